"""Reference backend: dispatch and combine written with torch.distributed point-to-point exchanges and index
arithmetic. It runs on any process group (gloo on CPU, NCCL on GPU) and is the oracle of the CUDA backend.
(Over 400 lines: the oracle's dispatch and combine read best in one place, step by step as a kernel takes them.)

Shape legend: N = this rank's tokens, K = top-k slots, R = ranks, L = local experts, E = global experts,
B = rows of the receive buffer (one block per source rank), M = rows of the non-expand layout (compact:
source ranks ascending, then the unused tail), P = rows of the dispatch output.

How a dispatch runs (the same steps a kernel takes, in plain tensors):
1. Layout (local): which ranks each token goes to (`send_pos_NR`), rows and expert counts per rank.
2. Count exchange: each rank sends every peer `[rows for it, per-expert counts, error flags]`.
   With a CPU sync the counts are read on the host and every buffer is sized exactly; without one, every
   block has the worst-case capacity (`num_max_tokens_per_rank` rows) and nothing is read on the host.
3. Metadata exchange: per row the source token index, the local expert ids and weights.
   From it the receiver builds every layout tensor of the handle (expand positions, return positions).
4. Data exchange: the rows themselves (x, or FP8 data and scales). This is the only step that is left
   in flight when `async_with_compute_stream=True` on CPU; its finalizer writes the outputs.
Rows travel as raw bytes (`_RowCodec`), so every dtype, FP8 included, moves bit for bit.

The receive order is always deterministic: source ranks ascending, then source token index ascending.
Combine sends every row back to its source and reduces there in the order of DESIGN 2.2; an expand combine with
partial sums (`CombineCall.partial`) first adds each received row's slots on the expert's rank and sends one row
per received row back, as a non-expand combine does.

This is the direct path (every rank to every rank). Across hosts, `torch_hybrid.HybridRefBackend` runs the
same steps in two legs (over the rail, then inside the host) and reuses the pieces here that do not depend on
who sends to whom: routing (`_route`), count reads, the receiver's layout (`_received_rows`), the outputs and
their finalizers (`_dispatch_outputs`, `_combine_outputs`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .. import quant
from ..handle import EPHandle
from .common import Backend, accumulation_dtype, exclusive_cumsum

@dataclass(frozen=True)
class RefLayout:
    """Routing state of the reference backend, kept in `EPHandle.layout`.

    send_pos_NR: `[N, R]` row of each token inside the block it is sent to, -1 if not sent to that rank.
    send_splits / recv_splits: rows per peer block in the send / receive buffer (capacities without sync).
    out_row_B: `[B]` output row (compact, source ranks ascending) of each receive-buffer row, -1 for the
        unused tail of a block without CPU sync; the identity with a CPU sync.
    src_rank_M: `[M]` source rank of each output row (0 past the true count).
    expand_row_MK: `[M, K]` output row of each (received row, local slot) in expand mode, else None.
    return_pos_MK: `[M, K]` row of each (received row, local slot) in the expand combine's return buffer.
    return_send_splits / return_recv_splits: rows per peer of the expand combine's return exchange.
    slot_return_pos_NK: `[N, K]` row of each of this rank's slots in the expand combine's receive buffer.
    """

    send_pos_NR: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    out_row_B: torch.Tensor
    src_rank_M: torch.Tensor
    expand_row_MK: Optional[torch.Tensor] = None
    return_pos_MK: Optional[torch.Tensor] = None
    return_send_splits: Optional[list[int]] = None
    return_recv_splits: Optional[list[int]] = None
    slot_return_pos_NK: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class Route:
    """Where this rank's tokens go in a fresh dispatch (step 1; local, no communication).

    topk_idx: `[N, K]` with invalid slots dropped to -1. flags: 0-d error flags of this rank's routing.
    dest_NK: `[N, K]` destination rank of each slot, -1 for none. in_rank_NR: `[N, R]` bool, token goes to rank.
    send_pos_NR: `[N, R]` rank of the token among those going to that rank, -1 if not sent there.
    num_tokens_per_rank: `[R]`. num_tokens_per_expert: `[R, L]` slots per expert, grouped by owner rank.
    """

    topk_idx: torch.Tensor
    flags: torch.Tensor
    dest_NK: torch.Tensor
    in_rank_NR: torch.Tensor
    send_pos_NR: torch.Tensor
    num_tokens_per_rank: torch.Tensor
    num_tokens_per_expert: torch.Tensor


@dataclass(frozen=True)
class ReceivedCounts:
    """What every source rank announced to this rank in the count exchange (device tensors).

    rows_R: rows (tokens) from each source rank. pairs_R: (token, local expert) pairs from each source rank.
    aligned_L: rows per local expert padded to `expert_alignment`. flags_R: each source rank's error flags.
    """

    rows_R: torch.Tensor
    pairs_R: torch.Tensor
    aligned_L: torch.Tensor
    flags_R: torch.Tensor

    @classmethod
    def of(cls, counts_recv: torch.Tensor, L: int, expert_alignment: int) -> "ReceivedCounts":
        """From the received count rows `[R, >= L + 2]`: `[rows, per-expert counts (L), flags, ...]` per source."""
        per_expert_RL = counts_recv[:, 1:L + 1]
        return cls(rows_R=counts_recv[:, 0], pairs_R=per_expert_RL.sum(1),
                   aligned_L=_ceil_div(per_expert_RL.sum(0), expert_alignment) * expert_alignment,
                   flags_R=counts_recv[:, L + 1])


@dataclass(frozen=True)
class ReceivedRows:
    """The receiver's half of a dispatch layout (tensors of the handle; M = non-expand rows, P = output rows).

    recv_src_M, recv_idx_MK, src_rank_M: as `EPHandle.recv_src_idx`, `recv_topk_idx`, `RefLayout.src_rank_M`.
    out_w: the dispatch's `recv_topk_weights` output. num_recv_rows: P. psum_per_expert: `[L]` inclusive.
    expand_row_MK, return_pos_MK: as in `RefLayout` (expand only).
    """

    recv_src_M: torch.Tensor
    recv_idx_MK: torch.Tensor
    src_rank_M: torch.Tensor
    out_w: Optional[torch.Tensor]
    num_recv_rows: int
    psum_per_expert: torch.Tensor
    expand_row_MK: Optional[torch.Tensor] = None
    return_pos_MK: Optional[torch.Tensor] = None


class _RowCodec:
    """Packs several per-row tensors into one `[rows, width]` uint8 tensor, each field 16-byte aligned."""

    def __init__(self, fields: Sequence[tuple[str, torch.dtype, int]]) -> None:
        self.fields = []
        offset = 0
        for name, dtype, numel in fields:
            nbytes = numel * dtype.itemsize
            self.fields.append((name, dtype, numel, offset, nbytes))
            offset += -(-nbytes // 16) * 16
        self.width = max(offset, 16)

    def pack_into(self, out: torch.Tensor, rows: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """Write row i of every field to `out[rows[i]]`."""
        packed = torch.zeros(rows.numel(), self.width, dtype=torch.uint8, device=out.device)
        for name, _, _, offset, nbytes in self.fields:
            t = tensors[name]
            # Flatten first: a contiguous [n, 1] tensor may still carry a 0 stride in its last dim.
            packed[:, offset:offset + nbytes] = t.contiguous().reshape(-1).view(torch.uint8).view(rows.numel(), nbytes)
        out.index_copy_(0, rows, packed)

    def unpack(self, buf: torch.Tensor, pad_rows: int = 0) -> dict[str, torch.Tensor]:
        """Every field as its own tensor, with `pad_rows` zero rows appended (targets of absent entries)."""
        rows = buf.shape[0]
        out = {}
        for name, dtype, numel, offset, nbytes in self.fields:
            field = buf.new_zeros(rows + pad_rows, nbytes)
            field[:rows] = buf[:, offset:offset + nbytes]
            out[name] = field.view(dtype).reshape(rows + pad_rows, numel)
        return out


def _place(values: torch.Tensor, rows: torch.Tensor, num_rows: int, fill) -> torch.Tensor:
    """`out[rows[i]] = values[i]` for `rows[i] >= 0`, `fill` elsewhere; `out` has `num_rows` rows."""
    out = torch.full((num_rows + 1, *values.shape[1:]), fill, dtype=values.dtype, device=values.device)
    out.index_copy_(0, torch.where(rows >= 0, rows, num_rows), values)
    return out[:num_rows]


def _block_starts(splits: Sequence[int], device: torch.device) -> torch.Tensor:
    """First row of each block as a device tensor; equal blocks (no CPU sync) need no host-to-device copy."""
    if len(set(splits)) <= 1:
        return torch.arange(len(splits), dtype=torch.int64, device=device) * (splits[0] if splits else 0)
    return torch.tensor(exclusive_cumsum(splits), dtype=torch.int64, device=device)


def _rows_in_blocks(block_NT: torch.Tensor, num_blocks: int, splits: Sequence[int]) -> torch.Tensor:
    """Row of each entry (`block_NT`: the block it goes to, -1: none) in a buffer of `num_blocks` blocks of `splits`
    rows: its block's first row, then (row, column) row-major order among that block's entries; -1 for none."""
    blocks = torch.arange(num_blocks, device=block_NT.device)[:, None, None]
    onehot = (block_NT[None] == blocks).long()
    flat = onehot.flatten(1)
    before = (flat.cumsum(1) - flat).view_as(onehot)
    block = block_NT.clamp(min=0)
    rows = _block_starts(splits, block_NT.device)[block] + before.gather(0, block[None])[0]
    return torch.where(block_NT >= 0, rows, -1)


def _block_of_rows(splits: Sequence[int], device: torch.device) -> torch.Tensor:
    """Block index of every row; as above, equal blocks are computed on the device alone."""
    num_rows = sum(splits)
    if len(set(splits)) <= 1:
        return torch.arange(num_rows, dtype=torch.int64, device=device) // max(splits[0] if splits else 1, 1)
    counts = torch.tensor(list(splits), dtype=torch.int64, device=device)
    return torch.repeat_interleave(torch.arange(len(splits), dtype=torch.int64, device=device), counts,
                                   output_size=num_rows)


def _compact_rows(region_splits: Sequence[int], region_src_Q: torch.Tensor, rows_R: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Receive-buffer rows to compact output rows (source ranks ascending, then arrival order).

    The receive buffer holds one region per entry of `region_splits` (its capacity), region q holding the rows of
    source rank `region_src_Q[q]`, the first `rows_R[source]` of them valid. Returns `(out_row_B, src_rank_B)`:
    the output row of each buffer row (-1 past a region's valid rows) and its source rank.
    """
    dev = rows_R.device
    region_B = _block_of_rows(region_splits, dev)
    src_rank_B = region_src_Q[region_B]
    row_in_region_B = torch.arange(region_B.numel(), dtype=torch.int64, device=dev) - \
        _block_starts(region_splits, dev)[region_B]
    rows_before_R = rows_R.cumsum(0) - rows_R
    out_row_B = torch.where(row_in_region_B < rows_R[src_rank_B], rows_before_R[src_rank_B] + row_in_region_B, -1)
    return out_row_B, src_rank_B


