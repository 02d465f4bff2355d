"""Rank-side checks of one routing case against the oracle in `routing.py`.

`check_case(buffer, case, rank)` runs dispatch, combine and a cached dispatch for `case` on `buffer` and compares
everything bitwise: received rows, ids, weights, handle counts, source indices, combined rows and weights (with
`recv_hook=True` every call sends with `return_recv_hook=True` and receives in its hook). Without a CPU sync the
rows up to the true count are compared, and on the reference backend the documented rest (zero rows and weights, -1
ids and sources; other backends leave it unspecified). Used by the CPU tier (reference over gloo) and the GPU tier.

`skip_one_call(buffer, case, rank, missing_rank, phase)` has one rank sleep through a call the others make, for
the timeout tests. `compile_recording(fn)` compiles a function around moe_comm calls and counts what Dynamo traced.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional, Union

import torch

from .routing import Case, expected_combine, expected_dispatch, expert_output, rank_bias, rank_inputs


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_same(name: str, got: Optional[torch.Tensor], expected: Optional[torch.Tensor]) -> None:
    """Bitwise equality (-0.0 differs from 0.0), with the first differing position in the message."""
    if got is None or expected is None:
        assert got is None and expected is None, f"{name}: got {got is None=}, expected {expected is None=}"
        return
    got = got.detach().cpu()
    assert got.dtype == expected.dtype, f"{name}: dtype {got.dtype} != expected {expected.dtype}"
    assert got.shape == expected.shape, f"{name}: shape {tuple(got.shape)} != expected {tuple(expected.shape)}"
    if got.is_floating_point():
        got, expected = got.view(_BITS[got.dtype.itemsize]), expected.view(_BITS[got.dtype.itemsize])
    same = got == expected
    if not bool(same.all()):
        where = (~same).nonzero()[0].tolist()
        raise AssertionError(f"{name}: {int((~same).sum())} of {same.numel()} elements differ; first at {where}: "
                             f"got {got[tuple(where)].item()}, expected {expected[tuple(where)].item()}")


def _received(outputs: tuple, recv_hook: bool) -> tuple:
    """A call's outputs, its hook run first when it has one."""
    if not recv_hook:
        return outputs
    *outputs, hook = outputs
    assert not hook.done
    hook()
    assert hook.done
    return tuple(outputs)


def check_case(buffer, case: Case, rank: int, check_cached: bool = True, recv_hook: bool = False) -> dict:
    """Run and verify one case on this rank; returns a few counts for the caller's summary."""
    dev = buffer.device
    L = case.num_local_experts
    hook = {"return_recv_hook": True} if recv_hook else {}
    x, topk_idx, topk_weights = rank_inputs(case, rank, dev)
    recv_x, recv_idx, recv_w, handle, event = _received(buffer.dispatch(
        x, topk_idx, topk_weights, num_experts=case.num_experts, expert_alignment=case.expert_alignment,
        do_expand=case.do_expand, do_cpu_sync=case.do_cpu_sync, num_max_tokens_per_rank=case.num_max_tokens_per_rank,
        **hook), recv_hook)
    # A synchronous call returns a completed event: on CPU it has waited, on CUDA its work is ordered on the current
    # stream (nothing left for the caller to wait for).
    assert event.done, "a synchronous dispatch returned an incomplete event"
    exp = expected_dispatch(case, rank)
    num_rows = exp.x.shape[0]
    num_tokens = sum(exp.num_recv_tokens_per_rank)

    # Counts in the handle.
    psum_rank = torch.tensor(exp.num_recv_tokens_per_rank, dtype=torch.int64).cumsum(0)
    psum_expert = torch.tensor(exp.num_recv_tokens_per_expert, dtype=torch.int64).cumsum(0)
    assert_same("psum_num_recv_tokens_per_rank", handle.psum_num_recv_tokens_per_rank, psum_rank)
    assert_same("psum_num_recv_tokens_per_expert", handle.psum_num_recv_tokens_per_expert, psum_expert)
    if case.do_cpu_sync:
        assert handle.num_recv_tokens == num_rows, f"num_recv_tokens {handle.num_recv_tokens} != {num_rows}"
        assert handle.num_recv_tokens_per_expert_list == exp.num_recv_tokens_per_expert, \
            f"num_recv_tokens_per_expert_list {handle.num_recv_tokens_per_expert_list} != " \
            f"{exp.num_recv_tokens_per_expert}"
        assert recv_x.shape[0] == num_rows, f"recv_x rows {recv_x.shape[0]} != {num_rows}"
    else:
        assert handle.num_recv_tokens is None and handle.num_recv_tokens_per_expert_list is None
        worst = buffer.num_ranks * (case.num_max_tokens_per_rank if not case.do_expand else
                                    case.num_max_tokens_per_rank * min(case.num_topk, L)) + \
            (L * (case.expert_alignment - 1) if case.do_expand else 0)
        assert recv_x.shape[0] == worst, f"worst-case rows {recv_x.shape[0]} != {worst}"

    # Received rows, ids, weights, sources (bitwise).
    assert_same("recv_x", recv_x[:num_rows], exp.x)
    assert_same("recv_topk_idx", None if recv_idx is None else recv_idx[:num_rows], exp.topk_idx)
    assert_same("recv_topk_weights", None if recv_w is None else recv_w[:num_rows], exp.topk_weights)
    src = torch.tensor([t for _, t in exp.src], dtype=torch.int64)
    assert_same("handle.recv_src_idx", handle.recv_src_idx[:num_tokens], src)
    if buffer.backend == "torch" and not case.do_cpu_sync:  # the reference backend's documented tail
        assert not recv_x[num_rows:].any(), "recv_x past the valid rows is not zero"
        assert recv_idx is None or bool((recv_idx[num_rows:] == -1).all()), "recv_topk_idx past the valid rows != -1"
        assert recv_w is None or not recv_w[num_rows:].any(), "recv_topk_weights past the valid rows is not zero"
        assert bool((handle.recv_src_idx[num_tokens:] == -1).all()), "handle.recv_src_idx past the true count != -1"

    # Combine: each receiver applies a made-up expert, the source sums in the documented order.
    if case.do_expand:
        local = torch.bucketize(torch.arange(recv_x.shape[0], device=dev), handle.psum_num_recv_tokens_per_expert,
                                right=True).clamp(max=L - 1)
        y = expert_output(recv_x, rank * L + local)
    else:
        y = expert_output(recv_x, torch.full((recv_x.shape[0],), rank * L, device=dev))
    combine_w = None if recv_w is None else recv_w * 3
    bias = rank_bias(case, rank, dev)
    combined, combined_w, _ = _received(buffer.combine(y, handle, topk_weights=combine_w, bias=bias or None, **hook),
                                        recv_hook)
    exp_combined, exp_combined_w = expected_combine(case, rank, partial=buffer._expand_partial_sums(handle))
    assert_same("combined_x", combined, exp_combined)
    assert_same("combined_topk_weights", combined_w, exp_combined_w)

    # Cached dispatch moves new data along the same layout.
    if check_cached:
        x2 = x * 2
        recv_x2, recv_idx2, recv_w2, handle2, _ = _received(buffer.dispatch(
            x2, handle=handle, do_expand=case.do_expand, expert_alignment=case.expert_alignment, **hook), recv_hook)
        assert handle2 is handle
        assert recv_x2.shape == recv_x.shape, f"cached recv_x shape {tuple(recv_x2.shape)} != {tuple(recv_x.shape)}"
        assert_same("cached recv_x", recv_x2[:num_rows], exp.x * 2)
        assert recv_idx2 is recv_idx or recv_idx2 is handle.recv_topk_idx
        assert recv_w2 is recv_w or recv_w2 is handle.recv_topk_weights
    return {"rows": num_rows, "tokens": num_tokens}


