"""The hybrid path over a scale-up backend (`moe_comm.backends.hybrid`: what `Buffer(backend="cuda")` runs across
hosts) on the CPU tier. Its inner Buffer is the reference backend here, so everything but the NVLink kernels runs on
gloo ranks split into hosts by `MOE_COMM_RANKS_PER_NODE`; tests/test_hybrid_gpu.py runs it over the CUDA backend.
Dispatch outputs and handles are bitwise the direct path's; combine is bitwise the reference's hybrid partial sums
(`torch_hybrid`, within FP32 rounding of the direct path, which tests/test_hybrid.py checks), or with terms
(`deterministic=True`) the direct path's result."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from torch.overrides import TorchFunctionMode

import moe_comm
from moe_comm.backends.hybrid import HybridBackend
from moe_comm.testing import parallel_launch
from moe_comm.testing.checks import assert_same, skip_one_call
from moe_comm.testing.disagreement import assert_refusals, run_probes, run_refusals
from moe_comm.testing.gradcheck import run_gradcheck
from moe_comm.testing.routing import Case, draw_cases, rank_bias, rank_inputs
from test_hybrid import (assert_same_outputs, check_fp8_modes, make_buffer, raise_for_bad_routing, ranks_per_node,
                         rows_of, true_rows)


def over_reference(buf: moe_comm.Buffer) -> moe_comm.Buffer:
    """`buf` (a hybrid reference buffer) running the hybrid path over the reference backend instead: the CUDA
    backend's hybrid path with the reference in place of the NVLink kernels."""
    assert buf.is_hybrid
    S, U = buf.get_logical_domain_size()
    partial_sums = buf._impl.use_partial_reduction
    buf._impl.close()
    buf._impl = HybridBackend(buf.group, buf.device, buf.num_cpu_timeout_secs, S, U, partial_sums,
                              buf.num_gpu_timeout_secs, lambda host_group: buf._inner_buffer(host_group, "torch"))
    return buf


def compare(case: Case, rank: int, direct, partial, hybrids) -> None:
    """One case on the hybrid buffers (any device; partial sums or terms) and the references (CPU): dispatch, handle,
    cached dispatch bitwise the direct path; combine (weights, biases) bitwise the reference's partial sums, or with
    terms the direct path's result."""
    x, idx, w = rank_inputs(case, rank)
    kwargs = dict(num_experts=case.num_experts, expert_alignment=case.expert_alignment, do_expand=case.do_expand,
                  do_cpu_sync=case.do_cpu_sync, num_max_tokens_per_rank=case.num_max_tokens_per_rank)
    cached = dict(do_expand=case.do_expand, expert_alignment=case.expert_alignment)
    ref, ref_partial = (b.dispatch(x, idx, w, **kwargs) for b in (direct, partial))
    # Without a CPU sync, rows past the true count are unspecified (the reference zeroes them).
    num_tokens, num_rows = int(ref[3].psum_num_recv_tokens_per_rank[-1]), true_rows(ref[3])
    y = (ref[0].double() * 0.75 + 0.125).to(ref[0].dtype)
    weights = None if ref[2] is None else ref[2] * 3
    bias = rank_bias(case, rank) or None
    expected = {True: partial.combine(y, ref_partial[3], topk_weights=weights, bias=bias)[:2],
                False: direct.combine(y, ref[3], topk_weights=weights, bias=bias)[:2]}
    direct_cached = rows_of(direct.dispatch(x * 2, handle=ref[3], **cached)[0], num_rows)
    for hybrid in hybrids:
        dev = hybrid.device
        got = hybrid.dispatch(x.to(dev), idx.to(dev), None if w is None else w.to(dev), **kwargs)
        for i, what in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights")):
            assert_same_outputs(what, rows_of(got[i], num_rows), rows_of(ref[i], num_rows))
        for field, n in (("recv_src_idx", None), ("recv_topk_idx", num_tokens), ("recv_topk_weights", num_rows),
                         ("psum_num_recv_tokens_per_rank", None), ("psum_num_recv_tokens_per_expert", None),
                         ("topk_idx", None)):
            assert_same_outputs(f"handle.{field}", rows_of(getattr(got[3], field), n),
                                rows_of(getattr(ref[3], field), n))
        for field in ("num_recv_tokens", "num_recv_tokens_per_expert_list", "num_recv_rows"):
            assert getattr(got[3], field) == getattr(ref[3], field), field
        assert_same_outputs("cached recv_x", rows_of(hybrid.dispatch(x.to(dev) * 2, handle=got[3], **cached)[0],
                                                     num_rows), direct_cached)
        partial_sums = hybrid._impl.use_partial_reduction
        combined, combined_w, _ = hybrid.combine(y.to(dev), got[3], topk_weights=None if weights is None else
                                                 weights.to(dev), bias=None if bias is None else
                                                 tuple(b.to(dev) for b in bias))
        what = "partial sums" if partial_sums else "terms"
        assert_same_outputs(f"{what} combined_x", combined, expected[partial_sums][0])
        assert_same_outputs(f"{what} combined_topk_weights", combined_w, expected[partial_sums][1])


