"""Where the time of a dispatch/combine goes: host issue time, device time per kernel, Python hot spots.

For each token count and op (dispatch with and without CPU sync, cached dispatch, combine) on the CUDA backend:
- host us/call: wall time of issuing calls back to back, divided by the count, the least of `--host-loops` loops
  of `--iters / --host-loops` calls (the GPU is not waited for, so for ops without a host sync this is the Python +
  launch cost alone; the lent hosts have slow spells of tens of milliseconds: for an A/B take many short loops, e.g.
  `--iters 2000 --host-loops 100`);
- stream us/call: CUDA-event time of the same loop per call (what the stream spends when the host is ahead);
- per kernel: mean device time from `torch.profiler` (CUPTI), with its share of the stream time.
At the smallest size also the host time of the pieces of a cached dispatch and a combine (checks, allocation, the
launcher crossing), the host time every op spends inside each launcher and in `torch.empty`, and a cProfile of
every op (top functions by own time). Rank 0 prints.
With `--variants`, instead: per kernel build variant (`unroll=N` sets MOE_COMM_COPY_UNROLL, `batch=N`
MOE_COMM_SEND_BATCH, `cbatch=N` MOE_COMM_COMBINE_BATCH, `chunk=N` MOE_COMM_RECV_CHUNK, `stages=N`
MOE_COMM_RECV_STAGES, `send=F` / `csend=F` the share of sending blocks of the dispatch / combine, `sms=N` the SM
count, `times=1` a build that records when each block ends, `expand=1` the expand layout), one bitwise check, then
the kernel times of a cached dispatch (BF16 and FP8), a combine and a fresh dispatch's layout kernel at the largest
token count.

The per-SM copy floor the kernels are measured against is benchmarks/microbench/copy_bench.cu.

    python scripts/profile_ops.py [--num-ranks 2] [--tokens 128 4096] [--iters 50] [--host-loops 5] [--out DIR]
                                  [--json FILE] [--ops-only] [--variants unroll=8,send=0.6 ...]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
import types
from collections import defaultdict

import torch

import moe_comm
from moe_comm import quant
from moe_comm.testing import parallel_launch
from moe_comm.testing.bench import least_host_us, loop_times, run_metadata
from moe_comm.testing.routing import Case, rank_inputs


def kernel_times(fn, iters: int) -> dict[str, float]:
    """Mean device us per call of every kernel that `fn` launches."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    totals = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            totals[evt.name[:60]] += evt.device_time / iters
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def block_times(buf, handle, ops: dict) -> list[str]:
    """When each block of one call of each op (name -> fn: dispatches and a combine) ended, in us after the first
    block started: senders and receivers apart, as min / median / max (a build with -DMOE_COMM_BLOCK_TIMES)."""
    import ctypes
    import statistics

    from moe_comm.backends.cuda import num_send_blocks

    lines = []
    num_blocks = handle.num_sms
    impl, tuning = buf._impl, buf._impl.tuning
    for name, fn in ops.items():
        op = "combine" if name == "combine" else "dispatch"
        fraction = tuning.combine_send_fraction if op == "combine" else tuning.dispatch_send_fraction
        num_send = num_send_blocks(op, num_blocks, buf.num_ranks, handle.do_expand, fraction)
        fn()
        torch.cuda.synchronize()
        raw = (ctypes.c_uint64 * (2 * num_blocks))()
        read = impl.kernels.combine_block_times if op == "combine" else impl.kernels.dispatch_block_times
        impl.kernels.check(read(raw, num_blocks), "block times", impl.rank)
        starts, ends = raw[0::2], raw[1::2]
        t0 = min(starts)
        parts = []
        for role, blocks in (("send", range(num_send)), ("recv", range(num_send, num_blocks))):
            done = sorted((ends[b] - t0) / 1e3 for b in blocks)
            begun = max((starts[b] - t0) / 1e3 for b in blocks)
            parts.append(f"{role} end {done[0]:.0f}/{statistics.median(done):.0f}/{done[-1]:.0f} us "
                         f"(last start {begun:.0f})")
        lines.append(f"        {name} blocks: " + ", ".join(parts))
    return lines


