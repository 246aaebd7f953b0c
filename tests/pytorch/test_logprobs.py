"""GenerationConfig(logprobs=N) through pipeline(), float64 on CPU: each generated token's
logprob and top-N are transformers' own log-softmax of the raw logits (within 1e-9, sampled rows
included: before temperature and top-k); under MTP k=3 (drafts accepted: asserted first) they
equal plain decoding's; streamed chunks join to the whole response's; a stop or length cut
inside an accepted run truncates them with the tokens; rows of one batch get their own N."""
import pytest
import torch

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, pipeline
from lmdeploy_lite.api import EMBEDDED_MODEL_DIR
from lmdeploy_lite.messages import TokenLogprobs
from lmdeploy_lite.pytorch.engine.build import build_engine
from tests.helpers import accepting
from tests.helpers.accepting import assert_real_acceptance, spec
from tests.helpers.reference import hf_log_softmax

TINY = dict(dtype='float64', device='cpu', block_size=4, session_len=64)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]
K = 3


@pytest.mark.parametrize('value', [21, -1, True, 2.0, '3'])
def test_logprobs_out_of_range_is_a_value_error_naming_it(value):
    with pytest.raises(ValueError, match=r'^logprobs=.*: must be None \(off\) or an integer in '
                                         r'0\.\.20'):
        GenerationConfig(logprobs=value)


def test_token_logprobs_is_the_dict_lmdeploy_returns():
    entry = TokenLogprobs(7, -2.5, {3: -0.1, 4: -0.9})
    assert entry == {3: -0.1, 4: -0.9, 7: -2.5}
    assert (entry.token_id, entry.logprob, entry.top_logprobs) == (7, -2.5, {3: -0.1, 4: -0.9})


def hf_reference(prompt: list[int], generated: list[int]) -> torch.Tensor:
    """[n, V] float64 log-softmax of transformers' logits at each generated token's position
    (the tiny dense model, seed 0: tiny_ckpt(False)'s weights; float64 throughout)."""
    return hf_log_softmax(False, prompt + generated)[len(prompt) - 1:-1]


def assert_match(entries: list[TokenLogprobs], token_ids: list[int], reference: torch.Tensor,
                 n: int, tol: float):
    """Each entry is the chosen token's and the top-n of the [len, V] log-softmax `reference`."""
    assert [e.token_id for e in entries] == token_ids and len(reference) == len(token_ids)
    for entry, token, row in zip(entries, token_ids, reference):
        assert entry.logprob == pytest.approx(row[token].item(), abs=tol, rel=0)
        values, ids = row.topk(n)
        assert list(entry.top_logprobs) == ids.tolist()
        assert list(entry.top_logprobs.values()) == pytest.approx(values.tolist(), abs=tol, rel=0)
        assert entry == {**entry.top_logprobs, token: entry.logprob}


def assert_close(got: list[TokenLogprobs], want: list[TokenLogprobs], tol: float = 1e-9):
    """The same tokens and top ids, the logprobs within `tol`."""
    assert [(e.token_id, list(e.top_logprobs)) for e in got] == \
        [(e.token_id, list(e.top_logprobs)) for e in want]
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=tol, rel=0)
    assert [v for e in got for v in e.top_logprobs.values()] == pytest.approx(
        [v for e in want for v in e.top_logprobs.values()], abs=tol, rel=0)


def test_float64_logprobs_are_transformers_log_softmax(tiny_ckpt):
    """Greedy, sampled (temperature 0.7, top-k 3, top-p 0.9: the logprobs stay the raw
    logits') and n=3 sampled choices (forked from one prefill: each its own), streamed and
    not."""
    greedy = GenerationConfig(max_new_tokens=8, ignore_eos=True, logprobs=5)
    sampled = GenerationConfig(max_new_tokens=8, ignore_eos=True, logprobs=5, do_sample=True,
                               temperature=0.7, top_k=3, top_p=0.9, random_seed=1)
    choices = GenerationConfig(max_new_tokens=8, ignore_eos=True, logprobs=5, do_sample=True,
                               temperature=1.5, random_seed=2, n=3)
    with pipeline(tiny_ckpt(False), PytorchEngineConfig(**TINY), progress=False) as pipe:
        for gen in (greedy, sampled, choices):
            responses = pipe(PROMPTS, gen)
            assert len(responses) == len(PROMPTS) * gen.n
            for r in responses:
                prompt = PROMPTS[r.index // gen.n]
                assert len(r.logprobs) == len(r.token_ids) == 8
                assert_match(r.logprobs, r.token_ids, hf_reference(prompt, r.token_ids), 5,
                             1e-9)
        assert len({tuple(r.token_ids) for r in responses}) > len(PROMPTS)   # choices differ
        streamed = [[] for _ in PROMPTS]
        for chunk in pipe.stream_infer(PROMPTS, greedy):
            assert len(chunk.logprobs) == len(chunk.token_ids)
            streamed[chunk.index] += chunk.logprobs
        # the same tokens and logprobs; float64 values within 1e-9, as against transformers: a
        # stream's prompts may be admitted over two steps under load, and a different batch
        # composition changes float64 GEMMs in the last bits
        batched = [r.logprobs for r in pipe(PROMPTS, greedy)]
        for mine, theirs in zip(streamed, batched, strict=True):
            assert [(e.token_id, list(e.top_logprobs)) for e in mine] == \
                [(e.token_id, list(e.top_logprobs)) for e in theirs]
            for a, b in zip(mine, theirs):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-9, rel=0)
                assert list(a.top_logprobs.values()) == pytest.approx(
                    list(b.top_logprobs.values()), abs=1e-9, rel=0)
        assert pipe(PROMPTS[0], GenerationConfig(max_new_tokens=2)).logprobs is None


