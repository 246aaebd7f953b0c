"""Every size of an EP forward comes from the StepPlan, and no device value is read on the host
inside one (issue 19 item 1).

Two gloo ranks run the tiny MoE target (float64) in two layouts, steps planned by
`StepPlan.gather` and sized by `plan.forward_sizes` as the engine does:
  * dp=2 ep=2: ranks with different token counts (12 and 3), then one rank decoding while the
    other is idle and runs the dummy forward;
  * tp=2 ep=2: odd token counts (15, then 3), so the TP split pads a row (each TP rank sends
    8, then 2).
Each forward runs under `HostReadGuard`, which counts host reads of tensors made inside the
forward; the test asserts there are none, that each all-to-all block has the plan's size on
every rank (the idle rank's dummy included), and that the busy ranks' hidden states equal the
single process's. Hard timeouts: a hang fails with a message naming the ranks.
"""
from __future__ import annotations

import io
import os
import queue
import traceback
from types import SimpleNamespace

import pytest
import torch

from lmdeploy_lite.pytorch.config import CacheConfig, DistConfig
from lmdeploy_lite.pytorch.distributed import DistContext
from lmdeploy_lite.pytorch.cache_engine import CacheEngine
from lmdeploy_lite.pytorch.engine.executor.mp import free_port, rank_context
from lmdeploy_lite.pytorch.engine.step_plan import StepPlan
from lmdeploy_lite.pytorch.model_inputs import ForwardSizes
from lmdeploy_lite.pytorch.models.loader import build_model
from lmdeploy_lite.pytorch.strategies.ar import ARStrategy
from tests.helpers.step_inputs import make_inputs, shuffled_block_tables
from tests.helpers.tiny_models import make_tiny_checkpoint

TOP_K, EXPERTS = 2, 4          # tests/helpers/tiny_models.TINY_MOE: 2 experts per rank at ep=2
# per layout, per rank: steps of (token chunks, history lengths, is_decoding) or None (idle)
STEPS = {
    'dp2_ep2': {0: [([[5, 6, 7, 8, 9, 10, 11], [300, 2, 450, 17, 3]], [0, 0], False),
                    ([[40], [41]], [7, 5], True)],
                1: [([[20, 21, 22]], [0], False),
                    None]},
    'tp2_ep2': {r: [([[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [300, 2, 450, 17, 3]], [0, 0, 0],
                     False),
                    ([[40], [41], [42]], [7, 3, 5], True)] for r in range(2)},
}
LAYOUTS = {'dp2_ep2': DistConfig(dp=2, ep=2), 'tp2_ep2': DistConfig(tp=2, ep=2)}
# what the plan gives each layout's steps: (tokens per rank, capacity = max_tokens / tp)
WANT_SIZES = {'dp2_ep2': [((12, 3), 12), ((2, 1), 2)],
              'tp2_ep2': [((16, 16), 8), ((4, 4), 2)]}


class HostReadGuard:
    """Counts host reads (device->host syncs on a GPU) of tensors made inside the `with` block:
    `tolist`, `item`, `bool`/`int`/`float`/`index` conversions, `numpy`, `nonzero`, `unique`,
    `repeat_interleave` without `output_size`, and indexing by a boolean mask. Tensors that
    existed before (`existing`: inputs, weights, caches) are not counted, nor are calls made
    from backends/default (the CPU's own kernels, which read ids on the host by design; a GPU
    runs backends/cuda instead). `reads` lists (method, call site)."""
    METHODS = ('tolist', 'item', '__bool__', '__int__', '__float__', '__index__', 'numpy',
               'nonzero', 'unique')

    def __init__(self, existing: list[torch.Tensor]):
        self.existing = {t.untyped_storage().data_ptr() for t in existing}
        self.reads: list[tuple[str, str]] = []
        self.saved = {}

    def _made_inside(self, tensor) -> bool:
        return (isinstance(tensor, torch.Tensor) and tensor.numel() > 0
                and tensor.untyped_storage().data_ptr() not in self.existing)

    def _record(self, name: str):
        frames = [f for f in traceback.extract_stack()[:-2] if 'lmdeploy_lite' in f.filename]
        if frames and 'backends/default' in frames[-1].filename:
            return
        site = f'{frames[-1].filename}:{frames[-1].lineno}' if frames else '?'
        self.reads.append((name, site))

    def _wrap(self, name: str, original):
        def counted(tensor, *args, **kwargs):
            if name == 'repeat_interleave':
                read = 'output_size' not in kwargs and isinstance(
                    args[0] if args else kwargs.get('repeats'), torch.Tensor)
            elif name in ('__getitem__', '__setitem__'):
                index = args[0] if isinstance(args[0], tuple) else (args[0],)
                read = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
            else:
                read = True
            if read and self._made_inside(tensor):
                self._record(name)
            return original(tensor, *args, **kwargs)
        return counted

    def __enter__(self):
        for name in self.METHODS + ('repeat_interleave', '__getitem__', '__setitem__'):
            self.saved[name] = vars(torch.Tensor).get(name)      # None: inherited
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)


