"""The CUDA backend's peer paths with two ranks sharing GPU 0 (`CudaTuning(peer_memory="ipc")`: buffers mapped with
CUDA IPC, which, unlike torch's symmetric memory, maps between two processes on one GPU). Every peer path of the
kernels runs as with two GPUs (barriers and signatures, row tags, the per-peer combine region, expand fan-out,
receive hooks, disagreement found on the device, a peer that never arrives), with the world group on gloo (its
collectives stage CUDA tensors through host memory) and no NVLink: correctness only, no timings. Skips without
CUDA; tests/test_gpu.py runs the same paths with a GPU per rank."""

from __future__ import annotations

import os
import time

import pytest
import torch

import moe_comm
from moe_comm import layout as lay
from moe_comm.backends.cuda import CudaTuning
from moe_comm.testing import WorkerPool
from moe_comm.testing.checks import check_case
from moe_comm.testing.disagreement import assert_refusals, run_probes, run_refusals
from moe_comm.testing.shared_gpu import every_buffer_over_ipc, on_gpu0
from moe_comm.testing.soak import SoakConfig, draw_soak_cases, soak_rank, summarize, warmup_cases
from moe_comm.testing.routing import Case, draw_cases, rank_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs CUDA")]

IPC = CudaTuning(peer_memory="ipc")


@pytest.fixture(scope="module")
def pool():
    # The workers import tests/test_gpu.py for its rank functions: there every GPU is a rank, here both share one.
    # (Set while the pool lives: it spawns its workers at its first run.)
    old = os.environ.get("MOE_COMM_GPU_RANKS")
    os.environ["MOE_COMM_GPU_RANKS"] = "2"
    try:
        with WorkerPool(2, backend="gloo", timeout_s=600) as workers:
            yield workers
    finally:
        if old is None:
            os.environ.pop("MOE_COMM_GPU_RANKS")
        else:
            os.environ["MOE_COMM_GPU_RANKS"] = old


def gpu_tier_rank(rank: int, world_size: int, name: str, *args):
    """tests/test_gpu.py's rank function `name`, its buffers over IPC on the shared GPU."""
    import test_gpu

    assert test_gpu.WORLD_SIZE == 2
    with every_buffer_over_ipc():
        return getattr(test_gpu, name)(rank, world_size, *args)


