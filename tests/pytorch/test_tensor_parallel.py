"""Tensor parallelism of the target model and the MTP head, against one process (float64).

Each multi-process test runs one gloo process per rank (processes the layouts share, a fresh
process group each: RankPool); every rank builds its shard of the model with
`build_model(..., dist_ctx=ctx)`, allocates per-rank caches (`CacheEngine(..., tp=)`) and runs a prefill, 1-token decodes, a 3-token verify with partial acceptance and another decode,
for the target and the MTP head, with the collective trace check on (`begin_step`/`end_step`).
Every rank must return the single-process logits. Hard timeouts; the pool's processes must have
exited at the end of the module.
"""
from __future__ import annotations

import os
import queue
import re
import socket
import time
import traceback
from dataclasses import replace

import pytest
import torch

from lmdeploy_lite.messages import SpeculativeConfig
from lmdeploy_lite.pytorch.config import CacheConfig, DistConfig, ModelConfig
from lmdeploy_lite.pytorch.distributed import DistContext
from lmdeploy_lite.pytorch.engine.executor.mp import rank_context
from lmdeploy_lite.pytorch.cache_engine import CacheEngine
from lmdeploy_lite.pytorch.model_inputs import ForwardSizes
from lmdeploy_lite.pytorch.models.loader import build_model, load_mtp_weights, load_weights
from lmdeploy_lite.pytorch.models.qwen3_5 import Qwen3_5ForCausalLM
from lmdeploy_lite.pytorch.models.qwen3_5_mtp import Qwen3_5MTP
from lmdeploy_lite.pytorch.spec_decode.build import draft_dist_config
from tests.helpers.step_inputs import make_inputs, shuffled_block_tables
from tests.helpers.tiny_models import make_tiny_checkpoint

# enough heads for tp=4 (the default tiny model has 2 KV heads and 2 linear key heads)
WIDE = dict(num_key_value_heads=4, linear_num_key_heads=4, linear_num_value_heads=8)
BLOCK_SIZE, NUM_SPEC = 4, 2
# two sequences per DP rank, equal lengths on every DP rank (the same collective shapes); an
# odd prefill (13 tokens: sequence parallelism pads it to the plan's multiple of tp)
PROMPTS = {0: [[5, 6, 7, 8, 9, 10, 11], [300, 2, 450, 17, 3, 9]],
           1: [[20, 21, 22, 23, 24, 25, 26], [100, 101, 102, 103, 104, 105]]}
DECODES = [[40, 41], [42, 43]]              # 1-token decode steps (fixed, not sampled)
VERIFY, ACCEPTED = [[50, 51, 52], [53, 54, 55]], [2, 3]
LAST = [60, 61]


