"""Launcher for multi-rank tests and scripts.

Ports are never guessed: the parent opens the rendezvous store on port 0 and hands the port it got to the ranks.

Ranks are forked from multiprocessing's fork server, which imports torch once per parent process: a rank then
starts in ~0.1 s, where a spawned one imports torch itself (~2.5 s of CPU each on a 2-core CI machine, so 8 ranks
took ~20 s). A fresh interpreter runs the server, so no parent state (CUDA, gloo, threads) is forked; moe_comm is
imported by each rank (from the parent's sys.path, so a script's own copy is the one used). What differs from
spawned ranks:
- Each rank sets the parent's environment as it was at the pool's start (its first `run`) before anything else;
  modules imported while unpickling the rank's entry point (the parent's `__main__`, the target's module) see the
  server's.
- The ranks share the server's stdout/stderr (those of the parent when the server started) and its string hash
  seed (the same set iteration order on every rank).
- The ranks share the machine's cores: each runs `torch.set_num_threads(cores // world_size)` (at least 1) unless
  `OMP_NUM_THREADS` is set, since idle intra-op threads that spin on cores another rank needs made a small gloo
  dispatch + combine 2.5x slower (4x the CPU time) with 2 ranks of 2 threads on 2 cores.

`WorkerPool(world_size)` starts the ranks once (one process each, gloo on CPU or NCCL with one GPU per rank),
then runs many functions on them: `pool.run(fn, *args)` calls `fn(rank, world_size, *args)` on every rank
and returns the per-rank results. Draw random cases in the parent and pass them as `args`, so every rank runs
the same case and no case pays for a start.

On the first failure (an exception on any rank, a rank that dies, or the overall timeout) every rank is killed
at once and `RankFailure` carries the failing rank's traceback; the next `run` starts a fresh group.
Collectives inside the workers use a short process-group timeout (`MOE_COMM_TEST_TIMEOUT`, default 60 s)
instead of gloo's 30 minutes.
"""

from __future__ import annotations

import atexit
import datetime
import os
import queue
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import env


# What the fork server imports before it forks any rank: torch, and torch._dynamo, which moe_comm's import pulls in
# (2 of its 2.2 s); not moe_comm itself (the server does not use the parent's sys.path: it could import another copy).
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]


def process_context():
    """The multiprocessing context the ranks start from: the fork server, with torch imported in it (module
    docstring). A child started from it has the server's environment and stdout/stderr, not the parent's at
    its start: pass `dict(os.environ)` to it where that matters (the ranks get it), and redirect its output where a
    test reads it (pytest's capfd does not see it)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (first child of this process)
    return ctx


class RankFailure(RuntimeError):
    """A rank raised, died or timed out; the message holds its traceback."""


def _worker_main(rank: int, world_size: int, backend: str, store_port: int, pg_timeout_s: float,
                 environ: dict[str, str], tasks: "mp.Queue", results: "mp.Queue") -> None:
    os.environ.clear()
    os.environ.update(environ)
    try:
        threads = environ.get("OMP_NUM_THREADS")
        torch.set_num_threads(int(threads) if threads else max(1, len(os.sched_getaffinity(0)) // world_size))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", store_port, world_size + 1, is_master=False,
                              timeout=datetime.timedelta(seconds=pg_timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, "ok", fn(rank, world_size, *args)))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
            # Peers may be blocked in a collective with us; the parent kills the group.
            time.sleep(3600)
    dist.destroy_process_group()


class WorkerPool:
    """A long-lived group of `world_size` ranks.

    Arguments:
        world_size: number of ranks.
        backend: "gloo" (CPU) or "nccl" (rank i on cuda:i); default gloo.
        timeout_s: default wall-clock limit of one `run`.
    """

    def __init__(self, world_size: int, backend: str = "gloo", timeout_s: float = 300.0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r} must be 'gloo' or 'nccl'")
        if backend == "nccl" and torch.cuda.device_count() < world_size:
            raise ValueError(f"backend='nccl' with world_size={world_size} needs as many GPUs, "
                             f"found {torch.cuda.device_count()}")
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self._procs: list = []
        self._tasks: list = []
        self._results = None
        self._store = None
        atexit.register(self.close)

    def _spawn(self) -> None:
        ctx = process_context()
        self._store = dist.TCPStore("127.0.0.1", 0, self.world_size + 1, is_master=True, wait_for_workers=False)
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        pg_timeout_s = env.get_float("MOE_COMM_TEST_TIMEOUT")
        self._procs = [ctx.Process(target=_worker_main, daemon=True,
                                   args=(r, self.world_size, self.backend, self._store.port, pg_timeout_s,
                                         dict(os.environ), self._tasks[r], self._results))
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: Optional[float] = None) -> list[Any]:
        """Run `fn(rank, world_size, *args)` on every rank; return the results in rank order."""
        if not self._procs:
            self._spawn()
        for q in self._tasks:
            q.put((fn, args))
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        results: dict[int, Any] = {}
        while len(results) < self.world_size:
            try:
                rank, status, value = self._results.get(timeout=0.1)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    codes = [self._procs[r].exitcode for r in dead]
                    self.close()
                    raise RankFailure(f"{getattr(fn, '__name__', fn)}: rank(s) {dead} died (exit codes {codes})")
                if time.monotonic() > deadline:
                    self.close()
                    raise RankFailure(f"{getattr(fn, '__name__', fn)}: ranks {sorted(set(range(self.world_size)) - set(results))} "
                                      f"did not finish within {timeout_s or self.timeout_s:g} s")
                continue
            if status == "error":
                self.close()
                raise RankFailure(f"{getattr(fn, '__name__', fn)} failed on rank {rank}:\n{value}")
            results[rank] = value
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Kill every rank now (idempotent)."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        self._procs = []
        self._tasks = []
        self._store = None

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def parallel_launch(world_size: int, fn: Callable[..., Any], *args: Any, backend: str = "gloo",
                    timeout_s: float = 300.0) -> list[Any]:
    """Spawn `world_size` ranks, run `fn(rank, world_size, *args)` on each, tear down; per-rank results."""
    with WorkerPool(world_size, backend=backend, timeout_s=timeout_s) as pool:
        return pool.run(fn, *args)


__all__ = ["RankFailure", "WorkerPool", "parallel_launch", "process_context"]
