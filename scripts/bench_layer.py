"""One Megatron MoE layer, forward + backward, with each dispatcher and expert module, beside its compute-only floor.

DeepSeek-V3's MoE shapes by default (hidden 7168, 256 experts, top-8, moe ffn 2048, SwiGLU, bf16, 4096 tokens per
rank), EP = the number of ranks (one GPU each, NCCL). Per variant: median milliseconds of forward + backward
from a synchronized start, and milliseconds per step of steps issued back to back (the host ahead of the GPU, as in
training; a CPU sync stalls it), both with CUDA events after warm-up (every rank times the same steps, the slowest
rank is reported):

- `alltoall + sequential`: Megatron's alltoall dispatcher and SequentialMLP (a Python loop over local experts);
- `alltoall + grouped`: Megatron's alltoall dispatcher and moe_comm's MoECommGroupedMLP (one grouped GEMM per
  projection), the baseline that differs from the moe_comm rows only in communication;
- `route A (CPU sync)`: moe_comm's dispatcher (expand layout, host counts), grouped experts;
- `route A non-expand`: the same with `MoECommConfig`'s default layout (one row per (token, rank), permuted into
  expert blocks on the receiver by torch ops, summed back per row before the combine);
- `route A sync-free`: expand layout without CPU sync (device counts, worst-case rows), grouped experts;
- `route A sync-free partial`: the same with `deterministic=False`: its expand combines (forward, and the
  dispatch's backward) add each token's rows per rank before they travel (one row per (token, rank) instead of one
  per slot, FP32; one round), not in DESIGN 2.2's slot order, which Megatron parity needs;
- `route A FP8`: route A with FP8 (fp8_block128) on the wire, dequantized on arrival;
- `route B`: Megatron's flex dispatcher on moe_comm (Megatron's own permutation), grouped experts (EP > 1 only);
- `floor`: the compute-only floor: the same layer with dispatch and combine replaced by rows already in place
  (the router on this rank's tokens, then the grouped experts on the rows one route A dispatch produced, same
  counts and probabilities; forward and backward of both): what the layer costs if communication were free. The
  experts' probabilities are constants there, so the floor leaves out their gradient's small reduction: it is a
  little low, and the ratios against it a little pessimistic.

`--share-gpu` runs the ranks on GPU 0 (gloo between them, moe_comm's buffers over CUDA IPC): every variant's code at
EP > 1 on a one-GPU machine, a check before a run on real GPUs; its times mean nothing.

`--num-sms 0 32 132` runs each route A variant once per SM count of moe_comm's kernels (0: the analytical model,
whose count keeps NVLink busy; the expand layout's receivers also write each token once per local expert it chose).

Writes a markdown table, a JSON record (with `moe_comm.testing.bench.run_metadata`) and a PNG bar chart.

    python scripts/bench_layer.py [--num-ranks 2] [--tokens 4096] [--iters 20] [--out DIR] [--variants ...]
                                  [--num-sms 0 ...]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from moe_comm.testing.bench import median_time_us  # noqa: E402
from recipes.megatron_moe.model import ModelDims  # noqa: E402

from bench import run_ranks  # noqa: E402  (scripts/ is sys.path[0] when this file runs as a script)

VARIANTS = ("alltoall + sequential", "alltoall + grouped", "route A (CPU sync)", "route A non-expand",
            "route A sync-free", "route A sync-free partial", "route A FP8", "route B", "floor")
DSV3 = ModelDims(num_layers=1, hidden_size=7168, num_attention_heads=56, num_experts=256, moe_router_topk=8,
                 moe_ffn_hidden_size=2048)


def _layer(variant: str, dims: ModelDims, ep_size: int, seed: int, num_sms: int = 0):
    """The variant's MoE layer on the current GPU (same seed, so every variant routes the same way)."""
    from megatron.core import tensor_parallel

    from moe_comm.integrations.megatron import MoECommConfig
    from recipes.megatron_moe.model import build_moe_layer, transformer_config

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    dispatcher = {"route B": "moe_comm_flex"}.get(variant, "moe_comm" if variant.startswith("route A") else
                                                  "alltoall")
    options = None
    if variant.startswith("route A"):
        options = MoECommConfig(do_expand=variant != "route A non-expand",
                                do_cpu_sync=not variant.startswith("route A sync-free"), num_sms=num_sms,
                                quantize="fp8_block128" if variant == "route A FP8" else None,
                                deterministic=not variant.endswith("partial"))
    config = transformer_config(dims, dispatcher, ep_size, torch.bfloat16, gated_linear_unit=True,
                                activation_func=torch.nn.functional.silu, add_bias_linear=False,
                                use_cpu_initialization=False)  # billions of expert weights: initialize on the GPU
    grouped = variant not in ("alltoall + sequential",)
    return build_moe_layer(config, dims, dispatcher, options, grouped_experts=grouped).cuda()


