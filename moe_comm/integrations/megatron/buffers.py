"""The process-wide cache of `moe_comm.Buffer`s behind both routes: one per (process group, backend,
deterministic), grown when a call needs more, as Megatron's DeepEP path does.

Keys hold the group object itself, not `id(group)`: an id can be reused by a new group once the old one is
garbage, and would hand it a buffer on a dead group. The cache keeps its groups and buffers alive until
`clear_buffers()`, or until a buffer is made while their group was destroyed meanwhile (a job that makes its
process groups anew, as after a failure, gets its memory back without calling `clear_buffers()`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...backends.common import forget_dead_groups
from ...buffer import Buffer
from .options import MoECommConfig

_buffers: dict[tuple[dist.ProcessGroup, str, bool], Buffer] = {}


def _max_over_ranks(group: dist.ProcessGroup, value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=Buffer.group_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


@torch.compiler.disable  # collective (a buffer made or grown, an all-reduce): eager under torch.compile
def get_buffer(group: dist.ProcessGroup, num_tokens: int, hidden: int, elem_size: int, num_topk: int,
               options: MoECommConfig) -> Buffer:
    """The cached `moe_comm.Buffer` for `group`, created or grown to fit this call.

    Every rank of `group` must call this at the same point (making a buffer is collective, and the first creation
    runs one all-reduce); ranks agree on sizes because hidden, top-k and dtype are model constants. A call with
    more tokens than the buffer was made for is refused by the dispatch itself, on every rank (set
    `num_max_tokens_per_rank` to the largest micro-batch's tokens per rank).

    Growing (for a larger hidden size or top-k, or for FP8) makes a larger buffer and drops the old one from the
    cache: it is released once nothing refers to it, so a backward still to run on it (an earlier layer's, in the
    first step) runs there. The MoE layers on one group share the buffer: give them the same sizes and options,
    and it never grows after their first forward.

    Arguments:
        group: the expert-parallel process group.
        num_tokens: rows this rank dispatches now.
        hidden: hidden size H of the rows.
        elem_size: bytes per element of the rows (bf16 2, float32 4).
        num_topk: top-k slots per token.
        options: the `MoECommConfig`.

    Returns:
        The `moe_comm.Buffer` to dispatch and combine with.
    """
    key = (group, options.backend, options.deterministic)
    hidden_bf16 = hidden * max(elem_size, 2) // 2  # Buffer(hidden=) counts bf16 elements
    use_fp8 = options.quantize is not None
    buf = _buffers.get(key)
    if buf is not None:
        made = {"num_max_tokens_per_rank": buf.num_max_tokens_per_rank, "sl_idx": buf.sl_idx,
                "num_cpu_timeout_secs": buf.num_cpu_timeout_secs}
        asked = {"num_max_tokens_per_rank": options.num_max_tokens_per_rank or buf.num_max_tokens_per_rank,
                 "sl_idx": options.sl_idx, "num_cpu_timeout_secs": float(options.num_cpu_timeout_secs)}
        if asked != made:  # the same on every rank (model options): every rank raises
            differ = {name: (made[name], asked[name]) for name in made if made[name] != asked[name]}
            raise ValueError(f"the MoE layers on one expert-parallel group share a moe_comm buffer, made with "
                             f"{made}; this layer's MoECommConfig asks for other values (made, asked): {differ}")
        if hidden_bf16 <= buf.hidden and num_topk <= buf.num_topk and (buf.use_fp8_dispatch or not use_fp8):
            return buf
        num_max_tokens = buf.num_max_tokens_per_rank
        hidden_bf16, num_topk = max(hidden_bf16, buf.hidden), max(num_topk, buf.num_topk)
        use_fp8 = use_fp8 or buf.use_fp8_dispatch
        del _buffers[key]  # not destroyed: a backward may still hold it
    else:
        for dead in forget_dead_groups(_buffers):  # their group was destroyed: they hold device memory
            dead.destroy()
        num_max_tokens = options.num_max_tokens_per_rank or _max_over_ranks(group, max(num_tokens, 1))
    buf = Buffer(group, num_max_tokens_per_rank=num_max_tokens, hidden=hidden_bf16, num_topk=num_topk,
                 use_fp8_dispatch=use_fp8, backend=options.backend, deterministic=options.deterministic,
                 num_cpu_timeout_secs=options.num_cpu_timeout_secs, sl_idx=options.sl_idx)
    _buffers[key] = buf
    return buf


def buffer_domain_sizes() -> list[tuple[int, int]]:
    """`Buffer.get_logical_domain_size()` of every cached buffer, `(scale-out ranks, scale-up ranks)`: `(1, R)` on
    the direct path, `(hosts, ranks per host)` on the hybrid one (for logs, and for tests that force hosts)."""
    return [buf.get_logical_domain_size() for buf in _buffers.values()]


def clear_buffers() -> None:
    """Destroy and forget the cached buffers (e.g. before destroying the process groups)."""
    for buf in _buffers.values():
        buf.destroy()
    _buffers.clear()


__all__ = ["get_buffer", "buffer_domain_sizes", "clear_buffers"]