def _pack_blocks(codec: _RowCodec, pos_XB: torch.Tensor, offsets: Sequence[int], num_rows: int,
                 fields_of: Callable[[int], dict[str, torch.Tensor]]) -> torch.Tensor:
    """A send buffer of `num_rows` rows (plus a spare one that takes the rows sent nowhere): row x of block b's
    fields (`fields_of(b)`) lands at `offsets[b] + pos_XB[x, b]`, nowhere where that is -1."""
    send = torch.zeros(num_rows + 1, codec.width, dtype=torch.uint8, device=pos_XB.device)
    for b, offset in enumerate(offsets):
        pos = pos_XB[:, b]
        codec.pack_into(send, torch.where(pos >= 0, offset + pos, num_rows), fields_of(b))
    return send


def _meta_fields(src: torch.Tensor, topk_idx: torch.Tensor, weights: Optional[torch.Tensor], owner_XK: torch.Tensor,
                 owner: int, first_expert: int) -> dict[str, torch.Tensor]:
    """Metadata rows for the receiver `owner` (a rank, or a host on the hybrid path): source token index, expert ids
    from `first_expert` on for its slots (-1 elsewhere), its slots' weights (0 elsewhere)."""
    mine = owner_XK == owner
    fields = {"src": src, "idx": torch.where(mine, topk_idx - first_expert, -1)}
    if weights is not None:
        fields["w"] = torch.where(mine, weights, 0)
    return fields