def cases_rank(rank: int, world_size: int, ranks_per_host: int, cases: list[Case]) -> int:
    for i, case in enumerate(cases):
        with ranks_per_node(str(ranks_per_host)):
            hybrids = [over_reference(make_buffer(case)), over_reference(make_buffer(case, deterministic=True))]
            partial = make_buffer(case)
            direct = make_buffer(case, allow_hybrid_mode=False, deterministic=True)  # DESIGN 2.2 order
        name = f"hybrid {world_size // ranks_per_host}x{ranks_per_host} over torch"
        assert [b._impl.name for b in hybrids] == [f"{name} partial sums", name]
        compare_and_destroy(i, case, rank, direct, partial, hybrids)
    return len(cases)


def compare_and_destroy(i: int, case: Case, rank: int, direct, partial, hybrids) -> None:
    """`compare` for case number `i` (named in a failure), then every buffer destroyed."""
    try:
        compare(case, rank, direct, partial, hybrids)
    except AssertionError as exc:
        raise AssertionError(f"case {i}: {case}\n{exc}") from exc
    for b in (*hybrids, partial, direct):
        b.destroy()


# (world size, ranks per host) -> cases: one rank per host (no reordering), two and four (receivers reorder), and
# four hosts of two.
LAYOUTS = {(4, 2): 12, (4, 1): 6, (8, 4): 6, (8, 2): 4}


