"""PNG plots of result JSON files, to lie beside their tables in benchmarks/ (DESIGN section 8.5).

A bench record (`scripts/bench.py --json`): time per call against tokens for the dispatch with CPU sync, the cached
dispatch, both FP8 dispatches and the combine, with the NCCL (gloo on CPU) baseline of the same run, on log-log
axes; back-to-back device time on CUDA, one isolated call where there is none (CPU). A second panel, when the run
has one, shows the SM sweep at the largest token count beside the analytical SM count and that size's baseline.
Every cell is the slowest rank's, as in the table.

An overlap record (`scripts/bench_overlap.py --json`): per op, bars of a GEMM's time beside it in flight over the
GEMM alone. A primitives record (`scripts/bench_primitives.py --json`): GB/s against size, moe_comm and NCCL, and
the GEMM beside each.

A side-by-side record (`scripts/bench_deepep.py --json`): back-to-back time against tokens per op, moe_comm and
DeepEP V1.

A floor record (a microbenchmark's rows, e.g. `benchmarks/fanout-floor_*.json`): GB/s per SM against blocks, a
line per method and a panel per case. A candidates record (`benchmarks/microbench/expert_sum.py --json`): per case,
a bar of each timing against the case's floor.

Recipe metrics (`recipes/megatron_moe/train.py --metrics-json`, one file per dispatcher of the same preset and
seed): loss and tokens/s per step, one line per file; with several runs a third panel has each run's |loss
difference| from the first run's at the steps both have. Runs gathered in one file under `runs`, each with its
`label` (`benchmarks/loss-curves_*.json`), plot the same way.

    python scripts/plot_results.py RESULT.json [-o RESULT.png]
    python scripts/plot_results.py METRICS.json [METRICS.json ...] -o OUT.png
"""

from __future__ import annotations

import argparse
import json
import pathlib

# op in the bench table -> label and style; FP8 shares the BF16 dispatch's shape in another colour
BENCH_LINES = {
    "dispatch": ("dispatch (CPU sync)", dict(color="C0", linestyle="-", marker="o")),
    "cached dispatch": ("cached dispatch", dict(color="C0", linestyle="--", marker="s")),
    "dispatch fp8": ("FP8 dispatch (CPU sync)", dict(color="C2", linestyle="-", marker="o")),
    "cached dispatch fp8": ("cached FP8 dispatch", dict(color="C2", linestyle="--", marker="s")),
    "cached dispatch bf16 via fp8": ("cached BF16 dispatch, FP8 wire", dict(color="C3", linestyle="--", marker="d")),
    "combine": ("combine", dict(color="C1", linestyle="-", marker="^")),
    "combine slot order": ("combine, slot order", dict(color="C1", linestyle="--", marker="v")),
}
BASELINE_LINES = {
    "dispatch": ("dispatch", dict(color="0.3", linestyle=":", marker="x")),
    "combine": ("combine", dict(color="0.3", linestyle="-.", marker="+", markersize=9)),
}


def bench_series(record: dict) -> tuple[dict, dict, bool]:
    """Time per call against tokens, per op and per baseline op.

    Arguments:
        record: a bench JSON record.

    Returns:
        `(ops, baselines, back_to_back)`: `{op: [(tokens, us), ...]}` for moe_comm's ops and for the baseline's
        dispatch and combine; `back_to_back` says whether the times are back-to-back device times (else one
        isolated call each).
    """
    back_to_back = all(row.get("back_to_back_us") is not None for row in record["table"])
    key = "back_to_back_us" if back_to_back else "us"
    ops, baselines = {}, {}
    for row in record["table"]:
        ops.setdefault(row["op"], []).append((row["tokens"], row[key]))
        base = row.get(f"baseline_{key}")
        if row["op"] in BASELINE_LINES and base is not None:
            baselines.setdefault(row["op"], []).append((row["tokens"], base))
    return ops, baselines, back_to_back


def sweep_series(record: dict) -> dict:
    """The SM sweep, slowest rank per point: `{op: [(num_sms, us), ...]}` (empty when the run has none)."""
    per_rank = record.get("per_rank") or []
    series = {}
    for i, point in enumerate(per_rank[0]["sweep"] if per_rank else []):
        for op in ("cached dispatch", "combine"):
            series.setdefault(op, []).append((point["num_sms"], max(r["sweep"][i][op] for r in per_rank)))
    return series


