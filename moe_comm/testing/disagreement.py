"""Ranks that disagree: probes for every call path (shared by the CPU tier and the GPU tier).

Each probe makes the ranks call one operation with a different value of one thing that sizes the exchange (or
different operations altogether). Every rank must raise the same ValueError naming the field and every rank's
value, and the buffer must work afterwards. The reference backend on the CPU raises at the call itself; the CUDA
backend detects it on the device and raises at the next synchronizing call (here `Buffer.barrier()`).
Refusals: arguments refused on one rank only; that rank raises its own error at the call, the others a ValueError
naming it (the CUDA backend: every rank, at the next synchronizing call).
"""

from __future__ import annotations

import re
from typing import Callable

import pytest

from .checks import check_case
from .routing import Case, rank_inputs

CASE = Case(seed=43, num_ranks=2, num_experts=4, num_topk=2, hidden=128, num_tokens=(6, 4),
            num_max_tokens_per_rank=8)


def probes(buf, rank: int) -> list[tuple[str, str, Callable[[], object]]]:
    """(label, message fragment, call) for every way two ranks can disagree; rank 0 is the odd one out."""
    x, idx, w = rank_inputs(CASE, rank, buf.device)
    E = CASE.num_experts
    odd = rank == 0
    rx, _, rw, handle, _ = buf.dispatch(x, idx, w, num_experts=E)
    rx2, _, _, handle2, _ = buf.dispatch(x, idx, w, num_experts=E)
    narrow = rx[:, :64].contiguous()
    d = buf.dispatch
    return [
        ("combine hidden", "ranks called combine with different arguments (per rank): hidden: [64, 128]",
         lambda: buf.combine(narrow if odd else rx, handle)),
        ("combine weights", "topk_weights given: [1, 0]",
         lambda: buf.combine(rx, handle, topk_weights=rw if odd else None)),
        ("combine handle epoch", f"handle epoch: [{handle2.epoch}, {handle.epoch}]",
         lambda: buf.combine(rx2 if odd else rx, handle2 if odd else handle)),
        ("no-sync num_experts", "num_experts: [8, 4]",
         lambda: d(x, idx, w, num_experts=2 * E if odd else E, do_cpu_sync=False)),
        ("no-sync weights", "topk_weights given: [0, 1]",
         lambda: d(x, idx, None if odd else w, num_experts=E, do_cpu_sync=False)),
        ("no-sync expand", "do_expand: [1, 0]", lambda: d(x, idx, w, num_experts=E, do_cpu_sync=False, do_expand=odd)),
        ("no-sync alignment", "expert_alignment: [4, 1]",
         lambda: d(x, idx, w, num_experts=E, do_cpu_sync=False, do_expand=True, expert_alignment=4 if odd else 1)),
        ("no-sync fp8 format", "fp8 format: ['mxfp8', 'fp8_block128']",
         lambda: d(x, idx, w, num_experts=E, do_cpu_sync=False, quantize="mxfp8" if odd else "fp8_block128")),
        ("sync vs no-sync", "do_cpu_sync: [0, 1]", lambda: d(x, idx, w, num_experts=E, do_cpu_sync=not odd)),
        ("cached vs fresh", "ranks called different operations (per rank): ['cached dispatch', 'dispatch']",
         lambda: d(x, handle=handle) if odd else d(x, idx, w, num_experts=E, do_cpu_sync=False)),
        ("cached hidden", "ranks called cached dispatch with different arguments (per rank): hidden: [64, 128]",
         lambda: d(x[:, :64].contiguous() if odd else x, handle=handle)),
        ("dispatch vs combine", "ranks called different operations (per rank): ['combine', 'dispatch']",
         lambda: buf.combine(rx, handle) if odd else d(x, idx, w, num_experts=E, do_cpu_sync=False)),
    ]


def refusals(buf, rank: int) -> list[tuple[str, str, Callable[[], object]]]:
    """(label, the other ranks' operation, call) for arguments refused on rank 0 only, on every call path."""
    x, idx, w = rank_inputs(CASE, rank, buf.device)
    E = CASE.num_experts
    odd = rank == 0
    rx, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=E)
    d = buf.dispatch
    return [
        ("dispatch x dtype", "dispatch", lambda: d(x.int() if odd else x, idx, w, num_experts=E)),
        ("no-sync dispatch alignment", "dispatch",
         lambda: d(x, idx, w, num_experts=E, do_cpu_sync=False, expert_alignment=0 if odd else 1)),
        ("cached dispatch num_sms", "cached dispatch", lambda: d(x, handle=handle, num_sms=-1 if odd else 0)),
        ("combine num_sms", "combine", lambda: buf.combine(rx, handle, num_sms=-1 if odd else 0)),
    ] + ([("combine num_sms=1 (the CUDA backend's own check)", "combine",
           lambda: buf.combine(rx, handle, num_sms=1 if odd else 0))] if buf.backend == "cuda" else [])


