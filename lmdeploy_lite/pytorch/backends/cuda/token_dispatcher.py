"""DeepEP (V1 API) token dispatch for expert parallelism over NVLink: the `AllToAllDispatcher`
interface (nn/token_dispatcher.py) on DeepEP's kernels.

Two modes, the step's `ForwardSizes.low_latency`, passed to every `dispatch` call:
  * normal (prefill): `dispatch` sends each token once to every rank holding one of its
    experts, with its local expert ids (-1: another rank's) and weights; `combine` sums what
    the ranks send back. No per-rank token limit. Where DeepEP offers `num_worst_tokens`
    (intranode; `SharedBuffer.fixed_normal_rows`) it receives into capacity x ep rows (a rank
    gets a token at most once; unused rows have ids -1): fixed shapes, no host sync; bf16 hands
    them to the experts as `TopKRows`, exact mode expands them to one row per (token, slot).
    Otherwise (internode, or an older DeepEP) the EP forward's remaining host syncs are here,
    eager only: the received row count, and the (token, slot) pairs selected with `nonzero`.
  * low-latency (decode; CUDA-graph capturable, no host sync): `low_latency_dispatch` packs the
    tokens of each local expert into `[num_local_experts, capacity * ep, W]` with a count per
    expert; bf16 hands that to the experts as is (`GroupedRows`, written straight into the
    buffer the combine sends), exact mode `flatten_low_latency`s it into fixed-shape rows, -1
    marking padding; `low_latency_combine` weights and sums. At most `capacity` tokens per rank.

DeepEP's reductions (both combines) and its low-latency kernels take bf16 only, and the
low-latency kernels exist for row widths `LL_WIDTHS` only (narrower rows are zero-padded).
bf16 models use DeepEP as designed. Other dtypes travel exactly, so that every layout gives the
single-GPU numbers: rows are sent as their raw bits (`as_bf16_words`), and each expert output
comes back split into bf16 parts (`split_bf16`, exact) in the column block of its top-k slot,
so DeepEP's sums add zeros only; the router weights are applied at home, in the all-to-all
dispatcher's order. That costs `k * parts` times the combine traffic (fine for the float32
checks it serves; DeepEP is for bf16 serving). float64 is not supported.

ONE deep_ep.Buffer per EP group (`SharedBuffer`) serves every MoE layer of the target and of the
draft: it is made and owned by the models' `EPTransport` (nn/token_dispatcher.py) at start-up,
sized from the plan's capacity, and handed to each dispatcher the transport makes. Dispatchers
register their widest rows when made; the transport allocates the buffer before the KV cache is
planned. It holds no mode, only what its memory is: whether normal kernels left the low-latency
region dirty since it was last cleaned.
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..default.moe import GroupedRows, TopKRows

LL_WIDTHS = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)   # DeepEP's low-latency kernels
_SIGNIFICAND_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}
_TOPK_IDX = torch.int64                                        # deep_ep.topk_idx_t


# ---- pure tensor logic (tested on CPU) ----------------------------------------------------------
def ll_width(columns: int) -> int:
    """The narrowest low-latency row width >= `columns` (bf16 elements)."""
    for width in LL_WIDTHS:
        if width >= columns:
            return width
    raise ValueError(f'DeepEP low-latency rows hold at most {LL_WIDTHS[-1]} bf16 columns, '
                     f'{columns} are needed')


def num_bf16_parts(dtype: torch.dtype) -> int:
    """How many bf16 values sum exactly to one `dtype` value (8 significand bits each)."""
    if dtype not in _SIGNIFICAND_BITS:
        raise ValueError(f'DeepEP dispatch carries bfloat16, float16 or float32, not {dtype}')
    return -(-_SIGNIFICAND_BITS[dtype] // 8)


def split_bf16(x: torch.Tensor, parts: int) -> torch.Tensor:
    """x [..., H] -> [..., parts, H] bf16 whose float32 sum, first to last, is x exactly
    (finite x within bf16's range, which is float32's)."""
    rest, out = x.float(), []
    for _ in range(parts):
        out.append(rest.to(torch.bfloat16))
        rest = rest - out[-1].float()
    return torch.stack(out, dim=-2)


def join_bf16(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `split_bf16`: [..., parts, H] -> [..., H] in `dtype`."""
    total = parts[..., 0, :].float()
    for i in range(1, parts.shape[-2]):
        total = total + parts[..., i, :].float()
    return total.to(dtype)


def as_bf16_words(x: torch.Tensor) -> torch.Tensor:
    """[..., n] of any 2/4/8-byte dtype -> its raw bits as [..., n * itemsize / 2] bf16."""
    return x.contiguous().view(torch.bfloat16)