def _axes(ax, xs: list[int], log_x: bool) -> None:
    """Log y (log2 x when `log_x`) with the measured x values as ticks and plain numbers on both axes."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted(set(xs)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else ""))
    ax.grid(True, which="both", alpha=0.3)


def _title(record: dict) -> str:
    """Two lines: the run's shape, then where it came from (commit, versions, date)."""
    config, meta = record["config"], record.get("meta")
    shape = (f"{record.get('device', '?')}, {config['num_ranks']} ranks over {config['pg_backend']}, backend "
             f"{record['per_rank'][0]['backend']}; hidden {config['hidden']} bf16, top-{config['num_topk']} of "
             f"{config['num_experts']} experts")
    if meta is None:
        return f"{shape}\n{record.get('date', '')}, a record without run metadata (its markdown names the commit)"
    # .get: records whose `meta` was stated afterwards (dispatch-combine_h200x2_2026-11-30*.json) lack `dirty`, `cuda`
    commit = ("no checkout" if meta.get("commit") is None else
              meta["commit"][:10] + (" (dirty)" if meta.get("dirty") else ""))
    return (f"{shape}\ncommit {commit}, torch {meta.get('torch', '?')}, CUDA {meta.get('cuda') or '-'}, NCCL "
            f"{meta.get('nccl') or '-'}, {meta.get('date_utc', '')[:10]}")


