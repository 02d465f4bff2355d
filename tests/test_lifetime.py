"""Buffer lifetime on the CPU tier: a construction that fails on one rank raises on every rank (not a timeout on the
others), and buffers destroyed or dropped give their memory back. The CUDA backend's memory: tests/test_gpu.py."""

from __future__ import annotations

import copy
import io
import pickle
import time
import unittest.mock as mock

import pytest
import torch

import moe_comm
from moe_comm import buffer as buffer_module
from moe_comm.testing import parallel_launch
from moe_comm.testing.checks import check_case
from moe_comm.testing.memory import churn_buffers
from moe_comm.testing.routing import Case, rank_inputs

GOOD = Case(seed=51, num_ranks=2, num_experts=4, num_topk=2, hidden=128, num_tokens=(6, 4), num_max_tokens_per_rank=8)

# What each rank's backend raises while it is made (rank -> exception), and the error every rank must then raise.
FAILURES = [
    ({1: torch.OutOfMemoryError("Tried to allocate 4294967296 bytes")}, torch.OutOfMemoryError,
     "moe_comm.Buffer(backend='torch') failed on rank(s) [1]: rank 1: OutOfMemoryError: Tried to allocate "
     "4294967296 bytes"),
    ({1: ValueError("would need 123 bytes")}, ValueError, "failed on rank(s) [1]: rank 1: ValueError: would need 123"),
    ({0: ValueError("too large"), 1: MemoryError("no host memory")}, RuntimeError,
     "failed on rank(s) [0, 1]: rank 0: ValueError: too large; rank 1: MemoryError: no host memory"),
]


def failed_construction_rank(rank: int, world_size: int) -> list[tuple[str, str, float, bool]]:
    """Per case of FAILURES: (error type, message, seconds to raise, chained to this rank's own failure); then the
    group still makes a working buffer (no rank is left inside a collective)."""
    outcomes = []
    for failures, _, _ in FAILURES:
        real = buffer_module.TorchRefBackend

        def make_backend(*args, failure=failures.get(rank)):
            if failure is not None:
                raise failure
            return real(*args)

        start = time.monotonic()
        with mock.patch.object(buffer_module, "TorchRefBackend", make_backend), pytest.raises(Exception) as info:
            moe_comm.Buffer(None, num_max_tokens_per_rank=8, hidden=128, num_topk=2, backend="torch",
                            num_cpu_timeout_secs=30)
        outcomes.append((type(info.value).__name__, str(info.value), time.monotonic() - start,
                         info.value.__cause__ is failures.get(rank)))
    check_case(moe_comm.Buffer(None, num_max_tokens_per_rank=8, hidden=128, num_topk=2, backend="torch"), GOOD, rank)
    return outcomes


def test_failed_construction_raises_on_every_rank(pools):
    """Rank 1's backend cannot allocate: rank 0, whose own allocation succeeded, raises the same error naming rank 1
    at once (it used to get a buffer, and a timeout at its first call)."""
    per_rank = pools(2).run(failed_construction_rank)
    for i, (failures, error_type, fragment) in enumerate(FAILURES):
        (type_0, message_0, seconds_0, chained_0), (type_1, message_1, seconds_1, chained_1) = (r[i] for r in per_rank)
        assert type_0 == type_1 == error_type.__name__, (type_0, type_1)
        assert message_0 == message_1 and fragment in message_0, message_0
        assert max(seconds_0, seconds_1) < 10, (seconds_0, seconds_1)  # the launcher's collective timeout is 60 s
        assert chained_0 and chained_1  # a failed rank's error is chained to its own exception


def churn_rank(rank: int, world_size: int, case: Case, num_buffers: int) -> dict:
    def make_buffer():
        return moe_comm.Buffer(None, num_max_tokens_per_rank=case.num_max_tokens_per_rank, hidden=case.hidden,
                               num_topk=case.num_topk, backend="torch")

    return churn_buffers(make_buffer, case, rank, num_buffers)


def test_buffers_give_back_host_memory(pools):
    """200 buffers, every other one destroyed, the rest dropped: none stays alive, and resident memory stays flat.

    Tolerance: 4 MiB of RSS growth (measured here: under 0.1 MiB). A buffer that kept the outputs of its three calls
    alive (44 to 64 KiB per rank for this case) would grow RSS by at least 200 x 44 KiB = 8.6 MiB; the margin below
    that is for malloc, which may keep freed memory in its arenas. A buffer that kept only itself alive (a reference
    cycle, a cache) is caught by the "alive" count, whatever its size. The case is small: the reference backend's
    calls, not the buffers, would otherwise take the time.
    """
    case = Case(seed=52, num_ranks=2, num_experts=8, num_topk=2, hidden=256, num_tokens=(32, 24),
                num_max_tokens_per_rank=32)
    for r in pools(2).run(churn_rank, case, 200):
        growth = r["after"]["host rss"] - r["before"]["host rss"]
        assert r["alive"] == 0 and not r["unraisable"], r
        assert growth <= 4 * 2**20, f"host RSS grew by {growth / 2**20:.2f} MiB over 200 buffers: {r}"


