"""What communication in flight costs the compute beside it (DESIGN 8.2, issue 14's receive hook): a bf16 GEMM on
the compute stream, timed with CUDA events, alone and while each op is in flight.

Per op (cached dispatch and combine of DeepSeek-V3 rows, `--tokens` per rank, the expand layout with `--expand`)
and way of running it:
- async: `async_with_compute_stream=True`, the kernel on the comm stream beside the GEMM (it holds its SMs until
  its rows have arrived);
- hook: `return_recv_hook=True`, the call (its send launch: the barrier, then its rows pushed with SM stores)
  before the GEMM on the same stream, the hook (the receivers) after it: what runs beside the GEMM is only what the
  peers still push into this rank's region, so the GEMM column alone says little; the step column says what the
  split buys or costs against running the op then the GEMM;
- nccl: `all_to_all_single` of the same rows on a side stream (the baseline's exchange; NCCL's kernels beside the
  GEMM);
- after: the plain call, completed before the GEMM starts (nothing beside it: what the op's memory traffic leaves
  behind, e.g. dirty L2 lines).
The GEMM ([M, H] x [H, H], M doubled from 128 until it takes at least as long as the op alone) is timed alone and
in each way; the tables give the GEMM's time and its ratio to alone, and the whole step (from the gate's end until
the op and the GEMM are both done), median of `--iters`, slowest rank; also the op's time alone (one isolated call,
host included; and sent with a hook then received: its two launches). The hooked results are checked bitwise
against the plain call first. Without a peer (one GPU) the numbers say only what the kernels do on one device.

    python scripts/bench_overlap.py [--num-ranks 2] [--tokens 4096] [--hidden 7168] [--num-experts 256]
                                    [--num-topk 8] [--num-sms 0] [--expand] [--iters 20] [--json F] [--md F]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.distributed as dist

import moe_comm
from moe_comm.testing import parallel_launch
from moe_comm.testing.bench import median_time_us, run_metadata
from moe_comm.testing.checks import assert_same
from moe_comm.testing.routing import Case, rank_inputs

from bench import meta_lines, write_results  # scripts/bench.py: scripts/ is sys.path[0] when this file runs as a script

MODES = ("after", "async", "hook", "nccl")


# Cycles of the gate that holds the stream while the host queues a run (~0.5 ms on an H200): without it the
# GEMM's time would include the host's launch gap whenever the stream is idle at `start` (alone, mostly).
GATE_CYCLES = 1_000_000


def gemm_us(a: torch.Tensor, b: torch.Tensor, beside, iters: int) -> tuple[float, float]:
    """Medians `(GEMM us, step us)`: `a @ b` on the current stream, `beside()` issued just before it (and its hook,
    if it returns one, called after), everything queued behind a gate; step = from the gate's end until both the
    GEMM and the op are done (their hook run, their event waited). Ranks start each run together."""
    gemms, steps = [], []
    for _ in range(iters + 2):
        torch.cuda.synchronize()
        dist.barrier()
        gate, start, end, done = (torch.cuda.Event(enable_timing=True) for _ in range(4))
        torch.cuda._sleep(GATE_CYCLES)
        gate.record()
        pending = beside() if beside is not None else None
        start.record()
        a @ b
        end.record()
        if callable(pending):
            pending()
        elif pending is not None:
            pending.current_stream_wait()
        done.record()
        torch.cuda.synchronize()
        gemms.append(start.elapsed_time(end) * 1e3)
        steps.append(gate.elapsed_time(done) * 1e3)
    return statistics.median(gemms[2:]), statistics.median(steps[2:])


def on_side_stream(fn, side: torch.cuda.Stream):
    """Run `fn` on `side` after the current stream's work; returns what makes the current stream wait for it."""
    current = torch.cuda.current_stream(side.device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        fn()
    done = torch.cuda.Event()
    done.record(side)
    return lambda: current.wait_event(done)


def run_on_gpus(parser: argparse.ArgumentParser, args, rank_fn, config: dict, report, plot: str) -> None:
    """Check `--num-ranks` against the machine's GPUs, run `rank_fn(rank, world_size, config)` on every rank over
    NCCL, print `report(config, per_rank, meta)`'s table and write its files (`bench.write_results`)."""
    if not 1 <= args.num_ranks <= torch.cuda.device_count():
        parser.error(f"--num-ranks={args.num_ranks} needs as many GPUs (this machine has "
                     f"{torch.cuda.device_count()})")
    meta = run_metadata(sys.argv)
    per_rank = parallel_launch(args.num_ranks, rank_fn, config, backend="nccl", timeout_s=1800)
    text, record = report(config, per_rank, meta)
    print(text)
    write_results(text, record, args.json, args.md, plot)


def gemm_as_long_as(op_us: float, b: torch.Tensor) -> torch.Tensor:
    """`a` for an `a @ b` at least as long as `op_us` on every rank: small GEMMs do not scale with their rows, so M
    doubles from 128 while one rank's is shorter (the ranks take the same steps, as each timing is collective)."""
    m = 128
    while True:
        a = torch.randn(m, b.shape[0], dtype=b.dtype, device=b.device)
        short = torch.tensor([m < 65536 and median_time_us(lambda: a @ b, b.device, num_iters=5) < op_us],
                             dtype=torch.int32, device=b.device)
        dist.all_reduce(short, op=dist.ReduceOp.MAX)
        if not short.item():
            return a
        m *= 2


def overlap_rank(rank: int, world_size: int, args: dict) -> dict:
    device = torch.device("cuda", rank)
    E, K, H, N, expand = args["num_experts"], args["num_topk"], args["hidden"], args["tokens"], args["expand"]
    buf = moe_comm.Buffer(None, num_max_tokens_per_rank=N, hidden=H, num_topk=K, backend="cuda", use_recv_hook=True)
    case = Case(seed=3, num_ranks=world_size, num_experts=E, num_topk=K, hidden=H, num_tokens=(N,) * world_size,
                num_max_tokens_per_rank=N, drop_prob=0.0)
    x, idx, w = rank_inputs(case, rank, device)
    sms = args["num_sms"]
    recv_x, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=E, do_expand=expand, num_sms=sms)
    calls = {"cached dispatch": lambda **kw: buf.dispatch(x, handle=handle, do_expand=expand, num_sms=sms, **kw),
             "combine": lambda **kw: buf.combine(recv_x, handle, num_sms=sms, **kw)}
    # The hooked calls give the plain calls' results, bit for bit.
    for name, call in calls.items():
        plain = call()[0]
        *hooked, receive = call(return_recv_hook=True)
        receive()
        assert_same(f"hooked {name}", hooked[0], plain.cpu())
    # The baseline's exchange of the same rows: a row per (token, destination rank) each way.
    send = recv_x[:N * world_size].contiguous() if recv_x.shape[0] >= N * world_size else \
        recv_x.new_zeros(N * world_size, H)
    received = torch.empty_like(send)
    b = torch.randn(H, H, dtype=torch.bfloat16, device=device)
    side = torch.cuda.Stream(device)
    rows = []
    for name, call in calls.items():
        op_us = median_time_us(call, device, num_iters=args["iters"])
        hooked_us = median_time_us(lambda: call(return_recv_hook=True)[-1](), device, num_iters=args["iters"])
        big = gemm_as_long_as(op_us, b)
        m = big.shape[0]

        def nccl():
            return on_side_stream(lambda: dist.all_to_all_single(received, send), side)

        def after():
            call()

        beside = {"after": after, "async": lambda: call(async_with_compute_stream=True)[-1],
                  "hook": lambda: call(return_recv_hook=True)[-1], "nccl": nccl}
        row = {"op": name, "op_us": op_us, "op_hooked_us": hooked_us, "gemm_rows": m}
        row["gemm_alone_us"], _ = gemm_us(big, b, None, args["iters"])
        for mode in MODES:
            row[f"gemm_{mode}_us"], row[f"step_{mode}_us"] = gemm_us(big, b, beside[mode], args["iters"])
        rows.append(row)
    return {"rows": rows, "num_sms": sms or buf.get_theoretical_num_sms(E, K, expand),
            "device": torch.cuda.get_device_name()}


