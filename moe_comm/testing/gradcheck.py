"""gradcheck across ranks (DESIGN section 3).

gradcheck perturbs inputs one at a time and calls the function again, and every call is collective. So every
rank runs the same gradcheck on the same *global* inputs (all ranks' tokens, built from one seed): the function
takes this rank's slice (`take_rank_slice`, whose backward sums the gradient over ranks), runs
dispatch -> a differentiable per-row op -> combine, and returns the global result (`gather_rank_slices`: each
rank writes its slice into zeros, then `all_reduce`; its backward takes this rank's slice of the gradient).
Both work on gloo.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import autograd as moe_autograd
from .routing import Case, rank_bias, rank_inputs


class _TakeRankSlice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_global: torch.Tensor, start: int, length: int, group):
        ctx.start, ctx.length, ctx.group, ctx.shape = start, length, group, x_global.shape
        return x_global[start:start + length].clone()

    @staticmethod
    def backward(ctx, grad):
        full = grad.new_zeros(ctx.shape)
        full[ctx.start:ctx.start + ctx.length] = grad
        dist.all_reduce(full, group=ctx.group)
        return full, None, None, None


class _GatherRankSlices(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local: torch.Tensor, start: int, total: int, group):
        ctx.start, ctx.length = start, x_local.shape[0]
        full = x_local.new_zeros((total, *x_local.shape[1:]))
        full[start:start + x_local.shape[0]] = x_local
        dist.all_reduce(full, group=group)
        return full

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.start:ctx.start + ctx.length].clone(), None, None, None


def take_rank_slice(x_global: torch.Tensor, start: int, length: int, group=None) -> torch.Tensor:
    """Rows `[start, start + length)` of a tensor every rank holds; the gradient is summed over ranks."""
    return _TakeRankSlice.apply(x_global, start, length, group)


def gather_rank_slices(x_local: torch.Tensor, start: int, total: int, group=None) -> torch.Tensor:
    """Every rank's rows placed at their offsets in one `[total, ...]` tensor, identical on every rank."""
    return _GatherRankSlices.apply(x_local, start, total, group)


def global_inputs(case: Case, device="cpu") -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """All ranks' x and topk_weights stacked (float64 leaves), and each rank's first row."""
    xs, ws = [], []
    for r in range(case.num_ranks):
        x, _, w = rank_inputs(case, r, device)
        xs.append(x)
        ws.append(w)
    starts = [sum(case.num_tokens[:r]) for r in range(case.num_ranks)]
    return torch.cat(xs).requires_grad_(), torch.cat(ws).requires_grad_(), starts


def dispatch_combine_fn(buffer, case: Case, rank: int, recv_hook: bool = False):
    """The function gradcheck differentiates: global (x, topk_weights) -> global combined rows (with `recv_hook`,
    both calls receive in their hooks)."""
    _, topk_idx, _ = rank_inputs(case, rank, buffer.device)
    bias = rank_bias(case, rank, buffer.device)
    n = case.num_tokens[rank]
    total = sum(case.num_tokens)
    start = sum(case.num_tokens[:rank])

    def fn(x_global: torch.Tensor, w_global: torch.Tensor) -> torch.Tensor:
        x = take_rank_slice(x_global, start, n)
        w = take_rank_slice(w_global, start, n)
        recv_x, _, recv_w, handle, _, *hook = moe_autograd.dispatch(
            buffer, x, topk_idx, w, num_experts=case.num_experts, expert_alignment=case.expert_alignment,
            do_expand=case.do_expand, do_cpu_sync=case.do_cpu_sync, return_recv_hook=recv_hook)
        for receive in hook:
            receive()
        # A per-row op that uses both the rows and the weights, non-linear in both.
        gate = recv_w if case.do_expand else recv_w.sum(dim=1)
        y = recv_x * (1 + gate)[:, None] + 0.25 * recv_x * recv_x * gate[:, None]
        combined, _, *hook = moe_autograd.combine(buffer, y, handle, bias=tuple(b.requires_grad_(False) for b in bias),
                                                  return_recv_hook=recv_hook)
        for receive in hook:
            receive()
        return gather_rank_slices(combined, start, total)

    return fn


def run_gradcheck(buffer, case: Case, rank: int, recv_hook: bool = False) -> bool:
    """`torch.autograd.gradcheck` of `dispatch_combine_fn` on this rank (call on every rank at once)."""
    x_global, w_global, _ = global_inputs(case, buffer.device)
    fn = dispatch_combine_fn(buffer, case, rank, recv_hook)
    return torch.autograd.gradcheck(fn, (x_global, w_global), eps=1e-6, atol=1e-7, rtol=1e-5)
