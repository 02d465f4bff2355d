"""The buffer's primitives beside dispatch and combine (issue 16) on the reference path over gloo, 2-4 ranks: pipeline
send/recv between ring neighbours, all-gather, reduce-scatter and Engram fetches, bitwise against torch.distributed
equivalents and closed forms; bad arguments refused before anything moves; a peer that never arrives is a
TimeoutError naming rank, phase and peer."""

from __future__ import annotations

import math
import os
import re
import time

import pytest
import torch
import torch.distributed as dist

import moe_comm


def make_buffer(**kwargs) -> moe_comm.Buffer:
    return moe_comm.Buffer(None, num_max_tokens_per_rank=8, hidden=16, num_topk=2,
                           backend=kwargs.pop("backend", "torch"),
                           num_cpu_timeout_secs=kwargs.pop("num_cpu_timeout_secs", 30), **kwargs)


def tensor_of(rank: int, step: int, shape=(3, 5), dtype=torch.float32, device="cpu") -> torch.Tensor:
    """What `rank` sends at `step`: values nobody else sends."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(shape, generator=g).to(dtype).to(device)


def pipeline_rank(rank: int, world_size: int, num_steps: int, shape=(3, 5), backend: str = "torch") -> bool:
    """Every rank sends `num_steps` tensors to the next rank of the ring, each before it receives the previous
    rank's (every rank sends first: with two ranks they send to each other), async and not, mixed dtypes; each
    received tensor is bitwise what its sender made for that step. `backend="cuda"`: the copy-engine path."""
    buf = make_buffer(backend=backend)
    buf.pp_set_config(num_max_tensor_bytes=math.prod(shape) * 8, num_max_inflight_tensors=2)
    if backend == "cuda":  # the pipeline region is what the hint says
        assert buf._prims._region.tensor.numel() == moe_comm.Buffer.get_pp_buffer_size_hint(math.prod(shape) * 8, 2)
    nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
    received = []
    for step in range(num_steps):
        dtype = (torch.float32, torch.bfloat16, torch.float64)[step % 3]
        sent = tensor_of(rank, step, shape, dtype=dtype, device=buf.device)
        buf.pp_send(sent, nxt)
        sent.fill_(-1)  # the slot holds a copy: reusing the tensor at once changes nothing
        out = torch.empty(shape, dtype=dtype, device=buf.device)
        event = buf.pp_recv(out, prev, async_with_compute_stream=step % 2 == 1)
        event.current_stream_wait()
        expected = tensor_of(prev, step, shape, dtype=dtype)
        received.append(torch.equal(out.cpu().view(torch.uint8), expected.view(torch.uint8)))
    buf.barrier()
    return all(received)


@pytest.mark.parametrize("world_size", [2, 3])
def test_pipeline_ring(pools, world_size):
    assert pools(world_size).run(pipeline_rank, 7) == [True] * world_size


def pipeline_slots_rank(rank: int, world_size: int, backend: str = "torch") -> bool:
    """Rank 0 sends four tensors with two slots before rank 1 receives any (it sleeps first): the third send waits
    for the first receive (rank 0's last two sends take about rank 1's sleep: the reference's sends block the host,
    the CUDA backend's stream), and no send overwrites a slot not yet received (bitwise). Between rank 0's sends and
    rank 1's receives both run an all_gather: the pipeline's tensors travel apart from the buffer's other
    exchanges."""
    buf = make_buffer(backend=backend)
    device = buf.device
    buf.pp_set_config(num_max_tensor_bytes=64, num_max_inflight_tensors=2)
    if rank == 0:
        for step in range(2):
            buf.pp_send(tensor_of(0, step, (4,), device=device), 1)
    gathered, _ = buf.all_gather(torch.full((4,), float(rank), device=device))
    same = torch.equal(gathered.cpu(), torch.arange(world_size).float()[:, None].expand(-1, 4))
    if rank == 0:
        start = time.monotonic()
        for step in range(2, 4):
            buf.pp_send(tensor_of(0, step, (4,), device=device), 1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        same &= time.monotonic() - start > 0.5  # waited for rank 1's first receive, after its 1 s sleep
    else:
        time.sleep(1.0)
        for step in range(4):
            out = torch.empty(4, device=device)
            buf.pp_recv(out, 0)
            same &= torch.equal(out.cpu(), tensor_of(0, step, (4,)))
    buf.barrier()
    return same


def test_pipeline_slots_and_other_exchanges(pools):
    assert pools(2).run(pipeline_slots_rank) == [True, True]


def pipeline_receive_first_rank(rank: int, world_size: int, backend: str = "torch") -> bool:
    """Every rank posts an async receive from the previous rank before its send to the next (the order a pipeline
    schedule posts them in), for several steps, sends alternately synchronous and async: nothing waits for a send
    queued behind a receive (on GPUs each neighbour and direction has a stream of its own), every tensor bitwise."""
    buf = make_buffer(backend=backend)
    device = buf.device
    buf.pp_set_config(num_max_tensor_bytes=256, num_max_inflight_tensors=2)
    nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
    same = True
    for step in range(5):
        out = torch.empty(8, 4, device=device)
        received = buf.pp_recv(out, prev, async_with_compute_stream=True)
        sent = buf.pp_send(tensor_of(rank, step, (8, 4), device=device), nxt,
                           async_with_compute_stream=step % 2 == 1)
        received.current_stream_wait()
        sent.current_stream_wait()
        same &= torch.equal(out.cpu().view(torch.uint8), tensor_of(prev, step, (8, 4)).view(torch.uint8))
    buf.barrier()
    return same


@pytest.mark.parametrize("world_size", [2, 3])
def test_pipeline_receive_posted_first(pools, world_size):
    assert pools(world_size).run(pipeline_receive_first_rank) == [True] * world_size


def empty_tensors_rank(rank: int, world_size: int, backend: str = "torch") -> list[str]:
    """Every primitive with nothing to move: an empty send and receive, all_gather and reduce_scatter of no rows, an
    Engram table with no rows on some ranks and a fetch of none; then a non-empty round still right (the 0-byte
    copies left every flag and slot in step). Returns the output shapes."""
    buf = make_buffer(backend=backend)
    device = buf.device
    buf.pp_set_config(num_max_tensor_bytes=64, num_max_inflight_tensors=2)
    nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
    shapes = []
    for step in range(3):  # more than the slots: the empty sends take slots and release them as any other
        buf.pp_send(torch.ones(0, 4, device=device), nxt)
        out = torch.empty(0, 4, device=device)
        buf.pp_recv(out, prev, async_with_compute_stream=step == 1).current_stream_wait()
    buf.pp_send(tensor_of(rank, 9, (4,), device=device), nxt)
    out = torch.empty(4, device=device)
    buf.pp_recv(out, prev)
    shapes.append(str(torch.equal(out.cpu(), tensor_of(prev, 9, (4,)))))
    for call in (buf.all_gather, buf.reduce_scatter):
        shapes.append(str(tuple(call(torch.ones(0, 3, device=device))[0].shape)))
    gathered, _ = buf.all_gather(torch.full((2,), float(rank), device=device))
    shapes.append(str(torch.equal(gathered.cpu(), torch.arange(world_size).float()[:, None].expand(-1, 2))))
    buf.engram_write(torch.ones(0 if rank else 3, 4, device=device))
    shapes.append(str(tuple(buf.engram_fetch(torch.zeros(0, dtype=torch.int64, device=device))().shape)))
    shapes.append(str(buf.engram_fetch(torch.tensor([2, 0], device=device))().cpu().tolist()))
    buf.barrier()
    return shapes


EMPTY_RESULTS = ["True", "(2, 0, 3)", "(0, 3)", "True", "(0, 4)", str([[1.0] * 4] * 2)]  # empty_tensors_rank, 2 ranks


def test_empty_tensors(pools):
    assert pools(2).run(empty_tensors_rank) == [EMPTY_RESULTS] * 2


def pipeline_reconfigure_rank(rank: int, world_size: int, backend: str = "torch") -> list[str]:
    """`pp_set_config` while rank 0's tensor to rank 1 is unreceived, then while rank 1's async receive from rank 0
    waits for its send: each time the same ValueError on every rank, naming the pair, and the old configuration
    stays (the missing receive, then the missing send, made afterwards, bitwise); with nothing in flight the new
    configuration takes effect and a tensor of its larger size goes through."""
    buf = make_buffer(backend=backend)
    device = buf.device
    buf.pp_set_config(num_max_tensor_bytes=64, num_max_inflight_tensors=2)
    if rank == 0:
        buf.pp_send(tensor_of(0, 0, (4,), device=device), 1)
    with pytest.raises(ValueError) as unreceived:
        buf.pp_set_config(num_max_tensor_bytes=1024, num_max_inflight_tensors=2)
    same = True
    if rank == 1:
        out = torch.empty(4, device=device)
        buf.pp_recv(out, 0)
        same = torch.equal(out.cpu(), tensor_of(0, 0, (4,)))
        early = torch.empty(4, device=device)
        posted = buf.pp_recv(early, 0, async_with_compute_stream=True)
    with pytest.raises(ValueError) as unsent:
        buf.pp_set_config(num_max_tensor_bytes=1024, num_max_inflight_tensors=2)
    if rank == 0:
        buf.pp_send(tensor_of(0, 2, (4,), device=device), 1)
    elif rank == 1:
        posted.current_stream_wait()
        same &= torch.equal(early.cpu(), tensor_of(0, 2, (4,)))
    buf.pp_set_config(num_max_tensor_bytes=1024, num_max_inflight_tensors=2)
    if rank == 0:
        buf.pp_send(tensor_of(0, 1, (256,), device=device), 1)
    elif rank == 1:
        out = torch.empty(256, device=device)
        buf.pp_recv(out, 0)
        same &= torch.equal(out.cpu(), tensor_of(0, 1, (256,)))
    buf.barrier()
    return [str(unreceived.value), str(unsent.value), str(same)]


RECONFIGURE_MESSAGES = [
    "pp_set_config while tensors are in flight (the configuration is unchanged): rank 0 sent 1 to rank 1, which "
    "posted 0 receives from it (receive the rest)",
    "pp_set_config while tensors are in flight (the configuration is unchanged): rank 1 posted 2 receives from rank "
    "0, which sent 1 to it (send the rest)"]  # pipeline_reconfigure_rank's, on every rank


def test_pipeline_reconfigure_with_tensors_in_flight(pools):
    assert pools(3).run(pipeline_reconfigure_rank) == [RECONFIGURE_MESSAGES + ["True"]] * 3


def refused_rank(rank: int, world_size: int) -> list[str]:
    """Arguments refused on one rank of a collective call: that rank raises its own error, every other rank a
    ValueError naming it (none waits for the refused rank until a timeout); the buffer works afterwards."""
    buf = make_buffer()
    calls = [("pp_set_config", lambda: buf.pp_set_config(0 if rank == 1 else 64, 2)),
             ("engram_write", lambda: buf.engram_write("not a tensor" if rank == 1 else torch.zeros(2, 3))),
             ("all_gather", lambda: buf.all_gather(torch.zeros(4, 6).t() if rank == 1 else torch.zeros(6, 4))),
             ("engram_fetch", lambda: buf.engram_fetch(torch.zeros(2, dtype=torch.int64)))]  # no table yet
    messages = []
    for what, call in calls:
        with pytest.raises((TypeError, ValueError, RuntimeError)) as info:
            call()
        messages.append(str(info.value))
    buf.pp_set_config(64, 2)
    out, _ = buf.all_gather(torch.full((2,), float(rank)))
    assert torch.equal(out, torch.arange(world_size).float()[:, None].expand(-1, 2))
    return messages


def test_refused_arguments_raise_on_every_rank(pools):
    ok, refused = pools(2).run(refused_rank)
    assert ok[0] == "pp_set_config: rank(s) [1] refused their arguments (their error says why)", ok
    assert refused[0] == "num_max_tensor_bytes=0 must be >= 1", refused
    assert ok[1] == "engram_write: rank(s) [1] refused their arguments (their error says why)"
    assert refused[1] == "storage must be a torch.Tensor, got str"
    assert ok[2] == "all_gather: rank(s) [1] refused their arguments (their error says why)"
    assert refused[2].startswith("t must be contiguous")
    assert ok[3] == refused[3] == "moe_comm: call engram_write(storage) on every rank before engram_fetch"


def mixed_calls_rank(rank: int, world_size: int, backend: str = "torch") -> list[str]:
    """Ranks that called different primitives, or one with a bad stream argument on one rank only: every rank raises
    at once (the first exchange of every primitive is the fixed-size agreement, the operation first), none dies in
    the transport or waits for a timeout, and the buffer works afterwards. The CUDA backend: the calls whose
    agreement runs on the host there (pp_set_config, engram_write, engram_fetch, an all_gather / reduce_scatter that
    makes its region)."""
    buf = make_buffer(backend=backend)
    dev = buf.device
    t = torch.zeros(2 * world_size, 3, device=dev)
    buf.engram_write(torch.zeros(2, 3, device=dev))
    calls = {"all_gather": lambda: buf.all_gather(t), "reduce_scatter": lambda: buf.reduce_scatter(t),
             "engram_fetch": lambda: buf.engram_fetch(torch.zeros(1, dtype=torch.int64, device=dev)),
             "engram_write": lambda: buf.engram_write(torch.zeros(2, 3, device=dev)),
             "pp_set_config": lambda: buf.pp_set_config(64, 2),
             "dispatch": lambda: buf.dispatch(torch.zeros(2, 16, dtype=torch.bfloat16, device=dev),
                                              torch.zeros(2, 2, dtype=torch.int64, device=dev), None, num_experts=4)}
    pairs = [("all_gather", "reduce_scatter"), ("engram_fetch", "all_gather"), ("pp_set_config", "engram_write"),
             ("engram_write", "engram_fetch")]
    if backend == "torch":  # the CUDA backend's dispatch and a grown region's collectives agree on the device only
        pairs += [("all_gather", "dispatch"), ("pp_set_config", "all_gather")]
    messages = []
    for mine, other in pairs:
        with pytest.raises(ValueError) as info:
            calls[mine if rank == 0 else other]()
        messages.append(str(info.value))
    if backend == "torch":  # bad stream arguments on rank 1 only
        for what, call in (("all_gather", lambda: buf.all_gather(t, previous_event="x" if rank else None)),
                           ("reduce_scatter", lambda: buf.reduce_scatter(
                               t, async_with_compute_stream="yes" if rank else False))):
            with pytest.raises((TypeError, ValueError)) as info:
                call()
            messages.append(str(info.value))
    out, _ = buf.all_gather(torch.full((2,), float(rank), device=dev))
    messages.append(str(torch.equal(out.cpu(), torch.arange(world_size).float()[:, None].expand(-1, 2))))
    return messages


def expected_mixed_calls(rank: int, backend: str) -> list[str]:
    """`mixed_calls_rank`'s messages on `rank` of 2."""
    pairs = [("all_gather", "reduce_scatter"), ("engram_fetch", "all_gather"), ("pp_set_config", "engram_write"),
             ("engram_write", "engram_fetch")]
    if backend == "torch":
        pairs += [("all_gather", "dispatch"), ("pp_set_config", "all_gather")]
    messages = [f"ranks called different operations (per rank): {list(pair)}" for pair in pairs]
    if backend == "torch":
        if rank == 0:
            messages += [f"{what}: rank(s) [1] refused their arguments (their error says why)"
                         for what in ("all_gather", "reduce_scatter")]
        else:
            messages += ["previous_event must be a moe_comm.EventOverlap or None, got str",
                         "async_with_compute_stream must be a bool, got 'yes' (str)"]
    return messages + ["True"]


def test_mixed_calls_raise_on_every_rank(pools):
    assert pools(2).run(mixed_calls_rank) == [expected_mixed_calls(r, "torch") for r in range(2)]


def collectives_rank(rank: int, world_size: int, backend: str = "torch") -> list[str]:
    """all_gather and reduce_scatter against torch.distributed's all_gather and a local rank-ordered FP32 sum of
    every rank's blocks (bitwise), sync and async; then the errors. `backend="cuda"`: the copy-engine path."""
    buf = make_buffer(backend=backend)
    dev = buf.device
    problems = []
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        t = tensor_of(rank, 0, shape=(2 * world_size, 3), dtype=dtype, device=dev)
        everyone = [torch.empty_like(t) for _ in range(world_size)]
        dist.all_gather(everyone, t)
        for use_async in (False, True):
            out, event = buf.all_gather(t, async_with_compute_stream=use_async)
            event.current_stream_wait()
            if not torch.equal(out.view(torch.uint8), torch.stack(everyone).view(torch.uint8)):
                problems.append(f"all_gather {dtype} async={use_async}")
            out, event = buf.reduce_scatter(t, async_with_compute_stream=use_async)
            event.current_stream_wait()
            acc = torch.float64 if dtype == torch.float64 else torch.float32
            blocks = [e[2 * rank:2 * rank + 2].to(acc) for e in everyone]
            expected = blocks[0]
            for block in blocks[1:]:
                expected = expected + block
            if not torch.equal(out.view(torch.uint8), expected.to(dtype).view(torch.uint8)):
                problems.append(f"reduce_scatter {dtype} async={use_async}")
    if backend == "cuda":  # the region grows to the largest block a rank sends another, and stays that large
        for numel in (250, 150):  # 1000 bytes (slots of 1024), then 600 (768 would do)
            buf.all_gather(torch.full((numel,), float(rank), device=dev))
            hint = moe_comm.Buffer.get_agrs_buffer_size_hint(None, 1000)
            if buf._prims._agrs.tensor.numel() != hint:
                problems.append(f"all_gather / reduce_scatter region {buf._prims._agrs.tensor.numel()} != {hint}")
    # Bad arguments: refused on the caller before anything moves.
    if world_size > 1:
        with pytest.raises(ValueError, match=r"t's first dimension must be a multiple of the \d ranks, got shape "
                                             r"\(5, 3\)"):
            buf.reduce_scatter(torch.zeros(5, 3, device=dev))
    with pytest.raises(TypeError, match="t must be one of .* for reduce_scatter, got torch.int64"):
        buf.reduce_scatter(torch.zeros(2 * world_size, dtype=torch.int64, device=dev))
    with pytest.raises(ValueError, match="t must be contiguous"):
        buf.all_gather(torch.zeros(4, 6, device=dev).t())
    with pytest.raises(TypeError, match="t must be a torch.Tensor, got list"):
        buf.all_gather([1, 2])
    # Ranks that disagree on the shape: the same ValueError on every rank (checked on the CPU tier; on GPUs with
    # MOE_COMM_CHECK_INPUTS=1), then it works.
    if dev.type == "cpu" and world_size > 1:
        with pytest.raises(ValueError, match=r"ranks called all_gather with different arguments \(per rank\): "
                                             r"shape\[0\]: \[1, 2"):
            buf.all_gather(torch.zeros(rank + 1, 3))
    out = buf.all_gather(torch.full((2,), float(rank), device=dev))[0]
    if not torch.equal(out.cpu(), torch.arange(world_size).float()[:, None].expand(-1, 2)):
        problems.append("all_gather after a disagreement")
    return problems


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_all_gather_and_reduce_scatter(pools, world_size):
    assert pools(world_size).run(collectives_rank) == [[]] * world_size


def engram_rank(rank: int, world_size: int, backend: str = "torch") -> list[str]:
    """Tables of different row counts per rank (rank 1 none); every rank fetches indices of every owner, repeated,
    unordered, and none; rows bitwise the concatenated table's. `backend="cuda"`: the one-sided path."""
    buf = make_buffer(backend=backend)
    problems = []
    for dtype, row in ((torch.float32, (4,)), (torch.bfloat16, (2, 3)), (torch.int64, ())):
        counts = [5, 0, 3, 2][:world_size]
        tables = [tensor_of(r, 7, shape=(counts[r], *row)).mul(100).to(dtype) for r in range(world_size)]
        buf.engram_write(tables[rank].to(buf.device))
        hint = moe_comm.Buffer.get_engram_storage_size_hint(counts[rank], math.prod(row) * tables[rank].element_size())
        if backend == "cuda" and buf._prims._engram.tensor.numel() != hint:
            problems.append(f"engram region {buf._prims._engram.tensor.numel()} != {hint}")
        whole = torch.cat(tables)
        g = torch.Generator().manual_seed(rank)
        for n in (0, 1, 9):
            indices = torch.randint(0, whole.shape[0], (n,), generator=g)
            fetch = buf.engram_fetch(indices.to(buf.device))
            rows = fetch()
            if not (torch.equal(rows.cpu().view(torch.uint8), whole[indices].view(torch.uint8)) and fetch() is rows):
                problems.append(f"engram {dtype} {row} n={n}")
    total = sum([5, 0, 3, 2][:world_size])
    bad = torch.tensor([0, total] if rank == world_size - 1 else [1], device=buf.device)
    with pytest.raises(ValueError, match=rf"engram_fetch indices must be in \[0, {total}\) .*: rank {world_size - 1}: "
                                         rf"indices\[1\]={total}"):
        buf.engram_fetch(bad)
    with pytest.raises(TypeError, match="indices must be a 1-D torch.int64 tensor"):
        buf.engram_fetch(torch.zeros(2, dtype=torch.int32, device=buf.device))
    if world_size > 1:
        dtypes = str(["float64"] + ["float32"] * (world_size - 1))
        with pytest.raises(ValueError, match=r"ranks called engram_write with different arguments \(per rank\): "
                                             rf"table row dtype: {re.escape(dtypes)}"):
            buf.engram_write(torch.zeros(2, 4, dtype=torch.float32 if rank else torch.float64, device=buf.device))
    return problems


def test_size_hints():
    """Each region's bytes (the CUDA backend allocates these; tests/test_shared_gpu.py compares its regions): flags
    of 16 bytes per possible rank, slots rounded up to 256 bytes, two directions / parities; bad arguments named."""
    flags = 16 * moe_comm.layout.MAX_RANKS
    assert moe_comm.Buffer.get_pp_buffer_size_hint(1000, 3) == flags + 2 * 3 * 1024
    assert moe_comm.Buffer.get_pp_buffer_size_hint(1024, 1) == flags + 2 * 1024
    assert moe_comm.Buffer.get_engram_storage_size_hint(1000, 256) == 256_000
    assert moe_comm.Buffer.get_engram_storage_size_hint(0, 8) == 256
    with pytest.raises(ValueError, match="num_max_tensor_bytes=0 must be >= 1"):
        moe_comm.Buffer.get_pp_buffer_size_hint(0, 2)
    with pytest.raises(TypeError, match="num_max_inflight_tensors must be an int, got 1.5"):
        moe_comm.Buffer.get_pp_buffer_size_hint(64, 1.5)
    with pytest.raises(ValueError, match="num_rows=-1 must be >= 0"):
        moe_comm.Buffer.get_engram_storage_size_hint(-1, 8)


def agrs_hint_rank(rank: int, world_size: int) -> list[int]:
    return [moe_comm.Buffer.get_agrs_buffer_size_hint(None, n) for n in (1, 256, 257)]


def test_agrs_size_hint(pools):
    flags = 16 * moe_comm.layout.MAX_RANKS
    assert pools(2).run(agrs_hint_rank) == [[flags + 2 * 2 * 256, flags + 2 * 2 * 256, flags + 2 * 2 * 512]] * 2


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_engram(pools, world_size):
    assert pools(world_size).run(engram_rank) == [[]] * world_size


def pipeline_errors_rank(rank: int, world_size: int) -> list[str]:
    # A group of its own: the receive left posted by the timeout below must not meet another test's sends.
    group = dist.new_group(list(range(world_size)))
    buf = moe_comm.Buffer(group, num_max_tokens_per_rank=8, hidden=16, num_topk=2, backend="torch",
                          num_cpu_timeout_secs=2)
    messages = []
    with pytest.raises(RuntimeError, match=r"call pp_set_config\(num_max_tensor_bytes, num_max_inflight_tensors\)"):
        buf.pp_send(torch.zeros(2), (rank + 1) % world_size)
    with pytest.raises(ValueError, match=r"ranks called pp_set_config with different arguments \(per rank\): "
                                         r"num_max_inflight_tensors: \[1, 2"):
        buf.pp_set_config(64, rank + 1)
    buf.pp_set_config(64, 2)
    with pytest.raises(ValueError, match="t has 80 bytes, more than num_max_tensor_bytes=64"):
        buf.pp_send(torch.zeros(20), (rank + 1) % world_size)
    with pytest.raises(ValueError, match=rf"dst={rank} is not a ring neighbour of rank {rank} of {world_size}"):
        buf.pp_send(torch.zeros(2), rank)
    with pytest.raises(TypeError, match="src must be an int"):
        buf.pp_recv(torch.zeros(2), 1.0)
    # A peer that never sends: the receive ends in a TimeoutError naming rank, phase and peer; then every call of
    # that rank refuses before it exchanges anything (its peers are out of step).
    if rank == 0:
        with pytest.raises(TimeoutError) as info:
            buf.pp_recv(torch.zeros(2), world_size - 1)
        messages.append(str(info.value))
        for call in (lambda: buf.pp_set_config(64, 2), lambda: buf.all_gather(torch.zeros(2)),
                     lambda: buf.reduce_scatter(torch.zeros(world_size)), lambda: buf.engram_write(torch.zeros(2)),
                     lambda: buf.engram_fetch(torch.zeros(0, dtype=torch.int64)),
                     lambda: buf.pp_send(torch.zeros(2), 1)):
            with pytest.raises(RuntimeError, match="broken since an earlier error"):
                call()
    return messages


def test_pipeline_errors(pools):
    messages = pools(3).run(pipeline_errors_rank)
    assert "rank 0 pp_recv: receive from peer 2 did not complete within num_cpu_timeout_secs=2" in messages[0][0]


def pipeline_destroy_rank(rank: int, world_size: int) -> list[str]:
    """`destroy()` right after a ring of sends: the last rank receives late (a sleep), and every rank's tensor still
    arrives (destroy waits for this rank's sends to be received); then a send whose receiver never receives: the
    sender's destroy ends in the TimeoutError naming it, and releases the buffer all the same."""
    group = dist.new_group(list(range(world_size)))  # of its own: rank 1's last send is never received
    results = []
    for step in range(2):
        buf = moe_comm.Buffer(group, num_max_tokens_per_rank=8, hidden=16, num_topk=2, backend="torch",
                              num_cpu_timeout_secs=3)
        buf.pp_set_config(64, 2)
        if step == 0:
            buf.pp_send(tensor_of(rank, 0, (4,)), (rank + 1) % world_size)
            if rank == world_size - 1:
                time.sleep(1.0)
            out = torch.empty(4)
            buf.pp_recv(out, (rank - 1) % world_size)
            results.append(str(torch.equal(out, tensor_of((rank - 1) % world_size, 0, (4,)))))
            buf.destroy()
        elif rank == 1:
            buf.pp_send(tensor_of(rank, 1, (4,)), 0)
            with pytest.raises(TimeoutError) as info:
                buf.destroy()
            results.append(str(info.value).split(" did not")[0])
            with pytest.raises(RuntimeError, match="destroyed"):
                buf.all_gather(torch.zeros(2))
        else:
            buf.destroy()
    return results


def test_pipeline_destroy_waits_for_the_receivers(pools):
    results = pools(3).run(pipeline_destroy_rank)
    assert results == [["True"], ["True", "moe_comm: rank 1 pp_send: send to peer 0"], ["True"]], results


def grad_free_rank(rank: int, world_size: int, backend: str = "torch") -> list[bool]:
    """Outputs of the buffer's calls carry no autograd history, whatever their inputs require (as torch.distributed's;
    the reference once returned an all_gather whose own block had it: gradients of this rank's rows only)."""
    buf = make_buffer(backend=backend)
    dev = buf.device
    t = torch.randn(2 * world_size, 3, device=dev, requires_grad=True)
    x = torch.randn(4, 16, device=dev, dtype=torch.bfloat16, requires_grad=True)
    idx = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]], device=dev)
    w = torch.rand(4, 2, device=dev, requires_grad=True)
    recv_x, _, recv_w, handle, _ = buf.dispatch(x, idx, w, num_experts=4)
    outputs = [buf.all_gather(t)[0], buf.reduce_scatter(t)[0], recv_x, recv_w]
    outputs += buf.combine(recv_x.detach().requires_grad_(), handle, topk_weights=recv_w.detach().requires_grad_())[:2]
    return [o.requires_grad for o in outputs]