@pytest.mark.parametrize("world_size,ranks_per_host", sorted(LAYOUTS))
def test_random_cases(pools, seed, world_size, ranks_per_host):
    cases = draw_cases(seed * 10 + world_size + 1000 * ranks_per_host + 5, LAYOUTS[world_size, ranks_per_host],
                       world_size, max_tokens=40 if world_size == 4 else 25)
    # Every combination of layout and sync, with and without weights, whatever the draw.
    cases = [dataclasses.replace(c, do_expand=i % 2 == 0, do_cpu_sync=i // 2 % 2 == 0, with_weights=i % 3 != 2)
             for i, c in enumerate(cases)]
    start = time.monotonic()
    assert pools(world_size).run(cases_rank, ranks_per_host, cases) == [len(cases)] * world_size
    print(f"{world_size} ranks as {world_size // ranks_per_host} x {ranks_per_host}: {len(cases)} cases in "
          f"{time.monotonic() - start:.1f} s")


# 2 hosts x 2: forwarders that receive no row on their rail (every slot -1, or no tokens anywhere, or one rank's
# tokens only), with and without a CPU sync, in both layouts.
_EMPTY_RAIL = dict(num_ranks=4, num_experts=8, num_topk=2, hidden=16, num_max_tokens_per_rank=6, dtype="float32",
                   num_bias=1)
EMPTY_RAIL_CASES = [Case(seed=61 + i, num_tokens=tokens, drop_prob=drop, do_expand=i % 2 == 0,
                         expert_alignment=4 if i % 2 == 0 else 1, do_cpu_sync=i // 2 % 2 == 0, **_EMPTY_RAIL)
                    for i, (tokens, drop) in enumerate([((3, 4, 5, 6), 1.0)] * 4 + [((0, 0, 0, 0), 0.1)] * 4
                                                        + [((0, 0, 5, 0), 1.0)] * 2)]


def test_routings_that_leave_a_host_nothing(pools):
    """EMPTY_RAIL_CASES: the combine sends back zero rows (it raised on reshaping them, and the other host waited
    for it until its timeout)."""
    assert pools(4).run(cases_rank, 2, EMPTY_RAIL_CASES) == [len(EMPTY_RAIL_CASES)] * 4


def fp8_async_rank(rank: int, world_size: int, cases: list[Case]) -> int:
    """FP8 on the wire (tuples, `quantize=`, `dequantize=`, cached) bitwise the direct path; async calls equal to
    synchronous ones; a handle of the reference's hybrid path refused."""
    checked = 0
    for case in cases:
        make = dict(num_max_tokens_per_rank=case.num_max_tokens_per_rank, hidden=case.hidden, num_topk=case.num_topk,
                    use_fp8_dispatch=True, backend="torch", num_cpu_timeout_secs=60)
        with ranks_per_node("2"):
            hybrid = over_reference(moe_comm.Buffer(None, **make))
            reference = moe_comm.Buffer(None, **make)
        direct = moe_comm.Buffer(None, allow_hybrid_mode=False, deterministic=True, **make)
        checked += check_fp8_modes(hybrid, direct, case, rank)
        x, idx, w = rank_inputs(case, rank)
        kwargs = dict(num_experts=case.num_experts, do_expand=case.do_expand, expert_alignment=case.expert_alignment,
                      do_cpu_sync=case.do_cpu_sync)
        sync = hybrid.dispatch(x, idx, w, **kwargs)
        early = hybrid.dispatch(x, idx, w, **kwargs, async_with_compute_stream=True)
        early[4].current_stream_wait()
        assert_same_outputs("async recv_x", early[0], sync[0])
        combined, _, _ = hybrid.combine(sync[0], sync[3])
        later = hybrid.combine(sync[0], sync[3], async_with_compute_stream=True)
        with later[2]:
            pass
        assert_same("async combined_x", later[0], combined)
        with pytest.raises(ValueError, match=r"handle was made by backend 'torch hybrid 2x2 partial sums', this "
                                             r"buffer runs 'hybrid 2x2 over torch partial sums'"):
            hybrid.combine(sync[0], reference.dispatch(x, idx, w, **kwargs)[3])
        for b in (hybrid, reference, direct):
            b.destroy()
    return checked


def test_fp8_async_and_foreign_handles(pools, seed):
    cases = draw_cases(seed + 17, 4, 4, max_tokens=30, dtypes=("bfloat16",))
    cases = [dataclasses.replace(c, hidden=128 * (1 + i % 2), do_expand=i % 2 == 0, do_cpu_sync=i // 2 % 2 == 0)
             for i, c in enumerate(cases)]
    assert pools(4).run(fp8_async_rank, cases) == [6 * len(cases)] * 4


def gradcheck_rank(rank: int, world_size: int, cases: list[Case]) -> list[bool]:
    results = []
    for case in cases:
        for deterministic in (False, True):  # partial sums, terms
            with ranks_per_node("2"):
                # float64 rows need 4x the bytes of the bf16 `hidden` the buffer is sized with.
                buf = over_reference(moe_comm.Buffer(None, num_max_tokens_per_rank=case.num_max_tokens_per_rank,
                                                     hidden=4 * case.hidden, num_topk=case.num_topk, backend="torch",
                                                     deterministic=deterministic, num_cpu_timeout_secs=60))
            results.append(run_gradcheck(buf, case, rank))
            buf.destroy()
    return results


def test_gradcheck(pools):
    base = dict(num_ranks=4, num_experts=8, num_topk=3, hidden=2, num_tokens=(3, 0, 2, 1), num_max_tokens_per_rank=4,
                dtype="float64", drop_prob=0.25, num_bias=1)
    cases = [Case(seed=41, **base), Case(seed=42, do_expand=True, expert_alignment=2, do_cpu_sync=False, **base)]
    assert pools(4).run(gradcheck_rank, cases) == [[True] * 4] * 4


# ------------------------------------------------------------------------------------------------
# Bad routing, ranks that disagree, a peer that never arrives
# ------------------------------------------------------------------------------------------------
# One rank per host: a non-expand combine's partial sum per host is its one term, so the closed-form oracle of
# `check_case` (the direct path's order) holds bitwise.
SMALL = Case(seed=53, num_ranks=4, num_experts=8, num_topk=2, hidden=16, num_tokens=(4, 4, 4, 4),
             num_max_tokens_per_rank=4)


def value_errors_rank(rank: int, world_size: int) -> str:
    """A bad expert id on rank 3 (another host): with a CPU sync every rank raises naming rank 3; without one the slot
    is dropped and the next barrier raises on every rank; then the buffer works."""
    with ranks_per_node("1"):
        buf = over_reference(moe_comm.Buffer(None, num_max_tokens_per_rank=4, hidden=16, num_topk=2, backend="torch",
                                             num_cpu_timeout_secs=30))
    message = raise_for_bad_routing(buf, SMALL, rank)
    buf.destroy()
    return message


def test_value_errors_raise_on_every_rank(pools):
    messages = pools(4).run(value_errors_rank)
    assert all("topk_idx is invalid: entries outside [-1, 8) on rank(s) [3]" in m for m in messages), messages


def unchecked_disagreement_rank(rank: int, world_size: int) -> list[str]:
    """Host 0 calls with num_experts=8, host 1 with 16 (each host agrees inside), without a CPU sync and without
    the per-call host check (as on GPUs): the blocks that cross have equal sizes, so the dispatch goes through; the
    next barrier raises on every rank naming the field, and the one after it passes."""
    with ranks_per_node("2"):
        buf = over_reference(moe_comm.Buffer(None, num_max_tokens_per_rank=8, hidden=16, num_topk=2,
                                             backend="torch", num_cpu_timeout_secs=20))
    buf._impl.checks_every_call = buf._impl.inner._impl.checks_every_call = False
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(6, 16, generator=gen).bfloat16()
    idx = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(6)])
    buf.dispatch(x, idx, num_experts=8 if rank < 2 else 16, do_cpu_sync=False)
    seen = []
    for _ in range(2):
        try:
            buf.barrier()
            seen.append("passed")
        except ValueError as exc:
            seen.append(str(exc))
    buf.destroy()
    return seen


def test_disagreement_without_cpu_sync_raises_at_the_next_barrier(pools):
    for first, second in pools(4).run(unchecked_disagreement_rank):
        assert "num_experts: [8, 8, 16, 16]" in first and "without CPU sync" in first, first
        assert second == "passed"


def probes_rank(rank: int, world_size: int) -> list[str]:
    def make() -> moe_comm.Buffer:
        with ranks_per_node("1"):
            return over_reference(moe_comm.Buffer(None, num_max_tokens_per_rank=8, hidden=128, num_topk=2,
                                                  backend="torch", num_cpu_timeout_secs=20))
    return run_probes(rank, world_size, make)


def test_disagreement_is_an_error_on_every_rank(pools):
    messages = pools(2).run(probes_rank)
    assert messages[0] == messages[1] and len(messages[0]) > 10


def refusals_rank(rank: int, world_size: int) -> list[str]:
    def make() -> moe_comm.Buffer:
        with ranks_per_node("1"):
            return over_reference(moe_comm.Buffer(None, num_max_tokens_per_rank=8, hidden=128, num_topk=2,
                                                  backend="torch", num_cpu_timeout_secs=20))
    return run_refusals(rank, world_size, make, deferred=False)


def test_arguments_refused_on_one_rank_raise_on_every_rank(pools):
    """The hybrid path (2 hosts x 1) checks every call's agreement on the host in Buffer: arguments refused on rank
    0 only raise there, and on rank 1 a ValueError naming rank 0, on every call path; the buffer works after."""
    refused, ok = pools(2).run(refusals_rank)
    assert_refusals(refused, ok, cuda=False)


def missing_peer_rank(rank: int, world_size: int, phase: str):
    """2 hosts x 2; rank 3 skips one call: every other rank fails within the timeout, naming itself and the phase."""
    with ranks_per_node("2"):
        buf = over_reference(moe_comm.Buffer(None, num_max_tokens_per_rank=4, hidden=16, num_topk=2, backend="torch",
                                             num_cpu_timeout_secs=2))
    return skip_one_call(buf, SMALL, rank, 3, phase)


@pytest.mark.parametrize("phase", ["dispatch", "combine"])
def test_missing_peer_times_out(phase):
    *outcomes, skipped = parallel_launch(4, missing_peer_rank, phase, timeout_s=120)
    assert skipped == "skipped"
    for rank, (error, message, elapsed) in enumerate(outcomes):
        # A rank may see a peer that timed out first close its connection (a ConnectionError naming the phase).
        assert error in ("TimeoutError", "ConnectionError"), (rank, error, message)
        assert elapsed < 5, (rank, elapsed)
        assert f"rank {rank} {phase} argument agreement" in message, message


# ------------------------------------------------------------------------------------------------
# No host traffic without a CPU sync
# ------------------------------------------------------------------------------------------------
class NoHostTraffic(TorchFunctionMode):
    """Fails on the calls that on a GPU read device values on the host or copy host values to the device (a host
    sync, and a CUDA graph capture error): a call without a CPU sync must make none. The CPU tier sees them here;
    the inner backend's own calls are let through (on GPUs it is the CUDA backend, which tests/test_gpu.py checks
    under CUDA's sync debug mode)."""

    FORBIDDEN = {torch.tensor, torch.as_tensor, torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.nonzero,
                 torch.nonzero, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
                 torch.Tensor.__index__, torch.masked_select, torch.unique, torch.Tensor.cpu}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if func in self.FORBIDDEN or (func in (torch.repeat_interleave, torch.Tensor.repeat_interleave) and
                                      isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None):
            raise AssertionError(f"host traffic in a call without a CPU sync: {getattr(func, '__name__', func)}")
        return func(*args, **kwargs)


def _unchecked(call):
    def wrapper(*args, **kwargs):
        with torch._C.DisableTorchFunction():
            return call(*args, **kwargs)
    return wrapper


def no_host_traffic_rank(rank: int, world_size: int, case: Case) -> list[str]:
    done = []
    for deterministic in (False, True):
        with ranks_per_node("2"):
            buf = over_reference(make_buffer(case, deterministic=deterministic))
        impl = buf._impl
        impl.checks_every_call = False  # as on GPUs: nothing but the call itself
        impl.inner._impl.dispatch = _unchecked(impl.inner._impl.dispatch)
        impl.inner._impl.combine = _unchecked(impl.inner._impl.combine)
        x, idx, w = rank_inputs(case, rank)
        kwargs = dict(num_experts=case.num_experts, do_expand=case.do_expand, do_cpu_sync=False,
                      expert_alignment=case.expert_alignment)
        buf.dispatch(x, idx, w, **kwargs)  # a first call of this shape may copy its signature to the device
        with NoHostTraffic():
            recv_x, _, recv_w, handle, _ = buf.dispatch(x, idx, w, **kwargs)
            buf.dispatch(x, handle=handle, do_expand=case.do_expand, expert_alignment=case.expert_alignment)
            buf.combine(recv_x, handle, topk_weights=recv_w)
        buf.barrier()
        buf.destroy()
        done.append(impl.name)
    return done


@pytest.mark.parametrize("do_expand", [False, True])
def test_no_host_traffic_without_cpu_sync(pools, do_expand):
    case = Case(seed=57, num_ranks=4, num_experts=16, num_topk=3, hidden=64, num_tokens=(9, 0, 12, 7),
                num_max_tokens_per_rank=16, do_expand=do_expand, expert_alignment=4 if do_expand else 1)
    assert pools(4).run(no_host_traffic_rank, case) == [["hybrid 2x2 over torch partial sums",
                                                         "hybrid 2x2 over torch"]] * 4
