"""Harness for the Megatron-core tests: CPU shims (shared with the recipe, `recipes/megatron_moe/cpu_shims.py`),
model-parallel setup once per worker process, and comparison helpers.

The shims patch torch.cuda in the worker processes, so these tests run on their own WorkerPool, never on the
pools other test modules share.
"""

from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from recipes.megatron_moe import model as recipe_model  # noqa: E402
from recipes.megatron_moe.cpu_shims import apply_cpu_shims  # noqa: E402

EP_SIZE = 2


def setup_worker(seed: int, ep_size: int = EP_SIZE) -> torch.device:
    """Shims (CPU only), Megatron's parallel state with EP over the whole group, and the RNG tracker."""
    apply_cpu_shims()
    recipe_model.initialize_megatron(ep_size, seed)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in float64 (inf if shapes differ or either is None)."""
    if a is None or b is None or a.shape != b.shape:
        return float("inf")
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def compare(named_ref: dict, named_test: dict) -> dict:
    """Per name: `(bitwise_equal, max_abs_diff, max_abs_ref)` of two dicts of tensors with the same keys."""
    if named_ref.keys() != named_test.keys():
        raise AssertionError(f"different names: {sorted(named_ref.keys() ^ named_test.keys())}")
    out = {}
    for name, ref in named_ref.items():
        test = named_test[name]
        same = test is not None and ref is not None and ref.shape == test.shape and torch.equal(ref, test)
        scale = ref.double().abs().max().item() if ref is not None and ref.numel() else 0.0
        out[name] = (bool(same), max_abs_diff(ref, test), scale)
    return out


def expert_grads(experts) -> dict:
    """Expert parameter gradients under MoECommGroupedMLP's names (`fc1_weight` ...: `[L, ...]`); a
    SequentialMLP's per-expert gradients are stacked into the same shapes."""
    grads = {name: param.grad for name, param in experts.named_parameters()}
    if "local_experts.0.linear_fc1.weight" not in grads:
        return grads
    num_local = len(experts.local_experts)
    return {f"{fc}_{kind}": torch.stack([grads[f"local_experts.{i}.linear_{fc}.{kind}"] for i in range(num_local)])
            for fc in ("fc1", "fc2") for kind in ("weight", "bias")
            if f"local_experts.0.linear_{fc}.{kind}" in grads}