def skip_one_call(buffer, case: Case, rank: int, missing_rank: int, phase: str, sleep_s: float = 6.0
                  ) -> Union[str, tuple[str, str, float]]:
    """Every rank dispatches `case`; then `missing_rank` sleeps `sleep_s` through the next call (`phase`: "dispatch"
    or "combine") that the others make. Returns "skipped" on the missing rank; on the others the type and message of
    the error the call raised and the seconds it took (an AssertionError if it completed). The error is a
    TimeoutError, or a ConnectionError on a rank that waited on a peer that gave up first (gloo closes a timed-out
    rank's connections)."""
    x, idx, w = rank_inputs(case, rank, buffer.device)
    _, _, _, handle, _ = buffer.dispatch(x, idx, w, num_experts=case.num_experts)
    if rank == missing_rank:
        time.sleep(sleep_s)
        return "skipped"
    start = time.monotonic()
    try:
        if phase == "dispatch":
            buffer.dispatch(x, idx, w, num_experts=case.num_experts)
        else:
            buffer.combine(torch.zeros(handle.num_recv_rows, case.hidden, dtype=x.dtype, device=buffer.device),
                           handle)
    except (TimeoutError, ConnectionError) as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    raise AssertionError(f"rank {rank}: the {phase} completed while rank {missing_rank} skipped it")


def compile_recording(fn: Callable) -> tuple[Callable, Callable[[], None]]:
    """`fn` under `torch.compile` (Dynamo's graphs run as captured, no code generated) and a check to call once it
    ran: Dynamo captured operations, each with the stack trace that names the file it came from, and none came from
    moe_comm's own files (its calls are `torch.compiler.disable`d: they run eagerly between the graphs)."""
    graphs = []
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

    def record(gm: torch.fx.GraphModule, example_inputs) -> Callable:
        graphs.append(gm)
        return gm.forward

    def check() -> None:
        traces = [node.meta.get("stack_trace") for gm in graphs for node in gm.graph.nodes
                  if node.op in ("call_function", "call_method")]
        assert traces, "torch.compile captured no operation"
        assert all(traces), "Dynamo's operations carry no stack trace: where they came from cannot be told"
        inside = [trace for trace in traces if package in trace]
        assert not inside, f"torch.compile traced {len(inside)} operations of moe_comm, e.g.\n{inside[0]}"

    torch._dynamo.reset()
    return torch.compile(fn, backend=record), check
