"""GPU tier of the CUDA backend's hybrid path (`moe_comm.backends.hybrid`): 2 ranks as 2 hosts x 1 GPU
(`MOE_COMM_RANKS_PER_NODE=1`), the scale-up leg the CUDA kernels on each host, checked bitwise against the reference
backend on the CPU (direct path for dispatch and for the combine of terms, `deterministic=True`; the reference's hybrid
partial sums for the default combine). Skips without CUDA.

With 2 GPUs the ranks are one GPU each and the scale-out leg runs over NCCL, as between hosts. With one GPU both ranks
share it and the group is gloo, whose all-to-all stages CUDA tensors through host memory: every step of the path runs
(the CUDA kernels inside each one-rank host, the scale-out exchanges, the reordering, both combines), only the
transport between hosts differs, and the test that needs NCCL (no host sync) skips. Four ranks sharing GPU 0 run it
as 2 hosts x 2 (`pool4`): the scale-up leg then moves rows between two ranks through the CUDA kernels."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import pytest
import torch
import torch.distributed as dist

import moe_comm
from moe_comm import traffic_class
from moe_comm.testing import WorkerPool
from moe_comm.testing.gradcheck import run_gradcheck
from moe_comm.testing.routing import Case, draw_cases, rank_inputs
from moe_comm.testing.shared_gpu import every_buffer_over_ipc, on_gpu0
from test_hybrid import assert_same_outputs, check_fp8_modes, ranks_per_node, true_rows
from test_hybrid_over_backend import compare_and_destroy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs CUDA")]

ONE_GPU = torch.cuda.device_count() < 2
_CPU_GROUP: list = []  # per worker: a gloo group for the CPU references (the world group is NCCL on 2 GPUs)


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(2, backend="gloo" if ONE_GPU else "nccl", timeout_s=600) as workers:
        yield workers


@contextlib.contextmanager
def on_gpu():
    """One GPU: the gloo world group's buffers live on cuda:0 (a gloo group is a CPU group to `Buffer`)."""
    if not ONE_GPU:
        yield
        return
    with on_gpu0():
        yield


@pytest.fixture(scope="module")
def pool4():
    """Four ranks sharing GPU 0 as 2 hosts x 2 (gloo world group; scale-up buffers mapped with CUDA IPC)."""
    with WorkerPool(4, backend="gloo", timeout_s=600) as workers:
        yield workers


def placement(ranks_per_host: int):
    """Where the CUDA buffers of a layout live: 2 hosts x 1 on the pool's GPUs (`on_gpu`); 2 x 2 on GPU 0, shared by
    the four ranks, peers mapped with CUDA IPC (`every_buffer_over_ipc`: the scale-up leg then runs the CUDA kernels
    between two ranks, so the receivers' reordering of forwarded rows and the expand layout's cached dispatch of tag
    rows go through them)."""
    return every_buffer_over_ipc() if ranks_per_host > 1 else on_gpu()


def cpu_group() -> dist.ProcessGroup:
    if not _CPU_GROUP:
        _CPU_GROUP.append(dist.group.WORLD if ONE_GPU else dist.new_group(backend="gloo"))
    return _CPU_GROUP[0]


