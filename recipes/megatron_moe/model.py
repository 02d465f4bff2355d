"""GPT-MoE model and MoE layer builders on megatron-core APIs, shared by the recipe and the parity tests.

`DISPATCHERS` names the token dispatcher a model is built with:
- "moe_comm": route A, `moe_comm_layer_spec` puts `MoECommMoELayer` in the layer spec (config says "alltoall");
- "moe_comm_flex": route B, Megatron's flex dispatcher (backend deepep) with moe_comm's fused dispatch/combine
  (the caller must have called `moe_comm.integrations.megatron.install_flex_dispatcher()`);
- "alltoall": Megatron's own alltoall dispatcher, the reference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

DISPATCHERS = ("moe_comm", "moe_comm_flex", "alltoall")


@dataclass(frozen=True)
class ModelDims:
    """Sizes of a GPT-MoE model (every layer is an MoE layer)."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_experts: int = 8
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 64
    seq_length: int = 32
    vocab_size: int = 128


def transformer_config(dims: ModelDims, dispatcher: str, ep_size: int, dtype: torch.dtype = torch.float32,
                       aux_loss_coeff: float = 1e-2, **overrides):
    """Megatron `TransformerConfig` for `dims`, with expert parallelism `ep_size` and the given dispatcher."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher={dispatcher!r} is not one of {DISPATCHERS}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype={dtype} must be torch.float32 or torch.bfloat16")
    kwargs = dict(
        num_layers=dims.num_layers, hidden_size=dims.hidden_size, num_attention_heads=dims.num_attention_heads,
        ffn_hidden_size=dims.moe_ffn_hidden_size, num_moe_experts=dims.num_experts,
        moe_router_topk=dims.moe_router_topk, moe_ffn_hidden_size=dims.moe_ffn_hidden_size,
        moe_token_dispatcher_type="flex" if dispatcher == "moe_comm_flex" else "alltoall",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=aux_loss_coeff, moe_router_dtype="fp32",
        moe_grouped_gemm=False, moe_permute_fusion=False, expert_model_parallel_size=ep_size,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=dtype == torch.bfloat16, params_dtype=dtype, pipeline_dtype=dtype)
    if dims.moe_router_topk == 1:
        kwargs["moe_router_pre_softmax"] = True  # Megatron requires it for top-1 (TransformerConfig check)
    if dispatcher == "moe_comm_flex":
        kwargs["moe_flex_dispatcher_backend"] = "deepep"
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def layer_spec(dims: ModelDims, dispatcher: str, moe_comm_config=None, grouped_experts: bool = False):
    """The local (no Transformer Engine) GPT layer spec with the dispatcher's MoE layer; its experts are
    Megatron's SequentialMLP, or with `grouped_experts` moe_comm's `MoECommGroupedMLP` (one grouped GEMM per
    projection; Megatron's grouped experts need Transformer Engine)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from moe_comm.integrations.megatron import grouped_experts_spec, moe_comm_layer_spec

    spec = get_gpt_layer_local_spec(num_experts=dims.num_experts, moe_grouped_gemm=False)
    if dispatcher == "moe_comm":
        return moe_comm_layer_spec(spec, moe_comm_config, grouped_experts=grouped_experts)
    return grouped_experts_spec(spec) if grouped_experts else spec


def build_moe_layer(config, dims: ModelDims, dispatcher: str, moe_comm_config=None, grouped_experts: bool = False):
    """One `MoELayer` (or `MoECommMoELayer`) as the layer spec builds it."""
    from megatron.core.transformer.spec_utils import build_module

    mlp = layer_spec(dims, dispatcher, moe_comm_config, grouped_experts).submodules.mlp
    if isinstance(mlp, functools.partial):  # megatron-core >= 0.18 specs are partials
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

        return mlp(config=config, pg_collection=get_default_pg_collection())
    return build_module(mlp, config=config)


def build_gpt(config, dims: ModelDims, dispatcher: str, moe_comm_config=None, grouped_experts: bool = False):
    """A `GPTModel` with rotary positions and the dispatcher's MoE layers."""
    from megatron.core.models.gpt import GPTModel

    spec = layer_spec(dims, dispatcher, moe_comm_config, grouped_experts)
    model = GPTModel(config=config, transformer_layer_spec=spec,
                     vocab_size=dims.vocab_size, max_sequence_length=dims.seq_length,
                     position_embedding_type="rope")
    # Every weight in the config's dtype, as Megatron's Float16Module does for bf16 (`module.bfloat16()`): the
    # local spec's torch LayerNorm ignores `params_dtype` and would stay float32 next to bf16 activations.
    return model.to(config.params_dtype)


def mock_batch(dims: ModelDims, micro_batch_size: int, generator: torch.Generator,
               device: torch.device) -> dict[str, torch.Tensor]:
    """Mock data with next-token labels, positions and a causal mask (Megatron's batch layout).

    Each sequence is an arithmetic progression modulo the vocabulary with a random start and a random stride
    in 1..8, so the next token follows from the context and the loss falls as the model learns (uniformly
    random tokens would keep it at log(vocab_size)).
    """
    start = torch.randint(0, dims.vocab_size, (micro_batch_size, 1), generator=generator)
    stride = torch.randint(1, 9, (micro_batch_size, 1), generator=generator)
    tokens = (start + stride * torch.arange(dims.seq_length + 1)) % dims.vocab_size
    tokens = tokens.to(device)
    position_ids = torch.arange(dims.seq_length, device=device).unsqueeze(0).expand(micro_batch_size, -1)
    mask = torch.triu(torch.ones(dims.seq_length, dims.seq_length, device=device, dtype=torch.bool), diagonal=1)
    return dict(input_ids=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(),
                position_ids=position_ids, attention_mask=mask.view(1, 1, dims.seq_length, dims.seq_length))


def initialize_megatron(ep_size: int, seed: int, timeout_s: float | None = None) -> None:
    """Megatron's model-parallel state (expert parallelism `ep_size`, everything else 1) and RNG tracker, and
    the names megatron-core 0.16.1's router needs without Transformer Engine (also for the alltoall baseline).
    `timeout_s`: the collective timeout of Megatron's process groups (None: Megatron's default, 30 minutes)."""
    from megatron.core import parallel_state, tensor_parallel

    from moe_comm.integrations.megatron.compat import define_missing_te_names

    define_missing_te_names()

    if not parallel_state.model_parallel_is_initialized():
        kwargs = {} if timeout_s is None else dict(distributed_timeout_minutes=timeout_s / 60)
        parallel_state.initialize_model_parallel(expert_model_parallel_size=ep_size, **kwargs)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
