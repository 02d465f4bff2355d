"""GPU tier: both backends (reference over NCCL, CUDA over NVLink) with one GPU per rank; skips without CUDA.
(Over 400 lines: one process group serves every GPU test, so they share this module.)
With one GPU the tier runs on one rank (every row goes to the rank itself) and skips what needs a peer.

Same random cases and bitwise oracle as the CPU tier, plus what only CUDA has: the comm stream and events (async
calls let compute run while they communicate, measured with CUDA events), no host synchronization at all without a
CPU sync (checked with CUDA's sync debug mode), CUDA graph replay, GPU-side timeouts, and device memory given back
by buffers destroyed or dropped. Every rank function destroys the buffers it made (`Buffers`): no buffer carries
state from one test into another."""

from __future__ import annotations

import ctypes
import math
from typing import Callable, Optional

import pytest
import torch
import torch.distributed as dist

import moe_comm
from moe_comm import autograd as moe_autograd
from moe_comm import env, traffic_class
from moe_comm.backends.common import _flatten_tensors
from moe_comm.backends.cuda import CudaTuning
from moe_comm.event import EventOverlap
from moe_comm.testing import WorkerPool
from moe_comm.testing.checks import assert_same, check_case, compile_recording
from moe_comm.testing.gradcheck import run_gradcheck
from moe_comm.testing.memory import churn_buffers
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
# Room for every case of a test on the CUDA backend: up to 4104 tokens of hidden 7168 in float64 (4 x 7168 bf16
# elements), top-9, FP8 (0.9 GB per rank at EP2).
LARGE_CUDA_BUFFER = dict(num_max_tokens_per_rank=4104, hidden=4 * 7168, num_topk=9, use_fp8_dispatch=True)


class Buffers:
    """The buffers one rank function makes, all destroyed when it ends.

    `get(case, backend, **kwargs)`: without extra arguments (or with `deterministic` alone) the CUDA backend's cases
    share one large buffer per `deterministic` (a symmetric-memory rendezvous per case would dominate the run); any
    other buffer is sized for its case.
    `make(**buffer_kwargs)`: a buffer made with exactly these arguments.
    """

    def __init__(self) -> None:
        self._made: list[moe_comm.Buffer] = []
        self._large: dict[bool, moe_comm.Buffer] = {}

    def make(self, **buffer_kwargs) -> moe_comm.Buffer:
        self._made.append(moe_comm.Buffer(None, **buffer_kwargs))
        return self._made[-1]

    def get(self, case: Case, backend: str = "torch", **kwargs) -> moe_comm.Buffer:
        if backend == "cuda" and set(kwargs) <= {"deterministic"}:
            det = kwargs.get("deterministic", False)
            if det not in self._large:
                self._large[det] = self.make(backend="cuda", deterministic=det, **LARGE_CUDA_BUFFER)
            return self._large[det]
        hidden = case.hidden * case.torch_dtype.itemsize // 2
        return self.make(num_max_tokens_per_rank=case.num_max_tokens_per_rank, hidden=max(hidden, 8),
                         num_topk=case.num_topk, use_fp8_dispatch=case.hidden % 128 == 0, backend=backend, **kwargs)

    def __enter__(self) -> "Buffers":
        return self

    def __exit__(self, *exc) -> None:
        for buf in self._made:
            buf.destroy()


def random_cases_rank(rank: int, world_size: int, cases: list[Case], backend: str, recv_hook: bool = False) -> int:
    """Each case bitwise against the oracle; every other case on a deterministic buffer (expand combines in DESIGN
    2.2's slot order, else by partial sums per rank)."""
    with Buffers() as buffers:
        for i, case in enumerate(cases):
            try:
                kwargs = {"use_recv_hook": True} if recv_hook else {}
                buf = buffers.get(case, backend, **kwargs, **({"deterministic": True} if i % 2 else {}))
                check_case(buf, case, rank, recv_hook=recv_hook)
            except AssertionError as exc:
                raise AssertionError(f"case {i}: {case}\n{exc}") from exc
    return len(cases)


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_cases(nccl_pool, seed, backend):
    cases = draw_cases(seed * 10 + 102, 30, WORLD_SIZE, max_tokens=4096) + draw_cases(seed * 10 + 103, 30, WORLD_SIZE)
    assert nccl_pool.run(random_cases_rank, cases, backend) == [len(cases)] * WORLD_SIZE


def no_host_sync_rank(rank: int, world_size: int, case: Case, backend: str) -> bool:
    """Dispatch without CPU sync, combine and cached dispatch must never synchronize with the host."""
    with Buffers() as buffers:
        buf = buffers.get(case, backend)
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


# The async overlap check: a gate (a sleep on the current stream) holds back both streams until the host has queued
# everything (~100 ms at H200 clocks); the communication uses a few SMs so that compute has the others.
GATE_CYCLES = 200_000_000
NUM_COMM_SMS = 16


def gated_ms(comm: Optional[Callable[[], EventOverlap]], num_comm: int,
             compute: Optional[Callable[[], object]]) -> dict[str, float]:
    """Queue `num_comm` async calls `comm()`, then `compute()` on the current stream, behind a gate; milliseconds from
    the gate's end to "compute start" (the current stream reaching the compute), "comm end" (the last call's event
    completing, seen from a side stream) and "total" (both done).

    An async call orders the comm stream after the current stream, so neither stream starts before the gate ends:
    this measures the device's overlap, not the host's launch speed. Ranks start their gates together (a barrier),
    so a peer's late start does not count as communication time.
    """
    names = ("gate", "compute start", "comm end", "total")
    events = {name: torch.cuda.Event(enable_timing=True) for name in names}
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda._sleep(GATE_CYCLES)
    events["gate"].record()
    in_flight = [comm() for _ in range(num_comm)] if comm is not None else []
    events["compute start"].record()
    if compute is not None:
        compute()
    if in_flight:
        side.wait_event(in_flight[-1].event)
        events["comm end"].record(side)
        in_flight[-1].current_stream_wait()
    else:
        events["comm end"].record()
    events["total"].record()
    # Still sleeping: the host queued everything in time (an async call that synchronized with the host would have
    # waited for the gate to end).
    assert not events["gate"].query(), "the gate ended while the host was still queuing work (host sync?)"
    torch.cuda.synchronize()
    return {name: events["gate"].elapsed_time(events[name]) for name in names[1:]}


