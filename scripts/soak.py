"""Soak: `--iters` random routings over every dispatch and combine path, each result checked against a closed form
(`moe_comm.testing.soak`), with host RSS and CUDA memory before and after each path.

Spawns `--num-ranks` ranks (NCCL with one GPU each when the machine has that many GPUs, else gloo on CPU; with
`--share-gpu`, gloo with every rank on GPU 0, the CUDA backend's peers mapped with CUDA IPC: its peer paths without a
second GPU, `moe_comm.testing.shared_gpu`), draws
the cases in this process from `--seed` and sends them to the ranks, so every rank runs the same case. Each path
runs a warm-up iteration of the largest case in each row dtype (the kernels of each are loaded at their first
launch), then every drawn case, on one Buffer per rank ("combine partial" on a second one). Prints a table
per path (iterations, wrong iterations summed over ranks with the first example, wall time of the slowest rank,
memory from after the warm-up to the end); `--json F` also writes it with the run's commit and versions.

Exit status: 0 when every result matched and no rank's host RSS grew by more than `--rss-tolerance-mib` (default
8) nor its `torch.cuda.memory_allocated` by more than `--cuda-tolerance-kib` (default 0) in any path; 1 for a
wrong result or such growth; 2 when a rank raised, died or timed out (its traceback is printed).

    python scripts/soak.py [--iters 200] [--num-ranks 2] [--backend auto|torch|cuda] [--share-gpu] [--seed 0]
                           [--max-tokens 64] [--hidden 384] [--max-experts 32] [--max-topk 8]
                           [--paths dispatch combine ...] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from moe_comm.testing import RankFailure, WorkerPool
from moe_comm.testing.bench import run_metadata
from moe_comm.testing.soak import (MAX_TOKENS, MAX_TOPK, PATHS, SoakConfig, draw_soak_cases, format_summary,
                                   soak_rank, summarize, warmup_cases)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=200, help="drawn cases, each run through every path")
    parser.add_argument("--num-ranks", type=int, default=2)
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "cuda"])
    parser.add_argument("--share-gpu", action="store_true",
                        help="every rank on GPU 0 (gloo group, peers over CUDA IPC); implies --backend cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=64, help=f"tokens per rank, at most {MAX_TOKENS}")
    parser.add_argument("--hidden", type=int, default=384, help="largest hidden size drawn (at least 8)")
    parser.add_argument("--max-experts", type=int, default=32)
    parser.add_argument("--max-topk", type=int, default=MAX_TOPK, help=f"at most {MAX_TOPK}")
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--rss-tolerance-mib", type=float, default=8.0)
    parser.add_argument("--cuda-tolerance-kib", type=float, default=0.0)
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="limit of the whole run")
    parser.add_argument("--json", default=None, help="write the summary, per-rank results and metadata here")
    args = parser.parse_args()
    if args.num_ranks < 1:
        parser.error(f"--num-ranks={args.num_ranks} must be >= 1")
    if args.iters < 1:
        parser.error(f"--iters={args.iters} must be >= 1 (a soak of no iteration checks nothing)")
    if args.share_gpu:
        if args.backend == "torch":
            parser.error("--share-gpu runs the CUDA backend: leave out --backend torch")
        if not torch.cuda.is_available():
            parser.error("--share-gpu needs a GPU, found none")
        args.backend, pg_backend = "cuda", "gloo"
    else:
        pg_backend = "nccl" if args.backend != "torch" and torch.cuda.device_count() >= args.num_ranks else "gloo"
        if args.backend == "cuda" and pg_backend != "nccl":
            parser.error(f"--backend cuda needs {args.num_ranks} GPUs, found {torch.cuda.device_count()} "
                         "(--share-gpu puts every rank on one)")
    try:
        cases = draw_soak_cases(args.seed, args.iters, args.num_ranks, max_tokens=args.max_tokens,
                                max_hidden=args.hidden, max_experts=args.max_experts, max_topk=args.max_topk)
    except ValueError as exc:
        parser.error(str(exc))
    config = SoakConfig(backend=args.backend, num_max_tokens_per_rank=args.max_tokens, max_hidden=args.hidden,
                        max_topk=args.max_topk, paths=tuple(args.paths), share_gpu=args.share_gpu)
    warmups = warmup_cases(config, args.num_ranks, args.max_experts)

    meta = run_metadata(sys.argv)
    sharing = " sharing GPU 0" if args.share_gpu else ""
    commit = (meta["commit"] or "unknown")[:12] + (" (dirty)" if meta["dirty"] else "")
    print(f"soak: {args.iters} iterations x {len(args.paths)} paths, {args.num_ranks} ranks over "
          f"{pg_backend}{sharing}, seed {args.seed}, tokens <= {args.max_tokens}, hidden <= {args.hidden}, "
          f"experts <= {args.max_experts}, top-k <= {args.max_topk}; commit {commit}, torch {meta['torch']}")
    start = time.monotonic()
    pool = WorkerPool(args.num_ranks, backend=pg_backend, timeout_s=args.timeout_s)
    try:
        per_rank = pool.run(soak_rank, cases, warmups, config)
    except RankFailure as exc:
        print(f"FAILED: a rank raised, died or timed out:\n{exc}")
        return 2
    finally:
        pool.close()
    summary = summarize(per_rank, int(args.rss_tolerance_mib * 2**20), int(args.cuda_tolerance_kib * 2**10))
    print(f"backend {summary['backend']}; tolerances: host RSS {args.rss_tolerance_mib:g} MiB, CUDA "
          f"{args.cuda_tolerance_kib:g} KiB; {time.monotonic() - start:.1f} s in all")
    print(format_summary(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "config": vars(args), "pg_backend": pg_backend, "summary": summary,
                       "per_rank": per_rank}, f, indent=2)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