def layout_steps(buf, fresh) -> str:
    """When a fresh dispatch's layout kernel (one call of `fresh`) reached each step (layout.LAYOUT_STEPS), in
    us after its first block started: the blocks' median, then the notify's steps in the last block (a build with
    -DMOE_COMM_BLOCK_TIMES)."""
    import ctypes
    import statistics

    from moe_comm.layout import LAYOUT_BLOCK_STEPS, LAYOUT_STEPS

    impl, width = buf._impl, 1 + len(LAYOUT_STEPS)
    impl._shapes.clear()
    fresh()
    torch.cuda.synchronize()
    (plan,) = impl._shapes.values()
    num_blocks = plan.structs[1].num_blocks
    raw = (ctypes.c_uint64 * (width * num_blocks))()
    impl.kernels.check(impl.kernels.layout_step_times(raw, num_blocks), "layout step times", impl.rank)
    rows = [raw[b * width:(b + 1) * width] for b in range(num_blocks)]
    t0 = min(row[0] for row in rows)
    (last,) = [row for row in rows if row[-1]]
    us = lambda t: (t - t0) / 1e3  # noqa: E731
    parts = [f"{name} {statistics.median(us(row[i]) for row in rows):.1f}"
             for i, name in enumerate(LAYOUT_STEPS[:LAYOUT_BLOCK_STEPS], 1)]
    parts += [f"{name} {us(last[i]):.1f}"
              for i, name in enumerate(LAYOUT_STEPS[LAYOUT_BLOCK_STEPS:], 1 + LAYOUT_BLOCK_STEPS)]
    return f"        layout steps ({num_blocks} blocks, us, medians then the last block): " + ", ".join(parts)


def variants_rank(rank: int, world_size: int, args: dict) -> str:
    from moe_comm.backends.cuda import CudaTuning
    from moe_comm.testing.checks import check_case

    device = torch.device("cuda", rank)
    E, K, hidden, num_tokens = 256, 8, 7168, max(args["tokens"])
    case = Case(seed=2, num_ranks=world_size, num_experts=E, num_topk=K, hidden=hidden,
                num_tokens=(num_tokens,) * world_size, num_max_tokens_per_rank=num_tokens, drop_prob=0.0)
    expand_case = Case(**{**case.__dict__, "do_expand": True})
    lines = [f"{num_tokens} tokens, kernel us per call (cached dispatch | cached dispatch fp8 | combine | layout of a "
             f"fresh dispatch)"]
    for variant in args["variants"]:
        settings = dict(item.split("=") for item in variant.split(","))
        tuning = CudaTuning(
            kernel_flags=(f"-DMOE_COMM_COPY_UNROLL={settings.get('unroll', 8)}",
                          f"-DMOE_COMM_SEND_BATCH={settings.get('batch', 4)}",
                          f"-DMOE_COMM_COMBINE_BATCH={settings.get('cbatch', 1)}",
                          f"-DMOE_COMM_RECV_CHUNK={settings.get('chunk', 8192)}",
                          f"-DMOE_COMM_RECV_STAGES={settings.get('stages', 2)}",
                          *(["-DMOE_COMM_BLOCK_TIMES"] if settings.get("times") else [])),
            dispatch_send_fraction=float(settings["send"]) if "send" in settings else None,
            combine_send_fraction=float(settings["csend"]) if "csend" in settings else None)
        num_sms, expand = int(settings.get("sms", 0)), bool(int(settings.get("expand", 0)))
        buf = moe_comm.Buffer(None, num_max_tokens_per_rank=num_tokens, hidden=hidden, num_topk=K,
                              use_fp8_dispatch=True, backend="cuda", cuda_tuning=tuning)
        try:
            check_case(buf, expand_case if expand else case, rank)
            x, idx, w = rank_inputs(case, rank, device)
            recv_x, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=E, num_sms=num_sms, do_expand=expand)
            x_fp8 = quant.quantize(x, "fp8_block128")
            handle_fp8 = buf.dispatch(x_fp8, idx, w, num_experts=E, num_sms=num_sms, do_expand=expand)[3]
            ops = {"cached dispatch": lambda: buf.dispatch(x, handle=handle, do_expand=expand),
                   "cached dispatch fp8": lambda: buf.dispatch(x_fp8, handle=handle_fp8, do_expand=expand),
                   "combine": lambda: buf.combine(recv_x, handle)}
            times = [sum(kernel_times(fn, args["iters"]).values()) for fn in ops.values()]
            fresh = kernel_times(lambda: buf.dispatch(x, idx, w, num_experts=E, num_sms=num_sms, do_cpu_sync=False,
                                                      do_expand=expand), args["iters"])
            times.append(sum(us for name, us in fresh.items() if "layout" in name))
            lines.append(f"    {variant:30s} " + " | ".join(f"{us:8.1f}" for us in times) +
                         f"   (SMs {handle.num_sms})")
            if settings.get("times"):
                lines += block_times(buf, handle, ops)
                for sync in (False, True):
                    lines.append(layout_steps(buf, lambda: buf.dispatch(x, idx, w, num_experts=E, num_sms=num_sms,
                                                                        do_cpu_sync=sync, do_expand=expand)))
        except RuntimeError as exc:  # e.g. a build whose kernels need more registers than a launch allows
            lines.append(f"    {variant:30s} failed: {exc}")
        if rank == 0:
            print(lines[-1], flush=True)
        buf.destroy()
    return "\n".join(lines)