def overlap_rank(rank: int, world_size: int, backend: str) -> dict:
    """async_with_compute_stream: the results equal the synchronous calls', and compute on the current stream runs
    while a cached dispatch or a combine is in flight on the comm stream (CUDA events on both streams): the compute
    starts long before the communication ends, and on the CUDA backend (which leaves the SMs it does not use to
    compute) both together take clearly less than one after the other."""
    case = Case(seed=72, num_ranks=WORLD_SIZE, num_experts=16, num_topk=4, hidden=7168,
                num_tokens=per_rank(4096, 3000), num_max_tokens_per_rank=4096)
    with Buffers() as buffers:
        buf = buffers.get(case, backend)
        x, idx, w = rank_inputs(case, rank, buf.device)
        ref_x, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=16)
        ref_combined, _, _ = buf.combine(ref_x, handle)
        ref_cached = buf.dispatch(x, handle=handle)[0]
        recv_x, _, _, new_handle, event = buf.dispatch(x, idx, w, num_experts=16, async_with_compute_stream=True)
        combined, _, event = buf.combine(recv_x, new_handle, async_with_compute_stream=True, previous_event=event)
        cached, _, _, _, cached_event = buf.dispatch(x, handle=handle, async_with_compute_stream=True)
        with event, cached_event:
            pass
        assert_same("async recv_x", recv_x, ref_x.cpu())
        assert_same("async combined", combined, ref_combined.cpu())
        assert_same("async cached dispatch", cached, ref_cached.cpu())

        # previous_event holds back the call's comm stream, not the current stream (as DeepEP): a side stream sleeps,
        # then writes the rows the call sends; work queued on the current stream after the call completes while the
        # gate sleeps, the call's result waits for it, and its rows are the gate's.
        gate_stream, gate, mark = torch.cuda.Stream(), torch.cuda.Event(), torch.cuda.Event()
        gated_x = torch.zeros_like(x)
        gate_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(gate_stream):
            torch.cuda._sleep(5 * GATE_CYCLES)  # ~0.5 s: the host queues the call and the mark well within it
            gated_x.copy_(x)
            gate.record()
        gated = buf.dispatch(gated_x, handle=handle, async_with_compute_stream=True,
                             previous_event=EventOverlap(event=gate))
        mark.record()
        mark.synchronize()
        assert not gate.query(), "the current stream waited for previous_event (the gate ended first)"
        assert not gated[4].done, "the call did not wait for previous_event"
        gated[4].current_stream_wait()
        assert_same("cached dispatch after previous_event", gated[0], ref_cached.cpu())

        # An async call's event keeps the handle it reads alive: the handle's tensors were made on the current stream
        # and the kernels read them through raw pointers, so a handle dropped while its combine waits behind the gate
        # must not give its blocks to the current stream's next allocations (same sizes, filled at once).
        fresh_x, _, _, fresh_handle, _ = buf.dispatch(x, idx, w, num_experts=16)
        late_gate = torch.cuda.Event()
        gate_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(gate_stream):
            torch.cuda._sleep(5 * GATE_CYCLES)
            late_gate.record()
        late, _, late_event = buf.combine(fresh_x, fresh_handle, async_with_compute_stream=True,
                                          previous_event=EventOverlap(event=late_gate))
        sizes = [(t.shape, t.dtype) for t in _flatten_tensors([fresh_handle])]
        del fresh_handle
        junk = [torch.full(shape, 7, dtype=dtype, device=buf.device) for shape, dtype in sizes]
        assert not late_gate.query(), "the gate ended before the handle was dropped: the check proves nothing"
        late_event.current_stream_wait()
        assert_same("async combine with its handle dropped", late, ref_combined.cpu())
        del junk

        a, b = (torch.randn(4096, 4096, dtype=torch.bfloat16, device=buf.device) for _ in range(2))
        ops = {"cached dispatch": lambda: buf.dispatch(x, handle=handle, num_sms=NUM_COMM_SMS,
                                                       async_with_compute_stream=True)[4],
               "combine": lambda: buf.combine(ref_x, handle, num_sms=NUM_COMM_SMS, async_with_compute_stream=True)[2]}
        a @ b  # warm-up: cuBLAS, the allocator
        one_gemm = gated_ms(None, 0, lambda: a @ b)["total"]
        timings = {}
        for name, op in ops.items():
            for warm in [op() for _ in range(16)]:  # launch structs, output blocks in the allocator
                warm.current_stream_wait()
            num_comm = min(16, math.ceil(1.0 / gated_ms(op, 1, None)["comm end"]))  # >= ~1 ms of communication
            comm = gated_ms(op, num_comm, None)["comm end"]
            num_gemms = max(1, round(comm / one_gemm))  # about as long as the communication
            compute = gated_ms(None, 0, lambda: [a @ b for _ in range(num_gemms)])["total"]
            both = gated_ms(op, num_comm, lambda: [a @ b for _ in range(num_gemms)])
            timings[name] = dict(comm=comm, compute=compute, num_comm=num_comm, num_gemms=num_gemms, **both)
            where = f"rank {rank}, {name} on {backend}, ms after the gate: {timings[name]}"
            assert both["compute start"] < 0.5 * both["comm end"], f"compute waited for the communication: {where}"
            if backend == "cuda":
                # Serialized: comm + compute; overlapped: about the longer one (compute loses NUM_COMM_SMS SMs).
                assert both["total"] < comm + compute - 0.3 * min(comm, compute), f"too little overlap: {where}"
    return timings


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_overlaps_compute(nccl_pool, backend):
    for rank, timings in enumerate(nccl_pool.run(overlap_rank, backend)):
        print(f"rank {rank} {backend}: {timings}")


