"""GPU tier: both backends (reference over NCCL, CUDA over NVLink) with one GPU per rank; skips without CUDA.
With one GPU the tier runs on one rank (every row goes to the rank itself) and skips what needs a peer.

Same random cases and bitwise oracle as the CPU tier, plus what only CUDA has: the comm stream and events,
no host synchronization at all without a CPU sync (checked with CUDA's sync debug mode), CUDA graph replay,
and GPU-side timeouts."""

from __future__ import annotations

import pytest
import torch

import moe_comm
from moe_comm import autograd as moe_autograd
from moe_comm import env
from moe_comm.testing import WorkerPool
from moe_comm.testing.checks import assert_same, check_case
from moe_comm.testing.gradcheck import run_gradcheck
from moe_comm.testing.routing import Case, draw_cases, rank_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs CUDA")]

# Every GPU of the machine is a rank (EP = GPU count, at most 8) unless MOE_COMM_GPU_RANKS says fewer.
WORLD_SIZE = env.get_int("MOE_COMM_GPU_RANKS") or min(torch.cuda.device_count(), 8)
needs_peer = pytest.mark.skipif(WORLD_SIZE < 2, reason="needs 2 ranks (2 GPUs)")


def per_rank(*values: int) -> tuple[int, ...]:
    """Token counts for every rank, cycling through `values`."""
    return tuple(values[r % len(values)] for r in range(WORLD_SIZE))


@pytest.fixture(scope="module")
def nccl_pool():
    with WorkerPool(WORLD_SIZE, backend="nccl", timeout_s=600) as pool:
        yield pool


BACKENDS = ["torch", "cuda"]
_BUFFERS: dict = {}


def make_buffer(case: Case, backend: str = "torch", **kwargs) -> moe_comm.Buffer:
    """A buffer large enough for `case`. Without extra arguments, CUDA cases share one large buffer (a symmetric
    memory rendezvous per case would dominate the run)."""
    if backend == "cuda" and not kwargs:
        if "cuda" not in _BUFFERS:
            _BUFFERS["cuda"] = moe_comm.Buffer(None, num_max_tokens_per_rank=4104, hidden=4 * 7168, num_topk=9,
                                               use_fp8_dispatch=True, backend="cuda")
        return _BUFFERS["cuda"]
    hidden = case.hidden * case.torch_dtype.itemsize // 2
    return moe_comm.Buffer(None, num_max_tokens_per_rank=case.num_max_tokens_per_rank, hidden=max(hidden, 8),
                           num_topk=case.num_topk, use_fp8_dispatch=case.hidden % 128 == 0, backend=backend, **kwargs)


def random_cases_rank(rank: int, world_size: int, cases: list[Case], backend: str) -> int:
    for i, case in enumerate(cases):
        try:
            check_case(make_buffer(case, backend), case, rank)
        except AssertionError as exc:
            raise AssertionError(f"case {i}: {case}\n{exc}") from exc
    return len(cases)


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_cases(nccl_pool, seed, backend):
    cases = draw_cases(seed * 10 + 102, 30, WORLD_SIZE, max_tokens=4096) + draw_cases(seed * 10 + 103, 30, WORLD_SIZE)
    assert nccl_pool.run(random_cases_rank, cases, backend) == [len(cases)] * WORLD_SIZE


def no_host_sync_rank(rank: int, world_size: int, case: Case, backend: str) -> bool:
    """Dispatch without CPU sync, combine and cached dispatch must never synchronize with the host."""
    buf = make_buffer(case, backend)
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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("do_expand", [False, True])
def test_no_host_sync(nccl_pool, do_expand, backend):
    case = Case(seed=71, num_ranks=WORLD_SIZE, num_experts=16, num_topk=4, hidden=256, num_tokens=per_rank(300, 200),
                num_max_tokens_per_rank=512, do_expand=do_expand, expert_alignment=16)
    assert nccl_pool.run(no_host_sync_rank, case, backend) == [True] * WORLD_SIZE


def async_rank(rank: int, world_size: int, backend: str) -> bool:
    """async_with_compute_stream: work on the compute stream overlaps; after the wait, results equal sync."""
    case = Case(seed=72, num_ranks=WORLD_SIZE, num_experts=16, num_topk=4, hidden=1024,
                num_tokens=per_rank(2048, 1500),
                num_max_tokens_per_rank=2048)
    buf = make_buffer(case, backend)
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_comm_stream(nccl_pool, backend):
    assert nccl_pool.run(async_rank, backend) == [True] * WORLD_SIZE