def host_us(fn, iters: int, loops: int) -> float:
    """`least_host_us` of `fn` from an idle device (the GPU is not waited for inside the loops)."""
    torch.cuda.synchronize()
    least = least_host_us(fn, iters, loops)
    torch.cuda.synchronize()
    return least


def host_breakdown(buf, x, idx, w, num_experts: int, handle, recv_x, iters: int, loops: int) -> list[str]:
    """Host us per call of the pieces of a fresh dispatch without CPU sync, a cached dispatch and a combine: argument
    checks, the kernel library's launchers called alone through ctypes (a launch without allocations or views), the
    host extension's crossing (allocations, views, launches), the whole call; torch baselines beside them."""
    impl, dev = buf._impl, x.device
    lib = impl.kernels
    # The launchers alone run along the structs as these calls set them: their tensors stay alive meanwhile.
    impl._shapes.clear()  # then the fresh dispatch's launch structs are the only ones
    fresh = buf.dispatch(x, idx, w, num_experts=num_experts, do_cpu_sync=False)
    (fplan,) = impl._shapes.values()
    cached = buf.dispatch(x, handle=handle)
    buf.combine(recv_x, handle)
    (dplan,) = [p for k, p in impl._plans[handle].items() if k[0] == "dispatch"]
    (cplan,) = [p for k, p in impl._plans[handle].items() if k[0] == "combine"]
    stream = torch.cuda.current_stream(dev).cuda_stream
    sms = handle.num_sms
    params, layout_args, notify, inputs, outputs = fplan.structs
    pieces = {
        "fresh dispatch without CPU sync: checks (Buffer._validate_dispatch)": lambda: buf._validate_dispatch(
            x, idx, w, num_experts, None, 1, 0, None, False, False, None, False, None, False, False, False),
        "fresh dispatch: layout launcher alone (ctypes; a cooperative launch)": lambda: lib.layout(
            params, layout_args, notify, stream),
        "fresh dispatch: dispatch launcher alone (ctypes)": lambda: lib.dispatch(params, inputs, outputs, sms, 0, 0,
                                                                                  stream),
        "cached dispatch: launcher alone (ctypes)": lambda: lib.dispatch(*dplan.structs, sms, 1, 0, stream),
        "fresh dispatch without CPU sync: host extension (allocations, both launches)": lambda: impl.launcher
        .layout_dispatch(*fplan.addresses, idx, x, None, w, fplan.offsets_address, 0, 1, fplan.num_rows,
                         fplan.num_expand_rows, False, 0, 0, sms, 0, stream),
        "fresh dispatch without CPU sync: whole call": lambda: buf.dispatch(x, idx, w, num_experts=num_experts,
                                                                            do_cpu_sync=False),
        "cached dispatch: checks (Buffer._validate_dispatch)": lambda: buf._validate_dispatch(
            x, None, None, None, None, 1, 0, handle, None, handle.do_expand, None, False, None, False, False, False),
        "torch.empty from Python (one output)": lambda: torch.empty(handle.num_recv_rows, x.shape[1], dtype=x.dtype,
                                                                    device=dev),
        "cached dispatch: host extension (allocation, launch)": lambda: impl.launcher.cached_dispatch(
            *dplan.addresses, x, None, 0, 0, handle.num_recv_rows, sms, 0, stream),
        "cached dispatch: whole call": lambda: buf.dispatch(x, handle=handle),
        "combine: checks (Buffer._validate_combine)": lambda: buf._validate_combine(
            recv_x, handle, None, None, 0, None, False, False, False),
        "combine: host extension (allocation, launch)": lambda: impl.launcher.combine(
            *cplan.addresses, recv_x, None, None, None, handle.num_tokens, 1, cplan.num_slots, cplan.num_rounds,
            False, sms, 0, stream),
        "combine: whole call": lambda: buf.combine(recv_x, handle),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(dev),
        "a small torch kernel from Python (t.add_(1))": lambda: recv_x[:1].add_(1),
    }
    lines = [f"\nhost us per call, {x.shape[0]} tokens (the least of {loops} loops of {iters // loops} calls each):"]
    for name, fn in pieces.items():
        lines.append(f"    {host_us(fn, iters, loops):8.1f}  {name}")
    del fresh, cached
    return lines


def host_pieces(impl, fn, iters: int) -> dict[str, float]:
    """Host us per call of `fn` spent inside each host extension call (allocation and launch, which cProfile
    books to the caller) and in `torch.empty` from Python, and the whole call."""
    spent: dict[str, float] = defaultdict(float)

    def timed(name: str, f):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t
        return wrapper

    launcher, empty = impl.launcher, torch.empty
    impl.launcher = types.SimpleNamespace(**{name: timed(f"{name} (host extension)", getattr(launcher, name))
                                             for name in ("layout_dispatch", "cached_dispatch", "combine")})
    torch.empty = timed("torch.empty", empty)
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        spent["whole call"] = time.perf_counter() - t0
    finally:
        impl.launcher, torch.empty = launcher, empty
    torch.cuda.synchronize()
    return {name: seconds * 1e6 / iters for name, seconds in spent.items()}


