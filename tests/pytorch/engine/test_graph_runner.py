"""GraphRunner's static buffers and batch padding, on CPU (static-buffer mode: the same copies
and padding as with CUDA graphs, the forward run eagerly). CUDA graphs themselves: tests/gpu.
The model is the embedded one (tests/helpers/accepting), float64: its MTP head's drafts are mostly
accepted (asserted first), so the verify and draft graphs replay with every accepted length."""
import pytest

from lmdeploy_lite.api import EMBEDDED_MODEL_DIR
from lmdeploy_lite.messages import PytorchEngineConfig
from lmdeploy_lite.pytorch.backends.cuda.graph_runner import batch_buckets
from lmdeploy_lite.pytorch.engine.build import build_engine
from tests.helpers import accepting
from tests.helpers.accepting import GREEDY, SHORT, assert_real_acceptance, counts, reference


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(64)[-3:] == [32, 48, 64]


def _generate_with_graphs(k: int, padded: int = 0, whole: bool = True):
    """(token ids, SpecDecodeStats or None) per prompt, decode steps through static buffers for
    batch buckets 2, 4, 8; `padded`: every step padded as if another DP rank's batch were that
    big; `whole`: a greedy step of k > 0 in one runner (SpecAgent.step_graphs), else through
    the verify forward's and the proposer's runners. accepting.SHORT's 16 new tokens."""
    engine = build_engine(EMBEDDED_MODEL_DIR, PytorchEngineConfig(**accepting.BASE), accepting.spec(k),
                    progress=False)
    engine.agent.enable_graphs([2, 4, 8], max_blocks=16)
    if padded:
        step = engine.agent.step

        def padded_step(inputs, sampling):
            inputs.padded_batch_size = padded
            return step(inputs, sampling)
        engine.agent.step = padded_step
    seqs = engine.generate([list(p) for p in accepting.prompts()], SHORT)
    if k and whole:
        assert engine.agent.step_graphs[k].num_replays > 0
        assert engine.agent.target.graph.num_replays == 0
        return [s.generated_ids for s in seqs], [s.spec_stats for s in seqs]
    agent = engine.agent if k == 0 else engine.agent.target
    assert agent.graph.num_replays > 0
    if k:      # the MTP layer over the verify step (k + 1 tokens), then the greedy draft chain
        proposer = engine.agent.proposer
        replays = {q_len: r.num_replays for q_len, r in proposer.graphs.items()}
        assert replays[k + 1] > 0 and proposer.chain_graphs[k].num_replays > 0, replays
    return [s.generated_ids for s in seqs], [s.spec_stats if k else None for s in seqs]


@pytest.mark.parametrize('padded', [0, 7], ids=['unpadded', 'padded'])
@pytest.mark.parametrize('k', [0, 1, 3])
def test_static_buffers_give_the_eager_and_plain_greedy_tokens(k, padded):
    """Whole sequences equal the eager engine's (accepting.reference) and plain greedy's, and
    per-request draft counts, positions included, equal the eager engine's."""
    tokens, stats = _generate_with_graphs(k, padded)
    if k:
        assert_real_acceptance(stats, k)
    assert tokens == reference(k, gen=SHORT).token_ids == reference(0, gen=SHORT).token_ids
    assert [counts(s) for s in stats] == reference(k, gen=SHORT).counts


def test_a_swapped_verification_rule_is_captured_again():
    """The whole-step runners hold the rule they were captured with: setting
    `rejection_sampler` (a benchmark's synthetic acceptance) captures them anew, and their
    steps then verify with it."""
    engine = build_engine(EMBEDDED_MODEL_DIR, PytorchEngineConfig(**accepting.BASE),
                          accepting.spec(3), progress=False)
    engine.agent.enable_graphs([2, 4, 8], max_blocks=16)
    before, calls, sampler = engine.agent.step_graphs[3], [], engine.agent.rejection_sampler

    def recording(*args, **kwargs):
        calls.append(args[1].shape)               # drafts [B, k]
        return sampler(*args, **kwargs)
    engine.agent.rejection_sampler = recording
    runner = engine.agent.step_graphs[3]
    assert runner is not before and runner.num_replays == 0
    seqs = engine.generate([list(p) for p in accepting.prompts()], SHORT)
    assert_real_acceptance([s.spec_stats for s in seqs], 3)
    assert [s.generated_ids for s in seqs] == reference(0, gen=SHORT).token_ids
    assert runner.num_replays > 0 and len(calls) >= runner.num_replays


def test_static_buffers_of_the_verify_and_draft_runners(monkeypatch):
    """The same through the verify forward's and the proposer's runners (what a sampled batch
    replays), the whole-step runner off, every step padded."""
    monkeypatch.setattr('lmdeploy_lite.pytorch.spec_decode.spec_agent.STEP_GRAPH_MAX_BATCH', 0)
    tokens, stats = _generate_with_graphs(3, 7, whole=False)
    assert_real_acceptance(stats, 3)
    assert tokens == reference(3, gen=SHORT).token_ids == reference(0, gen=SHORT).token_ids
    assert [counts(s) for s in stats] == reference(3, gen=SHORT).counts