def gradcheck_rank(rank: int, world_size: int, backend: str) -> bool:
    base = dict(num_ranks=WORLD_SIZE, num_experts=2 * max(WORLD_SIZE, 2), num_topk=3, hidden=2, num_tokens=per_rank(3, 0),
                num_max_tokens_per_rank=4,
                dtype="float64", drop_prob=0.25, num_bias=1)
    for case in (Case(seed=81, **base), Case(seed=82, do_expand=True, expert_alignment=3, do_cpu_sync=False, **base)):
        buf = moe_comm.Buffer(None, num_max_tokens_per_rank=4, hidden=8, num_topk=3, backend=backend)
        assert run_gradcheck(buf, case, rank)
    return True


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck(nccl_pool, backend):
    assert nccl_pool.run(gradcheck_rank, backend) == [True] * WORLD_SIZE


def autograd_async_rank(rank: int, world_size: int, backend: str) -> list:
    case = Case(seed=83, num_ranks=WORLD_SIZE, num_experts=8, num_topk=2, hidden=64, num_tokens=per_rank(64, 32),
                num_max_tokens_per_rank=64)
    buf = make_buffer(case, backend)
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_autograd_async(nccl_pool, backend):
    for sync_grad, async_grad in nccl_pool.run(autograd_async_rank, backend):
        assert sync_grad == async_grad


def graph_rank(rank: int, world_size: int, do_expand: bool) -> int:
    """A no-sync dispatch + combine + cached dispatch captured once in a CUDA graph, replayed on new data,
    equals the same calls run eagerly (bitwise on every valid row)."""
    case = Case(seed=90, num_ranks=WORLD_SIZE, num_experts=16, num_topk=4, hidden=512, num_tokens=per_rank(256),
                num_max_tokens_per_rank=256, do_expand=do_expand, expert_alignment=16, do_cpu_sync=False)
    buf = make_buffer(case, "cuda")
    kwargs = dict(num_experts=16, do_cpu_sync=False, do_expand=do_expand, expert_alignment=16)
    static = [t.clone() for t in rank_inputs(case, rank, buf.device)]

    def step():
        recv_x, _, recv_w, handle, _ = buf.dispatch(*static, **kwargs)
        combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w * 3)
        again, _, _, _, _ = buf.dispatch(combined, handle=handle, do_expand=do_expand, expert_alignment=16)
        return recv_x, combined, combined_w, again, handle

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()
    replays = 0
    for trial in range(3):
        new = Case(**{**case.__dict__, "seed": 91 + trial})
        for target, value in zip(static, rank_inputs(new, rank, buf.device)):
            target.copy_(value)
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        rows = int(eager[4].psum_num_recv_tokens_per_expert[-1] if do_expand
                   else eager[4].psum_num_recv_tokens_per_rank[-1])
        assert int(graph_out[4].psum_num_recv_tokens_per_rank[-1]) == int(eager[4].psum_num_recv_tokens_per_rank[-1])
        assert_same("graph recv_x", graph_out[0][:rows], eager[0][:rows].cpu())
        assert_same("graph combined", graph_out[1], eager[1].cpu())
        assert_same("graph combined_topk_weights", graph_out[2], eager[2].cpu())
        assert_same("graph cached dispatch", graph_out[3][:rows], eager[3][:rows].cpu())
        replays += 1
    return replays


@pytest.mark.parametrize("do_expand", [False, True])
def test_cuda_graph_replay(nccl_pool, do_expand):
    assert nccl_pool.run(graph_rank, do_expand) == [3] * WORLD_SIZE


def missing_peer_rank(rank: int, world_size: int) -> str:
    """Rank 1 skips a dispatch: rank 0's GPU wait ends within num_gpu_timeout_secs, naming rank, phase, peer."""
    import time
    case = Case(seed=92, num_ranks=WORLD_SIZE, num_experts=8, num_topk=2, hidden=128, num_tokens=per_rank(64),
                num_max_tokens_per_rank=64)
    buf = make_buffer(case, "cuda", num_gpu_timeout_secs=3)
    x, idx, w = rank_inputs(case, rank, buf.device)
    buf.dispatch(x, idx, w, num_experts=8)
    torch.cuda.synchronize()
    if rank == 1:
        time.sleep(8)
        return "skipped"
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        buf.dispatch(x, idx, w, num_experts=8)
    assert time.monotonic() - start < 6
    with pytest.raises(RuntimeError, match="broken since an earlier error"):
        buf.dispatch(x, idx, w, num_experts=8)
    return str(info.value)