def run_steps(ctx: DistContext | None, path: str, prompts: list[list[int]],
              draft_tp: int | None = None) -> dict:
    """Target + MTP over prefill, decodes, a verify (partially accepted) and a decode; the MTP
    head at `draft_tp` (default: the target's tp; spec_decode/build.draft_dist_config).
    Returns {'target': [logits [T, V] per step], 'mtp': [...]} (float64, full vocab)."""
    tp = ctx.config.tp if ctx else 1
    model = build_model(path, torch.float64, 'cpu', progress=False, dist_ctx=ctx)
    config = model.config
    mtp_ctx = ctx
    if ctx and draft_tp:
        mtp_ctx = ctx.draft_context(draft_dist_config(SpeculativeConfig(tp=draft_tp), ctx.config))
    mtp = Qwen3_5MTP(config, torch.float64, 'cpu', model.embed_tokens, model.lm_head,
                     dist_ctx=mtp_ctx)
    load_mtp_weights(mtp, path, progress=False)
    mtp.eval()
    cache_config = CacheConfig(block_size=BLOCK_SIZE, num_blocks=24, num_state_slots=3,
                               num_spec_tokens=NUM_SPEC)
    caches = CacheEngine(config, cache_config, torch.float64, 'cpu', tp=tp)
    mtp_caches = CacheEngine(config, cache_config, torch.float64, 'cpu',
                             layer_types=('full_attention',), tp=mtp_ctx.config.tp if ctx else 1)
    tables = shuffled_block_tables(len(prompts), 5, seed=3)
    slots = [1, 2]
    steps = [(prompts, [0, 0], [0, 0], False)]
    history = [len(p) for p in prompts]
    for tokens in DECODES:
        steps.append(([[t] for t in tokens], list(history), [0, 0], True))
        history = [h + 1 for h in history]
    steps.append((VERIFY, list(history), [0, 0], True))
    history = [h + a for h, a in zip(history, ACCEPTED)]
    steps.append(([[t] for t in LAST], list(history), [a - 1 for a in ACCEPTED], True))

    out = {'target': [], 'mtp': []}
    with torch.inference_mode():
        for i, (chunks, history_lens, state_index, decoding) in enumerate(steps):
            inputs = make_inputs(chunks, history_lens, tables, slots, state_index, decoding)
            tokens, seqs = -(-inputs.num_tokens // tp) * tp, -(-inputs.batch_size // tp) * tp
            # DP ranks: equal counts; every step (decodes too) sequence-parallel where configured
            split = ctx is not None and ctx.config.sequence_parallel
            inputs.sizes = ForwardSizes(tokens, tokens, seqs, seqs, sequence_parallel=split)
            # the token after each position: the next input, and a fixed id at each chunk's end
            next_ids = torch.cat([torch.tensor(c[1:] + [7 + b]) for b, c in enumerate(chunks)])
            if ctx:
                ctx.begin_step(i)
            hidden = model(inputs, caches)
            out['target'].append(model.compute_logits(hidden))
            mtp_hidden = mtp(next_ids, hidden, inputs, mtp_caches)
            out['mtp'].append(mtp.compute_logits(mtp_hidden))
            if ctx:
                out.setdefault('ops', set()).update(op for op, *_ in ctx.trace)
                out.setdefault('op_groups', set()).update(e[:2] for e in ctx.trace)
                ctx.end_step()
    return out


def feed_unaligned(ctx: DistContext, path: str, prompts) -> dict:
    """A reduce-scatter of 3 rows on the TP group (not a multiple of tp): the check must raise
    before any collective runs (so no rank waits)."""
    ctx.begin_step(7)
    try:
        ctx.tp.reduce_scatter(torch.zeros(3, 4))
    except ValueError as e:
        return {'error': str(e), 'trace': list(ctx.trace)}
    return {'error': None}


def run_steps_draft_tp2(ctx: DistContext, path: str, prompts) -> dict:
    return run_steps(ctx, path, prompts, draft_tp=2)


TASKS = {'run_steps': run_steps, 'feed_unaligned': feed_unaligned,
         'run_steps_draft_tp2': run_steps_draft_tp2}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _pool_worker(inbox, outbox):
    """One pool process: runs rank tasks until it gets None. Each task is one rank of one
    layout in a fresh process group; the result goes to a file, (rank, error or None) home."""
    os.environ['LMDEPLOY_LITE_CHECK_COLLECTIVES'] = '1'
    os.environ['LMDEPLOY_LITE_DIST_TIMEOUT'] = '30'
    torch.set_num_threads(1)
    for rank, config, port, path, out_dir, task in iter(inbox.get, None):
        ctx, error = None, None
        try:
            ctx = DistContext.init(config, rank, f'tcp://127.0.0.1:{port}')
            result = TASKS[task](ctx, path, PROMPTS[ctx.dp_rank])
            torch.save(result, os.path.join(out_dir, f'rank{rank}.pt'))
        except BaseException:
            error = traceback.format_exc()
        finally:
            if ctx is not None:
                ctx.destroy()
        outbox.put((rank, error))


class RankPool:
    """Processes (gloo) that run the ranks of one layout after another, each layout in a fresh
    process group: a new process spends seconds importing torch, a layout's steps a tenth of
    one (so they come from the mp executor's fork server, which imported torch once, rather
    than being spawned). Process r runs rank r. A layout whose ranks raise leaves the pool
    usable; one that hangs or loses a process ends it (killed), and the next layout starts a
    new one."""

    def __init__(self):
        self.procs, self.inboxes, self.outbox = [], [], None

    def _grow(self, size: int):
        ctx = rank_context()
        if self.outbox is None:
            self.outbox = ctx.Queue()
        while len(self.procs) < size:
            inbox = ctx.Queue()
            proc = ctx.Process(target=_pool_worker, args=(inbox, self.outbox), daemon=True)
            proc.start()
            self.procs.append(proc)
            self.inboxes.append(inbox)

    def run(self, config: DistConfig, path: str, out_dir: str, timeout: float = 240,
            task: str = 'run_steps') -> list:
        """Every rank's `TASKS[task]` result for this layout (or an AssertionError naming the
        ranks that failed, with their tracebacks, or that did not finish within `timeout` s)."""
        world = config.world_size
        self._grow(world)
        port = _free_port()
        for rank in range(world):
            self.inboxes[rank].put((rank, config, port, path, out_dir, task))
        errors, finished, deadline = {}, set(), time.monotonic() + timeout
        while len(finished) < world:
            try:
                rank, error = self.outbox.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r in range(world) if not self.procs[r].is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close(kill=True)
                    late = sorted(set(range(world)) - finished)
                    errors['pool'] = (f'ranks {dead} died' if dead else
                                      f'ranks {late} did not finish within {timeout} s')
                    break
                continue
            finished.add(rank)
            if error is not None:
                errors[f'rank {rank}'] = error
        assert not errors, f'{config}:\n' + '\n'.join(f'{k}: {e}' for k, e in errors.items())
        return [torch.load(os.path.join(out_dir, f'rank{r}.pt')) for r in range(world)]

    def close(self, kill: bool = False):
        """End every process (asked first, unless `kill`); none outlives this call."""
        for inbox in self.inboxes:
            inbox.put(None)
        for proc in self.procs:
            if kill:
                proc.kill()
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        assert not any(p.is_alive() for p in self.procs)
        self.procs, self.inboxes, self.outbox = [], [], None


@pytest.fixture(scope='module')
def rank_pool():
    pool = RankPool()
    yield pool
    pool.close()


def assert_same_logits(got: dict, want: dict, what: str):
    for key in ('target', 'mtp'):
        assert len(got[key]) == len(want[key])
        for step, (g, w) in enumerate(zip(got[key], want[key])):
            assert g.shape == w.shape and g.dtype == torch.float64, (what, key, step)
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10,
                                       msg=lambda m: f'{what}, {key} logits, step {step}: {m}')


