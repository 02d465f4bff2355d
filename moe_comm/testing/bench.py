"""Benchmark helpers: timers (one isolated call, on CPU and CUDA; back-to-back calls, on CUDA), the NCCL/gloo
baseline that every benchmark table prints beside moe_comm, and the run metadata every result records.

The baseline is what Megatron's alltoall dispatcher does with `torch.distributed`: dedup each token per
destination rank, permute rows into rank order, exchange counts with a host sync, `all_to_all_single` the
rows; combine is the reverse `all_to_all_single` plus an FP32 `index_add_` on the source.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

import moe_comm
from moe_comm import env


def _git(repo_dir: pathlib.Path, *args: str) -> str | None:
    """Output of `git -C repo_dir args`, or None when git is missing, fails or hangs."""
    try:
        done = subprocess.run(["git", "-C", str(repo_dir), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def run_metadata(argv: Sequence[str], repo_dir: str | pathlib.Path | None = None) -> dict:
    """What a result needs beside its numbers to be found again and reproduced (DESIGN section 8.5).

    Reads the commit only from a checkout whose top level is `repo_dir` itself: an installed copy inside some
    other repository (a venv in a checkout) must not report that repository's commit. Never raises.

    Arguments:
        argv: the command line of the run (`sys.argv`), recorded shell-quoted after the interpreter's name.
        repo_dir: the checkout to read the commit from; default: the one holding this `moe_comm` package.

    Returns:
        a JSON-ready dict: `commit` (full hash) and `dirty` (tracked files changed), both None outside a checkout;
        `moe_comm`, `torch`, `cuda` (`torch.version.cuda`, None on CPU builds), `nccl` ("2.28.9", None without
        CUDA), `python`, `gpu` (name of device 0, None without CUDA), `num_gpus`, `hostname`, `date_utc`
        (ISO 8601, seconds) and `command`.
    """
    repo = pathlib.Path(repo_dir if repo_dir is not None else pathlib.Path(moe_comm.__file__).parents[1]).resolve()
    commit = dirty = None
    top = _git(repo, "rev-parse", "--show-toplevel")
    if env.get_str("MOE_COMM_COMMIT"):  # a copied tree whose git history is missing or stale (device machines)
        commit, dirty = env.get_str("MOE_COMM_COMMIT"), None
    elif top is not None and pathlib.Path(top).resolve() == repo:
        commit = _git(repo, "rev-parse", "HEAD")
        status = _git(repo, "status", "--porcelain", "--untracked-files=no")
        dirty = None if commit is None or status is None else bool(status)
    cuda = torch.cuda.is_available()
    nccl = None
    if cuda:
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except (AttributeError, RuntimeError):
            pass  # a torch built without NCCL
    return {"commit": commit, "dirty": dirty, "moe_comm": moe_comm.__version__, "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": nccl, "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "num_gpus": torch.cuda.device_count() if cuda else 0, "hostname": socket.gethostname(),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join([pathlib.Path(sys.executable).name, *argv])}


def record_parser(doc: str) -> argparse.ArgumentParser:
    """A microbenchmark's argument parser (its description: `doc`'s first paragraph) with `--json` and `--md`, where
    `write_record` puts its record."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="write the record here (plot: scripts/plot_results.py)")
    parser.add_argument("--md", default=None, help="write the record's table here")
    return parser


