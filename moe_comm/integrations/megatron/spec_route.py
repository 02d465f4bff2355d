"""Route A: moe_comm as the token dispatcher of a `MoELayer` put in a layer spec.

`moe_comm_layer_spec` swaps every `MoELayer` in a layer or block spec for `MoECommMoELayer`, whose token
dispatcher is `MoECommTokenDispatcher` (Megatron's six-step dispatcher contract on `moe_comm.Buffer` and its
autograd pair). Shape legend: see the package docstring. (Over 400 lines: route A whole, the dispatcher, the
layer that carries it and the spec rewrite that puts the layer in, each used only through the others.)
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Optional

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization, get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import get_pg_rank

from ... import autograd as moe_autograd
from ...backends.cuda_kernels import load_kernels
from ...buffer import Buffer
from ..expert_rows import ExpertRows, MoveExpertRows
from ...handle import EPHandle
from .buffers import get_buffer
from .experts import MoECommGroupedMLP, host_to_device
from .options import MoECommConfig


def routing_map_to_topk(routing_map: torch.Tensor, probs: torch.Tensor,
                        num_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's multi-hot routing to moe_comm's top-k slots, slots in ascending expert order.

    The ascending order makes the expand-mode combine add a token's rows in the order Megatron's unpermute
    does (ascending expert), so results match bit for bit.

    Arguments:
        routing_map: `[T, E]`, `torch.bool`, at most `num_topk` True per row (fewer for dropped tokens).
        probs: `[T, E]` routing probabilities (any float dtype).
        num_topk: K, the router's top-k.

    Returns:
        `(topk_idx, topk_weights)`: `[T, K]` `torch.int64` expert ids (-1 for empty slots) and `[T, K]`
        `torch.float32` probabilities (0 for empty slots), differentiable with respect to `probs`.
    """
    num_experts = routing_map.shape[1]
    if num_topk > num_experts:
        raise ValueError(f"num_topk={num_topk} exceeds the routing map's {num_experts} experts")
    expert_ids = torch.arange(num_experts, device=routing_map.device)
    keys = torch.where(routing_map, expert_ids, num_experts)  # unselected experts sort last
    topk_idx = keys.topk(num_topk, dim=1, largest=False, sorted=True).values
    valid = topk_idx < num_experts
    topk_idx = torch.where(valid, topk_idx, -1)
    topk_weights = probs.float().gather(1, topk_idx.clamp(min=0)).masked_fill(~valid, 0.0)
    return topk_idx, topk_weights


def expert_alignment_for(config, options: MoECommConfig) -> int:
    """Rows per expert block are padded to this: `options.expert_alignment` if set, else Megatron's router
    padding for quantization (16 for FP8, 32 for the MXFP8 recipe) when enabled, else 1."""
    if options.expert_alignment is not None:
        return options.expert_alignment
    if config.moe_router_padding_for_quantization:
        return get_align_size_for_quantization(config)
    return 1


