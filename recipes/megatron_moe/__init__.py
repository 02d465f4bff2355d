"""GPT-MoE training recipe on megatron-core APIs with moe_comm as the token dispatcher (README: Megatron-core)."""
