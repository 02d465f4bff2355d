"""Multi-node dispatch/combine on paper (issue 15, item 5): `moe_comm.sizing`'s time model for 1x8, 2x8 and 4x8
H100/H200 hosts with one 400 Gb/s NIC per GPU, beside DeepEP's published internode figures and the SM model's counts.

No multi-host machine was available: every number here is the model's (`sizing.estimate_time`,
`sizing.estimate_num_sms`), computed by hand-checkable formulas from named assumptions; the markdown lists them.
Tables:
- the model: EP8 (one host, NVLink only), EP16 (2x8), EP32 (4x8) on H100 and H200 (both NVLink 4, 18 links, so the
  same numbers), BF16 and FP8 dispatch, combine with and without partial sums at the relay;
- beside DeepEP V1 (docs/legacy.md, H800 with ~160 GB/s NVLink, 4096 tokens, FP8 dispatch, BF16 combine): the model
  on H800 links and on H100/H200 links, in DeepEP's own metric;
- beside DeepEP V2 (README, SM90, 8192 tokens): the model at 8192 tokens;
- direct mode over RDMA (no dedup per host) against hybrid, to show what the dedup buys.

Writes OUT.md, OUT.json (run metadata as `meta`) and, when matplotlib is importable, OUT.png; OUT defaults to
`benchmarks/multinode-model_analytical_<today>` (a model: no hardware ran it).

    python scripts/multinode_model.py [--tokens 4096] [--hidden 7168] [--num-experts 256] [--num-topk 8]
                                      [--out PREFIX] [--no-plot]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys

from moe_comm import sizing

ROOT = pathlib.Path(__file__).resolve().parents[1]
GPUS_PER_HOST = 8

# name -> per-link NVLink rates and SMs; H100 and H200 share NVLink 4 (18 x 26.5625 GB/s per direction).
HARDWARE = {
    "H100": dict(link_gbs=sizing.H100_NVLINK_LINK_GBS, num_device_sms=sizing.H100_NUM_SMS),
    "H200": dict(link_gbs=sizing.H200_NVLINK_LINK_GBS, num_device_sms=sizing.H200_NUM_SMS),
}
# DeepEP V1's test machine: H800, "~160 GB/s NVLink maximum bandwidth" (docs/legacy.md), taken as the usable rate.
H800_NVLINK_GBS = 160.0
H800_NUM_SMS = 132
# (label, hosts): EP = hosts x GPUS_PER_HOST.
SCALES = (("EP8", 1), ("EP16", 2), ("EP32", 4))
OPS = ("dispatch BF16", "dispatch FP8", "combine", "combine, no partial sums")

# Published figures, "bottleneck bandwidth" per GPU in GB/s, as each README defines it (see SOURCES).
DEEPEP_V1 = {  # H800, CX7 400 Gb/s, 4096 tokens, hidden 7168, top-8 (top-4 groups), FP8 dispatch, BF16 combine
    ("EP8", "dispatch FP8"): (153, "NVLink"), ("EP8", "combine"): (158, "NVLink"),
    ("EP16", "dispatch FP8"): (43, "RDMA"), ("EP16", "combine"): (43, "RDMA"),
    ("EP32", "dispatch FP8"): (58, "RDMA"), ("EP32", "combine"): (57, "RDMA"),
}
DEEPEP_V2 = {  # SM90, CX7, 8192 tokens, hidden 7168, top-8, FP8 dispatch, BF16 combine; (GB/s, #SMs)
    ("EP16", "dispatch FP8"): (90, 12), ("EP16", "combine"): (81, 12),
    ("EP32", "dispatch FP8"): (61, 6), ("EP32", "combine"): (61, 6),
}
DEEPEP_V2_TOKENS = 8192
SOURCES = {
    "repository": "https://github.com/deepseek-ai/DeepEP",
    "commit": "dd758caf451848bd150e1046af3d0a73e5fff38d",
    "deepep_v1_figures": "docs/legacy.md, 'Normal kernels with NVLink and RDMA forwarding' (the V1 README's table "
                         "since commit 3b1045d, 2025-04-22; also README.md at tag v1.2.1)",
    "deepep_v1_metric": "tests/legacy/test_internode.py and test_intranode.py (tests/ at v1.2.1)",
    "deepep_v2_figures": "README.md, 'Performance'",
}


def topology(hardware: str, num_hosts: int, hybrid: bool = True) -> sizing.Topology:
    """`num_hosts` hosts of 8 GPUs on `hardware`'s links (or H800's, DeepEP V1's machine), 400 Gb/s NICs."""
    num_ranks = num_hosts * GPUS_PER_HOST
    num_scaleout_groups = num_hosts if hybrid else 1
    if hardware == "H800":
        return sizing.Topology(num_ranks, GPUS_PER_HOST, num_scaleout_groups, H800_NVLINK_GBS,
                               sizing.DEFAULT_RDMA_GBS, H800_NUM_SMS)
    return sizing.Topology.from_links(num_ranks, GPUS_PER_HOST, num_scaleout_groups, **HARDWARE[hardware])