def _sum_terms(x: torch.Tensor, rows_NT: torch.Tensor, acc_dtype: torch.dtype) -> torch.Tensor:
    """`sum_t x[rows_NT[:, t]]` from zero in column order, accumulated in `acc_dtype` (rows_NT: no -1 left)."""
    acc = torch.zeros(rows_NT.shape[0], x.shape[1], dtype=acc_dtype, device=x.device)
    for t in range(rows_NT.shape[1]):
        acc += x[rows_NT[:, t]].to(acc_dtype)
    return acc


def _select_weights(w: torch.Tensor, rows_NT: torch.Tensor, owner_NK: Optional[torch.Tensor], pad: int) -> torch.Tensor:
    """`[N, K]` weights, slot j's from the term that owns it: with `owner_NK` (the owning column, -1: none), column
    j of the `[K]` weights of row `rows_NT[:, owner]`; without, the scalar weight of row `rows_NT[:, j]` (one term
    per slot). `pad` is a zero row of `w`."""
    if owner_NK is None:
        return w.view(-1)[rows_NT]
    owner_rows_NK = torch.where(owner_NK >= 0, rows_NT.gather(1, owner_NK.clamp(min=0)), pad)
    return w[owner_rows_NK, torch.arange(owner_NK.shape[1], device=w.device)[None, :]]


