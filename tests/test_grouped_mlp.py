"""`MoECommGroupedMLP` against Megatron's `SequentialMLP` with the same weights (CPU tier, 2 gloo ranks, EP=2).
(Over 400 lines: one worker pool and one set of helpers for every case.)

Exactness. Outputs, the input gradient, the probabilities' gradient and every weight gradient are bitwise
equal to SequentialMLP's in float32 and bfloat16 (grouped path) and float64 (loop fallback): the grouped
path runs the products Megatron's linear layers run (`x @ W.T`, `grad @ W`, `grad.T @ x`, per expert; on CPU
torch's grouped_mm computes each group as that matmul, DESIGN 8.1), and the activation, probability scaling
and bias terms are the same elementwise ops in the same order. One exception: on the grouped path the bias
gradients are a float32 scatter-add of rows into `[L, N]` (no host counts needed), where Megatron sums each
expert's rows with torch's cascade `sum`; same terms, other association, so they are checked to
`BIAS_GRAD_REL_TOL` (a few float32 ulps, or 2 bfloat16 ulps, of the largest value; in practice they often
come out bitwise). The loop fallback is bitwise there too.

Experts run on 2 ranks with EP=2 because Megatron 0.16.1's expert bias add (`output += ...` in MLP.forward)
fails on an autograd view when EP=1; each rank checks its own experts, and the MoE-layer case uses Megatron's
alltoall dispatcher between the ranks. The CPU shims patch torch.cuda, so these tests own their pool.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'moe_comm[megatron]')")

from megatron_shims import compare, expert_grads  # noqa: E402

from moe_comm.testing import WorkerPool  # noqa: E402
from recipes.megatron_moe.model import ModelDims, layer_spec, transformer_config  # noqa: E402

EP_SIZE = 2
DIMS = ModelDims(hidden_size=32, num_experts=8, moe_ffn_hidden_size=16, moe_router_topk=2)
NUM_LOCAL_EXPERTS = DIMS.num_experts // EP_SIZE
BIAS_GRAD_REL_TOL = {"float32": 1e-6, "bfloat16": 2.0 ** -7}
BIAS_GRADS = ("fc1_bias", "fc2_bias")


@dataclasses.dataclass(frozen=True)
class Case:
    """One experts-level case: rows grouped by `counts` (one per local expert), then `num_tail_rows` more."""

    gated: bool = True               # SwiGLU (gated_linear_unit + silu), else plain gelu
    bias: bool = False               # add_bias_linear
    dtype: str = "float32"
    counts: tuple = (5, 0, 7, 3)
    num_tail_rows: int = 0
    counts_kind: str = "guarded"     # "guarded": a tensor nothing may read on the host; "tensor"; "list"
    use_grouped_mm: Optional[bool] = None
    apply_probs_on_input: bool = False

    @property
    def grouped(self) -> bool:
        return self.use_grouped_mm is not False and self.dtype != "float64"


class HostReadGuard(torch.Tensor):
    """Counts that raise when read on the host: on CPU, the stand-in for a device sync."""

    FORBIDDEN = (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.numpy,
                 torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls.FORBIDDEN:
            raise AssertionError(f"tokens_per_expert read on the host: {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(EP_SIZE, backend="gloo", timeout_s=300) as pool:
        yield pool


def assert_parity(results: list[dict], bias_rel_tol: float = 0.0) -> None:
    """`results`: per rank, name -> (bitwise_equal, max_abs_diff, max_abs_ref) from `compare`; bias gradients
    within `bias_rel_tol` of the largest value when it is not 0, everything else bitwise."""
    for rank, per_name in enumerate(results):
        assert per_name, f"rank {rank}: nothing compared"
        for name, (same, diff, scale) in per_name.items():
            if bias_rel_tol and name.split(".")[-1] in BIAS_GRADS:
                assert diff <= bias_rel_tol * scale, f"rank {rank}: {name} max |diff| {diff:.3g} (|ref| {scale:.3g})"
            else:
                assert same, f"rank {rank}: {name} differs (max |diff| {diff:.3g}, max |ref| {scale:.3g})"


# ----------------------------------------------------------------------------------------------------
# Worker side (module level, so the pool can pickle it)
# ----------------------------------------------------------------------------------------------------
def _setup(seed: int = 0) -> None:
    from recipes.megatron_moe import model as recipe_model
    from recipes.megatron_moe.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    recipe_model.initialize_megatron(EP_SIZE, seed)


def _config(case: Case, **overrides):
    import torch.nn.functional as F

    dims = dataclasses.replace(DIMS, moe_router_topk=1) if case.apply_probs_on_input else DIMS
    dtype = getattr(torch, case.dtype)
    if dtype == torch.float64:  # the recipe's helper takes float32/bfloat16; Megatron builds float64 too
        overrides = dict(params_dtype=dtype, pipeline_dtype=dtype, **overrides)
        dtype = torch.float32
    return transformer_config(dims, "alltoall", EP_SIZE, dtype, gated_linear_unit=case.gated,
                              activation_func=F.silu if case.gated else F.gelu, add_bias_linear=case.bias,
                              moe_apply_probs_on_input=case.apply_probs_on_input, **overrides)


def _moe_submodules(mlp_spec):
    return mlp_spec.keywords["submodules"] if isinstance(mlp_spec, functools.partial) else mlp_spec.submodules


def _swap_experts(mlp_spec, module):
    """The local spec's MoE entry with `module` in place of SequentialMLP (0.16 ModuleSpec, 0.18+ partial)."""
    subs = _moe_submodules(mlp_spec)
    experts = subs.experts
    if isinstance(experts, functools.partial):
        experts = functools.partial(module, *experts.args, **experts.keywords)
    else:
        experts = dataclasses.replace(experts, module=module)
    subs = dataclasses.replace(subs, experts=experts)
    if isinstance(mlp_spec, functools.partial):
        return functools.partial(mlp_spec.func, *mlp_spec.args, **{**mlp_spec.keywords, "submodules": subs})
    return dataclasses.replace(mlp_spec, submodules=subs)