@pytest.mark.parametrize('whole', [True, False], ids=['whole', 'parts'])
def test_static_buffers_with_a_draft_count_per_step(monkeypatch, whole):
    """Dynamic k (the cycle: every switch, plain steps included): a runner per verify width, per
    greedy draft chain and the KV-only pass of a plain step (`parts`), or a whole-step runner
    per k (`whole`), each replayed; whole sequences equal plain greedy."""
    accepting.cycle_draft_counts(monkeypatch)
    if not whole:
        monkeypatch.setattr('lmdeploy_lite.pytorch.spec_decode.spec_agent.STEP_GRAPH_MAX_BATCH', 0)
    engine = build_engine(EMBEDDED_MODEL_DIR, PytorchEngineConfig(**accepting.BASE),
                    accepting.spec(3, dynamic=True), progress=False)
    engine.agent.enable_graphs([2, 4, 8], max_blocks=16)
    seqs = engine.generate([list(p) for p in accepting.prompts()], GREEDY)
    accepting.assert_dynamic_acceptance([s.spec_stats for s in seqs], 3, positions=3)
    assert [s.generated_ids for s in seqs] == reference(0).token_ids
    proposer, target = engine.agent.proposer, engine.agent.target
    assert engine.agent.plain_graph.num_replays > 0       # greedy plain steps: one replay
    if whole:
        assert all(engine.agent.step_graphs[k].num_replays > 0 for k in (1, 2, 3))
        return
    assert all(target.graphs[q].num_replays > 0 for q in (2, 3, 4)), target.graphs.keys()
    assert sorted(target.graphs) == [1, 2, 3, 4]
    assert all(proposer.chain_graphs[k].num_replays > 0 for k in (1, 2, 3))


def test_prefill_spare_sequences_fit_a_block_table():
    """A prefill bucket's spare tokens go to enough spare sequences that none takes more than a
    block table's width in tokens (`max_seq_tokens`), at capture (every token spare) and with
    the most real sequences the bucket takes (their kernels index the table by position: a
    2,048-token bucket over 4 + 1 sequences of a 256-token table read past it on a GPU)."""
    import torch

    from lmdeploy_lite.pytorch.backends.cuda.graph_runner import PrefillGraphRunner
    runner = PrefillGraphRunner(None, 'prefill', [64, 2048], max_seqs=4, max_q_len=128,
                                max_blocks=16, device=torch.device('cpu'), max_seq_tokens=256)
    assert runner.seqs == {64: [4 + 1], 2048: [4 + 8]}
    for bucket, tokens, batch in ((2048, 0, 0), (2048, 1030, 4), (2048, 3, 3), (64, 5, 4)):
        runner._pad(bucket, runner.seqs[bucket][0], tokens, batch)
        spare = runner.q_lens[batch:runner.seqs[bucket][0]]
        assert spare.sum() == bucket - tokens and spare.max() <= 256, (bucket, spare)


def test_prefill_buckets_of_fewer_sequences():
    """A bucket that would hold more than SMALL_BATCH sequences has a variant of SMALL_BATCH
    (+ spares), and a step replays the fewest sequences that hold its own and the spares its
    bucket's tokens may need (none over a block table): the smallest bucket of enough tokens
    first, as before."""
    import torch

    from lmdeploy_lite.pytorch.backends.cuda import graph_runner
    from lmdeploy_lite.pytorch.backends.cuda.graph_runner import PrefillGraphRunner
    runner = PrefillGraphRunner(None, 'prefill', [64, 256, 2048], max_seqs=256, max_q_len=128,
                                max_blocks=16, device=torch.device('cpu'), max_seq_tokens=256,
                                long_row_from=128)
    small = graph_runner.SMALL_BATCH
    assert runner.seqs == {64: [65], 256: [small + 1, 257], 2048: [small + 8, 256 + 8]}
    assert runner._keys() == [(64, 65, False), (256, small + 1, False), (256, small + 1, True),
                              (256, 257, False), (256, 257, True), (2048, small + 8, False),
                              (2048, small + 8, True), (2048, 264, False), (2048, 264, True)]

    class Step:
        is_decoding, graphable, host_lens, sizes, max_q_len = False, True, True, None, 1
        block_tables = torch.zeros(1, 16)

        def __init__(self, num_tokens, batch_size):
            self.num_tokens, self.batch_size = num_tokens, batch_size
    assert [runner.bucket_for(Step(t, b)) for t, b in ((40, 30, ), (200, 30), (200, 64),
                                                       (200, 65), (200, 100), (256, 256),
                                                       (300, 256), (300, 264))] == [
        (64, 65), (256, 65), (256, 65), (256, 257), (256, 257), (256, 257), (2048, 264),
        None]
    for bucket, sizes in runner.seqs.items():  # the most sequences each size takes, a token each:
        for seqs in sizes:                     # the spares hold the rest within a block table
            batch = seqs - runner.spares[bucket]
            runner._pad(bucket, seqs, batch, batch)
            spare = runner.q_lens[batch:seqs]
            assert spare.sum() == bucket - batch and spare.max() <= 256, (bucket, seqs, spare)
