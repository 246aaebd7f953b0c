"""Process groups as typed handles (`dist.tp.all_reduce(x)`), and the one wrapper every
collective goes through (`DistContext.traced`).

Groups (`rank_sets`, a pure function of the DistConfig): `world` = dp x tp ranks; `tp` = the tp
consecutive ranks of one DP rank; `dp` = the dp ranks of one TP rank; `ep` = the world with
ep > 1, else this rank alone; `plan` = the StepPlan's group, the ranks that advance together: the
world with ep > 1 (MoE all-to-alls join every rank), else each TP group (DP ranks share no
collective inside a step and run as independent engines); the check group spans the same ranks.
The MTP draft's own layout (SpeculativeConfig tp / ep) gets a `DraftDistContext` (`draft_context`).

On CUDA every multi-rank group also has an NCCL twin: a collective of a CUDA tensor runs on it,
of a CPU tensor on gloo (the StepPlan gather, the inbox broadcast, the trace check). With
LMDEPLOY_LITE_TP_ALLREDUCE=oneshot small TP sums take a one-shot peer-memory all-reduce instead
(backends/cuda/peer_all_reduce.py).

Each collective is recorded per step as (op, group, shape, dtype), variable first dimensions
(all-to-all payloads) as -1 (DESIGN.md invariant 2): with LMDEPLOY_LITE_CHECK_COLLECTIVES=1 the
ranks compare digests of it at the end of every step, and before every collective across DP
ranks (gloo aborts the process on a size mismatch); a mismatch raises CollectiveMismatch naming
the first collective that differs. Every collective has a timeout (LMDEPLOY_LITE_DIST_TIMEOUT s,
default 180; invariant 3) whose expiry raises CollectiveTimeout naming rank, step and operation
and runs the comparison (which waits up to 3x the timeout for peers stuck in a collective of
their own), so a rank that skipped a collective is named instead of leaving its peers to hang.

NCCL collectives are asynchronous: `traced` only sees errors raised at launch. A peer that never
joins makes the kernel wait until the same timeout, when torch's NCCL watchdog aborts the
communicator (`lmdeploy_lite_<name>`) and ends the process, which the executor reports by rank.
"""
from __future__ import annotations

import dataclasses
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
    """A collective failed or timed out; the message names rank, step and operation."""


class CollectiveMismatch(RuntimeError):
    """Ranks' collective sequences differ; the message names the first difference."""


def rank_sets(config: DistConfig, name: str | int) -> list[tuple[int, ...]]:
    """Every group `name` of the layout, in creation order (module docstring); a number: the
    world cut into consecutive runs of that many ranks."""
    world, tp, ep = config.world_size, config.tp, config.ep
    if name == 'dp':
        return [tuple(range(t, world, tp)) for t in range(tp)]
    size = name if isinstance(name, int) else {'world': world, 'tp': tp, 'ep': world if ep > 1
                                               else 1, 'plan': world if ep > 1 else tp}[name]
    return [tuple(range(s, s + size)) for s in range(0, world, size)]


