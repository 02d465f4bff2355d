"""The CUDA backend's peer paths with two ranks sharing GPU 0 (`CudaTuning(peer_memory="ipc")`: buffers mapped with
CUDA IPC, which, unlike torch's symmetric memory, maps between two processes on one GPU). Every peer path of the
kernels runs as with two GPUs (barriers and signatures, row tags, the per-peer combine region, expand fan-out,
receive hooks, disagreement found on the device, a peer that never arrives), with the world group on gloo (its
collectives stage CUDA tensors through host memory) and no NVLink: correctness only, no timings. Skips without
CUDA; tests/test_gpu.py runs the same paths with a GPU per rank."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

import moe_comm
from moe_comm.backends.cuda import CudaTuning
from moe_comm.testing import WorkerPool
from moe_comm.testing.checks import check_case
from moe_comm.testing.disagreement import run_probes
from moe_comm.testing.routing import Case, draw_cases, rank_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs CUDA")]

IPC = CudaTuning(peer_memory="ipc")


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(2, backend="gloo", timeout_s=600) as workers:
        yield workers


@contextlib.contextmanager
def on_gpu0():
    """The gloo world group's buffers on cuda:0 (a gloo group is a CPU group to `Buffer`)."""
    torch.cuda.set_device(0)
    original = moe_comm.Buffer.__dict__["group_device"]  # the staticmethod itself
    moe_comm.Buffer.group_device = staticmethod(lambda group: torch.device("cuda", 0))
    try:
        yield
    finally:
        moe_comm.Buffer.group_device = original


def make(case: Case, **kwargs) -> moe_comm.Buffer:
    hidden = max(case.hidden * case.torch_dtype.itemsize // 2, 8)
    with on_gpu0():
        return moe_comm.Buffer(None, num_max_tokens_per_rank=case.num_max_tokens_per_rank, hidden=hidden,
                               num_topk=case.num_topk, use_fp8_dispatch=case.hidden % 128 == 0, backend="cuda",
                               num_cpu_timeout_secs=60, cuda_tuning=kwargs.pop("cuda_tuning", IPC), **kwargs)


def cases_rank(rank: int, world_size: int, cases: list[Case], recv_hook: bool) -> int:
    for i, case in enumerate(cases):
        buf = make(case, use_recv_hook=recv_hook)
        try:
            assert buf._impl.name == "cuda" and buf._impl._ipc is not None
            check_case(buf, case, rank, recv_hook=recv_hook)
        except AssertionError as exc:
            raise AssertionError(f"case {i}: {case}\n{exc}") from exc
        finally:
            buf.destroy()
    return len(cases)


@pytest.mark.parametrize("recv_hook", [False, True])
def test_random_cases(pool, seed, recv_hook):
    """Both layouts, with and without CPU sync, weights, alignment, empty ranks, bf16/fp32/fp64: bitwise the
    oracle, every call through its hook or not."""
    cases = draw_cases(seed * 10 + 201 + recv_hook, 12, 2)
    assert pool.run(cases_rank, cases, recv_hook) == [len(cases)] * 2


def probes_rank(rank: int, world_size: int) -> list[str]:
    return run_probes(rank, world_size, lambda: make(Case(seed=43, num_ranks=2, num_experts=4, num_topk=2, hidden=128,
                                                          num_tokens=(6, 4), num_max_tokens_per_rank=8)))


def test_disagreement_on_the_cuda_path(pool):
    """Ranks that disagree in calls without a CPU sync: every rank raises the same ValueError naming the field
    (found by the kernels at the operation's barrier, raised at the next synchronizing call), and the buffer works
    after each (issue 13 item 1 on the CUDA path)."""
    first, second = pool.run(probes_rank)
    assert first == second and len(first) >= 12, first


def missing_peer_rank(rank: int, world_size: int) -> str:
    case = Case(seed=92, num_ranks=2, num_experts=8, num_topk=2, hidden=128, num_tokens=(64, 64),
                num_max_tokens_per_rank=64)
    buf = make(case, num_gpu_timeout_secs=3)
    x, idx, w = rank_inputs(case, rank, buf.device)
    buf.dispatch(x, idx, w, num_experts=8)
    torch.cuda.synchronize()
    if rank == 1:
        time.sleep(8)
        return "skipped"
    buf.dispatch(x, idx, w, num_experts=8, do_cpu_sync=False)
    torch.cuda.synchronize()
    with pytest.raises(TimeoutError) as info:
        buf.dispatch(x, idx, w, num_experts=8)
    with pytest.raises(RuntimeError, match="broken since an earlier error"):
        buf.dispatch(x, idx, w, num_experts=8)
    return str(info.value)


def test_missing_peer_times_out():
    """A peer that never arrives: the kernel's wait ends after num_gpu_timeout_secs and the next call raises naming
    rank, phase and peer (its own pool: the timed-out rank's group is broken)."""
    with WorkerPool(2, backend="gloo", timeout_s=120) as workers:
        message, skipped = workers.run(missing_peer_rank)
    assert skipped == "skipped"
    assert "rank 0 timed out in barrier before dispatch waiting for peer 1" in message, message