class MoECommTokenDispatcher(MoETokenDispatcher):
    """Megatron-core `MoETokenDispatcher` on `moe_comm.Buffer` and its autograd pair.

    The six steps, as `MoELayer` calls them:
    1. `dispatch_preprocess`: routing map and probs -> top-k slots (local work).
    2. `token_dispatch`: `moe_comm.autograd.dispatch` on the comm stream (async with `async_comm`).
    3. `dispatch_postprocess`: waits for the dispatch, then hands the experts rows grouped by local expert,
       `tokens_per_expert` (a CPU int64 tensor, as Megatron's experts call `.tolist()`; with
       `do_cpu_sync=False` an int64 tensor on the device, for `MoECommGroupedMLP`) and per-row probs.
    4. `combine_preprocess`: non-expand: sums each token's local expert outputs into its received row.
    5. `token_combine`: `moe_comm.autograd.combine` on the comm stream (async with `async_comm`).
    6. `combine_postprocess`: waits for the combine, restores `[S, B, H]` (adds overlapped shared experts).

    Megatron's experts apply the probabilities (`per_token_scale`); combine only sums, as Megatron's unpermute.

    Arguments:
        num_local_experts: L, experts on this rank.
        local_expert_indices: their global ids, `ep_rank * L ... ep_rank * L + L - 1`.
        config: Megatron's `TransformerConfig` (top-k, expert count, router padding).
        pg_collection: Megatron's process groups (None: the global parallel state). Dispatch runs over `ep`;
            expert tensor parallelism (`expt_tp` size > 1) is not supported here (use route B).
        moe_comm_config: `MoECommConfig` (None: defaults).
    """

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config,
                 pg_collection=None, moe_comm_config: Optional[MoECommConfig] = None) -> None:
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        super().__init__(config=config, pg_collection=pg_collection)
        options = MoECommConfig() if moe_comm_config is None else moe_comm_config
        if not isinstance(options, MoECommConfig):
            raise TypeError(f"moe_comm_config must be a MoECommConfig, got {type(options).__name__}")
        if self.tp_size != 1:
            raise ValueError(f"MoECommTokenDispatcher needs expert_tensor_parallel_size=1, got {self.tp_size}; "
                             f"for expert tensor parallelism use install_flex_dispatcher() (route B)")
        if config.moe_pad_expert_input_to_capacity:
            raise ValueError("MoECommTokenDispatcher does not support moe_pad_expert_input_to_capacity=True "
                             "(dropless or capacity-dropping routing only)")
        self.ep_rank = get_pg_rank(self.ep_group)
        self.num_experts = config.num_moe_experts
        self.num_local_experts = num_local_experts
        self.num_topk = config.moe_router_topk
        if num_local_experts * self.ep_size != self.num_experts:
            raise ValueError(f"num_local_experts={num_local_experts} x ep_size={self.ep_size} != "
                             f"num_moe_experts={self.num_experts}")
        expected = list(range(self.ep_rank * num_local_experts, (self.ep_rank + 1) * num_local_experts))
        if list(local_expert_indices) != expected:
            raise ValueError(f"local_expert_indices={list(local_expert_indices)} must be {expected} "
                             f"(experts laid out contiguously by EP rank)")
        self.local_expert_indices = list(local_expert_indices)
        if options.quantize is not None and (config.params_dtype != torch.bfloat16 or config.hidden_size % 128):
            raise ValueError(f"MoECommConfig(quantize={options.quantize!r}) casts bf16 rows of a hidden size that is a "
                             f"multiple of 128; this model has params_dtype={config.params_dtype}, hidden_size="
                             f"{config.hidden_size}")
        self.options = options
        self.expert_alignment = expert_alignment_for(config, options)
        # Megatron's partial CUDA graphs (`cuda_graph_scope` with moe_router / moe_preprocess) replay
        # dispatch_preprocess without running its Python: what it leaves for token_dispatch is restored from these.
        self.cudagraph_attrs = ["topk_idx"]
        # NOTES: Megatron's EP-overlap schedule (`overlap_moe_expert_parallel_comm`) runs a layer as separate
        # schedule nodes and frees the storage of the "moe_dispatch" and "mlp" nodes' inputs after their forward
        # (`should_free_input`: it expects alltoall's dispatch_preprocess / dispatch_postprocess to return
        # copies). Ours return aliases of tensors autograd saved: the `[T, H]` rows are a view of the pre-MLP
        # layernorm output (saved by the router), and in the expand layout the experts get `recv_x` itself
        # (saved by fc1). So under that schedule both are copied; otherwise the backward reads freed storage.
        self.copy_freed_inputs = bool(getattr(config, "overlap_moe_expert_parallel_comm", False))
        # State of the forward in flight (one per MoELayer call).
        self.hidden_shape = None
        self.probs_dtype = None
        self.topk_idx = None
        self.buffer: Optional[Buffer] = None
        self.handle: Optional[EPHandle] = None
        self.recv_topk_idx = None
        self.expert_rows: Optional[ExpertRows] = None
        self.dispatch_event = None
        self.combine_event = None
        self.last_num_sms = 0  # SMs the last dispatch ran with (for logs)

    # 1 ------------------------------------------------------------------------------------------------
    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """`[S, B, H]` tokens, `[T, E]` bool routing map and probs -> `([T, H] rows, [T, K] float32 weights)`."""
        self.hidden_shape = hidden_states.shape
        hidden = hidden_states.reshape(-1, self.hidden_shape[-1])
        if self.copy_freed_inputs:  # see NOTES in __init__
            hidden = hidden.clone()
        num_tokens = hidden.shape[0]
        if tuple(routing_map.shape) != (num_tokens, self.num_experts) or routing_map.dtype != torch.bool:
            raise ValueError(f"routing_map must be [{num_tokens}, {self.num_experts}] torch.bool, got "
                             f"{tuple(routing_map.shape)} {routing_map.dtype}")
        if tuple(probs.shape) != tuple(routing_map.shape):
            raise ValueError(f"probs shape {tuple(probs.shape)} != routing_map shape {tuple(routing_map.shape)}")
        self.probs_dtype = probs.dtype
        self.topk_idx, topk_weights = routing_map_to_topk(routing_map, probs, self.num_topk)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states)
        return hidden, topk_weights

    # 2 ------------------------------------------------------------------------------------------------
    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Send rows and weights to the ranks of their experts; returns before completion with `async_comm`."""
        options = self.options
        num_tokens, hidden = hidden_states.shape
        self.buffer = get_buffer(self.ep_group, num_tokens, hidden, hidden_states.element_size(), self.num_topk,
                                 options)
        recv_x, recv_topk_idx, recv_weights, handle, event = moe_autograd.dispatch(
            self.buffer, hidden_states.contiguous(), self.topk_idx, probs.contiguous(),
            num_experts=self.num_experts, expert_alignment=self.expert_alignment, num_sms=options.num_sms,
            do_expand=options.do_expand, do_cpu_sync=options.do_cpu_sync, quantize=options.quantize,
            dequantize=options.quantize is not None, async_with_compute_stream=options.async_comm)
        self.handle, self.recv_topk_idx, self.dispatch_event = handle, recv_topk_idx, event
        self.last_num_sms = handle.num_sms
        self.topk_idx = None
        if self.shared_experts is not None:
            # Runs on the shared experts' stream while the dispatch is in flight.
            self.shared_experts.linear_fc1_forward_and_act(recv_x)
        return recv_x, recv_weights

    def set_shared_experts(self, shared_experts) -> None:
        """As Megatron's alltoall dispatcher: the shared experts' state that dispatch_preprocess leaves (their fc1
        input, the gate score) is restored after a partial CUDA graph's replay too."""
        super().set_shared_experts(shared_experts)
        if shared_experts.use_shared_expert_gate:
            self.cudagraph_attrs.append("shared_experts.gate_score")
        self.cudagraph_attrs.append("shared_experts.cached_fc1_input")

    def wait_dispatch(self) -> None:
        """Make the current stream wait for the dispatch in flight (no-op if done)."""
        if self.dispatch_event is not None:
            event, self.dispatch_event = self.dispatch_event, None
            event.current_stream_wait()

    # 3 ------------------------------------------------------------------------------------------------
    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Received rows -> `(rows [P, H] grouped by local expert, tokens_per_expert [L] int64, probs [P])`:
        counts on the CPU, or on the device without a CPU sync (rows past their sum are the worst case's tail)."""
        self.wait_dispatch()
        if self.options.do_cpu_sync:
            tokens_per_expert = torch.tensor(self.handle.num_recv_tokens_per_expert_list, dtype=torch.int64)
        else:
            if hidden_states.is_cuda and hidden_states.dtype != torch.bfloat16:
                raise ValueError(f"MoECommConfig(do_cpu_sync=False) on CUDA needs bf16 rows, got "
                                 f"{hidden_states.dtype}: torch's grouped GEMM of other dtypes copies the "
                                 f"offsets to the host (a host sync per layer)")
            psum = self.handle.psum_num_recv_tokens_per_expert
            tokens_per_expert = torch.diff(psum, prepend=psum.new_zeros(1))
        if self.options.do_expand:
            # The received rows are the experts' input as they are (a copy under the EP-overlap schedule: see
            # NOTES in __init__).
            permuted = hidden_states.clone() if self.copy_freed_inputs else hidden_states
            permuted_probs = probs
        else:
            permuted, permuted_probs = self._permute_by_expert(hidden_states, probs,
                                                               self.handle.num_recv_tokens_per_expert_list)
        self.recv_topk_idx = None
        return permuted, tokens_per_expert, permuted_probs.to(self.probs_dtype)

    def _permute_by_expert(self, recv_x: torch.Tensor, recv_weights: torch.Tensor, counts: list[int]):
        """Non-expand rows `[M, H]` -> one row per (row, local expert), experts ascending, rows ascending."""
        num_rows = recv_x.shape[0]
        L, device = self.num_local_experts, recv_x.device
        idx_MK = self.recv_topk_idx
        is_local_ML = (idx_MK.unsqueeze(-1) == torch.arange(L, device=device)).any(dim=1)
        # Weight of each (row, local expert); slot -1 goes to a dummy column that is cut off.
        weights_ML = recv_weights.new_zeros(num_rows, L + 1).scatter(
            1, torch.where(idx_MK < 0, L, idx_MK), recv_weights)[:, :L]
        # Position of each (row, expert) pair in the output: block start + rank inside the expert's block.
        counts_L = host_to_device(counts, torch.int64, device)
        block_start_L = torch.cumsum(counts_L, 0) - counts_L
        num_out = sum(counts)
        pos_ML = block_start_L + torch.cumsum(is_local_ML.long(), dim=0) - 1
        kernels = load_kernels() if self.buffer.backend == "cuda" and recv_x.is_cuda else None
        self.expert_rows = ExpertRows(torch.where(is_local_ML, pos_ML, num_out), num_out,  # num_out: no copy
                                      padded=self.expert_alignment > 1, kernels=kernels, rank=self.ep_rank)
        permuted = MoveExpertRows.apply(recv_x, self.expert_rows, True)
        permuted_weights = torch.cat([weights_ML.flatten(), weights_ML.new_zeros(1)]).index_select(
            0, self.expert_rows.src_pairs)
        return permuted, permuted_weights

    # 4 ------------------------------------------------------------------------------------------------
    def combine_preprocess(self, hidden_states: torch.Tensor):
        """Expert outputs `[P, H]` -> rows in the dispatch's layout (non-expand: summed per received row)."""
        if self.options.do_expand:
            return hidden_states
        out = MoveExpertRows.apply(hidden_states, self.expert_rows, False)
        self.expert_rows = None
        return out

    # 5 ------------------------------------------------------------------------------------------------
    def token_combine(self, hidden_states: torch.Tensor):
        """Sum every token's rows back on its source rank; returns before completion with `async_comm`."""
        combined, event = moe_autograd.combine(self.buffer, hidden_states.contiguous(), self.handle,
                                               num_sms=self.options.num_sms,
                                               async_with_compute_stream=self.options.async_comm)
        self.combine_event = event
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(combined)
        return combined

    def wait_combine(self) -> None:
        """Make the current stream wait for the combine in flight (no-op if done)."""
        if self.combine_event is not None:
            event, self.combine_event = self.combine_event, None
            event.current_stream_wait()

    # 6 ------------------------------------------------------------------------------------------------
    def combine_postprocess(self, hidden_states: torch.Tensor):
        """Combined `[T, H]` -> `[S, B, H]` (plus the overlapped shared experts' output)."""
        self.wait_combine()
        output = hidden_states.view(self.hidden_shape)
        if self.shared_experts is not None:
            self.shared_experts.post_forward_comm()
            output = output + self.shared_experts.get_output()
        self.handle = None
        return output


class MoECommMoELayer(MoELayer):
    """Megatron's `MoELayer` with `MoECommTokenDispatcher` (route A). Build it through a spec
    (`moe_comm_layer_spec`); arguments are `MoELayer`'s plus `moe_comm_config`.

    The config keeps `moe_token_dispatcher_type="alltoall"` (Megatron builds that dispatcher in the parent
    constructor, then this class replaces it); "flex" is refused since its constructor needs DeepEP.
    """

    def __init__(self, config, submodules=None, layer_number: Optional[int] = None, pg_collection=None,
                 moe_comm_config: Optional[MoECommConfig] = None, **kwargs) -> None:
        if config.moe_token_dispatcher_type == "flex":
            raise ValueError("MoECommMoELayer needs moe_token_dispatcher_type='alltoall' (or 'allgather'), got "
                             "'flex'; to keep 'flex' use install_flex_dispatcher() (route B) instead")
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         pg_collection=pg_collection, **kwargs)
        self.token_dispatcher = MoECommTokenDispatcher(self.num_local_experts, self.local_expert_indices, config,
                                                       pg_collection, moe_comm_config)
        if not self.token_dispatcher.options.do_cpu_sync:
            if not isinstance(self.experts, MoECommGroupedMLP):
                raise ValueError(f"MoECommConfig(do_cpu_sync=False) needs experts that take tokens_per_expert on "
                                 f"the device, got {type(self.experts).__name__}: build the spec with "
                                 f"moe_comm_layer_spec(..., grouped_experts=True) (MoECommGroupedMLP)")
            if not self.experts.uses_grouped_mm(config.params_dtype):
                raise ValueError(f"MoECommConfig(do_cpu_sync=False) needs the experts' grouped path, which reads "
                                 f"tokens_per_expert on the device only; with use_grouped_mm="
                                 f"{self.experts.use_grouped_mm} and params_dtype={config.params_dtype} they loop "
                                 f"over host counts (a host sync per layer)")
            # The worst-case rows past the counts are never read (the combine and the dispatch's backward read
            # the rows of tokens' slots only): the experts need not zero them.
            self.experts.zero_tail = False
        if self.use_shared_expert and self.shared_expert_overlap:
            self.token_dispatcher.set_shared_experts(self.shared_experts)