def test_rows_of_one_batch_get_their_own_top_n(tiny_ckpt):
    engine = build_engine(tiny_ckpt(False), PytorchEngineConfig(**TINY), progress=False)
    asks = [None, 0, 3]
    seqs = [engine.add_request(PROMPTS[0], GenerationConfig(max_new_tokens=4, ignore_eos=True,
                                                            logprobs=n)) for n in asks]
    got = {s.seq_id: [] for s in seqs}
    while engine.has_work:
        for out in engine.step():
            got[out.seq.seq_id].append(out.logprobs)
    assert got[seqs[0].seq_id] == [None] * 4
    for seq, n in zip(seqs[1:], asks[1:]):
        entries = [e for step in got[seq.seq_id] for e in step]
        assert len(entries) == 4 and all(len(ids) == len(values) == n
                                         for _, ids, values in entries)
    # the same tokens and logprobs whatever N each row asked for; float64 values within 1e-12:
    # identical rows at different places of one batch may differ in the last bits of their GEMM
    # (MKL may split the rows among fewer threads when the machine is busy)
    assert seqs[1].generated_ids == seqs[2].generated_ids
    assert [e[0] for step in got[seqs[1].seq_id] for e in step] == pytest.approx(
        [e[0] for step in got[seqs[2].seq_id] for e in step], abs=1e-12, rel=0)


# accepting.SHORT's 16 new tokens: drafts accepted at every position (asserted), runs of
# accepted drafts to cut inside (found, asserted)
EMBEDDED_NEW = accepting.SHORT.max_new_tokens


@pytest.fixture(scope='module')
def embedded_runs():
    """The embedded model, float64, accepting.prompts() with logprobs=4: (plain Responses,
    MTP k=3 Responses, MTP k=3 streamed chunks per prompt, the MTP pipeline). EMBEDDED_NEW
    tokens each."""
    gen = GenerationConfig(max_new_tokens=EMBEDDED_NEW, ignore_eos=True, logprobs=4)
    prompts = [list(p) for p in accepting.prompts()]
    config = PytorchEngineConfig(**accepting.BASE)
    with pipeline(EMBEDDED_MODEL_DIR, config, progress=False) as pipe:
        plain = pipe(prompts, gen)
    pipe = pipeline(EMBEDDED_MODEL_DIR, config, spec(K), progress=False)
    try:
        mtp = pipe(prompts, gen)
        chunks = [[] for _ in prompts]
        for chunk in pipe.stream_infer(prompts, gen):
            chunks[chunk.index].append(chunk)
        yield plain, mtp, chunks, pipe
    finally:
        pipe.close()


def test_mtp_logprobs_equal_plain_decodings_in_float64(embedded_runs):
    plain, mtp, chunks, _ = embedded_runs
    assert_real_acceptance([r.spec_stats for r in mtp], K)
    assert [r.token_ids for r in mtp] == [r.token_ids for r in plain]
    for got, want in zip(mtp, plain):
        assert len(got.logprobs) == len(got.token_ids) == EMBEDDED_NEW
        assert_close(got.logprobs, want.logprobs)
    # streamed: one chunk per step (runs of accepted drafts among them), joined = the whole
    assert any(len(c.token_ids) > 1 for per_prompt in chunks for c in per_prompt)
    for per_prompt, whole in zip(chunks, mtp):
        assert all(len(c.logprobs) == len(c.token_ids) for c in per_prompt)
        assert_close([e for c in per_prompt for e in c.logprobs], whole.logprobs)


def test_a_stop_or_length_cut_inside_an_accepted_run_truncates_the_logprobs(embedded_runs):
    """A cut at a position strictly inside one step's run of tokens (the step emitted more)."""
    _, mtp, chunks, pipe = embedded_runs
    inside = []                 # (prompt, position): not the last token its step emitted
    for i, per_prompt in enumerate(chunks):
        start = 0
        for chunk in per_prompt:
            inside += [(i, start + j) for j in range(len(chunk.token_ids) - 1)]
            start += len(chunk.token_ids)
    i, position = next((i, p) for i, p in inside if p > 0)
    whole, prompt = mtp[i], list(accepting.prompts()[i])
    cut = pipe(prompt, GenerationConfig(max_new_tokens=position + 1, ignore_eos=True,
                                        logprobs=4))
    assert cut.finish_reason == 'length' and cut.token_ids == whole.token_ids[:position + 1]
    assert_close(cut.logprobs, whole.logprobs[:position + 1])
    i, stop_at = next((i, p) for i, p in inside if mtp[i].token_ids[p] not in
                      mtp[i].token_ids[:p])
    whole, prompt = mtp[i], list(accepting.prompts()[i])
    stopped = pipe(prompt, GenerationConfig(max_new_tokens=EMBEDDED_NEW, ignore_eos=True,
                                            logprobs=4,
                                            stop_token_ids=[whole.token_ids[stop_at]]))
    assert stopped.finish_reason == 'stop'
    assert stopped.token_ids == whole.token_ids[:stop_at + 1]
    assert_close(stopped.logprobs, whole.logprobs[:stop_at + 1])