def buffers(case: Case, fp8: bool = False, ranks_per_host: int = 1):
    """`(hybrids, partial, direct)`: the CUDA hybrid buffers (partial sums; terms, by `deterministic=True`, made with
    backend="auto"), the reference's hybrid partial sums and its direct path (CPU), sized for `case`, as 2 hosts of
    `ranks_per_host` ranks."""
    hidden = max(case.hidden * case.torch_dtype.itemsize // 2, 8)
    make = dict(num_max_tokens_per_rank=case.num_max_tokens_per_rank, hidden=hidden, num_topk=case.num_topk,
                use_fp8_dispatch=fp8, num_cpu_timeout_secs=60)
    with ranks_per_node(str(ranks_per_host)):
        with placement(ranks_per_host), warnings.catch_warnings():
            warnings.simplefilter("error")  # "auto" takes the CUDA backend without a word
            hybrids = [moe_comm.Buffer(None, backend="cuda", **make),
                       moe_comm.Buffer(None, backend="auto", deterministic=True, **make)]
        partial = moe_comm.Buffer(cpu_group(), backend="torch", **make)
        direct = moe_comm.Buffer(cpu_group(), backend="torch", allow_hybrid_mode=False, deterministic=True, **make)
    name = f"cuda hybrid 2x{ranks_per_host}"
    assert [(b.device.type, b._impl.name) for b in hybrids] == [("cuda", f"{name} partial sums"), ("cuda", name)]
    assert partial.is_hybrid and not direct.is_hybrid
    return hybrids, partial, direct


def cases_rank(rank: int, world_size: int, cases: list[Case], ranks_per_host: int = 1) -> int:
    for i, case in enumerate(cases):
        hybrids, partial, direct = buffers(case, ranks_per_host=ranks_per_host)
        compare_and_destroy(i, case, rank, direct, partial, hybrids)
    return len(cases)


def test_random_cases(pool, seed):
    cases = draw_cases(seed * 10 + 77, 12, 2, max_tokens=200)
    cases = [dataclasses.replace(c, do_expand=i % 2 == 0, do_cpu_sync=i // 2 % 2 == 0, with_weights=i % 3 != 2)
             for i, c in enumerate(cases)]
    assert pool.run(cases_rank, cases) == [len(cases)] * 2


def test_two_hosts_of_two_ranks_sharing_the_gpu(pool4, seed):
    cases = draw_cases(seed * 10 + 91, 8, 4, max_tokens=48)
    cases = [dataclasses.replace(c, do_expand=i % 2 == 0, do_cpu_sync=i // 2 % 2 == 0, with_weights=i % 3 != 2)
             for i, c in enumerate(cases)]
    assert pool4.run(cases_rank, cases, 2) == [len(cases)] * 4


def test_two_by_two_routings_that_leave_a_host_nothing(pool4):
    """tests/test_hybrid_over_backend.py's routings whose forwarders receive nothing on their rail, through the CUDA
    kernels of a two-rank scale-up leg."""
    from test_hybrid_over_backend import EMPTY_RAIL_CASES
    assert pool4.run(cases_rank, EMPTY_RAIL_CASES, 2) == [len(EMPTY_RAIL_CASES)] * 4


def fp8_rank(rank: int, world_size: int, cases: list[Case], ranks_per_host: int = 1) -> int:
    checked = 0
    for case in cases:
        (hybrid, terms), _, direct = buffers(case, fp8=True, ranks_per_host=ranks_per_host)
        terms.destroy()
        # Without a CPU sync, rows past the true count are unspecified on the CUDA path.
        checked += check_fp8_modes(hybrid, direct, case, rank, whole=False)
        dev = hybrid.device
        x, idx, w = rank_inputs(case, rank)
        kwargs = dict(num_experts=case.num_experts, do_expand=case.do_expand, expert_alignment=case.expert_alignment,
                      do_cpu_sync=case.do_cpu_sync)
        # Async: equal to the synchronous call once waited on.
        sync = hybrid.dispatch(x.to(dev), idx.to(dev), w.to(dev), **kwargs)
        early = hybrid.dispatch(x.to(dev), idx.to(dev), w.to(dev), **kwargs, async_with_compute_stream=True)
        early[4].current_stream_wait()
        n = true_rows(sync[3])
        assert_same_outputs("async recv_x", early[0][:n], sync[0][:n].cpu())
        combined = hybrid.combine(sync[0], sync[3])[0]
        later = hybrid.combine(sync[0], sync[3], async_with_compute_stream=True)
        later[2].current_stream_wait()
        assert_same_outputs("async combined_x", later[0], combined.cpu())
        hybrid.destroy()
        direct.destroy()
    return checked


def fp8_cases(seed: int, num_ranks: int) -> list[Case]:
    cases = draw_cases(seed + 23, 4, num_ranks, max_tokens=150, dtypes=("bfloat16",))
    return [dataclasses.replace(c, hidden=128 * (1 + i % 2), do_expand=i % 2 == 0, do_cpu_sync=i // 2 % 2 == 0,
                                with_weights=True) for i, c in enumerate(cases)]


def test_fp8_and_async(pool, seed):
    cases = fp8_cases(seed, 2)
    assert pool.run(fp8_rank, cases) == [6 * len(cases)] * 2


def test_two_by_two_fp8_and_async(pool4, seed):
    cases = fp8_cases(seed, 4)
    assert pool4.run(fp8_rank, cases, 2) == [6 * len(cases)] * 4


def gradcheck_rank(rank: int, world_size: int, cases: list[Case], ranks_per_host: int = 1) -> list[bool]:
    results = []
    for case in cases:
        for deterministic in (False, True):  # partial sums, terms
            with ranks_per_node(str(ranks_per_host)), placement(ranks_per_host):
                buf = moe_comm.Buffer(None, num_max_tokens_per_rank=case.num_max_tokens_per_rank,
                                      hidden=4 * case.hidden, num_topk=case.num_topk, backend="cuda",
                                      deterministic=deterministic, num_cpu_timeout_secs=60)
            results.append(run_gradcheck(buf, case, rank))
            buf.destroy()
    return results


def gradcheck_cases(num_tokens: tuple[int, ...]) -> list[Case]:
    base = dict(num_ranks=len(num_tokens), num_experts=4, num_topk=3, hidden=2, num_tokens=num_tokens,
                num_max_tokens_per_rank=4, dtype="float64", drop_prob=0.25, num_bias=1)
    return [Case(seed=51, **base), Case(seed=52, do_expand=True, expert_alignment=2, do_cpu_sync=False, **base)]


def test_gradcheck(pool):
    assert pool.run(gradcheck_rank, gradcheck_cases((3, 0))) == [[True] * 4] * 2


def test_two_by_two_gradcheck(pool4):
    assert pool4.run(gradcheck_rank, gradcheck_cases((3, 0, 2, 1)), 2) == [[True] * 4] * 4


def no_host_sync_rank(rank: int, world_size: int, case: Case) -> bool:
    hybrids, partial, direct = buffers(case)
    for hybrid in hybrids:  # partial sums, terms
        dev = hybrid.device
        x, idx, w = (t.to(dev) for t in rank_inputs(case, rank))
        kwargs = dict(num_experts=case.num_experts, do_expand=case.do_expand, do_cpu_sync=False)
        hybrid.dispatch(x, idx, w, **kwargs)  # first call: launch structs, kernels loaded
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            recv_x, _, _, handle, _ = hybrid.dispatch(x, idx, w, **kwargs)
            hybrid.dispatch(x, handle=handle, do_expand=case.do_expand)
            hybrid.combine(recv_x, handle)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        hybrid.barrier()
    for b in (*hybrids, partial, direct):
        b.destroy()
    return True


@pytest.mark.skipif(ONE_GPU, reason="needs NCCL between 2 GPUs (gloo's all-to-all of CUDA tensors syncs the host)")
@pytest.mark.parametrize("do_expand", [False, True])
def test_no_host_sync(pool, do_expand):
    case = Case(seed=61, num_ranks=2, num_experts=16, num_topk=4, hidden=256, num_tokens=(40, 33),
                num_max_tokens_per_rank=48, do_expand=do_expand, do_cpu_sync=False)
    assert pool.run(no_host_sync_rank, case) == [True, True]


def traffic_class_rank(rank: int, world_size: int) -> list:
    """The legs' subgroups keep the traffic class of the group the buffer was made on (`sl_idx`)."""
    options = dist.ProcessGroupNCCL.Options()
    options.config.traffic_class = 3
    group = dist.new_group([0, 1], pg_options=options)
    with ranks_per_node("1"):
        buf = moe_comm.Buffer(group, num_max_tokens_per_rank=16, hidden=128, num_topk=2, backend="cuda", sl_idx=3)
    dev = buf.device
    classes = [traffic_class.group_traffic_class(g, dev) for g in (buf._impl.rail_group, buf._impl.host_group)]
    buf.destroy()
    return classes


@pytest.mark.skipif(ONE_GPU, reason="needs NCCL between 2 GPUs")
def test_legs_keep_the_traffic_class(pool):
    assert pool.run(traffic_class_rank) == [[3, 3]] * 2


SPLIT_SCRIPT = """
import datetime, torch, torch.distributed as dist
from moe_comm.backends.hybrid import leg_groups
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=dev,
                        timeout=datetime.timedelta(seconds=60))
host, rail = leg_groups(dist.group.WORLD, dev, 1, 1, 30.0)
ones = torch.ones(4, device=dev)
for g in (host, rail):
    dist.all_reduce(ones, group=g)
torch.cuda.synchronize()
print("sizes", host.size(), rail.size(), "sum", int(ones.sum()))
dist.destroy_process_group()
"""


def test_legs_split_from_an_eager_default_group():
    """A default group with a bound device makes its NCCL communicators eagerly, and subgroups are split from it,
    which every rank of the parent must join: the legs are made with `split_group` then (one rank here)."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", SPLIT_SCRIPT], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sizes 1 1 sum 4" in done.stdout, done.stdout
