"""Megatron-core expert MLP on torch's grouped matmul: `MoECommGroupedMLP`, a drop-in for `SequentialMLP`.

Megatron's `SequentialMLP` loops over the local experts in Python and splits its rows with
`tokens_per_expert.tolist()`, a host sync per MoE layer (forward and backward) when the counts live on the
GPU. This module computes the same function with one `torch.nn.functional.grouped_mm` per projection over
device-side offsets, so it takes `tokens_per_expert` on the host (Megatron's dispatchers) or on the device
(a dispatch without CPU sync) and, in the second case, never reads the counts on the host.

    from functools import partial
    from megatron.core.transformer.moe.moe_layer import MoESubmodules
    from moe_comm.integrations.megatron import MoECommGroupedMLP
    # megatron-core <= 0.17: experts=ModuleSpec(module=MoECommGroupedMLP, submodules=<the MLPSubmodules>)
    # megatron-core >= 0.18: experts=partial(MoECommGroupedMLP, submodules=<the MLPSubmodules>)

The function is MLP.forward's unfused path (megatron/core/transformer/mlp.py, the same in 0.16.1 and 0.19.2)
for each local expert, with the router probabilities as `per_token_scale`, as `SequentialMLP.forward` calls it
(megatron/core/transformer/moe/experts.py). Rows past the last offset (worst-case-sized inputs) add nothing to
parameter gradients and to the other rows, whatever the inputs and the incoming gradient hold there; their output
and input gradient are zeros (`zero_tail=True`, the default) or left uncomputed (`zero_tail=False`). Inside the
backward they may hold NaN either way (torch's anomaly mode would report it), without reaching anything else.

Shape legend: P = rows fed to the experts (grouped by local expert), L = local experts, I = input/output
size of an expert (hidden size, or `moe_latent_size`), F = `moe_ffn_hidden_size`, F1 = F (2F with a gated
linear unit).
"""

from __future__ import annotations

import copy
import functools
import itertools
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import (get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name,
                                           set_tensor_model_parallel_attributes)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

GROUPED_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what grouped_mm accepts (no float64)