def _is_moe_layer_builder(obj) -> bool:
    target = obj.module if isinstance(obj, ModuleSpec) else obj.func if isinstance(obj, functools.partial) else None
    return isinstance(target, type) and issubclass(target, MoELayer)


def _moe_comm_builder(obj, moe_comm_config: Optional[MoECommConfig]):
    if isinstance(obj, ModuleSpec):  # megatron-core <= 0.17
        return dataclasses.replace(obj, module=MoECommMoELayer,
                                   params={**obj.params, "moe_comm_config": moe_comm_config})
    # megatron-core >= 0.18: functools.partial(MoELayer, submodules=MoESubmodules(...))
    return functools.partial(MoECommMoELayer, *obj.args, **{**obj.keywords, "moe_comm_config": moe_comm_config})


def _grouped_experts(obj):
    """A MoELayer builder whose experts builder builds `MoECommGroupedMLP` (same submodules and arguments)."""
    submodules = obj.submodules if isinstance(obj, ModuleSpec) else obj.keywords["submodules"]
    experts = submodules.experts
    if isinstance(experts, ModuleSpec):
        experts = dataclasses.replace(experts, module=MoECommGroupedMLP)
    else:
        experts = functools.partial(MoECommGroupedMLP, *experts.args, **experts.keywords)
    submodules = dataclasses.replace(submodules, experts=experts)
    if isinstance(obj, ModuleSpec):
        return dataclasses.replace(obj, submodules=submodules)
    return functools.partial(obj.func, *obj.args, **{**obj.keywords, "submodules": submodules})


