"""`python -m moe_comm.integrations.megatron [--moe-comm-backend=B] SCRIPT ARGS`: run SCRIPT (e.g.
pretrain_gpt.py) with Megatron's flex/deepep dispatcher backed by moe_comm (route B), without editing it."""

from __future__ import annotations

import os
import runpy
import sys

from . import install_flex_dispatcher


def main(argv: list[str]) -> None:
    """Install route B, then run `argv[0]` as `__main__` with `argv` as its `sys.argv`.

    Arguments:
        argv: `[--moe-comm-backend=auto|torch|cuda] SCRIPT [ARGS]`.
    """
    backend = "auto"
    if argv and argv[0].startswith("--moe-comm-backend="):
        backend, argv = argv[0].split("=", 1)[1], argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: torchrun ... -m moe_comm.integrations.megatron [--moe-comm-backend=auto|torch|cuda] "
              "pretrain_gpt.py [ARGS]")
        return
    install_flex_dispatcher(backend=backend)
    script = argv[0]
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
