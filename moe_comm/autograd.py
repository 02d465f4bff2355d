"""Differentiable dispatch and combine (DESIGN section 3).

    recv_x, recv_topk_idx, recv_topk_weights, handle, event = moe_comm.autograd.dispatch(buffer, x, topk_idx,
                                                                                         topk_weights, ...)
    combined, event = moe_comm.autograd.combine(buffer, expert_out, handle, bias=...)

- `dispatch` backward is a combine: `grad_x` sums the row gradients of each token, and `grad_topk_weights` is
  the select of `grad_recv_topk_weights` (`combined_topk_weights`), in both layouts.
- `combine` backward is a cached dispatch of `grad_combined` along the handle; a bias' gradient is the output
  gradient.
- FP8 on the wire with `dequantize=True` is straight-through: the backward is a BF16 combine. An FP8 tuple
  output (no `dequantize`) and a pre-quantized FP8 tuple input carry no gradient.

Both wrappers return the buffer's `EventOverlap` last. With `async_with_compute_stream=True` they return before
the communication ends: call `event.current_stream_wait()` (or use `with event:`) before touching the outputs.
With `return_recv_hook=True` they return the hook after the event: call it before using the outputs (autograd
records the call as usual; the hook fills its outputs in place).
The backward passes run on the comm stream and make the current stream wait for their result (on CUDA the host
does not block; on CPU the reference backend waits for its collectives). They are differentiable once: a double
backward through them (`create_graph=True`, then a backward of the gradients) raises a RuntimeError.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.autograd.function import once_differentiable

from .buffer import Buffer
from .handle import EPHandle

_NO_AUTOGRAD_ARGS = ("topk_weights",)


def _check_buffer(buffer, what: str) -> None:
    if not isinstance(buffer, Buffer):
        raise TypeError(f"moe_comm.autograd.{what} takes the moe_comm.Buffer first, got {type(buffer).__name__} "
                        f"(call it as {what}(buffer, ...))")


class Dispatch(torch.autograd.Function):
    """`Buffer.dispatch` with a combine as backward. Use `moe_comm.autograd.dispatch`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, x_scales: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor],
                buffer, topk_idx: Optional[torch.Tensor], kwargs: dict):
        x_in = x if x_scales is None else (x, x_scales)
        recv_x, recv_idx, recv_w, handle, event, *hook = buffer.dispatch(x_in, topk_idx, topk_weights, **kwargs)
        # The handle keeps recv_topk_idx/weights: hand out aliases, so that autograd never attaches a grad_fn
        # to the handle's own tensors (a later cached dispatch returns them again).
        recv_idx = None if recv_idx is None else recv_idx.detach()
        recv_w = None if recv_w is None else recv_w.detach()
        recv_scales = None
        if isinstance(recv_x, tuple):
            recv_x, recv_scales = recv_x
            ctx.mark_non_differentiable(recv_x, recv_scales)
        if recv_idx is not None:
            ctx.mark_non_differentiable(recv_idx)
        if recv_w is not None and kwargs.get("handle") is not None:
            # A cached dispatch returns the forward's weights: they depend on no input of this call.
            ctx.mark_non_differentiable(recv_w)
        ctx.buffer, ctx.handle = buffer, handle
        ctx.allocate_on_comm_stream = kwargs.get("allocate_on_comm_stream", False)
        # No gradient reaches x through FP8 rows: a pre-quantized input or an FP8 tuple output.
        ctx.x_has_grad = x_scales is None and recv_scales is None
        ctx.row_dtype = x.dtype if x_scales is None else torch.bfloat16
        ctx.hidden = recv_x.shape[1]
        return recv_x, recv_scales, recv_idx, recv_w, handle, event, *hook

    @staticmethod
    @once_differentiable  # no double backward: a second one raises (it would treat moe_comm as a constant)
    def backward(ctx, grad_recv_x, grad_scales, grad_idx, grad_recv_w, grad_handle, grad_event, *grad_hook):
        need_x = ctx.needs_input_grad[0] and ctx.x_has_grad
        need_w = ctx.needs_input_grad[2]
        if not (need_x or need_w):
            return (None,) * 6
        if grad_recv_x is None or not ctx.x_has_grad:
            # Weight gradients still need a combine; FP8 rows carry nothing back: zeros of the rows' width (the
            # peers call the same combine). Rows with a gradient always go back: they are the peers' tokens too,
            # whatever this rank's own x needs.
            grad_recv_x = torch.zeros(ctx.handle.num_recv_rows, ctx.hidden, dtype=ctx.row_dtype,
                                      device=ctx.buffer.device)
        combined, combined_w, _ = ctx.buffer.combine(
            grad_recv_x.contiguous(), ctx.handle,
            topk_weights=None if grad_recv_w is None else grad_recv_w.contiguous(),
            allocate_on_comm_stream=ctx.allocate_on_comm_stream)
        return (combined if need_x else None), None, (combined_w if need_w else None), None, None, None