def make(case: Case, **kwargs) -> moe_comm.Buffer:
    hidden = max(case.hidden * case.torch_dtype.itemsize // 2, 8)
    with on_gpu0():
        return moe_comm.Buffer(None, num_max_tokens_per_rank=case.num_max_tokens_per_rank, hidden=hidden,
                               num_topk=case.num_topk, use_fp8_dispatch=case.hidden % 128 == 0, backend="cuda",
                               num_cpu_timeout_secs=60, cuda_tuning=kwargs.pop("cuda_tuning", IPC), **kwargs)


def cases_rank(rank: int, world_size: int, cases: list[Case], recv_hook: bool) -> int:
    for i, case in enumerate(cases):
        # Every other case deterministic: expand combines in the slot order, else by partial sums per rank.
        buf = make(case, use_recv_hook=recv_hook, deterministic=i % 2 == 1)
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


def test_soak_sharing_the_gpu(pool, seed):
    """`scripts/soak.py --share-gpu` in short: every soak path over random cases on one long-lived Buffer per rank,
    no wrong result, no CUDA memory growth (host RSS is not checked here: the pool's processes ran other tests)."""
    cases = draw_soak_cases(seed * 10 + 207, 12, 2, max_tokens=24, max_hidden=136, max_experts=12)
    config = SoakConfig(backend="cuda", num_max_tokens_per_rank=24, max_hidden=136, share_gpu=True)
    per_rank = pool.run(soak_rank, cases, warmup_cases(config, 2, 12), config)
    summary = summarize(per_rank, rss_tolerance=2**40, cuda_tolerance=0)
    assert summary["backend"] == "cuda" and all(e["iterations"] == len(cases) for e in summary["paths"].values())
    assert summary["ok"], "\n".join(summary["problems"])


def probes_rank(rank: int, world_size: int) -> list[str]:
    return run_probes(rank, world_size, lambda: make(Case(seed=43, num_ranks=2, num_experts=4, num_topk=2, hidden=128,
                                                          num_tokens=(6, 4), num_max_tokens_per_rank=8)))


def test_disagreement_on_the_cuda_path(pool):
    """Ranks that disagree in calls without a CPU sync: every rank raises the same ValueError naming the field
    (found by the kernels at the operation's barrier, raised at the next synchronizing call), and the buffer works
    after each (issue 13 item 1 on the CUDA path)."""
    first, second = pool.run(probes_rank)
    assert first == second and len(first) >= 12, first


def refusals_rank(rank: int, world_size: int) -> list[str]:
    return run_refusals(rank, world_size, lambda: make(Case(seed=43, num_ranks=2, num_experts=4, num_topk=2,
                                                            hidden=128, num_tokens=(6, 4), num_max_tokens_per_rank=8)),
                        deferred=True)


def test_refusal_on_the_cuda_path(pool):
    """Arguments refused on rank 0 only: rank 0 raises its own error at the call and runs the operation's barrier
    with a refusal; rank 1's kernels move nothing and both raise the ValueError naming rank 0 at the next
    synchronizing call; the buffer works afterwards (no rank waits for its timeout)."""
    start = time.monotonic()
    refused, ok = pool.run(refusals_rank)
    assert time.monotonic() - start < 60
    assert_refusals(refused, ok, cuda=True)



def disagreeing_dispatch(buf: moe_comm.Buffer, rank: int) -> None:
    """A dispatch without CPU sync of disagreement.CASE whose ranks disagree on num_experts (rank 0: twice the
    others'), waited for: its kernels found it and set the abort word on every rank (moving nothing)."""
    from moe_comm.testing.disagreement import CASE
    x, idx, w = rank_inputs(CASE, rank, buf.device)
    buf.dispatch(x, idx, w, num_experts=2 * CASE.num_experts if rank == 0 else CASE.num_experts, do_cpu_sync=False)
    torch.cuda.synchronize()


def primitives_after_disagreement_rank(rank: int, world_size: int) -> list[str]:
    """A dispatch without CPU sync whose ranks disagree sets the abort word on both ranks (its kernels move nothing);
    the copy-engine paths' flags stay in step, so a pipeline receive and an all_gather after it still wait for their
    peer (rank 1 sleeps first) and move the right data, bitwise; the next synchronizing call raises the
    disagreement, and the buffer works after it."""
    from moe_comm.testing.disagreement import CASE
    buf = make(CASE)
    device = buf.device
    buf.pp_set_config(num_max_tensor_bytes=1024, num_max_inflight_tensors=2)
    sent = torch.arange(64, dtype=torch.float32, device=device) + 100 * rank
    buf.all_gather(sent)  # its region made now: the one after the disagreement waits on the device only
    disagreeing_dispatch(buf, rank)
    results = [str(buf._impl._error.code == lay.ERROR_DISAGREE)]
    if rank == 1:
        time.sleep(1.0)  # rank 0's receive and all_gather wait for this rank meanwhile
        buf.pp_send(sent, 0)
    else:
        out = torch.empty(64, device=device)
        buf.pp_recv(out, 1)
        results.append(str(torch.equal(out.cpu(), torch.arange(64, dtype=torch.float32) + 100)))
    if rank == 1:
        time.sleep(1.0)
    gathered, _ = buf.all_gather(sent)
    results.append(str(torch.equal(gathered.cpu(), torch.stack([torch.arange(64.0), torch.arange(64.0) + 100]))))
    with pytest.raises(ValueError, match=r"num_experts: \[8, 4\]"):
        buf.barrier()
    check_case(buf, CASE, rank)  # still usable
    buf.destroy()
    return results


def test_primitives_after_a_disagreement(pool):
    assert pool.run(primitives_after_disagreement_rank) == [["True", "True", "True"], ["True", "True"]]


def agreement_with_a_busy_stream_rank(rank: int, world_size: int) -> str:
    """After a disagreement, rank 1 sends async (its pipeline stream may still run) and rank 0 receives synchronously;
    then both reconfigure the pipeline. Its host agreement is a synchronizing point on neither rank (it is one only
    where it is one on every rank), so neither raises there alone (rank 0 did, and rank 1 waited in the next exchange
    until its timeout); the next synchronizing call raises the disagreement on both."""
    from moe_comm.testing.disagreement import CASE
    buf = make(CASE)
    buf.pp_set_config(num_max_tensor_bytes=1024, num_max_inflight_tensors=2)
    disagreeing_dispatch(buf, rank)
    sent = torch.arange(64, dtype=torch.float32, device=buf.device)
    if rank == 1:
        buf.pp_send(sent, 0, async_with_compute_stream=True)
    else:
        buf.pp_recv(torch.empty_like(sent), 1)
    buf.pp_set_config(num_max_tensor_bytes=2048, num_max_inflight_tensors=2)
    with pytest.raises(ValueError, match=r"num_experts: \[8, 4\]"):
        buf.barrier()
    check_case(buf, CASE, rank)  # still usable
    buf.destroy()
    return "ok"


def test_agreement_with_a_busy_stream(pool):
    start = time.monotonic()
    assert pool.run(agreement_with_a_busy_stream_rank) == ["ok", "ok"]
    assert time.monotonic() - start < 60


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


def out_of_memory_rank(rank: int, world_size: int) -> list[str]:
    """Rank 1's dispatch outputs cannot be allocated (it gives its earlier outputs' memory back to the device and
    caps its caching allocator just above what it still holds): rank 1 raises torch.OutOfMemoryError, rank 0 gets its
    dispatch whole at once (the rows rank 1 still sent), and both go on with a dispatch and a combine (epochs
    aligned), for a synchronized dispatch (allocation after the notify) and one without CPU sync (before the
    layout). Rows of 14 KB, ~8,000 of them: every output of over 10 MB has a segment of its own."""
    case = Case(seed=93, num_ranks=2, num_experts=8, num_topk=2, hidden=7168, num_tokens=(4096, 4096),
                num_max_tokens_per_rank=4096, drop_prob=0.0)
    buf = make(case, num_gpu_timeout_secs=20)
    dev = buf.device
    x, idx, w = rank_inputs(case, rank, dev)
    raised = []
    for sync, expand in ((True, False), (False, False), (True, True)):
        call = lambda: buf.dispatch(x, idx, w, num_experts=8, do_cpu_sync=sync, do_expand=expand)  # noqa: E731
        ref = call()
        ref_combined, _, _ = buf.combine(ref[0], ref[3])
        torch.cuda.synchronize()
        if rank == 1:  # room for the workspace (a 2 MiB segment of the small pool), not for 80 MB of rows
            ref = ref[3]
            torch.cuda.empty_cache()
            limit = torch.cuda.memory_reserved(dev) + 8 * 2**20
            torch.cuda.set_per_process_memory_fraction(limit / torch.cuda.get_device_properties(dev).total_memory)
        start = time.monotonic()
        try:
            got_x, got_idx, got_w, handle, _ = call()
            torch.cuda.synchronize()
            assert rank == 0, "rank 1's outputs were allocated under the cap"
            assert time.monotonic() - start < 10, "rank 0 waited for its peer's rows"
            # Without CPU sync the outputs are of the worst case: the rows received first.
            rows = got_x.shape[0] if sync else int(handle.psum_num_recv_tokens_per_rank[-1])
            ref_x, ref_idx, ref_w, _, _ = ref
            assert got_x.shape == ref_x.shape
            assert torch.equal(got_x[:rows], ref_x[:rows]) and torch.equal(got_w[:rows], ref_w[:rows])
            assert expand or torch.equal(got_idx[:rows], ref_idx[:rows])
        except torch.OutOfMemoryError as exc:
            assert rank == 1, exc
            raised.append(f"sync={sync} expand={expand}: {type(exc).__name__}")
        finally:
            if rank == 1:
                torch.cuda.set_per_process_memory_fraction(1.0)
        again_x, _, _, again, _ = call()
        combined, _, _ = buf.combine(again_x, again)
        torch.cuda.synchronize()
        assert torch.equal(combined, ref_combined), f"sync={sync} expand={expand}: the combine after differs"
    buf.destroy()
    return raised


def test_out_of_memory_on_one_rank(pool):
    """An allocation failure on one rank is that rank's error, not its peers' timeout (issue 13 item 5)."""
    first, second = pool.run(out_of_memory_rank)
    assert first == [] and len(second) == 3, (first, second)


# tests/test_gpu.py's checks of the CUDA backend that need a peer, run here with both ranks on one GPU (their own
# test functions skip or run one rank there). `(rank function, arguments)`; the cases are built for 2 ranks.
_EXPAND_ROUNDS = [Case(seed=105, num_ranks=2, num_experts=16, num_topk=8, hidden=7168, dtype="bfloat16",
                       num_tokens=(96, 64), num_max_tokens_per_rank=96, do_expand=True)]
_EXPAND_ROUNDS += [Case(**{**c.__dict__, "do_expand": True, "num_topk": min(c.num_experts, max(4, c.num_topk))})
                   for c in draw_cases(1044, 4, 2, max_tokens=512, dtypes=("bfloat16",))]
GPU_TIER = {
    "no host sync": ("no_host_sync_rank", (Case(seed=71, num_ranks=2, num_experts=16, num_topk=4, hidden=256,
                                                 num_tokens=(300, 200), num_max_tokens_per_rank=512, do_expand=True,
                                                 expert_alignment=16), "cuda")),
    "graph replay": ("graph_rank", (False, False)),
    "graph replay expand": ("graph_rank", (True, False)),
    "graph replay with hooks": ("graph_rank", (False, True)),
    "graph replay expand with hooks": ("graph_rank", (True, True)),
    "receive hook": ("recv_hook_cuda_rank", ()),
    "expand combine in rounds": ("rounds_rank", (_EXPAND_ROUNDS,)),
    "large shapes": ("large_shapes_rank", ()),
    "top-40 expand": ("wide_topk_rank", ()),
    "sizes disagree": ("disagreement_rank", ()),
    "partial sums disagree": ("partial_sums_rank", ()),
    "bad routing": ("bad_routing_rank", ()),
    "fp8 against the reference": ("fp8_rank", ([
        Case(seed=211, num_ranks=2, num_experts=16, num_topk=4, hidden=512, num_tokens=(300, 77),
             num_max_tokens_per_rank=300),
        Case(seed=212, num_ranks=2, num_experts=8, num_topk=3, hidden=7168, num_tokens=(64, 0),
             num_max_tokens_per_rank=64, do_expand=True, expert_alignment=32, drop_prob=0.3),
        Case(seed=213, num_ranks=2, num_experts=8, num_topk=2, hidden=16384, num_tokens=(40, 9),
             num_max_tokens_per_rank=40, do_expand=True, expert_alignment=4)],)),
    "round slots disagree": ("round_slots_rank", ()),
    "clearing a disagreement": ("clear_disagreement_rank", ()),
}


@pytest.mark.parametrize("check", sorted(GPU_TIER))
def test_gpu_tier_checks_with_a_peer(pool, check):
    name, args = GPU_TIER[check]
    first, second = pool.run(gpu_tier_rank, name, *args)
    if name in ("disagreement_rank", "partial_sums_rank", "round_slots_rank", "clear_disagreement_rank"):
        assert first == second, (first, second)


def pipeline_rank(rank: int, world_size: int) -> bool:
    """tests/test_primitives.py's ring on the CUDA backend: pipeline send/recv by copy engines between the two
    processes' IPC regions, more sends than slots in flight, async and not, mixed dtypes, bitwise."""
    import test_primitives

    with every_buffer_over_ipc():
        return test_primitives.pipeline_rank(rank, world_size, 9, (1024, 768), "cuda")


def test_pipeline_by_copy_engines(pool):
    assert pool.run(pipeline_rank) == [True, True]


def test_pipeline_ring_of_three():
    """Three ranks on the GPU: both directions of the ring (sources before and after each rank)."""
    with WorkerPool(3, backend="gloo", timeout_s=300) as workers:
        assert workers.run(pipeline_rank) == [True] * 3


def primitives_check_rank(rank: int, world_size: int, name: str):
    """tests/test_primitives.py's rank function `name` on the CUDA backend."""
    import test_primitives

    with every_buffer_over_ipc():
        return getattr(test_primitives, name)(rank, world_size, "cuda")


def test_mixed_calls_raise_on_every_rank(pool):
    """Ranks that called different primitives where the agreement runs on the host (tests/test_primitives.py)."""
    import test_primitives
    expected = [test_primitives.expected_mixed_calls(rank, "cuda") for rank in range(2)]
    assert pool.run(primitives_check_rank, "mixed_calls_rank") == expected


def test_outputs_carry_no_autograd_history(pool):
    assert pool.run(primitives_check_rank, "grad_free_rank") == [[False] * 6] * 2


def test_pipeline_lagging_receiver(pool):
    """The third send into two slots waits on the stream for the receiver's first receive; no slot is overwritten
    before it is received."""
    assert pool.run(primitives_check_rank, "pipeline_slots_rank") == [True, True]


def test_pipeline_receive_posted_first(pool):
    """Both ranks post an async receive before their send: each neighbour and direction has a stream of its own, so
    the receive's wait holds back no send (on the comm stream both ranks' sends queued behind their receives)."""
    assert pool.run(primitives_check_rank, "pipeline_receive_first_rank") == [True, True]


def test_empty_tensors(pool):
    """0-byte copies and empty launches on the copy-engine paths (tests/test_primitives.py's check)."""
    import test_primitives
    assert pool.run(primitives_check_rank, "empty_tensors_rank") == [test_primitives.EMPTY_RESULTS] * 2


def test_pipeline_reconfigure_with_tensors_in_flight(pool):
    import test_primitives
    expected = test_primitives.RECONFIGURE_MESSAGES + ["True"]
    assert pool.run(primitives_check_rank, "pipeline_reconfigure_rank") == [expected] * 2


def pipeline_timeout_rank(rank: int, world_size: int, after_disagreement: bool) -> str:
    """A receive whose sender never sends: its one-warp wait ends after num_gpu_timeout_secs, and the next call
    raises the TimeoutError naming rank, phase and peer. `after_disagreement`: a disagreeing dispatch came first; the
    receive's wait goes on through the disagreement and times out, the timeout takes the error record over, and the
    next synchronizing call raises the TimeoutError (not the disagreement, which the host would realign and go on
    from)."""
    from moe_comm.testing.disagreement import CASE
    buf = make(CASE, num_gpu_timeout_secs=3)
    buf.pp_set_config(64, 2)
    if after_disagreement:
        disagreeing_dispatch(buf, rank)
    if rank == 1:
        time.sleep(6)
        return "skipped"
    buf.pp_recv(torch.empty(4, device=buf.device), 1)  # returns: the wait is on the stream
    torch.cuda.synchronize()
    with pytest.raises(TimeoutError) as info:
        if after_disagreement:
            buf.barrier()
        else:
            buf.pp_recv(torch.empty(4, device=buf.device), 1)
    return str(info.value)


@pytest.mark.parametrize("after_disagreement", [False, True])
def test_pipeline_timeout(after_disagreement):
    with WorkerPool(2, backend="gloo", timeout_s=120) as workers:
        message, skipped = workers.run(pipeline_timeout_rank, after_disagreement)
    assert skipped == "skipped"
    assert "rank 0 timed out in pp_recv waiting for peer 1" in message, message


def collectives_rank(rank: int, world_size: int) -> list[str]:
    """tests/test_primitives.py's all_gather and reduce_scatter checks on the CUDA backend: copies into every peer's
    slot by copy engines, the sum in rank order by one kernel, bitwise."""
    import test_primitives

    with every_buffer_over_ipc():
        return test_primitives.collectives_rank(rank, world_size, "cuda")


def test_all_gather_and_reduce_scatter_by_copy_engines(pool):
    assert pool.run(collectives_rank) == [[], []]


def engram_rank(rank: int, world_size: int) -> list[str]:
    """tests/test_primitives.py's Engram checks on the CUDA backend: the table in IPC regions, rows read one-sided."""
    import test_primitives

    with every_buffer_over_ipc():
        return test_primitives.engram_rank(rank, world_size, "cuda")


def test_engram_one_sided(pool):
    assert pool.run(engram_rank) == [[], []]


def destroyed_group_rank(rank: int, world_size: int) -> tuple:
    """A CUDA buffer with primitive regions on a subgroup that is then destroyed: its calls raise the clear error,
    and destroy() meets no peer (it would wait in a barrier on the dead group), keeping this rank's regions."""
    import torch.distributed as dist

    group = dist.new_group(list(range(world_size)))
    with on_gpu0():
        buf = moe_comm.Buffer(group, num_max_tokens_per_rank=8, hidden=128, num_topk=2, backend="cuda",
                              num_cpu_timeout_secs=30, cuda_tuning=IPC)
        t = torch.full((4,), float(rank), device="cuda")
        gathered = buf.all_gather(t)[0].cpu()
        buf.pp_set_config(64, 1)
        buf.barrier()
        dist.destroy_process_group(group)
        messages = []
        for call in (buf.barrier, lambda: buf.all_gather(t)):
            with pytest.raises(RuntimeError) as info:
                call()
            messages.append(str(info.value))
        start = time.monotonic()
        buf.destroy()
        took = time.monotonic() - start
    return torch.equal(gathered, torch.arange(world_size, dtype=torch.float32)[:, None].expand(-1, 4)), messages, took


def test_destroyed_group():
    # Processes of their own: destroying a group shifts torch's hashed names of later subgroups in that process.
    with WorkerPool(2, backend="gloo", timeout_s=300) as workers:
        for gathered, messages, took in workers.run(destroyed_group_rank):
            assert gathered and took < 5, (gathered, took)
            assert messages == ["moe_comm: this Buffer's process group was destroyed (torch.distributed."
                                "destroy_process_group): make a new Buffer on a new process group"] * 2, messages
