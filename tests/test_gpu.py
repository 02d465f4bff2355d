"""GPU tier: the reference backend over NCCL, one GPU per rank (skips without 2 GPUs).

Same random cases and bitwise oracle as the CPU tier, plus what only CUDA has: the comm stream and events,
and no host synchronization at all without a CPU sync (checked with CUDA's sync debug mode)."""

from __future__ import annotations

import pytest
import torch

import moe_comm
from moe_comm import autograd as moe_autograd
from moe_comm.testing import WorkerPool
from moe_comm.testing.checks import assert_same, check_case
from moe_comm.testing.gradcheck import run_gradcheck
from moe_comm.testing.routing import Case, draw_cases, rank_inputs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


@pytest.fixture(scope="module")
def nccl_pool():
    with WorkerPool(2, backend="nccl", timeout_s=600) as pool:
        yield pool


def make_buffer(case: Case) -> moe_comm.Buffer:
    hidden = case.hidden * case.torch_dtype.itemsize // 2
    return moe_comm.Buffer(None, num_max_tokens_per_rank=case.num_max_tokens_per_rank, hidden=max(hidden, 8),
                           num_topk=case.num_topk, use_fp8_dispatch=case.hidden % 128 == 0, backend="torch")


def random_cases_rank(rank: int, world_size: int, cases: list[Case]) -> int:
    for i, case in enumerate(cases):
        try:
            check_case(make_buffer(case), case, rank)
        except AssertionError as exc:
            raise AssertionError(f"case {i}: {case}\n{exc}") from exc
    return len(cases)


def test_random_cases_over_nccl(nccl_pool, seed):
    cases = draw_cases(seed * 10 + 102, 30, 2, max_tokens=4096) + draw_cases(seed * 10 + 103, 30, 2)
    assert nccl_pool.run(random_cases_rank, cases) == [len(cases)] * 2


def no_host_sync_rank(rank: int, world_size: int, case: Case) -> bool:
    """Dispatch without CPU sync, combine and cached dispatch must never synchronize with the host."""
    buf = make_buffer(case)
    x, idx, w = rank_inputs(case, rank, buf.device)
    bias = torch.randn_like(x)
    kwargs = dict(num_experts=case.num_experts, do_expand=case.do_expand, expert_alignment=case.expert_alignment)
    buf.dispatch(x, idx, w, do_cpu_sync=False, **kwargs)  # warm-up: NCCL communicators, allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        recv_x, _, recv_w, handle, _ = buf.dispatch(x, idx, w, do_cpu_sync=False, **kwargs)
        combined, _, _ = buf.combine(recv_x, handle, topk_weights=recv_w, bias=bias)
        buf.dispatch(combined, handle=handle, do_expand=case.do_expand, expert_alignment=case.expert_alignment)
        q_recv, _, _, _, _ = buf.dispatch(x, idx, w, do_cpu_sync=False, quantize="mxfp8", **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return True


@pytest.mark.parametrize("do_expand", [False, True])
def test_no_host_sync(nccl_pool, do_expand):
    case = Case(seed=71, num_ranks=2, num_experts=16, num_topk=4, hidden=256, num_tokens=(300, 200),
                num_max_tokens_per_rank=512, do_expand=do_expand, expert_alignment=16)
    assert nccl_pool.run(no_host_sync_rank, case) == [True, True]


def async_rank(rank: int, world_size: int) -> bool:
    """async_with_compute_stream: work on the compute stream overlaps; after the wait, results equal sync."""
    case = Case(seed=72, num_ranks=2, num_experts=16, num_topk=4, hidden=1024, num_tokens=(2048, 1500),
                num_max_tokens_per_rank=2048)
    buf = make_buffer(case)
    x, idx, w = rank_inputs(case, rank, buf.device)
    ref_x, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=16)
    ref_combined, _, _ = buf.combine(ref_x, handle)
    recv_x, _, _, handle2, event = buf.dispatch(x, idx, w, num_experts=16, async_with_compute_stream=True)
    busy = torch.randn(2048, 2048, device=buf.device) @ torch.randn(2048, 2048, device=buf.device)
    event.current_stream_wait()
    combined, _, event = buf.combine(recv_x, handle2, async_with_compute_stream=True, previous_event=event)
    with event:
        pass
    assert_same("async recv_x", recv_x, ref_x.cpu())
    assert_same("async combined", combined, ref_combined.cpu())
    return bool(busy.isfinite().all())


def test_async_comm_stream(nccl_pool):
    assert nccl_pool.run(async_rank) == [True, True]


def gradcheck_rank(rank: int, world_size: int) -> bool:
    base = dict(num_ranks=2, num_experts=4, num_topk=3, hidden=2, num_tokens=(3, 0), num_max_tokens_per_rank=4,
                dtype="float64", drop_prob=0.25, num_bias=1)
    for case in (Case(seed=81, **base), Case(seed=82, do_expand=True, expert_alignment=3, do_cpu_sync=False, **base)):
        buf = moe_comm.Buffer(None, num_max_tokens_per_rank=4, hidden=8, num_topk=3, backend="torch")
        assert run_gradcheck(buf, case, rank)
    return True


def test_gradcheck_over_nccl(nccl_pool):
    assert nccl_pool.run(gradcheck_rank) == [True, True]


def autograd_async_rank(rank: int, world_size: int) -> list:
    case = Case(seed=83, num_ranks=2, num_experts=8, num_topk=2, hidden=64, num_tokens=(64, 32),
                num_max_tokens_per_rank=64)
    buf = make_buffer(case)
    out = []
    for use_async in (False, True):
        x, idx, w = rank_inputs(case, rank, buf.device)
        x.requires_grad_()
        recv_x, _, recv_w, handle, event = moe_autograd.dispatch(buf, x, idx, w, num_experts=8,
                                                                 async_with_compute_stream=use_async)
        event.current_stream_wait()
        y = recv_x * (1 + recv_w.sum(1, keepdim=True)).to(recv_x.dtype)
        combined, event = moe_autograd.combine(buf, y, handle, async_with_compute_stream=use_async)
        event.current_stream_wait()
        combined.float().square().sum().backward()
        out.append(x.grad.float().cpu().tolist())
    return out


def test_autograd_async_over_nccl(nccl_pool):
    for sync_grad, async_grad in nccl_pool.run(autograd_async_rank):
        assert sync_grad == async_grad