LAYOUTS = [
    pytest.param(False, {}, DistConfig(tp=2), id='dense-tp2'),
    pytest.param(True, {}, DistConfig(tp=2), id='moe-tp2'),
    pytest.param(True, dict(per_expert=True, layout='multimodal'), DistConfig(tp=2),
                 id='moe-per-expert-multimodal-tp2'),
    pytest.param(True, {}, DistConfig(tp=2, ep=2), id='moe-tp2-ep2'),
    # a check group per TP; one KV head, so each of the two TP ranks keeps (a replica of) it
    pytest.param(False, dict(num_key_value_heads=1), DistConfig(tp=2, dp=2),
                 id='dense-kv1-tp2-dp2'),
    # 2-token decodes: 2 TP ranks dispatch 0 rows; 2 KV heads, each kept by 2 of the 4 ranks
    pytest.param(True, dict(WIDE, tie=True, vocab_size=510, num_key_value_heads=2),
                 DistConfig(tp=4, ep=4), id='moe-tied-vocab510-kv2-tp4-ep4'),
    pytest.param(True, dict(per_expert=True, **WIDE), DistConfig(tp=2, dp=2, ep=4),
                 id='moe-tp2-dp2-ep4'),
    # sequence parallelism (nn/sequence_parallel.py): the target and the MTP head
    pytest.param(False, {}, DistConfig(tp=2, sequence_parallel=True), id='dense-tp2-sp'),
    pytest.param(True, {}, DistConfig(tp=2, sequence_parallel=True), id='moe-tp2-sp'),
    pytest.param(True, dict(tie=True, vocab_size=510, **WIDE),
                 DistConfig(tp=4, ep=4, sequence_parallel=True),
                 id='moe-tied-vocab510-tp4-ep4-sp'),     # 2-token decodes: 2 of 4 rows padding
    pytest.param(True, dict(per_expert=True, **WIDE),
                 DistConfig(tp=2, dp=2, ep=4, sequence_parallel=True), id='moe-tp2-dp2-ep4-sp'),
]