def flatten_low_latency(recv_x: torch.Tensor, recv_count: torch.Tensor,
                        columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP low-latency output -> expert rows (fixed shapes, no host sync).

    recv_x [E, C, W]: row c of expert e is valid for c < recv_count[e] ([E] int);
    returns rows [E*C, columns] (the first `columns` of each row) and local expert ids [E*C]
    (e for a valid row, -1 for padding)."""
    num_local, slots, _ = recv_x.shape
    valid = torch.arange(slots, device=recv_x.device)[None, :] < recv_count[:, None]
    expert = torch.arange(num_local, device=recv_x.device)[:, None].expand(num_local, slots)
    local_ids = torch.where(valid, expert, -1).reshape(-1)
    return recv_x[..., :columns].reshape(num_local * slots, columns), local_ids


def unflatten_low_latency(rows: torch.Tensor, num_local_experts: int, width: int) -> torch.Tensor:
    """Expert rows [E*C, n] (bf16) -> `[E, C, width]` zero-padded, what `low_latency_combine`
    takes."""
    rows = rows.view(num_local_experts, -1, rows.shape[-1])
    return F.pad(rows, (0, width - rows.shape[-1])).contiguous()


def slot_blocks(values: torch.Tensor, slot: torch.Tensor, top_k: int, parts: int) -> torch.Tensor:
    """values [R, H], slot [R] (0..k-1, the top-k position each row answers) -> [R, k*parts*H]
    bf16: the row's `split_bf16` parts in block `slot`, zeros elsewhere (so that summing the k
    experts' rows of a token adds only zeros to each block)."""
    num_rows, hidden = values.shape
    out = values.new_zeros((num_rows, top_k, parts, hidden), dtype=torch.bfloat16)
    out.scatter_(1, slot.view(-1, 1, 1, 1).expand(-1, 1, parts, hidden),
                 split_bf16(values, parts)[:, None])
    return out.view(num_rows, top_k * parts * hidden)


# ---- the shared buffer ----------------------------------------------------------------------
ENV_QP_DEPTH = 'NVSHMEM_QP_DEPTH'


@dataclass
class SharedBuffer:
    """One deep_ep.Buffer per EP group. `capacity`: tokens per rank per low-latency call (the
    user's number; the buffer rounds it up to a multiple of 4 as DeepEP's TMA needs)."""
    group: object
    num_experts: int
    capacity: int
    normal_bytes: int = 0             # widest normal-mode row, in bytes
    ll_columns: int = 0               # widest low-latency row, in bf16 columns
    buffer: object = None
    ll_dirty: bool = True             # the low-latency region needs a clean before its next use
    fixed_normal: bool | None = None  # `fixed_normal_rows()`, once known

    @property
    def ll_capacity(self) -> int:
        return -(-self.capacity // 4) * 4

    def require(self, normal_bytes: int, ll_columns: int):
        if self.buffer is not None and (normal_bytes > self.normal_bytes
                                        or ll_width(ll_columns) > ll_width(self.ll_columns)):
            raise RuntimeError('a DeepEP dispatcher was built after the shared buffer was '
                               'allocated, with wider rows; build every model first')
        self.normal_bytes = max(self.normal_bytes, normal_bytes)
        self.ll_columns = max(self.ll_columns, ll_columns)

    @property
    def width(self) -> int:
        """The low-latency row width of every call on this buffer (DeepEP's buffer layout
        depends on it, so dispatch and combine of every layer share it)."""
        return ll_width(self.ll_columns)

    def get(self):
        if self.buffer is None:
            self.buffer = self._allocate()
        return self.buffer

    def _allocate(self):
        import deep_ep
        ranks = self.group.size()
        nvl_bytes = max(config.get_nvl_buffer_size_hint(self.normal_bytes, ranks)
                        for config in (deep_ep.Buffer.get_dispatch_config(ranks),
                                       deep_ep.Buffer.get_combine_config(ranks)))
        rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
            self.ll_capacity, self.width, ranks, self.num_experts)
        depth = 1024                      # DeepEP asserts depth >= 2 * (capacity + 1)
        while depth < 2 * (self.ll_capacity + 1):
            depth *= 2
        os.environ[ENV_QP_DEPTH] = str(max(depth, int(os.environ.get(ENV_QP_DEPTH, '0'))))
        return deep_ep.Buffer(self.group, nvl_bytes, rdma_bytes, low_latency_mode=True,
                              num_qps_per_rank=max(1, self.num_experts // ranks))

    def fixed_normal_rows(self) -> bool:
        """The normal dispatch can receive into `num_worst_tokens` rows, with no host sync:
        DeepEP versions that have the argument, intranode only (its docstring says so)."""
        if self.fixed_normal is None:
            buffer = self.get()
            try:
                self.fixed_normal = ('num_worst_tokens' in inspect.signature(buffer.dispatch)
                                     .parameters and buffer.runtime.get_num_rdma_ranks() == 1)
            except (AttributeError, TypeError, ValueError):
                self.fixed_normal = False
        return self.fixed_normal

    def check_capacity(self, num_tokens: int, dist_ctx):
        """Raise unless a low-latency call of `num_tokens` tokens per rank (the plan's) fits."""
        if num_tokens > self.capacity:
            raise ValueError(
                f'DeepEP low-latency dispatch at step {dist_ctx.step}: the plan has '
                f'{num_tokens} tokens per rank (rank {dist_ctx.rank}), but the buffer holds '
                f'{self.capacity} per rank (DEEPEP_MAX_TOKENS_PER_RANK, default max_batch_size '
                f'x (1 + num_speculative_tokens)); raise it or lower max_batch_size')

    def clean_low_latency(self, dist_ctx):
        """Clean the low-latency region if normal kernels dirtied it (every rank at the same
        point: they run the same dispatches). A traced collective (allocates the buffer if
        needed) whose GPU-side wait is bounded where the host next waits for the step (Engine's
        InFlight.host_result deadline). Not inside a graph capture."""
        buffer = self.get()
        if not self.ll_dirty:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError('DeepEP: the low-latency region must be clean before a CUDA graph '
                               'is captured (EPTransport.prepare first)')
        dist_ctx.ep.traced('deepep_clean', torch.empty(0, dtype=torch.uint8), lambda _: (
            buffer.clean_low_latency_buffer(self.ll_capacity, self.width, self.num_experts)))
        self.ll_dirty = False


# ---- the dispatcher -------------------------------------------------------------------------
def _ll_columns(hidden_size: int, top_k: int, dtype: torch.dtype) -> int:
    """bf16 columns of a low-latency row: the hidden state (bf16), or in exact mode the wider
    of (raw bits of x + the token's int64 top-k ids) and (k slot blocks of split parts)."""
    if dtype == torch.bfloat16:
        return hidden_size
    parts = num_bf16_parts(dtype)
    return max(hidden_size * dtype.itemsize // 2 + 4 * top_k, top_k * parts * hidden_size)


@dataclass
class NormalHandle:
    deep_ep_handle: tuple
    token: torch.Tensor          # [R] received token (row of recv_x) of each expert row
    slot: torch.Tensor           # [R] its top-k position
    weight: torch.Tensor         # [R] its router weight (float32)
    num_received: int
    topk_weights: torch.Tensor   # [T, k] this rank's tokens' weights (exact mode)
    fixed: bool = False          # fixed shapes (num_worst_tokens): token/slot/weight unused


@dataclass
class LowLatencyHandle:
    deep_ep_handle: tuple
    topk_ids: torch.Tensor       # [T, k] int64
    topk_weights: torch.Tensor   # [T, k]
    slot: torch.Tensor | None    # [E*C] top-k position of each row (exact mode)
    send: torch.Tensor | None = None   # [E, C, W] bf16: the experts' output buffer (bf16 mode)


class DeepEPDispatcher:
    """One MoE layer's dispatch over `shared`, the EP group's buffer (its capacity: tokens per
    rank a low-latency call holds)."""

    @staticmethod
    def unsupported(hidden_size: int, top_k: int, dtype: torch.dtype) -> str | None:
        """Why DeepEP cannot carry this layer's rows (None: it can)."""
        try:
            ll_width(_ll_columns(hidden_size, top_k, dtype))
        except ValueError as e:
            return str(e)
        return None

    def __init__(self, dist_ctx, num_experts: int, hidden_size: int, top_k: int,
                 dtype: torch.dtype, shared: SharedBuffer):
        self.dist, self.group = dist_ctx, dist_ctx.ep
        self.ep_size = dist_ctx.config.ep
        self.num_experts, self.hidden, self.top_k = num_experts, hidden_size, top_k
        self.experts_per_rank = num_experts // self.ep_size
        self.first_expert = dist_ctx.ep_rank * self.experts_per_rank
        self.exact = dtype != torch.bfloat16
        self.parts = num_bf16_parts(dtype)
        ll_columns = _ll_columns(hidden_size, top_k, dtype)
        ll_width(ll_columns)                              # fail now if rows cannot fit
        normal_bytes = hidden_size * dtype.itemsize
        if self.exact:
            normal_bytes = max(normal_bytes, 2 * top_k * self.parts * hidden_size)
        self.shared = shared
        shared.require(normal_bytes, ll_columns)

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 capacity: int, low_latency: bool = False):
        """As `AllToAllDispatcher.dispatch`; the routing: local ids [R] (-1: padding row),
        `TopKRows` (bf16 fixed normal) or, bf16 low-latency, `GroupedRows` with expert_x
        [E_local, C, H] a view of DeepEP's receive buffer. DeepEP wants contiguous inputs."""
        if x.shape[0] > capacity:
            raise ValueError(f'EP dispatch: {x.shape[0]} tokens on rank {self.dist.rank} at step '
                             f'{self.dist.step}, but the plan\'s capacity is {capacity} per rank')
        x, topk_ids, topk_weights = x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous()
        if low_latency:
            self.shared.check_capacity(capacity, self.dist)
            self.shared.clean_low_latency(self.dist)       # no-op unless normal kernels ran
            return self._dispatch_low_latency(x, topk_ids, topk_weights)
        self.shared.ll_dirty = True
        return self._dispatch_normal(x, topk_ids, topk_weights, capacity)

    def combine(self, expert_out: torch.Tensor, handle) -> torch.Tensor:
        """expert_out ([R, H] or [E_local, C, H], as dispatch's expert_x) -> [T, H] = sum over
        each token's k experts of weight * output."""
        if isinstance(handle, LowLatencyHandle):
            return self._combine_low_latency(expert_out, handle)
        return self._combine_normal(expert_out, handle)

    # ---- normal mode ----------------------------------------------------------------------
    def _dispatch_normal(self, x, topk_ids, topk_weights, capacity: int):
        buffer = self.shared.get()
        topk_idx = topk_ids.to(_TOPK_IDX)
        send = x.contiguous() if self.exact else x.to(torch.bfloat16)
        worst = capacity * self.ep_size if self.shared.fixed_normal_rows() else 0
        fixed = {'num_worst_tokens': worst} if worst else {}

        def run(_):
            per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(
                topk_idx, self.num_experts)
            return buffer.dispatch(
                send, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
                is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                topk_weights=topk_weights.float(), **fixed)
        recv_x, recv_idx, recv_weights, _, deep_ep_handle, _ = self.group.traced(
            'deepep_dispatch', send, run, variable=True)
        if worst:
            return self._fixed_rows(recv_x, recv_idx, recv_weights, deep_ep_handle, x.dtype,
                                    topk_weights)
        token, slot = (recv_idx >= 0).nonzero(as_tuple=True)         # host sync: prefill only
        handle = NormalHandle(deep_ep_handle, token, slot, recv_weights[token, slot],
                              recv_x.shape[0], topk_weights)
        return recv_x[token].to(x.dtype), recv_idx[token, slot], handle

    def _fixed_rows(self, recv_x, recv_idx, recv_weights, deep_ep_handle, dtype, topk_weights):
        """num_worst_tokens' output (N rows, ids -1 past the received ones, whose rows hold
        stale data: zeroed) -> bf16: the tokens as `TopKRows`; exact: one row per (token,
        slot), [N * k, H] with local ids [N * k]. Fixed shapes, no host sync."""
        num_rows, top_k = recv_idx.shape
        handle = NormalHandle(deep_ep_handle, None, None, None, num_rows, topk_weights, True)
        valid = recv_idx >= 0
        if not self.exact:
            rows = torch.where(valid.any(1, keepdim=True), recv_x, 0).to(dtype)
            return rows, TopKRows(recv_idx, torch.where(valid, recv_weights, 0)), handle
        rows = recv_x.to(dtype).repeat_interleave(top_k, dim=0)
        rows = torch.where(valid.reshape(-1, 1), rows, 0)
        return rows, recv_idx.reshape(-1), handle

    def _combine_normal(self, expert_out, handle: NormalHandle):
        buffer = self.shared.get()
        if handle.fixed:      # exact: rows in (token, slot) order; bf16: weighted sums already
            send = (split_bf16(expert_out, self.parts).view(handle.num_received, -1)
                    if self.exact else expert_out.to(torch.bfloat16))
        elif self.exact:        # each (token, slot) output in its own block: the sums add zeros
            send = expert_out.new_zeros((handle.num_received, self.top_k, self.parts,
                                         self.hidden), dtype=torch.bfloat16)
            send[handle.token, handle.slot] = split_bf16(expert_out, self.parts)
            send = send.view(handle.num_received, -1)
        else:                 # this rank's weighted partial sums, one slot at a time
            partial = expert_out.new_zeros((handle.num_received, self.hidden), dtype=torch.float32)
            for k in range(self.top_k):        # one row per token per slot: deterministic
                rows = (handle.slot == k).nonzero(as_tuple=True)[0]
                partial.index_add_(0, handle.token[rows],
                                   expert_out[rows].float() * handle.weight[rows, None])
            send = partial.to(torch.bfloat16)
        combined = self.group.traced(
            'deepep_combine', send, lambda _: buffer.combine(send, handle.deep_ep_handle),
            variable=True)[0]
        if not self.exact:
            return combined.to(expert_out.dtype)
        return self._weighted_sum(combined, expert_out.dtype, handle.topk_weights)

    # ---- low-latency mode -----------------------------------------------------------------
    def _dispatch_low_latency(self, x, topk_ids, topk_weights):
        buffer, width = self.shared.get(), self.shared.width
        topk_idx = topk_ids.to(_TOPK_IDX)
        if self.exact:        # raw bits of x, then of the token's top-k ids (to find the slot)
            payload = torch.cat([as_bf16_words(x), as_bf16_words(topk_idx)], dim=1)
        else:
            payload = x.to(torch.bfloat16)
        send = F.pad(payload, (0, width - payload.shape[1]))
        recv_x, recv_count, deep_ep_handle, _, _ = self.group.traced(
            'deepep_ll_dispatch', send, lambda _: buffer.low_latency_dispatch(
                send, topk_idx, self.shared.ll_capacity, self.num_experts, use_fp8=False),
            variable=True)
        if not self.exact:    # bf16: the experts read and write [E, C, *] as DeepEP keeps it
            send = torch.empty_like(recv_x)                          # [E, C, W]
            return (recv_x[..., :self.hidden], GroupedRows(recv_count, send),
                    LowLatencyHandle(deep_ep_handle, topk_idx, topk_weights, None, send))
        x_words = self.hidden * x.dtype.itemsize // 2
        rows, local_ids = flatten_low_latency(recv_x, recv_count, x_words + 4 * self.top_k)
        valid = (local_ids >= 0)[:, None]         # padding rows hold stale bits: zero them
        expert_x = torch.where(valid, rows[:, :x_words].contiguous().view(x.dtype), 0)
        ids = rows[:, x_words:].contiguous().view(_TOPK_IDX)                 # [R, k]
        expert = local_ids.clamp(min=0) + self.first_expert
        slot = (ids == expert[:, None]).int().argmax(dim=1)                  # padding rows: any
        return expert_x, local_ids, LowLatencyHandle(deep_ep_handle, topk_idx, topk_weights, slot)

    def _combine_low_latency(self, expert_out, handle: LowLatencyHandle):
        buffer, width = self.shared.get(), self.shared.width
        if self.exact:
            rows = slot_blocks(expert_out, handle.slot, self.top_k, self.parts)
            weights = torch.ones_like(handle.topk_weights, dtype=torch.float32)
            send = unflatten_low_latency(rows, self.experts_per_rank, width)
        else:
            # The experts wrote columns :H of `send` (FusedExperts.run); another expert_out is
            # copied in. Columns H..W and rows past an expert's count stay garbage (maybe NaN):
            # DeepEP's combine (no LogFMT) sums every column on its own and reads only the rows
            # dispatch filled, so garbage lands only in columns >= H, sliced off below.
            send, weights = handle.send, handle.topk_weights.float()
            if expert_out.data_ptr() != send.data_ptr():
                send[..., :self.hidden].copy_(expert_out)
        combined = self.group.traced(
            'deepep_ll_combine', send, lambda _: buffer.low_latency_combine(
                send, handle.topk_ids, weights, handle.deep_ep_handle),
            variable=True)[0]
        if not self.exact:
            return combined[:, :self.hidden].to(expert_out.dtype)
        return self._weighted_sum(combined, expert_out.dtype, handle.topk_weights)

    def _weighted_sum(self, combined, dtype: torch.dtype, topk_weights: torch.Tensor):
        """Exact mode: combined [T, >= k * parts * H] bf16 (each slot's parts in its own block)
        -> [T, H] in `dtype`, weighted and summed in the all-to-all dispatcher's order."""
        columns = self.top_k * self.parts * self.hidden
        pairs = join_bf16(combined[:, :columns].reshape(-1, self.top_k, self.parts, self.hidden),
                          dtype)
        return (pairs * topk_weights[..., None]).sum(1)
