#!/usr/bin/env bash
# Fresh-machine main job: creates .venv if missing, installs moe_comm with megatron-core, wandb and tqdm, then
# trains the GPT-MoE recipe (recipes/megatron_moe) on 2 processes with torchrun: the `tiny` preset over gloo on
# CPU, the `small` preset on 2 GPUs. It trains with Megatron's alltoall dispatcher and with moe_comm from the
# same seed, then compares the loss curves and speed; the last lines are the summary and the wandb run
# directories (offline runs unless WANDB_MODE says otherwise; `wandb sync DIR` uploads one later).
# First it prints the 2-rank dispatch/combine benchmark table (scripts/bench.py, with the NCCL/gloo baseline;
# small sizes on CPU, DESIGN section 7's sizes on GPUs).
# Extra arguments go to both runs of train.py, e.g. `scripts/run.sh --steps 10 --do-expand` (--do-expand is route A's
# layout: the alltoall run ignores it); route A's options that alltoall has no meaning for (--quantize,
# --no-cpu-sync) are refused by its run: train it with recipes/megatron_moe/train.py directly (README). OUT sets the
# output folder.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
venv_install recipe

num_gpus=$(.venv/bin/python -c "import torch; print(torch.cuda.device_count())")
preset=tiny
if [ "$num_gpus" -ge 2 ]; then
    preset=small
fi
echo "== scripts/bench.py: dispatch/combine on 2 processes"
if [ "$num_gpus" -ge 2 ]; then
    .venv/bin/python scripts/bench.py --sms
else
    .venv/bin/python scripts/bench.py --tokens 128 512 --hidden 2048 --num-experts 64 --sms --iters 10
fi
out=${OUT:-runs/megatron_moe}
mkdir -p "$out"
export WANDB_MODE=${WANDB_MODE:-offline}
echo "== recipes/megatron_moe: preset $preset on 2 processes ($num_gpus GPUs), output in $out"
for dispatcher in alltoall moe_comm; do
    .venv/bin/torchrun --standalone --nproc-per-node 2 recipes/megatron_moe/train.py --preset "$preset" \
        --dispatcher "$dispatcher" --out "$out" --metrics-json "$out/metrics-$preset-$dispatcher.json" "$@"
done
exec .venv/bin/python recipes/megatron_moe/compare.py "$out/metrics-$preset-moe_comm.json" \
    "$out/metrics-$preset-alltoall.json"
