"""Dispatch/combine benchmark with the NCCL (or gloo) baseline from the same run (DESIGN section 7).

Spawns `--num-ranks` ranks (default 2; NCCL with one GPU each when the machine has that many GPUs, else gloo
on CPU), checks one case bitwise against the oracle, then per token count times, slowest rank, (a) one call on
an idle stream, median of `--iters` runs after warm-up (host issue time included) and (b) on CUDA, device time
per call of `--iters` back-to-back calls issued ahead of the GPU (DeepEP's measure): dispatch BF16 (fresh
layout, CPU sync), cached dispatch BF16, dispatch FP8 (pre-quantized fp8_block128 tuple; fresh and cached), a
cached dispatch of BF16 rows with FP8 on the wire (`quantize=`, `dequantize=True`: cast in the kernel),
combine BF16, and the all_to_all_single baseline (Megatron's alltoall path: dedup, permute, count exchange with
host sync; combine = reverse + FP32 index_add). Then an SM sweep of cached dispatch and combine at the largest
token count, next to the analytical `get_theoretical_num_sms`, and the JIT build times (CUDA backend).
`--expand`: moe_comm's dispatches use the expand layout (one row per (token, local expert), grouped by expert, as
the MoE layer's grouped experts take them; the receivers write min(K, local experts) rows per arrived token) and
its combines add those rows: "combine" by partial sums per rank (the Buffer's default: one row per (token, rank)
goes back, FP32 where the rank holds several slots), "combine slot order" on a second buffer made with
`deterministic=True` (DESIGN 2.2's order: a row per (token, slot), in rounds when they outgrow the region); the
baseline stays as it is.

Bandwidths (from the back-to-back time on CUDA): logical GB/s = bytes of all received rows (own rank included) /
time (DeepEP's metric); wire GB/s = bytes received from other ranks / time. Rows that travel as FP8 count one byte
per element, the "bf16 via fp8" row too (it moves FP8 rows; its bf16 output is cast on the receiver); scales are
not counted. Host us (CUDA) = isolated-call time
minus back-to-back time: the host's issue time that the device does not hide.

The markdown starts with the run's commit, versions and command; the JSON carries them as `meta`
(`moe_comm.testing.bench.run_metadata`). With `--json F.json` and matplotlib importable, the plot of
`scripts/plot_results.py` is written to F.png.

    python scripts/bench.py [--num-ranks 2] [--backend auto|torch|cuda] [--tokens 128 512 4096] [--hidden 7168]
                            [--num-experts 256] [--num-topk 8] [--sms 4 8 16 24 32 48] [--expand]
                            [--ranks-per-host N] [--json F] [--md F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import moe_comm
from moe_comm import quant
from moe_comm.testing import parallel_launch
from moe_comm.testing.bench import AllToAllBaseline, loop_times, median_time_us, run_metadata
from moe_comm.testing.checks import check_case
from moe_comm.testing.routing import Case, rank_inputs


def bench_rank(rank: int, world_size: int, args: dict) -> dict:
    device = torch.device("cuda", rank) if args["pg_backend"] == "nccl" else torch.device("cpu")
    cap = max(args["tokens"])
    buf = moe_comm.Buffer(None, num_max_tokens_per_rank=cap, hidden=args["hidden"], num_topk=args["num_topk"],
                          use_fp8_dispatch=args["hidden"] % 128 == 0, backend=args["backend"])
    E, K, iters, expand = args["num_experts"], args["num_topk"], args["iters"], args["expand"]
    # One bitwise check first, so the numbers below are about a backend that is right.
    check_case(buf, Case(seed=1, num_ranks=world_size, num_experts=E, num_topk=K, hidden=args["hidden"],
                         num_tokens=(min(args["tokens"]),) * world_size, num_max_tokens_per_rank=cap,
                         do_expand=expand), rank)
    baseline = AllToAllBaseline(dist.group.WORLD, E)
    # Expand: the slot order's combine beside the partial sums', on a buffer of its own (the order is a Buffer's).
    slot_order = moe_comm.Buffer(None, num_max_tokens_per_rank=cap, hidden=args["hidden"], num_topk=K,
                                 backend=args["backend"], deterministic=True) if expand else None
    rows, sweep = [], []
    for num_tokens in args["tokens"]:
        case = Case(seed=2, num_ranks=world_size, num_experts=E, num_topk=K, hidden=args["hidden"],
                    num_tokens=(num_tokens,) * world_size, num_max_tokens_per_rank=cap, drop_prob=0.0)
        x, idx, w = rank_inputs(case, rank, device)
        recv_x, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=E, do_expand=expand)
        base_recv, state = baseline.dispatch(x, idx)
        ops = {
            "dispatch": lambda: buf.dispatch(x, idx, w, num_experts=E, do_expand=expand),
            "cached dispatch": lambda: buf.dispatch(x, handle=handle, do_expand=expand),
            "combine": lambda: buf.combine(recv_x, handle),
            "baseline dispatch": lambda: baseline.dispatch(x, idx),
            "baseline combine": lambda: baseline.combine(base_recv, state),
        }
        if slot_order is not None:
            slot_x, _, _, slot_handle, _ = slot_order.dispatch(x, idx, w, num_experts=E, do_expand=True)
            ops["combine slot order"] = lambda: slot_order.combine(slot_x, slot_handle)
        if args["hidden"] % 128 == 0:
            x_fp8 = quant.quantize(x, "fp8_block128")
            ops["dispatch fp8"] = lambda: buf.dispatch(x_fp8, idx, w, num_experts=E, do_expand=expand)
            handle_fp8 = buf.dispatch(x_fp8, idx, w, num_experts=E, do_expand=expand)[3]
            ops["cached dispatch fp8"] = lambda: buf.dispatch(x_fp8, handle=handle_fp8, do_expand=expand)
            # BF16 in and out, FP8 on the wire: both casts in the kernel on the CUDA backend.
            ops["cached dispatch bf16 via fp8"] = lambda: buf.dispatch(
                x, handle=handle_fp8, do_expand=expand, quantize="fp8_block128", dequantize=True)
        timings = {op: median_time_us(fn, device, num_iters=iters) for op, fn in ops.items()}
        if device.type == "cuda":
            timings.update({f"{op} b2b": loop_times(fn, iters, device)[1] for op, fn in ops.items()})
        # Rows that cross the wire to this rank, in rows of x's size: a dispatch's tokens once per rank (the expand
        # layout's fan-out happens at the receiver); a combine as many of its tokens' rows as come back from peers:
        # one per (token, peer) (an expand combine's partial sum of several slots: FP32, two bf16 rows' bytes), in
        # the slot order one per (token, slot) on a peer (the bench's routing: no alignment padding, no invalid slots).
        psum = handle.psum_num_recv_tokens_per_rank.tolist()
        peer_tokens = psum[-1] - (psum[rank] - (psum[rank - 1] if rank else 0))
        dest = torch.where(idx >= 0, idx // (E // world_size), rank)
        on_peer = torch.zeros(idx.shape[0], world_size, dtype=torch.int64, device=device).scatter_add_(
            1, dest, (dest != rank).long())  # [N, R]: a token's slots on each peer
        acc_rows = 4 // x.element_size() if x.dtype != torch.float64 else 1  # FP32 (FP64) sums in rows of x
        wire_rows = {"dispatch": peer_tokens,
                     "combine": int(((on_peer == 1) + (on_peer > 1) * acc_rows).sum()) if expand else peer_tokens,
                     "combine slot order": int(on_peer.sum())}
        rows.append({"tokens": num_tokens, "recv_rows": recv_x.shape[0],
                     "row_bytes": recv_x.shape[1] * recv_x.element_size(), "wire_rows": wire_rows,
                     "num_sms": handle.num_sms, **timings})
        if num_tokens == cap:
            # Back-to-back device time on CUDA (the SM count shows in it, not behind the host's issue time).
            timer = (lambda fn: loop_times(fn, iters, device)[1]) if device.type == "cuda" else \
                (lambda fn: median_time_us(fn, device, num_iters=iters))
            for num_sms in args["sms"]:
                sweep.append({"num_sms": num_sms,
                              "cached dispatch": timer(lambda: buf.dispatch(x, handle=handle, do_expand=expand,
                                                                            num_sms=num_sms)),
                              "combine": timer(lambda: buf.combine(recv_x, handle, num_sms=num_sms))})
    hosts, per_host = buf.get_logical_domain_size()
    return {"backend": buf.backend, "path": f"hybrid {hosts} hosts x {per_host}" if buf.is_hybrid else "direct",
            "theoretical_num_sms": buf.get_theoretical_num_sms(E, K, expand), "rows": rows, "sweep": sweep}


def jit_times() -> dict:
    """Cold build of every kernel library into an empty cache, and a warm first load in a fresh process."""
    from moe_comm.backends import cuda_kernels
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "MOE_COMM_JIT_CACHE_DIR": cache}
        code = ("import time; from moe_comm.backends import cuda_kernels as c; t = time.perf_counter(); c.load_kernels(); "
                "print(time.perf_counter() - t)")
        cold = float(subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True,
                                    text=True).stdout.split()[-1])
        warm = float(subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True,
                                    text=True).stdout.split()[-1])
    return {"cold_build_s": round(cold, 2), "warm_first_load_s": round(warm, 3),
            "libraries": [cuda_kernels.LIBRARY]}


def gbs(num_bytes: float, us: float) -> float:
    return num_bytes / (us * 1e3)


def meta_lines(meta: dict) -> list[str]:
    """The markdown's first lines: where the numbers came from."""
    commit = "not a checkout" if meta["commit"] is None else meta["commit"][:12] + (" (dirty)" if meta["dirty"] else "")
    gpus = f"{meta['num_gpus']}x {meta['gpu']}" if meta["gpu"] else "no GPU"
    return [f"commit {commit}; torch {meta['torch']}, CUDA {meta['cuda'] or '-'}, NCCL {meta['nccl'] or '-'}, "
            f"Python {meta['python']}; {gpus} on {meta['hostname']}; {meta['date_utc']}",
            "",
            f"    {meta['command']}",
            ""]