def gradcheck_rank(rank: int, world_size: int, backend: str) -> bool:
    base = dict(num_ranks=WORLD_SIZE, num_experts=2 * max(WORLD_SIZE, 2), num_topk=3, hidden=2,
                num_tokens=per_rank(3, 0), num_max_tokens_per_rank=4, dtype="float64", drop_prob=0.25, num_bias=1)
    with Buffers() as buffers:
        for case in (Case(seed=81, **base), Case(seed=82, do_expand=True, expert_alignment=3, do_cpu_sync=False,
                                                 **base)):
            buf = buffers.make(num_max_tokens_per_rank=4, hidden=8, num_topk=3, backend=backend)
            assert run_gradcheck(buf, case, rank)
    return True


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck(nccl_pool, backend):
    assert nccl_pool.run(gradcheck_rank, backend) == [True] * WORLD_SIZE


def autograd_async_rank(rank: int, world_size: int, backend: str) -> list:
    """x's gradient through dispatch and combine, synchronous then async, each eager then under torch.compile (with
    what Dynamo traced: moe_comm's calls run eagerly, none of its code in the graphs)."""
    case = Case(seed=83, num_ranks=WORLD_SIZE, num_experts=8, num_topk=2, hidden=64, num_tokens=per_rank(64, 32),
                num_max_tokens_per_rank=64)
    with Buffers() as buffers:
        buf = buffers.get(case, backend)
        out = []
        for use_async in (False, True):
            def pipeline(x, idx, w):
                recv_x, _, recv_w, handle, event = moe_autograd.dispatch(buf, x, idx, w, num_experts=8,
                                                                         async_with_compute_stream=use_async)
                event.current_stream_wait()
                y = recv_x * (1 + recv_w.sum(1, keepdim=True)).to(recv_x.dtype)
                combined, event = moe_autograd.combine(buf, y, handle, async_with_compute_stream=use_async)
                event.current_stream_wait()
                return combined

            compiled, check_compiled = compile_recording(pipeline)
            for fn in (pipeline, compiled):
                x, idx, w = rank_inputs(case, rank, buf.device)
                x.requires_grad_()
                fn(x, idx, w).float().square().sum().backward()
                out.append(x.grad.float().cpu().tolist())
            check_compiled()
        return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_autograd_async(nccl_pool, backend):
    for grads in nccl_pool.run(autograd_async_rank, backend):
        assert all(g == grads[0] for g in grads[1:])


def graph_rank(rank: int, world_size: int, do_expand: bool, recv_hook: bool = False) -> int:
    """A no-sync dispatch + combine + cached dispatch captured once in a CUDA graph, replayed on new data,
    equals the same calls run eagerly (bitwise on every valid row); with `recv_hook` the captured calls receive in
    their hooks (the sends and the receivers are two launches each, both in the graph)."""
    case = Case(seed=90, num_ranks=WORLD_SIZE, num_experts=16, num_topk=4, hidden=512, num_tokens=per_rank(256),
                num_max_tokens_per_rank=256, do_expand=do_expand, expert_alignment=16, do_cpu_sync=False)
    with Buffers() as buffers:
        buf = buffers.get(case, "cuda", use_recv_hook=True)
        kwargs = dict(num_experts=16, do_cpu_sync=False, do_expand=do_expand, expert_alignment=16)
        static = [t.clone() for t in rank_inputs(case, rank, buf.device)]
        hook = {"return_recv_hook": True} if recv_hook else {}

        def received(outputs: tuple) -> tuple:
            if recv_hook:
                outputs[-1]()
            return outputs

        def step():
            recv_x, _, recv_w, handle, *_ = received(buf.dispatch(*static, **kwargs, **hook))
            combined, combined_w, *_ = received(buf.combine(recv_x, handle, topk_weights=recv_w * 3, **hook))
            again = received(buf.dispatch(combined, handle=handle, do_expand=do_expand, expert_alignment=16,
                                          **hook))[0]
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
            num_rows = int(eager[4].psum_num_recv_tokens_per_rank[-1])
            assert int(graph_out[4].psum_num_recv_tokens_per_rank[-1]) == num_rows
            assert_same("graph recv_x", graph_out[0][:rows], eager[0][:rows].cpu())
            assert_same("graph combined", graph_out[1], eager[1].cpu())
            assert_same("graph combined_topk_weights", graph_out[2], eager[2].cpu())
            assert_same("graph cached dispatch", graph_out[3][:rows], eager[3][:rows].cpu())
            replays += 1
        return replays


@pytest.mark.parametrize("recv_hook", [False, True])
@pytest.mark.parametrize("do_expand", [False, True])
def test_cuda_graph_replay(nccl_pool, do_expand, recv_hook):
    assert nccl_pool.run(graph_rank, do_expand, recv_hook) == [3] * WORLD_SIZE


@pytest.mark.parametrize("backend", BACKENDS)
def test_recv_hook_cases(nccl_pool, seed, backend):
    """Every call sends, then receives in its hook: bitwise the oracle, every layout and mode of the random cases."""
    cases = draw_cases(seed * 10 + 104, 8, WORLD_SIZE, max_tokens=4096) + draw_cases(seed * 10 + 105, 16, WORLD_SIZE)
    assert nccl_pool.run(random_cases_rank, cases, backend, True) == [len(cases)] * WORLD_SIZE


