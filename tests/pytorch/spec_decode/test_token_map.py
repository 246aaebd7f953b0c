"""A reduced draft vocabulary (issue 20 item 1; spec_decode/token_map.py): the file's checks,
the reduced LM head against the full one (one process emulating TP ranks; the real gloo TP run
is test_token_map_ranks.py), what the memory plan charges, and greedy output with a map equal to
plain greedy output (embedded model, float64, chunked prefill), after asserting the drafts were
accepted and came from the map only.
"""
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, SpeculativeConfig, pipeline
from lmdeploy_lite.cli import main as cli
from lmdeploy_lite.pytorch.config import DistConfig, ModelConfig
from lmdeploy_lite.pytorch.distributed import DistContext
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.nn.embedding import ParallelLMHead
from lmdeploy_lite.pytorch.spec_decode.build import spec_plan
from lmdeploy_lite.pytorch.spec_decode.token_map import (ReducedLMHead, load_token_map,
                                                         rows_per_rank)
from tests.helpers import accepting, token_maps
from tests.helpers.token_maps import frequency_map, random_map, read_map, record_drafts

VOCAB = 4096                                     # the embedded model's
# the frequency map's floors on the mean accepted length at k=1..4, with margin below what it gives
# here (1.73, 2.21, 2.64, 2.85; the full vocabulary: 1.86, 2.46, 3.06, 3.4)
MIN_MEAN_ACCEPTED_LENGTH = {1: 1.5, 2: 1.9, 3: 2.3, 4: 2.5}


# ---- the file ---------------------------------------------------------------------------------

def test_json_and_safetensors_give_the_same_map(tmp_path):
    ids = [17, 0, 4095, 3, 250]
    (tmp_path / 'm.json').write_text(json.dumps(ids))
    save_file({'token_map': torch.tensor(ids)}, str(tmp_path / 'm.safetensors'))
    for name in ('m.json', 'm.safetensors'):
        got = load_token_map(str(tmp_path / name), VOCAB)
        assert got.dtype == torch.long and got.tolist() == ids


def _json(value):
    return lambda path: path.write_text(json.dumps(value))


def _tensors(**tensors):
    return lambda path: save_file(tensors, str(path))


BAD_FILES = [   # (file name, writer, what the message must say: the entry and what is allowed)
    ('missing.json', None, 'no such file'),
    ('broken.json', lambda p: p.write_text('[1, 2,'), 'cannot be read as JSON'),
    ('garbage.safetensors', lambda p: p.write_bytes(b'\x00\x01not a safetensors file'),
     'cannot be read as safetensors'),
    ('dict.json', _json({'ids': [1, 2]}), 'is a JSON dict, not a list'),
    ('empty.json', _json([]), 'is empty: a map needs at least one token id in 0..4095'),
    ('high.json', _json([5, 6, 4096]),
     'entry [2] = 4096 is outside the vocabulary: token ids must be ints in 0..4095'),
    ('negative.json', _json([-1]),
     'entry [0] = -1 is outside the vocabulary: token ids must be ints in 0..4095'),
    ('repeat.json', _json([5, 7, 9, 7]),
     'token id 7 appears twice, at entries [1] and [3]: each id may appear once'),
    ('string.json', _json([1, '2']), "entry [1] = '2' is a str: token ids must be ints in 0..4095"),
    ('bool.json', _json([1, 2, True]), 'entry [2] = True is a bool: token ids must be ints'),
    ('float.json', _json([1.0]), 'entry [0] = 1.0 is a float: token ids must be ints'),
    ('float.safetensors', _tensors(token_map=torch.tensor([1.0, 2.0])),
     "tensor 'token_map' is torch.float32: must be torch.int64"),
    ('int32.safetensors', _tensors(token_map=torch.tensor([1, 2], dtype=torch.int32)),
     "tensor 'token_map' is torch.int32: must be torch.int64"),
    ('other_name.safetensors', _tensors(ids=torch.tensor([1, 2])),
     "has no tensor 'token_map' (it has ['ids'])"),
    ('2d.safetensors', _tensors(token_map=torch.tensor([[1, 2], [3, 4]])),
     "tensor 'token_map' has shape (2, 2): must be 1-D"),
    ('empty.safetensors', _tensors(token_map=torch.zeros(0, dtype=torch.long)), 'is empty'),
    ('high.safetensors', _tensors(token_map=torch.tensor([3, 9999])),
     'entry [1] = 9999 is outside the vocabulary: token ids must be ints in 0..4095'),
    ('repeat.safetensors', _tensors(token_map=torch.tensor([4, 4])),
     'token id 4 appears twice, at entries [0] and [1]'),
]