def report(config: dict, per_rank: list[dict], jit: dict | None, meta: dict) -> tuple[str, dict]:
    """The markdown table (slowest rank per cell) and the JSON record.

    Arguments:
        config: the run's options (`main`).
        per_rank: what `bench_rank` returned on each rank.
        jit: `jit_times()` on the CUDA backend, else None.
        meta: `run_metadata(sys.argv)`.

    Returns:
        `(markdown, record)`; the record is the JSON (`meta`, `config`, `table` with one entry per token count and
        op, `per_rank` raw timings, `jit`).
    """
    device = torch.cuda.get_device_name(0) if config["pg_backend"] == "nccl" else platform.machine()
    first = per_rank[0]
    lines = meta_lines(meta)
    lines += [f"moe_comm {moe_comm.__version__}, backend {first['backend']} ({first['path']} path), "
              f"{config['num_ranks']} ranks over "
              f"{config['pg_backend']} on "
              f"{device}; hidden {config['hidden']} bf16, top-{config['num_topk']} of {config['num_experts']} experts"
              f"{', expand layout' if config['expand'] else ''}; "
              f"median of {config['iters']}, slowest rank; bitwise check passed; "
              f"analytical num_sms {first['theoretical_num_sms']}",
              "",
              "",
              "us: one call on an idle stream, host issue time included; back-to-back: device time per call of "
              f"{config['iters']} calls issued ahead of the GPU (DeepEP's measure; CUDA only), which the GB/s use; "
              "host: us minus back-to-back, the issue time the device does not hide (CUDA only; noise can make it "
              "negative).",
              "",
              "| tokens | op | us | back-to-back us | host us | SMs | logical GB/s | wire GB/s | baseline us | "
              "baseline back-to-back us |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    table = []
    for i, row in enumerate(first["rows"]):
        slowest = {k: max(r["rows"][i][k] for r in per_rank) for k in row if k not in
                   ("tokens", "recv_rows", "wire_rows", "row_bytes", "num_sms")}
        recv_bytes = sum(r["rows"][i]["recv_rows"] * r["rows"][i]["row_bytes"] for r in per_rank) / len(per_rank)
        wire = {kind: sum(r["rows"][i]["wire_rows"][kind] * r["rows"][i]["row_bytes"] for r in per_rank) / len(per_rank)
                for kind in row["wire_rows"]}
        for op, base in (("dispatch", "baseline dispatch"), ("cached dispatch", "baseline dispatch"),
                         ("dispatch fp8", None), ("cached dispatch fp8", None), ("cached dispatch bf16 via fp8", None),
                         ("combine", "baseline combine"), ("combine slot order", "baseline combine")):
            if op not in slowest:
                continue
            scale = 0.5 if "fp8" in op else 1.0  # e4m3 rows on the wire are half the bytes (scales not counted)
            us, b2b = slowest[op], slowest.get(f"{op} b2b")
            device_us = us if b2b is None else b2b
            entry = {"tokens": row["tokens"], "op": op, "us": us, "back_to_back_us": b2b,
                     "host_us": None if b2b is None else us - b2b, "num_sms": row["num_sms"],
                     "logical_gbs": gbs(recv_bytes * scale, device_us),
                     "wire_gbs": gbs(wire[op if op.startswith("combine") else "dispatch"] * scale, device_us),
                     "baseline_us": slowest.get(base) if base else None,
                     "baseline_back_to_back_us": slowest.get(f"{base} b2b") if base else None}
            table.append(entry)
            cell = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
            lines.append(f"| {row['tokens']} | {op} | {us:.1f} | {cell(b2b)} | {cell(entry['host_us'])} | "
                         f"{row['num_sms']} | "
                         f"{entry['logical_gbs']:.2f} | {entry['wire_gbs']:.2f} | {cell(entry['baseline_us'])} | "
                         f"{cell(entry['baseline_back_to_back_us'])} |")
    if first["sweep"]:
        lines += ["", f"SM sweep at {max(config['tokens'])} tokens (analytical: {first['theoretical_num_sms']})", "",
                  "| SMs | cached dispatch us | combine us |", "|---|---|---|"]  # back-to-back on CUDA
        for i, point in enumerate(first["sweep"]):
            d = max(r["sweep"][i]["cached dispatch"] for r in per_rank)
            c = max(r["sweep"][i]["combine"] for r in per_rank)
            lines.append(f"| {point['num_sms']} | {d:.1f} | {c:.1f} |")
    if jit:
        lines += ["", f"JIT: cold build {jit['cold_build_s']} s, warm first load {jit['warm_first_load_s']} s "
                      f"({', '.join(jit['libraries'])})"]
    record = {"date": meta["date_utc"][:10], "meta": meta, "config": config, "device": device, "table": table,
              "per_rank": per_rank, "jit": jit}
    return "\n".join(lines), record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-ranks", type=int, default=2)
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "cuda"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 4096])
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--num-experts", type=int, default=256)
    parser.add_argument("--num-topk", type=int, default=8)
    parser.add_argument("--sms", type=int, nargs="*", default=[4, 8, 12, 16, 20, 24, 32, 48])
    parser.add_argument("--expand", action="store_true", help="moe_comm's dispatches in the expand layout")
    parser.add_argument("--ranks-per-host", type=int, default=None,
                        help="MOE_COMM_RANKS_PER_NODE for the ranks: this many ranks form a host, so one machine runs "
                             "the hybrid (multi-host) path; e.g. 2 GPUs as 2 hosts x 1 against the direct path")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default=None, help="write the JSON record here")
    parser.add_argument("--md", default=None, help="write the markdown table here")
    args = parser.parse_args()
    if args.num_ranks < 1:
        parser.error(f"--num-ranks={args.num_ranks} must be >= 1")
    # Checked here, before any rank starts (a rank would raise them only after the spawn, as a RankFailure).
    if args.iters < 1 or min(args.tokens) < 0:
        parser.error(f"--iters={args.iters} must be >= 1 and --tokens={args.tokens} >= 0")
    if args.num_experts < 1 or args.num_experts % args.num_ranks or not 1 <= args.num_topk <= args.num_experts:
        parser.error(f"--num-experts={args.num_experts} must be a positive multiple of --num-ranks={args.num_ranks}, "
                     f"and --num-topk={args.num_topk} in [1, num_experts]")
    if args.hidden < 1 or args.hidden * 2 % 16:
        parser.error(f"--hidden={args.hidden}: bf16 rows must be a positive multiple of 16 bytes (hidden % 8 == 0)")
    if args.backend == "cuda" and torch.cuda.device_count() < args.num_ranks:
        parser.error(f"--backend cuda needs {args.num_ranks} GPUs (one per rank), found {torch.cuda.device_count()}")
    if any(n < 0 for n in args.sms):
        parser.error(f"--sms={args.sms}: each >= 0 (0: the analytical count)")
    if args.backend != "torch" and torch.cuda.device_count() >= args.num_ranks:  # the CUDA backend can be chosen
        num_device_sms = torch.cuda.get_device_properties(0).multi_processor_count
        if any(n == 1 or n > num_device_sms for n in args.sms):
            parser.error(f"--sms={args.sms}: the CUDA backend takes 0 (the analytical count) or 2 (a sender and a "
                         f"receiver block) to {num_device_sms} (the SMs of GPU 0)")
    if args.ranks_per_host is not None:
        os.environ["MOE_COMM_RANKS_PER_NODE"] = str(args.ranks_per_host)  # the spawned ranks inherit it
    pg_backend = "nccl" if torch.cuda.device_count() >= args.num_ranks else "gloo"
    config = {"num_ranks": args.num_ranks, "backend": args.backend, "tokens": args.tokens, "hidden": args.hidden,
              "num_experts": args.num_experts, "num_topk": args.num_topk, "sms": args.sms, "iters": args.iters,
              "expand": args.expand, "ranks_per_host": args.ranks_per_host,
              "pg_backend": pg_backend}
    meta = run_metadata(sys.argv)
    start = time.monotonic()
    per_rank = parallel_launch(args.num_ranks, bench_rank, config, backend=pg_backend, timeout_s=1800)
    jit = jit_times() if per_rank[0]["backend"] == "cuda" else None
    text, record = report(config, per_rank, jit, meta)
    print(text)
    print(f"({time.monotonic() - start:.0f} s)")
    write_results(text, record, args.json, args.md, "plot_bench")