def report(config: dict, per_rank: list[dict], meta: dict) -> tuple[str, dict]:
    first = per_rank[0]
    lines = meta_lines(meta) + [
        f"{config['num_ranks']} ranks on {first['device']}; {config['tokens']} tokens per rank, hidden "
        f"{config['hidden']} bf16, top-{config['num_topk']} of {config['num_experts']} experts"
        f"{', expand layout' if config['expand'] else ''}; {first['num_sms']} SMs; median of {config['iters']}, "
        f"slowest rank; hooked results bitwise the plain calls'",
        "", "GEMM us alone and beside the op in flight (ratio to alone): async = the kernel on the comm stream, "
        "hook = sends before the GEMM and the hook after it, nccl = all_to_all_single of the same rows on a side "
        "stream; after the op = the plain call completed first.", "",
        "| op | op us alone | op + hook us | GEMM rows | GEMM us alone | after the op | beside async | beside hook | "
        "beside nccl |",
        "|---|---|---|---|---|---|---|---|---|"]
    steps = ["", "The whole step (op and GEMM, from the gate's end until both are done) in us: after the op = one "
             "after the other; the others overlap what they can.", "",
             "| op | " + " | ".join(MODES) + " |", "|---|" + "---|" * len(MODES)]
    table = []
    for i, row in enumerate(first["rows"]):
        slowest = {k: max(r["rows"][i][k] for r in per_rank) for k in row if k.endswith("_us")}
        entry = {"op": row["op"], "gemm_rows": row["gemm_rows"], **slowest,
                 **{f"gemm_{mode}_ratio": slowest[f"gemm_{mode}_us"] / slowest["gemm_alone_us"] for mode in MODES}}
        table.append(entry)
        cells = " | ".join(f"{entry[f'gemm_{mode}_us']:.1f} ({entry[f'gemm_{mode}_ratio']:.3f})" for mode in MODES)
        lines.append(f"| {row['op']} | {entry['op_us']:.1f} | {entry['op_hooked_us']:.1f} | {row['gemm_rows']} | "
                     f"{entry['gemm_alone_us']:.1f} | {cells} |")
        steps.append(f"| {row['op']} | " + " | ".join(f"{entry[f'step_{mode}_us']:.1f}" for mode in MODES) + " |")
    record = {"date": meta["date_utc"][:10], "meta": meta, "config": config, "table": table, "per_rank": per_rank}
    return "\n".join(lines + steps), record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--num-experts", type=int, default=256)
    parser.add_argument("--num-topk", type=int, default=8)
    parser.add_argument("--num-sms", type=int, default=0, help="SMs of moe_comm's kernels (0: the analytical count)")
    parser.add_argument("--expand", action="store_true", help="the expand layout (the MoE layer's)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default=None)
    parser.add_argument("--md", default=None)
    args = parser.parse_args()
    config = {k: getattr(args, k) for k in ("num_ranks", "tokens", "hidden", "num_experts", "num_topk", "num_sms",
                                            "expand", "iters")}
    run_on_gpus(parser, args, overlap_rank, config, report, "plot_overlap")

if __name__ == "__main__":
    main()
