"""Before/after report of the host path from `scripts/profile_ops.py --json` runs taken in one sitting, alternated
(before, after, before, after: the host's speed drifts between machine starts and within one): per token count and
op the median and the least over the runs of the host us per call (issue time, the GPU not waited for), the median
stream us per call (back to back) and the layout kernel's device us; markdown, JSON and a PNG beside each other
(DESIGN 8.5). The plot shows the least host time (the cost of the path with the least interference).

    python scripts/host_path_report.py --before B1.json B2.json --after A1.json A2.json \\
        --out benchmarks/host-path_h200x1_2026-12-01 [--note "text for the markdown"]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import Counter
from pathlib import Path

LAYOUT_KERNEL = "moe_comm::layout_notify_impl"
# Issue 11's host-path targets (us per call), by op.
TARGETS = {"cached dispatch": 20, "combine": 20, "dispatch without CPU sync": 40}


def summarize(runs: list[dict]) -> dict[tuple[int, str], dict]:
    """(tokens, op) -> medians over the runs of host us, stream us and the layout kernel's us (None without)."""
    cells: dict[tuple[int, str], list[dict]] = {}
    for run in runs:
        for row in run["rows"]:
            cells.setdefault((row["tokens"], row["op"]), []).append(row)
    out = {}
    for key, rows in cells.items():
        layout = [r["kernel_us"][LAYOUT_KERNEL] for r in rows if LAYOUT_KERNEL in r["kernel_us"]]
        out[key] = {"host_us": statistics.median(r["host_us"] for r in rows),
                    "host_us_least": min(r["host_us"] for r in rows),
                    "stream_us": statistics.median(r["stream_us"] for r in rows),
                    "layout_us": statistics.median(layout) if layout else None, "runs": len(rows)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", nargs="+", required=True, help="profile_ops JSON files of the old tree")
    parser.add_argument("--after", nargs="+", required=True, help="profile_ops JSON files of the new tree")
    parser.add_argument("--out", required=True, help="path without extension for .md, .json and .png")
    parser.add_argument("--note", default="", help="a paragraph for the markdown (what changed, the machine)")
    args = parser.parse_args()
    runs = {side: [json.loads(Path(f).read_text()) for f in getattr(args, side)] for side in ("before", "after")}
    started: dict[str, str] = {}  # a run's start time -> its file: the same run given twice would weigh double
    for f, run in zip(args.before + args.after, runs["before"] + runs["after"]):
        date = run["metadata"]["date_utc"]
        if date in started:
            parser.error(f"{f} and {started[date]} are the same run (metadata.date_utc {date})")
        started[date] = f
    summary = {side: summarize(r) for side, r in runs.items()}
    keys = sorted(set(summary["before"]) & set(summary["after"]), key=lambda k: (k[1], k[0]))
    table = [{"tokens": t, "op": op, **{f"{side}_{what}": summary[side][(t, op)][what] for side in summary
                                        for what in ("host_us", "host_us_least", "stream_us", "layout_us")}}
             for t, op in keys]
    meta = {side: runs[side][0]["metadata"] for side in runs}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"metadata": meta, "targets_host_us": TARGETS, "table": table,
                                                    "runs": runs}, indent=1))

    lines = [f"# Host path before and after ({meta['after']['gpu']}, {meta['after']['date_utc'][:10]})", "",
             args.note, "", f"Before: commit {meta['before']['commit']}; after: commit {meta['after']['commit']}. "
             f"torch {meta['after']['torch']}, CUDA {meta['after']['cuda']}, NCCL {meta['after']['nccl']}, Python "
             f"{meta['after']['python']}; {len(runs['before'])} + {len(runs['after'])} runs alternated in one "
             "sitting; host us: median over the runs / least run, the rest medians.", "",
             "Commands (each run wrote its own JSON file; the number of runs of each):", "",
             *(f"    {command}  # x{count}" for command, count in Counter(
                 re.sub(r"--json \S+", "--json RUN.json", run["metadata"]["command"])
                 for side in ("before", "after") for run in runs[side]).items()), "",
             "| op | tokens | host us before | host us after | target | stream us before | stream us after | "
             "layout kernel us before | after |", "|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for r in table:
        lines.append(f"| {r['op']} | {r['tokens']} | {fmt(r['before_host_us'])} / {fmt(r['before_host_us_least'])} | "
                     f"{fmt(r['after_host_us'])} / {fmt(r['after_host_us_least'])} | {TARGETS.get(r['op'], '-')} | "
                     f"{fmt(r['before_stream_us'])} | {fmt(r['after_stream_us'])} | {fmt(r['before_layout_us'])} | "
                     f"{fmt(r['after_layout_us'])} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({op for _, op in keys})
    tokens = sorted({t for t, _ in keys})
    fig, (ax_host, ax_layout) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / (2 * len(tokens))
    for i, t in enumerate(tokens):
        for j, side in enumerate(("before", "after")):
            xs = [k + (2 * i + j) * width for k in range(len(ops))]
            ys = [summary[side][(t, op)]["host_us_least"] for op in ops]
            ax_host.bar(xs, ys, width, label=f"{side}, {t} tokens", color=f"C{i}", alpha=0.45 if j == 0 else 1.0)
    for k, op in enumerate(ops):
        if op in TARGETS:
            ax_host.hlines(TARGETS[op], k, k + 0.8, colors="k", linestyles="--")
    ax_host.set_xticks([k + 0.4 - width / 2 for k in range(len(ops))], ops, rotation=12, fontsize=8)
    ax_host.set_ylabel("host us per call, least run (dashed: issue 11 target)")
    ax_host.legend(fontsize=7)
    for side, style in (("before", "o--"), ("after", "s-")):
        pts = [(t, summary[side][(t, "dispatch")]["layout_us"]) for t in tokens if (t, "dispatch") in summary[side]]
        ax_layout.plot([t for t, _ in pts], [v for _, v in pts], style, label=side)
    ax_layout.set_xscale("log", base=2)
    ax_layout.set_xlabel("tokens per rank")
    ax_layout.set_ylabel("layout + notify kernel, device us")
    ax_layout.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
