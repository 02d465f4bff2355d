"""Adapters for training frameworks. Each lives in its own module and is import-guarded: `import moe_comm`
never imports a framework, and importing an adapter without its framework raises an ImportError that says
what to install.

- `moe_comm.integrations.megatron`: Megatron-core token dispatcher, layer-spec helper and a drop-in for the
  flex (DeepEP) dispatcher.
- `moe_comm.integrations.expert_rows`: the non-expand layout's receiver (rows per local expert and back), needing
  no framework; the Megatron dispatcher uses it.
"""
