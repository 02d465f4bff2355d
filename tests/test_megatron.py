"""Megatron-core integration: moe_comm's dispatcher against Megatron's own alltoall dispatcher. (Over 400 lines:
every case shares one worker pool and Megatron's set-up, which a split would repeat.)

CPU tier (always, when megatron-core is installed): 2 ranks over gloo, EP=2, fp32, the reference backend.
Every case builds Megatron's alltoall MoE layer (or GPTModel) and ours with the same weights and inputs and
compares outputs, input gradients and every parameter gradient.

Exactness: bitwise, except for non-expand layouts (route A with `do_expand=False`, route B) at top-k >= 3.
There a token's K expert outputs are summed per rank first (on the expert rank) and then across ranks, as
DeepEP does, while Megatron's unpermute adds all K in ascending expert order: the same terms grouped
differently, so the results differ by float32 rounding only. Those cases are checked to
`NONEXACT_REL_TOL` (relative to the tensor's largest magnitude). Expand mode adds the K rows in ascending
expert order and is bitwise for every top-k; with `deterministic=False` its combine adds them per rank first
(partial sums), to float32 rounding again.

EP overlap (`overlap_moe_expert_parallel_comm`, bf16 as Megatron requires) compares Megatron's combined-1F1B
schedule with plain steps of the same model instead, bitwise.

The fast subset runs in CI; the full matrix (routes x top-k 1/2/4 x expand x sync/async) is marked `slow`.
GPU tier (`gpu`, skipped without 2 GPUs): the same on NCCL with backend "auto" (the CUDA backend where
built), fp32 and bf16, plus FP8 on the wire against alltoall over quantize-dequantized inputs. Shared-GPU tier
(`gpu`, machines with one GPU): those cases with two ranks on GPU 0 (gloo, moe_comm's buffers over CUDA IPC), so
a one-GPU machine runs routes A and B on the CUDA kernels at EP2.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import pathlib
import subprocess
import sys
import types

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'moe_comm[megatron]')")

from megatron_shims import EP_SIZE, compare, expert_grads, setup_worker  # noqa: E402

from moe_comm.testing import WorkerPool  # noqa: E402
from recipes.megatron_moe.model import (ModelDims, build_gpt, build_moe_layer, mock_batch,  # noqa: E402
                                        transformer_config)

NONEXACT_REL_TOL = 1e-6     # float32, top-k >= 3 in a non-expand layout (see the module docstring)
BF16_REL_TOL = 2e-2         # GPU tier, bf16 (a few bf16 ulps of the largest value)
LAYER_DIMS = ModelDims(hidden_size=64, num_experts=8, moe_ffn_hidden_size=32)
GPT_DIMS = ModelDims(num_layers=2, hidden_size=64, num_attention_heads=4, num_experts=8, moe_ffn_hidden_size=64,
                     seq_length=16, vocab_size=128)


@dataclasses.dataclass(frozen=True)
class Case:
    """One parity case. `route`: "A" (moe_comm_layer_spec) or "B" (flex dispatcher with moe_comm inside)."""

    route: str
    topk: int
    do_expand: bool = False
    async_comm: bool = True
    dtype: str = "float32"
    backend: str = "torch"
    seed: int = 0
    deterministic: bool = True  # False: an expand combine adds a token's rows per rank first (partial sums)

    @property
    def dispatcher(self) -> str:
        return "moe_comm" if self.route == "A" else "moe_comm_flex"

    @property
    def exact(self) -> bool:
        return self.dtype == "float32" and (self.do_expand and self.deterministic or self.topk <= 2)

    def moe_comm_config(self):
        from moe_comm.integrations.megatron import MoECommConfig

        return MoECommConfig(backend=self.backend, do_expand=self.do_expand, async_comm=self.async_comm,
                             deterministic=self.deterministic)


def full_matrix() -> list[Case]:
    cases = []
    for topk in (1, 2, 4):
        cases += [Case("A", topk, do_expand, async_comm) for do_expand in (False, True) for async_comm in (True, False)]
        cases.append(Case("B", topk))
    return cases


FAST_LAYER_CASES = [Case("A", 2), Case("A", 4), Case("A", 4, do_expand=True),
                    Case("A", 4, do_expand=True, deterministic=False), Case("B", 2)]
FAST_GPT_CASES = [Case("A", 2, do_expand=True), Case("B", 2)]


@pytest.fixture(scope="module")
def mcore_pool():
    """A private 2-rank gloo pool: the CPU shims patch torch.cuda inside its workers."""
    with WorkerPool(2, backend="gloo", timeout_s=600) as pool:
        yield pool


@pytest.fixture(scope="module")
def nccl_pool():
    with WorkerPool(2, backend="nccl", timeout_s=600) as pool:
        yield pool


def assert_parity(results: list[dict], exact: bool, rel_tol: float = NONEXACT_REL_TOL) -> None:
    """`results`: per rank, name -> (bitwise_equal, max_abs_diff, max_abs_ref)."""
    for rank, per_name in enumerate(results):
        assert per_name, f"rank {rank}: nothing compared"
        for name, (same, diff, scale) in per_name.items():
            if exact:
                assert same, f"rank {rank}: {name} differs (max |diff| {diff:.3g}, max |ref| {scale:.3g})"
            else:
                assert diff <= rel_tol * max(scale, 1e-30), \
                    f"rank {rank}: {name} max |diff| {diff:.3g} > {rel_tol:g} x max |ref| {scale:.3g}"


# ----------------------------------------------------------------------------------------------------
# Worker functions (module level, so the pool can pickle them)
# ----------------------------------------------------------------------------------------------------
def _flex_installed(case: Case):
    from moe_comm.integrations.megatron import install_flex_dispatcher

    return install_flex_dispatcher(backend=case.backend) if case.route == "B" else (lambda: None)


def _grads(module: torch.nn.Module, prefix: str = "") -> dict:
    return {f"{prefix}{name}.grad": p.grad for name, p in module.named_parameters()}


def layer_parity_rank(rank: int, world_size: int, case: Case, dims: ModelDims, overrides: dict) -> dict:
    """MoE layer: alltoall vs ours, same weights; output, input grad and every parameter grad (EP over the
    whole group)."""
    device = setup_worker(case.seed, world_size)
    dtype = getattr(torch, case.dtype)
    restore = _flex_installed(case)
    try:
        dims = dataclasses.replace(dims, moe_router_topk=case.topk)
        ref = build_moe_layer(transformer_config(dims, "alltoall", world_size, dtype, **overrides), dims, "alltoall")
        test = build_moe_layer(transformer_config(dims, case.dispatcher, world_size, dtype, **overrides), dims,
                               case.dispatcher, case.moe_comm_config())
        ref, test = ref.to(device), test.to(device)
        test.load_state_dict(ref.state_dict())
        gen = torch.Generator().manual_seed(1000 * case.seed + rank)
        x = torch.randn(16, 2, dims.hidden_size, generator=gen).to(device, dtype)
        grad_out = torch.randn(16, 2, dims.hidden_size, generator=gen).to(device, dtype)
        named = {}
        for name, layer in (("ref", ref), ("test", test)):
            x_in = x.clone().requires_grad_()
            out, bias = layer(x_in)
            assert bias is None
            out.backward(grad_out)
            named[name] = {"output": out.detach(), "input.grad": x_in.grad, **_grads(layer)}
        return compare(named["ref"], named["test"])
    finally:
        restore()


def sync_free_layer_rank(rank: int, world_size: int, dtype: str, ep_size: int, check_graph: bool) -> dict:
    """Route A's sync-free layer (expand, no CPU sync, MoECommGroupedMLP) against Megatron's alltoall with
    SequentialMLP, same weights: output, input grad, every parameter grad. On GPUs also: a forward + backward
    with no host sync (CUDA's sync debug mode) and, with `check_graph`, the same captured in one CUDA graph and
    replayed on new inputs against eager."""
    from recipes.megatron_moe import model as recipe_model

    from moe_comm.integrations.megatron import MoECommConfig

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        recipe_model.initialize_megatron(ep_size, 0)
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = setup_worker(0)
    torch_dtype = getattr(torch, dtype)
    dims = GPU_DIMS if on_gpu else LAYER_DIMS
    options = MoECommConfig(backend="auto" if on_gpu else "torch", do_expand=True, do_cpu_sync=False)
    # No linear biases on GPUs (DeepSeek's experts have none): with EP=1 Megatron's own SequentialMLP adds its
    # bias in place into an autograd view and raises.
    overrides = dict(add_bias_linear=False) if on_gpu else {}
    ref = build_moe_layer(transformer_config(dims, "alltoall", ep_size, torch_dtype, **overrides), dims,
                          "alltoall").to(device)
    test = build_moe_layer(transformer_config(dims, "moe_comm", ep_size, torch_dtype, **overrides), dims, "moe_comm",
                           options, grouped_experts=True).to(device)
    test.load_state_dict({k: v for k, v in ref.state_dict().items() if not k.startswith("experts.")}, strict=False)
    test.experts.load_sequential(ref.experts)
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(16, 2, dims.hidden_size, generator=gen).to(device, torch_dtype)
    grad_out = torch.randn(16, 2, dims.hidden_size, generator=gen).to(device, torch_dtype)

    def step(layer, x_in):
        layer.zero_grad(set_to_none=True)
        x_in = x_in.detach().clone().requires_grad_()
        out, _ = layer(x_in)
        out.backward(grad_out)
        grads = {f"experts.{k}": v for k, v in expert_grads(layer.experts).items()}
        grads.update({k: p.grad for k, p in layer.named_parameters() if not k.startswith("experts.")})
        return {"output": out.detach(), "input.grad": x_in.grad, **grads}

    result = {"parity": compare(step(ref, x), step(test, x)), "zero_tail": test.experts.zero_tail}
    if not on_gpu:
        return result
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(test, x)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    if check_graph:
        static_x = x.detach().clone().requires_grad_()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step(test, static_x)
        torch.cuda.current_stream().wait_stream(side)
        test.zero_grad(set_to_none=True)
        static_x.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out, _ = test(static_x)
            static_out.backward(grad_out)
        # The gradients the graph writes (an eager step below replaces the parameters' .grad attributes).
        static = {"output": static_out, "input.grad": static_x.grad,
                  **{f"experts.{k}": v for k, v in expert_grads(test.experts).items()}}
        diffs = []
        for trial in range(2):
            new_x = torch.randn(16, 2, dims.hidden_size, generator=gen).to(device, torch_dtype)
            static_x.data.copy_(new_x)
            graph.replay()
            replayed = {k: v.detach().clone() for k, v in static.items()}
            eager = step(test, new_x)
            diffs.append(compare({k: eager[k] for k in replayed}, replayed))
        result["graph"] = diffs
    return result


def gpt_parity_rank(rank: int, world_size: int, case: Case, dims: ModelDims, num_steps: int) -> dict:
    """2-layer GPTModel: alltoall vs ours, same weights and batches; first-step gradients and Adam losses (EP over
    the whole group)."""
    device = setup_worker(case.seed, world_size)
    restore = _flex_installed(case)
    try:
        dims = dataclasses.replace(dims, moe_router_topk=case.topk)
        dtype = getattr(torch, case.dtype)
        ref = build_gpt(transformer_config(dims, "alltoall", world_size, dtype), dims, "alltoall").to(device)
        test = build_gpt(transformer_config(dims, case.dispatcher, world_size, dtype), dims, case.dispatcher,
                         case.moe_comm_config()).to(device)
        test.load_state_dict(ref.state_dict(), strict=False)  # strict=False: `_extra_state` entries
        for (n_ref, p_ref), (n_test, p_test) in zip(ref.named_parameters(), test.named_parameters()):
            assert n_ref == n_test and torch.equal(p_ref, p_test), f"weights differ at {n_ref}"
        losses, named = {}, {}
        for name, model in (("ref", ref), ("test", test)):
            gen = torch.Generator().manual_seed(1000 * case.seed + rank)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            losses[name] = []
            for step in range(num_steps):
                batch = mock_batch(dims, 2, gen, device)
                opt.zero_grad()
                loss = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"],
                             labels=batch["labels"]).float().mean()
                loss.backward()
                if step == 0:
                    named[name] = {"loss": loss.detach(), **_grads(model)}
                opt.step()
                losses[name].append(loss.detach())
        named["ref"]["losses"] = torch.stack(losses["ref"])
        named["test"]["losses"] = torch.stack(losses["test"])
        return compare(named["ref"], named["test"])
    finally:
        restore()


def _run_dispatcher(dispatcher, experts, hidden: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
    """Megatron's six dispatcher steps around `experts`, as MoELayer calls them."""
    h, p = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
    h, p = dispatcher.token_dispatch(h, p)
    h, tokens_per_expert, p = dispatcher.dispatch_postprocess(h, p)
    out, _ = experts(h, tokens_per_expert, p)
    out = dispatcher.combine_preprocess(out)
    out = dispatcher.token_combine(out)
    return dispatcher.combine_postprocess(out), tokens_per_expert


def dispatcher_parity_rank(rank: int, world_size: int, case: Case, dims: ModelDims, alignment: int,
                           quantize) -> dict:
    """Dispatcher level, fixed random routing: our dispatcher (optionally padded to `alignment`, optionally
    FP8 on the wire) vs alltoall over the same (for FP8: quantize-dequantized) inputs, with the same experts."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from moe_comm import quant
    from moe_comm.integrations.megatron import MoECommConfig, MoECommTokenDispatcher

    device = setup_worker(case.seed)
    dtype = getattr(torch, case.dtype)
    dims = dataclasses.replace(dims, moe_router_topk=case.topk)
    config = transformer_config(dims, "alltoall", EP_SIZE, dtype)
    layer = build_moe_layer(config, dims, "alltoall").to(device)
    num_local = layer.num_local_experts
    ref_disp = MoEAlltoAllTokenDispatcher(num_local, layer.local_expert_indices, config, _pg())
    options = MoECommConfig(backend=case.backend, do_expand=case.do_expand, async_comm=case.async_comm,
                            expert_alignment=alignment, quantize=quantize)
    test_disp = MoECommTokenDispatcher(num_local, layer.local_expert_indices, config, _pg(), options)
    ref_experts, test_experts = layer.experts, build_moe_layer(config, dims, "alltoall").to(device).experts
    test_experts.load_state_dict(ref_experts.state_dict())

    gen = torch.Generator().manual_seed(1000 * case.seed + rank)
    num_tokens, hidden = 32, dims.hidden_size
    scores = torch.rand(num_tokens, dims.num_experts, generator=gen)
    top = scores.topk(case.topk, dim=1).indices
    routing_map = torch.zeros(num_tokens, dims.num_experts, dtype=torch.bool).scatter(1, top, True).to(device)
    probs = (torch.softmax(scores, dim=1) * routing_map.cpu()).to(device)
    x = torch.randn(num_tokens // 2, 2, hidden, generator=gen).to(device, dtype)
    grad_out = torch.randn(num_tokens // 2, 2, hidden, generator=gen).to(device, dtype)
    x_ref = x
    if quantize is not None:  # the reference sees what our receivers see: the dequantized FP8 rows
        x_ref = quant.dequantize(*quant.quantize(x.reshape(-1, hidden), quantize), dtype).view_as(x)

    named, counts = {}, {}
    for name, disp, experts, x_in in (("ref", ref_disp, ref_experts, x_ref), ("test", test_disp, test_experts, x)):
        x_in = x_in.clone().requires_grad_()
        p_in = probs.clone().requires_grad_()
        out, tokens_per_expert = _run_dispatcher(disp, experts, x_in, routing_map, p_in)
        out.backward(grad_out)
        counts[name] = tokens_per_expert
        named[name] = {"output": out.detach(), "input.grad": x_in.grad, "probs.grad": p_in.grad, **_grads(experts)}
    tpe = counts["test"]
    assert tpe.device.type == "cpu" and tpe.dtype == torch.int64, (tpe.device, tpe.dtype)
    assert all(int(c) % alignment == 0 for c in tpe), f"tokens_per_expert={tpe.tolist()} not padded to {alignment}"
    unpadded = counts["ref"].tolist()
    assert [-(-c // alignment) * alignment for c in unpadded] == tpe.tolist(), (unpadded, tpe.tolist())
    return compare(named["ref"], named["test"])


def _pg():
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    return get_default_pg_collection()


def async_overlap_rank(rank: int, world_size: int, case: Case, dims: ModelDims) -> dict:
    """With async_comm the dispatch is still in flight after token_dispatch; dispatch_postprocess waits."""
    from moe_comm.integrations.megatron import MoECommConfig

    device = setup_worker(case.seed)
    dims = dataclasses.replace(dims, moe_router_topk=case.topk)
    config = transformer_config(dims, "alltoall", EP_SIZE)
    layer = build_moe_layer(config, dims, "moe_comm", MoECommConfig(backend=case.backend, async_comm=True))
    layer = layer.to(device)
    x = torch.randn(16, 2, dims.hidden_size, generator=torch.Generator().manual_seed(rank)).to(device)
    probs, routing_map = layer.route(x)
    h, p = layer.preprocess(x, probs, routing_map)
    h, p = layer.dispatch(h, p)
    disp = layer.token_dispatcher
    event = disp.dispatch_event
    pending_after_dispatch = event is not None and not event.done
    out, _ = layer.routed_experts_compute(h, p)
    waited = event is not None and event.done and disp.dispatch_event is None
    out = layer.combine(out)
    pending_after_combine = disp.combine_event is not None and not disp.combine_event.done
    layer.postprocess(out, None)
    return dict(pending_after_dispatch=pending_after_dispatch, waited=waited,
                pending_after_combine=pending_after_combine, num_sms=disp.last_num_sms)


def graph_attrs_rank(rank: int, world_size: int, case: Case, dims: ModelDims, overrides: dict) -> list:
    """Megatron's partial CUDA graph of the router and dispatch_preprocess, emulated: after a replay the Python of
    dispatch_preprocess has not run, and Megatron sets back only the dispatcher attributes that `cudagraph_attrs`
    names (tensors, dotted names through submodules; transformer_layer's restore). The layer's output must equal a
    plain run's."""
    from moe_comm.integrations.megatron import MoECommConfig

    device = setup_worker(case.seed)
    dims = dataclasses.replace(dims, moe_router_topk=case.topk)
    config = transformer_config(dims, "alltoall", EP_SIZE, **overrides)
    layer = build_moe_layer(config, dims, "moe_comm", MoECommConfig(backend=case.backend)).to(device)
    disp = layer.token_dispatcher
    x = torch.randn(16, 2, dims.hidden_size, generator=torch.Generator().manual_seed(rank)).to(device)
    outputs = []
    for replay in (False, True):
        probs, routing_map = layer.route(x)
        h, p = layer.preprocess(x, probs, routing_map)
        if replay:
            def owner_of(name: str):
                *parents, last = name.split(".")
                owner = disp
                for part in parents:
                    owner = getattr(owner, part)
                return owner, last

            saved = {name: getattr(*owner_of(name), None) for name in disp.cudagraph_attrs}
            saved = {name: value.clone() for name, value in saved.items() if torch.is_tensor(value)}
            # What dispatch_preprocess sets, as the previous forward's later steps left it (consumed: None); the
            # replay does not run dispatch_preprocess's Python.
            disp.topk_idx = None
            if disp.shared_experts is not None:
                disp.shared_experts.cached_fc1_input = None
            for name, value in saved.items():
                setattr(*owner_of(name), value)
        h, p = layer.dispatch(h, p)
        out, shared = layer.routed_experts_compute(h, p)
        outputs.append(layer.postprocess(layer.combine(out), shared).tolist())
    return outputs


@pytest.mark.parametrize("shared", [False, True])
def test_partial_cuda_graph_attributes_restore_the_dispatch(mcore_pool, shared):
    overrides = SHARED_EXPERT_OVERLAP if shared else {}
    for plain, replayed in mcore_pool.run(graph_attrs_rank, Case("A", 2), LAYER_DIMS, overrides):
        assert replayed == plain


def hybrid_parity_rank(rank: int, world_size: int, ranks_per_node: int, parity, *args) -> tuple:
    """`parity` (a parity worker above) with hosts forced by MOE_COMM_RANKS_PER_NODE, so moe_comm's buffers run the
    hybrid path; returns its comparison and the logical domain sizes of the buffers it made."""
    from moe_comm.integrations.megatron import buffer_domain_sizes, clear_buffers

    clear_buffers()  # a buffer made earlier without the override would be reused
    os.environ["MOE_COMM_RANKS_PER_NODE"] = str(ranks_per_node)
    try:
        result = parity(rank, world_size, *args)
        return result, buffer_domain_sizes()
    finally:
        os.environ.pop("MOE_COMM_RANKS_PER_NODE")
        clear_buffers()


def flex_build_rank(rank: int, world_size: int) -> dict:
    """Route B: Megatron's flex dispatcher (backend deepep) builds without DeepEP once moe_comm is installed,
    and refuses again after `restore()`."""
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    from moe_comm.integrations import megatron as integration

    setup_worker(0)
    config = transformer_config(LAYER_DIMS, "moe_comm_flex", EP_SIZE)
    args = (LAYER_DIMS.num_experts // EP_SIZE, [rank * 4 + i for i in range(4)], config, _pg())
    restore = integration.install_flex_dispatcher(backend="torch")
    try:
        dispatcher = MoEFlexTokenDispatcher(*args)
        manager = type(dispatcher._comm_manager).__name__
    finally:
        restore()
    try:
        MoEFlexTokenDispatcher(*args)
        refused_after_restore = False
    except ImportError:
        refused_after_restore = True
    return dict(manager=manager, refused_after_restore=refused_after_restore)


def _is_destroyed(buf) -> bool:
    try:
        buf.barrier()
    except RuntimeError as exc:
        return "destroyed" in str(exc)
    return False


def buffer_cache_rank(rank: int, world_size: int) -> dict:
    """One buffer per group object; a grown buffer replaces the old one, which is released once nothing refers to
    it (a backward may still hold it); clear_buffers() destroys the rest."""
    import gc
    import weakref

    import torch.distributed as dist

    from moe_comm.integrations.megatron import MoECommConfig, buffer_domain_sizes, clear_buffers, get_buffer

    options = MoECommConfig(backend="torch")
    group, other_group = dist.new_group(list(range(world_size))), dist.new_group(list(range(world_size)))
    small = get_buffer(group, 8, 64, 4, 2, options)
    reused = get_buffer(group, 8, 32, 4, 2, options) is small
    grown = get_buffer(group, 8, 128, 4, 2, options)
    other = get_buffer(other_group, 8, 64, 4, 2, options)
    result = dict(reused=reused, grown_is_new=grown is not small, old_alive=not _is_destroyed(small),
                  grown_alive=not _is_destroyed(grown), other_is_new=other not in (small, grown))
    old = weakref.ref(small)
    del small
    gc.collect()
    result["old_released"] = old() is None
    # Options that the shared buffer was not made with: every rank raises, naming them.
    for name, value in (("num_cpu_timeout_secs", 60.0), ("num_max_tokens_per_rank", 16)):
        try:
            get_buffer(group, 8, 64, 4, 2, dataclasses.replace(options, **{name: value}))
            result[name] = False  # no error
        except ValueError as exc:
            result[name] = name in str(exc) and str(value) in str(exc)
    clear_buffers()
    result["cleared"] = _is_destroyed(grown) and _is_destroyed(other)
    # A group destroyed without clear_buffers(): its buffer goes when the next one is made (it kept its memory).
    dead = get_buffer(group, 8, 64, 4, 2, options)
    dist.destroy_process_group(group)
    get_buffer(other_group, 8, 64, 4, 2, options)
    result["dead_group_released"] = _is_destroyed(dead) and len(buffer_domain_sizes()) == 1
    clear_buffers()
    return result


@dataclasses.dataclass(frozen=True)
class OverlapRow:
    """One row of the EP-overlap test: a dispatcher ("moe_comm" route A, "moe_comm_flex" route B, "alltoall")
    and, for route A, the layout and the CPU sync (`do_cpu_sync=False` builds grouped experts)."""

    name: str
    dispatcher: str
    do_expand: bool = False
    do_cpu_sync: bool = True

    def __str__(self) -> str:
        return self.name

    @property
    def route(self) -> str:
        return {"moe_comm": "A", "moe_comm_flex": "B"}.get(self.dispatcher, "")

    def moe_comm_config(self):
        from moe_comm.integrations.megatron import MoECommConfig

        if self.dispatcher != "moe_comm":
            return None
        return MoECommConfig(backend="torch", do_expand=self.do_expand, do_cpu_sync=self.do_cpu_sync)


OVERLAP_ROWS = [OverlapRow("A", "moe_comm"), OverlapRow("A-expand", "moe_comm", do_expand=True),
                OverlapRow("A-sync-free", "moe_comm", do_expand=True, do_cpu_sync=False),
                OverlapRow("B", "moe_comm_flex"), OverlapRow("alltoall", "alltoall")]


def _overlap_loss(output_tensor: torch.Tensor):
    loss = output_tensor.float().mean()
    return loss, {"loss": loss.detach().clone()}


def _overlap_forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """Megatron's `forward_step_func`: with `return_schedule_plan` (the EP-overlap schedule) the model's
    schedule plan instead of its output."""
    batch = next(data_iterator)
    args = (batch["input_ids"], batch["position_ids"], batch["attention_mask"])
    if return_schedule_plan:
        return model.build_schedule_plan(*args, labels=batch["labels"]), _overlap_loss
    return model(*args, labels=batch["labels"]), _overlap_loss


def ep_overlap_rank(rank: int, world_size: int, row: OverlapRow, dims: ModelDims, num_microbatches: int) -> dict:
    """Megatron's EP-overlap schedule (`overlap_moe_expert_parallel_comm`: combined 1F1B without pipelining) vs
    plain forward + backward per micro-batch, same weights and batches, bf16 (the overlap needs it): losses and
    every parameter gradient, plus what proves the overlap path ran."""
    import contextlib

    from megatron.core.pipeline_parallel import utils as pp_utils
    from megatron.core.pipeline_parallel.combined_1f1b import combined_1f1b_schedule_for_no_pipelining
    from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss
    from megatron.core.transformer.moe import token_dispatcher as mcore_token_dispatcher
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    device = setup_worker(0)
    restore = _flex_installed(Case("B", dims.moe_router_topk)) if row.route == "B" else (lambda: None)
    try:
        models = {}
        for name, overlap in (("plain", False), ("overlap", True)):
            config = transformer_config(dims, row.dispatcher, EP_SIZE, torch.bfloat16,
                                        overlap_moe_expert_parallel_comm=overlap)
            models[name] = build_gpt(config, dims, row.dispatcher, row.moe_comm_config(),
                                     grouped_experts=not row.do_cpu_sync).to(device)
        plain, overlapped = models["plain"], models["overlap"]
        overlapped.load_state_dict(plain.state_dict(), strict=False)  # strict=False: `_extra_state` entries
        gen = torch.Generator().manual_seed(1000 + rank)
        batches = [mock_batch(dims, 2, gen, device) for _ in range(num_microbatches)]

        # Plain: forward, Megatron's loss step (loss and aux-loss scale / micro-batches), backward. The aux-loss
        # scale is a class attribute: drop what earlier tests in this worker left (its shape differs by version).
        MoEAuxLossAutoScaler.main_loss_backward_scale = None
        plain_store = []
        for batch in batches:
            output, loss_func = _overlap_forward_step(iter([batch]), plain)
            loss, _ = forward_step_calc_loss(plain, output, loss_func, plain.config, None, False, num_microbatches,
                                             plain_store, cp_group_size=1, is_last_stage=True)
            loss.backward()

        # Overlap: the schedule Megatron's forward_backward_no_pipelining runs when the flag is set (called
        # directly: that function allocates its token count on "cuda"). Guards: no MoELayer.forward (the layers
        # run as schedule nodes), one schedule plan per micro-batch, the nodes that ran and whether they freed
        # their inputs, and for route B the calls of moe_comm's fused_dispatch.
        plans, nodes, dispatches = [], [], []
        node_forward, layer_forward = pp_utils.ScheduleNode.forward, MoELayer.forward
        fused_dispatch = mcore_token_dispatcher.fused_dispatch

        def forward_step(data_iterator, model, return_schedule_plan=False):
            plan, loss_func = _overlap_forward_step(data_iterator, model, return_schedule_plan)
            plans.append(type(plan).__name__)
            return plan, loss_func

        def recording_node_forward(self, *args, **kwargs):
            nodes.append((self.name, bool(self.free_input)))
            return node_forward(self, *args, **kwargs)

        def no_layer_forward(self, *args, **kwargs):
            raise AssertionError("MoELayer.forward ran: the EP-overlap schedule was not used")

        def recording_fused_dispatch(*args, **kwargs):
            dispatches.append("fused_dispatch")
            return fused_dispatch(*args, **kwargs)

        pp_utils.ScheduleNode.forward, MoELayer.forward = recording_node_forward, no_layer_forward
        if row.route == "B":
            mcore_token_dispatcher.fused_dispatch = recording_fused_dispatch
        try:
            store = []
            combined_1f1b_schedule_for_no_pipelining(
                forward_step_func=forward_step, data_iterator=iter(batches), model=overlapped,
                num_microbatches=num_microbatches, input_tensor=None, output_tensor_grad=None,
                forward_data_store=store, config=overlapped.config, collect_non_loss_data=False,
                first_val_step=None, forward_only=False, no_sync_func=contextlib.nullcontext,
                total_num_tokens=torch.zeros([], dtype=torch.int), check_first_val_step=lambda first: first)
        finally:
            pp_utils.ScheduleNode.forward, MoELayer.forward = node_forward, layer_forward
            mcore_token_dispatcher.fused_dispatch = fused_dispatch
        dispatchers = [layer.mlp.token_dispatcher for layer in overlapped.decoder.layers]
        dispatcher_types = sorted({type(d).__name__ for d in dispatchers})
        layouts = sorted({(d.options.do_expand, d.options.do_cpu_sync)
                          for d in dispatchers if hasattr(d, "options")})
        named = {"plain": {"losses": torch.stack([d["loss"] for d in plain_store]), **_grads(plain)},
                 "overlap": {"losses": torch.stack([d["loss"] for d in store]), **_grads(overlapped)}}
        return dict(parity=compare(named["plain"], named["overlap"]), plans=plans, nodes=nodes,
                    fused_dispatches=len(dispatches),
                    fused_dispatch_module=getattr(fused_dispatch, "__module__", None),
                    dispatcher_types=dispatcher_types, layouts=layouts)
    finally:
        restore()


# ----------------------------------------------------------------------------------------------------
# CPU tier
# ----------------------------------------------------------------------------------------------------
def test_core_never_imports_megatron():
    code = "import moe_comm, sys; assert not [m for m in sys.modules if m.startswith('megatron')], 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_import_guard_names_the_package():
    """Without megatron-core (no package metadata, `megatron` not importable): say so and how to install it."""
    code = ("import sys; sys.modules['megatron'] = None\n"
            "from importlib import metadata\n"
            "def version(name):\n    raise metadata.PackageNotFoundError(name)\n"
            "metadata.version = version\n"
            "try:\n    import moe_comm.integrations.megatron\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=120, capture_output=True, text=True)
    assert "needs megatron-core >= 0.16, which is not installed" in out.stdout, out.stdout
    assert "pip install 'moe_comm[megatron]'" in out.stdout, out.stdout


def test_import_error_names_missing_symbol_and_version(monkeypatch):
    """A symbol the integration imports is missing: the error names it and the installed version."""
    from importlib import metadata

    from megatron.core.transformer.moe import token_dispatcher

    from moe_comm.integrations.megatron import compat

    assert all(name in compat.REQUIRED_SYMBOLS["megatron.core.transformer.moe.token_dispatcher"]
               for name in ("MoETokenDispatcher", "fused_dispatch"))
    monkeypatch.delattr(token_dispatcher, "MoETokenDispatcher")
    monkeypatch.setattr(metadata, "version", lambda name: "0.15.0")
    with pytest.raises(ImportError, match=r"needs megatron\.core\.transformer\.moe\.token_dispatcher\."
                                          r"MoETokenDispatcher, which megatron-core 0.15.0 does not have "
                                          r"\(needs >= 0\.16"):
        compat.check_megatron_core()
    monkeypatch.setattr(metadata, "version", lambda name: "0.20.0")  # newer than checked: no ">= 0.16" advice
    with pytest.raises(ImportError, match=r"which megatron-core 0\.20\.0 does not have \(checked with 0\.16\.1"):
        compat.check_megatron_core()


def test_required_symbols_cover_every_megatron_import():
    """`compat.REQUIRED_SYMBOLS` lists every Megatron name the integration imports, so the import check
    (not a bare ImportError) reports any that is missing."""
    import ast

    from moe_comm.integrations.megatron import compat

    package = pathlib.Path(compat.__file__).parent
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron"):
                for alias in node.names:
                    assert alias.name in compat.REQUIRED_SYMBOLS.get(node.module, ()), (path.name, node.module,
                                                                                         alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("megatron") or alias.name in compat.REQUIRED_SYMBOLS, \
                        (path.name, alias.name)


def test_import_defines_missing_te_names():
    """megatron-core 0.16.1 without Transformer Engine: the router raises NameError until the integration is
    imported, which defines `te_general_gemm` and the `fused_*` names as None (as 0.17+ does)."""
    code = ("import torch\n"
            "from megatron.core.transformer.moe import moe_utils\n"
            "def gate():\n"
            "    return moe_utils.router_gating_linear(torch.ones(2, 4), torch.ones(3, 4), None, torch.float32)\n"
            "try:\n    gate(); before = 'ok'\nexcept NameError:\n    before = 'NameError'\n"
            "from moe_comm.integrations.megatron import compat\n"
            "missing = [n for n in compat.TE_NAMES if not hasattr(moe_utils, n)]\n"
            "print(before, gate().tolist() == [[4.0] * 3] * 2, missing)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=120, capture_output=True, text=True)
    before, gate_ok, missing = out.stdout.strip().split("\n")[-1].split(" ", 2)
    assert before in ("ok", "NameError") and gate_ok == "True" and missing == "[]", out.stdout


def test_define_missing_te_names_keeps_existing_ones(monkeypatch):
    from megatron.core.transformer.moe import moe_utils

    from moe_comm.integrations.megatron import compat

    gemm = object()
    monkeypatch.setattr(moe_utils, "te_general_gemm", gemm, raising=False)
    monkeypatch.delattr(moe_utils, "fused_permute", raising=False)
    compat.define_missing_te_names()
    assert moe_utils.te_general_gemm is gemm and moe_utils.fused_permute is None


def test_buffer_cache_keyed_by_group_releases_replaced_buffers(mcore_pool):
    for r in mcore_pool.run(buffer_cache_rank):
        assert all(r.values()), r


def test_install_flex_dispatcher_twice_restores_megatron_originals():
    """A second install must not save moe_comm's own functions as the originals; restore() (either one, any
    number of times) puts Megatron's back."""
    from megatron.core.transformer.moe import token_dispatcher

    from moe_comm.integrations.megatron import flex_route, install_flex_dispatcher

    names = ("fused_dispatch", "fused_combine", "set_deepep_num_sms")
    originals = {name: getattr(token_dispatcher, name) for name in names}
    restore_first = install_flex_dispatcher(backend="torch")
    try:
        restore_second = install_flex_dispatcher(backend="torch", num_sms=8, num_max_tokens_per_rank=64)
        assert flex_route._flex.options.num_max_tokens_per_rank == 64  # the buffer's size, not the first call's
        assert all(getattr(token_dispatcher, name) is getattr(flex_route, name) for name in names)
        restore_second()
        assert all(getattr(token_dispatcher, name) is fn for name, fn in originals.items())
        restore_second()
        restore_first()
        assert all(getattr(token_dispatcher, name) is fn for name, fn in originals.items())
        with pytest.raises(RuntimeError, match="not installed"):
            flex_route.fused_combine(torch.zeros(1, 1), None, None)
    finally:
        for name, fn in originals.items():
            setattr(token_dispatcher, name, fn)


def test_config_errors_name_the_argument():
    from moe_comm.integrations.megatron import MoECommConfig

    with pytest.raises(ValueError, match="quantize='fp4'"):
        MoECommConfig(quantize="fp4")
    with pytest.raises(ValueError, match="expert_alignment=0"):
        MoECommConfig(expert_alignment=0)
    with pytest.raises(ValueError, match="backend='nccl'"):
        MoECommConfig(backend="nccl")
    with pytest.raises(ValueError, match="num_sms=-1"):
        MoECommConfig(num_sms=-1)
    with pytest.raises(ValueError, match=r"num_cpu_timeout_secs=inf must be a number of seconds in \(0, 604800\]"):
        MoECommConfig(num_cpu_timeout_secs=float("inf"))
    with pytest.raises(ValueError, match="do_cpu_sync=False needs do_expand=True"):
        MoECommConfig(do_cpu_sync=False)
    with pytest.raises(ValueError, match=r"sl_idx=16 must be an InfiniBand service level in \[0, 15\]"):
        MoECommConfig(sl_idx=16)
    with pytest.raises(TypeError, match="sl_idx must be an int or None"):
        MoECommConfig(sl_idx="3")
    # A bool is not an int here (Buffer refused it only at the first forward), nor an alignment Buffer refuses.
    for name in ("num_sms", "expert_alignment", "num_max_tokens_per_rank"):
        with pytest.raises(TypeError, match=f"{name} must be an int, got True"):
            MoECommConfig(**{name: True})
    with pytest.raises(ValueError, match="expert_alignment=4096 exceeds 1024"):
        MoECommConfig(expert_alignment=4096)
    with pytest.raises(TypeError, match="do_expand must be a bool, got 1"):
        MoECommConfig(do_expand=1)
    assert MoECommConfig(sl_idx=3).sl_idx == 3


def test_expert_alignment_follows_router_padding():
    from moe_comm.integrations.megatron import MoECommConfig, expert_alignment_for

    def cfg(**kw):
        base = dict(moe_router_padding_for_quantization=False, fp8=None, fp8_recipe="delayed", fp4=None,
                    use_transformer_engine_op_fuser=False)  # read by megatron-core >= 0.18
        return types.SimpleNamespace(**{**base, **kw})

    assert expert_alignment_for(cfg(), MoECommConfig()) == 1
    assert expert_alignment_for(cfg(moe_router_padding_for_quantization=True, fp8="e4m3"), MoECommConfig()) == 16
    assert expert_alignment_for(cfg(moe_router_padding_for_quantization=True, fp8="e4m3", fp8_recipe="mxfp8"),
                                MoECommConfig()) == 32
    assert expert_alignment_for(cfg(), MoECommConfig(expert_alignment=32)) == 32


def test_routing_map_to_topk():
    from moe_comm.integrations.megatron import routing_map_to_topk

    routing_map = torch.tensor([[0, 1, 0, 1], [1, 0, 0, 0], [0, 0, 1, 1]], dtype=torch.bool)
    probs = torch.tensor([[.1, .6, .1, .2], [.7, .1, .1, .1], [.1, .1, .3, .5]], requires_grad=True)
    idx, weights = routing_map_to_topk(routing_map, probs, 2)
    assert idx.tolist() == [[1, 3], [0, -1], [2, 3]]
    assert torch.equal(weights, torch.tensor([[.6, .2], [.7, 0.], [.3, .5]]))
    weights.sum().backward()
    assert torch.equal(probs.grad, routing_map.float())


def _expert_rows_case(device: str, kernels, alignment: int, num_rows: int = 37, num_local: int = 12):
    """A non-expand receiver's plan over `num_rows` received rows and `num_local` local experts (bags of 0 to
    `num_local` rows, so the kernel's four-row loads run several times; with 40, rows of 32 and 33 experts too, the
    kernel's second 32-entry pass), expert blocks padded to `alignment`: `(ExpertRows, src_rows)`, the plan's own
    received row and pair of each expert row checked against the layout built here."""
    from moe_comm.integrations.expert_rows import ExpertRows

    g = torch.Generator().manual_seed(0)
    is_local = torch.rand(num_rows, num_local, generator=g) < 0.75
    if num_rows >= 2:
        is_local[:2] = torch.tensor([False, True]).unsqueeze(1)  # a row with no expert, a row with all of them
    for row, size in ((2, 32), (3, 33)):
        if num_rows > row and num_local > size:
            is_local[row] = torch.arange(num_local) < size
    blocks, src_pairs = [], []  # each expert row's received row and (row, expert) pair, padding past the end
    dest = torch.zeros(num_rows, num_local, dtype=torch.int64)
    for expert in range(num_local):
        rows = is_local[:, expert].nonzero().flatten().tolist()
        for row in rows:
            dest[row, expert] = len(blocks)
            blocks.append(row)
            src_pairs.append(row * num_local + expert)
        blocks += [num_rows] * (-len(rows) % alignment)
        src_pairs += [num_rows * num_local] * (-len(rows) % alignment)
    dest[~is_local] = len(blocks)
    src_rows = torch.tensor(blocks, dtype=torch.int64)
    plan = ExpertRows(dest.to(device), len(blocks), padded=alignment > 1, kernels=kernels)
    assert torch.equal(plan.src_rows.cpu(), src_rows)
    assert plan.src_pairs.tolist() == src_pairs
    return plan, src_rows


class _CountingKernels:
    """The kernel library, counting its expert_sum launches (the fallback gives the same bits)."""

    def __init__(self, kernels):
        self.kernels, self.launches = kernels, 0

    def expert_sum(self, *args):
        self.launches += 1
        return self.kernels.expert_sum(*args)

    def check(self, *args):
        return self.kernels.check(*args)


@pytest.mark.parametrize("alignment", [1, 4])
@pytest.mark.parametrize("device,kernels", [("cpu", False), *(pytest.param("cuda", k, marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]) for k in (False, True))],
    ids=["cpu", "cuda-embedding_bag", "cuda-kernel"])
def test_expert_rows_gather_and_sum(device, kernels, alignment):
    """The non-expand receiver's moves: the gather copies each received row to its experts' rows (padding rows
    zero); the sum adds each received row's expert rows in fp32 (fp64 for float64), experts ascending, from zero,
    rounded once, bit for bit against that loop on the CPU, padding left out, with torch's embedding_bag and with
    moe_comm's kernel (rows of 16-byte vectors, rows of other sizes, a base off 16 bytes, strided rows); each move
    is the other's adjoint (gradcheck); rows of the wrong shape are refused before anything runs."""
    from moe_comm.backends.cuda_kernels import load_kernels
    from moe_comm.integrations.expert_rows import ExpertRows, MoveExpertRows

    counting = _CountingKernels(load_kernels()) if kernels else None
    num_rows = 37
    plan, src_rows = _expert_rows_case(device, counting, alignment, num_rows)
    num_sums = 0
    # Rows of 16-byte vectors (24; 264: 33 to 132 vectors, a last pass of lanes partly idle), rows of other sizes
    # (21; 70 but in float64), a base off 16 bytes, strided rows; bags of up to 12 rows, then up to 40.
    cases = [(plan, src_rows, hidden, form) for hidden, form in (
        (24, "contiguous"), (21, "contiguous"), (264, "contiguous"), (70, "contiguous"), (24, "base off 16 bytes"),
        (24, "strided"))]
    long_plan, long_src_rows = _expert_rows_case(device, counting, alignment, num_rows, num_local=40)
    cases += [(long_plan, long_src_rows, hidden, "contiguous") for hidden in (24, 264, 21)]
    for dtype, (case_plan, case_rows, hidden, form) in itertools.product(
            (torch.float64, torch.float32, torch.bfloat16), cases):
        x = torch.randn(num_rows, hidden, dtype=dtype)
        expected = torch.cat([x, x.new_zeros(1, hidden)])[case_rows]
        assert torch.equal(case_plan.gather(x.to(device)).cpu(), expected)
        y = torch.randn(len(case_rows), hidden, dtype=dtype)
        acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        expected = torch.zeros(num_rows, hidden, dtype=acc_dtype)
        for pos, row in enumerate(case_rows.tolist()):  # positions ascend within a row's experts
            if row < num_rows:
                expected[row] += y[pos].to(acc_dtype)
        if form == "base off 16 bytes":
            y_dev = torch.cat([y.new_zeros(1), y.flatten()]).to(device)[1:].view(y.shape)
        elif form == "strided":
            y_dev = y.t().contiguous().to(device).t()
        else:
            y_dev = y.to(device)
        got = case_plan.sum(y_dev)
        num_sums += 1
        assert got.dtype == dtype
        assert torch.equal(got.cpu(), expected.to(dtype)), (dtype, hidden, form)
    if counting is not None:
        assert counting.launches == num_sums
    x = torch.randn(num_rows, 2, dtype=torch.float64, device=device, requires_grad=True)
    y = torch.randn(len(src_rows), 2, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: MoveExpertRows.apply(t, plan, True), (x,))
    assert torch.autograd.gradcheck(lambda t: MoveExpertRows.apply(t, plan, False), (y,))
    with pytest.raises(ValueError, match=r"ExpertRows.sum: rows must be \[%d, hidden\], got \(%d, 2\)"
                       % (len(src_rows), len(src_rows) - 1)):
        plan.sum(y.detach()[1:])
    with pytest.raises(ValueError, match=r"ExpertRows.gather: rows must be \[37, hidden\]"):
        plan.gather(x.detach().flatten())
    # No received rows, or received rows without an expert row: empty or zero results of the right shapes.
    empty, _ = _expert_rows_case(device, counting, alignment, num_rows=0)
    assert empty.sum(torch.zeros(0, 8, device=device)).shape == (0, 8)
    assert empty.gather(torch.zeros(0, 8, device=device)).shape == (0, 8)
    with pytest.raises(ValueError, match=r"ExpertRows: dest must be \[rows, local experts\] torch.int64, got \(3,\)"):
        ExpertRows(torch.zeros(3, dtype=torch.int64, device=device), 0, padded=False)
    none = ExpertRows(torch.zeros(3, 4, dtype=torch.int64, device=device), 0, padded=False, kernels=counting)
    assert torch.equal(none.sum(torch.zeros(0, 8, device=device)), torch.zeros(3, 8, device=device))
    assert none.gather(torch.ones(3, 8, device=device)).shape == (0, 8)


def test_layer_spec_forms():
    """ModuleSpec (<= 0.17), functools.partial (0.18+) and block specs are rewritten; the input is untouched."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from moe_comm.integrations.megatron import MoECommConfig, MoECommMoELayer, moe_comm_layer_spec

    def target(builder):  # the class a builder makes, in either spec form
        return builder.func if isinstance(builder, functools.partial) else builder.module

    def options_of(builder):
        return builder.keywords["moe_comm_config"] if isinstance(builder, functools.partial) \
            else builder.params["moe_comm_config"]

    options = MoECommConfig(do_expand=True)
    spec = get_gpt_layer_local_spec(num_experts=4)  # ModuleSpec mlp up to 0.17, partial from 0.18
    new = moe_comm_layer_spec(spec, options)
    assert target(spec.submodules.mlp) is MoELayer
    assert target(new.submodules.mlp) is MoECommMoELayer and options_of(new.submodules.mlp) is options

    old_mlp = ModuleSpec(module=MoELayer, submodules=MoESubmodules(experts=None))
    new = moe_comm_layer_spec(ModuleSpec(module=object, submodules=types.SimpleNamespace(mlp=old_mlp)), options)
    assert new.submodules.mlp.module is MoECommMoELayer and new.submodules.mlp.params["moe_comm_config"] is options
    assert new.submodules.mlp.submodules == old_mlp.submodules

    submodules = MoESubmodules(experts=None)
    partial_spec = ModuleSpec(module=object, submodules=types.SimpleNamespace(
        mlp=functools.partial(MoELayer, submodules=submodules)))
    new = moe_comm_layer_spec(partial_spec, options)
    assert new.submodules.mlp.func is MoECommMoELayer
    assert new.submodules.mlp.keywords["moe_comm_config"] is options
    assert isinstance(new.submodules.mlp.keywords["submodules"], MoESubmodules)

    dense = get_gpt_layer_local_spec(num_experts=None)
    block = types.SimpleNamespace(layer_specs=[dense, spec])
    new = moe_comm_layer_spec(block)
    assert target(new.layer_specs[0].submodules.mlp) == target(dense.submodules.mlp)
    assert target(new.layer_specs[1].submodules.mlp) is MoECommMoELayer
    with pytest.raises(ValueError, match="no MoELayer"):
        moe_comm_layer_spec(dense)


def test_flex_dispatcher_builds_on_moe_comm(mcore_pool):
    for r in mcore_pool.run(flex_build_rank):
        assert r == dict(manager="_DeepepManager", refused_after_restore=True), r


def test_module_runner_installs_route_b(tmp_path):
    """`python -m moe_comm.integrations.megatron SCRIPT ARGS` runs SCRIPT with route B installed, its options
    written either way, the script's own passed on untouched; without a script it exits 2 with its usage."""
    script = tmp_path / "pretrain_stub.py"
    script.write_text("import sys\n"
                      "from megatron.core.transformer.moe import token_dispatcher as td\n"
                      "print(td.fused_dispatch.__module__, sys.argv[1:], __name__)\n")
    runner = [sys.executable, "-m", "moe_comm.integrations.megatron"]
    for option in (["--moe-comm-backend=torch"], ["--moe-comm-backend", "torch"]):
        out = subprocess.run(runner + option + [str(script), "--num-layers", "2", "-h"], check=True, timeout=120,
                             capture_output=True, text=True)
        assert out.stdout.split("\n")[-2] == \
            "moe_comm.integrations.megatron.flex_route ['--num-layers', '2', '-h'] __main__", out.stdout
    out = subprocess.run(runner, timeout=120, capture_output=True, text=True)
    assert out.returncode == 2 and "the following arguments are required: script" in out.stderr, out.stderr


@pytest.mark.parametrize("case", FAST_LAYER_CASES, ids=str)
def test_moe_layer_parity(mcore_pool, case):
    assert_parity(mcore_pool.run(layer_parity_rank, case, LAYER_DIMS, {}), case.exact)


@pytest.mark.parametrize("case", FAST_GPT_CASES, ids=str)
def test_gpt_parity(mcore_pool, case):
    assert_parity(mcore_pool.run(gpt_parity_rank, case, GPT_DIMS, 3), case.exact)


@pytest.mark.parametrize("do_expand,alignment", [(False, 16), (True, 32)])
def test_expert_alignment_pads_tokens_per_expert(mcore_pool, do_expand, alignment):
    """Padded blocks (FP8 16 / MXFP8 32) give Megatron's unpadded alltoall results to float32 rounding: the
    expert GEMMs get extra zero rows, and GEMM kernels pick their tiling (and so their summation order) by
    shape. Counts are checked exactly in the worker."""
    case = Case("A", 2, do_expand=do_expand)
    assert_parity(mcore_pool.run(dispatcher_parity_rank, case, LAYER_DIMS, alignment, None), exact=False)


def shared_buffer_rank(rank: int, world_size: int) -> list[str]:
    """The buffer cache behind both routes (`get_buffer`): a layer that grows the shared buffer (FP8 here) leaves an
    earlier layer's backward its old buffer (it was destroyed, and that backward raised 'destroyed' in the first
    step); a call with more tokens on one rank than the buffer holds is refused on every rank by the dispatch
    (the check in get_buffer raised on that rank alone, and its peer waited for it until its timeout)."""
    from moe_comm import autograd as moe_autograd
    from moe_comm.integrations.megatron import MoECommConfig, clear_buffers
    from moe_comm.integrations.megatron.buffers import get_buffer

    import torch.distributed as dist

    setup_worker(0)
    group = dist.new_group(list(range(world_size)))  # of its own: the cache holds the other tests' buffers
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(16, 128, generator=g).bfloat16().requires_grad_()
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(16)])
    w = torch.rand(16, 2, generator=g)
    plain = get_buffer(group, 16, 128, 2, 2, MoECommConfig(backend="torch", num_cpu_timeout_secs=30))
    recv_x, _, _, handle, _ = moe_autograd.dispatch(plain, x, idx, w, num_experts=4)
    out, _ = moe_autograd.combine(plain, recv_x, handle)
    grown = get_buffer(group, 16, 128, 2, 2, MoECommConfig(backend="torch", quantize="mxfp8",
                                                           num_cpu_timeout_secs=30))
    out.float().sum().backward()  # on the old buffer
    ranks_per_token = 1 + (idx[:, 0] // 2 != idx[:, 1] // 2).to(x.dtype)  # d(sum of out)/dx: one row per rank
    results = [str(grown is not plain and grown.use_fp8_dispatch),
               str(torch.equal(x.grad, ranks_per_token[:, None].expand_as(x)))]
    rows = 32 if rank == 0 else 16
    buf = get_buffer(group, rows, 128, 2, 2, MoECommConfig(backend="torch", quantize="mxfp8",
                                                           num_cpu_timeout_secs=30))
    with pytest.raises(ValueError) as info:
        moe_autograd.dispatch(buf, torch.zeros(rows, 128, dtype=torch.bfloat16), idx[:1].repeat(rows, 1), None,
                              num_experts=4)
    results.append(str(info.value).split(" (make")[0])
    clear_buffers()
    return results


def test_shared_buffer_grows_and_refuses_on_every_rank(mcore_pool):
    results = mcore_pool.run(shared_buffer_rank)
    assert results == [["True", "True", "num_tokens=32 (x rows) exceeds num_max_tokens_per_rank=16"],
                       ["True", "True", "dispatch: rank(s) [0] refused their arguments (their error says why)"]]


def quantize_refused_rank(rank: int, world_size: int, dtype: str, hidden: int) -> str:
    """MoECommConfig(quantize=) on a model it cannot cast: refused when the dispatcher is built."""
    from moe_comm.integrations.megatron import MoECommConfig, MoECommTokenDispatcher

    setup_worker(0)
    dims = dataclasses.replace(LAYER_DIMS, hidden_size=hidden)
    config = transformer_config(dims, "alltoall", EP_SIZE, getattr(torch, dtype))
    num_local = dims.num_experts // EP_SIZE
    with pytest.raises(ValueError) as info:
        MoECommTokenDispatcher(num_local, list(range(rank * num_local, (rank + 1) * num_local)), config, _pg(),
                               MoECommConfig(quantize="mxfp8"))
    return str(info.value)


@pytest.mark.parametrize("dtype, hidden", [("float32", 128), ("bfloat16", 64)])
def test_fp8_wire_refused_at_construction(mcore_pool, dtype, hidden):
    expected = (f"MoECommConfig(quantize='mxfp8') casts bf16 rows of a hidden size that is a multiple of 128; this "
                f"model has params_dtype=torch.{dtype}, hidden_size={hidden}")
    assert mcore_pool.run(quantize_refused_rank, dtype, hidden) == [expected] * 2


@pytest.mark.parametrize("quantize", ["fp8_block128", "mxfp8"])
def test_fp8_wire_matches_alltoall_on_dequantized_inputs(mcore_pool, quantize):
    case = Case("A", 2, dtype="bfloat16")
    dims = dataclasses.replace(LAYER_DIMS, hidden_size=128)
    assert_parity(mcore_pool.run(dispatcher_parity_rank, case, dims, 1, quantize), exact=True)


def test_async_comm_is_waited_where_used(mcore_pool):
    results = mcore_pool.run(async_overlap_rank, Case("A", 2), LAYER_DIMS)
    for r in results:
        assert r["pending_after_dispatch"] and r["waited"] and r["pending_after_combine"], r
        assert r["num_sms"] > 0, r


SHARED_EXPERT_OVERLAP = dict(moe_shared_expert_intermediate_size=32, moe_shared_expert_overlap=True,
                             add_bias_linear=False)
FLEX_SHARED_EXPERT_OVERLAP_SINCE = "0.18"  # first megatron-core whose config takes it with the flex dispatcher


def _megatron_core_before(version: str):
    """True / False: the installed megatron-core is older than `version`; None: its version is unknown."""
    from packaging.version import Version

    from moe_comm.integrations.megatron.compat import megatron_core_version

    installed = megatron_core_version()
    return None if installed is None else installed < Version(version)


@pytest.mark.parametrize("route", ["A", "B"])
def test_shared_expert_overlap_parity(mcore_pool, route):
    """`moe_shared_expert_overlap`: the shared expert runs while the dispatch and combine are in flight, bitwise
    equal to alltoall with the same flag (route A on every version; route B needs megatron-core 0.18+)."""
    if route == "B" and _megatron_core_before(FLEX_SHARED_EXPERT_OVERLAP_SINCE) is not False:
        pytest.skip(f"megatron-core < {FLEX_SHARED_EXPERT_OVERLAP_SINCE} refuses moe_shared_expert_overlap with the "
                    f"flex dispatcher (test_flex_shared_expert_overlap_refused_before_0_18)")
    assert_parity(mcore_pool.run(layer_parity_rank, Case(route, 2), LAYER_DIMS, SHARED_EXPERT_OVERLAP), exact=True)


def test_flex_shared_expert_overlap_refused_before_0_18():
    """Route B keeps `moe_token_dispatcher_type="flex"`, and megatron-core < 0.18 accepts
    `moe_shared_expert_overlap` with "alltoall" only: its own TransformerConfig check raises, before any
    moe_comm code runs. 0.18 added "flex" to that check (route B's overlap then runs:
    test_shared_expert_overlap_parity[B]); route A (config "alltoall") works on every version."""
    before = _megatron_core_before(FLEX_SHARED_EXPERT_OVERLAP_SINCE)
    if before is None:
        pytest.skip("the installed megatron-core has no package metadata: its version is unknown")
    if not before:
        pytest.skip(f"megatron-core >= {FLEX_SHARED_EXPERT_OVERLAP_SINCE} accepts moe_shared_expert_overlap with "
                    f"the flex dispatcher (test_shared_expert_overlap_parity[B] runs it)")
    with pytest.raises(ValueError, match="moe_shared_expert_overlap only works with alltoall token dispatcher"):
        transformer_config(LAYER_DIMS, "moe_comm_flex", EP_SIZE, **SHARED_EXPERT_OVERLAP)


@pytest.fixture(scope="module")
def hybrid_pool():
    """4 gloo ranks, EP=4, made into 2 hosts x 2 by MOE_COMM_RANKS_PER_NODE=2 inside the workers."""
    with WorkerPool(4, backend="gloo", timeout_s=600) as pool:
        yield pool


HYBRID_LAYER_CASES = [Case("A", 2), Case("A", 4, do_expand=True), Case("B", 2)]


@pytest.mark.parametrize("case", HYBRID_LAYER_CASES, ids=str)
def test_moe_layer_parity_on_hybrid_path(hybrid_pool, case):
    """Both routes unchanged on the hybrid path (deterministic: bitwise as on the direct path)."""
    results = hybrid_pool.run(hybrid_parity_rank, 2, layer_parity_rank, case, LAYER_DIMS, {})
    assert all(domains == [(2, 2)] for _, domains in results), [domains for _, domains in results]
    assert_parity([result for result, _ in results], case.exact)


def test_gpt_parity_on_hybrid_path(hybrid_pool):
    results = hybrid_pool.run(hybrid_parity_rank, 2, gpt_parity_rank, Case("A", 2, do_expand=True), GPT_DIMS, 3)
    assert all(domains == [(2, 2)] for _, domains in results), [domains for _, domains in results]
    assert_parity([result for result, _ in results], exact=True)


def test_sync_free_layer_matches_alltoall(mcore_pool):
    """Expand, no CPU sync, grouped experts with device counts vs alltoall + SequentialMLP: bitwise in float32,
    except the expert bias gradients (a float32 scatter-add of rows, MoECommGroupedMLP's docstring)."""
    for rank, result in enumerate(mcore_pool.run(sync_free_layer_rank, "float32", EP_SIZE, False)):
        assert result["zero_tail"] is False  # the layer's combine never reads the worst case's tail rows
        parity = result["parity"]
        bias = {k: v for k, v in parity.items() if k.startswith("experts.") and k.endswith("_bias")}
        assert_parity([{k: v for k, v in parity.items() if k not in bias}], exact=True)
        assert_parity([bias], exact=False)


OVERLAP_MICROBATCHES = 3


@pytest.mark.parametrize("row", OVERLAP_ROWS, ids=str)
def test_ep_overlap_schedule_matches_plain_steps(mcore_pool, row):
    """`overlap_moe_expert_parallel_comm`: Megatron's combined-1F1B schedule (layers split into schedule nodes,
    one micro-batch's forward interleaved with another's backward) gives the losses and every parameter gradient
    of plain forward + backward steps bit for bit, bf16, 2-layer GPTModel, 3 micro-batches. Route A frees
    nothing it still needs (the schedule frees the dispatch and expert nodes' inputs); the alltoall row checks
    the harness itself."""
    results = mcore_pool.run(ep_overlap_rank, row, GPT_DIMS, OVERLAP_MICROBATCHES)
    num_layer_steps = GPT_DIMS.num_layers * OVERLAP_MICROBATCHES
    for rank, result in enumerate(results):
        assert result["plans"] == ["TransformerModelChunkSchedulePlan"] * OVERLAP_MICROBATCHES, (rank, result)
        names = [name for name, _ in result["nodes"]]
        assert all(names.count(name) == num_layer_steps for name in ("moe_dispatch", "mlp", "moe_combine")), \
            (rank, names)
        if row.route == "A":
            assert result["dispatcher_types"] == ["MoECommTokenDispatcher"], (rank, result)
            assert result["layouts"] == [(row.do_expand, row.do_cpu_sync)], (rank, result)
            assert {("moe_dispatch", True), ("mlp", True)} <= set(result["nodes"]), (rank, result["nodes"])
        elif row.route == "B":
            assert result["dispatcher_types"] == ["MoEFlexTokenDispatcher"], (rank, result)
            assert result["fused_dispatch_module"] == "moe_comm.integrations.megatron.flex_route", (rank, result)
            assert result["fused_dispatches"] == num_layer_steps, (rank, result)
        else:
            assert result["dispatcher_types"] == ["MoEAlltoAllTokenDispatcher"], (rank, result)
        assert_parity([result["parity"]], exact=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", full_matrix(), ids=str)
def test_moe_layer_parity_full(mcore_pool, case):
    assert_parity(mcore_pool.run(layer_parity_rank, case, LAYER_DIMS, {}), case.exact)


@pytest.mark.slow
@pytest.mark.parametrize("case", full_matrix(), ids=str)
def test_gpt_parity_full(mcore_pool, case):
    assert_parity(mcore_pool.run(gpt_parity_rank, case, GPT_DIMS, 3), case.exact)


# ----------------------------------------------------------------------------------------------------
# GPU tier: 2 GPUs, NCCL, backend "auto" (the CUDA backend where it exists)
# ----------------------------------------------------------------------------------------------------
GPU_DIMS = dataclasses.replace(LAYER_DIMS, hidden_size=256, moe_ffn_hidden_size=512)
GPU_CASES = [Case(route, topk, do_expand, backend="auto", dtype=dtype)
             for dtype in ("float32", "bfloat16") for topk in (1, 2, 4)
             for route, do_expand in (("A", False), ("A", True), ("B", False))]


def _gpu_rel_tol(case: Case) -> float:
    return NONEXACT_REL_TOL * 10 if case.dtype == "float32" else BF16_REL_TOL


@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_gpu_moe_layer_parity(nccl_pool, case):
    # GPU scatter-adds use atomics and cuBLAS may tile differently, so GPU results are compared to a tolerance.
    assert_parity(nccl_pool.run(layer_parity_rank, case, GPU_DIMS, {}), exact=False, rel_tol=_gpu_rel_tol(case))


@pytest.mark.parametrize("route", ["A", "B"])
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_gpu_gpt_parity_bf16(nccl_pool, route):
    case = Case(route, 2, do_expand=route == "A", backend="auto", dtype="bfloat16")
    results = nccl_pool.run(gpt_parity_rank, case, dataclasses.replace(GPT_DIMS, hidden_size=256), 3)
    assert_parity(results, exact=False, rel_tol=BF16_REL_TOL)


@pytest.mark.parametrize("quantize", ["fp8_block128", "mxfp8"])
@pytest.mark.parametrize("do_expand", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_gpu_fp8_wire(nccl_pool, quantize, do_expand):
    case = Case("A", 2, do_expand=do_expand, backend="auto", dtype="bfloat16")
    results = nccl_pool.run(dispatcher_parity_rank, case, GPU_DIMS, 16, quantize)
    assert_parity(results, exact=False, rel_tol=BF16_REL_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs CUDA")
def test_gpu_sync_free_layer():
    """One GPU per rank (EP = min(2, GPUs)), bf16: the sync-free layer matches alltoall + SequentialMLP to bf16
    rounding, makes no host sync in forward + backward, and replays from one CUDA graph like eager."""
    world_size = min(torch.cuda.device_count(), 2)
    with WorkerPool(world_size, backend="nccl", timeout_s=600) as pool:
        results = pool.run(sync_free_layer_rank, "bfloat16", world_size, True)
    for result in results:
        assert_parity([result["parity"]], exact=False, rel_tol=BF16_REL_TOL)
        for replay in result["graph"]:
            assert_parity([replay], exact=False, rel_tol=BF16_REL_TOL)


# ----------------------------------------------------------------------------------------------------
# Shared-GPU tier: the GPU cases above with two ranks on one GPU, for a machine with a single GPU: a gloo world
# (NCCL refuses two ranks on one device; gloo stages Megatron's CUDA tensors through the host), moe_comm's buffers
# on that GPU with their peers mapped by CUDA IPC (`moe_comm.testing.shared_gpu`), so route A and B run the CUDA
# kernels at EP2. Correctness only.
# ----------------------------------------------------------------------------------------------------
# With two GPUs the test_gpu_* cases above run the same over NCCL, one GPU per rank.
one_gpu = pytest.mark.skipif(torch.cuda.device_count() != 1, reason="one GPU for two ranks (with 2, see test_gpu_*)")


@pytest.fixture(scope="module")
def shared_gpu_pool():
    with WorkerPool(2, backend="gloo", timeout_s=600) as pool:
        yield pool


def on_shared_gpu(rank: int, world_size: int, fn, *args):
    """`fn(rank, world_size, *args)` with this rank's CUDA buffers on GPU 0, their peers over IPC; checks that the
    integration's buffers, made afresh for the call, ran the CUDA backend (backend "auto" would fall back to the
    reference with a warning)."""
    from moe_comm.integrations.megatron.buffers import _buffers, clear_buffers
    from moe_comm.testing.shared_gpu import every_buffer_over_ipc

    clear_buffers()
    with every_buffer_over_ipc():
        result = fn(rank, world_size, *args)
    backends = {buf._impl.name for buf in _buffers.values()}
    assert backends == {"cuda"}, f"the integration's buffers ran {backends or 'nothing'}, not the CUDA backend"
    return result


@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@pytest.mark.gpu
@one_gpu
def test_shared_gpu_moe_layer_parity(shared_gpu_pool, case):
    results = shared_gpu_pool.run(on_shared_gpu, layer_parity_rank, case, GPU_DIMS, {})
    assert_parity(results, exact=False, rel_tol=_gpu_rel_tol(case))


@pytest.mark.parametrize("route", ["A", "B"])
@pytest.mark.gpu
@one_gpu
def test_shared_gpu_gpt_parity_bf16(shared_gpu_pool, route):
    case = Case(route, 2, do_expand=route == "A", backend="auto", dtype="bfloat16")
    results = shared_gpu_pool.run(on_shared_gpu, gpt_parity_rank, case, dataclasses.replace(GPT_DIMS, hidden_size=256),
                                  3)
    assert_parity(results, exact=False, rel_tol=BF16_REL_TOL)


@pytest.mark.parametrize("quantize", ["fp8_block128", "mxfp8"])
@pytest.mark.parametrize("do_expand", [False, True])
@pytest.mark.gpu
@one_gpu
def test_shared_gpu_fp8_wire(shared_gpu_pool, quantize, do_expand):
    case = Case("A", 2, do_expand=do_expand, backend="auto", dtype="bfloat16")
    results = shared_gpu_pool.run(on_shared_gpu, dispatcher_parity_rank, case, GPU_DIMS, 16, quantize)
    assert_parity(results, exact=False, rel_tol=BF16_REL_TOL)


@pytest.mark.gpu
@one_gpu
def test_shared_gpu_sync_free_layer(shared_gpu_pool):
    """EP2 on one GPU: parity with alltoall + SequentialMLP and no host sync (the graph replay runs on one GPU per
    rank in test_gpu_sync_free_layer)."""
    results = shared_gpu_pool.run(on_shared_gpu, sync_free_layer_rank, "bfloat16", 2, False)
    for result in results:
        assert_parity([result["parity"]], exact=False, rel_tol=BF16_REL_TOL)