def test_outputs_carry_no_autograd_history(pools):
    assert pools(2).run(grad_free_rank) == [[False] * 6] * 2


def pipelines_of_many_buffers_rank(rank: int, world_size: int) -> list:
    """Two buffers' pipelines on one group keep apart (rank 1 receives the second buffer's tensor first), and a
    process making buffers with pipelines in a loop holds no more files after the first (each pipeline once made two
    gloo groups of its own, their connections never closed)."""
    a, b = make_buffer(), make_buffer()
    for buf in (a, b):
        buf.pp_set_config(num_max_tensor_bytes=64, num_max_inflight_tensors=2)
    if rank == 0:
        a.pp_send(tensor_of(rank, 0, (4,)), 1)
        b.pp_send(tensor_of(rank, 1, (4,)), 1)
    received = []
    if rank == 1:
        for buf, step in ((b, 1), (a, 0)):
            out = torch.empty(4)
            buf.pp_recv(out, 0)
            received.append(torch.equal(out, tensor_of(0, step, (4,))))
    a.destroy()
    b.destroy()
    files = []
    for step in range(12):
        buf = make_buffer()
        buf.pp_set_config(num_max_tensor_bytes=64, num_max_inflight_tensors=2)
        buf.pp_send(tensor_of(rank, step, (4,)), 1 - rank)
        out = torch.empty(4)
        buf.pp_recv(out, 1 - rank)
        received.append(torch.equal(out, tensor_of(1 - rank, step, (4,))))
        buf.destroy()
        files.append(len(os.listdir("/proc/self/fd")))
    return all(received), files[2:] == files[1:-1]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc")
def test_pipelines_of_many_buffers(pools):
    assert pools(2).run(pipelines_of_many_buffers_rank) == [(True, True)] * 2

