"""The launcher: results in rank order, the failing rank's traceback, the other ranks stopped at once,
a fresh group after a failure, the parent's environment and a share of the cores in each rank; and moe_comm's own
timeouts when a peer never arrives."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import moe_comm
from moe_comm.testing import RankFailure, WorkerPool, parallel_launch
from moe_comm.testing.checks import skip_one_call
from moe_comm.testing.routing import Case, rank_inputs


def rank_info(rank: int, world_size: int, tag: str) -> tuple:
    return rank, world_size, tag, dist.get_world_size()


def fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise KeyError("planted failure")
    dist.barrier()  # rank 0 blocks here until it is killed


def sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(3600)


def test_results_in_rank_order():
    assert parallel_launch(3, rank_info, "t") == [(r, 3, "t", 3) for r in range(3)]


def test_failure_reports_traceback_and_stops_peers():
    with WorkerPool(2) as pool:
        pool.run(rank_info, "warm")
        start = time.monotonic()
        with pytest.raises(RankFailure) as info:
            pool.run(fail_on_rank_one)
        # Rank 0 was blocked in a barrier (60 s group timeout): it must have been killed, not waited for.
        assert time.monotonic() - start < 15
        assert "failed on rank 1" in str(info.value) and "KeyError: 'planted failure'" in str(info.value)
        # The pool starts a fresh group for the next run.
        assert pool.run(rank_info, "again") == [(0, 2, "again", 2), (1, 2, "again", 2)]


def environment_and_threads(rank: int, world_size: int) -> tuple:
    return os.environ.get("MOE_COMM_TEST_PROBE"), torch.get_num_threads()


def test_ranks_get_the_environment_at_start_and_a_share_of_the_cores(monkeypatch):
    """The fork server started before these variables were set (conftest): each rank still sees the parent's
    environment as it was when the pool started (its first run), and takes cores // world_size threads unless
    OMP_NUM_THREADS says."""
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("MOE_COMM_TEST_PROBE", "first")
    with WorkerPool(2) as pool:
        assert pool.run(environment_and_threads) == [("first", max(1, cores // 2))] * 2  # the first run starts it
        monkeypatch.setenv("MOE_COMM_TEST_PROBE", "later")  # after the start: the ranks keep what they got
        assert pool.run(environment_and_threads) == [("first", max(1, cores // 2))] * 2
    monkeypatch.delenv("MOE_COMM_TEST_PROBE")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert parallel_launch(2, environment_and_threads) == [(None, 3)] * 2


def test_overall_timeout():
    with WorkerPool(2) as pool:
        with pytest.raises(RankFailure, match="did not finish within 2 s"):
            pool.run(sleep_forever, timeout_s=2)


CASE = Case(seed=51, num_ranks=2, num_experts=4, num_topk=2, hidden=16, num_tokens=(4, 4), num_max_tokens_per_rank=4)


def missing_peer_rank(rank: int, world_size: int, phase: str):
    """Rank 1 skips one call; rank 0 must fail within num_cpu_timeout_secs, naming rank, phase and peer."""
    buf = moe_comm.Buffer(None, num_max_tokens_per_rank=4, hidden=16, num_topk=2, backend="torch",
                          num_cpu_timeout_secs=2)
    return skip_one_call(buf, CASE, rank, 1, phase)


@pytest.mark.parametrize("phase,fragment", [("dispatch", "rank 0 dispatch argument agreement: receive from peer 1"),
                                            ("combine", "rank 0 combine argument agreement: receive from peer 1")])
def test_missing_peer_times_out(phase, fragment):
    (error, message, elapsed), skipped = parallel_launch(2, missing_peer_rank, phase, timeout_s=120)
    assert skipped == "skipped"
    assert error == "TimeoutError" and elapsed < 5, (error, elapsed)
    assert fragment in message and "num_cpu_timeout_secs=2" in message, message


def dead_peer_rank(rank: int, world_size: int) -> object:
    """Rank 1's connections close (as when its process ends): rank 0 gets a ConnectionError naming the peer at once,
    not a timeout, and every later call one clear error saying the group is broken and why."""
    import torch.distributed as dist

    buf = moe_comm.Buffer(None, num_max_tokens_per_rank=4, hidden=16, num_topk=2, backend="torch",
                          num_cpu_timeout_secs=30)
    x, idx, w = rank_inputs(CASE, rank)
    recv_x, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=4)
    if rank == 1:
        dist.destroy_process_group()
        return "closed"
    time.sleep(1)
    start = time.monotonic()
    with pytest.raises(ConnectionError) as info:
        buf.dispatch(x, idx, w, num_experts=4)
    elapsed = time.monotonic() - start
    later = []
    for call in (lambda: buf.combine(recv_x, handle), lambda: buf.dispatch(x, idx, w, num_experts=4), buf.barrier):
        with pytest.raises(RuntimeError, match="process group is broken since an earlier error") as broken:
            call()
        later.append(str(broken.value))
    return str(info.value), elapsed, later


def test_dead_peer_is_named_and_breaks_the_group():
    (message, elapsed, later), closed = parallel_launch(2, dead_peer_rank, timeout_s=120)
    assert closed == "closed"
    # Posting the exchange fails when the connection is already closed, its wait when it closes meanwhile.
    assert message.startswith("moe_comm: rank 0 dispatch argument agreement: ") and \
        "peer 1 closed the connection" in message, message
    assert elapsed < 10, elapsed  # not num_cpu_timeout_secs=30
    assert all(message.removeprefix("moe_comm: ") in text for text in later), later


def missing_peer_at_construction_rank(rank: int, world_size: int):
    """The last rank never makes its Buffer: every other rank's construction ends within num_cpu_timeout_secs,
    naming it (its exchanges would otherwise wait for the process group's timeout). The others start together (a
    rank that came 2 s after another's timeout would find that rank gone and name it too, as documented)."""
    others = dist.new_group(list(range(world_size - 1)))  # every rank makes a group, members or not
    if rank == world_size - 1:
        time.sleep(6)
        return "skipped"
    dist.barrier(group=others)
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        moe_comm.Buffer(None, num_max_tokens_per_rank=4, hidden=16, num_topk=2, backend="torch",
                        num_cpu_timeout_secs=2)
    return str(info.value), time.monotonic() - start


def test_missing_peer_at_construction_times_out():
    *waiting, skipped = parallel_launch(3, missing_peer_at_construction_rank, timeout_s=120)
    assert skipped == "skipped"
    for rank, (message, elapsed) in enumerate(waiting):
        assert elapsed < 5, (rank, elapsed)
        assert message == f"moe_comm: rank {rank} Buffer(...): peer(s) [2] did not answer at the construction " \
                          f"within num_cpu_timeout_secs=2 (absent, or gave up); the group cannot be used further: " \
                          f"create a new process group"


def construct_or_call_rank(rank: int, world_size: int):
    """Rank 0 makes a second Buffer while rank 1 calls the first: the arrival words travel on a tag of their own,
    so each side times out cleanly (on one tag, gloo paired rank 1's rows with an arrival word and aborted). Rank 1
    gives up first (rank 0 waits 4 s): the first timeout closes gloo's connections, so the later side hears "gave
    up" and is named so; with equal deadlines either side could be first."""
    buf = moe_comm.Buffer(None, num_max_tokens_per_rank=4, hidden=16, num_topk=2, backend="torch",
                          num_cpu_timeout_secs=2)
    with pytest.raises(TimeoutError) as info:
        if rank == 0:
            moe_comm.Buffer(None, num_max_tokens_per_rank=4, hidden=16, num_topk=2, backend="torch",
                            num_cpu_timeout_secs=4)
        else:
            buf.dispatch(*rank_inputs(CASE, rank), num_experts=4)
    return str(info.value)


def test_construction_and_a_call_do_not_pair():
    made, called = parallel_launch(2, construct_or_call_rank, timeout_s=120)
    assert "rank 0 Buffer(...): peer(s) [1] did not answer at the construction" in made, made
    assert "rank 1 dispatch argument agreement: receive from peer 0" in called, called


def late_arrival_rank(rank: int, world_size: int):
    """Rank 1 reaches Buffer(...) after rank 0 gave up: rank 0 names it, rank 1 hears that a peer closed the
    connection before it came (a raw gloo RuntimeError before)."""
    dist.barrier()  # the two start together: rank 1 then comes 2 s after rank 0's deadline
    if rank == 1:
        time.sleep(4)
    with pytest.raises((TimeoutError, ConnectionError)) as info:
        moe_comm.Buffer(None, num_max_tokens_per_rank=4, hidden=16, num_topk=2, backend="torch",
                        num_cpu_timeout_secs=2)
    return type(info.value).__name__, str(info.value)


def test_late_arrival_at_construction():
    (early_type, early), (late_type, late) = parallel_launch(2, late_arrival_rank, timeout_s=120)
    assert early_type == "TimeoutError" and "rank 0 Buffer(...): peer(s) [1] did not answer" in early, early
    assert late_type == "ConnectionError" and late.startswith(
        "moe_comm: rank 1 Buffer(...): a peer closed the connection before this rank arrived"), late