def plot_bench(record: dict, path: str | pathlib.Path) -> None:
    """Write the bench record's plot to `path` (PNG).

    Arguments:
        record: a bench JSON record (`scripts/bench.py --json`, old records without `meta` too).
        path: where the PNG goes.
    """
    from matplotlib.figure import Figure

    ops, baselines, back_to_back = bench_series(record)
    sweep = sweep_series(record)
    base_name = "NCCL" if record["config"]["pg_backend"] == "nccl" else record["config"]["pg_backend"]
    fig = Figure(figsize=(13, 5.2) if sweep else (7.5, 5.2), layout="constrained")
    axes = fig.subplots(1, 2 if sweep else 1, squeeze=False)[0]
    ax = axes[0]
    for op, (label, style) in BENCH_LINES.items():
        if op in ops:
            ax.plot(*zip(*ops[op]), label=label, **style)
    for op, (label, style) in BASELINE_LINES.items():
        if op in baselines:
            ax.plot(*zip(*baselines[op]), label=f"{base_name} baseline {label}", **style)
    _axes(ax, [t for series in ops.values() for t, _ in series], log_x=True)
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("us per call, back to back (device time)" if back_to_back else
                  "us per call, one isolated call (host included)")
    ax.set_title("time per call against tokens (lower is better)", fontsize=10)
    ax.legend(fontsize=8)
    if sweep:
        ax = axes[1]
        tokens = max(record["config"]["tokens"])
        for op in ("cached dispatch", "combine"):
            label, style = BENCH_LINES[op]
            ax.plot(*zip(*sweep[op]), label=label, **style)
        for op, (label, style) in BASELINE_LINES.items():
            at = dict(baselines.get(op, [])).get(tokens)
            if at is not None:
                ax.axhline(at, color=style["color"], linestyle=style["linestyle"], linewidth=1,
                           label=f"{base_name} baseline {label}")
        theory = record["per_rank"][0].get("theoretical_num_sms")
        if theory is not None:
            ax.axvline(theory, color="C3", linestyle="--", linewidth=1, label=f"analytical num_sms ({theory})")
        _axes(ax, [n for n, _ in sweep["combine"]], log_x=False)
        ax.set_xlabel("SMs")
        ax.set_ylabel("us per call, back to back (device time)" if back_to_back else
                      "us per call, one isolated call (host included)")
        ax.set_title(f"SM sweep at {tokens} tokens", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(_title(record), fontsize=10)
    fig.savefig(path, dpi=110)


def plot_overlap(record: dict, path: str | pathlib.Path) -> None:
    """Write an overlap record's bars (`scripts/bench_overlap.py --json`) to `path` (PNG): per op, the GEMM's time
    beside each way of running it, relative to the GEMM alone (1.0: no cost to the compute)."""
    from matplotlib.figure import Figure

    modes = ("after", "async", "hook", "nccl")
    table, config, meta = record["table"], record["config"], record["meta"]
    fig = Figure(figsize=(7.5, 4.8), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(modes)
    for k, mode in enumerate(modes):
        xs = [i + (k - (len(modes) - 1) / 2) * width for i in range(len(table))]
        label = "after the op" if mode == "after" else f"beside {mode}"
        ax.bar(xs, [row[f"gemm_{mode}_ratio"] for row in table], width, label=label, color=f"C{k}")
    ax.axhline(1.0, color="0.3", linewidth=1)
    ax.axhline(1.03, color="k", linestyle="--", linewidth=1, label="+3% (the hook's target)")
    ax.set_xticks(range(len(table)), [row["op"] for row in table])
    ax.set_ylabel("GEMM time / GEMM alone")
    ax.set_ylim(bottom=0.9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    commit = "no checkout" if meta["commit"] is None else meta["commit"][:10]
    layout = ", expand layout" if config["expand"] else ""
    fig.suptitle(f"a GEMM beside communication in flight: {config['num_ranks']} ranks, {config['tokens']} tokens, "
                 f"hidden {config['hidden']}{layout}\ncommit {commit}, torch {meta['torch']}, {meta['date_utc'][:10]}",
                 fontsize=10)
    fig.savefig(path, dpi=110)


def plot_primitives(record: dict, path: str | pathlib.Path) -> None:
    """Write a primitives record's plot (`scripts/bench_primitives.py --json`) to `path` (PNG): GB/s against size per
    primitive, moe_comm and NCCL; and the GEMM's time beside each over the GEMM alone."""
    from matplotlib.figure import Figure

    table, config, meta = record["table"], record["config"], record["meta"]
    fig = Figure(figsize=(13, 5), layout="constrained")
    speed, gemm = fig.subplots(1, 2)
    for k, op in enumerate(dict.fromkeys(row["op"] for row in table)):
        rows = [row for row in table if row["op"] == op]
        sizes = [row["mb"] for row in rows]
        for who, style in (("moe", "-"), ("nccl", ":")):
            label = f"{op}, {'moe_comm' if who == 'moe' else 'NCCL'}"
            speed.plot(sizes, [row[f"{who}_gbs"] for row in rows], style, marker="o", color=f"C{k}", label=label)
            gemm.plot(sizes, [row[f"gemm_{who}_ratio"] for row in rows], style, marker="o", color=f"C{k}",
                      label=label)
    gemm.axhline(1.03, color="k", linestyle="--", linewidth=1, label="+3% (the target)")
    _two_panels(fig, "MB per rank", ((speed, "GB/s per rank", "bandwidth against size"),
                                     (gemm, "GEMM time / GEMM alone", "a GEMM beside each call")),
                f"the buffer's primitives against NCCL, {config['num_ranks']} ranks", meta)
    fig.savefig(path, dpi=110)


def _two_panels(fig, xlabel: str, panels, what: str, meta: dict) -> None:
    """Log2 x, labels, grid and legend on each `(ax, ylabel, title)` of `panels`; the figure's title: `what`, then
    the run's commit, torch and date."""
    for ax, ylabel, title in panels:
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    commit = "no checkout" if meta["commit"] is None else meta["commit"][:10]
    fig.suptitle(f"{what}\ncommit {commit}, torch {meta['torch']}, {meta['date_utc'][:10]}", fontsize=10)


def plot_versus(record: dict, path: str | pathlib.Path) -> None:
    """Write a side-by-side record's plot (`scripts/bench_deepep.py --json`) to `path` (PNG): back-to-back us against
    tokens per op, moe_comm solid and DeepEP dashed, and their ratio."""
    from matplotlib.figure import Figure

    table, config, meta = record["table"], record["config"], record["meta"]
    fig = Figure(figsize=(13, 5), layout="constrained")
    times, ratios = fig.subplots(1, 2)
    for k, op in enumerate(dict.fromkeys(row["op"] for row in table)):
        rows = [row for row in table if row["op"] == op]
        tokens = [row["tokens"] for row in rows]
        times.plot(tokens, [row["moe_b2b_us"] for row in rows], "-", marker="o", color=f"C{k}",
                   label=f"{op}, moe_comm")
        times.plot(tokens, [row["deepep_b2b_us"] for row in rows], "--", marker="x", color=f"C{k}",
                   label=f"{op}, DeepEP V1")
        ratios.plot(tokens, [row["b2b_ratio"] for row in rows], "-", marker="o", color=f"C{k}", label=op)
    ratios.axhline(1.0, color="k", linestyle="--", linewidth=1)
    times.set_yscale("log")
    _two_panels(fig, "tokens per rank", ((times, "back-to-back us per call", "time per call"),
                                         (ratios, "moe_comm / DeepEP", "moe_comm's time over DeepEP's (below 1: "
                                                                       "faster)")),
                f"moe_comm beside DeepEP V1, {config['num_ranks']} ranks, {config['num_sms']} SMs each", meta)
    fig.savefig(path, dpi=110)


def plot_floor(record: dict, path: str | pathlib.Path) -> None:
    """Write a floor record's plot to `path` (PNG): `record["floor"]` rows (`method`, `case`, `blocks`,
    `gbs_per_sm`), GB/s per SM against blocks, a line per method, a panel per case."""
    from matplotlib.figure import Figure

    rows, meta = record["floor"], record["meta"]
    cases = list(dict.fromkeys(row["case"] for row in rows))
    fig = Figure(figsize=(5.2 * len(cases), 4.8), layout="constrained")
    axes = fig.subplots(1, len(cases), squeeze=False)[0]
    for ax, case in zip(axes, cases):
        for k, method in enumerate(dict.fromkeys(row["method"] for row in rows)):
            mine = [row for row in rows if row["case"] == case and row["method"] == method]
            ax.plot([row["blocks"] for row in mine], [row["gbs_per_sm"] for row in mine], marker="o",
                    color=f"C{k % 10}", linestyle="-" if k < 10 else "--", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("blocks (SMs)")
        ax.set_ylabel("GB/s stored per SM")
        ax.set_title(case, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    commit = (meta.get("commit") or "no checkout")[:10]
    fig.suptitle(f"{record['title']}\ncommit {commit}, {meta['hardware']}, {record['date']}", fontsize=10)
    fig.savefig(path, dpi=110)


def plot_candidates(record: dict, path: str | pathlib.Path) -> None:
    """Write a candidates record's plot to `path` (PNG): `record["cases"]`, each with `case`, `floor_us` and `us`
    (name -> microseconds): horizontal bars of the timings, the floor a dashed line, a panel per case."""
    from matplotlib.figure import Figure

    cases, meta = record["cases"], record["meta"]
    names = list(dict.fromkeys(name for case in cases for name in case["us"]))
    fig = Figure(figsize=(6.5 * len(cases), 0.32 * len(names) + 1.6), layout="constrained")
    axes = fig.subplots(1, len(cases), squeeze=False, sharey=True)[0]
    for ax, case in zip(axes, cases):
        ys = [k for k, name in enumerate(names) if name in case["us"]]
        ax.barh(ys, [case["us"][names[k]] for k in ys], color="C0")
        ax.axvline(case["floor_us"], color="0.3", linestyle="--", label=f"floor {case['floor_us']:.0f} us")
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_xlabel("us per call")
        ax.set_title(case["case"], fontsize=10)
        ax.grid(True, axis="x", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].invert_yaxis()  # the first timing on top (the axes share it)
    commit = (meta.get("commit") or "no checkout")[:10]
    fig.suptitle(f"{record['title']}\ncommit {commit}, {meta['gpu']}, {meta['date_utc'][:10]}", fontsize=10)
    fig.savefig(path, dpi=110)


def plot_recipe(runs: list[dict], path: str | pathlib.Path, labels: list[str] | None = None) -> None:
    """Write loss and tokens/s per step of recipe runs to `path` (PNG), and with several runs each one's loss
    difference from the first run's.

    Arguments:
        runs: metrics records (`train.py --metrics-json`), one line each.
        path: where the PNG goes.
        labels: one per run (default: the dispatchers).
    """
    from matplotlib.figure import Figure

    labels = labels or [run["summary"]["dispatcher"] for run in runs]
    panels = 3 if len(runs) > 1 else 2
    fig = Figure(figsize=(6.5 * panels, 4.8), layout="constrained")
    axes = fig.subplots(1, panels)
    loss_ax, speed_ax = axes[:2]
    base = {h["step"]: h["loss"] for h in runs[0]["history"]}
    for i, (run, label) in enumerate(zip(runs, labels)):
        summary, history = run["summary"], run["history"]
        steps = [h["step"] for h in history]
        color = f"C{i % 10}"  # one color per run in every panel (the difference panel has no first run)
        loss_ax.plot(steps, [h["loss"] for h in history], label=label, color=color)
        # Step 1 is the warm-up (JIT, allocator): it would squash the axis.
        speed_ax.plot(steps[1:], [h["tokens_per_s"] / 1e3 for h in history[1:]], color=color,
                      label=f"{label} (mean {summary['mean_tokens_per_s'] / 1e3:.1f}k)")
        if panels == 3 and i > 0:
            both = [h for h in history if h["step"] in base]
            axes[2].plot([h["step"] for h in both], [abs(h["loss"] - base[h["step"]]) for h in both], label=label,
                         color=color)
    if panels == 3:
        axes[2].set_yscale("symlog", linthresh=1e-6)  # 0 (bitwise the same) stays on the axis
        axes[2].set_xlabel("step")
        axes[2].set_ylabel(f"|loss - loss of {labels[0]}|")
        axes[2].set_title(f"difference from {labels[0]}", fontsize=10)
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("loss")
    loss_ax.set_title("loss per step", fontsize=10)
    speed_ax.set_xlabel("step")
    speed_ax.set_ylabel("thousand tokens/s")
    speed_ax.set_title("throughput per step (from step 2)", fontsize=10)
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    first = runs[0]["summary"]
    shared = any(run["summary"].get("share_gpu") for run in runs)
    num_steps = sorted({run["summary"]["steps"] for run in runs})
    fig.suptitle(f"recipe preset {first['preset']}, {' or '.join(map(str, num_steps))} steps, seed {first['seed']}, "
                 f"{first['world_size']} ranks" + (", sharing one GPU (times mean nothing)" if shared else ""),
                 fontsize=10)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="one bench JSON, or recipe metrics JSONs of one preset")
    parser.add_argument("-o", "--out", default=None, help="the PNG (default: the first JSON with .png)")
    args = parser.parse_args(argv)
    records = [json.loads(pathlib.Path(path).read_text()) for path in args.results]
    out = args.out or str(pathlib.Path(args.results[0]).with_suffix(".png"))
    if any("table" in record and "config" not in record for record in records):
        # scripts/host_path_report.py's records (host-path_*, layout-*) also hold a `table`, of other columns
        parser.error("a `table` without a `config`: not a bench record (host-path and layout records are drawn by "
                     "scripts/host_path_report.py from their profile_ops runs)")
    if all("table" in record for record in records):
        if len(records) != 1:
            parser.error(f"one bench JSON at a time, got {len(records)}")
        first = records[0]["table"][0] if records[0]["table"] else {}
        plot = (plot_primitives if "moe_gbs" in first else plot_overlap if "gemm_alone_us" in first
                else plot_versus if "deepep_b2b_us" in first else plot_bench)
        plot(records[0], out)
    elif len(records) == 1 and "floor" in records[0]:
        plot_floor(records[0], out)
    elif len(records) == 1 and "cases" in records[0]:
        plot_candidates(records[0], out)
    elif all({"summary", "history"} <= record.keys() for record in records):
        plot_recipe(records, out)
    elif len(records) == 1 and "runs" in records[0]:  # recipe runs gathered in one file, each with its label
        plot_recipe(records[0]["runs"], out, [run["label"] for run in records[0]["runs"]])
    else:
        parser.error("each file must be a bench JSON (a `table`), a floor record (`floor`), a candidates record "
                     "(`cases`), recipe metrics (`summary` and `history`) or recipe runs gathered under `runs`")
    print(out)


if __name__ == "__main__":
    main()
