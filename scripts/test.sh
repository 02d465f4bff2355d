#!/usr/bin/env bash
# Fresh-machine test command: creates .venv if missing, installs the package with its test extras, runs pytest.
# Extra arguments go to pytest (e.g. `scripts/test.sh -k reference`).
set -euo pipefail
cd "$(dirname "$0")/.."
# megatron-core, wandb and tqdm (extra "recipe") for the Megatron parity tests and the recipe smoke run.
source scripts/venv.sh
venv_install dev,recipe
exec .venv/bin/python -m pytest -q --durations=15 "$@"
