"""Speculative decoding through the whole engine on tiny random checkpoints with random mtp.*.

Greedy speculative output must equal greedy plain output exactly (float64); sampling must keep
the target distribution; rollback must leave exactly the caches a fresh prefill would build.
"""
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.engine.build import build_engine
from tests.helpers.reference import hf_generate

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 49)), [300, 301, 2, 450, 3, 3, 3, 17]]
NEW = 40
GREEDY = GenerationConfig(max_new_tokens=NEW, ignore_eos=True)


def make_engine(path, spec=None, **kw):
    cfg = dict(dtype='float64', device='cpu', block_size=4, session_len=160)
    cfg.update(kw)
    return build_engine(path, PytorchEngineConfig(**cfg), spec, progress=False)


def mtp(k):
    """Fixed k: the tests here check per-step draft counts (test_dynamic_k.py: dynamic k)."""
    return SpeculativeConfig(method='qwen3_5_mtp', num_speculative_tokens=k, dynamic=False)


@pytest.fixture(scope='module')
def plain(tiny_ckpt):
    cache = {}

    def get(moe, prompts=tuple(map(tuple, PROMPTS)), new=NEW):
        key = (moe, prompts, new)
        if key not in cache:
            engine = make_engine(tiny_ckpt(moe, layout='multimodal'))
            cfg = GenerationConfig(max_new_tokens=new, ignore_eos=True)
            cache[key] = [s.generated_ids for s in engine.generate([list(p) for p in prompts], cfg)]
        return cache[key]
    return get


@pytest.mark.parametrize('moe', [False, True])
@pytest.mark.parametrize('k', [1, 2, 3, 5])
def test_greedy_mtp_equals_plain_with_chunked_prefill(moe, k, tiny_ckpt, plain):
    engine = make_engine(tiny_ckpt(moe, layout='multimodal'), mtp(k), max_prefill_token_num=7)
    got = [s.generated_ids for s in engine.generate(PROMPTS, GREEDY)]
    assert got == plain(moe)
    stats = engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens == k * stats.num_drafts


@pytest.mark.parametrize('moe', [False, True])
def test_greedy_mtp_equals_transformers_and_survives_preemption(moe, tiny_ckpt, plain):
    k = 3
    engine = make_engine(tiny_ckpt(moe, layout='plain'), mtp(k), num_gpu_blocks=36,
                         session_len=96)
    seqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    preempted = 0
    while engine.has_work:
        before = [s.num_computed for s in seqs]
        engine.step()
        preempted += sum(s.num_computed < b for s, b in zip(seqs, before))
    assert preempted > 0
    assert [s.generated_ids for s in seqs] == plain(moe)
    assert seqs[0].generated_ids == hf_generate(moe, tuple(PROMPTS[0]), NEW)
    assert engine.scheduler.bm.num_free_blocks == engine.scheduler.bm.num_usable_blocks


class OracleProposer:
    """Test-only host proposer: the target's own greedy continuation (`correct` drafts), then
    deliberately wrong tokens."""

    def __init__(self, continuations: dict, k: int, correct: int, vocab: int = 512):
        self.continuations, self.k, self.correct, self.vocab = continuations, k, correct, vocab

    def propose(self, token_ids):
        for prompt, cont in self.continuations.items():
            if tuple(token_ids[:len(prompt)]) == prompt:
                full = list(prompt) + cont
                nxt = full[len(token_ids):len(token_ids) + self.k]
                return [t if i < self.correct else (t + 1) % self.vocab
                        for i, t in enumerate(nxt)]
        raise AssertionError('unknown prompt')


def oracle_engine(path, k, correct, continuations, **kw):
    engine = make_engine(path, SpeculativeConfig(method='ngram', num_speculative_tokens=k,
                                                 dynamic=False), **kw)
    engine.strategy.host_proposer = OracleProposer(continuations, k, correct)
    return engine