def _ceil_div(a, b):
    return (a + b - 1) // b


class TorchRefBackend(Backend):
    """The reference implementation behind `Buffer(backend="torch")`."""

    name = "torch"

    def gather_values(self, mine: torch.Tensor, phase: str) -> torch.Tensor:
        R = self.num_ranks
        everyone, works = self._exchange(mine.expand(R, -1).contiguous(), [1] * R, [1] * R, phase)
        self._wait(works)
        return everyone

    # ------------------------------------------------------------------------------------------------
    # Dispatch
    # ------------------------------------------------------------------------------------------------
    def __init__(self, group: dist.ProcessGroup, device: torch.device, num_cpu_timeout_secs: float) -> None:
        super().__init__(group, device, num_cpu_timeout_secs)
        # On the CPU every exchange blocks the host anyway: one more (a signature per rank) makes every call path
        # refuse ranks that disagree. On GPUs the calls without a CPU sync stay sync-free (checked only when the
        # Buffer asks); the CUDA backend checks those on the device.
        self.checks_every_call = device.type == "cpu"

    def dispatch_steps(self, c, agreed: bool):
        # A dispatch with a CPU sync syncs anyway: the check costs no extra sync there.
        if not agreed and c.handle is None and c.do_cpu_sync:
            self.check_agreement(c.signature())
        if c.handle is None:
            self.epoch += 1
        return self._cached_dispatch_body(c) if c.handle is not None else self._dispatch_body(c)

    def _data_fields(self, c, hidden: int) -> list[tuple[str, torch.dtype, int]]:
        if c.wire_format is None:
            return [("x", c.x.dtype, hidden)]
        scale_dtype = torch.float32 if c.wire_format == "fp8_block128" else torch.int32
        return [("q", torch.uint8, hidden), ("scales", scale_dtype, hidden // 128)]

    def _route(self, c) -> Route:
        """Step 1 of a fresh dispatch: where this rank's tokens go (local, no communication)."""
        R, L, K, N = self.num_ranks, c.num_experts // self.num_ranks, c.num_topk, c.num_tokens
        i64 = dict(dtype=torch.int64, device=self.device)
        topk_idx, flags = self.sanitize_topk_idx(c.topk_idx, c.num_experts)
        dest_NK = torch.where(topk_idx >= 0, topk_idx // L, torch.full_like(topk_idx, -1))
        in_rank_NR = torch.zeros(N, R + 1, dtype=torch.bool, device=self.device)
        in_rank_NR.scatter_(1, torch.where(dest_NK >= 0, dest_NK, R), True)
        in_rank_NR = in_rank_NR[:, :R]
        num_tokens_per_expert = torch.zeros(c.num_experts + 1, **i64)
        num_tokens_per_expert.scatter_add_(0, torch.where(topk_idx >= 0, topk_idx, c.num_experts).flatten(),
                                           torch.ones(N * K, **i64))
        return Route(topk_idx=topk_idx, flags=flags, dest_NK=dest_NK, in_rank_NR=in_rank_NR,
                     send_pos_NR=torch.where(in_rank_NR, in_rank_NR.long().cumsum(0) - 1, -1),
                     num_tokens_per_rank=in_rank_NR.long().sum(0),
                     num_tokens_per_expert=num_tokens_per_expert[:c.num_experts].view(R, L))

    def _read_counts(self, c, flags_R: torch.Tensor, values: Sequence[torch.Tensor]) -> list[list[int]]:
        """With a CPU sync: read `values` (1-D int64 tensors) on the host, raise for bad routing on every rank
        (`flags_R`: each source rank's error flags), and return the values as lists."""
        R = self.num_ranks
        host = torch.cat([flags_R, self.pending_flags, *values]).tolist()
        self.after_host_sync(synchronized=True)
        flags_per_rank, pending = host[:R], host[R:2 * R]
        if any(pending):
            self.check_pending_errors()
        self.raise_for_flags(flags_per_rank, c.topk_idx, c.num_experts, "")
        out, start = [], 2 * R
        for v in values:
            out.append(host[start:start + v.numel()])
            start += v.numel()
        return out

    def _defer_flags(self, flags_R: torch.Tensor) -> None:
        """Without a CPU sync: invalid slots were dropped; the next synchronizing call raises for them."""
        torch.bitwise_or(self.pending_flags, flags_R, out=self.pending_flags)

    @staticmethod
    def _meta_codec(c) -> _RowCodec:
        """Per received row: source token index, local expert ids and weights."""
        fields = [("src", torch.int64, 1), ("idx", torch.int64, c.num_topk)]
        if c.topk_weights is not None:
            fields.append(("w", c.topk_weights.dtype, c.num_topk))
        return _RowCodec(fields)

    def _dispatch_body(self, c):
        R, L, K, N = self.num_ranks, c.num_experts // self.num_ranks, c.num_topk, c.num_tokens
        dev, cap = self.device, c.num_max_tokens_per_rank
        i64 = dict(dtype=torch.int64, device=dev)
        route = self._route(c)

        # Count exchange: [rows, per-expert counts, flags] to every peer.
        counts_send = torch.cat([route.num_tokens_per_rank[:, None], route.num_tokens_per_expert,
                                 route.flags.expand(R, 1)], dim=1)
        counts_recv, works = self._exchange(counts_send, [1] * R, [1] * R, "dispatch count exchange")
        self._wait(works)
        counts = ReceivedCounts.of(counts_recv, L, c.expert_alignment)
        if c.do_cpu_sync:
            recv_splits, recv_pairs, own_pairs, send_splits, aligned_list = self._read_counts(
                c, counts.flags_R, [counts.rows_R, counts.pairs_R, route.num_tokens_per_expert.sum(1),
                                    route.num_tokens_per_rank, counts.aligned_L])
            return_send_splits, return_recv_splits = recv_pairs, own_pairs
        else:
            self._defer_flags(counts.flags_R)
            send_splits = recv_splits = [cap] * R
            return_send_splits = return_recv_splits = [cap * min(K, L)] * R
            aligned_list = None
        send_offsets = exclusive_cumsum(send_splits)

        # Metadata exchange: source token index, local expert ids and weights of every row.
        meta = self._meta_codec(c)
        src_N = torch.arange(N, **i64)
        meta_send = _pack_blocks(meta, route.send_pos_NR, send_offsets, sum(send_splits), lambda d: _meta_fields(
            src_N, route.topk_idx, c.topk_weights, route.dest_NK, d, d * L))
        meta_recv, works = self._exchange(meta_send, send_splits, recv_splits, "dispatch metadata exchange")
        self._wait(works)

        # Receiver-side layout: blocks of the receive buffer (one per source rank) become one compact run of rows.
        out_row_B, src_rank_B = _compact_rows(recv_splits, torch.arange(R, **i64), counts.rows_R)
        rows = self._received_rows(c, meta.unpack(meta_recv), out_row_B, src_rank_B, counts, aligned_list,
                                   _block_starts(return_send_splits, dev))
        layout = RefLayout(send_pos_NR=route.send_pos_NR, send_splits=send_splits, recv_splits=recv_splits,
                           out_row_B=out_row_B, src_rank_M=rows.src_rank_M, expand_row_MK=rows.expand_row_MK,
                           return_pos_MK=rows.return_pos_MK)
        if c.do_expand:
            # Where each of this rank's slots comes back: blocks per destination rank, (token, slot) order.
            slot_return_pos_NK = _rows_in_blocks(route.dest_NK, R, return_recv_splits)
            layout = dataclasses.replace(layout, return_send_splits=return_send_splits,
                                         return_recv_splits=return_recv_splits, slot_return_pos_NK=slot_return_pos_NK)
        handle = self._new_handle(c, route, rows, counts, aligned_list, layout)
        recv_x, works, finalizers = self._send_data(c, handle)
        return (recv_x, None if c.do_expand else rows.recv_idx_MK, rows.out_w, handle), works, finalizers

    def _received_rows(self, c, got: dict[str, torch.Tensor], out_row_B: torch.Tensor, src_rank_B: torch.Tensor,
                       counts: "ReceivedCounts", aligned_list: Optional[list[int]],
                       return_start_R: torch.Tensor) -> "ReceivedRows":
        """The receiver's half of the layout, from the metadata of every received row (`got`, `[B, ...]`), the
        compact row of each (`out_row_B`) and the counts (`aligned_list`: the aligned expert counts read on the
        host, None without a CPU sync). `return_start_R`: first row of each source rank's block in the expand
        combine's return buffer."""
        L, K = c.num_experts // self.num_ranks, c.num_topk
        dev = self.device
        M = out_row_B.shape[0]
        psum_per_expert = counts.aligned_L.cumsum(0)
        num_recv_rows = M
        if c.do_expand:
            num_recv_rows = sum(aligned_list) if c.do_cpu_sync else M * min(K, L) + L * (c.expert_alignment - 1)
        recv_idx_MK = _place(got["idx"], out_row_B, M, fill=-1)
        recv_w_MK = None if "w" not in got else _place(got["w"], out_row_B, M, fill=0)
        src_rank_M = _place(src_rank_B, out_row_B, M, fill=0)
        rows = ReceivedRows(recv_src_M=_place(got["src"].view(-1), out_row_B, M, fill=-1), recv_idx_MK=recv_idx_MK,
                            src_rank_M=src_rank_M, out_w=recv_w_MK, num_recv_rows=num_recv_rows,
                            psum_per_expert=psum_per_expert)
        if not c.do_expand:
            return rows
        expand_row_MK = self._expand_rows(recv_idx_MK, psum_per_expert - counts.aligned_L, L)
        out_w = None if recv_w_MK is None else self._scatter_slots(recv_w_MK, expand_row_MK, num_recv_rows)
        # Return path of the expand combine: one row per valid (row, slot) pair, (token, slot) order.
        valid_MK = recv_idx_MK >= 0
        pair_rank_MK = valid_MK.flatten().long().cumsum(0).view(M, K) - 1
        pairs_before = counts.pairs_R.cumsum(0) - counts.pairs_R
        block_M = src_rank_M[:, None]
        return_pos_MK = torch.where(valid_MK, return_start_R.to(dev)[block_M] + pair_rank_MK - pairs_before[block_M],
                                    -1)
        return dataclasses.replace(rows, out_w=out_w, expand_row_MK=expand_row_MK, return_pos_MK=return_pos_MK)

    def _new_handle(self, c, route: Route, rows: "ReceivedRows", counts: "ReceivedCounts",
                    aligned_list: Optional[list[int]], layout) -> EPHandle:
        return EPHandle.make(
            group=self.group, backend=self.name, epoch=self.epoch,
            num_experts=c.num_experts, num_topk=c.num_topk, num_tokens=c.num_tokens,
            num_max_tokens_per_rank=c.num_max_tokens_per_rank, do_expand=c.do_expand,
            expert_alignment=c.expert_alignment, num_sms=c.num_sms, do_cpu_sync=c.do_cpu_sync,
            topk_idx=route.topk_idx, recv_src_idx=rows.recv_src_M, recv_topk_idx=rows.recv_idx_MK,
            recv_topk_weights=rows.out_w, psum_num_recv_tokens_per_rank=counts.rows_R.cumsum(0),
            psum_num_recv_tokens_per_expert=rows.psum_per_expert,
            num_recv_tokens=rows.num_recv_rows if c.do_cpu_sync else None,
            num_recv_tokens_per_expert_list=aligned_list, num_recv_rows=rows.num_recv_rows, layout=layout)

    def _cached_dispatch_body(self, c):
        handle = c.handle
        recv_x, works, finalizers = self._send_data(c, handle)
        recv_idx = None if handle.do_expand else handle.recv_topk_idx
        return (recv_x, recv_idx, handle.recv_topk_weights, handle), works, finalizers

    @staticmethod
    def _expand_rows(recv_idx_MK: torch.Tensor, block_start_L: torch.Tensor, L: int) -> torch.Tensor:
        """Output row of each (received row, slot) in the expand layout, -1 for non-local slots."""
        M = recv_idx_MK.shape[0]
        onehot_ML = torch.zeros(M, L + 1, dtype=torch.int64, device=recv_idx_MK.device)
        onehot_ML.scatter_(1, torch.where(recv_idx_MK >= 0, recv_idx_MK, L), 1)
        rank_in_expert_ML = onehot_ML[:, :L].cumsum(0) - 1
        local_MK = recv_idx_MK.clamp(min=0)
        rows = block_start_L[local_MK] + rank_in_expert_ML.gather(1, local_MK)
        return torch.where(recv_idx_MK >= 0, rows, -1)

    @staticmethod
    def _scatter_slots(values_MK: torch.Tensor, rows_MK: torch.Tensor, num_rows: int) -> torch.Tensor:
        """Place `values_MK[i, j]` (a scalar or a row per slot) at output row `rows_MK[i, j]`; zeros elsewhere."""
        out = torch.zeros((num_rows + 1, *values_MK.shape[2:]), dtype=values_MK.dtype, device=values_MK.device)
        for j in range(rows_MK.shape[1]):
            out.index_copy_(0, torch.where(rows_MK[:, j] >= 0, rows_MK[:, j], num_rows), values_MK[:, j])
        return out[:num_rows]

    def _send_data(self, c, handle: EPHandle):
        """Data exchange along `handle`'s layout; returns `(recv_x, works, finalizers)`."""
        lay: RefLayout = handle.layout
        codec = _RowCodec(self._data_fields(c, c.hidden))
        wire = self._wire_tensors(c)
        send = _pack_blocks(codec, lay.send_pos_NR, exclusive_cumsum(lay.send_splits), sum(lay.send_splits),
                            lambda d: wire)
        recv, works = self._exchange(send, lay.send_splits, lay.recv_splits, "dispatch data exchange")
        recv_x, finalize = self._dispatch_outputs(c, handle, codec, recv, lay.out_row_B, lay.expand_row_MK)
        return recv_x, works, [finalize]

    def _dispatch_outputs(self, c, handle: EPHandle, codec: _RowCodec, recv: torch.Tensor, out_row_B: torch.Tensor,
                          expand_row_MK: Optional[torch.Tensor]):
        """The dispatch outputs, allocated now, and the finalizer that fills them once `recv` (the rows as they
        arrived, `[B, codec.width]` bytes) is complete: `(recv_x, finalize)`."""
        dev, hidden = self.device, c.hidden
        P, M = handle.num_recv_rows, handle.recv_src_idx.shape[0]
        if c.wire_format is None or c.dequantize:
            out_dtype = torch.bfloat16 if c.dequantize else c.x.dtype
            recv_x = torch.empty(P, hidden, dtype=out_dtype, device=dev)
            targets = {"x": recv_x}
        else:
            scale_dtype = torch.float32 if c.wire_format == "fp8_block128" else torch.int32
            recv_x = (torch.empty(P, hidden, dtype=torch.float8_e4m3fn, device=dev),
                      torch.empty(P, hidden // 128, dtype=scale_dtype, device=dev))
            targets = {"q": recv_x[0].view(torch.uint8), "scales": recv_x[1]}

        def finalize() -> None:
            got = {k: _place(v, out_row_B, M, fill=0) for k, v in codec.unpack(recv).items()}
            if c.dequantize:
                got = {"x": quant.dequantize(got["q"].view(torch.float8_e4m3fn), got["scales"])}
            for name, target in targets.items():
                value = got[name]
                if handle.do_expand:
                    value = self._scatter_slots(value[:, None, :].expand(-1, expand_row_MK.shape[1], -1),
                                                expand_row_MK, P)
                target.copy_(value)

        return recv_x, finalize

    # ------------------------------------------------------------------------------------------------
    # Combine
    # ------------------------------------------------------------------------------------------------
    @staticmethod
    def _combine_codec(c, x_dtype: Optional[torch.dtype] = None) -> _RowCodec:
        """A combine row: the expert output (in `x_dtype`, default x's) and its weights (non-expand and partial
        sums `[K]`, expand one)."""
        fields = [("x", x_dtype or c.x.dtype, c.x.shape[1])]
        if c.topk_weights is not None:
            per_slot = c.handle.do_expand and not c.partial
            fields.append(("w", c.topk_weights.dtype, 1 if per_slot else c.handle.num_topk))
        return _RowCodec(fields)

    @staticmethod
    def _partial_rows(c, lay: RefLayout) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """An expand combine's partial sums (`c.partial`): per received row, the rows of its slots here added from
        zero in ascending slot order, in the accumulation dtype (`[M, H]`), and its weights per slot (`[M, K]`, 0
        for slots held elsewhere)."""
        acc_dtype = accumulation_dtype(c.x.dtype)
        rows_MK = lay.expand_row_MK
        absent = c.x.shape[0]  # a zero row after x: absent slots add zero
        src_MK = torch.where(rows_MK >= 0, rows_MK, absent)
        partial = _sum_terms(torch.cat([c.x, c.x.new_zeros(1, c.x.shape[1])]), src_MK, acc_dtype)
        if c.topk_weights is None:
            return partial, None
        return partial, torch.cat([c.topk_weights, c.topk_weights.new_zeros(1)])[src_MK]

    def _pack_back(self, c, codec: _RowCodec, lay, arrival_splits: tuple[list[int], list[int]]):
        """Every combine row packed where it goes back: non-expand into the receive block it arrived in (the unused
        tail of a block stays zero), expand one row per (received row, local slot) pair at `return_pos_MK`.
        Returns `(send, send_splits, recv_splits)`: the send buffer (one spare row at the end) and the splits of the
        exchange back, `arrival_splits` (the dispatch's last leg, receiver's then sender's side) reversed for
        non-expand rows, `lay.return_send_splits`/`return_recv_splits` for expand."""
        handle, dev, hidden = c.handle, self.device, c.x.shape[1]
        if handle.do_expand and not c.partial:
            num_send = sum(lay.return_send_splits)
            send = torch.zeros(num_send + 1, codec.width, dtype=torch.uint8, device=dev)
            x_pad = torch.cat([c.x, c.x.new_zeros(1, hidden)])
            w_pad = None if c.topk_weights is None else torch.cat([c.topk_weights, c.topk_weights.new_zeros(1)])
            trash_row = c.x.shape[0]
            for j in range(handle.num_topk):
                rows = lay.expand_row_MK[:, j]
                src = torch.where(rows >= 0, rows, trash_row)
                fields_j = {"x": x_pad[src]}
                if w_pad is not None:
                    fields_j["w"] = w_pad[src][:, None]
                dst = lay.return_pos_MK[:, j]
                codec.pack_into(send, torch.where(dst >= 0, dst, num_send), fields_j)
            return send, lay.return_send_splits, lay.return_recv_splits
        # One row per received row, into the receive block it arrived in: its own (non-expand) or its slots' partial
        # sum.
        x_M, w_M = self._partial_rows(c, lay) if c.partial else (c.x, c.topk_weights)
        num_send = lay.out_row_B.shape[0]
        send = torch.zeros(num_send + 1, codec.width, dtype=torch.uint8, device=dev)
        valid_B = lay.out_row_B >= 0
        src_rows = lay.out_row_B.clamp(min=0)
        fields_all = {"x": x_M[src_rows]}
        if w_M is not None:
            fields_all["w"] = w_M[src_rows]
        codec.pack_into(send, torch.where(valid_B, torch.arange(num_send, device=dev), num_send), fields_all)
        return (send, *arrival_splits)

    def combine_steps(self, c):
        handle: EPHandle = c.handle
        lay: RefLayout = handle.layout
        acc_dtype = accumulation_dtype(c.x.dtype)
        codec = self._combine_codec(c, acc_dtype if c.partial else None)
        send, send_splits, recv_splits = self._pack_back(c, codec, lay, (lay.recv_splits, lay.send_splits))
        recv, works = self._exchange(send, send_splits, recv_splits, "combine exchange")
        if handle.do_expand and not c.partial:
            # DESIGN 2.2 order: one term per valid slot, ascending slot.
            outputs, finalize = self._combine_outputs(c, codec, recv, lay.slot_return_pos_NK, None)
        else:
            # One term per destination rank, ascending rank: DESIGN 2.2's non-expand order, and with partial sums
            # each term is the sum of the token's slots on that rank.
            offsets = _block_starts(recv_splits, self.device)
            rows_NR = torch.where(lay.send_pos_NR >= 0, offsets[None, :] + lay.send_pos_NR, -1)
            dest_NK = torch.where(handle.topk_idx >= 0, handle.topk_idx // (handle.num_experts // self.num_ranks), -1)
            outputs, finalize = self._combine_outputs(c, codec, recv, rows_NR, dest_NK)
        return outputs, works, [finalize]

    def _combine_outputs(self, c, codec: _RowCodec, recv: torch.Tensor, rows_NT: torch.Tensor,
                         owner_NK: Optional[torch.Tensor]):
        """The combine outputs, allocated now, and the finalizer that sums them once `recv` has arrived:
        `(outputs, finalize)`; with `c.unreduced` the terms themselves, `[N, T, H]` (absent ones zero).

        rows_NT: `[N, T]`, the row of `recv` holding each term of each token (-1: no term), summed in column order.
        owner_NK: the column of the term that holds slot j's weight (`recv`'s weights are `[K]` per row, the
            select takes column j); None when each term is one slot with a scalar weight (`rows_NT` is `[N, K]`).
        """
        handle, dev = c.handle, self.device
        N, K, hidden = handle.num_tokens, handle.num_topk, c.x.shape[1]
        acc_dtype = accumulation_dtype(c.x.dtype)
        combined = torch.empty(N, *rows_NT.shape[1:] if c.unreduced else (), hidden, dtype=c.x.dtype, device=dev)
        combined_w = None if c.topk_weights is None else torch.empty(N, K, dtype=c.topk_weights.dtype, device=dev)

        def finalize() -> None:
            # One extra zero row: gathers of absent terms read it.
            got = codec.unpack(recv, pad_rows=1)
            pad = recv.shape[0]
            rows = torch.where(rows_NT >= 0, rows_NT, pad)
            if combined_w is not None:
                combined_w.copy_(_select_weights(got["w"], rows, owner_NK, pad))
            if c.unreduced:  # every term in its column (absent ones zero), as the dispatch's handle numbers them
                combined.copy_(got["x"][rows])
                return
            # DESIGN 2.2 order: start from zero, add the terms one by one, then bias[0], bias[1].
            acc = _sum_terms(got["x"], rows, acc_dtype)
            for b in c.bias:
                acc += b.to(acc_dtype)
            combined.copy_(acc)

        return (combined, combined_w), finalize
