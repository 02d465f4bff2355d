#!/usr/bin/env bash
# The device session in three commands, for a machine with 2+ GPUs whose python3 already has torch (the lent
# H200 machines): run from the repo root; logs and results go to OUT (or /tmp/gpu_check).
#   scripts/gpu_check.sh tests      GPU tier (both backends) + kernel compile/load + FP8 casts on CUDA (~3 min)
#   scripts/gpu_check.sh bench      scripts/bench.py with DESIGN 7's sizes on the CUDA backend, one rank per GPU
#                                   (at most 8, as the GPU tier) (~2 min)
#   scripts/gpu_check.sh megatron   Megatron GPU tier and the recipe's `small` preset, 50 steps with alltoall and
#                                   with moe_comm; needs megatron-core/wandb wheels carried in .whl (README of the
#                                   device tool: pip download ... --python-version 3.12 -d .whl)
# Results worth keeping go to benchmarks/<theme>_<hardware>_<date>.{md,json,png} (dispatch-combine_h200x2_...,
# recipe-small_h200x2_...), replacing that theme's older files (NOTES.md names those by git commit); test logs stay
# out of benchmarks/. Where the tree has no .git (a copied working tree), the bench records commit None: write the
# commit into the markdown when committing the result.
set -uo pipefail
cd "$(dirname "$0")/.."
# NVLink multicast stays off on shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
case "${1:-}" in
    tests)
        python3 -m pytest -q -p no:cacheprovider --timeout 300 --durations=10 tests/test_gpu.py \
            tests/test_kernels_compile.py tests/test_quant.py 2>&1 | tee "$out/gpu_tests.log" | tail -30 ;;
    bench)
        gpus=$(python3 -c "import torch; print(min(torch.cuda.device_count(), 8))")
        python3 scripts/bench.py --num-ranks "$gpus" --backend cuda --json "$out/bench.json" --md "$out/bench.md" \
            2>&1 | tail -45 ;;
    megatron)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/site:$PYTHONPATH WANDB_MODE=offline
        python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_megatron.py 2>&1 | tee "$out/megatron_gpu.log" \
            | tail -20
        for dispatcher in alltoall moe_comm; do
            python3 -m torch.distributed.run --standalone --nproc-per-node 2 recipes/megatron_moe/train.py \
                --preset small --steps 50 --dispatcher "$dispatcher" --out /tmp/runs \
                --metrics-json "$out/metrics-$dispatcher.json" 2>&1 | tee "$out/train-$dispatcher.log" \
                | grep -E "^(SUMMARY|wandb)"
        done
        python3 recipes/megatron_moe/compare.py "$out/metrics-moe_comm.json" "$out/metrics-alltoall.json" ;;
    *)
        echo "usage: scripts/gpu_check.sh tests|bench|megatron" >&2
        exit 2 ;;
esac
