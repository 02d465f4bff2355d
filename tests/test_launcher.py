"""The spawn launcher: results in rank order, the failing rank's traceback, the other ranks stopped at once,
a fresh group after a failure; and moe_comm's own timeouts when a peer never arrives."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import moe_comm
from moe_comm.testing import RankFailure, WorkerPool, parallel_launch
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
        # The pool spawns a fresh group for the next run.
        assert pool.run(rank_info, "again") == [(0, 2, "again", 2), (1, 2, "again", 2)]


def test_overall_timeout():
    with WorkerPool(2) as pool:
        with pytest.raises(RankFailure, match="did not finish within 2 s"):
            pool.run(sleep_forever, timeout_s=2)


CASE = Case(seed=51, num_ranks=2, num_experts=4, num_topk=2, hidden=16, num_tokens=(4, 4), num_max_tokens_per_rank=4)


def missing_peer_rank(rank: int, world_size: int, phase: str) -> str:
    """Rank 1 skips one call; rank 0 must fail within num_cpu_timeout_secs, naming rank, phase and peer."""
    buf = moe_comm.Buffer(None, num_max_tokens_per_rank=4, hidden=16, num_topk=2, backend="torch",
                          num_cpu_timeout_secs=2)
    x, idx, w = rank_inputs(CASE, rank)
    _, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=4)
    if rank == 1:
        time.sleep(6)
        return "skipped"
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        if phase == "dispatch":
            buf.dispatch(x, idx, w, num_experts=4)
        else:
            buf.combine(torch.zeros(handle.num_recv_rows, 16, dtype=torch.bfloat16), handle)
    elapsed = time.monotonic() - start
    assert elapsed < 5, elapsed
    return str(info.value)


@pytest.mark.parametrize("phase,fragment", [("dispatch", "rank 0 dispatch argument agreement: receive from peer 1"),
                                            ("combine", "rank 0 combine exchange: receive from peer 1")])
def test_missing_peer_times_out(phase, fragment):
    message, skipped = parallel_launch(2, missing_peer_rank, phase, timeout_s=120)
    assert skipped == "skipped"
    assert fragment in message and "num_cpu_timeout_secs=2" in message, message
