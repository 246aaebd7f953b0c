"""Process groups and the one wrapper every collective goes through.

DistContext holds the world, TP, DP and EP groups on gloo.

Group sizes: world = dp x tp ranks; 'tp' = the tp consecutive ranks of one DP rank; 'dp' = the
dp ranks of one TP rank; 'ep' = the world (ep is 1 or dp x tp). The MTP draft has its own
layout (SpeculativeConfig tp / ep, dp the target's): `draft_context` gives its layers a
`DraftDistContext` whose 'tp' is the TP group, a 'draft_tp' sub-group of it (consecutive runs
of the draft's tp ranks, for 1 < draft tp < tp) or none (draft tp=1), and whose 'ep' is the
EP group or none (draft ep=1). On CUDA (`init(..., device=cuda:i)`)
every multi-rank group also gets an NCCL twin with the same ranks, and `traced` runs a
collective of a CUDA tensor on the twin, of a CPU tensor on the gloo group: the StepPlan gather,
the inbox broadcast and the trace check stay on gloo, TP all-reduces (sequence-parallel:
reduce-scatters and row all-gathers, `reduce_scatter` / `gather_rows`) and EP all-to-alls of
activations go over NCCL (small TP sums on a one-shot peer-memory all-reduce instead with
LMDEPLOY_LITE_TP_ALLREDUCE=oneshot: backends/cuda/peer_all_reduce.py). Each collective is
recorded per step as (op, group, shape, dtype) — variable first dimensions (all-to-all payloads) as -1 — so that ranks can compare what they did
(DESIGN.md invariant 2): with LMDEPLOY_LITE_CHECK_COLLECTIVES=1 every step ends with a digest
comparison on a separate check group, and so does every collective across DP ranks before it
runs (gloo aborts the process on a size mismatch, so afterwards is too late); a mismatch raises
CollectiveMismatch naming the first collective that differs. Which ranks advance together is `plan_group` (the StepPlan's group, for
the engine and the executors alike): the world with ep > 1, whose MoE all-to-alls join every
rank; each TP group with ep = 1, whose DP ranks share no collective inside a step and so run as
independent engines; the check group spans the same ranks. Every collective has a timeout (LMDEPLOY_LITE_DIST_TIMEOUT seconds,
default 180); expiry raises CollectiveTimeout naming rank, step and operation (invariant 3).
A timeout also triggers the trace comparison, so a rank that skipped a collective is named
instead of leaving its peers to hang (the comparison waits up to 3x the timeout for peers still
stuck in a collective of their own, so with the check on, a rank that stopped participating
altogether is reported after about 4x the timeout; with it off, after 1x).

NCCL collectives are asynchronous: the call returns once the kernel is queued, so `traced` only
sees errors raised at launch. A peer that never joins makes the kernel wait on the GPU; the NCCL
groups get the same timeout, after which torch's NCCL watchdog aborts the communicator, logs the
timed-out collective (the group is named `lmdeploy_lite_<name>`) and ends the process
(TORCH_NCCL_ASYNC_ERROR_HANDLING), which the executor reports by rank. With the trace check on,
the check at the end of the step (gloo, on the CPU) still names a rank that skipped a collective
while the GPUs wait.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lmdeploy_lite.pytorch.config import DistConfig

ENV_CHECK = 'LMDEPLOY_LITE_CHECK_COLLECTIVES'
ENV_TIMEOUT = 'LMDEPLOY_LITE_DIST_TIMEOUT'


def dist_timeout_s() -> float:
    return float(os.environ.get(ENV_TIMEOUT, '180'))


class CollectiveTimeout(RuntimeError):
    pass


class CollectiveMismatch(RuntimeError):
    pass


@dataclass
class DistContext:
    config: DistConfig
    rank: int
    groups: dict = field(default_factory=dict)      # name -> ProcessGroup (None: single rank)
    device_groups: dict = field(default_factory=dict)   # name -> NCCL twin (CUDA ranks only)
    # tokens per rank a DeepEP low-latency dispatch holds (the executor sets it from the engine
    # config: nn/token_dispatcher.dispatch_capacity); None: unknown, DeepEP is not used
    max_tokens_per_rank: int | None = None
    nccl_device: torch.device | None = None     # CUDA ranks: where the NCCL twins live
    nccl_twins: dict = field(default_factory=dict)   # tuple(ranks) -> NCCL group
    # group name -> PeerAllReduce (backends/cuda/peer_all_reduce.py): the one-shot all-reduce
    # of small CUDA tensors over NVLink peer memory ('tp' on CUDA ranks, when chosen)
    peer_reduce: dict = field(default_factory=dict)
    check: bool = False
    step: int = 0
    trace: list = field(default_factory=list)
    heartbeat: object = None      # heartbeat(inside) around each collective: engine/heartbeat.py

    # ---- layout ---------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.config.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.config.tp

    @property
    def ep_rank(self) -> int:
        return self.rank if self.config.ep > 1 else 0

    @property
    def plan_group(self) -> str:
        """The group the StepPlan spans: the ranks that share collectives inside a step. With
        ep > 1 the MoE all-to-alls join every rank, so the world advances in lockstep (an idle
        DP rank runs dummy forwards); with ep = 1 DP ranks share nothing inside the forward and
        each DP group (its TP group) runs on its own."""
        return 'world' if self.config.ep > 1 else 'tp'

    @property
    def plan_ranks(self) -> list[int]:
        """The global ranks of `plan_group`, in group order."""
        return next(ranks for ranks in _plan_rank_sets(self.config) if self.rank in ranks)

    def group(self, name: str):
        return self.groups.get(name)

    @classmethod
    def single(cls) -> 'DistContext':
        """One process: every group has one rank and no collective runs."""
        return cls(DistConfig(), 0)

    @classmethod
    def init(cls, config: DistConfig, rank: int, init_method: str,
             device: torch.device | None = None) -> 'DistContext':
        """Join the world (gloo) and build the TP, DP, EP and check groups. With a CUDA `device`
        (this rank's, already made current by the caller) also their NCCL twins, created eagerly
        (`device_id`) so that no communicator is first set up inside a CUDA-graph capture."""
        timeout = datetime.timedelta(seconds=dist_timeout_s())
        dist.init_process_group('gloo', init_method=init_method, rank=rank,
                                world_size=config.world_size, timeout=timeout)
        ctx = cls(config, rank, check=os.environ.get(ENV_CHECK, '0') == '1')
        if device is not None and torch.device(device).type == 'cuda':
            ctx.nccl_device = torch.device(device)
        tp, dp = config.tp, config.dp
        world = list(range(config.world_size))
        ctx.add_group('world', world, dist.group.WORLD)
        # the check group spans the plan group's ranks (those that share collectives) and waits
        # longer than any data collective, so that a rank stuck in one can still reach the
        # comparison after its own timeout
        for ranks in _plan_rank_sets(config):
            check = dist.new_group(ranks, backend='gloo', timeout=3 * timeout)
            if rank in ranks:
                ctx.groups['check'] = check if len(ranks) > 1 else None
        for d in range(dp):
            ctx.add_group('tp', [d * tp + t for t in range(tp)])
        for t in range(tp):
            ctx.add_group('dp', [d * tp + t for d in range(dp)])
        if config.ep > 1:
            ctx.add_group('ep', world, dist.group.WORLD)
        if ctx.nccl_device is not None and tp > 1:        # every rank of each TP group at once
            from lmdeploy_lite.pytorch.backends.cuda.peer_all_reduce import PeerAllReduce
            peer = PeerAllReduce.create(ctx.device_groups['tp'], tp, ctx.nccl_device)
            if peer is not None:
                ctx.peer_reduce['tp'] = peer
        return ctx

    def add_group(self, name: str, ranks: list[int], group=None):
        """Create group `name` over `ranks` (gloo, plus its NCCL twin on CUDA; one communicator
        per set of ranks); this rank keeps it if it is a member. Every rank creates every group,
        in the same order (torch.distributed's rule)."""
        timeout = datetime.timedelta(seconds=dist_timeout_s())
        member = self.rank in ranks
        if group is None:
            group = dist.new_group(ranks, backend='gloo', timeout=timeout)
        twins = self.nccl_twins
        if self.nccl_device is not None and len(ranks) > 1 and tuple(ranks) not in twins:
            twins[tuple(ranks)] = dist.new_group(
                ranks, backend='nccl', timeout=timeout, group_desc=f'lmdeploy_lite_{name}',
                device_id=self.nccl_device if member else None)
        if member:
            self.groups[name] = group if len(ranks) > 1 else None
            self.device_groups[name] = twins.get(tuple(ranks))

    def draft_context(self, draft: DistConfig) -> 'DistContext | DraftDistContext':
        """The DistContext the MTP draft's layers are built with (DESIGN.md invariant 6): this
        one when the draft's layout is the target's, else a `DraftDistContext` with the draft's
        tp and ep. A draft tp strictly between 1 and the target's needs the 'draft_tp' groups:
        each TP group cut into consecutive runs of `draft.tp` ranks, created here, so every rank
        must call this once, at the same point of start-up."""
        if draft == self.config:
            return self
        tp = self.config.tp
        if draft.dp != self.config.dp or tp % draft.tp or draft.ep not in (1, self.config.ep):
            raise ValueError(f'draft layout {draft}: needs dp={self.config.dp}, a tp dividing '
                             f'{tp} and ep 1 or {self.config.ep}')
        if 1 < draft.tp < tp and self.world_size > 1:
            for start in range(0, self.world_size, draft.tp):
                self.add_group('draft_tp', list(range(start, start + draft.tp)))
        names = {'tp': 'tp' if draft.tp == tp else 'draft_tp' if draft.tp > 1 else None,
                 'ep': 'ep' if draft.ep > 1 else None}
        return DraftDistContext(self, draft, names)

    def destroy(self):
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- traced collectives ---------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, group: str, op: str = 'sum') -> torch.Tensor:
        """The group's reduction of `tensor`: `tensor` itself, reduced in place (gloo, NCCL),
        or a new tensor (a small CUDA sum on the one-shot peer-memory all-reduce): use the
        returned one."""
        reduce_op = {'sum': dist.ReduceOp.SUM, 'min': dist.ReduceOp.MIN,
                     'max': dist.ReduceOp.MAX}[op]
        if self.group(group) is None:
            return tensor
        peer = self.peer_reduce.get(group)
        if peer is not None and op == 'sum' and tensor.is_cuda and peer.can_reduce(tensor):
            out = []
            self.traced('all_reduce', group, tensor, lambda g: out.append(peer.all_reduce(tensor)))
            return out[0]
        self.traced('all_reduce', group, tensor,
                  lambda g: dist.all_reduce(tensor, op=reduce_op, group=g))
        return tensor

    def all_gather(self, tensor: torch.Tensor, group: str) -> torch.Tensor:
        """[size, *tensor.shape]: every rank's tensor, in rank order of the group."""
        g = self.group(group)
        if g is None:
            return tensor[None]
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(g))]
        self.traced('all_gather', group, tensor, lambda g: dist.all_gather(parts, tensor, group=g))
        return torch.stack(parts)

    def gather_rows(self, tensor: torch.Tensor, group: str) -> torch.Tensor:
        """Sequence parallelism: [N, ...] on each rank -> [size * N, ...], the ranks' rows
        concatenated in group order (traced as 'all_gather_rows' with the local shape)."""
        g = self.group(group)
        if g is None:
            return tensor
        tensor = tensor.contiguous()
        out = tensor.new_empty((self.group_size(group) * tensor.shape[0],) + tensor.shape[1:])
        self.traced('all_gather_rows', group, tensor,
                    lambda g: _all_gather_single(out, tensor, group=g))
        return out

    def reduce_scatter(self, tensor: torch.Tensor, group: str) -> torch.Tensor:
        """Sequence parallelism: [N, ...] partial sums on each rank -> [N / size, ...], this
        rank's share of the rows (rank r: rows [r * N / size, (r + 1) * N / size)) of the sum
        over the group. N must be a multiple of the group size (the StepPlan pads token counts
        to a multiple of tp): otherwise raises ValueError at once, naming rank, step and op."""
        g = self.group(group)
        if g is None:
            return tensor
        size = self.group_size(group)
        if tensor.shape[0] % size:
            raise ValueError(f'rank {self.rank}, step {self.step}: reduce_scatter on the {group} '
                             f'group of shape {list(tensor.shape)}: the first dimension must be '
                             f'a multiple of the group size {size} (token counts come padded '
                             f'from the StepPlan)')
        tensor = tensor.contiguous()
        out = tensor.new_empty((tensor.shape[0] // size,) + tensor.shape[1:])
        self.traced('reduce_scatter', group, tensor,
                    lambda g: _reduce_scatter_single(out, tensor, group=g))
        return out

    def group_size(self, group: str) -> int:
        g = self.group(group)
        return 1 if g is None else dist.get_world_size(g)

    def broadcast(self, tensor: torch.Tensor, src_local: int, group: str) -> torch.Tensor:
        g = self.group(group)
        if g is None:
            return tensor
        src = dist.get_global_rank(g, src_local)
        self.traced('broadcast', group, tensor, lambda g: dist.broadcast(tensor, src, group=g))
        return tensor

    def broadcast_object(self, obj, group: str):
        """A picklable object from the group's first rank to the others (e.g. TP rank 0's
        inbox events, so that every TP rank's scheduler sees the same requests)."""
        g = self.group(group)
        if g is None:
            return obj
        box = [obj]
        marker = torch.empty(0, dtype=torch.uint8)
        self.traced('broadcast_object', group, marker,
                  lambda g: dist.broadcast_object_list(box, dist.get_global_rank(g, 0), group=g))
        return box[0]

    def all_to_all(self, tensor: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                   group: str) -> torch.Tensor:
        """Variable-size exchange along dim 0 (the counts were exchanged first by the caller)."""
        out = tensor.new_empty((sum(recv_counts),) + tuple(tensor.shape[1:]))
        self.traced('all_to_all', group, tensor,
                  lambda g: dist.all_to_all_single(out, tensor.contiguous(), recv_counts,
                                                   send_counts, group=g),
                  variable=True)
        return out

    def traced(self, op: str, group: str, tensor: torch.Tensor, fn, variable: bool = False):
        """Record (op, group, shape of `tensor`, dtype) and run `fn(process_group)`: the NCCL
        twin of `group` for a CUDA tensor (when this rank has one), else the gloo group. Errors
        raised by `fn` become CollectiveTimeout naming rank, step and operation. Also used for
        collectives outside torch.distributed (DeepEP), which ignore the group argument."""
        shape = (-1,) + tuple(tensor.shape[1:]) if variable else tuple(tensor.shape)
        entry = (op, group, shape, str(tensor.dtype).replace('torch.', ''))
        self.trace.append(entry)
        if self.heartbeat is not None:
            self.heartbeat(True)
        if self.check and not variable and group not in TP_LOCAL_GROUPS:
            # a collective across DP ranks whose shapes must agree: compared before it runs,
            # since gloo aborts the process on a size mismatch (vllm-ascend #9689's "8 vs 4")
            self.compare_traces(before=True)
        process_group = self.group(group)
        if tensor.is_cuda and self.device_groups.get(group) is not None:
            process_group = self.device_groups[group]
        start = time.monotonic()
        try:
            fn(process_group)
        except RuntimeError as e:
            raise self._failure(entry, time.monotonic() - start, e) from e
        finally:
            if self.heartbeat is not None:
                self.heartbeat(False)

    def _failure(self, entry: tuple, elapsed_s: float, error: RuntimeError) -> RuntimeError:
        """The error for a collective that raised after `elapsed_s`: CollectiveTimeout naming
        rank, step and operation (one line; the backend's text follows on later lines), or,
        with the trace check on, CollectiveMismatch naming the rank that diverged."""
        op, group, shape, dtype = entry
        timeout = dist_timeout_s()
        what = (f'timed out after {timeout:g} s ({ENV_TIMEOUT})' if elapsed_s >= 0.9 * timeout
                else f'failed after {elapsed_s:.1f} s (a peer rank died or left?)')
        message = (f'rank {self.rank}, step {self.step}: {op} on the {group} group '
                   f'(shape {list(shape)}, {dtype}) {what}\n{error}')
        if self.check:
            try:
                self.compare_traces(failed=entry)          # names the rank that diverged
            except CollectiveMismatch as mismatch:
                return mismatch
            except RuntimeError as check_error:            # peers never reached the comparison
                message += f'\n(the trace comparison failed too: {check_error})'
        return CollectiveTimeout(message)

    # ---- step boundaries and the trace check ----------------------------------------------
    def begin_step(self, step: int):
        self.step = step
        self.trace = []

    def end_step(self):
        if self.check and len(self.plan_ranks) > 1:
            self.compare_traces()

    def compare_traces(self, failed: tuple | None = None, before: bool = False):
        """Compare this step's collective sequences across the plan group (the ranks that share
        collectives: the world with ep > 1, else this TP group) on the check group; raise
        CollectiveMismatch on the first difference. Collectives on groups that span DP ranks
        must agree on every rank in (op, group, shape, dtype) (a first dimension that DP ranks
        may differ in is recorded as -1: all-to-all payloads); TP peers (same DP rank) must
        agree exactly on everything, their own TP-group collectives included. `failed`: this
        rank's collective that just failed (marks its trace). `before`: the comparison that
        precedes a cross-DP collective (its entry is the trace's last), so that a rank about to
        post another collective, or one of another shape, is named before the backend sees it;
        a rank at another point of its step (its end, another collective) is a difference too,
        since every comparison exchanges the same [3] tensor: (where, cross-DP, full digests)."""
        ranks = self.plan_ranks
        if len(ranks) == 1:
            return
        record = list(self.trace) + ([('<timed out here>',)] if failed else [])
        mine = torch.tensor([int(before), _digest(_cross_dp(record)), _digest(record)],
                            dtype=torch.int64)
        check = self.group('check')
        digests = [torch.empty_like(mine) for _ in ranks]
        dist.all_gather(digests, mine, group=check)

        def tp_leader(i: int) -> int:       # position of ranks[i]'s TP rank 0 (ranks are a range)
            return i - ranks[i] % self.config.tp
        same_coarse = all(d[:2].tolist() == digests[0][:2].tolist() for d in digests)
        same_fine = all(int(d[2]) == int(digests[tp_leader(i)][2]) for i, d in enumerate(digests))
        if same_coarse and same_fine:
            return
        traces = [None] * len(ranks)
        dist.all_gather_object(traces, record, group=check)
        if not same_fine:                   # within a TP group: the full sequences
            self._raise_first_difference(traces, tp_leader, 'TP peers\'')
        self._raise_first_difference([_cross_dp(t) for t in traces], lambda i: 0,
                                     'ranks\' cross-DP')

    def _raise_first_difference(self, traces: list, reference, what: str):
        """`traces[i]`: the sequence of the plan group's i-th rank; `reference(i)`: the position
        whose sequence it must equal."""
        ranks = self.plan_ranks
        for i in range(max(map(len, traces))):
            entries = [t[i] if i < len(t) else ('<end of step>',) for t in traces]
            if any(e != entries[reference(p)] for p, e in enumerate(entries)):
                detail = '; '.join(f'rank {ranks[p]}: {e}' for p, e in enumerate(entries))
                raise CollectiveMismatch(f'step {self.step}: the {what} collective sequences '
                                         f'differ at collective #{i}: {detail}')


# torch >= 2.11 names them *_single; earlier releases *_tensor (same arguments)
_all_gather_single = getattr(dist, 'all_gather_single', None) or dist.all_gather_into_tensor
_reduce_scatter_single = (getattr(dist, 'reduce_scatter_single', None)
                          or dist.reduce_scatter_tensor)


def _plan_rank_sets(config: DistConfig) -> list[list[int]]:
    """Every plan group's ranks (DistContext.plan_group), in creation order: the world with
    ep > 1, else one set per TP group."""
    if config.ep > 1:
        return [list(range(config.world_size))]
    tp = config.tp
    return [[d * tp + t for t in range(tp)] for d in range(config.dp)]


TP_LOCAL_GROUPS = ('tp', 'draft_tp')     # groups inside one DP rank's TP group


def _cross_dp(record: list) -> list:
    """What every rank must agree on: the collectives of groups that span DP ranks, shapes
    included (a collective whose first dimension may differ between ranks, an all-to-all's
    payload, is recorded with -1 there: `traced`'s `variable`)."""
    return [e for e in record if len(e) < 4 or e[1] not in TP_LOCAL_GROUPS]


def _digest(record: list) -> int:
    return int.from_bytes(hashlib.sha256(repr(record).encode()).digest()[:8], 'little',
                          signed=True)


class DraftDistContext:
    """The MTP draft's view of its rank's DistContext: the same process, groups and trace, with
    the draft's own DistConfig (`config`: its tp and ep; dp the target's). Layers built with it
    ask for 'tp' and 'ep' as usual and get the draft's: 'tp' is the target's TP group when the
    tps agree, this rank's 'draft_tp' sub-group for a smaller draft tp > 1, none for tp=1; 'ep'
    is the target's EP group, or none with ep=1 (experts replicated). Collectives are recorded
    in the parent's trace under the real group's name. Anything else (rank, step,
    max_tokens_per_rank, ...) is the parent's."""

    def __init__(self, parent: DistContext, config: DistConfig, names: dict[str, str | None]):
        self.parent, self.config, self.names = parent, config, names

    def __getattr__(self, name: str):
        if name == 'parent':                 # not set yet (copy / unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.parent, name)

    def _real(self, group: str) -> str | None:
        return self.names.get(group, group)

    @property
    def tp_rank(self) -> int:
        return self.parent.tp_rank % self.config.tp

    @property
    def ep_rank(self) -> int:
        return self.parent.rank if self.config.ep > 1 else 0

    def group(self, name: str):
        real = self._real(name)
        return None if real is None else self.parent.group(real)

    def all_reduce(self, tensor: torch.Tensor, group: str, op: str = 'sum') -> torch.Tensor:
        real = self._real(group)
        return tensor if real is None else self.parent.all_reduce(tensor, real, op)

    def all_gather(self, tensor: torch.Tensor, group: str) -> torch.Tensor:
        real = self._real(group)
        return tensor[None] if real is None else self.parent.all_gather(tensor, real)

    def gather_rows(self, tensor: torch.Tensor, group: str) -> torch.Tensor:
        real = self._real(group)
        return tensor if real is None else self.parent.gather_rows(tensor, real)

    def reduce_scatter(self, tensor: torch.Tensor, group: str) -> torch.Tensor:
        real = self._real(group)
        return tensor if real is None else self.parent.reduce_scatter(tensor, real)

    def group_size(self, group: str) -> int:
        real = self._real(group)
        return 1 if real is None else self.parent.group_size(real)

    def broadcast(self, tensor: torch.Tensor, src_local: int, group: str) -> torch.Tensor:
        real = self._real(group)
        return tensor if real is None else self.parent.broadcast(tensor, src_local, real)

    def all_to_all(self, tensor: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                   group: str) -> torch.Tensor:
        return self.parent.all_to_all(tensor, send_counts, recv_counts, self._checked(group))

    def traced(self, op: str, group: str, tensor: torch.Tensor, fn, variable: bool = False):
        self.parent.traced(op, self._checked(group), tensor, fn, variable)

    def _checked(self, group: str) -> str:
        real = self._real(group)
        if real is None:
            raise RuntimeError(f'the draft ({self.config}) has no {group!r} group')
        return real
