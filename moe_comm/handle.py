"""EPHandle: the routing layout a dispatch returns, reused by combine and by cached dispatch.

Shape legend used in field docs: N = this rank's tokens, K = top-k slots, R = ranks, L = local experts
(`num_experts // R`), M = rows of the non-expand receive layout (tokens received from all ranks),
P = rows of the dispatch output (M, or expand rows with padding).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True, eq=False)
class EPHandle:
    """The layout of one dispatch. Pass it to `Buffer.combine` and to cached `Buffer.dispatch(handle=...)`.

    Configuration (checked on reuse):
        group: the process group of the buffer that made it.
        backend: the backend that made it ("torch" or "cuda"); only that backend can read `layout`.
        epoch: serial of the fresh dispatch that made it on its backend (base + 1, 2, ...; the base is the buffer's
            serial among those made on its group, agreed at construction, times 2**49; after ranks disagreed on the
            CUDA backend it restarts higher, the same on every rank): ranks that call in the same order hold handles
            of the same epoch, so a combine or cached dispatch checks it across ranks, also against a peer holding
            another buffer's.
        num_experts: global expert count; `num_experts // num_ranks` live on each rank.
        num_topk: slots per token (K).
        num_tokens: this rank's token count N at dispatch time (a cached dispatch must send as many).
        num_max_tokens_per_rank: the per-rank maximum the layout was sized with.
        do_expand: True for the expand layout (one row per (token, local expert), grouped by expert).
        expert_alignment: each expert block of the expand layout is padded to a multiple of this.
        num_sms: SMs the dispatch ran with (the analytical default when the call passed 0).
        do_cpu_sync: False when the outputs were sized for the worst case without a host sync.

    Tensors on the buffer's device:
        topk_idx: `[N, K]`, `torch.int64`, the routing this rank sent (invalid slots dropped to -1).
        recv_src_idx: `[M]`, `torch.int64`, source token index of each received row, -1 for rows past the
            true count (no CPU sync). Rows are grouped by source rank in ascending rank order.
        recv_topk_idx: `[M, K]`, `torch.int64`, local expert ids of the received rows (-1: not on this rank).
        recv_topk_weights: the dispatch's `recv_topk_weights` output (`[M, K]`, or `[P]` expand), or None.
        psum_num_recv_tokens_per_rank: `[R]`, `torch.int64`, inclusive prefix sum of rows received per
            source rank (non-expand rows, i.e. tokens).
        psum_num_recv_tokens_per_expert: `[L]`, `torch.int64`, inclusive prefix sum of the aligned
            per-local-expert row counts (both modes).

    Host values (None when `do_cpu_sync` is False):
        num_recv_tokens: rows of the dispatch output that hold data (non-expand: tokens received; expand:
            expanded rows including alignment padding).
        num_recv_tokens_per_expert_list: row count of each local expert, rounded up to `expert_alignment`.

    Other:
        num_recv_rows: first dimension P of the dispatch output (worst case without a CPU sync).
        layout: backend-private routing state (see the backend module); treat as opaque.
    """

    group: dist.ProcessGroup
    backend: str
    epoch: int
    num_experts: int
    num_topk: int
    num_tokens: int
    num_max_tokens_per_rank: int
    do_expand: bool
    expert_alignment: int
    num_sms: int
    do_cpu_sync: bool
    topk_idx: torch.Tensor
    recv_src_idx: torch.Tensor
    recv_topk_idx: torch.Tensor
    recv_topk_weights: Optional[torch.Tensor]
    psum_num_recv_tokens_per_rank: torch.Tensor
    psum_num_recv_tokens_per_expert: torch.Tensor
    num_recv_tokens: Optional[int]
    num_recv_tokens_per_expert_list: Optional[list[int]]
    num_recv_rows: int
    layout: object = field(repr=False, default=None)

    @classmethod
    def make(cls, **values) -> "EPHandle":
        """`EPHandle(**values)` with every field given, as the backends build their handles: without the frozen
        dataclass's object.__setattr__ per field (~2.5 us of host time per fresh dispatch). Frozen still: the
        CUDA backend's launch structs trust the sizes a handle had at its first cached dispatch or combine."""
        if values.keys() != _FIELD_NAMES:
            raise TypeError(f"EPHandle.make needs every field: missing {sorted(_FIELD_NAMES - values.keys())}, "
                            f"unknown {sorted(values.keys() - _FIELD_NAMES)}")
        handle = object.__new__(cls)
        handle.__dict__.update(values)
        return handle

    def __copy__(self) -> "EPHandle":
        return self

    def __deepcopy__(self, memo) -> "EPHandle":
        return self  # frozen: a copy would be the same layout, and its group cannot be copied

    def __reduce__(self):
        raise TypeError("a moe_comm.EPHandle belongs to the live buffer and process group that made it: it cannot be "
                        "pickled or saved (dispatch again after loading)")

    def check_owner(self, group: dist.ProcessGroup, backend: str) -> None:
        """Raise ValueError unless a buffer on `group` with `backend` can use this handle."""
        if group is not self.group:
            raise ValueError("handle was made by a buffer on another process group")
        if backend != self.backend:
            raise ValueError(f"handle was made by backend {self.backend!r}, this buffer runs {backend!r}: "
                             f"a handle's layout is private to its backend")

    def check_reuse(self, group: dist.ProcessGroup, backend: str, num_experts: Optional[int], num_tokens: int,
                    do_expand: bool, expert_alignment: int, num_max_tokens_per_rank: Optional[int]) -> None:
        """Raise ValueError if a call's buffer or configuration differs from the one this handle was made with
        (`expert_alignment` only for an expand handle: it does not change a non-expand cached dispatch)."""
        self.check_owner(group, backend)
        mismatches = []
        if num_experts is not None and num_experts != self.num_experts:
            mismatches.append(f"num_experts={num_experts} (handle: {self.num_experts})")
        if num_tokens != self.num_tokens:
            mismatches.append(f"num_tokens={num_tokens} (handle: {self.num_tokens})")
        if do_expand != self.do_expand:
            mismatches.append(f"do_expand={do_expand} (handle: {self.do_expand})")
        # Without expand the alignment only rounds the handle's `num_recv_tokens_per_expert_list`, which a cached
        # dispatch does not recompute: DeepEP's `dispatch(x, handle=handle)` need not repeat it.
        if self.do_expand and expert_alignment != self.expert_alignment:
            mismatches.append(f"expert_alignment={expert_alignment} (handle: {self.expert_alignment})")
        if num_max_tokens_per_rank is not None and num_max_tokens_per_rank != self.num_max_tokens_per_rank:
            mismatches.append(f"num_max_tokens_per_rank={num_max_tokens_per_rank} "
                              f"(handle: {self.num_max_tokens_per_rank})")
        if mismatches:
            raise ValueError("handle does not match this call: " + ", ".join(mismatches))


_FIELD_NAMES = frozenset(f.name for f in fields(EPHandle))
