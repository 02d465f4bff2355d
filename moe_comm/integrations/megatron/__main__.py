"""`python -m moe_comm.integrations.megatron [--moe-comm-backend B] SCRIPT ARGS`: run SCRIPT (e.g.
pretrain_gpt.py) with Megatron's flex/deepep dispatcher backed by moe_comm (route B), without editing it."""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from . import install_flex_dispatcher


def main(argv: list[str]) -> None:
    """Install route B, then run SCRIPT as `__main__` with `[SCRIPT, *ARGS]` as its `sys.argv`.

    Arguments:
        argv: `[--moe-comm-backend auto|torch|cuda] SCRIPT [ARGS]` (ARGS go to SCRIPT untouched).
    """
    parser = argparse.ArgumentParser(prog="python -m moe_comm.integrations.megatron",
                                     description="Run SCRIPT with Megatron's flex dispatcher backed by moe_comm.")
    parser.add_argument("--moe-comm-backend", choices=("auto", "torch", "cuda"), default="auto",
                        help="moe_comm Buffer backend (default: auto)")
    parser.add_argument("script", help="the training script to run, e.g. pretrain_gpt.py")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args(argv)
    install_flex_dispatcher(backend=args.moe_comm_backend)
    sys.argv = [args.script, *args.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