def write_record(record: dict, markdown: str, args: argparse.Namespace) -> None:
    """Print a record's markdown and write it and the record's JSON where `args` (`record_parser`) say."""
    print(markdown, flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    if args.md:
        pathlib.Path(args.md).write_text(markdown)


def candidates_markdown(record: dict, about: str) -> str:
    """A microbenchmark's candidates record as markdown: title, run metadata, `about` (a paragraph), then a row per
    timing and per case its us, its multiple of the case's floor and its largest difference from the reference
    (blank where not compared or not timed). `record["cases"]`: each with `case`, `floor_us`, `us` and `max_diff`
    (name -> value); `scripts/plot_results.py` draws the same record."""
    meta, cases = record["meta"], record["cases"]
    lines = [f"# {record['title']}", "", f"commit {meta['commit']}, {meta['gpu']}, torch {meta['torch']}, CUDA "
             f"{meta['cuda']}, Python {meta['python']}, {meta['date_utc']}", "", f"command: `{meta['command']}`", "",
             textwrap.fill(about, width=120), ""]
    lines.append("| | " + " | ".join(f"{c['case']} us | x floor | max diff" for c in cases) + " |")
    lines.append("|---|" + "---|---|---|" * len(cases))
    for name in dict.fromkeys(k for c in cases for k in c["us"]):
        cells = []
        for c in cases:
            us, diff = c["us"].get(name), c["max_diff"].get(name)
            cells += ["" if us is None else f"{us:.0f}", "" if us is None else f"{us / c['floor_us']:.2f}",
                      "" if diff is None else f"{diff:g}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| floor | " + " | ".join(f"{c['floor_us']:.0f} | 1.00 | " for c in cases) + " |")
    return "\n".join(lines) + "\n"


def median_time_us(fn: Callable[[], object], device: torch.device, num_warmups: int = 3,
                   num_iters: int = 20) -> float:
    """Median wall time of `fn` in microseconds over `num_iters` runs, ranks aligned by a barrier each time (when a
    process group is initialized; a single process times alone).

    CUDA runs are timed with events on the current stream; CPU runs with `time.perf_counter`.
    """
    barrier = dist.barrier if dist.is_initialized() else (lambda: None)
    for _ in range(num_warmups):
        fn()
    times = []
    for _ in range(num_iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            barrier()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def least_host_us(fn: Callable[[], object], iters: int, loops: int = 5) -> float:
    """Host wall time per call of `fn` issued back to back, the least over `loops` loops of `iters // loops` calls (at
    least one): the lent machines' host speed drifts by up to 1.5x within a minute (other tenants; slow spells of tens
    of milliseconds), the least loop is the cost of the path itself. More, shorter loops over more calls find a quiet
    spell more surely."""
    if loops < 1:
        raise ValueError(f"loops={loops} must be >= 1")
    per_loop, least = max(1, iters // loops), float("inf")
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(per_loop):
            fn()
        least = min(least, (time.perf_counter() - t0) * 1e6 / per_loop)
    return least


def loop_times(fn: Callable[[], object], iters: int, device: torch.device,
               host_loops: int = 5) -> tuple[float, float]:
    """(host us per call, stream us per call) of `iters` back-to-back calls on CUDA.

    Host: `least_host_us` over `host_loops` loops (the GPU is not waited for). Stream: CUDA-event time of one loop of
    `iters` with the stream kept busy first for longer than the host needs to issue it, so it is the device's time
    per call (what DeepEP's benchmark reports), host gaps left only where a call waits for the GPU (a CPU sync).
    """
    torch.cuda.synchronize(device)
    host = least_host_us(fn, iters, host_loops)
    # Every rank sleeps as long as the slowest host needs: with sleeps of their own lengths, the rank that woke
    # first would count the wait for the other in its first call.
    slowest = torch.tensor([host], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    torch.cuda.synchronize(device)
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    # About 2000 clock cycles per us; 3x the least host time covers its drift.
    torch.cuda._sleep(int(slowest.item() * iters * 3 * 2000) + 100_000)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return host, start.elapsed_time(end) * 1e3 / iters


class AllToAllBaseline:
    """Megatron-style dispatch/combine over `all_to_all_single` (the comparison every table carries).

    Arguments:
        group: the process group.
        num_experts: global expert count (a multiple of the group size).
    """

    def __init__(self, group, num_experts: int) -> None:
        self.group = group
        self.num_ranks = dist.get_world_size(group)
        self.num_local_experts = num_experts // self.num_ranks

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor):
        """Returns `(recv_x, state)`; `state` is what `combine` needs."""
        R = self.num_ranks
        dest = torch.where(topk_idx >= 0, topk_idx // self.num_local_experts, R)
        in_rank = torch.zeros(x.shape[0], R + 1, dtype=torch.bool, device=x.device)
        in_rank.scatter_(1, dest, True)
        in_rank = in_rank[:, :R]
        # Rows in destination-rank order, tokens ascending inside each rank.
        rank_major = in_rank.t().nonzero()
        token_idx = rank_major[:, 1]
        send_counts = in_rank.sum(0)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        send_x = x.index_select(0, token_idx)
        recv_x = x.new_empty(sum(recv_splits), x.shape[1])
        dist.all_to_all_single(recv_x, send_x, recv_splits, send_splits, group=self.group)
        return recv_x, (token_idx, send_splits, recv_splits, x.shape[0])

    def combine(self, y: torch.Tensor, state) -> torch.Tensor:
        token_idx, send_splits, recv_splits, num_tokens = state
        back = y.new_empty(sum(send_splits), y.shape[1])
        dist.all_to_all_single(back, y, send_splits, recv_splits, group=self.group)
        acc_dtype = torch.float64 if y.dtype == torch.float64 else torch.float32
        out = torch.zeros(num_tokens, y.shape[1], dtype=acc_dtype, device=y.device)
        out.index_add_(0, token_idx, back.to(acc_dtype))
        return out.to(y.dtype)