def estimate(op: str, topo: sizing.Topology, config: dict) -> sizing.TimeEstimate:
    """The model's estimate of `op` (one of `OPS`) for `config`'s shape."""
    args = (topo, config["num_experts"], config["num_topk"], config["tokens"], config["hidden"])
    if op.startswith("dispatch"):
        return sizing.estimate_time(*args, use_fp8=op == "dispatch FP8")
    return sizing.estimate_time(*args, "combine", allow_multiple_reduction=op == "combine")


def row(hardware: str, scale: str, op: str, est: sizing.TimeEstimate, **extra) -> dict:
    """One table row: where, what, and every number of the estimate the tables show."""
    return {"gpu": hardware, "ep": scale, "op": op, "mode": est.mode, "tokens": est.num_tokens,
            "bytes_per_row": est.bytes_per_row, "rdma_bytes": est.rdma_bytes, "nvlink_bytes": est.nvlink_bytes,
            "rdma_gbs": est.rdma_gbs, "nvlink_gbs": est.nvlink_gbs,
            "rdma_us": est.rdma_us, "nvlink_us": est.nvlink_us, "latency_us": est.latency_us,
            "total_us": est.total_us, "bottleneck": est.bottleneck, "logical_rdma_gbs": est.logical_rdma_gbs,
            "wire_rdma_gbs": est.wire_rdma_gbs, "logical_nvlink_gbs": est.logical_nvlink_gbs,
            "num_sms": est.sms.num_sms, **extra}


def build_tables(config: dict) -> dict:
    """Every table of the report, from the model alone (no torch, no GPU).

    Arguments:
        config: `tokens`, `hidden`, `num_experts`, `num_topk`.

    Returns:
        `{"model", "deepep_v1", "deepep_v2", "direct_over_rdma"}`, each a list of row dicts (`row`).
    """
    model = []
    for hardware in HARDWARE:
        for scale, num_hosts in SCALES:
            topo = topology(hardware, num_hosts)
            for op in OPS:
                if op == "combine, no partial sums" and not topo.is_hybrid:
                    continue  # direct mode has no partial sums: the same as "combine"
                published = DEEPEP_V1.get((scale, op))
                model.append(row(hardware, scale, op, estimate(op, topo, config),
                                 deepep_v1_gbs=published[0] if published else None,
                                 deepep_v1_link=published[1] if published else None))
    # DeepEP V1's published rows, as it measured them (FP8 dispatch, combine with partial sums), on both machines'
    # links.
    # DeepEP's metric is the published link's: all received rows (NVLink, EP8) or one row per distinct host (RDMA);
    # under the balanced gate the rows for the rank itself (1/8) or its own host (1/S) never cross that link.
    deepep_v1 = []
    for scale, num_hosts in SCALES:
        for op in ("dispatch FP8", "combine"):
            published_gbs, link = DEEPEP_V1[(scale, op)]
            wire_share = 1 - 1 / (num_hosts if link == "RDMA" else GPUS_PER_HOST)
            for hardware in ("H800", "H200"):
                est = estimate(op, topology(hardware, num_hosts), config)
                deepep_v1.append(row(
                    hardware, scale, op, est, deepep_v1_gbs=published_gbs, deepep_v1_link=link,
                    model_gbs=est.logical_rdma_gbs if link == "RDMA" else est.logical_nvlink_gbs,
                    model_wire_gbs=est.wire_rdma_gbs if link == "RDMA" else est.wire_nvlink_gbs,
                    published_wire_gbs=published_gbs * wire_share))
    v2_config = dict(config, tokens=DEEPEP_V2_TOKENS)
    deepep_v2 = [row("H200", scale, op, estimate(op, topology("H200", num_hosts), v2_config),
                     deepep_v2_gbs=DEEPEP_V2[(scale, op)][0], deepep_v2_num_sms=DEEPEP_V2[(scale, op)][1])
                 for scale, num_hosts in SCALES[1:] for op in ("dispatch FP8", "combine")]
    op = "dispatch BF16"
    direct_over_rdma = [row("H200", scale, op, estimate(op, topology("H200", num_hosts, hybrid), config))
                        for scale, num_hosts in SCALES[1:] for hybrid in (False, True)]
    return {"model": model, "deepep_v1": deepep_v1, "deepep_v2": deepep_v2, "direct_over_rdma": direct_over_rdma}