@dataclass(frozen=True, eq=False)
class Group:
    """This rank's handle on one group: its global `ranks` (group order) and the collectives on
    it, traced under `name`. Without a process group (one rank; a context that never joined any;
    a draft group that maps to none) every collective is the identity of a group of one."""
    ctx: 'DistContext' = field(repr=False)
    name: str
    ranks: tuple[int, ...]
    gloo: object = None         # the gloo ProcessGroup (None: no collective runs)
    nccl: object = None         # its NCCL twin (CUDA ranks): runs collectives of CUDA tensors
    peer: object = None         # PeerAllReduce (backends/cuda/peer_all_reduce.py), opt-in

    size = property(lambda self: len(self.ranks))
    rank = property(lambda self: self.ranks.index(self.ctx.rank))     # position in the group

    def traced(self, op: str, tensor: torch.Tensor, fn, variable: bool = False):
        """`DistContext.traced` on this group (also for DeepEP's collectives, whose `fn` ignores
        the process group it gets)."""
        if self.gloo is None:
            raise RuntimeError(f'rank {self.ctx.rank}: {op} on the one-rank {self.name} group')
        return self.ctx.traced(op, self, tensor, fn, variable)

    def all_reduce(self, tensor: torch.Tensor, op: str = 'sum') -> torch.Tensor:
        """The group's reduction of `tensor`: `tensor` itself, reduced in place (gloo, NCCL),
        or a new tensor (a small CUDA sum on the one-shot peer-memory all-reduce): use the
        returned one."""
        if self.gloo is None:
            return tensor
        peer = self.peer
        if peer is not None and op == 'sum' and tensor.is_cuda and peer.can_reduce(tensor):
            return self.traced('all_reduce', tensor, lambda g: peer.all_reduce(tensor))
        reduce_op = {'sum': dist.ReduceOp.SUM, 'min': dist.ReduceOp.MIN}[op]
        self.traced('all_reduce', tensor, lambda g: dist.all_reduce(tensor, op=reduce_op, group=g))
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """[size, *tensor.shape]: every rank's tensor, in rank order of the group."""
        if self.gloo is None:
            return tensor[None]
        parts = [torch.empty_like(tensor) for _ in self.ranks]
        self.traced('all_gather', tensor, lambda g: dist.all_gather(parts, tensor, group=g))
        return torch.stack(parts)

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sequence parallelism: [N, ...] on each rank -> [size * N, ...], the ranks' rows
        concatenated in group order (traced as 'all_gather_rows' with the local shape)."""
        if self.gloo is None:
            return tensor
        tensor = tensor.contiguous()
        out = tensor.new_empty((self.size * tensor.shape[0],) + tensor.shape[1:])
        self.traced('all_gather_rows', tensor, lambda g: _all_gather_single(out, tensor, group=g))
        return out

    def reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sequence parallelism: [N, ...] partial sums on each rank -> [N / size, ...], rank r's
        rows [r * N / size, (r + 1) * N / size) of the group's sum. N must be a multiple of the
        group size (the StepPlan pads token counts so): else ValueError naming rank and step."""
        if self.gloo is None:
            return tensor
        if tensor.shape[0] % self.size:
            raise ValueError(f'rank {self.ctx.rank}, step {self.ctx.step}: reduce_scatter on the '
                             f'{self.name} group of shape {list(tensor.shape)}: the first '
                             f'dimension must be a multiple of the group size {self.size} '
                             f'(token counts come padded from the StepPlan)')
        tensor = tensor.contiguous()
        out = tensor.new_empty((tensor.shape[0] // self.size,) + tensor.shape[1:])
        self.traced('reduce_scatter', tensor,
                    lambda g: _reduce_scatter_single(out, tensor, group=g))
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`tensor` of the group's rank `src` on every rank (in place)."""
        if self.gloo is not None:
            self.traced('broadcast', tensor,
                        lambda g: dist.broadcast(tensor, self.ranks[src], group=g))
        return tensor

    def all_to_all(self, tensor: torch.Tensor, send_counts: list[int],
                   recv_counts: list[int]) -> torch.Tensor:
        """Variable-size exchange along dim 0 (the counts were exchanged first by the caller)."""
        if self.gloo is None:
            return tensor
        out = tensor.new_empty((sum(recv_counts),) + tuple(tensor.shape[1:]))
        self.traced('all_to_all', tensor,
                    lambda g: dist.all_to_all_single(out, tensor.contiguous(), recv_counts,
                                                     send_counts, group=g),
                    variable=True)
        return out


@dataclass
class DistContext:
    """This rank's `Group` handles and the per-step collective trace they record into."""
    config: DistConfig
    rank: int
    groups: dict = field(default_factory=dict)      # name -> Group this rank belongs to
    check_group: object = None      # gloo group over the plan group's ranks (trace comparison)
    nccl_device: torch.device | None = None     # CUDA ranks: where the NCCL twins live
    nccl_twins: dict = field(default_factory=dict)   # tuple(ranks) -> NCCL group
    check: bool = False
    step: int = 0
    trace: list = field(default_factory=list)
    heartbeat: object = None      # heartbeat(inside) around each collective: engine/heartbeat.py

    # ---- layout ---------------------------------------------------------------------------
    world_size = property(lambda self: self.config.world_size)
    tp_rank = property(lambda self: self.rank % self.config.tp)
    dp_rank = property(lambda self: self.rank // self.config.tp)
    ep_rank = property(lambda self: self.rank if self.config.ep > 1 else 0)

    def group(self, name: str) -> Group:
        """This rank's group `name`; on a context that never joined it (`single()`, tests) a
        handle with the topology's ranks whose collectives are identities."""
        if name not in self.groups:
            self.groups[name] = Group(self, name, next(
                ranks for ranks in rank_sets(self.config, name) if self.rank in ranks))
        return self.groups[name]

    world = property(lambda self: self.group('world'))
    tp = property(lambda self: self.group('tp'))
    dp = property(lambda self: self.group('dp'))
    ep = property(lambda self: self.group('ep'))      # ep = 1: this rank alone

    plan = property(lambda self: self.world if self.config.ep > 1 else self.tp)

    @classmethod
    def single(cls) -> 'DistContext':
        """One process: every group has one rank and no collective runs."""
        return cls(DistConfig(), 0)

    @classmethod
    def init(cls, config: DistConfig, rank: int, init_method: str,
             device: torch.device | None = None) -> 'DistContext':
        """Join the world (gloo) and build the TP, DP, EP and check groups; with this rank's CUDA
        `device` (made current by the caller) their NCCL twins too, created eagerly so that no
        communicator is first set up inside a CUDA-graph capture."""
        timeout = datetime.timedelta(seconds=dist_timeout_s())
        dist.init_process_group('gloo', init_method=init_method, rank=rank,
                                world_size=config.world_size, timeout=timeout)
        ctx = cls(config, rank, check=os.environ.get(ENV_CHECK, '0') == '1')
        if device is not None and torch.device(device).type == 'cuda':
            ctx.nccl_device = torch.device(device)
        ctx.add_group('world', rank_sets(config, 'world')[0], dist.group.WORLD)
        # the check group (the plan group's ranks) waits longer than any data collective, so
        # that a rank stuck in one can still reach the comparison after its own timeout
        for ranks in rank_sets(config, 'plan'):
            check = dist.new_group(list(ranks), backend='gloo', timeout=3 * timeout)
            if rank in ranks and len(ranks) > 1:
                ctx.check_group = check
        for name in ('tp', 'dp'):
            for ranks in rank_sets(config, name):
                ctx.add_group(name, ranks)
        if config.ep > 1:
            ctx.add_group('ep', rank_sets(config, 'ep')[0], dist.group.WORLD)
        if ctx.nccl_device is not None and config.tp > 1:    # every rank of each TP group at once
            from lmdeploy_lite.pytorch.backends.cuda.peer_all_reduce import PeerAllReduce
            peer = PeerAllReduce.create(ctx.tp.nccl, config.tp, ctx.nccl_device)
            ctx.groups['tp'] = dataclasses.replace(ctx.tp, peer=peer)
        return ctx

    def add_group(self, name: str, ranks: tuple[int, ...], gloo=None):
        """Create group `name` over `ranks` (gloo, plus its NCCL twin on CUDA; one communicator
        per set of ranks); this rank keeps it if it is a member. Every rank creates every group,
        in the same order (torch.distributed's rule)."""
        timeout = datetime.timedelta(seconds=dist_timeout_s())
        ranks, member = tuple(ranks), self.rank in ranks
        if gloo is None:
            gloo = dist.new_group(list(ranks), backend='gloo', timeout=timeout)
        twins = self.nccl_twins
        if self.nccl_device is not None and len(ranks) > 1 and ranks not in twins:
            twins[ranks] = dist.new_group(
                list(ranks), backend='nccl', timeout=timeout, group_desc=f'lmdeploy_lite_{name}',
                device_id=self.nccl_device if member else None)
        if member:
            self.groups[name] = (Group(self, name, ranks, gloo, twins.get(ranks))
                                 if len(ranks) > 1 else Group(self, name, ranks))

    def draft_context(self, draft: DistConfig) -> 'DistContext | DraftDistContext':
        """The DistContext the MTP draft's layers are built with (DESIGN.md invariant 6): this
        one for the target's layout, else a `DraftDistContext` whose `tp` is the TP group, a
        'draft_tp' sub-group of consecutive ranks (created here: every rank calls this once, at
        the same point of start-up) or a group of one, and whose `ep` is the EP group or one."""
        if draft == self.config:
            return self
        tp = self.config.tp
        if draft.dp != self.config.dp or tp % draft.tp or draft.ep not in (1, self.config.ep):
            raise ValueError(f'draft layout {draft}: needs dp={self.config.dp}, a tp dividing '
                             f'{tp} and ep 1 or {self.config.ep}')
        if 1 < draft.tp < tp and self.world_size > 1:
            for ranks in rank_sets(self.config, draft.tp):
                self.add_group('draft_tp', ranks)
        draft_tp = (self.tp if draft.tp == tp else self.groups['draft_tp'] if draft.tp > 1
                    else Group(self, 'tp', (self.rank,)))
        draft_ep = self.ep if draft.ep > 1 else Group(self, 'ep', (self.rank,))
        return DraftDistContext(self, draft, draft_tp, draft_ep)

    def destroy(self):
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- the trace ------------------------------------------------------------------------
    def traced(self, op: str, group: Group, tensor: torch.Tensor, fn, variable: bool = False):
        """Record (op, group name, shape of `tensor`, dtype) and return `fn(process_group)`: the
        group's NCCL twin for a CUDA tensor, else its gloo group. Errors raised by `fn` become
        CollectiveTimeout naming rank, step and operation."""
        shape = (-1,) + tuple(tensor.shape[1:]) if variable else tuple(tensor.shape)
        entry = (op, group.name, shape, str(tensor.dtype).replace('torch.', ''))
        self.trace.append(entry)
        if self.heartbeat is not None:
            self.heartbeat(True)
        if self.check and not variable and group.name not in TP_LOCAL_GROUPS:
            # a collective across DP ranks whose shapes must agree: compared before it runs,
            # since gloo aborts the process on a size mismatch (vllm-ascend #9689's "8 vs 4")
            self.compare_traces(before=True)
        process_group = group.nccl if tensor.is_cuda and group.nccl is not None else group.gloo
        start = time.monotonic()
        try:
            return fn(process_group)
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
        if self.check and len(self.plan.ranks) > 1:
            self.compare_traces()

    def compare_traces(self, failed: tuple | None = None, before: bool = False):
        """Compare this step's collective sequences across the plan group (on the check group);
        raise CollectiveMismatch on the first difference: every rank must agree on the cross-DP
        collectives (`_cross_dp`), TP peers on everything. `failed`: this rank's collective that
        just failed (marks its trace). `before`: the check before a cross-DP collective, so that
        a rank about to post another one is named before the backend sees it."""
        ranks = self.plan.ranks
        if len(ranks) == 1:
            return
        record = list(self.trace) + ([('<timed out here>',)] if failed else [])
        mine = torch.tensor([int(before), _digest(_cross_dp(record)), _digest(record)],
                            dtype=torch.int64)
        check = self.check_group
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
        ranks = self.plan.ranks
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


TP_LOCAL_GROUPS = ('tp', 'draft_tp')     # groups inside one DP rank's TP group


def _cross_dp(record: list) -> list:
    """What every rank must agree on: the collectives of groups that span DP ranks, shapes
    included (a collective whose first dimension may differ between ranks, an all-to-all's
    payload, is recorded with -1 there: `traced`'s `variable`)."""
    return [e for e in record if len(e) < 4 or e[1] not in TP_LOCAL_GROUPS]


def _digest(record: list) -> int:
    return int.from_bytes(hashlib.sha256(repr(record).encode()).digest()[:8], 'little', signed=True)


class DraftDistContext:
    """The MTP draft's view of its rank's DistContext: the draft's own DistConfig and `tp` / `ep`
    handles (`draft_context`); anything else (rank, step, the trace, ...) is the parent's."""

    def __init__(self, parent: DistContext, config: DistConfig, tp: Group, ep: Group):
        self.parent, self.config, self.tp, self.ep = parent, config, tp, ep

    def __getattr__(self, name: str):
        if name == 'parent':                 # not set yet (copy / unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.parent, name)

    tp_rank = property(lambda self: self.parent.tp_rank % self.config.tp)
    ep_rank = property(lambda self: self.parent.rank if self.config.ep > 1 else 0)