def _bad_file(tmp_path, name, write) -> str:
    path = tmp_path / name
    if write is not None:
        write(path)
    return str(path)


@pytest.mark.parametrize('name, write, message', BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_a_bad_map_fails_engine_start_naming_file_and_entry(name, write, message, tmp_path):
    path = _bad_file(tmp_path, name, write)
    spec = SpeculativeConfig(num_speculative_tokens=2, draft_token_map=path)
    with pytest.raises(ValueError) as error:
        build_engine(accepting.model_dir(), PytorchEngineConfig(**accepting.BASE), spec, progress=False)
    assert f'SpeculativeConfig.draft_token_map={path!r}: ' in str(error.value)
    assert message in str(error.value)


@pytest.mark.parametrize('name, write, message', BAD_FILES[:1] + BAD_FILES[5:8],
                         ids=[b[0] for b in BAD_FILES[:1] + BAD_FILES[5:8]])
def test_a_bad_map_fails_the_cli_and_a_multi_rank_pipeline_before_any_rank(name, write, message,
                                                                          tmp_path, capsys):
    path = _bad_file(tmp_path, name, write)
    assert cli.main(['generate', accepting.model_dir(), '--prompt', '1 2', '--device', 'cpu',
                     '--speculative-num-draft-tokens', '2', '--speculative-token-map',
                     path]) == 2
    err = capsys.readouterr().err
    assert f'draft_token_map={path!r}' in err and message in err
    with pytest.raises(ValueError, match=r'draft_token_map=.*' + message[:20].replace('[', r'\[')):
        pipeline(accepting.model_dir(), PytorchEngineConfig(dp=2, ep=2, **accepting.BASE),
                 SpeculativeConfig(draft_token_map=path), progress=False)


# ---- the reduced head against the full one ----------------------------------------------------

def _integer_head(vocab: int, hidden: int, tp: int, rank: int, seed: int = 0) -> ParallelLMHead:
    """Rank `rank`'s shard of an LM head with small integer weights: any summation order gives
    exactly the same logits, so equality below is exact whatever shapes BLAS is handed."""
    full = torch.randint(-8, 9, (vocab, hidden), generator=torch.Generator().manual_seed(seed))
    head = ParallelLMHead(vocab, hidden, torch.float64, 'cpu',
                          DistContext(DistConfig(tp=tp), rank) if tp > 1 else None)
    shard = head.weight.shape[0]
    rows = full[rank * shard:(rank + 1) * shard].double()
    with torch.no_grad():
        head.weight.zero_()
        head.weight[:rows.shape[0]] = rows
    return head


class _EmulatedTP:
    """One process standing in for all `tp` ranks' all-gather: rank r's local logits are
    F.linear(hidden, heads[r].weight) (what ReducedLMHead computes before gathering)."""

    def __init__(self, reduced_heads: list):
        self.heads, self.tp = reduced_heads, self          # dist_ctx.tp.all_gather

    def all_gather(self, local):
        return torch.stack([F.linear(self.hidden, h.weight) for h in self.heads])


@pytest.mark.parametrize('tp', [1, 2, 3, 4])
@pytest.mark.parametrize('pick', ['random', 'one_shard', 'single', 'whole_vocab_permuted'])
def test_reduced_head_gives_the_full_heads_logits_at_the_map_ids(tp, pick):
    vocab, hidden = 103, 16                           # 103: the last shard is short under tp 2..4
    gen = torch.Generator().manual_seed(tp)
    token_map = {'random': torch.randperm(vocab, generator=gen)[:40],
                 'one_shard': torch.tensor([30, 2, 17, 5]),           # all in rank 0's shard
                 'single': torch.tensor([102]),
                 'whole_vocab_permuted': torch.randperm(vocab, generator=gen)}[pick]
    heads = [_integer_head(vocab, hidden, tp, r) for r in range(tp)]
    reduced = [ReducedLMHead(h, token_map, torch.float64) for h in heads]
    rows = rows_per_rank(token_map, vocab, tp)
    hidden_states = torch.randint(-8, 9, (5, hidden), generator=gen).double()
    full = torch.cat([F.linear(hidden_states, h.weight) for h in heads], 1)[:, :vocab]
    emulated = _EmulatedTP(reduced)
    emulated.hidden = hidden_states
    for rank, head in enumerate(reduced):
        assert head.weight.shape == (rows, hidden)             # no rank holds the full head
        assert rows <= -(-vocab // tp)
        if tp > 1:
            head.dist_ctx = emulated
        got = head(hidden_states)
        assert got.dtype == torch.float64 and torch.equal(got, full[:, token_map]), (tp, rank)


def test_tied_embeddings(tmp_path):
    """A tied target (lm_head.weight is embed_tokens.weight; the 0.8B's layout) on dummy weights:
    the reduced head's rows are a copy of the map's embedding rows, taken at build time, and
    greedy output with the map equals plain greedy output."""
    from benchmarks.presets import preset_config
    config = dict(preset_config('tiny'), tie_word_embeddings=True)
    (tmp_path / 'config.json').write_text(json.dumps(config))
    ids = [9, 400, 3, 77, 1, 0, 256, 511, 128]
    (tmp_path / 'map.json').write_text(json.dumps(ids))
    cfg = PytorchEngineConfig(dtype='float64', device='cpu', block_size=4, session_len=64,
                              load_format='dummy')
    prompts = [[5, 6, 7, 8, 9], [300, 301, 2]]
    gen = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    plain = build_engine(str(tmp_path), cfg, progress=False).generate(prompts, gen)
    engine = build_engine(str(tmp_path), cfg, token_maps.spec(2, str(tmp_path / 'map.json')),
                    progress=False)
    target = engine.agent.target.model
    assert target.lm_head.weight is target.model.embed_tokens.weight
    head = engine.agent.proposer.compute_logits
    assert torch.equal(head.weight, target.model.embed_tokens.weight[torch.tensor(ids)])
    assert head.weight.data_ptr() != target.lm_head.weight.data_ptr()     # a copy
    calls = record_drafts(engine)
    got = engine.generate(prompts, gen)
    assert [s.generated_ids for s in got] == [s.generated_ids for s in plain]
    assert calls and set(torch.cat([d.flatten() for d, _ in calls]).tolist()) <= set(ids)


# ---- the memory plan and the start-up allocations ---------------------------------------------

def test_plan_charges_the_map_and_the_agent_allocates_it():
    k, path = 3, frequency_map()
    model = ModelConfig.from_pretrained(accepting.model_dir())
    token_map = load_token_map(path, model.vocab_size)
    size = len(token_map)
    for tp in (1, 2):
        target = DistConfig(tp=tp)
        full = spec_plan(SpeculativeConfig(num_speculative_tokens=k), model, torch.float32,
                         target)
        reduced = spec_plan(token_maps.spec(k, path), model, torch.float32, target)
        assert reduced.draft_probs_bytes_per_slot == k * size * 4
        assert full.draft_probs_bytes_per_slot == k * model.vocab_size * 4
        rows = rows_per_rank(token_map, model.vocab_size, tp)
        assert reduced.draft.weight_bytes - full.draft.weight_bytes == rows * model.hidden_size * 4
        assert rows == (size if tp == 1 else max(int((token_map < 2048).sum()),
                                                 int((token_map >= 2048).sum())))
    engine = build_engine(accepting.model_dir(), PytorchEngineConfig(max_batch_size=4, **accepting.BASE),
                    token_maps.spec(k, path), progress=False)
    assert engine.agent.draft_probs.shape == (engine.cache_config.num_state_slots, k, size)
    assert engine.spec_plan.draft_probs_bytes_per_slot == k * size * 8        # float64
    assert engine.agent.proposer.compute_logits.weight.shape == (size, model.hidden_size)


# ---- whole runs ----------------------------------------------------------------------------------

def _run(k: int, path: str, gen=accepting.GREEDY, **engine_cfg):
    """prompts() in one batch (max_batch_size their number, as accepting.reference's)."""
    engine = build_engine(accepting.model_dir(), PytorchEngineConfig(**{
        **accepting.BASE, 'max_batch_size': len(accepting.prompts()), **engine_cfg}),
        token_maps.spec(k, path), progress=False)
    calls = record_drafts(engine)
    seqs = engine.generate([list(p) for p in accepting.prompts()], gen)
    drafts = torch.cat([d.flatten() for d, _ in calls])
    return [s.generated_ids for s in seqs], engine.spec_stats, drafts, calls


# the random map (512 ids) at k = 3 and 4 is not a case of its own: its drafts are accepted at
# position 0 only (per position [8, 0, 0] and [8, 0, 0, 0]: deterministic, float64 greedy), so
# it runs random-2's paths (k map drafts per step, every one after the first rejected), and the
# frequency map runs k = 3 and 4 with drafts accepted at every position
CASES = [('frequency', k) for k in (1, 2, 3, 4)] + [('random', k) for k in (1, 2)]


@pytest.mark.parametrize('which, k', CASES, ids=[f'{w}-{k}' for w, k in CASES])
def test_greedy_with_a_map_equals_plain_greedy_with_chunked_prefill(which, k):
    """max_prefill_token_num=4: the 3-10 token prompts prefill in chunks, and a chunk's end is
    drafted from (then discarded) as well as the final one's."""
    path = frequency_map() if which == 'frequency' else random_map(512)
    got, stats, drafts, _ = _run(k, path, max_prefill_token_num=4)
    # the map was used: every draft is one of its ids, and some were accepted
    assert set(drafts.tolist()) <= set(read_map(path))
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    if which == 'frequency':        # a frequency map keeps most of the full vocabulary's drafts
        accepting.assert_real_acceptance(stats, min(k, 3))
        assert stats.mean_accepted_length >= MIN_MEAN_ACCEPTED_LENGTH[k], stats
    assert got == accepting.reference(0).token_ids


def test_sampled_drafts_come_from_q_over_the_map():
    """Sampled rows: q is [B, k, M], a distribution over the map's ids, and each draft is the
    map id of an index q gives mass (the distribution itself: test_rejection_sampler.py)."""
    path, k = random_map(512), 2
    token_map = torch.tensor(read_map(path))
    gen = GenerationConfig(max_new_tokens=16, ignore_eos=True, do_sample=True, temperature=1.5,
                           random_seed=3)
    _, stats, _, calls = _run(k, path, gen)
    assert stats.num_drafts > 0
    for drafts, q in calls:
        assert q.shape == (drafts.shape[0], k, len(token_map))
        torch.testing.assert_close(q.sum(-1), torch.ones_like(q[..., 0]))
        index = (token_map == drafts[..., None]).long().argmax(-1)
        assert torch.equal(token_map[index], drafts)
        assert bool((q.gather(-1, index[..., None]) > 0).all())