def _num(value: float | None, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def _mb(num_bytes: float) -> str:
    return f"{num_bytes / 1e6:.1f}"


def render_markdown(config: dict, tables: dict, meta: dict, plot_name: str) -> str:
    """The report: provenance, the tables, the formulas, the assumptions, the sources."""
    commit = "not a checkout" if meta["commit"] is None else meta["commit"][:12] + (" (dirty)" if meta["dirty"] else "")
    shape = (f"{config['tokens']} tokens per rank, hidden {config['hidden']}, top-{config['num_topk']} of "
             f"{config['num_experts']} experts")
    lines = [
        "# Multi-node dispatch/combine on paper: 2x8 and 4x8 H100/H200 hosts, 400 Gb/s per GPU",
        "",
        f"commit {commit}; {meta['date_utc']}; Python {meta['python']}; computed on {meta['hostname']} (no GPU needed)",
        "",
        f"    {meta['command']}",
        "",
        "**A model, not a measurement.** No machine with more than one host was available to this project:",
        "no multi-host run was possible. Every number below comes from `moe_comm.sizing`'s time model",
        "(`estimate_time`) and SM model (`estimate_num_sms`) under the assumptions listed at the end. DeepEP's",
        "figures are theirs, published, measured on other hardware (H800 for V1).",
        "",
        f"Shape: {shape}.",
        f"Rows: BF16 {sizing.get_bytes_per_row(config['hidden'])} bytes, FP8 with an fp32 scale per 128 elements",
        f"{sizing.get_bytes_per_row(config['hidden'], True)} bytes; combine is BF16. H100 and H200 have the same",
        "NVLink 4 (18 links x 26.5625 GB/s per direction, 0.9 of it usable: 430.3 GB/s) and the same 132 SMs, so",
        "their rows are the same numbers; H200's larger, faster HBM is not in the model.",
        "",
        "## The model",
        "",
        "Per token of a rank, `Et = E(num_ranks)` distinct ranks and `Es = E(hosts)` distinct hosts are reached",
        "(`expected_num_groups`, balanced gate). Rows per token:",
        "- one host (direct): NVLink `Et * 7/8`; no RDMA;",
        "- `S` hosts of `U = 8` (hybrid): RDMA `Es * (1 - 1/S)` (once per remote host, to the same local index),",
        "  NVLink `Et * (1 - 1/U)` (the relay forwards every copy but its own); combine with partial sums at the",
        "  relay: the same rows reversed; without them (the bitwise-deterministic order): RDMA `Et * (1 - 1/S)`.",
        "",
        "Bytes per GPU = tokens x rows x row bytes, the same sent and received on each link class. Leg time =",
        f"bytes / rate, NVLink 430.3 GB/s, RDMA 50 GB/s x {sizing.RDMA_EFFICIENCY} = "
        f"{sizing.DEFAULT_RDMA_GBS * sizing.RDMA_EFFICIENCY:g} GB/s. Total = slowest leg (the legs overlap) +",
        f"{sizing.OP_LATENCY_US:g} us per operation + {sizing.RDMA_HOP_LATENCY_US:g} us when rows cross the network.",
        "RDMA GB/s (DeepEP's) = tokens x `Es` x row bytes / total: DeepEP V1's `tests/test_internode.py` counts one",
        "row per distinct destination host *including the sender's own*, which never crosses the NIC, so it reads",
        "`S / (S - 1)` times the wire rate (2x at EP16, 4/3 at EP32); V2's README says the same (\"logical",
        "bandwidth ... contains local rank traffic\"). Wire GB/s = RDMA bytes / total. NVLink GB/s (DeepEP's) = all",
        "received rows (own included) / total. DeepEP times its dispatch or combine kernel alone (the notify kernel",
        "apart); the model's total includes its fixed term. SMs: `estimate_num_sms` (golden 12 and 6 on 2x8 and 4x8).",
        "",
        f"## The model, {shape}",
        "",
        "| GPU | EP | op | RDMA MB/GPU | NVLink MB/GPU | RDMA us | NVLink us | fixed us | total us | bottleneck "
        "| RDMA GB/s (DeepEP's) | RDMA GB/s (wire) | NVLink GB/s (DeepEP's) | SMs | DeepEP V1 published (H800) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in tables["model"]:
        published = "-" if r["deepep_v1_gbs"] is None else f"{r['deepep_v1_gbs']} GB/s ({r['deepep_v1_link']})"
        lines.append(
            f"| {r['gpu']} | {r['ep']} | {r['op']} | {_mb(r['rdma_bytes'])} | {_mb(r['nvlink_bytes'])} | "
            f"{r['rdma_us']:.1f} | {r['nvlink_us']:.1f} | {r['latency_us']:.0f} | {r['total_us']:.1f} | "
            f"{r['bottleneck']} | {_num(r['logical_rdma_gbs'])} | {r['wire_rdma_gbs']:.1f} | "
            f"{r['logical_nvlink_gbs']:.1f} | {r['num_sms']} | {published} |")
    lines += [
        "",
        "## Beside DeepEP V1's published internode figures",
        "",
        "DeepEP V1 measured on H800 (NVLink \"~160 GB/s\" per its README, a third of H100's) with CX7 400 Gb/s, 4096",
        "tokens, hidden 7168, top-8 of 256 with top-4 groups, FP8 dispatch and BF16 combine, 24 SMs. At EP16 and EP32",
        "there are 2 and 4 hosts, so `min(hosts, 4)` groups is every host and its gate is the balanced one modeled",
        "here. The model on H800 links takes NVLink at 160 GB/s as is.",
        "",
        "GB/s per GPU in DeepEP's metric for the link it published (NVLink at EP8, RDMA across hosts), and on the",
        "wire: the model's bytes that cross that link / total; the published figure times the share of its rows",
        "that cross it under the balanced gate (`1 - 1/8` for NVLink, `1 - 1/S` for RDMA).",
        "",
        "| EP | op | links | bottleneck | total us | link | model, DeepEP's metric | DeepEP V1 published | "
        "model, wire | published, wire |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in tables["deepep_v1"]:
        lines.append(f"| {r['ep']} | {r['op']} | {r['gpu']} | {r['bottleneck']} | {r['total_us']:.1f} | "
                     f"{r['deepep_v1_link']} | {r['model_gbs']:.1f} | {r['deepep_v1_gbs']} | "
                     f"{r['model_wire_gbs']:.1f} | {r['published_wire_gbs']:.1f} |")
    lines += ["", "Where the model's time goes (FP8 dispatch; per token, rows on each leg):", ""]
    for r in tables["deepep_v1"]:
        if r["op"] == "dispatch FP8" and r["mode"] == "hybrid":
            row_bytes = r["tokens"] * r["bytes_per_row"]
            lines.append(f"- {r['ep']} on {r['gpu']} links: {r['nvlink_bytes'] / row_bytes:.2f} NVLink rows at "
                         f"{r['nvlink_gbs']:.1f} GB/s ({r['nvlink_us']:.0f} us), {r['rdma_bytes'] / row_bytes:.2f} "
                         f"RDMA rows at {r['rdma_gbs']:.1f} GB/s ({r['rdma_us']:.0f} us): {r['bottleneck']}-bound.")
    lines += [
        "",
        f"## Beside DeepEP V2's README ({DEEPEP_V2_TOKENS} tokens)",
        "",
        "V2's figures: SM90 (the part is not named), CX7, 8192 tokens, hidden 7168, top-8, FP8 dispatch, BF16",
        "combine, logical bandwidth; its rows also count top-k ids and weights (~1 % more bytes). Model on",
        "H100/H200 links at 8192 tokens:",
        "",
        "| EP | op | total us | RDMA GB/s (DeepEP's), model | DeepEP V2 published | SMs, model | SMs, V2 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in tables["deepep_v2"]:
        lines.append(f"| {r['ep']} | {r['op']} | {r['total_us']:.1f} | {r['logical_rdma_gbs']:.1f} | "
                     f"{r['deepep_v2_gbs']} | {r['num_sms']} | {r['deepep_v2_num_sms']} |")
    lines += [
        "",
        "## What the dedup per host buys (H200, BF16 dispatch)",
        "",
        "Direct mode across hosts sends a token's row to every rank it reaches, remote ones over the NIC:",
        "`Et * (num_ranks - 8) / num_ranks` rows per token instead of hybrid's `Es * (1 - 1/S)`.",
        "",
        "| EP | mode | RDMA rows per token | RDMA MB/GPU | total us | SMs |",
        "|---|---|---|---|---|---|",
    ]
    for r in tables["direct_over_rdma"]:
        rows_per_token = r["rdma_bytes"] / (r["tokens"] * r["bytes_per_row"]) if r["tokens"] else 0.0
        lines.append(f"| {r['ep']} | {r['mode']} | {rows_per_token:.3f} | {_mb(r['rdma_bytes'])} | "
                     f"{r['total_us']:.1f} | {r['num_sms']} |")
    lines += ["", "## Assumptions", "", *ASSUMPTIONS, "", "## Not modeled", "", *NOT_MODELED, "", "## Sources", ""]
    lines += [f"- DeepEP ({SOURCES['repository']}, read at commit {SOURCES['commit'][:12]}): V1 figures from "
              f"{SOURCES['deepep_v1_figures']}; V1's metric from {SOURCES['deepep_v1_metric']}; V2 figures from "
              f"{SOURCES['deepep_v2_figures']}.",
              "- moe_comm: DESIGN 2.4 (SM model), 8.3 (hybrid path); the fixed cost from",
              "  `benchmarks/dispatch-combine_h200x2_2026-11-30-run2.md`.",
              "", f"Plot: `{plot_name}` (DeepEP-metric RDMA GB/s beside the published figures; modeled time per leg)."]
    return "\n".join(lines) + "\n"


ASSUMPTIONS = [
    "- Balanced gate: each token picks top-k distinct experts uniformly; experts contiguous, equal per rank; every",
    "  rank dispatches the same number of tokens. So every GPU sends and receives the same bytes per link class.",
    "- 8 GPUs per host on NVLink 4 (430.3 GB/s per direction usable: 0.9 x 18 x 26.5625); H800: 160 GB/s.",
    "- One 400 Gb/s NIC per GPU (50 GB/s), rail-optimized fabric (GPU i of every host on one rail, so the hop to",
    f"  the same local index never leaves its rail), {sizing.RDMA_EFFICIENCY} of the line rate for rows: DeepEP V2's",
    "  90 and 61 GB/s logical at EP 8x2 and 8x4 are 45 and 45.75 GB/s on the wire.",
    "- No congestion, no other traffic on NVLink or the NIC; NVLink and the NIC are separate paths, and chunks",
    "  pipeline through the two legs, so the slower leg sets the time.",
    f"- Fixed cost {sizing.OP_LATENCY_US:g} us per operation: moe_comm's cached dispatch / combine at 128 tokens on",
    "  2x H200 (33 / 37 us back to back) less their ~4 us of rows at NVLink speed.",
    f"- {sizing.RDMA_HOP_LATENCY_US:g} us more when rows cross the network: an assumption (not measured here) for",
    "  the NIC's latency, the completion signal, and the pipeline's fill (16 BF16 rows at 45 GB/s: 5.1 us).",
    "- SMs and HBM do not limit: the SM model sizes the SMs to keep the bottleneck link busy (with 1.25 headroom),",
    "  and the local copies and reductions run on HBM at several TB/s.",
    "- Payload only: BF16 2 x hidden bytes, FP8 hidden + 4 x hidden / 128; metadata not counted (as DeepEP's",
    "  figures do not count it).",
]
NOT_MODELED = [
    "- Gate imbalance, hot experts, and group-limited routing (DeepSeek-V3's top-4 groups; a no-op at 2 and 4 hosts",
    "  in DeepEP's test, which is why EP64 is left out here).",
    "- The count exchange's size and its host sync (fresh dispatch), the host's issue time, CUDA graph effects.",
    "- NCCL's own costs on the path moe_comm builds (issue 15): proxy thread, chunking, channel count, and its",
    "  latency across hosts, which likely exceeds the fixed terms above at small token counts.",
    "- Congestion, adaptive routing, PCIe limits between GPU and NIC, the traffic class (`sl_idx`).",
    "- Expand mode (one row per slot), and the relay's partial-sum precision (fp32 rounding).",
]


def plot(tables: dict, path: str | pathlib.Path) -> None:
    """Two panels: DeepEP-metric RDMA GB/s beside DeepEP V1's figures; modeled time per leg on H200."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_gbs, ax_us) = plt.subplots(1, 2, figsize=(14, 5))
    v1 = [r for r in tables["deepep_v1"] if r["deepep_v1_link"] == "RDMA"]
    cases = list(dict.fromkeys((r["ep"], r["op"]) for r in v1))
    series = {
        "model, H800 links": [r["model_gbs"] for r in v1 if r["gpu"] == "H800"],
        "model, H100/H200 links": [r["model_gbs"] for r in v1 if r["gpu"] == "H200"],
        "DeepEP V1 published (H800)": [DEEPEP_V1[case][0] for case in cases],
    }
    width = 0.8 / len(series)
    for series_idx, (label, values) in enumerate(series.items()):
        xs = [case_idx + (series_idx - (len(series) - 1) / 2) * width for case_idx in range(len(cases))]
        ax_gbs.bar(xs, values, width, label=label)
    ax_gbs.set_xticks(range(len(cases)), [f"{ep}\n{op}" for ep, op in cases])
    ax_gbs.set_ylabel("RDMA GB/s per GPU, DeepEP's metric (own host counted)")
    ax_gbs.set_title("4096 tokens, hidden 7168, top-8 of 256")
    ax_gbs.legend()

    h200 = [r for r in tables["model"] if r["gpu"] == "H200"]
    legs = {"NVLink leg": "nvlink_us", "RDMA leg": "rdma_us", "total": "total_us"}
    width = 0.8 / len(legs)
    for leg_idx, (label, key) in enumerate(legs.items()):
        xs = [row_idx + (leg_idx - (len(legs) - 1) / 2) * width for row_idx in range(len(h200))]
        ax_us.bar(xs, [r[key] for r in h200], width, label=label)
    ax_us.set_xticks(range(len(h200)), [f"{r['ep']} {r['op']}" for r in h200], rotation=45, ha="right", fontsize=8)
    ax_us.set_ylabel("modeled us")
    ax_us.set_title("H200 (= H100), the model's legs")
    ax_us.legend()
    fig.suptitle("moe_comm.sizing time model: no multi-host run, numbers on paper")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--num-experts", type=int, default=256)
    parser.add_argument("--num-topk", type=int, default=8)
    parser.add_argument("--out", default=None, help="path prefix: writes OUT.md, OUT.json and OUT.png (default: "
                        "benchmarks/multinode-model_analytical_<today>)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    if args.tokens < 1:
        parser.error(f"--tokens={args.tokens} must be >= 1")
    config = {"tokens": args.tokens, "hidden": args.hidden, "num_experts": args.num_experts,
              "num_topk": args.num_topk}
    try:
        tables = build_tables(config)
    except ValueError as exc:  # the model's own checks (num_experts a multiple of 32 ranks, top-k, hidden)
        parser.error(str(exc))
    # Imports torch, for the versions it records; the model itself needs none.
    from moe_comm.testing.bench import run_metadata

    meta = run_metadata(sys.argv if argv is None else ["scripts/multinode_model.py", *argv])
    out = args.out or str(ROOT / "benchmarks" / f"multinode-model_analytical_{meta['date_utc'][:10]}")
    text = render_markdown(config, tables, meta, pathlib.Path(out).name + ".png")
    print(text)
    constants = {name: getattr(sizing, name) for name in
                 ("RDMA_EFFICIENCY", "OP_LATENCY_US", "RDMA_HOP_LATENCY_US", "NVLINK_EFFICIENCY", "DEFAULT_RDMA_GBS")}
    record = {"date": meta["date_utc"][:10], "meta": meta, "config": config, "constants": constants,
              "h800_nvlink_gbs": H800_NVLINK_GBS, "sources": SOURCES, "assumptions": ASSUMPTIONS,
              "not_modeled": NOT_MODELED, **tables}
    out_md, out_json, out_png = (pathlib.Path(out + suffix) for suffix in (".md", ".json", ".png"))
    out_md.write_text(text)
    out_json.write_text(json.dumps(record, indent=2) + "\n")
    if args.no_plot:
        return
    if importlib.util.find_spec("matplotlib") is None:
        print("plot skipped: matplotlib is not importable")
        return
    plot(tables, out_png)
    print(f"plot: {out_png}")


if __name__ == "__main__":
    main()