@needs_peer
def test_cuda_missing_peer_times_out():
    with WorkerPool(WORLD_SIZE, backend="nccl", timeout_s=120) as pool:
        message, skipped = pool.run(missing_peer_rank)[:2]
    assert skipped == "skipped"
    assert "rank 0 timed out in barrier before dispatch waiting for peer 1" in message, message


def rounds_rank(rank: int, world_size: int, cases: list[Case]) -> int:
    """Expand combines whose slots do not all fit the region at once (a buffer sized exactly for the case)."""
    for i, case in enumerate(cases):
        buf = make_buffer(case, "cuda", num_gpu_timeout_secs=100)
        try:
            check_case(buf, case, rank)
        except AssertionError as exc:
            raise AssertionError(f"case {i}: {case}\n{exc}") from exc
        buf.destroy()
    return len(cases)


def test_cuda_expand_combine_in_rounds(nccl_pool, seed):
    cases = [Case(**{**c.__dict__, "do_expand": True, "num_topk": min(c.num_experts, max(4, c.num_topk))})
             for c in draw_cases(seed * 10 + 104, 6, WORLD_SIZE, max_tokens=512, dtypes=("bfloat16",))]
    assert nccl_pool.run(rounds_rank, cases) == [len(cases)] * WORLD_SIZE


def large_shapes_rank(rank: int, world_size: int) -> int:
    """The largest shapes the issue names: hidden 7168 and a hidden that is not a multiple of 128, 128-256
    experts, top-8/9, 4096 tokens on one rank and none on another, float32 too."""
    cases = [Case(seed=201, num_ranks=WORLD_SIZE, num_experts=256, num_topk=8, hidden=7168,
                  num_tokens=per_rank(4096, 3000), num_max_tokens_per_rank=4096, num_bias=1),
             Case(seed=202, num_ranks=WORLD_SIZE, num_experts=128, num_topk=9, hidden=7176,
                  num_tokens=per_rank(1000, 0), num_max_tokens_per_rank=1024, do_expand=True, expert_alignment=16,
                  do_cpu_sync=False),
             Case(seed=203, num_ranks=WORLD_SIZE, num_experts=64, num_topk=6, hidden=2056, dtype="float32",
                  num_tokens=per_rank(513, 700), num_max_tokens_per_rank=700, num_bias=2)]
    return random_cases_rank(rank, world_size, cases, "cuda")


def test_cuda_large_shapes(nccl_pool):
    assert nccl_pool.run(large_shapes_rank) == [3] * WORLD_SIZE


def fp8_rank(rank: int, world_size: int, cases: list[Case]) -> int:
    """FP8 on the wire, both formats, pre-quantized tuples, `quantize=` and `dequantize=True`: the CUDA backend's
    outputs equal the reference backend's bit for bit (data, scales, routing, weights, source indices)."""
    from moe_comm import quant

    checked = 0
    for case in cases:
        ref_buf, cuda_buf = make_buffer(case, "torch"), make_buffer(case, "cuda")
        x, idx, w = rank_inputs(case, rank, cuda_buf.device)
        kwargs = dict(num_experts=case.num_experts, do_expand=case.do_expand, expert_alignment=case.expert_alignment)
        for fmt in quant.FP8_FORMATS:
            for mode, args in (("tuple", dict(x=quant.quantize(x, fmt))), ("quantize", dict(x=x, quantize=fmt)),
                               ("dequantize", dict(x=x, quantize=fmt, dequantize=True))):
                ref = ref_buf.dispatch(topk_idx=idx, topk_weights=w, **args, **kwargs)
                got = cuda_buf.dispatch(topk_idx=idx, topk_weights=w, **args, **kwargs)
                where = f"{fmt} {mode} {case}"
                ref_x, got_x = (ref[0], got[0]) if mode == "dequantize" else (ref[0][0], got[0][0])
                assert_same(f"recv data, {where}", got_x, ref_x.cpu())
                if mode != "dequantize":
                    assert_same(f"recv scales, {where}", got[0][1], ref[0][1].cpu())
                for i, name in ((1, "recv_topk_idx"), (2, "recv_topk_weights")):
                    assert_same(f"{name}, {where}", got[i], None if ref[i] is None else ref[i].cpu())
                assert_same(f"recv_src_idx, {where}", got[3].recv_src_idx, ref[3].recv_src_idx.cpu())
                checked += 1
        ref_buf.destroy()
    return checked


