"""Hybrid path of the reference backend (DESIGN 8.3, issue 15): the group is `S` scale-up domains ("hosts") of
`U` ranks, rank `r = h * U + u` sitting on host h with local index u. Only ranks of one local index (a "rail")
exchange across hosts; everything else stays inside a host. Every exchange is a `_exchange` over one leg's peers:
the scale-out leg (this rank's rail, one peer per host) or the scale-up leg (the ranks of this host). A rank is
the forwarder of its rail: it receives from the ranks of its local index on every host and fans out inside its
host. The outputs, the handle's tensors and the receive order are those of the direct path (`torch_ref`), bit
for bit; only `EPHandle.layout` differs (`HybridLayout`).

Shape legend (as `torch_ref`, and): S = hosts, U = ranks per host, F = rows of the forwarder's scale-out receive
buffer (one block per source host: the tokens of rank (h, u) for this host), T = combine terms of a token
(non-expand: one per destination rank, `U` per host; expand: one per slot, `K`).

How a fresh dispatch runs (me = (h0, u0)):
1. Layout (local, `_route`), plus the hosts each token goes to (`host_pos_NS`): once per host, whatever the number
   of its ranks the token needs there (dedup per host).
2. Count exchange, two legs. Scale-out: to the rail peer on each host h, the count rows of h's ranks (rows,
   per-expert counts, flags, tokens for host h). Scale-up: each forwarder hands every rank of its host the rows
   meant for it, one per source host. Every rank then holds the direct path's counts from every source rank.
3. Metadata, two legs: once per (token, host) the source token index, expert ids relative to the host, the
   weights on the host; the forwarder makes one row per (token, local rank owning one of its experts) with ids
   relative to that rank (`fwd_pos_FU`). A rank's scale-up receive buffer holds one region per source rank,
   ordered (source local index, source host) since forwarder u carries the sources (h, u); inside a region,
   source token order. `_compact_rows` maps it to the direct path's compact rows.
4. Data, two legs along the same positions: rows as raw bytes (FP8 included), the forwarder copying each arrived
   row to its fan-out positions. With `async_with_compute_stream` on CPU only the scale-up leg is left in flight.
Without a CPU sync every block has its worst-case capacity (`num_max_tokens_per_rank` rows per source and host)
and nothing is read on the host, as on the direct path.

Combine: rows go back along the scale-up leg to the forwarder (the rank of the source's local index on the
destination host), then along the rail to the source. Order (DESIGN 2.2 and 8.3):
- Unreduced (`deterministic=True`, or `allow_multiple_reduction=False`): the forwarder passes every term on; the
  source adds all of a token's terms from zero in DESIGN 2.2's order (ascending destination rank; expand,
  ascending slot), then `bias[0]`, `bias[1]`: bitwise the direct path's result. Up to `min(K, U)` rows per
  (token, host) cross (expand: `min(K, U * L)`).
- Partial reduction (`allow_multiple_reduction` and not `deterministic`): the forwarder adds the terms of a token
  on its host from zero in that order, in FP32 (FP64 for float64 rows), and the partial row crosses once, in that
  precision; the source adds the partials from zero in ascending host order, then the biases. The terms are those
  of the direct path, regrouped by host: `(t1 + t2) + (t3 + t4)` instead of `((t1 + t2) + t3) + t4`, so the
  accumulator is within FP32 rounding of the direct one, and a bf16 result may differ from it by one unit in the
  last place where the accumulator lies near a rounding boundary. Not bitwise, hence never with `deterministic`.
`combined_topk_weights` is a select on both paths (the forwarder selects the owning term's weight), so bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..handle import EPHandle
from .common import accumulation_dtype, exclusive_cumsum
from .torch_ref import (ReceivedCounts, TorchRefBackend, _block_of_rows, _block_starts, _compact_rows,
                        _meta_fields, _pack_blocks, _rows_in_blocks, _RowCodec, _select_weights, _sum_terms)


@dataclass(frozen=True)
class HybridLayout:
    """Routing state of the hybrid path, kept in `EPHandle.layout`. Positions are rows of a leg's send buffer.

    Source (scale-out leg):
        host_pos_NS: `[N, S]` row of each token in the block for host h, -1 if it does not go there.
        rail_send_splits / rail_recv_splits: rows per host of the scale-out leg (capacities without sync).
    Forwarder (scale-up leg):
        fwd_pos_FU: `[F, U]` row of the scale-up send buffer for (arrived row, local rank), -1: not sent there.
        host_send_splits / host_recv_splits: rows per local rank of the scale-up leg.
    Receiver: out_row_B, src_rank_M, expand_row_MK, return_pos_MK as in `RefLayout`; return_send_splits /
        return_recv_splits: rows per local rank of the expand combine's scale-up leg (receiver / forwarder).
    Combine at the forwarder:
        fwd_term_pos_FT: `[F, T]` row of the combine's scale-up receive buffer holding each term, -1: none.
        fwd_owner_FK: non-expand `[F, K]` the term (local rank) holding slot j, -1: not on this host; expand None.
        fwd_term_rail_pos_FT / term_rail_send_splits / term_rail_recv_splits: unreduced terms on the rail back:
            row of each term in the forwarder's send buffer, rows per host (forwarder / source side).
        term_pos_NT: `[N, R]` (expand `[N, K]`) row of each term in the source's receive buffer, -1: none.
        (The four term_rail fields are None with partial reduction, which sends one row per arrived row back
        along the scale-out leg's positions.)
    """

    host_pos_NS: torch.Tensor
    rail_send_splits: list[int]
    rail_recv_splits: list[int]
    fwd_pos_FU: torch.Tensor
    host_send_splits: list[int]
    host_recv_splits: list[int]
    out_row_B: torch.Tensor
    src_rank_M: torch.Tensor
    expand_row_MK: Optional[torch.Tensor]
    return_pos_MK: Optional[torch.Tensor]
    return_send_splits: Optional[list[int]]
    return_recv_splits: Optional[list[int]]
    fwd_term_pos_FT: torch.Tensor
    fwd_owner_FK: Optional[torch.Tensor]
    fwd_term_rail_pos_FT: Optional[torch.Tensor] = None
    term_rail_send_splits: Optional[list[int]] = None
    term_rail_recv_splits: Optional[list[int]] = None
    term_pos_NT: Optional[torch.Tensor] = None


def _local_major_regions(sizes: Sequence[int], S: int, U: int, device: torch.device
                         ) -> tuple[torch.Tensor, list[int], list[int]]:
    """A scale-up buffer: one block per local index u, holding one region per host h in ascending order; region
    (h, u) has `sizes[h * U + u]` rows. Returns `(start_SU, block_splits, region_splits)`: the first row of each
    region (`[S * U]`, indexed `h * U + u`), rows per block (`[U]`) and region sizes in buffer order."""
    region_splits = [sizes[h * U + u] for u in range(U) for h in range(S)]
    block_splits = [sum(region_splits[u * S:(u + 1) * S]) for u in range(U)]
    q = torch.arange(S * U, dtype=torch.int64, device=device)
    return _block_starts(region_splits, device)[(q % U) * S + q // U], block_splits, region_splits


def _rank_in_blocks(mask_FT: torch.Tensor, first_row_F: torch.Tensor, per_column: bool) -> torch.Tensor:
    """`[F, T]`: how many set entries of `mask_FT` precede each entry inside its block of rows (`first_row_F`: first
    row of each row's block): per column down the rows, or in row-major order."""
    m = mask_FT.long()
    if per_column:
        before = m.cumsum(0) - m
        return before - before[first_row_F]
    flat = m.flatten()
    before = (flat.cumsum(0) - flat).view_as(m)
    return before - before[first_row_F, :1]


def _copy_rows(src: torch.Tensor, src_pos: torch.Tensor, dst_pos: torch.Tensor, num_rows: int) -> torch.Tensor:
    """A send buffer of `num_rows` rows (plus a spare one): `src[src_pos[i]]` lands at `dst_pos[i]` for every entry
    with `dst_pos >= 0` (raw bytes: rows of any codec)."""
    dst = src.new_zeros(num_rows + 1, src.shape[1])
    src_pad = torch.cat([src, src.new_zeros(1, src.shape[1])])
    rows = src_pad[torch.where(src_pos >= 0, src_pos, src.shape[0])]
    dst.index_copy_(0, torch.where(dst_pos >= 0, dst_pos, num_rows).flatten(), rows.flatten(0, -2))
    return dst


class HybridRefBackend(TorchRefBackend):
    """The reference backend's hybrid path, behind `Buffer(backend="torch")` with more than one scale-up domain.

    Arguments (besides `TorchRefBackend`'s):
        num_scaleout_ranks: S, hosts; num_scaleup_ranks: U, ranks per host (rank r on host r // U).
        use_partial_reduction: sum a token's rows inside a host before they cross (module docstring).
    """

    supports_recv_hook = False  # as the CUDA hybrid path, which this one checks

    def __init__(self, group: dist.ProcessGroup, device: torch.device, num_cpu_timeout_secs: float,
                 num_scaleout_ranks: int, num_scaleup_ranks: int, use_partial_reduction: bool) -> None:
        super().__init__(group, device, num_cpu_timeout_secs)
        S, U = num_scaleout_ranks, num_scaleup_ranks
        if S * U != self.num_ranks:
            raise ValueError(f"num_scaleout_ranks={S} x num_scaleup_ranks={U} must be the group's {self.num_ranks} "
                             f"ranks")
        self.num_scaleout_ranks, self.num_scaleup_ranks = S, U
        h0, u0 = divmod(self.rank, U)
        self.rail_peers = [h * U + u0 for h in range(S)]
        self.host_peers = [h0 * U + u for u in range(U)]
        self.use_partial_reduction = use_partial_reduction
        # Handles of the direct path and of this one have different layouts: the name keeps them apart.
        self.name = f"torch hybrid {S}x{U}" + (" partial sums" if use_partial_reduction else "")

    # ------------------------------------------------------------------------------------------------
    # Legs
    # ------------------------------------------------------------------------------------------------
    def _rail(self, send, send_splits, recv_splits, phase: str):
        """The scale-out leg: blocks per host, to and from this rank's rail peers."""
        return self._exchange(send, send_splits, recv_splits, f"{phase} (scale-out leg)", self.rail_peers)

    def _host(self, send, send_splits, recv_splits, phase: str):
        """The scale-up leg: blocks per local index, to and from the ranks of this host."""
        return self._exchange(send, send_splits, recv_splits, f"{phase} (scale-up leg)", self.host_peers)

    def _by_rank(self, t_US: torch.Tensor) -> torch.Tensor:
        """Rows received from the forwarders (block u: one row per host h, source (h, u)) in source rank order."""
        S, U = self.num_scaleout_ranks, self.num_scaleup_ranks
        return t_US.view(U, S, *t_US.shape[1:]).transpose(0, 1).reshape(S * U, *t_US.shape[1:])

    def gather_values(self, mine: torch.Tensor, phase: str) -> torch.Tensor:
        S, U = self.num_scaleout_ranks, self.num_scaleup_ranks
        rail, works = self._rail(mine.expand(S, -1).contiguous(), [1] * S, [1] * S, phase)
        self._wait(works)
        everyone, works = self._host(rail.repeat(U, 1), [S] * U, [S] * U, phase)
        self._wait(works)
        return self._by_rank(everyone)

    # ------------------------------------------------------------------------------------------------
    # Dispatch
    # ------------------------------------------------------------------------------------------------
    def _dispatch_body(self, c):
        R, S, U = self.num_ranks, self.num_scaleout_ranks, self.num_scaleup_ranks
        L, K, N = c.num_experts // R, c.num_topk, c.num_tokens
        dev, cap = self.device, c.num_max_tokens_per_rank
        i64 = dict(dtype=torch.int64, device=dev)
        route = self._route(c)
        in_host_NS = route.in_rank_NR.view(N, S, U).any(2)
        host_pos_NS = torch.where(in_host_NS, in_host_NS.long().cumsum(0) - 1, -1)
        num_tokens_per_host = in_host_NS.long().sum(0)
        dest_host_NK = torch.where(route.topk_idx >= 0, route.topk_idx // (U * L), -1)

        # Count exchange: the direct path's count rows, plus the tokens for the row's host, through the forwarders.
        C = L + 3
        counts_send = torch.cat([route.num_tokens_per_rank[:, None], route.num_tokens_per_expert,
                                 route.flags.expand(R, 1), num_tokens_per_host.repeat_interleave(U)[:, None]], dim=1)
        fwd_counts, works = self._rail(counts_send, [U] * S, [U] * S, "dispatch count exchange")
        self._wait(works)
        fwd_SUC = fwd_counts.view(S, U, C)  # [h, u]: what source (h, u0) sends to rank (h0, u)
        counts_recv, works = self._host(fwd_SUC.transpose(0, 1).reshape(U * S, C), [S] * U, [S] * U,
                                        "dispatch count exchange")
        self._wait(works)
        counts = ReceivedCounts.of(self._by_rank(counts_recv), L, c.expert_alignment)
        fwd_rows_SU, fwd_pairs_SU = fwd_SUC[..., 0], fwd_SUC[..., 1:L + 1].sum(2)
        fwd_tokens_S = fwd_SUC[:, 0, L + 2]
        # Terms of the unreduced combine per host: (token, rank) pairs, expand (token, slot) pairs.
        own_terms_S = (route.num_tokens_per_expert if c.do_expand else route.num_tokens_per_rank).view(S, -1).sum(1)
        fwd_terms_S = (fwd_pairs_SU if c.do_expand else fwd_rows_SU).sum(1)
        if c.do_cpu_sync:
            rows_R, pairs_R, aligned_list, rail_send, rail_recv, fwd_rows, fwd_pairs, own_terms, fwd_terms = \
                self._read_counts(c, counts.flags_R, [
                    counts.rows_R, counts.pairs_R, counts.aligned_L, num_tokens_per_host, fwd_tokens_S,
                    fwd_rows_SU.flatten(), fwd_pairs_SU.flatten(), own_terms_S, fwd_terms_S])
        else:
            self._defer_flags(counts.flags_R)
            aligned_list = None
            rows_R = fwd_rows = [cap] * R
            pairs_R = fwd_pairs = [cap * min(K, L)] * R
            rail_send = rail_recv = [cap] * S
            own_terms = fwd_terms = [cap * min(K, U * L if c.do_expand else U)] * S
        fwd_start_SU, host_send, _ = _local_major_regions(fwd_rows, S, U, dev)
        _, host_recv, recv_regions = _local_major_regions(rows_R, S, U, dev)

        # Metadata, scale-out leg: once per (token, host), expert ids relative to the host.
        meta = self._meta_codec(c)
        src_N = torch.arange(N, **i64)
        send = _pack_blocks(meta, host_pos_NS, exclusive_cumsum(rail_send), sum(rail_send), lambda h: _meta_fields(
            src_N, route.topk_idx, c.topk_weights, dest_host_NK, h, h * U * L))
        arrived, works = self._rail(send, rail_send, rail_recv, "dispatch metadata exchange")
        self._wait(works)
        fwd = meta.unpack(arrived)
        F = arrived.shape[0]
        block_F = _block_of_rows(rail_recv, dev)
        first_row_F = _block_starts(rail_recv, dev)[block_F]
        valid_F = torch.arange(F, **i64) - first_row_F < fwd_tokens_S[block_F]  # rows past a block's count: none
        fwd_idx_FK = torch.where(valid_F[:, None], fwd["idx"], -1)
        owner_FK = torch.where(fwd_idx_FK >= 0, fwd_idx_FK // L, -1)
        goes_FU = torch.zeros(F, U + 1, dtype=torch.bool, device=dev)
        goes_FU.scatter_(1, torch.where(owner_FK >= 0, owner_FK, U), True)
        goes_FU = goes_FU[:, :U]
        region_FU = block_F[:, None] * U + torch.arange(U, **i64)[None, :]
        fwd_pos_FU = torch.where(goes_FU, fwd_start_SU[region_FU] + _rank_in_blocks(goes_FU, first_row_F, True), -1)

        # Metadata, scale-up leg: one row per (token, local rank it needs), ids relative to that rank.
        send = _pack_blocks(meta, fwd_pos_FU, [0] * U, sum(host_send), lambda u: _meta_fields(
            fwd["src"], fwd_idx_FK, fwd.get("w"), owner_FK, u, u * L))
        received, works = self._host(send, host_send, host_recv, "dispatch metadata exchange")
        self._wait(works)
        q = torch.arange(R, **i64)
        out_row_B, src_rank_B = _compact_rows(recv_regions, (q % S) * U + q // S, counts.rows_R)
        return_start_R, return_send, _ = _local_major_regions(pairs_R, S, U, dev)
        rows = self._received_rows(c, meta.unpack(received), out_row_B, src_rank_B, counts, aligned_list,
                                   return_start_R)

        # Where the combine's terms arrive at the forwarder: non-expand the fan-out rows themselves, expand one
        # region per (source host, local rank) with (token, slot) pairs in row-major order.
        fwd_pair_start_SU, return_recv, _ = _local_major_regions(fwd_pairs, S, U, dev)
        fwd_term_pos_FT, fwd_owner_FK = fwd_pos_FU, owner_FK
        if c.do_expand:
            fwd_term_pos_FT, fwd_owner_FK = torch.full_like(fwd_idx_FK, -1), None
            for u in range(U):
                on_u = owner_FK == u
                rows_FK = fwd_pair_start_SU[block_F * U + u][:, None] + _rank_in_blocks(on_u, first_row_F, False)
                fwd_term_pos_FT = torch.where(on_u, rows_FK, fwd_term_pos_FT)
        layout = dict(host_pos_NS=host_pos_NS, rail_send_splits=rail_send, rail_recv_splits=rail_recv,
                      fwd_pos_FU=fwd_pos_FU, host_send_splits=host_send, host_recv_splits=host_recv,
                      out_row_B=out_row_B, src_rank_M=rows.src_rank_M, expand_row_MK=rows.expand_row_MK,
                      return_pos_MK=rows.return_pos_MK, return_send_splits=return_send if c.do_expand else None,
                      return_recv_splits=return_recv if c.do_expand else None, fwd_term_pos_FT=fwd_term_pos_FT,
                      fwd_owner_FK=fwd_owner_FK)
        if not self.use_partial_reduction:
            # Unreduced terms on the rail back: per source host, (token, term) row-major.
            has_FT = fwd_term_pos_FT >= 0
            term_start_F = _block_starts(fwd_terms, dev)[block_F]
            host_NT = dest_host_NK if c.do_expand else \
                torch.where(route.in_rank_NR, torch.arange(R, **i64)[None, :] // U, -1)
            layout.update(fwd_term_rail_pos_FT=torch.where(
                has_FT, term_start_F[:, None] + _rank_in_blocks(has_FT, first_row_F, False), -1),
                term_rail_send_splits=fwd_terms, term_rail_recv_splits=own_terms,
                term_pos_NT=_rows_in_blocks(host_NT, S, own_terms))
        handle = self._new_handle(c, route, rows, counts, aligned_list, HybridLayout(**layout))
        recv_x, works, finalizers = self._send_data(c, handle)
        return (recv_x, None if c.do_expand else rows.recv_idx_MK, rows.out_w, handle), works, finalizers

    def _send_data(self, c, handle: EPHandle):
        """Data along `handle`'s layout, both legs (the scale-up one left in flight): `(recv_x, works, finalizers)`."""
        lay: HybridLayout = handle.layout
        codec = _RowCodec(self._data_fields(c, c.hidden))
        wire = self._wire_tensors(c)
        send = _pack_blocks(codec, lay.host_pos_NS, exclusive_cumsum(lay.rail_send_splits),
                            sum(lay.rail_send_splits), lambda h: wire)
        arrived, works = self._rail(send, lay.rail_send_splits, lay.rail_recv_splits, "dispatch data exchange")
        self._wait(works)
        rows_F = torch.arange(arrived.shape[0], device=self.device)[:, None].expand_as(lay.fwd_pos_FU)
        send = _copy_rows(arrived, rows_F, lay.fwd_pos_FU, sum(lay.host_send_splits))
        recv, works = self._host(send, lay.host_send_splits, lay.host_recv_splits, "dispatch data exchange")
        recv_x, finalize = self._dispatch_outputs(c, handle, codec, recv, lay.out_row_B, lay.expand_row_MK)
        return recv_x, works, [finalize]

    # ------------------------------------------------------------------------------------------------
    # Combine
    # ------------------------------------------------------------------------------------------------
    def combine_steps(self, c):
        handle: EPHandle = c.handle
        lay: HybridLayout = handle.layout
        L = handle.num_experts // self.num_ranks
        codec = self._combine_codec(c)

        # Scale-up leg: every row back to the forwarder it came through.
        send, send_splits, recv_splits = self._pack_back(c, codec, lay, (lay.host_recv_splits, lay.host_send_splits))
        back, works = self._host(send, send_splits, recv_splits, "combine exchange")
        self._wait(works)

        # Scale-out leg: one partial row per arrived row, or every term as it is.
        if self.use_partial_reduction:
            partial, send = self._reduce_in_host(c, codec, back, lay)
            recv, works = self._rail(send, lay.rail_recv_splits, lay.rail_send_splits, "combine exchange")
            starts_S = _block_starts(lay.rail_send_splits, self.device)
            rows_NS = torch.where(lay.host_pos_NS >= 0, starts_S[None, :] + lay.host_pos_NS, -1)
            dest_host_NK = torch.where(handle.topk_idx >= 0, handle.topk_idx // (self.num_scaleup_ranks * L), -1)
            outputs, finalize = self._combine_outputs(c, partial, recv, rows_NS, dest_host_NK)
        else:
            send = _copy_rows(back, lay.fwd_term_pos_FT, lay.fwd_term_rail_pos_FT, sum(lay.term_rail_send_splits))
            recv, works = self._rail(send, lay.term_rail_send_splits, lay.term_rail_recv_splits, "combine exchange")
            dest_NK = None if handle.do_expand else torch.where(handle.topk_idx >= 0, handle.topk_idx // L, -1)
            outputs, finalize = self._combine_outputs(c, codec, recv, lay.term_pos_NT, dest_NK)
        return outputs, works, [finalize]

    def _reduce_in_host(self, c, codec: _RowCodec, back: torch.Tensor, lay: HybridLayout
                        ) -> tuple[_RowCodec, torch.Tensor]:
        """The forwarder's partial sums: per arrived row, its terms on this host added from zero in term order, in
        the accumulation precision, with slot j's weight selected from the term that owns it. Returns the partial
        rows' codec and the scale-out send buffer (the positions the rows arrived at)."""
        acc_dtype = accumulation_dtype(c.x.dtype)
        F, K = lay.fwd_term_pos_FT.shape[0], c.handle.num_topk
        got = codec.unpack(back, pad_rows=1)
        pad = back.shape[0]
        rows_FT = torch.where(lay.fwd_term_pos_FT >= 0, lay.fwd_term_pos_FT, pad)
        fields = {"x": _sum_terms(got["x"], rows_FT, acc_dtype)}
        partial_fields = [("x", acc_dtype, c.x.shape[1])]
        if c.topk_weights is not None:
            fields["w"] = _select_weights(got["w"], rows_FT, lay.fwd_owner_FK, pad)
            partial_fields.append(("w", c.topk_weights.dtype, K))
        partial = _RowCodec(partial_fields)
        send = torch.zeros(F + 1, partial.width, dtype=torch.uint8, device=self.device)
        arrived_F = (lay.fwd_term_pos_FT >= 0).any(1)
        partial.pack_into(send, torch.where(arrived_F, torch.arange(F, device=self.device), F), fields)
        return partial, send