class Combine(torch.autograd.Function):
    """`Buffer.combine` with a cached dispatch as backward. Use `moe_comm.autograd.combine`."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, bias0: Optional[torch.Tensor], bias1: Optional[torch.Tensor], buffer,
                handle: EPHandle, kwargs: dict):
        bias = tuple(b for b in (bias0, bias1) if b is not None)
        combined, _, event, *hook = buffer.combine(y, handle, bias=bias or None, **kwargs)
        ctx.buffer, ctx.handle = buffer, handle
        ctx.allocate_on_comm_stream = kwargs.get("allocate_on_comm_stream", False)
        return combined, event, *hook

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_combined, grad_event, *grad_hook):
        need_y, need_b0, need_b1 = ctx.needs_input_grad[:3]
        grad_y = None
        if need_y:
            handle = ctx.handle
            grad_y, _, _, _, _ = ctx.buffer.dispatch(
                grad_combined.contiguous(), handle=handle, do_expand=handle.do_expand,
                expert_alignment=handle.expert_alignment, allocate_on_comm_stream=ctx.allocate_on_comm_stream)
        return (grad_y, grad_combined if need_b0 else None, grad_combined if need_b1 else None, None, None, None)


@torch.compiler.disable
def dispatch(buffer, x, topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
             **dispatch_kwargs: Any):
    """Differentiable `buffer.dispatch(x, topk_idx, topk_weights, **dispatch_kwargs)`.

    Arguments:
        buffer: a `moe_comm.Buffer`.
        x, topk_idx, topk_weights, dispatch_kwargs: as `Buffer.dispatch`.

    Returns:
        `(recv_x, recv_topk_idx, recv_topk_weights, handle, event)` and the hook with `return_recv_hook`, as
        `Buffer.dispatch`; `recv_x` and `recv_topk_weights` carry gradients back to `x` and `topk_weights`.
    """
    _check_buffer(buffer, "dispatch")
    if isinstance(x, tuple) and len(x) == 2:  # pre-quantized; anything else is the Buffer's to refuse
        q, scales = x
        out = Dispatch.apply(q, scales, topk_weights, buffer, topk_idx, dispatch_kwargs)
    else:
        out = Dispatch.apply(x, None, topk_weights, buffer, topk_idx, dispatch_kwargs)
    recv_x, recv_scales, recv_idx, recv_w, handle, event, *hook = out
    return ((recv_x if recv_scales is None else (recv_x, recv_scales)), recv_idx, recv_w, handle, event, *hook)


@torch.compiler.disable
def combine(buffer, y: torch.Tensor, handle: EPHandle, bias=None, **combine_kwargs: Any):
    """Differentiable `buffer.combine(y, handle, bias=bias, **combine_kwargs)`.

    Arguments:
        buffer: a `moe_comm.Buffer`.
        y: `[P, H]` expert outputs in the layout of `handle`'s dispatch.
        handle: the dispatch's `EPHandle`.
        bias: None, a tensor, or a tuple of two tensors (`[N, H]`, y's dtype), differentiable.
        combine_kwargs: `num_sms`, `previous_event`, `async_with_compute_stream`, `allocate_on_comm_stream`,
            `return_recv_hook`.

    Returns:
        `(combined, event)`, and the hook with `return_recv_hook`.
    """
    _check_buffer(buffer, "combine")
    for name in _NO_AUTOGRAD_ARGS:
        if name in combine_kwargs:
            raise TypeError(f"moe_comm.autograd.combine does not take {name}; weight gradients flow through "
                            f"dispatch's recv_topk_weights")
    if bias is None:
        bias = ()
    elif isinstance(bias, torch.Tensor):
        bias = (bias,)
    bias = tuple(bias)
    if len(bias) > 2:
        raise ValueError(f"bias takes at most two tensors, got {len(bias)}")
    bias0, bias1 = (tuple(bias) + (None, None))[:2]
    return Combine.apply(y, bias0, bias1, buffer, handle, combine_kwargs)
