"""Route B: moe_comm behind Megatron's flex dispatcher (backend "deepep"), with DeepEP's fused_dispatch /
fused_combine contract.

`install_flex_dispatcher` replaces the three functions Megatron's `_DeepepManager` looks up at call time in
`megatron.core.transformer.moe.token_dispatcher`; Megatron keeps its own permutation, router padding and
expert-tensor-parallel handling (non-expand layout, as DeepEP). Shape legend: see the package docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import megatron.core.transformer.moe.token_dispatcher as mcore_token_dispatcher
import torch
import torch.distributed as dist

from ... import autograd as moe_autograd
from ...handle import EPHandle
from .buffers import get_buffer
from .options import MoECommConfig


@dataclass
class _FlexSettings:
    options: MoECommConfig
    num_sms: Union[int, str, None]
    megatron_num_sms: int = 0
    last_num_sms: int = 0  # SMs the last dispatch ran with (for logs)

    def resolve_num_sms(self) -> int:
        if self.num_sms is None:
            return 0  # analytical model
        if self.num_sms == "megatron":
            return self.megatron_num_sms
        return self.num_sms


_flex: Optional[_FlexSettings] = None
# Megatron's own functions, saved by the first install and put back by restore().
_originals: Optional[dict[str, Callable]] = None


def _settings() -> _FlexSettings:
    if _flex is None:
        raise RuntimeError("moe_comm flex dispatcher is not installed: call install_flex_dispatcher() first")
    return _flex


def fused_dispatch(x: torch.Tensor, token_indices: torch.Tensor, token_probs: torch.Tensor, num_experts: int,
                   group: dist.ProcessGroup, async_finish: bool = False, allocate_on_comm_stream: bool = False):
    """Drop-in for `megatron.core.transformer.moe.fused_a2a.fused_dispatch` (DeepEP semantics).

    Arguments:
        x: `[T, H]` rows. token_indices: `[T, K]` `torch.int64` expert ids (-1 = dropped).
        token_probs: `[T, K]` `torch.float32`. num_experts: experts over `group`. group: Megatron's TPxEP group.
        async_finish, allocate_on_comm_stream: run on the comm stream; the current stream waits before return.

    Returns:
        `(recv_x, recv_token_indices [M, K] local ids or -1, recv_token_probs [M, K], tokens_per_expert (CPU
        int64 tensor), handle)`, differentiable in `x` and `token_probs`.
    """
    flex = _settings()
    options = flex.options
    buf = get_buffer(group, x.shape[0], x.shape[1], x.element_size(), token_indices.shape[1], options)
    recv_x, recv_idx, recv_probs, handle, event = moe_autograd.dispatch(
        buf, x.contiguous(), token_indices.contiguous(), token_probs.float().contiguous(), num_experts=num_experts,
        num_sms=flex.resolve_num_sms(), quantize=options.quantize, dequantize=options.quantize is not None,
        async_with_compute_stream=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)
    event.current_stream_wait()
    flex.last_num_sms = handle.num_sms
    tokens_per_expert = torch.tensor(handle.num_recv_tokens_per_expert_list, dtype=torch.int64)
    return recv_x, recv_idx, recv_probs, tokens_per_expert, handle


def fused_combine(x: torch.Tensor, group: dist.ProcessGroup, handle: EPHandle, async_finish: bool = False,
                  allocate_on_comm_stream: bool = False):
    """Drop-in for `megatron.core.transformer.moe.fused_a2a.fused_combine`: `(combined [T, H], None)`."""
    flex = _settings()
    buf = get_buffer(group, handle.num_tokens, x.shape[1], x.element_size(), handle.num_topk, flex.options)
    combined, event = moe_autograd.combine(buf, x.contiguous(), handle, num_sms=flex.resolve_num_sms(),
                                           async_with_compute_stream=async_finish,
                                           allocate_on_comm_stream=allocate_on_comm_stream)
    event.current_stream_wait()
    return combined, None


def set_deepep_num_sms(num_sms: int) -> None:
    """Drop-in for `fused_a2a.set_deepep_num_sms`: records Megatron's `--moe-deepep-num-sms` value (used only
    with `install_flex_dispatcher(num_sms="megatron")`)."""
    if _flex is not None:
        _flex.megatron_num_sms = int(num_sms)


def flex_last_num_sms() -> int:
    """SMs the last route-B dispatch ran with (0 before the first one or when not installed)."""
    return _flex.last_num_sms if _flex is not None else 0


_REPLACEMENTS = {"fused_dispatch": fused_dispatch, "fused_combine": fused_combine,
                 "set_deepep_num_sms": set_deepep_num_sms}


def install_flex_dispatcher(backend: str = "auto", num_sms: Union[int, str, None] = None,
                            quantize: Optional[str] = None, deterministic: bool = True,
                            num_cpu_timeout_secs: float = 300.0, sl_idx: Optional[int] = None,
                            num_max_tokens_per_rank: Optional[int] = None) -> Callable[[], None]:
    """Make Megatron's flex dispatcher with backend "deepep" run on moe_comm (route B).

    Replaces `fused_dispatch`, `fused_combine` and `set_deepep_num_sms` in
    `megatron.core.transformer.moe.token_dispatcher` (looked up at call time by `_DeepepManager`), so
    `--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep` works without DeepEP installed.
    Call it before the model is built. Megatron keeps its own permutation (non-expand layout), router padding
    and TPxEP handling. Calling it again only changes the options: Megatron's functions are saved once.

    Arguments:
        backend: `moe_comm.Buffer` backend ("auto", "torch", "cuda").
        num_sms: None: the analytical model (Megatron's `--moe-deepep-num-sms` is DeepEP's tuning and is
            ignored); "megatron": use that flag's value; an int: that many SMs.
        quantize: None, "fp8_block128" or "mxfp8": FP8 on the wire, dequantized to bf16 on arrival.
        deterministic, num_cpu_timeout_secs, sl_idx, num_max_tokens_per_rank: as `MoECommConfig` (set the last
            when the first forward is not the largest, e.g. a small warm-up or evaluation batch).

    Returns:
        `restore()`, which puts Megatron's original functions back (whichever install returned it; a second
        call does nothing).
    """
    global _flex, _originals
    if not (num_sms is None or num_sms == "megatron" or (isinstance(num_sms, int) and num_sms > 0)):
        raise ValueError(f"num_sms={num_sms!r} must be None, 'megatron' or a positive int")
    options = MoECommConfig(backend=backend, quantize=quantize, deterministic=deterministic,
                            num_cpu_timeout_secs=num_cpu_timeout_secs, sl_idx=sl_idx,
                            num_max_tokens_per_rank=num_max_tokens_per_rank)
    if _originals is None:
        _originals = {name: getattr(mcore_token_dispatcher, name) for name in _REPLACEMENTS}
    _flex = _FlexSettings(options=options, num_sms=num_sms)
    for name, fn in _REPLACEMENTS.items():
        setattr(mcore_token_dispatcher, name, fn)
    return restore_flex_dispatcher


def restore_flex_dispatcher() -> None:
    """Put Megatron's original flex functions back and forget the route-B options (no-op if not installed)."""
    global _flex, _originals
    if _originals is not None:
        for name, fn in _originals.items():
            setattr(mcore_token_dispatcher, name, fn)
    _flex, _originals = None, None


__all__ = ["install_flex_dispatcher", "restore_flex_dispatcher", "flex_last_num_sms", "fused_dispatch",
           "fused_combine", "set_deepep_num_sms"]
