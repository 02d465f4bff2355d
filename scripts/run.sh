#!/usr/bin/env bash
# Fresh-machine main job: creates .venv if missing, installs moe_comm, runs the 2-rank dispatch/combine demo
# and benchmark (NCCL on 2 GPUs when present, else gloo on CPU). Extra arguments go to scripts/demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
# Pinned torch: the CPU wheel for Python 3.11 lies on disk; an unpinned resolve downloads GB of CUDA wheels.
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e .
exec .venv/bin/python scripts/demo.py "$@"