def run_refusals(rank: int, world_size: int, backend_buffer: Callable[[], object], deferred: bool) -> list[str]:
    """Every refusal on a fresh buffer from `backend_buffer()`: rank 0 raises its own TypeError/ValueError at the
    call; the other ranks a ValueError naming rank 0, at the call (the ranks' agreement checked on the host), or
    with `deferred` (the CUDA backend: the refusal went through the operation's barrier on the device) at the next
    synchronizing call, `barrier()`, where rank 0 raises it too; the buffer works afterwards on every rank.
    Returns the messages: rank 0's own errors, the others' ValueErrors."""
    buf = backend_buffer()
    messages = []
    for i in range(len(refusals(buf, rank))):
        label, what, call = refusals(buf, rank)[i]
        expected = f"{what}: rank(s) [0] refused their arguments (their error says why)"
        if rank == 0:
            with pytest.raises((TypeError, ValueError)) as info:
                call()
            if deferred:
                with pytest.raises(ValueError, match=re.escape(expected)):
                    buf.barrier()
            else:
                buf.barrier()  # the other ranks' (they call it whether or not their call raised)
        else:
            with pytest.raises(ValueError) as info:
                try:
                    call()
                finally:
                    buf.barrier()  # raises what the CUDA kernels found, if the call did not
            assert expected in str(info.value), f"{label}: {info.value!r} lacks {expected!r}"
        messages.append(f"{type(info.value).__name__}: {info.value}")
        check_case(buf, CASE, rank)  # still usable
    buf.destroy()
    return messages


def assert_refusals(refused: list[str], ok: list[str], cuda: bool) -> None:
    """`run_refusals`' messages with 2 ranks: rank 0's own errors (`refusals`: four, five on the CUDA backend), the
    other rank's ValueErrors naming rank 0 for each operation."""
    assert refused[0].startswith("TypeError: x.dtype=torch.int32"), refused
    assert refused[1].startswith("ValueError: expert_alignment=0 must be >= 1"), refused
    assert refused[2].startswith("ValueError: num_sms=-1") and refused[3].startswith("ValueError: num_sms=-1"), refused
    assert len(refused) == 4 + cuda and (not cuda or refused[4].startswith(
        "ValueError: num_sms=1: the CUDA backend needs 2")), refused
    operations = ["dispatch", "dispatch", "cached dispatch", "combine"] + ["combine"] * cuda
    assert [m.split(":")[1].strip() for m in ok] == operations, ok
    assert all("rank(s) [0] refused their arguments" in m for m in ok), ok


def partial_sums_probe(rank: int, world_size: int, make_buffer: Callable[[bool], object]) -> str:
    """Ranks whose buffers add an expand combine's rows differently (`make_buffer(deterministic)`: rank 0 in DESIGN
    2.2's slot order, the others by partial sums per rank) get the same ValueError naming "partial sums" with every
    rank's value, and the buffer works afterwards for calls they agree on; returns the message."""
    buf = make_buffer(rank == 0)
    x, idx, w = rank_inputs(CASE, rank, buf.device)
    rx, _, rw, handle, _ = buf.dispatch(x, idx, w, num_experts=CASE.num_experts, do_expand=True)
    with pytest.raises(ValueError) as info:
        try:
            buf.combine(rx, handle, topk_weights=rw)
        finally:
            buf.barrier()  # where the CUDA backend raises what its kernels found
    expected = f"partial sums: {[int(r != 0) for r in range(world_size)]}"
    assert expected in str(info.value), f"{info.value!r} lacks {expected!r}"
    check_case(buf, CASE, rank)  # non-expand: no partial sums, the ranks agree
    buf.destroy()
    return str(info.value)


def run_probes(rank: int, world_size: int, backend_buffer: Callable[[], object]) -> list[str]:
    """Run every probe on a fresh buffer from `backend_buffer()`; returns the messages (equal on every rank)."""
    buf = backend_buffer()
    messages = []
    # Each probe with handles made after the previous one: the CUDA backend refuses handles made before a raised
    # disagreement (their dispatch may have moved nothing).
    for i in range(len(probes(buf, rank))):
        label, fragment, call = probes(buf, rank)[i]
        with pytest.raises(ValueError) as info:
            try:
                call()
            finally:
                # Where the CUDA backend raises what its kernels found, if the call did not (a rank whose call
                # synchronized raised there; it still meets the others here).
                buf.barrier()
        message = str(info.value)
        assert fragment in message, f"{label}: {message!r} lacks {fragment!r}"
        messages.append(message)
        check_case(buf, CASE, rank)  # still usable
    buf.destroy()
    return messages