def test_cuda_fp8_matches_reference(nccl_pool):
    cases = [Case(seed=211, num_ranks=WORLD_SIZE, num_experts=16, num_topk=4, hidden=512,
                  num_tokens=per_rank(300, 77), num_max_tokens_per_rank=300),
             Case(seed=212, num_ranks=WORLD_SIZE, num_experts=8, num_topk=3, hidden=7168, num_tokens=per_rank(64, 0),
                  num_max_tokens_per_rank=64, do_expand=True, expert_alignment=32, drop_prob=0.3)]
    assert nccl_pool.run(fp8_rank, cases) == [2 * 3 * len(cases)] * WORLD_SIZE


def disagreement_rank(rank: int, world_size: int) -> str:
    """Ranks that size a synchronizing dispatch differently all get a ValueError naming every rank's value (from the
    notify kernel's summary), and the buffer keeps working afterwards."""
    case = Case(seed=231, num_ranks=WORLD_SIZE, num_experts=8, num_topk=2, hidden=128, num_tokens=per_rank(32),
                num_max_tokens_per_rank=40)
    buf = make_buffer(case, "cuda")
    x, idx, w = rank_inputs(case, rank, buf.device)
    with pytest.raises(ValueError) as info:
        buf.dispatch(x, idx, w, num_experts=8, num_max_tokens_per_rank=32 + rank)
    check_case(buf, case, rank)
    return str(info.value)


@needs_peer
def test_cuda_ranks_must_agree_on_sizes(nccl_pool):
    messages = nccl_pool.run(disagreement_rank)
    assert messages == [messages[0]] * WORLD_SIZE
    assert f"num_max_tokens_per_rank: {list(range(32, 32 + WORLD_SIZE))}" in messages[0], messages[0]


def bad_routing_rank(rank: int, world_size: int) -> list[str]:
    """Out-of-range and duplicate experts on rank 0 raise a ValueError on every rank (at once with a CPU sync, at
    the next synchronizing dispatch without), and the buffer keeps working afterwards."""
    case = Case(seed=221, num_ranks=WORLD_SIZE, num_experts=8, num_topk=2, hidden=128, num_tokens=per_rank(32),
                num_max_tokens_per_rank=32, drop_prob=0.0)
    buf = make_buffer(case, "cuda")
    x, idx, w = rank_inputs(case, rank, buf.device)
    bad = idx.clone()
    if rank == 0:
        bad[3, 1] = 99
        bad[5, 1] = bad[5, 0]
    messages = []
    with pytest.raises(ValueError) as info:
        buf.dispatch(x, bad, w, num_experts=8)
    messages.append(str(info.value))
    buf.dispatch(x, bad, w, num_experts=8, do_cpu_sync=False)  # dropped slots, reported by the next sync
    with pytest.raises(ValueError) as info:
        buf.dispatch(x, idx, w, num_experts=8)
    messages.append(str(info.value))
    check_case(buf, case, rank)
    return messages


def test_cuda_bad_routing_raises_everywhere(nccl_pool):
    for now, deferred in nccl_pool.run(bad_routing_rank):
        assert "entries outside [-1, 8) on rank(s) [0]" in now and "duplicate experts in a row on rank(s) [0]" in now
        assert "earlier dispatch without CPU sync" in deferred
        assert "out-of-range entries on rank(s) [0], duplicate experts in a row on rank(s) [0]" in deferred


def disagreement_rank(rank: int, world_size: int) -> list[str]:
    from moe_comm.testing.disagreement import run_probes
    return run_probes(rank, world_size, lambda: moe_comm.Buffer(
        None, num_max_tokens_per_rank=8, hidden=128, num_topk=2, use_fp8_dispatch=True, backend="cuda",
        num_gpu_timeout_secs=20))


@pytest.mark.skipif(WORLD_SIZE != 2, reason="the probes are written for 2 ranks (2 GPUs)")
def test_disagreement_found_on_the_device(nccl_pool):
    """Every probe of moe_comm.testing.disagreement on the CUDA backend: the kernels compare the ranks' signatures at
    each operation's barrier, move nothing, and every rank raises the same ValueError at its next synchronizing
    call; the buffer works afterwards."""
    messages = nccl_pool.run(disagreement_rank)
    assert messages[0] == messages[1]