def _swap_moe_layers(spec, swap) -> int:
    """Replace MoELayer builders inside `spec` in place by `swap(builder)`; return how many were replaced."""
    layer_specs = getattr(spec, "layer_specs", None)
    if isinstance(layer_specs, (list, tuple)):  # TransformerBlockSubmodules (get_gpt_decoder_block_spec)
        return sum(_swap_moe_layers(s, swap) for s in layer_specs)
    submodules = getattr(spec, "submodules", None)
    if submodules is None:
        return 0
    count = 0
    if _is_moe_layer_builder(getattr(submodules, "mlp", None)):
        submodules.mlp = swap(submodules.mlp)
        count += 1
    if getattr(submodules, "moe_layer", None) is not None:  # hybrid (Mamba) stacks
        count += _swap_moe_layers(submodules.moe_layer, swap)
    return count


def _rewrite(spec, swap):
    if _is_moe_layer_builder(spec):
        return swap(spec)
    new_spec = copy.deepcopy(spec)
    if _swap_moe_layers(new_spec, swap) == 0:
        raise ValueError(f"no MoELayer found in the spec ({type(spec).__name__}); build it with num_experts set")
    return new_spec


def moe_comm_layer_spec(spec, moe_comm_config: Optional[MoECommConfig] = None, grouped_experts: bool = False):
    """A copy of a Megatron layer or block spec with every `MoELayer` replaced by `MoECommMoELayer`.

    Arguments:
        spec: a transformer layer spec (`ModuleSpec` of `TransformerLayer`, e.g. `get_gpt_layer_local_spec`),
            a block spec with `layer_specs` (`get_gpt_decoder_block_spec`), or a MoE builder itself
            (`ModuleSpec(module=MoELayer)` or `functools.partial(MoELayer, ...)`).
        moe_comm_config: options of the dispatcher (None: defaults).
        grouped_experts: also build the experts as `MoECommGroupedMLP` (`grouped_experts_spec`); required by
            `MoECommConfig(do_cpu_sync=False)`.

    Returns:
        The new spec (the argument is not modified). Raises ValueError if it holds no MoELayer.
    """
    if moe_comm_config is not None and not isinstance(moe_comm_config, MoECommConfig):
        raise TypeError(f"moe_comm_config must be a MoECommConfig, got {type(moe_comm_config).__name__}")

    def swap(obj):
        if grouped_experts:
            obj = _grouped_experts(obj)
        return _moe_comm_builder(obj, moe_comm_config)

    return _rewrite(spec, swap)


def grouped_experts_spec(spec):
    """A copy of a Megatron layer or block spec whose MoE layers build their experts as `MoECommGroupedMLP`
    (one grouped GEMM per projection instead of SequentialMLP's loop), any dispatcher kept.

    Arguments:
        spec: as `moe_comm_layer_spec`.

    Returns:
        The new spec. Raises ValueError if it holds no MoELayer.
    """
    return _rewrite(spec, _grouped_experts)


__all__ = ["MoECommTokenDispatcher", "MoECommMoELayer", "moe_comm_layer_spec", "grouped_experts_spec",
           "expert_alignment_for", "routing_map_to_topk"]