def host_to_device(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host integers as a tensor on `device`; to a GPU through pinned memory, without blocking: `.to(device)` of a
    pageable tensor waits for the whole stream (the dispatch and everything queued before it), so the host would
    stop issuing work until the GPU ran dry."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


class _GroupedLinear(torch.autograd.Function):
    """`out[r] = x[r] @ weight[l].T` for the rows r of group l (groups end at `offs`), one grouped GEMM each way.

    The weight gradient is computed as `grad.T @ x` per group, the product Megatron's linear layers compute
    (`grad_output.t().matmul(total_input)`), so it lands in the weight's own `[L, N, K]` layout and sums over the
    grouped rows only. grouped_mm leaves the output rows past `offs[-1]` uninitialised: `zero_out` / `zero_grad`
    (`[P, 1]` bool, or None) name the rows to zero in the output / the input gradient (each a pass over the whole
    tensor).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, zero_out: Optional[torch.Tensor],
                zero_grad: Optional[torch.Tensor]) -> torch.Tensor:
        out = F.grouped_mm(x, weight.transpose(1, 2), offs=offs)
        if zero_out is not None:
            out.masked_fill_(zero_out, 0)
        ctx.save_for_backward(x, weight, offs, zero_grad)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, offs, zero_grad = ctx.saved_tensors
        grad_out = grad_out.contiguous()  # grouped_mm rejects expanded (stride 0) gradients
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = F.grouped_mm(grad_out, weight, offs=offs)
            if zero_grad is not None:
                grad_x.masked_fill_(zero_grad, 0)
        if ctx.needs_input_grad[1]:
            # NOTES: an expert with no rows gets a zero gradient on Hopper and CPU; torch issue 172439 reports
            # non-zero ones on Blackwell (sm_100).
            grad_weight = F.grouped_mm(grad_out.t(), x, offs=offs)
        return grad_x, grad_weight, None, None, None


class MoECommGroupedMLP(MegatronModule):
    """The local experts of an MoE layer, as Megatron's `SequentialMLP` computes them, on grouped GEMMs.

    The constructor takes `SequentialMLP`'s arguments (megatron-core 0.16.1 and 0.19.2), so the class goes in
    `MoESubmodules(experts=...)` of a layer spec; `submodules` (linear layer types) is accepted and unused.
    Parameters are stacked over the local experts, expert l's slice laid out as `SequentialMLP`'s
    `local_experts.{l}.linear_fc1/linear_fc2` (`load_sequential` / `from_sequential` copy them over):
    `fc1_weight` `[L, F1, I]`, `fc2_weight` `[L, I, F]`, and with `add_bias_linear` `fc1_bias` `[L, F1]`,
    `fc2_bias` `[L, I]`, all in `config.params_dtype`. They are initialised as Megatron's expert linears
    (`init_method` for fc1, `output_layer_init_method` for fc2, biases zero, experts in order, on the CPU
    generator with `use_cpu_initialization`, else in the expert-parallel RNG tracker), so the same seed gives
    `SequentialMLP`'s weights.

    Arguments:
        num_local_experts: L.
        config: Megatron `TransformerConfig`. Refused (ValueError): expert tensor parallelism > 1, fp8/fp4
            (Transformer Engine's grouped linears do those), `use_te_activation_func`,
            `moe_apply_probs_on_input` with top-k != 1.
        submodules: `MLPSubmodules` of the spec (unused).
        pg_collection: Megatron process groups (`ep`, `expt_tp`, `expt_dp` are read); None: the defaults.
        name: module name (megatron-core 0.19; unused).
        use_grouped_mm: True: grouped GEMMs (bf16/fp16/fp32); False: a loop of matmuls over the experts
            (reads host counts); None: grouped where torch has `grouped_mm` and the dtype allows it.
        zero_tail: rows past the last count get zeros in the output and the input gradient (True, the default);
            False leaves them as the grouped GEMMs leave them (not computed; the loop fallback still writes zeros),
            which saves a pass over the whole output and input gradient on the grouped path, for a consumer that
            never reads those rows (moe_comm's dispatcher without CPU sync: its combine and the dispatch's backward
            read only rows that a token's slot maps to; `MoECommMoELayer` sets it). Values and gradients of every
            other row, parameter gradients and `probs.grad` (zero past the end) are the same either way.

    Differences from `SequentialMLP`: with one local expert, `SequentialMLP` ignores `tokens_per_expert` and
    runs every row; this module leaves out the rows past the count (zeros, unless `zero_tail=False`), equal
    whenever the counts cover all rows, as Megatron's dispatchers give them. With `bias_activation_fusion`,
    Megatron's fused SwiGLU kernels compute the same function with a hand-written backward (gradients equal to
    rounding).
    """

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None,
                 name: Optional[str] = None, *, use_grouped_mm: Optional[bool] = None,
                 zero_tail: bool = True) -> None:
        if config.moe_ffn_hidden_size != config.ffn_hidden_size:
            config = copy.deepcopy(config)  # as SequentialMLP: its experts read ffn_hidden_size
            config.ffn_hidden_size = config.moe_ffn_hidden_size
        super().__init__(config=config)
        pg_collection = pg_collection if pg_collection is not None else get_default_pg_collection()
        expert_tp_group = getattr(pg_collection, "expt_tp", None)
        expert_tp_size = max(config.expert_tensor_parallel_size or 1,
                             expert_tp_group.size() if expert_tp_group is not None else 1)
        expert_gtp_size = getattr(config, "expert_gtp_weight_remat_size", 1)  # megatron-core 0.19 weight sharding
        if expert_tp_size > 1 or expert_gtp_size > 1:
            raise ValueError(f"MoECommGroupedMLP does not support expert tensor parallelism: {expert_tp_size=} "
                             f"{expert_gtp_size=} (set expert_tensor_parallel_size=1, or use SequentialMLP or "
                             "TEGroupedMLP)")
        if config.fp8 or getattr(config, "fp4", None):
            raise ValueError(f"MoECommGroupedMLP computes in the params dtype; {config.fp8=} "
                             f"{getattr(config, 'fp4', None)=} need Transformer Engine's TEGroupedMLP")
        if getattr(config, "use_te_activation_func", False):
            raise ValueError("MoECommGroupedMLP applies config.activation_func; use_te_activation_func=True "
                             "(a Transformer Engine activation module) is not supported")
        if config.moe_apply_probs_on_input and config.moe_router_topk != 1:
            raise ValueError(f"moe_apply_probs_on_input needs moe_router_topk == 1 (as Megatron's experts), "
                             f"got {config.moe_router_topk=}")
        if use_grouped_mm and not hasattr(F, "grouped_mm"):
            raise ValueError(f"use_grouped_mm=True but torch {torch.__version__} has no "
                             "torch.nn.functional.grouped_mm")
        if not isinstance(zero_tail, bool):
            raise TypeError(f"zero_tail must be a bool, got {zero_tail!r}")
        self.num_local_experts = num_local_experts
        self.use_grouped_mm = use_grouped_mm
        self.zero_tail = zero_tail
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, expert_tp_group, pg_collection.expt_dp
        io_size = config.moe_latent_size if getattr(config, "moe_latent_size", None) else config.hidden_size
        ffn_size = config.moe_ffn_hidden_size
        fc1_size = 2 * ffn_size if config.gated_linear_unit else ffn_size
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        empty = functools.partial(torch.empty, device=device, dtype=config.params_dtype)
        self.fc1_weight = torch.nn.Parameter(empty(num_local_experts, fc1_size, io_size))
        self.fc2_weight = torch.nn.Parameter(empty(num_local_experts, io_size, ffn_size))
        has_bias = config.add_bias_linear
        self.fc1_bias = torch.nn.Parameter(empty(num_local_experts, fc1_size)) if has_bias else None
        self.fc2_bias = torch.nn.Parameter(empty(num_local_experts, io_size)) if has_bias else None
        if config.perform_initialization:
            self._initialize()
        # The attributes Megatron's ColumnParallelLinear/RowParallelLinear give expert parameters, shifted by the
        # L dim. DDP and the optimizer read `allreduce` (False: reduce over the expert-data-parallel group);
        # megatron-core 0.19's rule, which 0.16's (EP > 1 only) matches whenever TP == expert TP.
        use_expert_pgs = (config.expert_model_parallel_size > 1
                          or config.expert_tensor_parallel_size != config.tensor_model_parallel_size)
        set_tensor_model_parallel_attributes(self.fc1_weight, True, 1, 2 if config.gated_linear_unit else 1)
        set_tensor_model_parallel_attributes(self.fc2_weight, True, 2, 1)
        if has_bias:
            set_tensor_model_parallel_attributes(self.fc1_bias, True, 1, 2 if config.gated_linear_unit else 1)
            setattr(self.fc2_bias, "sequence_parallel", config.sequence_parallel)
        for param in self.parameters():
            setattr(param, "allreduce", not use_expert_pgs)

    @torch.no_grad()
    def _initialize(self) -> None:
        """Experts in order, fc1 then fc2, each as Megatron's `_initialize_affine_weight_cpu/_gpu` does it."""
        for expert_idx in range(self.num_local_experts):
            for weight, init_method in ((self.fc1_weight, self.config.init_method),
                                        (self.fc2_weight, self.config.output_layer_init_method)):
                if self.config.use_cpu_initialization:
                    master = torch.empty(weight.shape[1:], dtype=torch.float32)
                    init_method(master)
                    weight[expert_idx].copy_(master)
                else:
                    with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                        init_method(weight[expert_idx])
        for bias in (self.fc1_bias, self.fc2_bias):
            if bias is not None:
                bias.zero_()

    # ------------------------------------------------------------------------------------------------
    # Weights from SequentialMLP
    # ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def load_sequential(self, sequential_mlp) -> None:
        """Copy the weights of a Megatron `SequentialMLP` (same config and number of local experts).

        Arguments:
            sequential_mlp: `megatron.core.transformer.moe.experts.SequentialMLP`.
        """
        experts = list(sequential_mlp.local_experts)
        if len(experts) != self.num_local_experts:
            raise ValueError(f"SequentialMLP has {len(experts)} local experts, this module "
                             f"num_local_experts={self.num_local_experts}")
        for name in ("fc1_weight", "fc2_weight", "fc1_bias", "fc2_bias"):
            param = getattr(self, name)
            linear = "linear_fc1" if name.startswith("fc1") else "linear_fc2"
            sources = [getattr(getattr(e, linear), name.split("_")[1]) for e in experts]
            if (param is None) != (sources[0] is None):
                raise ValueError(f"{name}: this module has {'no ' if param is None else ''}{name}, "
                                 f"SequentialMLP has {'none' if sources[0] is None else 'one'}")
            if param is not None:
                stacked = torch.stack(sources)
                if stacked.shape != param.shape:
                    raise ValueError(f"{name}: SequentialMLP shape {tuple(stacked.shape)} != {tuple(param.shape)}")
                param.copy_(stacked)

    @classmethod
    def from_sequential(cls, sequential_mlp, *, use_grouped_mm: Optional[bool] = None,
                        zero_tail: bool = True) -> "MoECommGroupedMLP":
        """A `MoECommGroupedMLP` with the config, process groups, device and weights of a `SequentialMLP`."""
        pg_collection = ProcessGroupCollection(ep=sequential_mlp.ep_group, expt_tp=sequential_mlp.tp_group,
                                               expt_dp=sequential_mlp.dp_group)
        module = cls(sequential_mlp.num_local_experts, sequential_mlp.config, pg_collection=pg_collection,
                     use_grouped_mm=use_grouped_mm, zero_tail=zero_tail)
        module.to(next(sequential_mlp.parameters()).device)
        module.load_sequential(sequential_mlp)
        return module

    # ------------------------------------------------------------------------------------------------
    # Forward
    # ------------------------------------------------------------------------------------------------
    def forward(self, permuted_local_hidden_states: torch.Tensor,
                tokens_per_expert: Union[torch.Tensor, Sequence[int]], permuted_probs: torch.Tensor):
        """Run every row through its local expert.

        Arguments:
            permuted_local_hidden_states: `[P, I]`, params dtype, rows grouped by local expert (expert 0's
                first); rows past the sum of `tokens_per_expert` are ignored.
            tokens_per_expert: `[L]` rows per local expert, integer: a tensor on the rows' device (read only
                on the device on the grouped path: no host sync, unchecked; CPU rows with CPU counts take this
                path too, as the sync-free layer does on a GPU), or a list / CPU tensor for GPU rows (host counts,
                checked).
            permuted_probs: `[P]`, float, the router probability of each row (Megatron's `per_token_scale`).

        Returns:
            output: `[P, I]`, params dtype; past the last count zeros (`zero_tail`, the default) or not computed.
            output_bias: None (expert biases are already added, scaled by the probabilities, as Megatron does).

        Requirements:
            The counts sum to at most P (checked for host counts only: device counts are never read). On the
            grouped path I and F times the element size are multiples of 16 bytes (grouped_mm's strides), and
            on CUDA only bf16 (sm_90/sm_100) runs torch's grouped kernel without a host sync: other dtypes take
            torch's fallback, which copies the offsets to the host.
        """
        x, probs = permuted_local_hidden_states, permuted_probs
        use_grouped_mm = self.uses_grouped_mm(x.dtype)
        offs, host_counts, invalid = self._layout(tokens_per_expert, x.shape[0], x.device, use_grouped_mm)
        if invalid is not None:  # NaN/inf probabilities past the end would otherwise leak into gradients
            probs = probs.masked_fill(invalid.squeeze(-1), 0)
        if self.config.moe_apply_probs_on_input:  # SequentialMLP.forward
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        if use_grouped_mm:
            return self._grouped_forward(x, probs, offs, invalid), None
        return self._loop_forward(x, probs, host_counts), None

    def uses_grouped_mm(self, dtype: torch.dtype) -> bool:
        """Whether rows of `dtype` take the grouped path (device counts read on the device only), else the loop."""
        if self.use_grouped_mm is None:
            return hasattr(F, "grouped_mm") and dtype in GROUPED_MM_DTYPES
        if self.use_grouped_mm and dtype not in GROUPED_MM_DTYPES:
            raise ValueError(f"use_grouped_mm=True needs one of {GROUPED_MM_DTYPES}, got {dtype} "
                             "(use_grouped_mm=None falls back to a loop of matmuls)")
        return self.use_grouped_mm

    def _layout(self, tokens_per_expert, num_rows: int, device: torch.device, use_grouped_mm: bool):
        """`(offs [L] int32 or None, host counts or None, invalid [P, 1] bool or None)`.

        Counts that live on the rows' device are never read on the host on the grouped path; anything else
        is read on the host (no device sync) and checked.
        """
        num_experts = self.num_local_experts
        if torch.is_tensor(tokens_per_expert) and tokens_per_expert.device == device and use_grouped_mm:
            if tokens_per_expert.shape != (num_experts,) or tokens_per_expert.is_floating_point():
                raise ValueError(f"tokens_per_expert must be an integer tensor of shape ({num_experts},), got "
                                 f"{tuple(tokens_per_expert.shape)} {tokens_per_expert.dtype}")
            offs = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
            return offs, None, (torch.arange(num_rows, device=device) >= offs[-1]).unsqueeze(-1)
        # Host counts (a CUDA tensor here means the loop path on a GPU: reading it syncs).
        counts = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else list(tokens_per_expert)
        counts = [int(c) for c in counts]
        if len(counts) != num_experts or min(counts) < 0 or sum(counts) > num_rows:
            raise ValueError(f"tokens_per_expert={counts} must be {num_experts} counts >= 0 summing to at most "
                             f"the {num_rows} rows")
        num_used = sum(counts)
        invalid = None
        if num_used < num_rows:
            invalid = (torch.arange(num_rows, device=device) >= num_used).unsqueeze(-1)
        offs = None
        if use_grouped_mm:
            offs = host_to_device(list(itertools.accumulate(counts)), torch.int32, device)
        return offs, counts, invalid

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        """MLP.forward's unfused activation: GLU (first half gated, clamp, linear offset) or plain."""
        config = self.config
        if not config.gated_linear_unit:
            return config.activation_func(h)
        h_glu, h_linear = torch.chunk(h, 2, dim=-1)
        clamp = getattr(config, "activation_func_clamp_value", None)
        if clamp is not None:
            h_glu = h_glu.clamp(min=None, max=clamp)
            h_linear = h_linear.clamp(min=-clamp, max=clamp)
        return config.activation_func(h_glu) * (h_linear + getattr(config, "glu_linear_offset", 0.0))

    def _mlp(self, x, probs, fc1, fc2, fc1_bias, fc2_bias) -> torch.Tensor:
        """MLP.forward with `per_token_scale=probs`: fc1 (+bias), activation, scale, fc2 (+bias * scale)."""
        h = fc1(x)
        if fc1_bias is not None:
            h = h + fc1_bias
        h = self._activation(h)
        h = (h * probs.unsqueeze(-1)).to(h.dtype)
        out = fc2(h)
        if fc2_bias is not None:
            out = (out + fc2_bias * probs.unsqueeze(-1)).to(out.dtype)
        return out

    def _grouped_forward(self, x, probs, offs, invalid) -> torch.Tensor:
        fc1_bias = fc2_bias = None
        if self.fc1_bias is not None:
            rows = torch.arange(x.shape[0], device=x.device, dtype=torch.int32)
            expert_of_row = torch.searchsorted(offs, rows, right=True).clamp_(max=self.num_local_experts - 1)
            # Gathered from float32 copies so the backward's scatter-add accumulates in float32 (as Megatron's
            # `sum` does) and rounds once; the forward values are the same.
            fc1_bias = self.fc1_bias.float()[expert_of_row].to(self.fc1_bias.dtype)
            fc2_bias = self.fc2_bias.float()[expert_of_row].to(torch.promote_types(self.fc2_bias.dtype, probs.dtype))
        # Past the end: the bias gradients sum over every row (the tail's gathered bias included), so with biases
        # the tail is zero everywhere; without, only where `zero_tail` asks (weight gradients sum over the groups).
        inner = invalid if fc1_bias is not None else None
        outer = invalid if self.zero_tail else inner
        out = self._mlp(x, probs, lambda t: _GroupedLinear.apply(t, self.fc1_weight, offs, inner, outer),
                        lambda t: _GroupedLinear.apply(t, self.fc2_weight, offs, outer, inner), fc1_bias, fc2_bias)
        if fc2_bias is not None and invalid is not None:
            out = out.masked_fill(invalid, 0)  # keeps gradients past the end out of the bias gradients
        return out

    def _loop_forward(self, x, probs, counts: list) -> torch.Tensor:
        """SequentialMLP's loop: split the rows per expert, matmul against each expert's weights."""
        num_used = sum(counts)
        outs = []
        for idx, (x_e, probs_e) in enumerate(zip(x[:num_used].split(counts), probs[:num_used].split(counts))):
            fc1_bias = self.fc1_bias[idx] if self.fc1_bias is not None else None
            fc2_bias = self.fc2_bias[idx] if self.fc2_bias is not None else None
            outs.append(self._mlp(x_e, probs_e, lambda t: torch.matmul(t, self.fc1_weight[idx].t()),
                                  lambda t: torch.matmul(t, self.fc2_weight[idx].t()), fc1_bias, fc2_bias))
        if num_used < x.shape[0]:
            outs.append(x.new_zeros(x.shape[0] - num_used, self.fc2_weight.shape[1]))
        return torch.cat(outs)

    def backward_dw(self) -> None:
        """Weight gradients are computed in the backward itself (no delayed wgrad): nothing to do."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Not implemented: Megatron's distributed checkpoints need the expert-parallel mapping of
        `SequentialMLP.sharded_state_dict`; a plain `state_dict()` works."""
        raise NotImplementedError("MoECommGroupedMLP has no distributed-checkpoint mapping yet: save with "
                                  "state_dict(), or copy the weights into a SequentialMLP")
