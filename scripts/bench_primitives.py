"""The buffer's primitives against NCCL (issue 16): pipeline send/recv (a ring: each rank sends to the next and
receives from the previous), all_gather and reduce_scatter, from 1 MB to 512 MB per rank in one run.

Per primitive and size, slowest rank, median of `--iters`: the time of moe_comm's call and of torch.distributed's
equivalent on the same group (batch_isend_irecv, all_gather_into_tensor, reduce_scatter_tensor), their GB/s (the
whole tensor's bytes over the time, nccl-tests' algbw: all_gather's gathered output and reduce_scatter's input, own
block included, so R / (R - 1) times the bytes that cross to peers; the pipeline's tensor sent), and the SM claim: a
bf16 GEMM on the compute stream while each runs beside it (moe_comm's call with `async_with_compute_stream=True`,
NCCL's on a side stream), against the GEMM alone (`bench_overlap.gemm_us`, each run queued behind a gate). moe_comm's
all_gather and pipeline results are checked bitwise against NCCL's first, at every size. The buffer takes
`backend="auto"`: on one host with peer access that is the CUDA backend, whose primitives move data by copy engines
(`moe_comm/backends/cuda_primitives.py`); elsewhere the reference path (NCCL underneath, plus the pipeline's copy into
a slot).

    python scripts/bench_primitives.py [--num-ranks 2] [--sizes-mb 1 4 16 64 256 512] [--iters 10] [--json F] [--md F]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import moe_comm
from moe_comm.backends.common import all_gather_single, reduce_scatter_single
from moe_comm.testing.bench import median_time_us

from bench import meta_lines  # scripts/bench.py: scripts/ is sys.path[0] when this runs as a script
from bench_overlap import gemm_as_long_as, gemm_us, on_side_stream, run_on_gpus


def primitives_rank(rank: int, world_size: int, args: dict) -> dict:
    device = torch.device("cuda", rank)
    R, nxt, prev = world_size, (rank + 1) % world_size, (rank - 1) % world_size
    buf = moe_comm.Buffer(None, num_max_tokens_per_rank=1, hidden=128, num_topk=1)
    largest = max(args["sizes_mb"]) << 20
    if R > 1:
        buf.pp_set_config(largest, 2)
    b = torch.randn(7168, 7168, dtype=torch.bfloat16, device=device)
    side = torch.cuda.Stream(device)
    rows = []
    for mb in args["sizes_mb"]:
        numel = (mb << 20) // 2 // R * R  # bf16 elements, a multiple of R
        t = torch.randn(numel, dtype=torch.bfloat16, device=device)
        out = torch.empty_like(t)
        gathered = torch.empty(R * (numel // R), dtype=t.dtype, device=device)
        scattered = torch.empty(numel // R, dtype=t.dtype, device=device)

        def ring_nccl():
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, nxt), dist.P2POp(dist.irecv, out, prev)]):
                work.wait()

        def ring_moe(**kw):
            buf.pp_send(t, nxt)
            return buf.pp_recv(out, prev, **kw)

        ops = {  # name: (moe_comm call taking async kwargs, NCCL call, the whole tensor's bytes)
            "all_gather": (lambda **kw: buf.all_gather(t[:numel // R], **kw)[1],
                           lambda: all_gather_single(gathered, t[:numel // R]), numel * 2),
            "reduce_scatter": (lambda **kw: buf.reduce_scatter(t, **kw)[1],
                               lambda: reduce_scatter_single(scattered, t), numel * 2),
        }
        if R > 1:
            ops["pipeline send/recv"] = (ring_moe, ring_nccl, numel * 2)
        # moe_comm's data movement bitwise NCCL's first (reduce_scatter sums in another order than NCCL's bf16).
        moe_gathered = buf.all_gather(t[:numel // R])[0].view(-1)
        all_gather_single(gathered, t[:numel // R])
        assert torch.equal(moe_gathered, gathered), f"all_gather at {mb} MB differs from NCCL's"
        if R > 1:
            ring_moe().current_stream_wait()
            moe_out = out.clone()
            ring_nccl()
            assert torch.equal(moe_out, out), f"pipeline send/recv at {mb} MB differs from NCCL's"
        for name, (moe, nccl, num_bytes) in ops.items():
            moe_us = median_time_us(moe, device, num_iters=args["iters"])
            nccl_us = median_time_us(nccl, device, num_iters=args["iters"])
            big = gemm_as_long_as(max(moe_us, nccl_us), b)

            alone, _ = gemm_us(big, b, None, args["iters"])
            beside_moe, _ = gemm_us(big, b, lambda moe=moe: moe(async_with_compute_stream=True), args["iters"])
            beside_nccl, _ = gemm_us(big, b, lambda nccl=nccl: on_side_stream(nccl, side), args["iters"])
            rows.append({"op": name, "mb": mb, "bytes": num_bytes, "moe_us": moe_us, "nccl_us": nccl_us,
                         "gemm_rows": big.shape[0], "gemm_alone_us": alone, "gemm_moe_us": beside_moe,
                         "gemm_nccl_us": beside_nccl})
    buf.destroy()
    return {"rows": rows, "device": torch.cuda.get_device_name(device), "backend": buf.backend}


def report(config: dict, per_rank: list[dict], meta: dict) -> tuple[str, dict]:
    first = per_rank[0]
    lines = meta_lines(meta) + [
        f"{config['num_ranks']} ranks on {first['device']}, moe_comm's {first.get('backend', '?')} backend; median of "
        f"{config['iters']}, slowest rank; GB/s = the whole tensor's bytes / time (all_gather's output, "
        f"reduce_scatter's input, the pipeline's tensor: nccl-tests' algbw); GEMM: a bf16 [M, 7168] x [7168, 7168] "
        f"on the compute stream, alone and beside each call (ratio to alone).", "",
        "| op | MB | moe_comm us | NCCL us | moe_comm GB/s | NCCL GB/s | GEMM rows | GEMM us alone | beside moe_comm | "
        "beside NCCL |", "|---|---|---|---|---|---|---|---|---|---|"]
    table = []
    for i, row in enumerate(first["rows"]):
        slowest = {k: max(r["rows"][i][k] for r in per_rank) for k in row if k.endswith("_us")}
        entry = {"op": row["op"], "mb": row["mb"], "gemm_rows": row["gemm_rows"], **slowest,
                 "moe_gbs": row["bytes"] / slowest["moe_us"] / 1e3, "nccl_gbs": row["bytes"] / slowest["nccl_us"] / 1e3,
                 "gemm_moe_ratio": slowest["gemm_moe_us"] / slowest["gemm_alone_us"],
                 "gemm_nccl_ratio": slowest["gemm_nccl_us"] / slowest["gemm_alone_us"]}
        table.append(entry)
        lines.append(f"| {row['op']} | {row['mb']} | {entry['moe_us']:.1f} | {entry['nccl_us']:.1f} | "
                     f"{entry['moe_gbs']:.1f} | {entry['nccl_gbs']:.1f} | {row['gemm_rows']} | "
                     f"{entry['gemm_alone_us']:.1f} | {entry['gemm_moe_us']:.1f} ({entry['gemm_moe_ratio']:.3f}) | "
                     f"{entry['gemm_nccl_us']:.1f} ({entry['gemm_nccl_ratio']:.3f}) |")
    record = {"date": meta["date_utc"][:10], "meta": meta, "config": config, "table": table, "per_rank": per_rank}
    return "\n".join(lines), record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-ranks", type=int, default=2)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 4, 16, 64, 256, 512])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", default=None)
    parser.add_argument("--md", default=None)
    args = parser.parse_args()
    config = {"num_ranks": args.num_ranks, "sizes_mb": args.sizes_mb, "iters": args.iters}
    run_on_gpus(parser, args, primitives_rank, config, report, "plot_primitives")


if __name__ == "__main__":
    main()
