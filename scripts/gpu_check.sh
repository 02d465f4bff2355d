#!/usr/bin/env bash
# The device session in a few commands, for a machine whose python3 already has torch (the lent H200 machines): run
# from the repo root, one rank per GPU (at most 8); logs and results go to OUT (or /tmp/gpu_check). Pass the local
# commit as MOE_COMM_COMMIT=$(git rev-parse HEAD): the device copy's git history is stale, results would record it.
#   scripts/gpu_check.sh tests      GPU tier (both backends, the CUDA hybrid path as 2 hosts x 1) + kernel load and
#                                   host extension + FP8 casts on CUDA (~5 min; one GPU: one rank, the peer tests
#                                   skip; the shared-GPU and hybrid tests run 2 ranks sharing it)
#   scripts/gpu_check.sh bench      scripts/bench.py with DESIGN 7's sizes on the CUDA backend, then the same with the
#                                   expand layout (--expand: the MoE layer's dispatches; its combine by partial sums
#                                   beside the slot order's), then (2+ GPUs) the hybrid
#                                   path as hosts of one GPU (--ranks-per-host 1: its overhead) (~4 min)
#   scripts/gpu_check.sh overlap    scripts/bench_overlap.py (a GEMM beside dispatch/combine: async, receive hook, NCCL;
#                                   both layouts) and scripts/bench_primitives.py (pipeline, all_gather,
#                                   reduce_scatter against NCCL, 1-512 MB, the GEMM beside each) (~4 min)
#   scripts/gpu_check.sh soak       scripts/soak.py, 10,000 iterations of every path on the CUDA backend, one rank per
#                                   GPU (~7 min: 2,000 took 77 s on one H200; issue 13 asks for 10,000 on 2 GPUs)
#   scripts/gpu_check.sh megatron   Megatron GPU tier: parity on 2 GPUs (one GPU: the same cases with 2 ranks
#                                   sharing it, EP2 over CUDA IPC), grouped experts, the sync-free layer (no host
#                                   sync, CUDA graph replay) (~2 min on one H200); needs megatron-core carried in
#                                   .whl (README of the device tool: pip download megatron-core==0.19.2 ...
#                                   --python-version 3.12 -d .whl)
#   scripts/gpu_check.sh layer      scripts/bench_layer.py: one DeepSeek-V3-shaped MoE layer with every dispatcher
#                                   against its compute-only floor, route A at the model's SM count, 66 and 132
#                                   (sync-free in the slot order and by partial sums)
#                                   (.whl as above); one GPU: EP1, then every variant at EP2 with 2 ranks sharing
#                                   it (--share-gpu, 1024 tokens: a check of the code, no timings)
#   scripts/gpu_check.sh recipe     the recipe (2 GPUs): `small` 50 steps bf16 with alltoall and moe_comm, `small` 50
#                                   steps fp32 deterministic (expand layout: max |loss diff| <= 1e-3; the other one
#                                   reported), `dsv3` alltoall + grouped experts against moe_comm's sync-free layer
#                                   (.whl with megatron-core; wandb and its needs too, else the runs go with
#                                   --no-wandb); one GPU: the fp32 runs only, with 2 ranks sharing it
#                                   (--share-gpu: the loss curves hold, the times mean nothing; ~5 min)
#   scripts/gpu_check.sh deepep     scripts/bench_deepep.py: DeepEP V1 beside moe_comm on the same inputs (one GPU:
#                                   2 ranks sharing it, a check only); needs DeepEP v1.2.1 built intranode-only on
#                                   PYTHONPATH, never committed (NOTES.md, eighteenth session, says how) (~1 min)
# Several steps run in order (`scripts/gpu_check.sh tests megatron`), each in a subshell; every step runs even when
# one fails (a step without its wheels stops alone), and the script exits with the last failure's status.
# BUNDLE=F.tgz packs OUT into F after each step (a device call brings back only a few files: one bundle holds them
# all, and what finished before a time limit); set BUNDLE before OUT on one command line (`BUNDLE=$OUT/x.tgz
# OUT=$PWD/o`: bash assigns left to right, so the other order puts the bundle in the new OUT).
# Results worth keeping go to benchmarks/<theme>_<hardware>_<date>.{md,json,png} (dispatch-combine_h200x2_...,
# layer_h200x2_..., recipe-small_h200x2_...), replacing that theme's older files (NOTES.md names those by git
# commit); test logs stay out of benchmarks/.
set -uo pipefail
cd "$(dirname "$0")/.."
# NVLink multicast stays off on shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
steps="tests bench overlap soak megatron layer recipe deepep"
usage() { echo "usage: scripts/gpu_check.sh STEP [STEP ...], STEP one of: $steps" >&2; exit 2; }
[ $# -ge 1 ] || usage
for name in "$@"; do
    known=0
    for s in $steps; do [ "$s" = "$name" ] && known=1; done
    [ "$known" = 1 ] || usage
done

num_gpus() { python3 -c "import torch; print(min(torch.cuda.device_count(), 8))"; }  # one rank per GPU, at most 8

# One step; its status is the last failure among its commands (a step that runs several keeps going after one fails).
step() {
local st=0
# Every step is GPU work: without a GPU the tests would all skip and the step report success.
local n
n=$(num_gpus 2>/dev/null)  # empty where python3 has no torch
if [ "${n:-0}" -lt 1 ]; then
    echo "gpu_check.sh $1: needs a GPU; python3's torch sees none (a CPU-only torch, or CUDA_VISIBLE_DEVICES)" >&2
    return 2
fi
case "$1" in
    tests)
        # The nvcc compile checks (sm_90a build variants, microbenchmarks) are CPU work that CPU CI runs on every
        # change: left out here (~2 of the ~7 minutes on one H200); the host extension's tests stay (this torch).
        python3 -m pytest -q -p no:cacheprovider --timeout 300 --durations=10 tests/test_gpu.py \
            tests/test_hybrid_gpu.py tests/test_shared_gpu.py tests/test_kernels_compile.py tests/test_quant.py \
            tests/test_hybrid.py::test_nccl_no_host_sync tests/test_hybrid.py::test_nccl_random_cases \
            -k "not compiles_for_sm90a and not does_not_compile" 2>&1 | tee "$out/gpu_tests.log" | tail -30 ;;
    bench)
        gpus=$(num_gpus)
        python3 scripts/bench.py --num-ranks "$gpus" --backend cuda --json "$out/bench.json" --md "$out/bench.md" \
            2>&1 | tail -45 || st=$?
        python3 scripts/bench.py --num-ranks "$gpus" --backend cuda --expand --sms 12 22 32 48 66 96 132 \
            --json "$out/bench-expand.json" --md "$out/bench-expand.md" 2>&1 | tail -30 || st=$?
        if [ "$gpus" -ge 2 ]; then
            python3 scripts/bench.py --num-ranks "$gpus" --backend cuda --ranks-per-host 1 --sms 22 \
                --json "$out/bench-hybrid.json" --md "$out/bench-hybrid.md" 2>&1 | tail -30 || st=$?
        fi ;;
    overlap)
        gpus=$(num_gpus)
        for e in "" "--expand"; do
            python3 scripts/bench_overlap.py --num-ranks "$gpus" $e --json "$out/overlap${e:+-expand}.json" \
                --md "$out/overlap${e:+-expand}.md" 2>&1 | tail -16 || st=$?
        done
        python3 scripts/bench_primitives.py --num-ranks "$gpus" --json "$out/primitives.json" \
            --md "$out/primitives.md" 2>&1 | tail -24 || st=$? ;;
    soak)
        gpus=$(num_gpus)
        python3 scripts/soak.py --iters 10000 --num-ranks "$gpus" --backend cuda --json "$out/soak.json" 2>&1 \
            | grep -v -i warn | tail -16 ;;
    megatron)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || return 1
        export PYTHONPATH=/tmp/site:$PYTHONPATH WANDB_MODE=offline
        python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_megatron.py tests/test_grouped_mlp.py 2>&1 \
            | tee "$out/megatron_gpu.log" | tail -20 ;;
    layer)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || return 1
        export PYTHONPATH=/tmp/site:$PYTHONPATH
        gpus=$(num_gpus)
        python3 scripts/bench_layer.py --num-ranks "$gpus" --num-sms 0 66 132 --out "$out" 2>&1 | grep -v -i warn \
            | tail -30 || st=$?
        if [ "$gpus" -lt 2 ]; then  # every variant at EP2 with 2 ranks sharing the GPU: a check, not a timing
            python3 scripts/bench_layer.py --num-ranks 2 --share-gpu --tokens 1024 --iters 3 --out "$out/shared" \
                2>&1 | grep -v -i warn | tail -12 || st=$?
        fi ;;
    recipe)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || return 1
        export PYTHONPATH=/tmp/site:$PYTHONPATH WANDB_MODE=offline
        # Without wandb's wheels in .whl the runs still give their metrics JSON (the comparison reads those).
        local no_wandb=""
        python3 -c "import wandb" 2>/dev/null || { no_wandb=--no-wandb; echo "wandb not importable: --no-wandb"; }
        # One GPU: the two ranks share it (gloo, buffers over CUDA IPC): the loss curves hold, the times do not.
        local share=""
        [ "$(num_gpus)" -ge 2 ] || share=--share-gpu
        train() {  # name, then train.py arguments
            local name=$1
            shift
            python3 -m torch.distributed.run --standalone --nproc-per-node 2 recipes/megatron_moe/train.py $no_wandb \
                $share --out /tmp/runs --metrics-json "$out/metrics-$name.json" "$@" 2>&1 | tee "$out/train-$name.log" \
                | grep -E "^(SUMMARY|wandb)"
        }
        # fp32 loss curves: without deterministic algorithms alltoall differs from itself run to run (Megatron's
        # unpermute adds with atomics) and training amplifies it past 1e-3 within ~20 steps (NOTES.md, nineteenth
        # session); so --deterministic, and the expand layout, which sums a token's rows in Megatron's order
        # (the non-expand layout sums per rank first: reported, no bound).
        train fp32-alltoall --preset small --dtype float32 --deterministic --dispatcher alltoall || st=$?
        train fp32-moe_comm --preset small --dtype float32 --deterministic --dispatcher moe_comm --do-expand || st=$?
        python3 recipes/megatron_moe/compare.py --max-loss-diff 1e-3 "$out/metrics-fp32-moe_comm.json" \
            "$out/metrics-fp32-alltoall.json" || st=$?
        train fp32-moe_comm-rows --preset small --dtype float32 --deterministic --dispatcher moe_comm || st=$?
        python3 recipes/megatron_moe/compare.py "$out/metrics-fp32-moe_comm-rows.json" \
            "$out/metrics-fp32-alltoall.json" || st=$?
        # One GPU: the loss curves only (bf16 tokens/s of ranks sharing a GPU mean nothing; dsv3 needs ~114 GB a rank).
        [ -z "$share" ] || return $st
        train small-alltoall --preset small --dispatcher alltoall || st=$?
        train small-moe_comm --preset small --dispatcher moe_comm || st=$?
        python3 recipes/megatron_moe/compare.py "$out/metrics-small-moe_comm.json" "$out/metrics-small-alltoall.json" \
            || st=$?
        train dsv3-alltoall --preset dsv3 --dispatcher alltoall || st=$?
        train dsv3-moe_comm --preset dsv3 --dispatcher moe_comm --no-cpu-sync || st=$?
        python3 recipes/megatron_moe/compare.py "$out/metrics-dsv3-moe_comm.json" "$out/metrics-dsv3-alltoall.json" \
            || st=$? ;;
    deepep)
        gpus=$(num_gpus)
        # One GPU: two ranks sharing it, a check of the script and of the rows (no meaningful times).
        if [ "$gpus" -ge 2 ]; then ranks=(--num-ranks "$gpus"); else ranks=(--num-ranks 2 --share-gpu); fi
        python3 scripts/bench_deepep.py "${ranks[@]}" --json "$out/deepep.json" --md "$out/deepep.md" 2>&1 \
            | grep -v -i warn | tail -25 ;;
esac
st=$(( st ? st : $? ))
return $st
}

rc=0
for name in "$@"; do
    echo "== gpu_check.sh $name"
    ( step "$name" ) || rc=$?  # a subshell: one step's exports (PYTHONPATH=/tmp/site) stay out of the next
    if [ -n "${BUNDLE:-}" ]; then  # written aside and renamed: a time limit mid-tar leaves the last whole bundle
        # tar's status 1: a file changed while it was read (the folder itself, when the bundle is written inside
        # it); what it packed is still a whole archive.
        tar czf "$BUNDLE.part" --warning=no-file-changed --exclude="$(basename "$BUNDLE")*" -C "$out" .
        st=$?
        if [ $st -le 1 ]; then
            mv "$BUNDLE.part" "$BUNDLE"
        else
            echo "gpu_check.sh: tar exited $st packing $out" >&2
        fi
    fi
done
exit $rc