def _build(spec, *args, **kwargs):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.spec_utils import build_module

    kwargs["pg_collection"] = get_default_pg_collection()
    return spec(*args, **kwargs) if isinstance(spec, functools.partial) else build_module(spec, *args, **kwargs)


def _experts(config, grouped: bool):
    """SequentialMLP, or MoECommGroupedMLP, built from the experts entry of a layer spec."""
    from moe_comm.integrations.megatron import MoECommGroupedMLP

    mlp_spec = layer_spec(DIMS, "alltoall").submodules.mlp
    if grouped:
        mlp_spec = _swap_experts(mlp_spec, MoECommGroupedMLP)
    return _build(_moe_submodules(mlp_spec).experts, NUM_LOCAL_EXPERTS, config)


def _randomize_biases(module, seed: int) -> None:
    """Megatron initialises biases to zero: give them values so their terms and gradients count."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=gen).to(param.dtype))


def _sequential_with_random_biases(config):
    ref = _experts(config, grouped=False)
    _randomize_biases(ref, 7 + torch.distributed.get_rank())
    return ref


def _inputs(case: Case, seed: int, poison_tail: bool = False):
    gen = torch.Generator().manual_seed(seed)
    num_rows = sum(case.counts) + case.num_tail_rows
    dtype = getattr(torch, case.dtype)
    x = torch.randn(num_rows, DIMS.hidden_size, generator=gen).to(dtype)
    probs = torch.rand(num_rows, generator=gen)  # float32, as Megatron's router hands them over
    grad = torch.randn(num_rows, DIMS.hidden_size, generator=gen).to(dtype)
    if poison_tail:  # what a worst-case-sized dispatch buffer may hold past the last row
        for t in (x, probs, grad):
            t[sum(case.counts):] = float("nan")
    return x, probs, grad


def _counts(case: Case):
    if case.counts_kind == "list":
        return list(case.counts)
    counts = torch.tensor(case.counts)
    return counts.as_subclass(HostReadGuard) if case.counts_kind == "guarded" else counts


def _run(module, x, counts, probs, grad) -> dict:
    """Forward + backward: output, input and probability gradients, parameter gradients (this run's alone: a second
    run of the same module would otherwise add into, and so change, the tensors the first one returned)."""
    module.zero_grad(set_to_none=True)
    x, probs = x.clone().requires_grad_(), probs.clone().requires_grad_()
    out, out_bias = module(x, counts, probs)
    assert out_bias is None
    out.backward(grad)
    named = {"output": out.detach(), "input.grad": x.grad, "probs.grad": probs.grad, **expert_grads(module)}
    return {k: (v.as_subclass(torch.Tensor) if v is not None else None) for k, v in named.items()}


@functools.lru_cache(maxsize=None)
def _count_grouped_mm_calls() -> list:
    """Wrap F.grouped_mm (once per worker) with a call counter; returns the one-element counter."""
    import torch.nn.functional as F

    calls, inner = [0], F.grouped_mm

    def grouped_mm(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    F.grouped_mm = grouped_mm
    return calls


def parity_rank(rank: int, world_size: int, case: Case) -> tuple[dict, int]:
    """SequentialMLP vs MoECommGroupedMLP (built from the spec, weights loaded): every output and gradient.
    Also returns how many grouped_mm calls our run made."""
    _setup()
    calls = _count_grouped_mm_calls()
    ref = _sequential_with_random_biases(_config(case))
    test = _experts(_config(case), grouped=True)
    test.use_grouped_mm = case.use_grouped_mm
    test.load_sequential(ref)
    x, probs, grad = _inputs(case, 1 + rank)
    named_ref = _run(ref, x, torch.tensor(case.counts), probs, grad)
    before = calls[0]
    named_test = _run(test, x, _counts(case), probs, grad)
    return compare(named_ref, named_test), calls[0] - before


def tail_rank(rank: int, world_size: int, case: Case, zero_tail: bool) -> tuple[dict, dict]:
    """Rows past the last count hold NaN (rows, probabilities and incoming gradient): everything else must be
    bitwise what a call without them gives, and their outputs and gradients zero (with `zero_tail=False` only
    `probs.grad`: the rest is not computed)."""
    _setup()
    from moe_comm.integrations.megatron import MoECommGroupedMLP

    test = MoECommGroupedMLP.from_sequential(_sequential_with_random_biases(_config(case)),
                                             use_grouped_mm=case.use_grouped_mm, zero_tail=zero_tail)
    x, probs, grad = _inputs(case, 1 + rank, poison_tail=True)
    num_used = sum(case.counts)
    named_head = _run(test, x[:num_used], _counts(case), probs[:num_used], grad[:num_used])
    named_all = _run(test, x, _counts(case), probs, grad)
    tail_is_zero = {}
    for name in ("output", "input.grad", "probs.grad"):
        if zero_tail or name == "probs.grad":
            tail_is_zero[name] = bool((named_all[name][num_used:] == 0).all())
        named_all[name] = named_all[name][:num_used]
    return tail_is_zero, compare(named_head, named_all)


def paths_agree_rank(rank: int, world_size: int, case: Case) -> dict:
    """The grouped path (device counts) against the loop fallback (host counts), same module."""
    _setup()
    from moe_comm.integrations.megatron import MoECommGroupedMLP

    test = MoECommGroupedMLP.from_sequential(_sequential_with_random_biases(_config(case)))
    x, probs, grad = _inputs(case, 1 + rank)
    named_grouped = _run(test, x, _counts(case), probs, grad)
    test.use_grouped_mm = False
    named_loop = _run(test, x, list(case.counts), probs, grad)
    return compare(named_loop, named_grouped)


def init_rank(rank: int, world_size: int, use_cpu_initialization: bool) -> dict:
    """Same seed, same weights as SequentialMLP (CPU init, and the GPU-init branch that the shims run on CPU)."""
    _setup()
    config = _config(Case(bias=True), use_cpu_initialization=use_cpu_initialization)
    torch.manual_seed(123)
    ref = _experts(config, grouped=False)
    torch.manual_seed(123)
    test = _experts(config, grouped=True)
    for module in (ref, test):  # weights into .grad, to stack SequentialMLP's with _param_grads
        for param in module.parameters():
            param.grad = param.detach().clone()
    attrs = {name: (getattr(p, "allreduce", None), getattr(p, "tensor_model_parallel", None))
             for name, p in test.named_parameters()}
    named_test = expert_grads(test)
    return {"compare": compare(expert_grads(ref), named_test), "attrs": attrs,
            "nonzero_weights": bool(named_test["fc1_weight"].abs().sum() > 0)}


def moe_layer_rank(rank: int, world_size: int) -> dict:
    """A whole MoELayer (router, Megatron's alltoall dispatcher across the 2 ranks, experts) built from the
    local spec with MoECommGroupedMLP as experts, against the same layer with SequentialMLP."""
    _setup()
    from moe_comm.integrations.megatron import MoECommGroupedMLP

    config = _config(Case(bias=True))
    mlp_spec = layer_spec(DIMS, "alltoall").submodules.mlp
    ref = _build(mlp_spec, config=config)
    test = _build(_swap_experts(mlp_spec, MoECommGroupedMLP), config=config)
    _randomize_biases(ref.experts, 11 + rank)
    test.load_state_dict({k: v for k, v in ref.state_dict().items() if not k.startswith("experts.")}, strict=False)
    test.experts.load_sequential(ref.experts)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(8, 2, DIMS.hidden_size, generator=gen)
    grad = torch.randn(8, 2, DIMS.hidden_size, generator=gen)
    named = {}
    for name, layer in (("ref", ref), ("test", test)):
        x_in = x.clone().requires_grad_()
        out, out_bias = layer(x_in)
        assert out_bias is None
        out.backward(grad)
        grads = {f"experts.{k}": v for k, v in expert_grads(layer.experts).items()}
        grads.update({k: p.grad for k, p in layer.named_parameters() if not k.startswith("experts.")})
        named[name] = {"output": out.detach(), "input.grad": x_in.grad, **grads}
    return compare(named["ref"], named["test"])


def refusals_rank(rank: int, world_size: int) -> dict:
    """The ValueError message of each refused configuration or input (None where nothing was raised)."""
    import copy

    _setup()
    from moe_comm.integrations.megatron import MoECommGroupedMLP

    def error(fn):
        try:
            fn()
        except ValueError as exc:
            return str(exc)
        return None

    def config_with(**attrs):
        config = copy.copy(_config(Case()))
        for key, value in attrs.items():
            setattr(config, key, value)
        return config

    module = MoECommGroupedMLP(NUM_LOCAL_EXPERTS, _config(Case()))
    x, probs = torch.randn(4, DIMS.hidden_size), torch.rand(4)
    return {
        "expert_tp": error(lambda: MoECommGroupedMLP(NUM_LOCAL_EXPERTS, config_with(expert_tensor_parallel_size=2))),
        "expert_gtp": error(lambda: MoECommGroupedMLP(NUM_LOCAL_EXPERTS, config_with(expert_gtp_weight_remat_size=2))),
        "fp8": error(lambda: MoECommGroupedMLP(NUM_LOCAL_EXPERTS, config_with(fp8="e4m3"))),
        "float64_forced": error(lambda: MoECommGroupedMLP.from_sequential(
            _experts(_config(Case(dtype="float64")), grouped=False), use_grouped_mm=True)(
                x.double(), [1, 1, 1, 1], probs)),
        "too_many_counts": error(lambda: module(x, [1, 1, 1, 1, 0], probs)),
        "negative_count": error(lambda: module(x, [2, 3, -1, 0], probs)),
        "counts_past_rows": error(lambda: module(x, [2, 2, 1, 0], probs)),
        "device_counts_shape": error(lambda: module(x, torch.tensor([[1, 1, 1, 1]]), probs)),
        "device_counts_float": error(lambda: module(x, torch.tensor([1.0, 1.0, 1.0, 1.0]), probs)),
    }


def gpu_sync_free_rank(rank: int, world_size: int) -> dict:
    """GPU, bf16, counts on the device with rows past the end: forward + backward under
    `torch.cuda.set_sync_debug_mode("error")`, then the same call through SequentialMLP's loop."""
    from recipes.megatron_moe import model as recipe_model

    recipe_model.initialize_megatron(1, 0)
    from moe_comm.integrations.megatron import MoECommGroupedMLP

    dims = dataclasses.replace(DIMS, hidden_size=256, moe_ffn_hidden_size=128)
    config = transformer_config(dims, "alltoall", 1, torch.bfloat16, gated_linear_unit=True,
                                activation_func=torch.nn.functional.silu)
    module = MoECommGroupedMLP(dims.num_experts, config).cuda()
    counts = torch.tensor([40, 0, 17, 64, 3, 0, 25, 8], device="cuda")
    num_used, num_rows = int(counts.sum()), int(counts.sum()) + 13
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(num_rows, dims.hidden_size, device="cuda", generator=gen).bfloat16()
    probs = torch.rand(num_rows, device="cuda", generator=gen)
    grad = torch.randn(num_rows, dims.hidden_size, device="cuda", generator=gen).bfloat16()
    _run(module, x, counts, probs, grad)  # warm-up: first-call allocations and library handles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        named = _run(module, x, counts, probs, grad)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    module.use_grouped_mm = False
    named_loop = _run(module, x[:num_used], counts.tolist(), probs[:num_used], grad[:num_used])
    out = {"tail_zero": {name: bool((named[name][num_used:] == 0).all())
                         for name in ("output", "input.grad", "probs.grad")}}
    out["rel_diff"] = {}
    for name, ref in named_loop.items():
        test = named[name][:num_used] if name in ("output", "input.grad", "probs.grad") else named[name]
        out["rel_diff"][name] = ((test.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    return out


# ----------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------
PARITY_CASES = [
    Case(gated=True, bias=False),
    Case(gated=True, bias=True),
    Case(gated=False, bias=False),
    Case(gated=False, bias=True),
    Case(counts=(0, 9, 0, 4), bias=True),               # empty first and last experts
    Case(counts=(0, 0, 0, 0)),                          # no rows at all
    Case(gated=True, bias=True, counts_kind="list"),    # host counts on the grouped path
    Case(apply_probs_on_input=True),                    # moe_apply_probs_on_input (top-1)
    Case(dtype="bfloat16", gated=True, bias=True),
    Case(dtype="bfloat16", gated=False, bias=False, counts=(30, 41, 0, 57)),
    # The loop fallback: float64 (grouped_mm refuses it) and use_grouped_mm=False; bitwise everywhere.
    Case(dtype="float64", gated=True, bias=True, counts_kind="tensor"),
    Case(dtype="float64", gated=False, bias=True, counts_kind="list"),
    Case(use_grouped_mm=False, gated=True, bias=True, counts_kind="tensor"),
]


@pytest.mark.parametrize("case", PARITY_CASES, ids=str)
def test_parity_with_sequential_mlp(pool, case):
    results = pool.run(parity_rank, case)
    assert_parity([r[0] for r in results], bias_rel_tol=BIAS_GRAD_REL_TOL[case.dtype] if case.grouped else 0.0)
    for rank, (_, num_grouped_mm) in enumerate(results):
        # Two projections forward, up to two grouped GEMMs each backward.
        assert (num_grouped_mm >= 2) == case.grouped, f"rank {rank}: {num_grouped_mm} grouped_mm calls for {case}"


TAIL_CASES = [
    Case(num_tail_rows=6),
    Case(num_tail_rows=6, bias=True, gated=False),
    Case(num_tail_rows=6, bias=True, counts_kind="list"),
    Case(num_tail_rows=5, counts=(0, 0, 0, 0), bias=True),
    Case(num_tail_rows=6, bias=True, use_grouped_mm=False, counts_kind="list"),
    Case(num_tail_rows=6, dtype="bfloat16"),
]


@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("case", TAIL_CASES, ids=str)
def test_rows_past_last_offset_are_zero(pool, case, zero_tail):
    for rank, (tail_is_zero, same) in enumerate(pool.run(tail_rank, case, zero_tail)):
        assert tail_is_zero and all(tail_is_zero.values()), f"rank {rank}: {tail_is_zero}"
        assert_parity([same])


@pytest.mark.parametrize("counts_kind", ["guarded", "list"])
def test_host_and_device_counts_identical(pool, counts_kind):
    """The grouped path with counts as a tensor on the rows' device (never read on the host: the guard
    raises) or on the host (a list): bitwise the loop over host counts, in bfloat16 and float32."""
    if counts_kind == "guarded":
        with pytest.raises(AssertionError, match="read on the host: tolist"):
            torch.tensor([1, 2]).as_subclass(HostReadGuard).tolist()
    for dtype in ("bfloat16", "float32"):
        case = Case(dtype=dtype, counts=(3, 0, 11, 6), num_tail_rows=3, counts_kind=counts_kind)
        assert_parity(pool.run(paths_agree_rank, case))


@pytest.mark.parametrize("use_cpu_initialization", [True, False])
def test_init_matches_sequential_mlp(pool, use_cpu_initialization):
    for rank, r in enumerate(pool.run(init_rank, use_cpu_initialization)):
        assert r["nonzero_weights"]
        assert_parity([r["compare"]])
        # EP=2: expert parameters are reduced over the expert-data-parallel group, as Megatron's experts.
        assert all(attrs == (False, True) or (name == "fc2_bias" and attrs == (False, None))
                   for name, attrs in r["attrs"].items()), f"rank {rank}: {r['attrs']}"


def test_moe_layer_parity(pool):
    assert_parity(pool.run(moe_layer_rank), bias_rel_tol=BIAS_GRAD_REL_TOL["float32"])


def test_refusals_name_the_problem(pool):
    for errors in pool.run(refusals_rank):
        assert "expert tensor parallelism" in errors["expert_tp"] and "expert_tp_size=2" in errors["expert_tp"]
        assert "expert_gtp_size=2" in errors["expert_gtp"]
        assert "fp8" in errors["fp8"]
        assert "use_grouped_mm=True" in errors["float64_forced"] and "float64" in errors["float64_forced"]
        assert "[1, 1, 1, 1, 0]" in errors["too_many_counts"]
        assert "[2, 3, -1, 0]" in errors["negative_count"]
        assert "at most the 4 rows" in errors["counts_past_rows"]
        assert "(4,)" in errors["device_counts_shape"] and "(1, 4)" in errors["device_counts_shape"]
        assert "torch.float32" in errors["device_counts_float"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_sync_free_and_zero_tail():
    with WorkerPool(1, backend="nccl", timeout_s=300) as gpu_pool:
        r = gpu_pool.run(gpu_sync_free_rank)[0]
    assert all(r["tail_zero"].values()), r["tail_zero"]
    # bf16: the grouped GEMM and the loop of matmuls round differently.
    assert all(diff <= 2e-2 for diff in r["rel_diff"].values()), r["rel_diff"]