def _slowest_rank(ms: float) -> float:
    slowest = torch.tensor([ms], device="cuda")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def _time_ms(step, iters: int) -> float:
    """Median ms of `step()` (CUDA events, every rank's GPU idle at each start), the slowest rank's median."""
    return _slowest_rank(median_time_us(step, torch.device("cuda"), num_iters=iters) / 1e3)


def _time_b2b_ms(step, iters: int) -> float:
    """ms per step of `iters` steps issued back to back (CUDA events around all of them, the slowest rank): as in
    training, where the host runs ahead of the GPU unless a step waits for it (a CPU sync)."""
    def steps():
        for _ in range(iters):
            step()

    return _slowest_rank(median_time_us(steps, torch.device("cuda"), num_warmups=0, num_iters=1) / 1e3 / iters)


def bench_rank(rank: int, world_size: int, args: dict) -> dict:
    from moe_comm.testing.shared_gpu import every_buffer_over_ipc

    with every_buffer_over_ipc() if args["share_gpu"] else contextlib.nullcontext():
        return _bench_variants(rank, world_size, args)


def _bench_variants(rank: int, world_size: int, args: dict) -> dict:
    from recipes.megatron_moe import model as recipe_model

    recipe_model.initialize_megatron(world_size, 0)
    dims = dataclasses.replace(DSV3, hidden_size=args["hidden"], num_experts=args["num_experts"],
                               moe_router_topk=args["topk"], moe_ffn_hidden_size=args["ffn"])
    gen = torch.Generator(device="cuda").manual_seed(1 + rank)
    x = torch.randn(args["tokens"], 1, dims.hidden_size, device="cuda", generator=gen).bfloat16()
    grad = torch.randn_like(x)
    results = {}
    for name, variant, num_sms in runs(args["variants"], args["num_sms"]):
        if variant == "route B" and world_size < 2:
            results[name] = {"skipped": "Megatron's flex dispatcher asserts expert parallelism > 1"}
            continue
        restore = None
        if variant == "route B":
            from moe_comm.integrations.megatron import install_flex_dispatcher

            restore = install_flex_dispatcher()
        try:
            layer = _layer("route A (CPU sync)" if variant == "floor" else variant, dims, world_size, args["seed"],
                           num_sms)
            if variant == "floor":
                step = _make_floor(layer, x)
            else:
                def step(layer=layer):
                    x_in = x.detach().requires_grad_()
                    out, _ = layer(x_in)
                    out.backward(grad)
                    layer.zero_grad(set_to_none=True)
            ms = _time_ms(step, args["iters"])
            b2b = _time_b2b_ms(step, args["iters"])
            results[name] = {"ms": ms, "b2b_ms": b2b, "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30}
            if rank == 0:
                print(f"{name}: {ms:.2f} ms, back to back {b2b:.2f} ms", flush=True)
        except (ValueError, TypeError, AssertionError, NotImplementedError) as exc:
            # A variant this Megatron or this machine refuses (a configuration check, the same on every rank): the
            # table keeps the others. Anything else (a device error, out of memory) ends the run.
            results[name] = {"skipped": f"{type(exc).__name__}: {str(exc)[:200]}"}
            if rank == 0:
                print(f"{name}: skipped ({results[name]['skipped']})", flush=True)
        finally:
            if restore is not None:
                restore()
            layer = step = None
            from moe_comm.integrations.megatron import clear_buffers

            clear_buffers()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return results


def runs(variants: list[str], sms: list[int]) -> list[tuple[str, str, int]]:
    """`(name, variant, num_sms)` per measurement: the route A variants once per `--num-sms` value (0: the
    analytical model, `Buffer.get_theoretical_num_sms`), named with the count when it is not 0."""
    out = []
    for v in variants:
        for n in (sms if v.startswith("route A") else [0]):
            out.append((f"{v}, {n} SMs" if n else v, v, n))
    return out


def _make_floor(layer, x: torch.Tensor):
    """Forward + backward of the layer's compute with communication removed: one real route A dispatch fixes the
    rows (and counts and probabilities) the local experts get; each step runs the router on x and the experts on
    those rows, then backward through both (the experts' output gets a fixed random gradient, the router's
    probabilities a zero one, so its backward runs too)."""
    dispatcher = layer.token_dispatcher
    with torch.no_grad():
        probs, routing_map = layer.router(x.view(-1, x.shape[-1]))
        rows, weights = dispatcher.dispatch_preprocess(x, routing_map, probs)
        recv_x, recv_w = dispatcher.token_dispatch(rows, weights)
        permuted, counts, permuted_probs = dispatcher.dispatch_postprocess(recv_x, recv_w)
    rows_in_place = permuted.detach().clone().requires_grad_()
    probs_in_place = permuted_probs.detach().clone()
    grad_rows = torch.randn_like(rows_in_place)

    def step():
        x_step = x.detach().requires_grad_()
        router_probs, _ = layer.router(x_step.view(-1, x.shape[-1]))
        out, _ = layer.experts(rows_in_place, counts, probs_in_place)
        torch.autograd.backward([out, router_probs], [grad_rows, torch.zeros_like(router_probs)])
        layer.zero_grad(set_to_none=True)
        rows_in_place.grad = None

    return step


def report(config: dict, per_rank: list[dict], meta: dict) -> tuple[str, dict]:
    names = [name for name, _, _ in runs(config["variants"], config["num_sms"])]
    variants = [v for v in names if "ms" in per_rank[0][v]]
    ms = {v: max(r[v]["ms"] for r in per_rank) for v in variants}
    b2b = {v: max(r[v]["b2b_ms"] for r in per_rank) for v in variants}
    floor, floor_b2b = ms.get("floor"), b2b.get("floor")
    base = ms.get("alltoall + grouped")
    lines = [f"MoE layer forward + backward, EP{config['num_ranks']} ({meta.get('gpu')}), hidden {config['hidden']}, "
             f"{config['num_experts']} experts, top-{config['topk']}, moe ffn {config['ffn']}, SwiGLU, bf16, "
             f"{config['tokens']} tokens per rank; median of {config['iters']}, slowest rank"
             + ("; SHARING GPU 0 (a check of the code at EP > 1: the times mean nothing)" if config.get("share_gpu")
                else ""),
             f"commit {meta.get('commit')} (dirty: {meta.get('dirty')}), torch {meta.get('torch')}, CUDA "
             f"{meta.get('cuda')}, NCCL {meta.get('nccl')}, Python {meta.get('python')}",
             f"command: `{meta.get('command')}`", "",
             "ms: one step from a synchronized start (the host's issue time before the first GEMM shows); back to "
             f"back: ms per step of {config['iters']} steps issued without waiting (the host runs ahead, as in "
             "training, unless a step syncs).", "",
             "| variant | ms | x floor | x alltoall + grouped | back-to-back ms | x floor (back to back) | peak GiB |",
             "|---|---|---|---|---|---|---|"]
    for v in names:
        r = per_rank[0][v]
        if "skipped" in r:
            lines.append(f"| {v} | skipped: {r['skipped']} | | | | | |")
            continue
        ratio = f"{ms[v] / floor:.3f}" if floor else "-"
        vs = f"{ms[v] / base:.3f}" if base else "-"
        ratio_b2b = f"{b2b[v] / floor_b2b:.3f}" if floor_b2b else "-"
        peak = max(rr[v]["max_memory_gib"] for rr in per_rank)
        lines.append(f"| {v} | {ms[v]:.2f} | {ratio} | {vs} | {b2b[v]:.2f} | {ratio_b2b} | {peak:.1f} |")
    record = {"meta": meta, "config": config, "ms": ms, "b2b_ms": b2b, "per_rank": per_rank}
    return "\n".join(lines), record


def plot(record: dict, path: str) -> None:
    from matplotlib.figure import Figure

    ms, b2b = record["ms"], record["b2b_ms"]
    names = list(ms)
    fig = Figure(figsize=(8, 1.2 + 0.45 * len(names)), dpi=120)
    ax = fig.add_subplot(1, 1, 1)
    colors = ["#999999" if n == "floor" else "#4477aa" if n.startswith("route") else "#cc6677" for n in names]
    y = list(range(len(names)))
    ax.barh([i - 0.2 for i in y], [ms[n] for n in names], height=0.4, color=colors, label="from a synchronized start")
    ax.barh([i + 0.2 for i in y], [b2b[n] for n in names], height=0.4, color=colors, alpha=0.55,
            label="back to back")
    for i, n in enumerate(names):
        ax.text(ms[n], i - 0.2, f" {ms[n]:.2f}", va="center", fontsize=7)
        ax.text(b2b[n], i + 0.2, f" {b2b[n]:.2f}", va="center", fontsize=7)
    ax.set_yticks(y, names)
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="lower right")
    ax.set_xlabel("forward + backward, ms per step (slowest rank; median, or mean of steps back to back)")
    cfg = record["config"]
    ax.set_title(f"MoE layer, EP{cfg['num_ranks']}, {cfg['tokens']} tokens/rank, hidden {cfg['hidden']}, "
                 f"{cfg['num_experts']} experts top-{cfg['topk']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=DSV3.hidden_size)
    parser.add_argument("--num-experts", type=int, default=DSV3.num_experts)
    parser.add_argument("--topk", type=int, default=DSV3.moe_router_topk)
    parser.add_argument("--ffn", type=int, default=DSV3.moe_ffn_hidden_size)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--num-sms", type=int, nargs="+", default=[0],
                        help="SMs of moe_comm's kernels in the route A variants, one run per value (0: the model's)")
    parser.add_argument("--out", default=None, help="write bench_layer.md/.json/.png here")
    parser.add_argument("--share-gpu", action="store_true",
                        help="every rank on GPU 0 (gloo, buffers over CUDA IPC): checks EP > 1 on one GPU, no timings")
    args = parser.parse_args()
    if args.share_gpu and torch.cuda.device_count() < 1:
        parser.error("--share-gpu puts every rank on GPU 0 and needs CUDA; this torch sees no GPU")
    if torch.cuda.device_count() < args.num_ranks and not args.share_gpu:
        parser.error(f"--num-ranks={args.num_ranks} needs as many GPUs, found {torch.cuda.device_count()}")
    if len(set(args.num_sms)) < len(args.num_sms) or any(n < 0 or n == 1 for n in args.num_sms):
        parser.error(f"--num-sms={args.num_sms}: distinct values, each 0 (the model's count) or at least 2 (a "
                     f"sender and a receiver block)")
    config = {k: getattr(args, k) for k in ("tokens", "hidden", "num_experts", "topk", "ffn", "iters", "seed",
                                            "variants", "num_sms")}
    config.update(num_ranks=args.num_ranks, share_gpu=args.share_gpu)
    text, record = run_ranks(args.num_ranks, bench_rank, config, report, args.share_gpu)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_layer.json"), "w") as f:
            json.dump(record, f, indent=1)
        with open(os.path.join(args.out, "bench_layer.md"), "w") as f:
            f.write(text + "\n")
        try:
            plot(record, os.path.join(args.out, "bench_layer.png"))
        except ImportError:
            print("plot skipped: matplotlib is not importable")


if __name__ == "__main__":
    main()