def run_rank(ctx: DistContext | None, path: str, steps: list) -> list[dict]:
    """One rank's forwards (ctx None: the single process, busy steps only). Per step: its
    ForwardSizes, the row counts of every all-to-all it sent, its host reads, its hidden."""
    tp = ctx.config.tp if ctx else 1
    model = build_model(path, torch.float64, 'cpu', progress=False, dist_ctx=ctx)
    caches = CacheEngine(model.config, CacheConfig(block_size=4, num_blocks=24,
                                                   num_state_slots=4), torch.float64, 'cpu',
                         tp=tp)
    existing = [*model.parameters(), *model.buffers(),
                *(t for layer in range(len(model.config.layer_types)) for t in caches[layer])]
    tables = shuffled_block_tables(3, 5, seed=1)
    sent = []
    if ctx is not None:
        all_to_all = ctx.ep.all_to_all          # the handle is frozen: patch the instance
        object.__setattr__(ctx.ep, 'all_to_all',
                           lambda t, *a: sent.append(t.shape[0]) or all_to_all(t, *a))
    results = []
    for step, work in enumerate(steps):
        if ctx is None and work is None:
            continue
        batch = None if work is None else SimpleNamespace(
            q_lens=[len(c) for c in work[0]], seqs=work[0], is_decoding=work[2])
        plan = StepPlan.gather(batch, ctx) if ctx else None
        if work is None:
            inputs = ARStrategy().make_dummy_inputs(plan.dummy_tokens_per_seq,
                                                    plan.any_decoding, 'cpu')
        else:
            chunks, history, decoding = work
            inputs = make_inputs(chunks, history, tables[:len(chunks)],
                                 list(range(1, len(chunks) + 1)), is_decoding=decoding)
        if plan is not None:
            inputs.sizes = plan.forward_sizes(inputs.num_tokens, inputs.batch_size)
        inputs.host_q_lens                  # the inputs' lengths on the host: not a forward value
        sent.clear()
        if ctx:
            ctx.begin_step(step)
        with torch.inference_mode(), HostReadGuard(existing + tensors_of(inputs)) as guard:
            hidden = model(inputs, caches)
        if ctx:
            ctx.end_step()
        results.append(dict(sizes=inputs.sizes, sent=list(sent), reads=guard.reads,
                            hidden=None if work is None else hidden))
    return results


def tensors_of(inputs) -> list[torch.Tensor]:
    return [v for v in vars(inputs).values() if isinstance(v, torch.Tensor)]


def _rank_main(rank: int, ports: dict, path: str, results):
    os.environ['LMDEPLOY_LITE_CHECK_COLLECTIVES'] = '1'
    os.environ['LMDEPLOY_LITE_DIST_TIMEOUT'] = '30'
    torch.set_num_threads(1)
    for name, config in LAYOUTS.items():
        ctx = None
        try:
            ctx = DistContext.init(config, rank, f'tcp://127.0.0.1:{ports[name]}')
            result = io.BytesIO()               # bytes: the rank may exit before they are read
            torch.save(run_rank(ctx, path, STEPS[name][rank]), result)
            results.put((name, rank, result.getvalue(), None))
        except BaseException:
            results.put((name, rank, None, traceback.format_exc()))
        finally:
            if ctx is not None:
                ctx.destroy()