@pytest.mark.parametrize('k', [1, 3])
def test_bookkeeping_perfect_and_wrong_proposer(k, tiny_ckpt, plain):
    path = tiny_ckpt(False, layout='multimodal')
    long_ref = plain(False, new=NEW + 8)
    continuations = {tuple(p): r for p, r in zip(PROMPTS, long_ref)}
    perfect = oracle_engine(path, k, k, continuations)
    seqs = perfect.generate(PROMPTS, GREEDY)
    assert [s.generated_ids for s in seqs] == plain(False)
    assert perfect.spec_stats.acceptance_rate == 1.0
    assert perfect.spec_stats.mean_accepted_length == k + 1
    for s in seqs:
        assert s.spec_stats.mean_accepted_length == k + 1
        assert s.spec_stats.accepted_per_position == [s.spec_stats.num_drafts] * k
    wrong = oracle_engine(path, k, 0, continuations)
    assert [s.generated_ids for s in wrong.generate(PROMPTS, GREEDY)] == plain(False)
    assert wrong.spec_stats.mean_accepted_length == 1.0


def _target_state(engine, seq):
    """(KV of every full-attention layer for positions < num_computed, current linear states)."""
    agent = engine.agent.target
    slot, n = seq.state_slot, seq.num_computed
    index = int(agent.state_index[slot])
    bs = engine.cache_config.block_size
    pos = torch.arange(n)
    blocks = torch.tensor(seq.blocks)[pos // bs]
    out = []
    for layer_type, (a, b) in zip(engine.model_config.layer_types, agent.caches.caches):
        if layer_type == 'full_attention':
            out += [a[blocks, pos % bs], b[blocks, pos % bs]]
        else:
            kernel = engine.model_config.linear_conv_kernel_dim
            out += [a[slot, :, index:index + kernel - 1], b[slot, index]]
    mtp_k, mtp_v = engine.agent.proposer.caches[0]
    out += [mtp_k[blocks, pos % bs], mtp_v[blocks, pos % bs]]
    return out


@pytest.mark.parametrize('moe', [False, True])
def test_rollback_leaves_exactly_the_state_of_a_fresh_prefill(moe, tiny_ckpt, plain):
    """After a verify step accepting j of k drafts, the caches the next step reads equal those a
    fresh prefill of exactly the accepted tokens builds, for every j in 0..k."""
    k = 3
    path = tiny_ckpt(moe, layout='multimodal')
    prompt = PROMPTS[0]
    ref = plain(moe)[0]
    for j in range(k + 1):      # (no prefix cache: it would end a chunk at the last full block)
        engine = make_engine(path, mtp(k), enable_prefix_caching=False)
        seq = engine.add_request(prompt, GenerationConfig(max_new_tokens=20, ignore_eos=True))
        engine.step()                                                # prefill: emits ref[0]
        slot = seq.state_slot
        drafts = torch.tensor(ref[1:1 + k])
        drafts[j:] = (drafts[j:] + 1) % 512                           # exactly j correct drafts
        engine.agent.drafts[slot] = drafts
        engine.step()
        assert seq.spec_stats.num_accepted_tokens == j
        assert seq.generated_ids == ref[:j + 2]
        fresh = make_engine(path, mtp(k), enable_prefix_caching=False)
        fresh_seq = fresh.add_request(prompt + ref[:j + 1], GenerationConfig(max_new_tokens=20,
                                                                            ignore_eos=True))
        fresh.step()
        assert fresh_seq.num_computed == seq.num_computed
        assert fresh_seq.generated_ids == [ref[j + 1]]
        for got, want in zip(_target_state(engine, seq), _target_state(fresh, fresh_seq)):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_stops_inside_an_accepted_run_end_where_plain_output_ends(tiny_ckpt, plain):
    path = tiny_ckpt(False, layout='multimodal')
    ref = plain(False)[2]
    k = 3
    continuations = {tuple(PROMPTS[2]): plain(False, new=NEW + 8)[2]}
    for cfg in (GenerationConfig(max_new_tokens=NEW, stop_token_ids=[ref[9]]),
                GenerationConfig(max_new_tokens=9, ignore_eos=True)):
        base = make_engine(path).generate([PROMPTS[2]], cfg)[0]
        engine = oracle_engine(path, k, k, continuations)
        got = engine.generate([PROMPTS[2]], cfg)[0]
        assert got.generated_ids == base.generated_ids and got.finish_reason == base.finish_reason
        assert engine.spec_stats.mean_accepted_length == k + 1      # stops fell inside runs


def test_stop_words_inside_an_accepted_run(tiny_ckpt, plain):
    class SpaceTokenizer:
        def decode(self, ids, **kw):
            return ''.join(f' {i}' for i in ids)
    path = tiny_ckpt(False, layout='multimodal')
    ref = plain(False)[2]
    word = f' {ref[6]} {ref[7]}'
    cfg = GenerationConfig(max_new_tokens=NEW, stop_words=[word])
    base = build_engine(path, PytorchEngineConfig(dtype='float64', device='cpu', block_size=4,
                                            session_len=160), tokenizer=SpaceTokenizer(),
                  progress=False).generate([PROMPTS[2]], cfg)[0]
    spec = build_engine(path, PytorchEngineConfig(dtype='float64', device='cpu', block_size=4,
                                            session_len=160), mtp(3), tokenizer=SpaceTokenizer(),
                  progress=False).generate([PROMPTS[2]], cfg)[0]
    first = next(i for i in range(len(ref)) if word in SpaceTokenizer().decode(ref[:i + 1]))
    assert base.generated_ids == ref[:first + 1] and base.finish_reason == 'stop'
    assert spec.generated_ids == base.generated_ids and spec.finish_reason == 'stop'


def _target_probs(path, token_lists, gen_kw):
    """The plain target's sampling distribution after every prefix, from one float64 prefill:
    for each list of n tokens, probs [n, V] float64 with row i = p(. | tokens[:i + 1])."""
    from lmdeploy_lite.pytorch.sampling import SamplingInputs, probs_from_logits
    total = sum(map(len, token_lists))
    ref = make_engine(path, max_batch_size=len(token_lists), max_prefill_token_num=total,
                      session_len=max(map(len, token_lists)) + 1,
                      enable_prefix_caching=False)       # no chunk ends at snapshot points
    for tokens in token_lists:
        ref.add_request(tokens, GenerationConfig(max_new_tokens=1, ignore_eos=True))
    batch = ref.scheduler.schedule()
    inputs = ref.strategy.make_model_inputs(batch, ref.device)
    assert inputs.input_ids.numel() == total                         # one batch, every token
    with torch.inference_mode():
        logits = ref.agent.model.compute_logits(ref.agent.forward(inputs))
    probs = probs_from_logits(logits, SamplingInputs.from_values(
        [True] * total, [gen_kw.get('temperature', 1.0)] * total, [gen_kw.get('top_k', 0)] * total,
        [gen_kw.get('top_p', 1.0)] * total))
    return list(probs.split([len(t) for t in token_lists]))


def _assert_follows(probs, tokens, what, min_count):
    """Tokens [M], each claimed to follow its own distribution probs [M, V] (float64) given
    everything before it (as generated tokens do): two tests, each to pass at p-value > 0.001.
    * Randomised probability integral transform, tokens ranked by descending p (ties: lower id
      first): u = P(ranked before x) + U * p(x), U ~ U[0, 1), is then i.i.d. U[0, 1) for all
      tokens (Rosenblatt); chi-squared on 10 equal bins (df = 9).
    * Log-score: sum(log p(x) - E_p[log p]) / sqrt(sum Var_p[log p]) ~ N(0, 1) (a martingale
      CLT): the score test against p ** (1 / t) renormalised, so the most powerful check that
      no temperature is applied twice, or not at all, or to only one of p and q.
    Also: no token with p = 0, and at least min_count tokens."""
    p_x = probs.gather(-1, tokens[:, None])
    assert (p_x > 0).all(), f'{what}: a token its distribution gives probability 0'
    assert len(tokens) >= min_count, (what, len(tokens))
    ids = torch.arange(probs.size(-1))
    before = (probs > p_x) | ((probs == p_x) & (ids < tokens[:, None]))
    u = (probs * before).sum(-1) + torch.rand(len(tokens), generator=torch.Generator().manual_seed(0),
                                              dtype=probs.dtype) * p_x[:, 0]
    counts = torch.bincount((u * 10).long().clamp(max=9), minlength=10).numpy()
    assert chisquare(counts).pvalue > 0.001, (what, 'PIT', chisquare(counts).pvalue, counts)
    log_p = probs.clamp(min=1e-300).log() * (probs > 0)
    mean = (probs * log_p).sum(-1)
    var = (probs * log_p ** 2).sum(-1) - mean ** 2
    z = float((p_x[:, 0].log() - mean).sum() / var.sum().sqrt())
    assert abs(z) < 3.29, (what, 'log-score z', z)                  # two-sided p = 0.001


@pytest.mark.parametrize('gen_kw', [dict(temperature=1.0), dict(temperature=0.7, top_k=8, top_p=0.9)])
def test_sampled_speculation_keeps_the_target_distribution(gen_kw, tiny_ckpt):
    """Sampled MTP speculation through the whole engine (k=2, 128 sequences x 40 tokens, so
    ~40 verify steps with rollback in between) emits every token from the plain target's
    p(. | everything before it), and drafts every token from the q that verify is given.
    Checked with `_assert_follows` against a float64 target forward over the final sequences:
    all verify-emitted tokens together (4,992), and each verify output position 0, 1, 2 (an
    accepted draft, a correction, or the bonus) on its own (>= 50 asserted; 664 and 103 at
    position 2); every draft against its recorded q (~5,800 / ~10,500). The rejection sampler
    alone, at 50,000 rows per case: test_rejection_sampler.py::test_emitted_tokens_follow_target.

    Power: each check at p-value > 0.001; the chi-squared (df = 9) catches with power 0.9 a
    deviation of Cohen's w >= 0.083 at 4,992 tokens (0.06 at 10,000, 0.11 at 3,000). Injected
    bugs it finds (p-value): q of the other draft position (~0), q at another temperature than
    the drafts' (1e-35), the bonus from the last draft's position (1e-14), resampling from p
    instead of norm(max(p - q, 0)) after a rejection (1e-25; log-score z = -4.9 for gen_kw1).
    The test it replaces (20,000 sequences, the second token's marginal) took ~35 s each."""
    vocab, k, num_seqs, new = 24, 2, 128, 40
    path = tiny_ckpt(True, layout='plain', vocab_size=vocab, seed=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, vocab, rng.integers(2, 6)).tolist() for _ in range(num_seqs)]
    engine = make_engine(path, mtp(k), dtype='float32', max_batch_size=num_seqs, session_len=64)
    verify_calls, sampler = [], engine.agent.rejection_sampler      # (drafts [B, k], q [B, k, V])

    def recording_sampler(logits, drafts, draft_probs, *args):
        verify_calls.append((drafts.clone(), draft_probs.double()))
        return sampler(logits, drafts, draft_probs, *args)
    engine.agent.rejection_sampler = recording_sampler
    cfg = GenerationConfig(max_new_tokens=new, do_sample=True, ignore_eos=True, **gen_kw)
    seqs = [engine.add_request(p, cfg) for p in prompts]
    step_position = {s.seq_id: [] for s in seqs}        # per generated token: its index in its
    while engine.has_work:                              # verify step's output, -1 for prefill
        for out in engine.step():
            positions = step_position[out.seq.seq_id]
            positions += range(len(out.new_token_ids)) if positions else [-1] * len(out.new_token_ids)
    assert all(s.num_generated == new for s in seqs)
    assert engine.spec_stats.num_accepted_tokens >= 0.05 * engine.spec_stats.num_draft_tokens

    drafts = torch.cat([d.flatten() for d, _ in verify_calls])
    draft_probs = torch.cat([q.flatten(0, 1) for _, q in verify_calls])
    _assert_follows(draft_probs, drafts, 'drafts under q', 3000)
    probs = _target_probs(path, [s.token_ids[:-1] for s in seqs], gen_kw)
    probs = torch.cat([p[s.num_prompt - 1:] for p, s in zip(probs, seqs)])       # [tokens, V]
    tokens = torch.tensor([t for s in seqs for t in s.generated_ids])
    positions = torch.tensor([j for s in seqs for j in step_position[s.seq_id]])
    _assert_follows(probs[positions >= 0], tokens[positions >= 0], 'verify tokens', 4000)
    for j in range(k + 1):
        _assert_follows(probs[positions == j], tokens[positions == j], f'position {j}', 50)


@pytest.mark.parametrize('make, match', [
    (lambda: SpeculativeConfig(method='eagle'), "method='eagle'"),
    (lambda: SpeculativeConfig(num_speculative_tokens=0), 'num_speculative_tokens=0'),
    (lambda: SpeculativeConfig(num_speculative_tokens=9), 'num_speculative_tokens=9'),
])
def test_bad_speculative_config(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_mtp_on_a_checkpoint_without_mtp_tensors(tiny_ckpt):
    with pytest.raises(ValueError, match='no mtp.'):
        make_engine(tiny_ckpt(False, layout='plain', with_mtp=False), mtp(2))
