"""Two-rank dispatch/combine demo and benchmark on whatever this machine has.

Spawns 2 ranks (NCCL with one GPU each when 2 GPUs are present, else gloo on CPU), checks one case bitwise
against the oracle, then times moe_comm's dispatch and combine next to the all_to_all_single baseline
(Megatron's alltoall dispatcher) and prints a table; `--json PATH` also writes the numbers.

    python scripts/demo.py [--tokens 128 512] [--hidden 2048] [--num-experts 64] [--num-topk 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
import torch.distributed as dist

import moe_comm
from moe_comm.testing import parallel_launch
from moe_comm.testing.bench import AllToAllBaseline, median_time_us
from moe_comm.testing.checks import check_case
from moe_comm.testing.routing import Case, rank_inputs


def bench_rank(rank: int, world_size: int, args: dict) -> list[dict]:
    device = torch.device("cuda", rank) if args["backend"] == "nccl" else torch.device("cpu")
    buf = moe_comm.Buffer(None, num_max_tokens_per_rank=max(args["tokens"]), hidden=args["hidden"],
                          num_topk=args["num_topk"], backend=args["moe_backend"])
    # One bitwise check first, so the table below is about a backend that is right.
    check_case(buf, Case(seed=1, num_ranks=world_size, num_experts=args["num_experts"], num_topk=args["num_topk"],
                         hidden=args["hidden"], num_tokens=(min(args["tokens"]),) * world_size,
                         num_max_tokens_per_rank=max(args["tokens"])), rank)
    baseline = AllToAllBaseline(dist.group.WORLD, args["num_experts"])
    rows = []
    for num_tokens in args["tokens"]:
        case = Case(seed=2, num_ranks=world_size, num_experts=args["num_experts"], num_topk=args["num_topk"],
                    hidden=args["hidden"], num_tokens=(num_tokens,) * world_size,
                    num_max_tokens_per_rank=max(args["tokens"]), drop_prob=0.0)
        x, idx, w = rank_inputs(case, rank, device)
        recv_x, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=case.num_experts)
        base_recv, state = baseline.dispatch(x, idx)
        timings = {
            "dispatch": median_time_us(lambda: buf.dispatch(x, idx, w, num_experts=case.num_experts), device,
                                       num_iters=args["iters"]),
            "cached dispatch": median_time_us(lambda: buf.dispatch(x, handle=handle), device, num_iters=args["iters"]),
            "combine": median_time_us(lambda: buf.combine(recv_x, handle), device, num_iters=args["iters"]),
            "baseline dispatch": median_time_us(lambda: baseline.dispatch(x, idx), device, num_iters=args["iters"]),
            "baseline combine": median_time_us(lambda: baseline.combine(base_recv, state), device,
                                               num_iters=args["iters"]),
        }
        recv_bytes = recv_x.shape[0] * recv_x.shape[1] * recv_x.element_size()
        rows.append({"backend": buf.backend, "tokens": num_tokens, "recv_rows": recv_x.shape[0], "recv_bytes": recv_bytes,
                     "num_sms": handle.num_sms, **{k: round(v, 1) for k, v in timings.items()}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--num-experts", type=int, default=64)
    parser.add_argument("--num-topk", type=int, default=8)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default=None)
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "cuda"], help="moe_comm backend")
    args = parser.parse_args()
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    config = {"tokens": args.tokens, "hidden": args.hidden, "num_experts": args.num_experts,
              "num_topk": args.num_topk, "iters": args.iters, "backend": backend, "moe_backend": args.backend}
    per_rank = parallel_launch(2, bench_rank, config, backend=backend, timeout_s=1800)

    device = torch.cuda.get_device_name(0) if backend == "nccl" else platform.processor() or platform.machine()
    print(f"moe_comm {moe_comm.__version__} {per_rank[0][0]['backend']} backend, 2 ranks over {backend} on {device}; "
          f"hidden {args.hidden} bf16, top-{args.num_topk} of {args.num_experts} experts; "
          f"median of {args.iters}, slowest rank; bitwise check passed")
    header = ["tokens", "dispatch us", "cached us", "combine us", "baseline disp us", "baseline comb us",
              "dispatch GB/s", "combine GB/s"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    table = []
    for i, row in enumerate(per_rank[0]):
        slowest = {k: max(r[i][k] for r in per_rank) for k in row if k.endswith("dispatch") or k.endswith("combine")}
        recv_bytes = sum(r[i]["recv_bytes"] for r in per_rank) / len(per_rank)
        gbs = {k: recv_bytes / (slowest[k] * 1e3) for k in ("dispatch", "combine")}
        table.append({"tokens": row["tokens"], **slowest, "logical_gbs": gbs, "num_sms": row["num_sms"]})
        print(f"| {row['tokens']} | {slowest['dispatch']:.0f} | {slowest['cached dispatch']:.0f} | "
              f"{slowest['combine']:.0f} | {slowest['baseline dispatch']:.0f} | {slowest['baseline combine']:.0f} | "
              f"{gbs['dispatch']:.2f} | {gbs['combine']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": config, "device": device, "rows": table}, f, indent=2)


if __name__ == "__main__":
    main()
