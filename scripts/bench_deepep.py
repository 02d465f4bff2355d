"""moe_comm beside DeepEP V1 (intranode) on the same GPUs, inputs and SM count, in one run (DESIGN section 7).

Spawns `--num-ranks` ranks (one GPU each, NCCL), builds a `moe_comm.Buffer` (CUDA backend) and a `deep_ep.Buffer`
(NVLink buffer sized by DeepEP's own config hints, `set_num_sms(--num-sms)`), and per token count times, slowest
rank, one call on an idle stream (host issue time included) and the device time per call of `--iters` calls issued
back to back (DeepEP's measure): the dispatch with a fresh layout and a CPU sync (moe_comm: `dispatch(x, topk_idx,
...)`; DeepEP: `get_dispatch_layout` + the non-cached `dispatch`, which waits on the host for its counts), the
cached dispatch of BF16 rows and of pre-quantized FP8 rows (fp8_block128: e4m3 with a float32 scale per 128
channels, DeepEP's format), and the BF16 combine (no weights). Both receive the rows ordered by source rank then
token: the report says whether they received the same rows bit for bit, and how far the combines differ (their
summation orders differ).

`--share-gpu`: the ranks share GPU 0 over a gloo group, moe_comm's peers mapped with CUDA IPC
(`moe_comm.testing.shared_gpu`; DeepEP maps its peers with CUDA IPC anyway): checks the script and the rows
against DeepEP's on a one-GPU machine; the times mean nothing there (no NVLink, two kernels on one GPU).

DeepEP is not part of moe_comm and is never committed here: build its tag v1.2.1 intranode-only (without NVSHMEM)
on the device and put it on PYTHONPATH (benchmarks/NOTES.md says how it was done); without an importable `deep_ep`
the script says so and exits with status 2.

    python scripts/bench_deepep.py [--num-ranks 2] [--tokens 128 4096] [--num-sms 24] [--iters 20] [--share-gpu]
                                   [--json F] [--md F]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys

import torch
import torch.distributed as dist

import moe_comm
from moe_comm import quant
from moe_comm.testing.bench import loop_times, median_time_us
from moe_comm.testing.routing import Case, rank_inputs
from moe_comm.testing.shared_gpu import every_buffer_over_ipc

from bench import meta_lines, run_ranks, write_results  # scripts/ is sys.path[0] when this file runs as a script

OPS = ("dispatch", "cached dispatch", "cached dispatch fp8", "combine")


def bench_rank(rank: int, world_size: int, args: dict) -> dict:
    with every_buffer_over_ipc() if args["share_gpu"] else contextlib.nullcontext():
        return bench_on_device(rank, world_size, args, torch.device("cuda", 0 if args["share_gpu"] else rank))


def bench_on_device(rank: int, world_size: int, args: dict, device: torch.device) -> dict:
    import deep_ep

    E, K, H, sms, iters = args["num_experts"], args["num_topk"], args["hidden"], args["num_sms"], args["iters"]
    cap = max(args["tokens"])
    deep_ep.Buffer.set_num_sms(sms)
    dispatch_config = deep_ep.Buffer.get_dispatch_config(world_size)
    combine_config = deep_ep.Buffer.get_combine_config(world_size)
    nvl_bytes = max(config.get_nvl_buffer_size_hint(H * 2, world_size) for config in (dispatch_config, combine_config))
    theirs = deep_ep.Buffer(dist.group.WORLD, nvl_bytes, 0, explicitly_destroy=True)
    ours = moe_comm.Buffer(None, num_max_tokens_per_rank=cap, hidden=H, num_topk=K, use_fp8_dispatch=True,
                           backend="cuda")
    rows = []
    for num_tokens in args["tokens"]:
        case = Case(seed=2, num_ranks=world_size, num_experts=E, num_topk=K, hidden=H,
                    num_tokens=(num_tokens,) * world_size, num_max_tokens_per_rank=cap, drop_prob=0.0)
        x, idx, w = rank_inputs(case, rank, device)
        x_fp8 = quant.quantize(x, "fp8_block128")
        # DeepEP reads the scales column-major (its tests build them with `.T.contiguous().T`); same values.
        x_fp8_theirs = (x_fp8[0], x_fp8[1].T.contiguous().T)

        recv_x, recv_idx, recv_w, handle, _ = ours.dispatch(x, idx, w, num_experts=E, num_sms=sms)
        handle_fp8 = ours.dispatch(x_fp8, idx, w, num_experts=E, num_sms=sms)[3]
        our_ops = {"dispatch": lambda: ours.dispatch(x, idx, w, num_experts=E, num_sms=sms),
                   "cached dispatch": lambda: ours.dispatch(x, handle=handle),
                   "cached dispatch fp8": lambda: ours.dispatch(x_fp8, handle=handle_fp8),
                   "combine": lambda: ours.combine(recv_x, handle)}

        def their_dispatch():
            per_rank, _, per_expert, in_rank, _ = theirs.get_dispatch_layout(idx, E)
            return theirs.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                   num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
                                   config=dispatch_config)

        their_recv_x, their_idx, their_w, their_per_expert, their_handle, _ = their_dispatch()
        their_ops = {"dispatch": their_dispatch,
                     "cached dispatch": lambda: theirs.dispatch(x, handle=their_handle, config=dispatch_config),
                     "cached dispatch fp8": lambda: theirs.dispatch(x_fp8_theirs, handle=their_handle,
                                                                    config=dispatch_config),
                     "combine": lambda: theirs.combine(their_recv_x, their_handle, config=combine_config)}

        # What each received, compared bit for bit: BF16 rows, FP8 rows and scales, routing, counts per expert.
        ours_fp8, theirs_fp8 = our_ops["cached dispatch fp8"]()[0], their_ops["cached dispatch fp8"]()[0]
        local = recv_idx >= 0
        same = {"bf16 rows": bitwise_equal(recv_x, their_recv_x),
                "fp8 rows": bitwise_equal(ours_fp8[0], theirs_fp8[0]) and bitwise_equal(ours_fp8[1], theirs_fp8[1]),
                "topk_idx": bitwise_equal(recv_idx.long(), their_idx.long()),
                "topk_weights (local slots)": recv_w.shape == their_w.shape and torch.equal(recv_w[local],
                                                                                           their_w[local]),
                "tokens per expert": handle.num_recv_tokens_per_expert_list == list(their_per_expert)}
        combine_diff = (ours.combine(recv_x, handle)[0].float() - theirs.combine(their_recv_x, their_handle,
                                                                                 config=combine_config)[0].float())
        row = {"tokens": num_tokens, "recv_rows": recv_x.shape[0], "same": same,
               "max_combine_diff": combine_diff.abs().max().item() if combine_diff.numel() else 0.0}
        for who, ops in (("moe", our_ops), ("deepep", their_ops)):
            for op, fn in ops.items():
                row[f"{who} {op} us"] = median_time_us(fn, device, num_iters=iters)
                row[f"{who} {op} b2b"] = loop_times(fn, iters, device)[1]
        rows.append(row)
    theirs.destroy()
    ours.destroy()
    return {"rows": rows, "deepep": getattr(deep_ep, "__version__", "(version unknown)"),
            "device": torch.cuda.get_device_name(device)}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and the same bytes (values compared as raw bits, layouts made contiguous)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def report(config: dict, per_rank: list[dict], meta: dict) -> tuple[str, dict]:
    """The markdown (slowest rank per cell) and the JSON record (`meta`, `config`, `table` with one entry per token
    count and op, `per_rank` raw timings)."""
    first = per_rank[0]
    lines = meta_lines(meta)
    lines += [f"moe_comm {moe_comm.__version__} (CUDA backend) beside DeepEP {first['deepep']} (intranode), "
              f"{config['num_ranks']} ranks on {first['device']}; hidden {config['hidden']} bf16, "
              f"top-{config['num_topk']} of {config['num_experts']} experts; {config['num_sms']} SMs each; "
              "slowest rank"
              + ("; SHARING GPU 0 (a check of the script and the rows: the times mean nothing)"
                 if config["share_gpu"] else ""),
              "",
              f"us: median of {config['iters']} calls, each on an idle stream, host issue time included; "
              f"back-to-back: device time per call of one loop of {config['iters']} calls issued ahead of the GPU "
              "(DeepEP's measure). dispatch = fresh layout with a CPU sync (DeepEP: get_dispatch_layout + non-cached "
              "dispatch); fp8 = pre-quantized fp8_block128 rows.",
              "",
              "| tokens | op | moe_comm us | moe_comm back-to-back us | DeepEP us | DeepEP back-to-back us | "
              "back-to-back moe_comm / DeepEP |",
              "|---|---|---|---|---|---|---|"]
    table, checks = [], []
    for i, row in enumerate(first["rows"]):
        slowest = {k: max(r["rows"][i][k] for r in per_rank) for k in row if k.endswith((" us", " b2b"))}
        for op in OPS:
            entry = {"tokens": row["tokens"], "op": op, "moe_us": slowest[f"moe {op} us"],
                     "moe_b2b_us": slowest[f"moe {op} b2b"], "deepep_us": slowest[f"deepep {op} us"],
                     "deepep_b2b_us": slowest[f"deepep {op} b2b"]}
            entry["b2b_ratio"] = entry["moe_b2b_us"] / entry["deepep_b2b_us"]
            table.append(entry)
            lines.append(f"| {row['tokens']} | {op} | {entry['moe_us']:.1f} | {entry['moe_b2b_us']:.1f} | "
                         f"{entry['deepep_us']:.1f} | {entry['deepep_b2b_us']:.1f} | {entry['b2b_ratio']:.2f} |")
        differ = {what: [rank for rank, r in enumerate(per_rank) if not r["rows"][i]["same"][what]]
                  for what in row["same"]}
        same = [what for what, ranks in differ.items() if not ranks]
        diff = max(r["rows"][i]["max_combine_diff"] for r in per_rank)
        checks.append(f"- {row['tokens']} tokens: bitwise the same on every rank: {', '.join(same) or 'nothing'}"
                      + "".join(f"; {what} DIFFER on ranks {ranks}" for what, ranks in differ.items() if ranks)
                      + f"; combined rows differ by at most {diff:.3g} (each sums in its own order)")
    lines += ["", "Checks of the same inputs through both:", *checks]
    record = {"date": meta["date_utc"][:10], "meta": meta, "config": config, "table": table, "per_rank": per_rank}
    return "\n".join(lines), record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-ranks", type=int, default=2, help="ranks, one GPU each (DeepEP: 2, 4 or 8)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--num-experts", type=int, default=256)
    parser.add_argument("--num-topk", type=int, default=8)
    parser.add_argument("--num-sms", type=int, default=24, help="SMs for both (even: DeepEP's rule)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--share-gpu", action="store_true",
                        help="every rank on GPU 0 (a check of the script on one GPU; no meaningful times)")
    parser.add_argument("--json", default=None, help="write the JSON record here (and its plot beside it)")
    parser.add_argument("--md", default=None, help="write the markdown table here")
    args = parser.parse_args()
    if args.num_ranks not in (2, 4, 8):
        parser.error(f"--num-ranks={args.num_ranks}: DeepEP's intranode kernels run on 2, 4 or 8 ranks")
    if args.num_sms < 2 or args.num_sms % 2:
        parser.error(f"--num-sms={args.num_sms} must be even and >= 2 (DeepEP's set_num_sms)")
    if args.iters < 1 or min(args.tokens) < 1:
        parser.error(f"--iters={args.iters} and --tokens={args.tokens} must be >= 1")
    if args.num_experts % args.num_ranks or not 1 <= args.num_topk <= args.num_experts:
        parser.error(f"--num-experts={args.num_experts} must be a multiple of --num-ranks={args.num_ranks}, and "
                     f"--num-topk={args.num_topk} in [1, num_experts]")
    if args.hidden % 128:
        parser.error(f"--hidden={args.hidden} must be a multiple of 128 (the FP8 rows' scale blocks)")
    needed = 1 if args.share_gpu else args.num_ranks
    if torch.cuda.device_count() < needed:
        parser.error(f"{'--share-gpu' if args.share_gpu else f'--num-ranks={args.num_ranks}'} needs {needed} GPU(s); "
                     f"this machine has {torch.cuda.device_count()}")
    if importlib.util.find_spec("deep_ep") is None:
        print("deep_ep is not importable: build DeepEP v1.2.1 intranode-only and put it on PYTHONPATH "
              "(benchmarks/NOTES.md, DESIGN section 7)", file=sys.stderr)
        sys.exit(2)
    config = {"num_ranks": args.num_ranks, "tokens": args.tokens, "hidden": args.hidden,
              "num_experts": args.num_experts, "num_topk": args.num_topk, "num_sms": args.num_sms,
              "iters": args.iters, "share_gpu": args.share_gpu}
    text, record = run_ranks(args.num_ranks, bench_rank, config, report, args.share_gpu)
    write_results(text, record, args.json, args.md, "plot_versus")


if __name__ == "__main__":
    main()