def copy_rank(rank: int, world_size: int) -> list[str]:
    """A deep copy of a model holding a buffer (an EMA copy) shares the buffer and its handles; pickling either (or
    torch.save) is a TypeError saying what to save instead, not one about ProcessGroup."""
    case = Case(seed=5, num_ranks=2, num_experts=4, num_topk=2, hidden=16, num_tokens=(4, 3),
                num_max_tokens_per_rank=4)
    buf = moe_comm.Buffer(None, num_max_tokens_per_rank=4, hidden=16, num_topk=2, backend="torch")
    x, idx, w = rank_inputs(case, rank)
    recv_x, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=4)
    model = torch.nn.Linear(2, 2)
    model.buffer, model.handle = buf, handle
    twin = copy.deepcopy(model)
    assert twin.buffer is buf and twin.handle is handle and twin.weight is not model.weight
    assert copy.copy(buf) is buf and copy.copy(handle) is handle
    messages = []
    for obj in (buf, handle):
        with pytest.raises(TypeError, match="cannot be pickled or saved") as info:
            pickle.dumps(obj)
        messages.append(str(info.value))
        with pytest.raises(TypeError, match="cannot be pickled or saved"):
            torch.save(obj, io.BytesIO())
    buf.destroy()
    return messages


def test_copy_and_pickle(pools):
    messages = pools(2).run(copy_rank)
    assert messages[0] == messages[1] and "state_dict" in messages[0][0], messages


def after_group_destroyed_rank(rank: int, world_size: int, which: str) -> list[str]:
    """After `destroy_process_group()` (`which`: of the default group, or of the buffer's own subgroup) every call of
    a buffer on it raises one clear RuntimeError (dispatch raised torch's "Group <object at 0x...> is not
    registered", barrier returned as if the group were there); destroy() still releases it, with a send unreceived."""
    import torch.distributed as dist

    group = None if which == "default" else dist.new_group(list(range(world_size)))
    buf = moe_comm.Buffer(group, num_max_tokens_per_rank=8, hidden=128, num_topk=2, backend="torch",
                          num_cpu_timeout_secs=5)
    x, idx, w = rank_inputs(GOOD, rank)
    recv_x, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=GOOD.num_experts)
    buf.pp_set_config(64, 1)
    buf.pp_send(torch.zeros(2), 1 - rank)
    buf.barrier()
    dist.destroy_process_group(group)
    messages = []
    for call in (lambda: buf.dispatch(x, idx, w, num_experts=GOOD.num_experts), lambda: buf.combine(recv_x, handle),
                 buf.barrier, lambda: buf.pp_send(torch.zeros(2), 1 - rank), lambda: buf.all_gather(torch.zeros(2))):
        with pytest.raises(RuntimeError) as info:
            call()
        messages.append(str(info.value))
    buf.destroy()
    return messages


@pytest.mark.parametrize("which", ["default", "subgroup"])
def test_calls_after_the_group_was_destroyed(which):
    for messages in parallel_launch(2, after_group_destroyed_rank, which, timeout_s=120):
        assert messages == ["moe_comm: this Buffer's process group was destroyed (torch.distributed."
                            "destroy_process_group): make a new Buffer on a new process group"] * 5, messages


def dropped_exchanges_rank(rank: int, world_size: int, what: str) -> bool:
    """An exchange posted and then dropped unwaited (a receive hook of a destroyed buffer, an async call's event, an
    Engram fetch never called, a buffer with a pipeline receive posted) leaves the group usable: gloo's connection
    stalled on the data of a receive whose work was freed, and the next buffer's first exchange timed out."""
    import gc

    buf = moe_comm.Buffer(None, num_max_tokens_per_rank=8, hidden=128, num_topk=2, backend="torch",
                          num_cpu_timeout_secs=5)
    x, idx, w = rank_inputs(GOOD, rank)
    if what == "hook":
        buf.dispatch(x, idx, w, num_experts=GOOD.num_experts, return_recv_hook=True)
        buf.destroy()
    elif what == "event":
        buf.dispatch(x, idx, w, num_experts=GOOD.num_experts, async_with_compute_stream=True)
    elif what == "engram":
        buf.engram_write(torch.arange(8.0 * (rank + 1)).view(-1, 2))
        buf.engram_fetch(torch.tensor([0, 5]))
    else:  # "pipeline": each posts a receive, then sends; the buffer is dropped with both in flight
        buf.pp_set_config(64, 1)
        buf.pp_recv(torch.empty(4), 1 - rank, async_with_compute_stream=True)
        buf.pp_send(torch.ones(4), 1 - rank)
    del buf
    gc.collect()
    again = moe_comm.Buffer(None, num_max_tokens_per_rank=8, hidden=128, num_topk=2, backend="torch",
                            num_cpu_timeout_secs=5)
    return check_case(again, GOOD, rank) is not None


@pytest.mark.parametrize("what", ["hook", "event", "engram", "pipeline"])
def test_dropped_exchanges_leave_the_group_usable(pools, what):
    assert pools(2).run(dropped_exchanges_rank, what) == [True, True]
