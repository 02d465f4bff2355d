#!/usr/bin/env bash
# Fresh-machine test command: creates .venv if missing, installs the package with its test extras, runs pytest.
# Extra arguments go to pytest (e.g. `scripts/test.sh -k reference`).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
# torch first and pinned: the CPU wheel for Python 3.11 lies on the CI machines' disk; an unpinned
# resolve would download several GB of CUDA wheels.
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
# megatron-core, wandb and tqdm for the Megatron parity tests and the recipe smoke run (tests/test_megatron.py,
# tests/test_recipe.py); torch stays pinned.
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" -e ".[dev,recipe]"
exec .venv/bin/python -m pytest -q --durations=15 "$@"
