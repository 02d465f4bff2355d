"""Lifetime checks: does a buffer give back its memory when it is destroyed, or dropped without `destroy()`?

`churn_buffers(make_buffer, case, rank, num_buffers)` makes buffer after buffer, runs one case through each, destroys
every other one and drops the rest, and reports the memory figures before and after, and what the garbage collector
would have had to do. Used by the CPU tier (reference backend, host memory) and the GPU tier (CUDA backend, host and
device memory).
"""

from __future__ import annotations

import gc
import os
import sys
import weakref
from typing import Callable

import torch

from .routing import Case, rank_inputs


def host_rss_bytes() -> int:
    """Resident memory of this process (Linux: `/proc/self/statm`, second field, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def device_memory_bytes(device: torch.device) -> dict[str, int]:
    """Bytes of `device` that torch's caching allocator has handed out ("allocated") and holds ("reserved"), and that
    the driver counts as used ("used": what no allocator statistic sees, e.g. symmetric memory mapped by hand)."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device),
            "used": total - free}


def _memory(device: torch.device) -> dict[str, int]:
    figures = {"host rss": host_rss_bytes()}
    if device.type == "cuda":
        figures.update(device_memory_bytes(device))
    return figures


def churn_buffers(make_buffer: Callable[[], object], case: Case, rank: int, num_buffers: int,
                  num_warmups: int = 10) -> dict:
    """Make `num_buffers` buffers one after another with `make_buffer()` (collective: every rank runs the same loop),
    run a dispatch, a combine and a cached dispatch of `case` on each, then destroy the even ones and drop the odd
    ones without `destroy()`.

    The loop runs with the cyclic garbage collector off, so a buffer is released by reference counting alone (at
    once), or not at all if something keeps it alive. The first `num_warmups` buffers fill caches (allocator,
    communicators) before the "before" figures are taken.

    Returns:
        `{"before": figures, "after": figures, "alive": backends still alive, "unraisable": errors raised in
        finalizers}`; figures are `{"host rss": bytes}`, with `device_memory_bytes` on CUDA.
    """
    if num_warmups < 1:
        raise ValueError(f"num_warmups={num_warmups} must be >= 1 (the first buffers fill caches)")
    backends = []
    unraisable = []
    hook, sys.unraisablehook = sys.unraisablehook, lambda info: unraisable.append(repr(info.exc_value))
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        inputs = before = device = None
        for i in range(num_warmups + num_buffers):
            if i == num_warmups:
                before = _memory(device)
            buf = make_buffer()
            if inputs is None:
                device = buf.device
                inputs = rank_inputs(case, rank, device)
            recv_x, _, _, handle, _ = buf.dispatch(*inputs, num_experts=case.num_experts)
            buf.combine(recv_x, handle)
            buf.dispatch(inputs[0], handle=handle)
            if i >= num_warmups:
                backends.append(weakref.ref(buf._impl))
            if i % 2 == 0:
                buf.destroy()
            del buf, recv_x, handle
        after = _memory(device)
    finally:
        if was_enabled:
            gc.enable()
        sys.unraisablehook = hook
    return {"before": before, "after": after, "alive": sum(ref() is not None for ref in backends),
            "unraisable": unraisable}


__all__ = ["churn_buffers", "device_memory_bytes", "host_rss_bytes"]