def cprofile(fn, iters: int, title: str, top: int = 14) -> str:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return f"\ncProfile, {title}, {iters} calls:\n{text.getvalue()}"


def profile_rank(rank: int, world_size: int, args: dict) -> tuple[str, list[dict]]:
    """The report's text and its rows (`--json`): per token count and op, host and stream us per call and the
    device us of each kernel."""
    device = torch.device("cuda", rank)
    E, K, hidden = 256, 8, 7168
    cap = max(args["tokens"])
    buf = moe_comm.Buffer(None, num_max_tokens_per_rank=cap, hidden=hidden, num_topk=K, backend="cuda")
    iters, lines, rows = args["iters"], [], []
    for num_tokens in args["tokens"]:
        case = Case(seed=2, num_ranks=world_size, num_experts=E, num_topk=K, hidden=hidden,
                    num_tokens=(num_tokens,) * world_size, num_max_tokens_per_rank=cap, drop_prob=0.0)
        x, idx, w = rank_inputs(case, rank, device)
        recv_x, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=E)
        ops = {"dispatch": lambda: buf.dispatch(x, idx, w, num_experts=E),
               "dispatch without CPU sync": lambda: buf.dispatch(x, idx, w, num_experts=E, do_cpu_sync=False),
               "cached dispatch": lambda: buf.dispatch(x, handle=handle),
               "combine": lambda: buf.combine(recv_x, handle)}
        for name, fn in ops.items():
            for _ in range(3):
                fn()
            host, stream = loop_times(fn, iters, device, args["host_loops"])
            lines.append(f"\n{num_tokens} tokens, {name}: host {host:.1f} us/call, stream {stream:.1f} us/call")
            kernels = kernel_times(fn, iters)
            for kernel, us in kernels.items():
                lines.append(f"    {us:9.1f} us  {100 * us / stream:5.1f}%  {kernel}")
            rows.append({"tokens": num_tokens, "op": name, "host_us": round(host, 2), "stream_us": round(stream, 2),
                         "kernel_us": {kernel.split("(")[0]: round(us, 2) for kernel, us in kernels.items()}})
        if num_tokens == min(args["tokens"]) and not args["ops_only"]:
            lines += host_breakdown(buf, x, idx, w, E, handle, recv_x, max(200, 4 * args["host_loops"]),
                                    args["host_loops"])
            for name, fn in ops.items():
                pieces = host_pieces(buf._impl, fn, iters)
                lines.append(f"\nhost us per call inside, {name} at {num_tokens} tokens: " +
                             ", ".join(f"{piece} {us:.1f}" for piece, us in pieces.items()))
            for name, fn in ops.items():
                lines.append(cprofile(fn, iters, f"{name} at {num_tokens} tokens"))
    buf.destroy()
    return "\n".join(lines), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-ranks", type=int, default=2, help="ranks, one GPU each")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--host-loops", type=int, default=5, help="host us: the least of this many loops")
    parser.add_argument("--out", default=None, help="also write the report to DIR/profile.txt")
    parser.add_argument("--variants", nargs="*", default=None, help="kernel build variants to compare")
    parser.add_argument("--json", default=None, help="write the op rows and the run's metadata to this file")
    parser.add_argument("--ops-only", action="store_true",
                        help="only the public-API op timings (no host breakdown): runs against an older moe_comm "
                             "too (PYTHONPATH), for before/after comparisons in one sitting")
    args = parser.parse_args()
    if args.host_loops < 1 or args.iters < args.host_loops:
        parser.error(f"--host-loops={args.host_loops} must be >= 1 and at most --iters={args.iters}")
    if args.variants and args.json:
        parser.error("--json records the op rows, which a --variants run does not make (its report: --out)")
    if not 1 <= args.num_ranks <= torch.cuda.device_count():
        parser.error(f"--num-ranks={args.num_ranks} needs as many GPUs (the CUDA backend over NCCL; this machine has "
                     f"{torch.cuda.device_count()})")
    options = {"tokens": args.tokens, "iters": args.iters, "host_loops": args.host_loops, "variants": args.variants,
               "ops_only": args.ops_only}
    if args.variants:
        report = parallel_launch(args.num_ranks, variants_rank, options, backend="nccl", timeout_s=600)[0]
    else:
        report, rows = parallel_launch(args.num_ranks, profile_rank, options, backend="nccl", timeout_s=600)[0]
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"metadata": run_metadata(sys.argv), "rows": rows}, f, indent=1)
    print(report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "profile.txt"), "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