@pytest.mark.timeout(400)
@pytest.mark.parametrize('moe, ckpt, config', LAYOUTS)
def test_tp_ranks_give_single_process_logits(moe, ckpt, config, tmp_path, rank_pool):
    path = make_tiny_checkpoint(str(tmp_path), moe=moe, **ckpt)
    config.validate(ModelConfig.from_pretrained(path))
    results = rank_pool.run(config, path, str(tmp_path))
    want = {dp: run_steps(None, path, PROMPTS[dp]) for dp in range(config.dp)}
    for rank, got in enumerate(results):
        assert_same_logits(got, want[rank // config.tp], f'rank {rank} of {config}')
        # sequence parallelism: reduce-scatters and row gathers replace the all-reduces
        sp_ops = {'reduce_scatter', 'all_gather_rows'}
        assert (sp_ops <= got['ops']) == config.sequence_parallel, got['ops']
    for dp in range(config.dp):                                    # TP peers agree exactly
        first = results[dp * config.tp]
        for rank in range(dp * config.tp + 1, (dp + 1) * config.tp):
            for key in ('target', 'mtp'):
                assert all(torch.equal(a, b) for a, b in zip(results[rank][key], first[key])), \
                    f'TP ranks {dp * config.tp} and {rank} disagree on the {key} logits'


@pytest.mark.timeout(400)
def test_sp_target_tp4_with_a_draft_of_tp2_gives_single_process_logits(tmp_path, rank_pool):
    """Sequence parallelism in a draft of 1 < tp < the target's: the MTP head runs on its
    'draft_tp' sub-group's share of the plan's rows (a multiple of the target's tp=4, so of 2)."""
    path = make_tiny_checkpoint(str(tmp_path), moe=True, **WIDE)
    config = DistConfig(tp=4, sequence_parallel=True)
    results = rank_pool.run(config, path, str(tmp_path), task='run_steps_draft_tp2')
    want = run_steps(None, path, PROMPTS[0])
    for rank, got in enumerate(results):
        assert_same_logits(got, want, f'rank {rank} of {config}, draft tp=2')
        assert {('reduce_scatter', 'draft_tp'), ('all_gather_rows', 'draft_tp'),
                ('reduce_scatter', 'tp')} <= got['op_groups'], got['op_groups']


@pytest.mark.timeout(120)
def test_an_unaligned_reduce_scatter_raises_at_once_naming_rank_step_and_op(tmp_path,
                                                                            rank_pool):
    start = time.monotonic()
    results = rank_pool.run(DistConfig(tp=2, sequence_parallel=True), '', str(tmp_path),
                            timeout=60, task='feed_unaligned')
    assert time.monotonic() - start < 60
    for rank, result in enumerate(results):
        assert result['error'] == (
            f'rank {rank}, step 7: reduce_scatter on the tp group of shape [3, 4]: the first '
            'dimension must be a multiple of the group size 2 (token counts come padded from '
            'the StepPlan)'), result
        assert result['trace'] == []                     # raised before any collective ran


# ---- single-process checks of the sharding itself (no process group is needed to build) ----

def fake_rank(tp: int, rank: int) -> DistContext:
    return DistContext(DistConfig(tp=tp), rank)


@pytest.mark.parametrize('moe, per_expert', [(False, False), (True, False), (True, True)])
def test_shards_are_the_right_slices_of_the_checkpoint(moe, per_expert, tmp_path):
    path = make_tiny_checkpoint(str(tmp_path), moe=moe, per_expert=per_expert, vocab_size=511)
    config = ModelConfig.from_pretrained(path)
    full = build_model(path, torch.float64, progress=False).state_dict()
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    key_dim = config.linear_num_key_heads * dk
    for rank in range(2):
        model = Qwen3_5ForCausalLM(config, torch.float64, 'cpu', fake_rank(2, rank))
        load_weights(model, path, progress=False)
        part = model.state_dict()
        for name, tensor in part.items():
            whole = full[name]
            if 'in_proj_qkv' in name or 'conv1d' in name:       # [q | k | v] split separately
                q, k, v = whole.split([key_dim, key_dim, whole.shape[0] - 2 * key_dim])
                want = torch.cat([x.chunk(2)[rank] for x in (q, k, v)])
            elif 'embed_tokens' in name or 'lm_head' in name:   # 511 rows -> 256 + 255 (+1 zero)
                want = torch.cat([whole, whole.new_zeros(1, whole.shape[1])]).chunk(2)[rank]
            elif 'experts.gate_up_proj' in name:
                gate, up = whole.chunk(2, dim=1)
                want = torch.cat([gate.chunk(2, 1)[rank], up.chunk(2, 1)[rank]], 1)
            elif 'experts.down_proj' in name:
                want = whole.chunk(2, dim=2)[rank]
            elif name.endswith(('o_proj.weight', 'out_proj.weight', 'down_proj.weight')):
                want = whole.chunk(2, dim=1)[rank]
            elif tensor.shape == whole.shape:                    # replicated
                want = whole
            else:                                                # by heads / rows
                want = whole.chunk(2, dim=0)[rank]
            assert torch.equal(tensor, want), name


def test_kv_heads_fewer_than_tp_are_replicated(tmp_path):
    """tp=4 over 2 KV heads: ranks 0, 1 keep KV head 0 and ranks 2, 3 head 1, the head their
    query heads read (query heads split 4 ways as usual), in the target and the MTP head."""
    path = make_tiny_checkpoint(str(tmp_path), moe=False, **dict(WIDE, num_key_value_heads=2))
    config = ModelConfig.from_pretrained(path)
    full = build_model(path, torch.float64, progress=False, fuse=False).state_dict()
    for rank in range(4):
        model = Qwen3_5ForCausalLM(config, torch.float64, 'cpu', fake_rank(4, rank))
        load_weights(model, path, progress=False)
        part = model.state_dict()
        names = [n for n in part if n.endswith(('k_proj.weight', 'v_proj.weight'))]
        assert names
        for name in names:
            assert torch.equal(part[name], full[name].chunk(2)[rank // 2]), (name, rank)
        q_name = names[0].replace('k_proj', 'q_proj')
        assert torch.equal(part[q_name], full[q_name].chunk(4)[rank]), rank


def test_shape_errors_name_file_tensor_and_full_shapes(tmp_path):
    """A TP rank checks the checkpoint against the FULL shape, and says so."""
    path = make_tiny_checkpoint(str(tmp_path), moe=False)
    config = ModelConfig.from_pretrained(path)
    wrong = ModelConfig.from_dict({**config.hf_config, 'linear_num_value_heads': 8})
    model = Qwen3_5ForCausalLM(wrong, torch.float64, 'cpu', fake_rank(2, 1))
    with pytest.raises(ValueError) as err:
        load_weights(model, path, progress=False)
    match = re.fullmatch(r".*model\.safetensors: tensor '(\S+)' has shape (\[[\d, ]+\]), but "
                         r"config\.json implies (\[[\d, ]+\])", str(err.value))
    assert match, str(err.value)
    name, shape, implied = match.groups()
    unsharded = Qwen3_5ForCausalLM(wrong, torch.float64, 'cpu').state_dict()
    checkpoint = Qwen3_5ForCausalLM(config, torch.float64, 'cpu').state_dict()
    assert implied == str(list(unsharded[name].shape)) != shape
    assert shape == str(list(checkpoint[name].shape))


def test_cache_engine_allocates_per_rank_shapes(tmp_path):
    config = ModelConfig.from_pretrained(make_tiny_checkpoint(str(tmp_path), moe=False, **WIDE))
    cache_config = CacheConfig(block_size=4, num_blocks=6, num_state_slots=3, num_spec_tokens=2)
    conv_dim = 2 * 4 * 16 + 8 * 16
    for tp in (1, 2, 4):
        caches = CacheEngine(config, cache_config, torch.float64, 'cpu', tp=tp)
        k_cache, _ = caches[config.full_attention_layers[0]]
        conv, rec = caches[config.linear_attention_layers[0]]
        assert k_cache.shape == (6, 4, 4 // tp, 16)
        assert conv.shape == (3, conv_dim // tp, 3 + 2)
        assert rec.shape == (3, 3, 8 // tp, 16, 16)
        assert CacheEngine.bytes_per_block(config, 4, torch.float64, tp=tp) == \
            2 * 1 * 4 * (4 // tp) * 16 * 8
        assert CacheEngine.bytes_per_state_slot(config, 2, torch.float64, tp=tp) == \
            3 * ((conv_dim // tp) * 5 + 3 * (8 // tp) * 16 * 16) * 8
    with pytest.raises(ValueError, match=r'tp=3: must be >= 1 and divide \w+=4'):
        CacheEngine(config, cache_config, torch.float64, 'cpu', tp=3)
    # tp above the KV heads (2 here): one replicated head per rank
    config = ModelConfig.from_pretrained(make_tiny_checkpoint(
        str(tmp_path / 'kv2'), moe=False, **dict(WIDE, num_key_value_heads=2)))
    k_cache, _ = CacheEngine(config, cache_config, torch.float64, 'cpu', tp=4)[
        config.full_attention_layers[0]]
    assert k_cache.shape == (6, 4, 1, 16)
    assert CacheEngine.bytes_per_block(config, 4, torch.float64, tp=4) == 2 * 1 * 4 * 1 * 16 * 8
    with pytest.raises(ValueError, match=r'tp=3: must divide num_key_value_heads=2 or be a '
                                         r'multiple of it'):
        DistConfig(tp=3).validate(replace(config, num_attention_heads=6,
                                          linear_num_key_heads=6, linear_num_value_heads=12))
