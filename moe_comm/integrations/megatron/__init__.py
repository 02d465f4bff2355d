"""Megatron-core integration: moe_comm as the token dispatcher of Megatron's `MoELayer`.

Megatron-core has no dispatcher registry (MoELayer picks allgather/alltoall/flex by a hard-coded if/elif), so
there are two ways in, both without editing Megatron:

Route A, a layer spec (any megatron-core model built from specs), `spec_route.py`:

    from moe_comm.integrations.megatron import MoECommConfig, moe_comm_layer_spec
    spec = moe_comm_layer_spec(get_gpt_layer_local_spec(num_experts=8), MoECommConfig(do_expand=True))
    model = GPTModel(config, transformer_layer_spec=spec, ...)       # config: moe_token_dispatcher_type="alltoall"

  It handles both spec forms: `ModuleSpec(module=MoELayer, ...)` (megatron-core <= 0.17) and
  `functools.partial(MoELayer, submodules=...)` (0.18+).

Route B, the flex dispatcher (existing `pretrain_gpt.py` command lines), `flex_route.py`:

    from moe_comm.integrations.megatron import install_flex_dispatcher
    install_flex_dispatcher()     # then --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep

  or, without editing the script, `torchrun ... -m moe_comm.integrations.megatron pretrain_gpt.py ARGS`
  (`__main__.py`).

Both share `MoECommConfig` (`options.py`) and one buffer per process group (`buffers.py`). `MoECommGroupedMLP`
(`experts.py`) is an expert module for either: SequentialMLP's function on torch's grouped matmul, taking
`tokens_per_expert` on the device (route A's sync-free layer) or on the host. Importing this
package checks megatron-core (`compat.py`: an ImportError names a missing symbol and the installed version)
and defines the names megatron-core 0.16.1 leaves undefined without Transformer Engine, which its router
needs on GPUs as on CPU. Megatron's other CUDA assumptions (streams, `torch.cuda.current_device()` as a
device) hold on GPUs; on CPU they need shims, which live in test and recipe harness code
(`recipes/megatron_moe/cpu_shims.py`), never here.

Shape legend: T = tokens on this rank (sequence x micro-batch), H = hidden, E = global experts, K = router
top-k, L = local experts (`E // ep_size`), M = rows received by a non-expand dispatch, P = rows fed to the
experts (grouped by local expert, each block padded to `expert_alignment`).
"""

from . import compat

compat.check_megatron_core()
compat.define_missing_te_names()

from .buffers import buffer_domain_sizes, clear_buffers, get_buffer  # noqa: E402
from .experts import MoECommGroupedMLP  # noqa: E402
from .flex_route import (flex_last_num_sms, fused_combine, fused_dispatch, install_flex_dispatcher,  # noqa: E402
                         restore_flex_dispatcher, set_deepep_num_sms)
from .options import MoECommConfig  # noqa: E402
from .spec_route import (MoECommMoELayer, MoECommTokenDispatcher, expert_alignment_for,  # noqa: E402
                         grouped_experts_spec, moe_comm_layer_spec, routing_map_to_topk)

__all__ = ["MoECommConfig", "MoECommGroupedMLP", "MoECommTokenDispatcher", "MoECommMoELayer", "moe_comm_layer_spec",
           "grouped_experts_spec", "expert_alignment_for", "routing_map_to_topk", "install_flex_dispatcher",
           "restore_flex_dispatcher", "flex_last_num_sms", "fused_dispatch", "fused_combine", "set_deepep_num_sms",
           "get_buffer", "buffer_domain_sizes", "clear_buffers"]
