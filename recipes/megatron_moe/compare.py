"""Compare two runs of train.py (their --metrics-json files): loss curves and speed.

    python recipes/megatron_moe/compare.py runs/moe_comm.json runs/alltoall.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def loss_diff(x: float, y: float) -> float:
    """|x - y| of two finite losses; infinite when either is not finite (a diverged run is equal to nothing, another
    diverged run included)."""
    return abs(x - y) if math.isfinite(x) and math.isfinite(y) else math.inf


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("metrics", nargs=2, help="two --metrics-json files of runs with the same preset and seed")
    p.add_argument("--max-loss-diff", type=float, default=None, help="exit 1 if the curves differ by more")
    args = p.parse_args(argv)
    if args.max_loss_diff is not None and not 0 <= args.max_loss_diff < math.inf:
        p.error(f"--max-loss-diff={args.max_loss_diff} must be a finite number >= 0")
    a, b = (load(path) for path in args.metrics)
    sa, sb = a["summary"], b["summary"]
    # Same model, data and arithmetic: the preset, the seed, the step count, the ranks (each rank draws its own
    # batches) and the dtype (--dtype overrides the preset's).
    for key in ("preset", "seed", "steps", "world_size", "dtype"):
        if sa.get(key) != sb.get(key):
            print(f"error: the runs differ in {key}: {sa.get(key)!r} vs {sb.get(key)!r}", file=sys.stderr)
            return 2
    diffs = [loss_diff(x["loss"], y["loss"]) for x, y in zip(a["history"], b["history"])]
    max_diff = max(diffs)
    where = f" (step {diffs.index(max_diff) + 1})" if max_diff else " (equal at every step)"
    print(f"COMPARE preset={sa['preset']} steps={sa['steps']} seed={sa['seed']} | max |loss diff| {max_diff:.3g}"
          f"{where} | final loss {sa['dispatcher']} {sa['final_loss']:.4f}, {sb['dispatcher']} "
          f"{sb['final_loss']:.4f} | tokens/s {sa['dispatcher']} {sa['mean_tokens_per_s']:.0f}, {sb['dispatcher']} "
          f"{sb['mean_tokens_per_s']:.0f}")
    print(f"wandb run directories: {sa['dispatcher']} {sa['wandb_run_dir']} | {sb['dispatcher']} {sb['wandb_run_dir']}")
    if args.max_loss_diff is not None and max_diff > args.max_loss_diff:
        print(f"error: max |loss diff| {max_diff:.3g} > --max-loss-diff {args.max_loss_diff:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
