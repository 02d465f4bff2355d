"""Where the time of a dispatch/combine goes: host issue time, device time per kernel, Python hot spots.

For each token count and op (dispatch with CPU sync, cached dispatch, combine) on the CUDA backend:
- host us/call: wall time of issuing `--iters` calls back to back, divided by the count (the GPU is not waited
  for, so for ops without a host sync this is the Python + launch cost alone);
- stream us/call: CUDA-event time of the same loop per call (what the stream spends when the host is ahead);
- per kernel: mean device time from `torch.profiler` (CUPTI), with its share of the stream time.
Then a cProfile of the dispatch with CPU sync at the smallest size (top functions by own time). Rank 0 prints.
With `--variants`, instead: per kernel build variant (`unroll=N` sets MOE_COMM_COPY_UNROLL, `batch=N`
MOE_COMM_SEND_BATCH, `cbatch=N` MOE_COMM_COMBINE_BATCH, `chunk=N` MOE_COMM_RECV_CHUNK, `stages=N`
MOE_COMM_RECV_STAGES, `send=F` / `csend=F` the share of sending blocks of the dispatch / combine, `sms=N` the SM
count, `times=1` a build that records when each block ends), one bitwise check, then the kernel times of a cached
dispatch (BF16 and FP8) and a combine at the largest token count.

With `--copy-ceiling`, instead: the plain grid-stride block copy of the transport (`copy_blocks`: every rank
writes one block to every rank, its own included, as a dispatch does) with 1 to 48 blocks, as GB/s per SM: the
per-SM floor the dispatch and combine kernels are measured against.

    python scripts/profile_ops.py [--num-ranks 2] [--tokens 128 4096] [--iters 50] [--out DIR]
                                  [--variants unroll=8,send=0.6 ...] [--copy-ceiling]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
from collections import defaultdict

import torch

import moe_comm
from moe_comm import quant
from moe_comm.testing import parallel_launch
from moe_comm.testing.bench import loop_times
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

    from moe_comm.backends import cuda as cuda_backend

    lines = []
    num_blocks = handle.num_sms
    for name, fn in ops.items():
        kernel = 1 if name == "combine" else 0
        num_send = cuda_backend._num_send_blocks("combine" if kernel else "dispatch", num_blocks, buf.num_ranks,
                                                 handle.do_expand)
        fn()
        torch.cuda.synchronize()
        raw = (ctypes.c_uint64 * (2 * num_blocks))()
        buf._impl._check(buf._impl.lib.moe_comm_block_times(kernel, raw, num_blocks), "block times")
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


def variants_rank(rank: int, world_size: int, args: dict) -> str:
    from moe_comm.backends import cuda as cuda_backend
    from moe_comm.testing.checks import check_case

    device = torch.device("cuda", rank)
    E, K, hidden, num_tokens = 256, 8, 7168, max(args["tokens"])
    case = Case(seed=2, num_ranks=world_size, num_experts=E, num_topk=K, hidden=hidden,
                num_tokens=(num_tokens,) * world_size, num_max_tokens_per_rank=num_tokens, drop_prob=0.0)
    lines = [f"{num_tokens} tokens, kernel us per call (cached dispatch | cached dispatch fp8 | combine)"]
    for variant in args["variants"]:
        settings = dict(item.split("=") for item in variant.split(","))
        cuda_backend.KERNEL_FLAGS = (f"-DMOE_COMM_COPY_UNROLL={settings.get('unroll', 8)}",
                                     f"-DMOE_COMM_SEND_BATCH={settings.get('batch', 4)}",
                                     f"-DMOE_COMM_COMBINE_BATCH={settings.get('cbatch', 1)}",
                                     f"-DMOE_COMM_RECV_CHUNK={settings.get('chunk', 8192)}",
                                     f"-DMOE_COMM_RECV_STAGES={settings.get('stages', 2)}",
                                     *(["-DMOE_COMM_BLOCK_TIMES"] if settings.get("times") else []))
        cuda_backend.SEND_FRACTION = {op: float(settings[key]) for op, key in (("dispatch", "send"),
                                                                               ("combine", "csend"))
                                      if key in settings}
        num_sms = int(settings.get("sms", 0))
        buf = moe_comm.Buffer(None, num_max_tokens_per_rank=num_tokens, hidden=hidden, num_topk=K,
                              use_fp8_dispatch=True, backend="cuda")
        try:
            check_case(buf, case, rank)
            x, idx, w = rank_inputs(case, rank, device)
            recv_x, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=E, num_sms=num_sms)
            x_fp8 = quant.quantize(x, "fp8_block128")
            handle_fp8 = buf.dispatch(x_fp8, idx, w, num_experts=E, num_sms=num_sms)[3]
            ops = {"cached dispatch": lambda: buf.dispatch(x, handle=handle),
                   "cached dispatch fp8": lambda: buf.dispatch(x_fp8, handle=handle_fp8),
                   "combine": lambda: buf.combine(recv_x, handle)}
            # The operation's own kernel (the barrier's time is the ranks' skew, not the kernel's).
            times = [sum(us for name, us in kernel_times(fn, args["iters"]).items() if "signal_wait" not in name)
                     for fn in ops.values()]
            lines.append(f"    {variant:30s} " + " | ".join(f"{us:8.1f}" for us in times) +
                         f"   (SMs {handle.num_sms})")
            if settings.get("times"):
                lines += block_times(buf, handle, ops)
        except RuntimeError as exc:  # e.g. a build whose kernels need more registers than a launch allows
            lines.append(f"    {variant:30s} failed: {exc}")
        if rank == 0:
            print(lines[-1], flush=True)
        buf.destroy()
    return "\n".join(lines)


def copy_ceiling_rank(rank: int, world_size: int, args: dict) -> str:
    import ctypes

    from moe_comm.backends import cuda as cuda_backend

    device = torch.device("cuda", rank)
    hidden, num_tokens = 7168, max(args["tokens"])
    buf = moe_comm.Buffer(None, num_max_tokens_per_rank=num_tokens, hidden=hidden, num_topk=8, backend="cuda")
    impl = buf._impl
    width = hidden * 2
    send = torch.randn(world_size * num_tokens, hidden, device=device).to(torch.bfloat16)
    stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
    params = cuda_backend._BlockCopyParams(send.data_ptr(), 0, impl.symm.buffer_ptrs_dev, width, num_tokens, 0,
                                           num_tokens, cuda_backend.CONTROL_BYTES, rank, world_size)
    total = world_size * num_tokens * width  # bytes this rank writes (its own block included)
    lines = [f"copy_blocks: {world_size} x {num_tokens} rows of {width} B per rank ({total / 1e6:.1f} MB, "
             f"{(world_size - 1) * num_tokens * width / 1e6:.1f} MB over NVLink)"]
    for num_blocks in (1, 2, 4, 8, 11, 16, 22, 32, 48):
        def launch() -> None:
            impl._check(impl.lib.moe_comm_copy_blocks(ctypes.byref(params), num_blocks, cuda_backend.COPY_THREADS,
                                                      stream), "copy")

        us = sum(kernel_times(launch, args["iters"]).values())
        lines.append(f"    {num_blocks:3d} blocks: {us:8.1f} us, {total / us / 1e3:7.1f} GB/s, "
                     f"{total / us / 1e3 / num_blocks:6.1f} GB/s per SM")
        if rank == 0:
            print(lines[-1], flush=True)
    buf.destroy()
    return "\n".join(lines)


def profile_rank(rank: int, world_size: int, args: dict) -> str:
    device = torch.device("cuda", rank)
    E, K, hidden = 256, 8, 7168
    cap = max(args["tokens"])
    buf = moe_comm.Buffer(None, num_max_tokens_per_rank=cap, hidden=hidden, num_topk=K, backend="cuda")
    iters, lines = args["iters"], []
    for num_tokens in args["tokens"]:
        case = Case(seed=2, num_ranks=world_size, num_experts=E, num_topk=K, hidden=hidden,
                    num_tokens=(num_tokens,) * world_size, num_max_tokens_per_rank=cap, drop_prob=0.0)
        x, idx, w = rank_inputs(case, rank, device)
        recv_x, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=E)
        ops = {"dispatch": lambda: buf.dispatch(x, idx, w, num_experts=E),
               "cached dispatch": lambda: buf.dispatch(x, handle=handle),
               "combine": lambda: buf.combine(recv_x, handle)}
        for name, fn in ops.items():
            for _ in range(3):
                fn()
            host, stream = loop_times(fn, iters, device)
            lines.append(f"\n{num_tokens} tokens, {name}: host {host:.1f} us/call, stream {stream:.1f} us/call")
            for kernel, us in kernel_times(fn, iters).items():
                lines.append(f"    {us:9.1f} us  {100 * us / stream:5.1f}%  {kernel}")
    small = min(args["tokens"])
    case = Case(seed=2, num_ranks=world_size, num_experts=E, num_topk=K, hidden=hidden,
                num_tokens=(small,) * world_size, num_max_tokens_per_rank=cap, drop_prob=0.0)
    x, idx, w = rank_inputs(case, rank, device)
    for _ in range(3):
        buf.dispatch(x, idx, w, num_experts=E)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        buf.dispatch(x, idx, w, num_experts=E)
    prof.disable()
    torch.cuda.synchronize(device)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    lines.append(f"\ncProfile, dispatch (CPU sync) at {small} tokens, {iters} calls:\n{text.getvalue()}")
    buf.destroy()
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-ranks", type=int, default=2, help="ranks, one GPU each")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", default=None, help="also write the report to DIR/profile.txt")
    parser.add_argument("--variants", nargs="*", default=None, help="kernel build variants to compare")
    parser.add_argument("--copy-ceiling", action="store_true", help="per-SM throughput of a plain block copy")
    args = parser.parse_args()
    fn = copy_ceiling_rank if args.copy_ceiling else variants_rank if args.variants else profile_rank
    report = parallel_launch(args.num_ranks, fn, {"tokens": args.tokens, "iters": args.iters, "variants": args.variants},
                             backend="nccl", timeout_s=600)[0]
    print(report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "profile.txt"), "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
