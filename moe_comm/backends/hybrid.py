"""The hybrid path over a scale-up backend (DESIGN 8.3, issue 15): what `Buffer(backend="cuda")` runs when the group
spans several hosts. (Over 400 lines: fresh dispatch, cached dispatch and both combines of one path, which share
the layout.) The group is `S` hosts of `U` ranks, rank `r = h * U + u` on host h with local index u. Two legs:
- scale-out: the ranks of one local index on every host (a "rail"), a `torch.distributed` subgroup: one
  `all_to_all_single` per exchange (NCCL on GPUs: the network between hosts, on the stream, no host sync);
- scale-up: the ranks of one host, an inner `moe_comm.Buffer` on that subgroup (the CUDA backend's NVLink kernels on
  GPUs; the reference backend in the CPU tests, which run this module's logic on gloo).

Shape legend (as `torch_ref`, and): S = hosts, U = ranks per host, cap = num_max_tokens_per_rank, F = scale-out rows
that arrive at a forwarder, space = S * cap rows of a forwarder space, M = token rows a rank receives (P: its output
rows, expand rows included), T = terms of a token's combine.

Fresh dispatch (me = (h0, u0)):
1. Each token goes once to every host that owns one of its experts (dedup per host), to the rank of its local index
   there, its "forwarder", with its expert ids relative to that host (-1 for slots elsewhere). The rows for a host
   are a block of the scale-out send, in token order; with a CPU sync the blocks hold exactly those tokens (the
   counts go round with the flags and the call's signature, one exchange and one host read), without one `cap` rows
   each.
2. The forwarder places each arrived row at row `h * cap + t` of its forwarder space (source host h, source token t)
   and dispatches that space inside its host: experts `U * L` relative to the host, `space` tokens. Without a CPU
   sync the sources put token t at row t of each block, so the arrived blocks are that space as they are.
3. A receiver then holds rows grouped by forwarder u', each group in (h, t) order; the direct path's order is by
   source rank `h * U + u'`, then t. With `U > 1` the receiver sorts its rows by host, stably (expand: by (expert,
   host), with the host of each expanded row read from a 16-byte cached dispatch of forwarder rows), once per layout;
   the handle keeps the gather index. Outputs and handle tensors are the direct path's, bit for bit.
A cached dispatch moves rows along the same positions (scale-out, forwarder space, inner cached dispatch, gather).

Combine: the rows go back through the inner combine to the forwarders, cross back once on the positions they came
by, and the source adds from zero, then `bias[0]`, `bias[1]`, and rounds once. Two ways (`Buffer` arguments):
- partial sums (`allow_multiple_reduction` and not `deterministic`): the inner combine runs in the accumulation
  precision (FP32; FP64 for float64 rows), so a forwarder holds per token its host's rows added from zero in DESIGN
  2.2's order, unrounded; one such row per (token, host) crosses, and the source adds them in ascending host order.
  Bitwise the reference's hybrid partial sums (`torch_hybrid`), within FP32 rounding of the direct path.
- terms (`deterministic=True` or `allow_multiple_reduction=False`): the inner combine returns each token's rows
  unsummed (`CombineCall.unreduced`: a term per rank of the host, expand a term per slot), all of a (token, host)'s
  term slots cross in the rows' dtype (absent ones too: U per (token, host), expand K), and the source adds the
  present terms in DESIGN 2.2's order: bitwise the direct path's result.

Costs against the direct path: two scale-out exchanges per dispatch (rows, and a float64 side row: source index, ids,
weights, FP8 scales), one per combine; with a CPU sync a copy into the forwarder space per dispatch and a gather out
of it per combine (without one, none: the blocks are the space); with `U > 1` one gather of the
received rows per dispatch and combine; partial sums move FP32 rows on the inner leg and across; terms move U (expand
K) rows per (token, host) across, present or not, and the source adds them in one pass each.
Ranks that disagree: checked with the counts in a dispatch with a CPU sync, on the CPU at every call, and inside a
host by the inner backend; a dispatch without a CPU sync compares the signatures its count exchange carries on the
device, and the next synchronizing call (a dispatch with a sync, `barrier()`) raises; `MOE_COMM_CHECK_INPUTS=1`
checks every call before anything moves. A scale-out wait that never ends: on GPUs NCCL's
timeout of the leg's subgroup, `num_gpu_timeout_secs` (NCCL's watchdog then ends the process), except a fresh
dispatch's count exchange and the agreement checks, which run on the caller's group under its own timeout (set at
`init_process_group` / `new_group`); on the CPU `num_cpu_timeout_secs`, naming rank, phase and rail.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..handle import EPHandle
from ..layout import SIGNATURE_LEN
from .common import Backend, accumulation_dtype, disagreement, forget_dead_groups, subgroup_of

MAX_SIGNATURES = 64  # signature tensors kept on the device per buffer (one per call shape)

# Subgroups per (group, hosts, ranks per host, timeout): a Buffer made again on the same group (Megatron's cache
# grows its buffers) reuses them instead of creating communicators without end. Keyed by the group object itself:
# a group made after `destroy_process_group` may reuse a name.
_LEG_GROUPS: dict[tuple, tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def leg_groups(group: dist.ProcessGroup, device: torch.device, num_hosts: int, ranks_per_host: int,
               timeout_secs: float) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """`(host_group, rail_group)` of this rank: the ranks of its host, and the ranks of its local index on every host,
    with `group`'s NCCL traffic class (`Buffer(sl_idx=...)`) and `timeout_secs` (NCCL's watchdog). Collective over
    `group` (`subgroup_of`)."""
    S, U = num_hosts, ranks_per_host
    key = (group, S, U, timeout_secs)
    if key not in _LEG_GROUPS:
        forget_dead_groups(_LEG_GROUPS)
        hosts = [[h * U + u for u in range(U)] for h in range(S)]
        rails = [[h * U + u for h in range(S)] for u in range(U)]
        _LEG_GROUPS[key] = tuple(subgroup_of(group, device, split, timeout_secs) for split in (hosts, rails))
    return _LEG_GROUPS[key]


def _gather(t, index: Optional[torch.Tensor]):
    """Rows `index` of a tensor, of both parts of an FP8 tuple, or None; `index` None: unchanged."""
    if index is None or t is None:
        return t
    if isinstance(t, tuple):
        return tuple(part.index_select(0, index) for part in t)
    return t.index_select(0, index)


@dataclass(eq=False)
class HybridLayout:
    """Routing state of the hybrid path, kept in `EPHandle.layout` (private to the backend).

    inner: the inner (scale-up) dispatch's handle, over this host's forwarder spaces.
    rail_send_splits / rail_recv_splits: rows per host of the scale-out leg (source side / forwarder side).
    rows_NS: `[N, S]` scale-out send row of each token for each host; `sum(rail_send_splits)` (one past the last)
        where it does not go.
    send_token: `[sum(rail_send_splits)]` source token of each scale-out send row (0 for rows that hold none).
    fwd_row: `[F]` forwarder-space row of each arrived scale-out row, -1: a row that holds none; None when the
        arrived rows are the forwarder space (without a CPU sync).
    order: `[P]` inner output row of each output row, None when the orders agree (one rank per host).
    inverse: `[P]` output row of each inner output row (the combine's gather), None likewise.
    """

    inner: EPHandle
    rail_send_splits: list[int]
    rail_recv_splits: list[int]
    rows_NS: torch.Tensor
    send_token: torch.Tensor
    fwd_row: Optional[torch.Tensor]
    order: Optional[torch.Tensor]
    inverse: Optional[torch.Tensor]


class HybridBackend(Backend):
    """`Buffer(backend="cuda")` across hosts: the scale-out leg over a rail subgroup, the scale-up leg through an inner
    Buffer on this rank's host (module docstring).

    Arguments:
        group, device, num_cpu_timeout_secs: as `Backend`.
        num_hosts, ranks_per_host: S and U (rank r on host r // U).
        use_partial_reduction: sum a token's rows inside a host before they cross (else every term crosses alone).
        num_gpu_timeout_secs: NCCL's timeout on the legs' subgroups.
        make_inner: builds the inner Buffer on the host subgroup it is given (collective over that subgroup).
    """

    supports_recv_hook = False  # the legs run one after another: nothing is left in flight to receive later

    def __init__(self, group: dist.ProcessGroup, device: torch.device, num_cpu_timeout_secs: float, num_hosts: int,
                 ranks_per_host: int, use_partial_reduction: bool, num_gpu_timeout_secs: float,
                 make_inner: Callable[[dist.ProcessGroup], object]) -> None:
        super().__init__(group, device, num_cpu_timeout_secs)
        S, U = num_hosts, ranks_per_host
        if S * U != self.num_ranks:
            raise ValueError(f"{S} hosts x {U} ranks != the group's {self.num_ranks} ranks")
        self.num_hosts, self.ranks_per_host = S, U
        self.h0, self.u0 = divmod(self.rank, U)
        self.rail_peers = [h * U + self.u0 for h in range(S)]
        self.host_group, self.rail_group = leg_groups(group, device, S, U, num_gpu_timeout_secs)
        self.inner = make_inner(self.host_group)
        self.use_partial_reduction = use_partial_reduction
        # Handles of the reference's hybrid path and of this one have different layouts, and partial sums another
        # combine: the name keeps them apart.
        self.name = (f"cuda hybrid {S}x{U}" if self.inner.backend == "cuda" else
                     f"hybrid {S}x{U} over {self.inner.backend}") + (" partial sums" if use_partial_reduction else "")
        # On the CPU every exchange blocks the host anyway: check every call's agreement (as the reference does).
        self.checks_every_call = device.type == "cpu"
        # A fresh dispatch's signature on the device, per call shape: made once, so later calls copy nothing from
        # the host (no sync, and capturable in a CUDA graph after a first call).
        self._signatures: dict[tuple[int, ...], torch.Tensor] = {}
        # Ranks that disagreed in a dispatch without CPU sync (their signatures crossed with its counts): a flag and
        # the first such call's signatures, on the device until a synchronizing call raises them.
        self._pending_disagree = torch.zeros(1, dtype=torch.int64, device=device)
        self._pending_signatures = torch.zeros(self.num_ranks, SIGNATURE_LEN, dtype=torch.int64, device=device)

    def connect(self) -> None:
        """Nothing left to map: the inner Buffer connected when it was made."""

    def close(self) -> None:
        self.inner.destroy()

    def after_host_sync(self, synchronized: bool = False) -> None:
        super().after_host_sync(synchronized)
        self.inner._impl.after_host_sync(synchronized)  # what the inner backend recorded on the device

    # ------------------------------------------------------------------------------------------------
    # Exchanges
    # ------------------------------------------------------------------------------------------------
    def gather_values(self, mine: torch.Tensor, phase: str) -> torch.Tensor:
        everyone = [torch.empty_like(mine) for _ in range(self.num_ranks)]  # the list form: gloo takes CUDA tensors
        work = dist.all_gather(everyone, mine, group=self.group, async_op=True)
        self._wait([(work, f"rank {self.rank} {phase}")])
        return torch.stack(everyone)

    def _rail(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], phase: str,
              zero_row: bool = False) -> torch.Tensor:
        """The scale-out leg: `send`'s block h (`send_splits[h]` rows) to this rank's rail peer on host h; returns the
        blocks that arrive, host by host, and with `zero_row` one more row of zeros after them."""
        total = sum(recv_splits)
        recv = send.new_empty(total + int(zero_row), *send.shape[1:])
        recv[total:] = 0
        work = dist.all_to_all_single(recv[:total], send, recv_splits, send_splits, group=self.rail_group,
                                      async_op=True)
        self._wait([(work, f"rank {self.rank} {phase} (scale-out leg, with ranks {self.rail_peers})")])
        return recv

    def _to_forwarders(self, rows: torch.Tensor, side: Optional[torch.Tensor], send_token: torch.Tensor,
                       send_splits: list[int], recv_splits: list[int], phase: str):
        """Rows (as bytes) and a float64 side row each along the scale-out leg: `(rows, side)` as they arrived,
        `side` None when there is none."""
        raw = rows.view(torch.uint8)
        send = raw.index_select(0, send_token) if raw.shape[0] else raw.new_zeros(sum(send_splits), raw.shape[1])
        arrived = self._rail(send, send_splits, recv_splits, f"{phase} rows")
        return arrived, None if side is None else self._rail(side, send_splits, recv_splits, f"{phase} side rows")

    def _forwarder_space(self, arrived: torch.Tensor, fwd_row: Optional[torch.Tensor], space: int, dtype: torch.dtype,
                         scales_in: Optional[torch.Tensor], scales_dtype: Optional[torch.dtype]):
        """The inner dispatch's input: arrived rows at their forwarder-space rows (rows that hold none: any bytes);
        `fwd_row` None: the arrived rows are the space."""
        if fwd_row is None:
            x = arrived.view(dtype)
            return x if scales_in is None else (x, scales_in.to(scales_dtype).contiguous())
        rows = torch.where(fwd_row >= 0, fwd_row, space)  # a spare last row takes what holds none
        x = arrived.new_empty(space + 1, arrived.shape[1]).index_copy_(0, rows, arrived)[:space].view(dtype)
        if scales_in is None:
            return x
        scales = scales_in.new_zeros(space + 1, scales_in.shape[1]).index_copy_(0, rows, scales_in)[:space]
        return x, scales.to(scales_dtype)

    def _inner_dispatch(self, c, x_F, **fields):
        """A dispatch on the inner backend, built from the outer call `c` (valid by construction, so the inner
        Buffer's argument checks are skipped: a host can own fewer experts than a token has slots, the slots
        elsewhere being -1). `fields` replace the call's; returns the inner backend's 5 outputs."""
        fp8 = isinstance(x_F, tuple)
        call = dataclasses.replace(
            c, x=None if fp8 else x_F, fp8_q=x_F[0] if fp8 else None, fp8_scales=x_F[1] if fp8 else None,
            quantize=None, previous_event=None, async_with_compute_stream=False, allocate_on_comm_stream=False,
            plan=None, **fields)
        return self.inner._impl.dispatch(call, agreed=False)

    # ------------------------------------------------------------------------------------------------
    # Dispatch
    # ------------------------------------------------------------------------------------------------
    def dispatch_steps(self, c, agreed: bool):
        return self._fresh_dispatch(c) if c.handle is None else self._cached_dispatch(c)

    def _fresh_dispatch(self, c):
        R, S, U = self.num_ranks, self.num_hosts, self.ranks_per_host
        L, K, N, cap = c.num_experts // R, c.num_topk, c.num_tokens, c.num_max_tokens_per_rank
        i64 = dict(dtype=torch.int64, device=self.device)
        clean, flags = self.sanitize_topk_idx(c.topk_idx, c.num_experts)
        host_NK = torch.where(clean >= 0, clean // (U * L), S)
        in_host_NS = torch.zeros(N, S + 1, dtype=torch.bool, device=self.device).scatter_(1, host_NK, True)[:, :S]

        # Every rank's error flags, the rows it sends each host, its call's signature: read with a CPU sync (one
        # exchange, one host read), else the flags wait for the next synchronizing call. The scale-out send's row
        # of each (token, host), `total` (a spare row) where it does not go: with a sync, a block holds its host's
        # tokens in order; without one a block has `cap` rows whatever it holds, so token t takes row t, and the
        # blocks that arrive are the forwarder space as they are (no copy into it).
        signature = self._signature_tensor(c.signature())
        table = self.gather_values(torch.cat([flags.view(1), in_host_NS.long().sum(0), signature]),
                                   "dispatch count exchange")
        if c.do_cpu_sync:
            rail_send, rail_recv = self._read_table(c, table)
            send_starts = torch.tensor([sum(rail_send[:h]) for h in range(S)], **i64)  # after the host read
            recv_starts = torch.tensor([sum(rail_recv[:h]) for h in range(S)], **i64)
            rows_NS = torch.where(in_host_NS, send_starts + in_host_NS.long().cumsum(0) - 1, sum(rail_send))
        else:
            torch.bitwise_or(self.pending_flags, table[:, 0], out=self.pending_flags)
            self._note_disagreement(table[:, S + 1:])
            rail_send = rail_recv = [cap] * S
            send_starts = recv_starts = torch.arange(S, **i64) * cap
            rows_NS = torch.where(in_host_NS, send_starts + torch.arange(N, **i64)[:, None], S * cap)

        # Scale-out send, then the forwarder's inner dispatch, then the receiver's order.
        total = sum(rail_send)
        send_token, side, rows, scales = self._scale_out_send(c, clean, rows_NS, send_starts, total)
        arrived, side_in = self._to_forwarders(rows, side, send_token, rail_send, rail_recv, "dispatch")
        fwd_row, (recv_x, _, recv_w, inner, _) = self._forward(c, arrived, side_in, recv_starts, rows.dtype, scales)
        recv_src_idx, recv_idx, per_rank, order_M = self._received_tokens(inner, cap)
        order = self._expand_order(c, inner, cap) if c.do_expand and U > 1 else order_M
        inverse = None if order is None else torch.empty_like(order).scatter_(
            0, order, torch.arange(order.shape[0], **i64))
        recv_w = _gather(recv_w, order)
        self.epoch += 1
        handle = EPHandle.make(
            group=self.group, backend=self.name, epoch=self.epoch, num_experts=c.num_experts, num_topk=K,
            num_tokens=N, num_max_tokens_per_rank=cap, do_expand=c.do_expand, expert_alignment=c.expert_alignment,
            num_sms=c.num_sms, do_cpu_sync=c.do_cpu_sync, topk_idx=clean, recv_src_idx=recv_src_idx,
            recv_topk_idx=recv_idx, recv_topk_weights=recv_w, psum_num_recv_tokens_per_rank=per_rank.cumsum(0),
            psum_num_recv_tokens_per_expert=inner.psum_num_recv_tokens_per_expert,
            num_recv_tokens=inner.num_recv_tokens,
            num_recv_tokens_per_expert_list=inner.num_recv_tokens_per_expert_list,
            num_recv_rows=inner.num_recv_rows,
            layout=HybridLayout(inner=inner, rail_send_splits=rail_send, rail_recv_splits=rail_recv, rows_NS=rows_NS,
                                send_token=send_token, fwd_row=fwd_row, order=order, inverse=inverse))
        return (_gather(recv_x, order), None if c.do_expand else recv_idx, recv_w, handle), [], []

    def _signature_tensor(self, signature: list[int]) -> torch.Tensor:
        key = tuple(signature)
        if key not in self._signatures:
            if len(self._signatures) >= MAX_SIGNATURES:
                self._signatures.clear()
            self._signatures[key] = torch.tensor(signature, dtype=torch.int64, device=self.device)
        return self._signatures[key]

    def _note_disagreement(self, signatures: torch.Tensor) -> None:
        """A dispatch without CPU sync: whether its ranks' `signatures` (`[R, words]`) differ, kept on the device
        (the first such call's rows too) for the next synchronizing call (`check_pending_errors`). Calls whose
        ranks disagree may exchange blocks of equal sizes and return wrong rows; nothing else would notice."""
        differ = (signatures != signatures[:1]).any().view(1).long()
        first = (differ > self._pending_disagree).view(1, 1)
        torch.where(first, signatures, self._pending_signatures, out=self._pending_signatures)
        torch.bitwise_or(self._pending_disagree, differ, out=self._pending_disagree)

    def check_pending_errors(self) -> None:
        """At a synchronizing call: ranks that disagreed in an earlier dispatch without CPU sync, then the slots
        such dispatches dropped (the same error on every rank)."""
        if self._pending_disagree.item():
            rows = self._pending_signatures.tolist()
            self._pending_disagree.zero_()
            raise ValueError(f"{disagreement(rows)} (in an earlier dispatch without CPU sync, across hosts: its "
                             f"outputs and those of the calls after it are not valid)")
        super().check_pending_errors()

    def _read_table(self, c, table: torch.Tensor) -> tuple[list[int], list[int]]:
        """With a CPU sync: read the count exchange, raise for ranks that disagree and for bad routing (the same
        error on every rank), and return the rows this rank sends each host and receives from each."""
        R, S, U = self.num_ranks, self.num_hosts, self.ranks_per_host
        values = torch.cat([table.flatten(), self.pending_flags, self._pending_disagree]).tolist()
        self.after_host_sync(synchronized=True)
        width = table.shape[1]
        rows_R = [values[r * width:(r + 1) * width] for r in range(R)]
        problem = disagreement([row[S + 1:] for row in rows_R])
        if problem:
            raise ValueError(problem)
        if any(values[R * width:]):
            self.check_pending_errors()
        self.raise_for_flags([row[0] for row in rows_R], c.topk_idx, c.num_experts, "")
        return rows_R[self.rank][1:S + 1], [rows_R[h * U + self.u0][1 + self.h0] for h in range(S)]

    def _scale_out_send(self, c, clean: torch.Tensor, rows_NS: torch.Tensor, send_starts: torch.Tensor, total: int):
        """A block per host of the scale-out send, its tokens in order: `(send_token, side, rows, scales)`. The
        float64 side row carries the source token, the ids relative to that host (-1: elsewhere, or a row that holds
        no token), the weights, the FP8 scales (all exact in a double)."""
        U, L, K, N = self.ranks_per_host, c.num_experts // self.num_ranks, c.num_topk, c.num_tokens
        i64 = dict(dtype=torch.int64, device=self.device)
        src_N = torch.arange(N, **i64)
        flat = rows_NS.flatten()
        send_token = torch.zeros(total + 1, **i64).scatter_(0, flat, src_N.repeat_interleave(self.num_hosts))[:total]
        sent = torch.zeros(total + 1, dtype=torch.bool, device=self.device).index_fill_(0, flat, True)[:total]
        host_row = torch.bucketize(torch.arange(total, **i64), send_starts, right=True) - 1
        ids = clean.index_select(0, send_token) if N else clean.new_full((total, K), -1)
        mine = (ids >= 0) & (ids // (U * L) == host_row[:, None]) & sent[:, None]
        side = [torch.where(sent, send_token, -1)[:, None], torch.where(mine, ids - host_row[:, None] * U * L, -1)]
        rows, scales = self._wire(c)
        for extra in (c.topk_weights, scales):
            if extra is not None:
                side.append(extra.index_select(0, send_token) if N else extra.new_zeros(total, extra.shape[1]))
        return send_token, torch.cat([t.to(torch.float64) for t in side], 1), rows, scales

    def _forward(self, c, arrived: torch.Tensor, side_in: torch.Tensor, recv_starts: torch.Tensor,
                 dtype: torch.dtype, scales: Optional[torch.Tensor]):
        """The forwarder: arrived rows at rows h * cap + t of its space, dispatched inside the host. Returns
        `(fwd_row, the inner dispatch's outputs)`, `fwd_row` None when the arrived rows are the space (no CPU
        sync: the sources sent token t at row t of each block; rows that hold none carry ids -1)."""
        S, U, K, cap = self.num_hosts, self.ranks_per_host, c.num_topk, c.num_max_tokens_per_rank
        space, host_experts = S * cap, U * (c.num_experts // self.num_ranks)
        i64 = dict(dtype=torch.int64, device=self.device)
        ids_in = side_in[:, 1:K + 1].long()
        w_in = None if c.topk_weights is None else side_in[:, K + 1:2 * K + 1].to(c.topk_weights.dtype)
        if c.do_cpu_sync:
            fwd_host = torch.bucketize(torch.arange(side_in.shape[0], **i64), recv_starts, right=True) - 1
            src_in = side_in[:, 0].long()
            fwd_row = torch.where(src_in >= 0, fwd_host * cap + src_in, -1)
            spare = torch.where(fwd_row >= 0, fwd_row, space)
            idx_F = torch.full((space + 1, K), -1, **i64).index_copy_(0, spare, ids_in)[:space]
            w_F = None if w_in is None else w_in.new_zeros(space + 1, K).index_copy_(0, spare, w_in)[:space]
        else:
            fwd_row, idx_F, w_F = None, ids_in.contiguous(), None if w_in is None else w_in.contiguous()
        scales_in = None if scales is None else side_in[:, side_in.shape[1] - scales.shape[1]:]
        x_F = self._forwarder_space(arrived, fwd_row, space, dtype, scales_in, None if scales is None else scales.dtype)
        return fwd_row, self._inner_dispatch(c, x_F, topk_idx=idx_F, topk_weights=w_F, num_experts=host_experts,
                                             num_tokens=space, num_max_tokens_per_rank=space, handle=None)

    def _received_tokens(self, inner: EPHandle, cap: int):
        """The receiver's token rows in the direct path's order: `(recv_src_idx, recv_topk_idx, rows per source rank,
        order)`, order None when it is the inner one (one rank per host)."""
        R, S, U = self.num_ranks, self.num_hosts, self.ranks_per_host
        i64 = dict(dtype=torch.int64, device=self.device)
        f_M = inner.recv_src_idx
        M = f_M.shape[0]
        valid_M = f_M >= 0
        host_M = torch.where(valid_M, f_M // max(cap, 1), S)
        fwd_M = torch.bucketize(torch.arange(M, **i64), inner.psum_num_recv_tokens_per_rank, right=True)
        fwd_M = fwd_M.clamp(max=U - 1)
        per_rank = torch.zeros(R + 1, **i64).scatter_add_(0, torch.where(valid_M, host_M * U + fwd_M, R),
                                                         torch.ones(M, **i64))[:R]
        order_M = None if U == 1 else torch.sort(host_M, stable=True).indices
        return (_gather(torch.where(valid_M, f_M % max(cap, 1), -1), order_M), _gather(inner.recv_topk_idx, order_M),
                per_rank, order_M)

    def _expand_order(self, c, inner: EPHandle, cap: int) -> torch.Tensor:
        """Expand layout, `U > 1`: the output's order of the inner rows, sorted by (expert, source host) stably;
        alignment padding last in its expert's block, rows past the data last of all. The host of each row comes
        from a cached dispatch of 16-byte forwarder rows holding `row + 1` (padding rows arrive as zeros)."""
        S, L, dev = self.num_hosts, inner.psum_num_recv_tokens_per_expert.shape[0], self.device
        space = S * cap
        tags = torch.zeros(space, 2, dtype=torch.float64, device=dev)
        tags[:, 0] = torch.arange(1, space + 1, dtype=torch.float64, device=dev)
        got = self._inner_dispatch(c, tags, wire_format=None, dequantize=False, topk_idx=None, topk_weights=None,
                                   num_experts=inner.num_experts, num_tokens=space, hidden=2,
                                   num_max_tokens_per_rank=space, handle=inner, num_sms=inner.num_sms,
                                   do_cpu_sync=inner.do_cpu_sync)[0]
        P = got.shape[0]
        f_P = got[:, 0].long() - 1
        expert_P = torch.bucketize(torch.arange(P, device=dev), inner.psum_num_recv_tokens_per_expert, right=True)
        key = torch.where(expert_P < L, expert_P * (S + 1) + torch.where(f_P >= 0, f_P // max(cap, 1), S),
                          L * (S + 1))
        return torch.sort(key, stable=True).indices

    def _cached_dispatch(self, c):
        handle: EPHandle = c.handle
        lay: HybridLayout = handle.layout
        inner: EPHandle = lay.inner
        rows, scales = self._wire(c)
        side = None
        if scales is not None:
            side = scales.index_select(0, lay.send_token) if scales.shape[0] else \
                scales.new_zeros(lay.send_token.shape[0], scales.shape[1])
            side = side.to(torch.float64)
        arrived, scales_in = self._to_forwarders(rows, side, lay.send_token, lay.rail_send_splits,
                                                 lay.rail_recv_splits, "cached dispatch")
        space = self.num_hosts * handle.num_max_tokens_per_rank
        x_F = self._forwarder_space(arrived, lay.fwd_row, space, rows.dtype, scales_in,
                                    None if scales is None else scales.dtype)
        recv_x = self._inner_dispatch(c, x_F, num_experts=inner.num_experts, num_tokens=space,
                                      num_max_tokens_per_rank=space, handle=inner, do_cpu_sync=inner.do_cpu_sync)[0]
        return (_gather(recv_x, lay.order), None if handle.do_expand else handle.recv_topk_idx,
                handle.recv_topk_weights, handle), [], []

    # ------------------------------------------------------------------------------------------------
    # Combine
    # ------------------------------------------------------------------------------------------------
    def combine_steps(self, c):
        """The inner combine (partial sums in the accumulation precision, or each term unsummed), one row back per
        arrived row, then the source adds from zero in DESIGN 2.2's order regrouped by host (partial sums) or
        exactly (terms), then the biases."""
        handle: EPHandle = c.handle
        lay: HybridLayout = handle.layout
        N, hidden, dev = handle.num_tokens, c.x.shape[1], self.device
        acc_dtype = accumulation_dtype(c.x.dtype)
        unreduced = not self.use_partial_reduction
        y = _gather(c.x, lay.inverse)
        call = dataclasses.replace(c, x=y if unreduced else y.to(acc_dtype), handle=lay.inner,
                                   topk_weights=_gather(c.topk_weights, lay.inverse), bias=(),
                                   previous_event=None, async_with_compute_stream=False,
                                   allocate_on_comm_stream=False, unreduced=unreduced, plan=None)
        out, out_w, _ = self.inner._impl.combine(call)  # [space, H] or [space, T, H]

        # Back along the scale-out leg, one row per arrived row (rows that hold none send any row: never read):
        # the rows' bytes, then the weights' bytes padded to 16 (so both parts view as their dtypes).
        rows = None if lay.fwd_row is None else lay.fwd_row.clamp(min=0)
        width = math.prod(out.shape[1:])  # not -1: a forwarder that received no row sends back zero rows
        parts = [_gather(out, rows).view(out.shape[0] if rows is None else rows.shape[0], width).view(torch.uint8)]
        if out_w is not None:
            w_bytes = _gather(out_w, rows).view(torch.uint8)
            parts.append(torch.nn.functional.pad(w_bytes, (0, -w_bytes.shape[1] % 16)))
        # Absent terms and hosts read the zero row after the arrived ones.
        got = self._rail(torch.cat(parts, 1), lay.rail_recv_splits, lay.rail_send_splits, "combine exchange",
                         zero_row=True)
        spare = got.shape[0] - 1
        data_bytes = parts[0].shape[1]
        terms = got[:, :data_bytes].view(out.dtype)  # [rows + 1, T * H]: term k at columns k * H ...
        rows_NS = torch.cat([lay.rows_NS, lay.rows_NS.new_full((N, 1), spare)], 1)  # host S: none
        acc = torch.zeros(N, hidden, dtype=acc_dtype, device=dev)
        for row_N, k in self._term_order(handle, rows_NS, spare):
            acc += terms[:, k * hidden:(k + 1) * hidden].index_select(0, row_N).to(acc_dtype)
        for b in c.bias:
            acc += b.to(acc_dtype)
        combined_w = None
        if out_w is not None:
            K = handle.num_topk
            w_all = got[:, data_bytes:data_bytes + K * out_w.element_size()].view(out_w.dtype)  # [rows + 1, K]
            row_NK = rows_NS.gather(1, self._host_of_slots(handle))
            combined_w = w_all[row_NK, torch.arange(K, device=dev)[None, :]]
        return (acc.to(c.x.dtype), combined_w), [], []

    def _host_of_slots(self, handle: EPHandle) -> torch.Tensor:
        """`[N, K]` host of each slot's expert, S for -1 slots."""
        L = handle.num_experts // self.num_ranks
        return torch.where(handle.topk_idx >= 0, handle.topk_idx // (self.ranks_per_host * L), self.num_hosts)

    def _term_order(self, handle: EPHandle, rows_NS: torch.Tensor, spare: int):
        """`(row of each token in the arrived rows, term column)` in the order the source adds them: partial sums,
        one per host in ascending host order; terms, DESIGN 2.2's (ascending rank = (host, local rank); expand,
        ascending slot). A token without that term reads the zero row `spare` (adding +0 changes nothing: the
        accumulator starts at +0, so it is never -0)."""
        S, U, R = self.num_hosts, self.ranks_per_host, self.num_ranks
        if self.use_partial_reduction:
            return [(rows_NS[:, h], 0) for h in range(S)]
        if handle.do_expand:
            host_NK = self._host_of_slots(handle)
            return [(rows_NS.gather(1, host_NK[:, j:j + 1])[:, 0], j) for j in range(handle.num_topk)]
        L = handle.num_experts // R
        rank_NK = torch.where(handle.topk_idx >= 0, handle.topk_idx // L, R)
        in_rank_NR = torch.zeros(handle.num_tokens, R + 1, dtype=torch.bool, device=self.device).scatter_(
            1, rank_NK, True)[:, :R]
        return [(torch.where(in_rank_NR[:, r], rows_NS[:, r // U], spare), r % U) for r in range(R)]


__all__ = ["HybridBackend", "HybridLayout", "leg_groups"]