def run_ranks(num_ranks: int, rank_fn, config: dict, report, share_gpu: bool) -> tuple[str, dict]:
    """`rank_fn(rank, world_size, config)` on every rank (NCCL, a GPU each; with `share_gpu` gloo, every rank on GPU
    0), then `report(config, per_rank, meta)`: its table printed with the run's seconds; returns `(text, record)`."""
    meta = run_metadata(sys.argv)
    start = time.monotonic()
    per_rank = parallel_launch(num_ranks, rank_fn, config, backend="gloo" if share_gpu else "nccl", timeout_s=1800)
    text, record = report(config, per_rank, meta)
    print(text)
    print(f"({time.monotonic() - start:.0f} s)")
    return text, record


def write_results(text: str, record: dict, json_path: str | None, md_path: str | None, plot: str) -> None:
    """The markdown and the JSON record where asked, and beside the JSON its PNG, drawn by `plot_results.<plot>`
    when matplotlib is importable."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(record, f, indent=2)
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("plot skipped: matplotlib is not importable")
        else:
            import plot_results  # scripts/ is sys.path[0] when this file runs as a script
            png = os.path.splitext(json_path)[0] + ".png"
            getattr(plot_results, plot)(record, png)
            print(f"plot: {png}")
    if md_path:
        with open(md_path, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