@pytest.fixture(scope='module')
def rank_results(tmp_path_factory):
    """{layout: {rank: run_rank result}} from two rank processes, and the checkpoint path. The
    processes come from the mp executor's fork server (torch imported once): a spawned one
    spends seconds importing torch."""
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp('ep_sizes')), moe=True)
    ctx = rank_context()
    results = ctx.Queue()
    ports = {name: free_port() for name in LAYOUTS}
    procs = [ctx.Process(target=_rank_main, args=(r, ports, path, results), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    got, errors = {}, []
    try:
        for _ in range(2 * len(LAYOUTS)):
            name, rank, result, error = results.get(timeout=150)
            got.setdefault(name, {})[rank] = result and torch.load(io.BytesIO(result),
                                                                   weights_only=False)
            if error:
                errors.append(f'{name} rank {rank}:\n{error}')
    except queue.Empty:
        pytest.fail(f'ranks did not finish in 150 s: got {sorted(got)} '
                    f'(exit codes {[p.exitcode for p in procs]})')
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert not errors, '\n'.join(errors)
    return got, path


@pytest.mark.timeout(240)
@pytest.mark.parametrize('layout', list(LAYOUTS))
def test_ep_forward_reads_nothing_on_the_host_and_uses_the_plans_sizes(rank_results, layout):
    got, path = rank_results
    for step, (tokens, capacity) in enumerate(WANT_SIZES[layout]):
        tp = LAYOUTS[layout].tp
        block = capacity * min(TOP_K, EXPERTS // LAYOUTS[layout].ep)
        for rank in range(2):
            result = got[layout][rank][step]
            assert result['reads'] == [], f'rank {rank}, step {step}: host reads {result["reads"]}'
            sizes = result['sizes']
            assert (sizes.tokens, sizes.max_tokens // tp) == (tokens[rank], capacity), sizes
            # rows and expert ids, sent and combined back, in every MoE layer: one block per rank
            assert set(result['sent']) == {2 * block} and len(result['sent']) == 3 * 4, \
                (rank, step, result['sent'])
    for rank in range(2):                    # busy ranks: the single process's hidden states
        want = run_rank(None, path, STEPS[layout][rank])
        busy = [r for r in got[layout][rank] if r['hidden'] is not None]
        assert len(busy) == len(want)
        for step, (g, w) in enumerate(zip(busy, want)):
            assert g['hidden'].shape == w['hidden'].shape
            torch.testing.assert_close(g['hidden'], w['hidden'], rtol=1e-12, atol=1e-12,
                                       msg=lambda m: f'{layout} rank {rank} step {step}: {m}')


def test_forward_sizes_are_functions_of_the_plan():
    """tp=2; ranks (world order) with 12 and 3 tokens: counts rounded up to 2, the maxima cover
    every rank; an idle rank's dummy (one sequence of 1 + k tokens when a rank decodes) too;
    low-latency only when every rank with work decodes."""
    def plan(*rows):
        return StepPlan(torch.tensor(rows, dtype=torch.int64), tp=2)
    prefill = plan([12, 2, 0, 1, 0, 0, 0], [12, 2, 0, 1, 0, 0, 0], [3, 1, 0, 1, 0, 0, 0],
                   [3, 1, 0, 1, 0, 0, 0])
    assert prefill.forward_sizes(3, 1) == ForwardSizes(4, 12, 2, 2, low_latency=False)
    decode_idle = plan([8, 2, 1, 1, 0, 0, 3], [8, 2, 1, 1, 0, 0, 3], [0] * 7, [0] * 7)
    dummy = decode_idle.dummy_tokens_per_seq
    assert dummy == 4
    sizes = decode_idle.forward_sizes(dummy, 1)
    assert sizes == ForwardSizes(4, 8, 2, 2, low_latency=True)
    assert sizes.one_token_per_seq() == ForwardSizes(2, 2, 2, 2, low_latency=True)
    one_seq = plan([2, 1, 1, 1, 0, 0, 3], [2, 1, 1, 1, 0, 0, 3], [0] * 7, [0] * 7)
    assert one_seq.forward_sizes(dummy, 1).max_tokens == 4      # the dummy's 1 + k tokens


def test_plan_agrees_on_the_smallest_draft_count():
    """Each working rank proposes a draft count; the plan runs the smallest, and a decode
    rank's token count is taken at that count (an idle rank's proposal does not count)."""
    def plan(*rows):
        return StepPlan(torch.tensor(rows, dtype=torch.int64), tp=2)
    mixed = plan([8, 2, 1, 1, 0, 0, 3], [4, 2, 1, 1, 0, 0, 1], [0, 0, 0, 0, 0, 0, 0])
    assert mixed.num_spec == 1
    assert mixed.max_tokens == 4                   # 2 rows x (1 + 1) on either decode rank
    assert mixed.dummy_tokens_per_seq == 2
    prefill = plan([10, 2, 0, 1, 0, 0, 2], [0, 0, 0, 0, 0, 0, 0])
    assert prefill.num_spec == 2 and prefill.max_tokens == 10
    assert plan([0] * 7, [0] * 7).num_spec == 0