def recv_hook_cuda_rank(rank: int, world_size: int) -> list[str]:
    """CUDA: the send launch ends without its receivers (the device drains before the hook: between the two no
    kernel of ours runs), no host sync, a hook called on another stream orders that stream after the receivers, and
    an expand combine in rounds is refused before anything is launched (the buffer works after it)."""
    case = Case(seed=73, num_ranks=WORLD_SIZE, num_experts=16, num_topk=4, hidden=256, num_tokens=per_rank(300, 200),
                num_max_tokens_per_rank=512, do_expand=True, expert_alignment=16, do_cpu_sync=False)
    kwargs = dict(num_experts=16, do_expand=True, expert_alignment=16, do_cpu_sync=False)
    with Buffers() as buffers:
        buf = buffers.get(case, "cuda", use_recv_hook=True)
        x, idx, w = rank_inputs(case, rank, buf.device)
        ref_x, _, ref_w, ref_handle, _ = buf.dispatch(x, idx, w, **kwargs)
        ref_combined, _, _ = buf.combine(ref_x, ref_handle, topk_weights=ref_w)
        rows = int(ref_handle.psum_num_recv_tokens_per_expert[-1])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            recv_x, _, recv_w, handle, _, hook = buf.dispatch(x, idx, w, return_recv_hook=True, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()  # returns: the senders finished alone
        dist.barrier()  # every rank's rows are in its peers' regions
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            hook()
            got_x, got_w = recv_x[:rows].clone(), recv_w[:rows].clone()
        side.synchronize()
        assert_same("hooked recv_x", got_x, ref_x[:rows].cpu())
        assert_same("hooked recv_w", got_w, ref_w[:rows].cpu())
        torch.cuda.set_sync_debug_mode("error")
        try:
            combined, _, _, hook = buf.combine(recv_x, handle, topk_weights=recv_w, return_recv_hook=True)
            hook()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert_same("hooked combined", combined, ref_combined.cpu())

        # What the caller drops before the hook stays allocated for the receivers: a tensor made in between gets
        # other memory, and neither it nor the results are overwritten.
        recv_x, _, recv_w, handle, _, hook = buf.dispatch(x, idx, w, return_recv_hook=True, **kwargs)
        del recv_x, recv_w, handle
        pattern = torch.full((ref_x.shape[0] * 2, ref_x.shape[1]), 7.0, dtype=ref_x.dtype, device=buf.device)
        hook()
        y = ref_x.clone()
        combined, _, _, hook = buf.combine(y, ref_handle, topk_weights=ref_w.clone(), return_recv_hook=True)
        del y
        filler = torch.full_like(ref_x, 3.0)
        hook()
        torch.cuda.synchronize()
        assert bool((pattern == 7.0).all()) and bool((filler == 3.0).all()), "a hook wrote into memory made after it"
        assert_same("combined, inputs dropped before the hook", combined, ref_combined.cpu())
        # ... and so does the handle whose layout the reducers read (tensors of its sizes made before the hook).
        fresh_x, _, fresh_w, fresh_handle, _ = buf.dispatch(x, idx, w, **kwargs)
        combined, _, _, hook = buf.combine(fresh_x, fresh_handle, topk_weights=fresh_w, return_recv_hook=True)
        sizes = [(t.shape, t.dtype) for t in _flatten_tensors([fresh_handle])]
        del fresh_handle
        junk = [torch.full(shape, 7, dtype=dtype, device=buf.device) for shape, dtype in sizes]
        hook()
        assert_same("combined, handle dropped before the hook", combined, ref_combined.cpu())
        del junk

        # Rounds come with the slot order only (partial sums, the default, take one round); the slot order of one
        # round is their reference.
        rounds = buffers.get(case, "cuda", cuda_tuning=CudaTuning(max_round_slots=2), deterministic=True)
        recv_x, _, recv_w, handle, _ = rounds.dispatch(x, idx, w, **kwargs)
        with pytest.raises(ValueError, match=r"this expand combine runs in 2 rounds \(CudaTuning.max_round_slots=2 "
                                             r"limits a round to 2 of a token's 4 slots\)") as info:
            rounds.combine(recv_x, handle, topk_weights=recv_w, return_recv_hook=True)
        in_rounds = rounds.combine(recv_x, handle, topk_weights=recv_w)[0]
        whole = buffers.get(case, "cuda", use_recv_hook=True, deterministic=True)
        recv_x, _, recv_w, handle, _ = whole.dispatch(x, idx, w, **kwargs)
        assert_same("combined in rounds", in_rounds, whole.combine(recv_x, handle, topk_weights=recv_w)[0].cpu())
        return [str(info.value)]


def test_recv_hook_cuda(nccl_pool):
    messages = nccl_pool.run(recv_hook_cuda_rank)
    assert all(m == messages[0] for m in messages)


@pytest.mark.parametrize("name", ["collectives_rank", "engram_rank",
                                  pytest.param("pipeline_rank", marks=needs_peer)])
def test_primitives_over_nccl(nccl_pool, name):
    """The buffer's primitives (tests/test_primitives.py's rank functions) on the GPU tier: the reference over
    NCCL, which every backend runs for now."""
    import test_primitives

    fn = getattr(test_primitives, name)
    args = (7, (1024, 768)) if name == "pipeline_rank" else ()  # 3-6 MB: NCCL sends wait for their receives
    assert all(result in (True, []) for result in nccl_pool.run(fn, *args))


@needs_peer
@pytest.mark.parametrize("backend", ["torch", "cuda"])
def test_pipeline_order_over_gpus(nccl_pool, backend):
    """tests/test_primitives.py's pipeline order checks with a GPU per rank, on both backends (the reference over
    NCCL, the copy engines over NVLink): async receives posted before the sends, and pp_set_config refused while a
    tensor is in flight, then taking effect once it was received."""
    import test_primitives

    assert nccl_pool.run(test_primitives.pipeline_receive_first_rank, backend) == [True] * WORLD_SIZE
    expected = test_primitives.RECONFIGURE_MESSAGES + ["True"]
    assert nccl_pool.run(test_primitives.pipeline_reconfigure_rank, backend) == [expected] * WORLD_SIZE


def missing_peer_rank(rank: int, world_size: int) -> str:
    """Rank 1 skips its calls: rank 0's first GPU wait ends within num_gpu_timeout_secs, the kernels queued behind
    it end at once (the abort word; before, each waited its own timeout), and the next call raises the timeout naming
    rank, phase and peer; every call after it says the group is broken."""
    import time
    case = Case(seed=92, num_ranks=WORLD_SIZE, num_experts=8, num_topk=2, hidden=128, num_tokens=per_rank(64),
                num_max_tokens_per_rank=64)
    with Buffers() as buffers:
        buf = buffers.get(case, "cuda", num_gpu_timeout_secs=3)
        x, idx, w = rank_inputs(case, rank, buf.device)
        buf.dispatch(x, idx, w, num_experts=8)
        torch.cuda.synchronize()
        if rank == 1:
            time.sleep(8)
            return "skipped"
        start = time.monotonic()
        for _ in range(4):
            buf.dispatch(x, idx, w, num_experts=8, do_cpu_sync=False)
        torch.cuda.synchronize()
        assert time.monotonic() - start < 6  # four waits of their own would take 12 s
        with pytest.raises(TimeoutError) as info:
            buf.dispatch(x, idx, w, num_experts=8)
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
    """Expand combines in rounds: slots that do not all fit the region at once (a buffer sized exactly for the
    case; its blocks are the peers'), or at most 2 slots per round (every other case; one rank needs no region)."""
    with Buffers() as buffers:
        for i, case in enumerate(cases):
            # Every other case at most 2 slots per round: rounds on one rank too (it needs no region).
            tuning = CudaTuning(max_round_slots=2) if i % 2 else None
            # deterministic: rounds come with the slot order only (partial sums take one round)
            buf = buffers.get(case, "cuda", num_gpu_timeout_secs=100, cuda_tuning=tuning, deterministic=True)
            try:
                check_case(buf, case, rank)
            except AssertionError as exc:
                raise AssertionError(f"case {i}: {case}\n{exc}") from exc
            buf.destroy()  # now: one exactly sized buffer at a time
    return len(cases)


def test_cuda_expand_combine_in_rounds(nccl_pool, seed):
    # First a case whose slots the region itself splits: DeepSeek-V3's rows at top-8 fit 4 slots per round at EP2
    # (2 rounds), 3 at EP3, 2 from EP4 on.
    cases = [Case(seed=105, num_ranks=WORLD_SIZE, num_experts=16, num_topk=8, hidden=7168, dtype="bfloat16",
                  num_tokens=per_rank(96, 64), num_max_tokens_per_rank=96, do_expand=True)]
    cases += [Case(**{**c.__dict__, "do_expand": True, "num_topk": min(c.num_experts, max(4, c.num_topk))})
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


def wide_topk_rank(rank: int, world_size: int) -> bool:
    """Top-40 in the expand layout: more slots than a warp's lanes, so no partial sums even on a buffer that allows
    them (the slot order, in rounds), bitwise the oracle on both backends."""
    case = Case(seed=204, num_ranks=WORLD_SIZE, num_experts=64, num_topk=40, hidden=256, num_tokens=per_rank(96, 70),
                num_max_tokens_per_rank=96, do_expand=True)
    with Buffers() as buffers:
        for backend in BACKENDS:
            buf = buffers.get(case, backend, num_gpu_timeout_secs=100)
            check_case(buf, case, rank)
            handle = buf.dispatch(*rank_inputs(case, rank, buf.device), num_experts=64, do_expand=True)[3]
            assert buf._partial_sums() and not buf._expand_partial_sums(handle)
    return True


def test_cuda_large_shapes(nccl_pool):
    assert nccl_pool.run(large_shapes_rank) == [3] * WORLD_SIZE
    assert nccl_pool.run(wide_topk_rank) == [True] * WORLD_SIZE


def layout_rank(rank: int, world_size: int, cases: list[Case]) -> int:
    """The layout kernel's outputs in a fresh dispatch's workspace (send_pos, expert_rank, the counts, the clean
    routing) against a vectorized oracle, bitwise."""
    with Buffers() as buffers:
        for case in cases:
            N, K, E, R = case.num_tokens[rank], case.num_topk, case.num_experts, world_size
            buf = buffers.make(num_max_tokens_per_rank=case.num_max_tokens_per_rank, hidden=case.hidden,
                               num_topk=K, backend="cuda")
            x, idx, w = rank_inputs(case, rank, buf.device)
            handle = buf.dispatch(x, idx, w, num_experts=E, do_cpu_sync=False)[3]
            words = torch.empty(0, dtype=torch.int64, device=buf.device).set_(
                handle.layout.clean_idx.untyped_storage())
            send_pos, counts, _, expert_rank = (words[o:] for o in handle.layout.offsets[:4])
            idx = idx.cpu()  # the oracle on the CPU (assert_same compares there)
            valid, e = idx >= 0, idx.clamp(min=0)
            chose = torch.zeros(N, E, dtype=torch.int64).scatter_add_(1, e, valid.long())
            hits = torch.zeros(N, R, dtype=torch.int64).scatter_add_(1, e // (E // R), valid.long()) > 0
            where = f"{N} tokens, top-{K} of {E}"
            assert_same(f"clean topk_idx, {where}", handle.topk_idx, idx)
            assert_same(f"send_pos, {where}", send_pos[:N * R].view(N, R),
                        torch.where(hits, hits.long().cumsum(0) - 1, -1))
            assert_same(f"expert_rank, {where}", expert_rank.view(torch.int32)[:N * K].view(N, K),
                        torch.where(valid, (chose.cumsum(0) - chose).gather(1, e), -1).int())
            assert_same(f"counts, {where}", counts[:R + E + 1],
                        torch.cat([hits.sum(0), chose.sum(0), torch.zeros(1, dtype=torch.int64)]))
        return len(cases)


def test_cuda_layout(nccl_pool):
    """One layout block (128 tokens), a grid of them (4096), several passes of 256 tokens per block (40,000 tokens on
    rank 0: over 256 per block on a GPU of up to 156 SMs) with rows wider than the slots a layout thread keeps in
    registers (top-20), half the slots dropped."""
    cases = [Case(seed=221, num_ranks=WORLD_SIZE, num_experts=256, num_topk=8, hidden=64,
                  num_tokens=per_rank(128, 100), num_max_tokens_per_rank=128),
             Case(seed=222, num_ranks=WORLD_SIZE, num_experts=256, num_topk=8, hidden=64,
                  num_tokens=per_rank(4096, 3000), num_max_tokens_per_rank=4096),
             Case(seed=223, num_ranks=WORLD_SIZE, num_experts=64, num_topk=20, hidden=64,
                  num_tokens=per_rank(40000, 39000), num_max_tokens_per_rank=40000, drop_prob=0.5)]
    assert nccl_pool.run(layout_rank, cases) == [len(cases)] * WORLD_SIZE


def fp8_rank(rank: int, world_size: int, cases: list[Case]) -> int:
    """FP8 on the wire, both formats, pre-quantized tuples, `quantize=` (cast by the CUDA backend's senders) and
    `dequantize=True`: the CUDA backend's outputs equal the reference backend's bit for bit (data, scales, routing,
    weights, source indices), special values included."""
    from moe_comm import quant

    with Buffers() as buffers:
        checked = 0
        for case in cases:
            ref_buf, cuda_buf = buffers.get(case, "torch"), buffers.get(case, "cuda")
            x, idx, w = rank_inputs(case, rank, cuda_buf.device)

            def ref(v):  # the reference's device (the CPU when two ranks share one GPU: tests/test_shared_gpu.py)
                return tuple(map(ref, v)) if isinstance(v, tuple) else v.to(ref_buf.device) if v is not None else v

            kwargs = dict(num_experts=case.num_experts, do_expand=case.do_expand,
                          expert_alignment=case.expert_alignment)
            special = x.clone()  # what the senders' cast (`quantize=`) must treat as quant.py does
            if special.shape[0] >= 4:
                special[0] = 0.0  # all-zero groups: amax clamped to AMAX_MIN
                special[1, ::3] = -0.0
                special[2] *= 1e-30  # tiny groups: scales near the bottom, mxfp8 exponents clamped
                special[3, ::2] *= 3e4  # groups with a few huge values: the rest rounds to zero or subnormals
            for fmt in quant.FP8_FORMATS:
                # Scale words no `quantize` makes: mxfp8 bytes 0 (2**-127), 1, 254 (products past float32: inf) and
                # 127 (1.0); fp8_block128 a subnormal and a huge float32 scale.
                q, q_scales = quant.quantize(x, fmt)
                word = 0x7FFE0100 if fmt == "mxfp8" else None
                extreme = torch.full_like(q_scales, word) if word is not None else \
                    torch.where(torch.arange(q_scales.shape[1], device=q.device) % 2 == 0, 1e-40, 3e38).expand_as(
                        q_scales).contiguous().to(q_scales.dtype)
                for mode, args in (("tuple", dict(x=quant.quantize(x, fmt))), ("quantize", dict(x=x, quantize=fmt)),
                                   ("tuple dequantize extreme scales", dict(x=(q, extreme), dequantize=True)),
                                   ("dequantize", dict(x=x, quantize=fmt, dequantize=True)),
                                   ("tuple dequantize", dict(x=quant.quantize(x, fmt), dequantize=True)),
                                   ("quantize special values", dict(x=special, quantize=fmt)),
                                   ("dequantize special values", dict(x=special, quantize=fmt, dequantize=True))):
                    expected = ref_buf.dispatch(topk_idx=ref(idx), topk_weights=ref(w),
                                                **{k: ref(v) if k == "x" else v for k, v in args.items()}, **kwargs)
                    got = cuda_buf.dispatch(topk_idx=idx, topk_weights=w, **args, **kwargs)
                    where = f"{fmt} {mode} {case}"
                    dequantized = "dequantize" in mode
                    ref_x, got_x = (expected[0], got[0]) if dequantized else (expected[0][0], got[0][0])
                    assert_same(f"recv data, {where}", got_x, ref_x.cpu())
                    if not dequantized:
                        assert_same(f"recv scales, {where}", got[0][1], expected[0][1].cpu())
                    for i, name in ((1, "recv_topk_idx"), (2, "recv_topk_weights")):
                        assert_same(f"{name}, {where}", got[i], None if expected[i] is None else expected[i].cpu())
                    assert_same(f"recv_src_idx, {where}", got[3].recv_src_idx, expected[3].recv_src_idx.cpu())
                    # A cached dispatch of other rows along the handle, with the same casts.
                    x2 = args["x"] * 2 if isinstance(args["x"], torch.Tensor) else \
                        args["x"] if "extreme" in mode else quant.quantize(x * 2, fmt)
                    casts = {k: v for k, v in args.items() if k != "x"}
                    got2 = cuda_buf.dispatch(x2, handle=got[3], **casts, **kwargs)[0]
                    ref2 = ref_buf.dispatch(ref(x2), handle=expected[3], **casts, **kwargs)[0]
                    pairs = zip(got2, ref2) if isinstance(got2, tuple) else [(got2, ref2)]
                    for i, (g, r) in enumerate(pairs):
                        assert_same(f"cached recv {i}, {where}", g, r.cpu())
                    checked += 1
            ref_buf.destroy()
        return checked


def test_cuda_fp8_matches_reference(nccl_pool):
    cases = [Case(seed=211, num_ranks=WORLD_SIZE, num_experts=16, num_topk=4, hidden=512,
                  num_tokens=per_rank(300, 77), num_max_tokens_per_rank=300),
             Case(seed=212, num_ranks=WORLD_SIZE, num_experts=8, num_topk=3, hidden=7168, num_tokens=per_rank(64, 0),
                  num_max_tokens_per_rank=64, do_expand=True, expert_alignment=32, drop_prob=0.3),
             # FP8 rows over one receive chunk (kRecvChunk, 8 KB): the receivers cast chunk by chunk.
             Case(seed=213, num_ranks=WORLD_SIZE, num_experts=8, num_topk=2, hidden=16384, num_tokens=per_rank(40, 9),
                  num_max_tokens_per_rank=40, do_expand=True, expert_alignment=4)]
    assert nccl_pool.run(fp8_rank, cases) == [2 * 7 * len(cases)] * WORLD_SIZE


def partial_sums_rank(rank: int, world_size: int) -> str:
    """Ranks that combine an expand dispatch with and without partial sums (moe_comm.testing.disagreement): the
    kernels compare the signatures, move nothing, and every rank raises at the barrier."""
    from moe_comm.testing.disagreement import CASE, partial_sums_probe
    with Buffers() as buffers:
        return partial_sums_probe(rank, world_size, lambda det: buffers.get(CASE, "cuda", num_gpu_timeout_secs=20,
                                                                            deterministic=det))


@needs_peer
def test_cuda_ranks_must_agree_on_partial_sums(nccl_pool):
    messages = nccl_pool.run(partial_sums_rank)
    assert messages == [messages[0]] * WORLD_SIZE


def disagreement_rank(rank: int, world_size: int) -> str:
    """Ranks that size a synchronizing dispatch differently all get a ValueError naming every rank's value (from the
    notify kernel's summary), and the buffer keeps working afterwards."""
    case = Case(seed=231, num_ranks=WORLD_SIZE, num_experts=8, num_topk=2, hidden=128, num_tokens=per_rank(32),
                num_max_tokens_per_rank=40)
    with Buffers() as buffers:
        buf = buffers.get(case, "cuda")
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
    with Buffers() as buffers:
        buf = buffers.get(case, "cuda")
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


def device_probes_rank(rank: int, world_size: int) -> list[str]:
    from moe_comm.testing.disagreement import run_probes
    return run_probes(rank, world_size, lambda: moe_comm.Buffer(
        None, num_max_tokens_per_rank=8, hidden=128, num_topk=2, use_fp8_dispatch=True, backend="cuda",
        num_gpu_timeout_secs=20))


def device_refusals_rank(rank: int, world_size: int) -> list[str]:
    from moe_comm.testing.disagreement import run_refusals
    return run_refusals(rank, world_size, lambda: moe_comm.Buffer(
        None, num_max_tokens_per_rank=8, hidden=128, num_topk=2, backend="cuda", num_gpu_timeout_secs=20),
        deferred=True)


@pytest.mark.skipif(WORLD_SIZE != 2, reason="the refusals are written for 2 ranks (2 GPUs)")
def test_refusal_found_on_the_device(nccl_pool):
    """Arguments refused on rank 0 only, on the CUDA backend: rank 0 raises its own error and runs the operation's
    barrier with a refusal, the other rank's kernels move nothing, and both raise the ValueError naming rank 0 at
    their next synchronizing call (instead of rank 1 timing out); the buffer works afterwards."""
    from moe_comm.testing.disagreement import assert_refusals
    assert_refusals(*nccl_pool.run(device_refusals_rank), cuda=True)


@pytest.mark.skipif(WORLD_SIZE != 2, reason="the probes are written for 2 ranks (2 GPUs)")
def test_disagreement_found_on_the_device(nccl_pool):
    """Every probe of moe_comm.testing.disagreement on the CUDA backend: the kernels compare the ranks' signatures at
    each operation's barrier, move nothing, and every rank raises the same ValueError at its next synchronizing
    call; the buffer works afterwards."""
    messages = nccl_pool.run(device_probes_rank)
    assert messages[0] == messages[1]


def clear_disagreement_rank(rank: int, world_size: int) -> str:
    """The host's realignment after a disagreement clears the record and the abort word on the device, each only
    while it holds the disagreement: a timeout that took them over (a pipeline wait on a side stream) stays, and is
    raised. Every rank plays the same recorded disagreement (the kernels' record, written here), so every rank
    raises and realigns alike; the buffer then works."""
    from moe_comm import layout as lay

    case = Case(seed=233, num_ranks=WORLD_SIZE, num_experts=8, num_topk=2, hidden=128, num_tokens=per_rank(12),
                num_max_tokens_per_rank=16)
    with Buffers() as buffers:
        buf = buffers.get(case, "cuda", num_gpu_timeout_secs=20)  # a buffer of its own (no shared large one)
        impl, e = buf._impl, buf._impl._error
        abort = impl.buffer[lay.ABORT_OFFSET:lay.ABORT_OFFSET + 8].view(torch.int64)
        record = ctypes.cast(impl._mapped_dev, ctypes.POINTER(lay.ErrorRecord))

        def clear(code: int) -> tuple[int, int]:
            e.code = code
            abort.fill_(code)
            torch.cuda.synchronize()
            impl.kernels.check(impl.kernels.clear_disagreement(impl.buffer.data_ptr(), record, 0), "clear", rank)
            torch.cuda.synchronize()
            return e.code, int(abort.item())

        assert clear(lay.ERROR_TIMEOUT) == (lay.ERROR_TIMEOUT, lay.ERROR_TIMEOUT)
        assert clear(lay.ERROR_DISAGREE) == (0, 0)
        e.code, e.observed = lay.ERROR_DISAGREE, 7
        abort.fill_(lay.ERROR_DISAGREE)
        torch.cuda.synchronize()
        with pytest.raises(ValueError, match="found by the kernels") as info:
            buf.barrier()
        assert (e.code, int(abort.item())) == (0, 0)
        check_case(buf, case, rank)
        return str(info.value)


def test_clearing_a_disagreement_keeps_a_timeout(nccl_pool):
    messages = nccl_pool.run(clear_disagreement_rank)
    assert messages == [messages[0]] * WORLD_SIZE


def round_slots_rank(rank: int, world_size: int) -> str:
    """Ranks whose buffers lay out an expand combine's rounds differently (`CudaTuning.max_round_slots`): the kernels
    find it at the first round's barrier, move nothing, and every rank raises at the next synchronizing call; a
    combine both lay out alike works afterwards."""
    case = Case(seed=232, num_ranks=WORLD_SIZE, num_experts=8, num_topk=4, hidden=128, num_tokens=per_rank(16),
                num_max_tokens_per_rank=16, do_expand=True)
    with Buffers() as buffers:
        buf = buffers.get(case, "cuda", num_gpu_timeout_secs=20, cuda_tuning=CudaTuning(max_round_slots=1 + rank),
                          deterministic=True)  # rounds come with the slot order only
        x, idx, w = rank_inputs(case, rank, buf.device)
        recv_x, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=8, do_expand=True)
        buf.combine(recv_x, handle)
        with pytest.raises(ValueError) as info:
            buf.barrier()
        agreed = buffers.get(case, "cuda", num_gpu_timeout_secs=20, cuda_tuning=CudaTuning(max_round_slots=2),
                             deterministic=True)
        check_case(agreed, case, rank)
        return str(info.value)


@needs_peer
def test_cuda_ranks_must_agree_on_round_slots(nccl_pool):
    messages = nccl_pool.run(round_slots_rank)
    assert messages == [messages[0]] * WORLD_SIZE
    assert f"slots per round: {[1 + r for r in range(WORLD_SIZE)]}" in messages[0], messages[0]


def cuda_churn_rank(rank: int, world_size: int, num_buffers: int) -> dict:
    case = Case(seed=241, num_ranks=WORLD_SIZE, num_experts=8, num_topk=2, hidden=4096, num_tokens=per_rank(512, 300),
                num_max_tokens_per_rank=512)
    sizes = dict(num_max_tokens_per_rank=2048, hidden=4096, num_topk=2)
    result = churn_buffers(lambda: moe_comm.Buffer(None, backend="cuda", **sizes), case, rank, num_buffers,
                           num_warmups=4)
    result["num_bytes"] = moe_comm.Buffer.get_buffer_size_hint(None, **sizes)
    return result


def test_cuda_buffers_give_back_memory(nccl_pool):
    """200 CUDA buffers, every other one destroyed and the rest dropped without destroy() (their finalizers free the
    host-mapped memory, the symmetric buffer goes with the backend): none stays alive, no finalizer raised, and
    device and host memory stay flat.

    Tolerances. Each buffer's symmetric memory is `num_bytes` (33 MiB at EP1, 66 MiB at EP2), so leaking it would grow
    the device's memory by 200 x that, 6.5 GiB or more. Device "allocated" (tensors alive): 1 MiB, as every buffer
    and every call's output is gone. "reserved" and "used" (the driver's count, which also sees memory no allocator
    statistic does): one buffer plus 256 MiB, for blocks the caching allocator or a symmetric-memory pool keeps for
    reuse and for what NCCL and the driver allocate on their own; a leak of more than a few buffers exceeds it. Host
    RSS: 32 MiB, for malloc arenas and the driver's bookkeeping. The host-mapped block (37 KiB per buffer, 7 MiB for
    200) is below what RSS can resolve here; that it is freed is checked directly: every backend is gone, so its
    finalizer ran, and none raised.
    """
    for rank, r in enumerate(nccl_pool.run(cuda_churn_rank, 200)):
        growth = {key: r["after"][key] - r["before"][key] for key in r["before"]}
        limits = {"allocated": 2**20, "reserved": r["num_bytes"] + 2**28, "used": r["num_bytes"] + 2**28,
                  "host rss": 2**25}
        where = f"rank {rank}: growth {growth}, limits {limits}, {r}"
        assert r["alive"] == 0 and not r["unraisable"], where
        assert all(growth[key] <= limits[key] for key in limits), where


def nccl_traffic_class_rank(rank: int, world_size: int) -> list:
    """The traffic class read back from this PyTorch's NCCL groups: the default group, a group made with a class,
    a group made without options after it, and one made with `subgroup_options` of the classed group."""
    dev = torch.device("cuda", torch.cuda.current_device())
    options = dist.ProcessGroupNCCL.Options()
    options.config.traffic_class = 3
    ranks = list(range(world_size))
    classed = dist.new_group(ranks, pg_options=options)
    groups = [dist.group.WORLD, classed, dist.new_group(ranks),
              dist.new_group(ranks, pg_options=traffic_class.subgroup_options(classed, dev))]
    classes = [traffic_class.group_traffic_class(g, dev) for g in groups]
    for g in groups[1:]:
        dist.destroy_process_group(g)
    return classes


def test_nccl_traffic_class_is_read_and_not_inherited(nccl_pool):
    """What README's "Traffic class" says of this PyTorch (2.11, NCCL 2.28) and `moe_comm.traffic_class` relies on:
    an NCCL group's class reads NCCL_CONFIG_UNDEF_INT when unset, a group made without options does not take
    another group's class, and `subgroup_options` carries it over."""
    unset = traffic_class.NCCL_CONFIG_UNDEF_INT
    assert nccl_pool.run(nccl_traffic_class_rank) == [[unset, 3, unset, 3]] * WORLD_SIZE
