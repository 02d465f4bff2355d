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
Combine sends every row back to its source and reduces there in the order of DESIGN 2.2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .. import quant
from ..event import wait_error
from ..handle import EPHandle
from .common import Backend

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
    return torch.tensor(_exclusive_cumsum(splits), dtype=torch.int64, device=device)


def _block_of_rows(splits: Sequence[int], device: torch.device) -> torch.Tensor:
    """Block index of every row; as above, equal blocks are computed on the device alone."""
    num_rows = sum(splits)
    if len(set(splits)) <= 1:
        return torch.arange(num_rows, dtype=torch.int64, device=device) // max(splits[0] if splits else 1, 1)
    counts = torch.tensor(list(splits), dtype=torch.int64, device=device)
    return torch.repeat_interleave(torch.arange(len(splits), dtype=torch.int64, device=device), counts,
                                   output_size=num_rows)


def _exclusive_cumsum(values: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for v in values:
        out.append(acc)
        acc += v
    return out


def _ceil_div(a, b):
    return (a + b - 1) // b


class TorchRefBackend(Backend):
    """The reference implementation behind `Buffer(backend="torch")`."""

    name = "torch"

    # ------------------------------------------------------------------------------------------------
    # Transport
    # ------------------------------------------------------------------------------------------------
    def _exchange(self, send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], phase: str,
) -> tuple[torch.Tensor, list[tuple[object, str]]]:
        """All-to-all-v of row blocks: `send`'s block p (rows from `exclusive_cumsum(send_splits)[p]`) goes to
        rank p; rank p's block lands at `exclusive_cumsum(recv_splits)[p]` of the returned `recv`.

        `send` may have trailing rows past its blocks.
        Returns `(recv, works)`: the works in flight, described by rank, phase and peer for timeout errors.
        Zero-row blocks are skipped on both sides (both know the size).
        """
        recv = send.new_empty(sum(recv_splits), *send.shape[1:])
        send_offsets, recv_offsets = _exclusive_cumsum(send_splits), _exclusive_cumsum(recv_splits)
        me = self.rank
        recv[recv_offsets[me]:recv_offsets[me] + recv_splits[me]] = \
            send[send_offsets[me]:send_offsets[me] + send_splits[me]]
        ops, descriptions = [], []
        for peer in range(self.num_ranks):
            if peer == me:
                continue
            global_peer = dist.get_global_rank(self.group, peer)
            if recv_splits[peer]:
                block = recv[recv_offsets[peer]:recv_offsets[peer] + recv_splits[peer]]
                ops.append(dist.P2POp(dist.irecv, block, global_peer, self.group))
                descriptions.append(f"rank {me} {phase}: receive from peer {peer}")
            if send_splits[peer]:
                block = send[send_offsets[peer]:send_offsets[peer] + send_splits[peer]]
                ops.append(dist.P2POp(dist.isend, block, global_peer, self.group))
                descriptions.append(f"rank {me} {phase}: send to peer {peer}")
        try:
            works = dist.batch_isend_irecv(ops) if ops else []
        except RuntimeError as exc:  # gloo: a peer's connection closed before the exchange was posted
            peers = [p for p in range(self.num_ranks) if p != me]
            who = f"peer {peers[0]}" if len(peers) == 1 else f"one of peers {peers}"
            error = wait_error(f"rank {me} {phase}: posting the exchange", self.timeout_secs, 0.0, exc, who)
            self.mark_broken(str(error))
            raise error from exc
        return recv, list(zip(works, descriptions))

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

    def dispatch_steps(self, c, verify_agreement: bool):
        # A dispatch with a CPU sync syncs anyway: the check costs no extra sync there.
        if verify_agreement or self.checks_every_call or (c.handle is None and c.do_cpu_sync):
            self.check_agreement(c.signature())
        if c.handle is None:
            self.epoch += 1
        return self._cached_dispatch_body(c) if c.handle is not None else self._dispatch_body(c)

    def _data_fields(self, c, hidden: int) -> list[tuple[str, torch.dtype, int]]:
        if c.wire_format is None:
            return [("x", c.x.dtype, hidden)]
        scale_dtype = torch.float32 if c.wire_format == "fp8_block128" else torch.int32
        return [("q", torch.uint8, hidden), ("scales", scale_dtype, hidden // 128)]

    def _dispatch_body(self, c):
        R, L, K, N = self.num_ranks, c.num_experts // self.num_ranks, c.num_topk, c.num_tokens
        dev, cap = self.device, c.num_max_tokens_per_rank
        i64 = dict(dtype=torch.int64, device=dev)

        # Layout: destination ranks of every token, and its row inside each destination block.
        topk_idx, flags = self.sanitize_topk_idx(c.topk_idx, c.num_experts)
        dest_NK = torch.where(topk_idx >= 0, topk_idx // L, torch.full_like(topk_idx, -1))
        in_rank_NR = torch.zeros(N, R + 1, dtype=torch.bool, device=dev)
        in_rank_NR.scatter_(1, torch.where(dest_NK >= 0, dest_NK, R), True)
        in_rank_NR = in_rank_NR[:, :R]
        send_pos_NR = torch.where(in_rank_NR, in_rank_NR.long().cumsum(0) - 1, -1)
        num_tokens_per_rank = in_rank_NR.long().sum(0)
        num_tokens_per_expert = torch.zeros(c.num_experts + 1, **i64)
        num_tokens_per_expert.scatter_add_(0, torch.where(topk_idx >= 0, topk_idx, c.num_experts).flatten(),
                                           torch.ones(N * K, **i64))
        num_tokens_per_expert = num_tokens_per_expert[:c.num_experts].view(R, L)

        # Count exchange: [rows, per-expert counts, flags] to every peer.
        counts_send = torch.cat([num_tokens_per_rank[:, None], num_tokens_per_expert, flags.expand(R, 1)], dim=1)
        counts_recv, works = self._exchange(counts_send, [1] * R, [1] * R, "dispatch count exchange")
        self._wait(works)
        recv_rows_per_rank = counts_recv[:, 0]
        recv_per_expert = counts_recv[:, 1:L + 1].sum(0)
        recv_pairs_per_rank = counts_recv[:, 1:L + 1].sum(1)
        aligned_per_expert = _ceil_div(recv_per_expert, c.expert_alignment) * c.expert_alignment
        own_pairs_per_rank = num_tokens_per_expert.sum(1)

        pair_cap = cap * min(K, L)
        if c.do_cpu_sync:
            host = torch.cat([counts_recv[:, L + 1], self.pending_flags, recv_rows_per_rank, recv_pairs_per_rank,
                              own_pairs_per_rank, num_tokens_per_rank, aligned_per_expert]).tolist()
            self.after_host_sync(synchronized=True)
            flags_per_rank, pending = host[:R], host[R:2 * R]
            if any(pending):
                self.check_pending_errors()
            self.raise_for_flags(flags_per_rank, c.topk_idx, c.num_experts, "")
            recv_splits, recv_pairs = host[2 * R:3 * R], host[3 * R:4 * R]
            own_pairs, send_splits = host[4 * R:5 * R], host[5 * R:6 * R]
            aligned_list = host[6 * R:]
            num_recv_nonexpand = sum(recv_splits)
            num_recv_rows = sum(aligned_list) if c.do_expand else num_recv_nonexpand
            return_send_splits, return_recv_splits = recv_pairs, own_pairs
        else:
            # Worst-case capacities; invalid slots were dropped, the flags wait for the next sync.
            torch.bitwise_or(self.pending_flags, counts_recv[:, L + 1], out=self.pending_flags)
            send_splits = recv_splits = [cap] * R
            return_send_splits = return_recv_splits = [pair_cap] * R
            aligned_list = None
            num_recv_nonexpand = R * cap
            num_recv_rows = R * pair_cap + L * (c.expert_alignment - 1) if c.do_expand else num_recv_nonexpand
        send_offsets = _exclusive_cumsum(send_splits)
        M, B = num_recv_nonexpand, sum(recv_splits)

        # Metadata exchange: source token index, local expert ids and weights of every row.
        meta_fields = [("src", torch.int64, 1), ("idx", torch.int64, K)]
        if c.topk_weights is not None:
            meta_fields.append(("w", c.topk_weights.dtype, K))
        meta = _RowCodec(meta_fields)
        num_send_rows = sum(send_splits)
        meta_send = torch.zeros(num_send_rows + 1, meta.width, dtype=torch.uint8, device=dev)
        src_N = torch.arange(N, **i64)
        for d in range(R):
            rows = torch.where(send_pos_NR[:, d] >= 0, send_offsets[d] + send_pos_NR[:, d], num_send_rows)
            on_d = dest_NK == d
            fields = {"src": src_N, "idx": torch.where(on_d, topk_idx - d * L, -1)}
            if c.topk_weights is not None:
                fields["w"] = torch.where(on_d, c.topk_weights, 0)
            meta.pack_into(meta_send, rows, fields)
        meta_recv, works = self._exchange(meta_send, send_splits, recv_splits, "dispatch metadata exchange")
        self._wait(works)
        got = meta.unpack(meta_recv)

        # Receiver-side layout: blocks of the receive buffer become one compact run of rows.
        psum_per_rank = recv_rows_per_rank.cumsum(0)
        psum_per_expert = aligned_per_expert.cumsum(0)
        src_rank_B = _block_of_rows(recv_splits, dev)
        row_in_block_B = torch.arange(B, **i64) - _block_starts(recv_splits, dev)[src_rank_B]
        out_row_B = torch.where(row_in_block_B < recv_rows_per_rank[src_rank_B],
                                (psum_per_rank - recv_rows_per_rank)[src_rank_B] + row_in_block_B, -1)
        recv_src_M = _place(got["src"].view(B), out_row_B, M, fill=-1)
        recv_idx_MK = _place(got["idx"], out_row_B, M, fill=-1)
        recv_w_MK = None if "w" not in got else _place(got["w"], out_row_B, M, fill=0)
        src_rank_M = _place(src_rank_B, out_row_B, M, fill=0)

        layout = dict(send_pos_NR=send_pos_NR, send_splits=send_splits, recv_splits=recv_splits,
                      out_row_B=out_row_B, src_rank_M=src_rank_M)
        out_w = recv_w_MK
        if c.do_expand:
            expand_row_MK = self._expand_rows(recv_idx_MK, psum_per_expert - aligned_per_expert, L)
            if recv_w_MK is not None:
                out_w = self._scatter_slots(recv_w_MK, expand_row_MK, num_recv_rows)
            # Return path of the expand combine: one row per valid (row, slot) pair, (token, slot) order.
            valid_MK = recv_idx_MK >= 0
            pair_rank_MK = valid_MK.flatten().long().cumsum(0).view(M, K) - 1
            pairs_before = recv_pairs_per_rank.cumsum(0) - recv_pairs_per_rank
            return_offsets = _block_starts(return_send_splits, dev)
            block_M = src_rank_M[:, None]
            return_pos_MK = torch.where(valid_MK, return_offsets[block_M] + pair_rank_MK - pairs_before[block_M], -1)
            slot_return_pos_NK = torch.full_like(topk_idx, -1)
            for d, offset in enumerate(_exclusive_cumsum(return_recv_splits)):
                on_d = dest_NK == d
                rank_in_block = on_d.flatten().long().cumsum(0).view(N, K) - 1
                slot_return_pos_NK = torch.where(on_d, offset + rank_in_block, slot_return_pos_NK)
            layout.update(expand_row_MK=expand_row_MK, return_pos_MK=return_pos_MK,
                          return_send_splits=return_send_splits, return_recv_splits=return_recv_splits,
                          slot_return_pos_NK=slot_return_pos_NK)

        handle = EPHandle(
            group=self.group, backend=self.name, epoch=self.epoch,
            num_experts=c.num_experts, num_topk=K, num_tokens=N, num_max_tokens_per_rank=cap,
            do_expand=c.do_expand, expert_alignment=c.expert_alignment, num_sms=c.num_sms,
            do_cpu_sync=c.do_cpu_sync, topk_idx=topk_idx, recv_src_idx=recv_src_M, recv_topk_idx=recv_idx_MK,
            recv_topk_weights=out_w, psum_num_recv_tokens_per_rank=psum_per_rank,
            psum_num_recv_tokens_per_expert=psum_per_expert,
            num_recv_tokens=num_recv_rows if c.do_cpu_sync else None,
            num_recv_tokens_per_expert_list=aligned_list, num_recv_rows=num_recv_rows, layout=RefLayout(**layout))
        recv_x, works, finalizers = self._send_data(c, handle)
        return (recv_x, None if c.do_expand else recv_idx_MK, out_w, handle), works, finalizers

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
        dev = self.device
        hidden = c.hidden
        codec = _RowCodec(self._data_fields(c, hidden))
        num_send_rows, M = sum(lay.send_splits), handle.recv_src_idx.shape[0]
        send = torch.zeros(num_send_rows + 1, codec.width, dtype=torch.uint8, device=dev)
        wire = self._wire_tensors(c)
        for d, offset in enumerate(_exclusive_cumsum(lay.send_splits)):
            pos = lay.send_pos_NR[:, d]
            codec.pack_into(send, torch.where(pos >= 0, offset + pos, num_send_rows), wire)
        recv, works = self._exchange(send, lay.send_splits, lay.recv_splits, "dispatch data exchange")

        # Outputs exist now; the finalizer fills them once the rows have arrived.
        P = handle.num_recv_rows
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
            got = {k: _place(v, lay.out_row_B, M, fill=0) for k, v in codec.unpack(recv).items()}
            if c.dequantize:
                got = {"x": quant.dequantize(got["q"].view(torch.float8_e4m3fn), got["scales"])}
            for name, target in targets.items():
                value = got[name]
                if handle.do_expand:
                    rows_MK = lay.expand_row_MK
                    value = self._scatter_slots(value[:, None, :].expand(-1, rows_MK.shape[1], -1), rows_MK, P)
                target.copy_(value)

        return recv_x, works, [finalize]

    # ------------------------------------------------------------------------------------------------
    # Combine
    # ------------------------------------------------------------------------------------------------
    def combine_steps(self, c):
        handle: EPHandle = c.handle
        lay: RefLayout = handle.layout
        R, K, N, dev = self.num_ranks, handle.num_topk, handle.num_tokens, self.device
        L = handle.num_experts // R
        hidden = c.x.shape[1]
        fields = [("x", c.x.dtype, hidden)]
        if c.topk_weights is not None:
            fields.append(("w", c.topk_weights.dtype, 1 if handle.do_expand else K))
        codec = _RowCodec(fields)
        acc_dtype = torch.float64 if c.x.dtype == torch.float64 else torch.float32

        if handle.do_expand:
            # Every (received row, local slot) pair goes back as its own row, in (token, slot) order.
            send_splits, recv_splits = lay.return_send_splits, lay.return_recv_splits
            num_send = sum(send_splits)
            send = torch.zeros(num_send + 1, codec.width, dtype=torch.uint8, device=dev)
            x_pad = torch.cat([c.x, c.x.new_zeros(1, hidden)])
            w_pad = None if c.topk_weights is None else torch.cat([c.topk_weights, c.topk_weights.new_zeros(1)])
            trash_row = c.x.shape[0]
            for j in range(K):
                rows = lay.expand_row_MK[:, j]
                src = torch.where(rows >= 0, rows, trash_row)
                fields_j = {"x": x_pad[src]}
                if w_pad is not None:
                    fields_j["w"] = w_pad[src][:, None]
                dst = lay.return_pos_MK[:, j]
                codec.pack_into(send, torch.where(dst >= 0, dst, num_send), fields_j)
        else:
            # Rows go back into the blocks they arrived in (the unused tail of a block stays zero).
            send_splits, recv_splits = lay.recv_splits, lay.send_splits
            num_send = sum(send_splits)
            send = torch.zeros(num_send + 1, codec.width, dtype=torch.uint8, device=dev)
            valid_B = lay.out_row_B >= 0
            src_rows = lay.out_row_B.clamp(min=0)
            fields_all = {"x": c.x[src_rows]}
            if c.topk_weights is not None:
                fields_all["w"] = c.topk_weights[src_rows]
            codec.pack_into(send, torch.where(valid_B, torch.arange(num_send, device=dev), num_send), fields_all)
        num_recv = sum(recv_splits)
        recv, works = self._exchange(send, send_splits, recv_splits, "combine exchange")

        combined = torch.empty(N, hidden, dtype=c.x.dtype, device=dev)
        combined_w = None if c.topk_weights is None else torch.empty(N, K, dtype=c.topk_weights.dtype, device=dev)
        dest_NK = torch.where(handle.topk_idx >= 0, handle.topk_idx // L, -1)

        def finalize() -> None:
            # One extra zero row: gathers of absent (token, rank) or (token, slot) pairs read it.
            got = codec.unpack(recv, pad_rows=1)
            back_x = got["x"]
            acc = torch.zeros(N, hidden, dtype=acc_dtype, device=dev)
            # DESIGN 2.2 order: start from zero, add the terms one by one, then bias[0], bias[1].
            if handle.do_expand:
                rows_NK = torch.where(lay.slot_return_pos_NK >= 0, lay.slot_return_pos_NK, num_recv)
                for j in range(K):
                    acc += back_x[rows_NK[:, j]].to(acc_dtype)
                if combined_w is not None:
                    combined_w.copy_(got["w"].view(-1)[rows_NK])
            else:
                offsets = _block_starts(recv_splits, dev)
                rows_NR = torch.where(lay.send_pos_NR >= 0, offsets[None, :] + lay.send_pos_NR, num_recv)
                for d in range(R):
                    acc += back_x[rows_NR[:, d]].to(acc_dtype)
                if combined_w is not None:
                    owner_rows_NK = rows_NR.gather(1, dest_NK.clamp(min=0))
                    owner_rows_NK = torch.where(dest_NK >= 0, owner_rows_NK, num_recv)
                    combined_w.copy_(got["w"][owner_rows_NK, torch.arange(K, device=dev)[None, :]])
            for b in c.bias:
                acc += b.to(acc_dtype)
            combined.copy_(acc)

        return (combined, combined_w), works, [finalize]
