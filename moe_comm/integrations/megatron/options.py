"""Options of the Megatron integration, shared by route A (`moe_comm_layer_spec`) and route B
(`install_flex_dispatcher`, which takes a subset as arguments)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ... import quant, traffic_class
from ...args import check_bool, check_int
from ...buffer import BACKENDS, MAX_EXPERT_ALIGNMENT, MAX_TIMEOUT_SECS


@dataclass(frozen=True)
class MoECommConfig:
    """moe_comm's own options for the Megatron dispatcher (Megatron's TransformerConfig has no slot for them).

    Arguments:
        backend: `moe_comm.Buffer` backend: "auto" (CUDA kernels where available, else the reference backend),
            "torch" or "cuda".
        do_expand: route A only. True: the dispatch itself lays rows out per local expert (expand layout, one
            row per (token, local expert)), so nothing is permuted on the receiver. False: one row per
            (token, rank), permuted locally (DeepEP's layout).
        expert_alignment: pad every local expert's block of rows to a multiple of this (zero rows with zero
            probability), for FP8 (16) or MXFP8 (32) grouped GEMMs. None: Megatron's
            `moe_router_padding_for_quantization` decides (16, or 32 for the mxfp8 recipe), else 1.
        quantize: None, "fp8_block128" or "mxfp8": FP8 on the wire for bf16 activations (hidden % 128 == 0).
            Rows arrive dequantized to bf16 (Megatron's experts take bf16); the backward is a bf16 combine.
        do_cpu_sync: route A only. False: the sync-free layer: the dispatch sizes its outputs for the worst case
            and `tokens_per_expert` stays on the device (a tensor of aligned counts), so nothing in the layer's
            forward or backward waits for the host and the step can be captured in a CUDA graph. Needs
            `do_expand=True` and experts that take device counts (`MoECommGroupedMLP`); the worst case costs
            memory: `ranks * num_max_tokens_per_rank * min(top-k, local experts)` rows per layer.
        num_sms: SMs for the communication kernels; 0 = `Buffer.get_theoretical_num_sms` (analytical model; with
            the expand layout it counts the receivers' fan-out: 88 SMs at EP2, top-8 of 256, against 22).
        async_comm: run dispatch and combine on the comm stream and wait only where the result is used
            (`dispatch_postprocess` / `combine_postprocess`), so work scheduled in between (shared experts,
            EP-overlap schedules) overlaps with the communication.
        num_max_tokens_per_rank: the most tokens any rank dispatches in one call. None: the maximum over the
            ranks of the first call's token count (one small all-reduce when the buffer is created).
        deterministic: fixed receive and reduction order (DESIGN 2.1/2.2); required for bitwise parity with
            Megatron's alltoall dispatcher. False: with the expand layout each combine (and each dispatch's
            backward) adds a token's rows per rank before they travel (`Buffer(allow_multiple_reduction=True)`: one
            FP32 row per (token, rank) instead of one row per slot, half the bytes at EP2 with top-8, one kernel),
            within float32 rounding of that order and still the same from run to run. (The non-expand layout's own
            sum of each received row's local experts, `combine_preprocess`, is deterministic whatever this says:
            fp32 (fp64 for float64 rows), experts ascending.)
        num_cpu_timeout_secs: how long a host wait for a peer may block before raising.
        sl_idx: `Buffer(sl_idx=...)`: the InfiniBand service level (0 to 15) the traffic between hosts must
            travel on, checked against NCCL's settings when the buffer is made; None: not checked.
    """

    backend: str = "auto"
    do_expand: bool = False
    expert_alignment: Optional[int] = None
    quantize: Optional[str] = None
    do_cpu_sync: bool = True
    num_sms: int = 0
    async_comm: bool = True
    num_max_tokens_per_rank: Optional[int] = None
    deterministic: bool = True
    num_cpu_timeout_secs: float = 300.0
    sl_idx: Optional[int] = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is not one of {BACKENDS}")
        check_bool(do_expand=self.do_expand, do_cpu_sync=self.do_cpu_sync, async_comm=self.async_comm,
                   deterministic=self.deterministic)
        if not self.do_cpu_sync and not self.do_expand:
            raise ValueError("do_cpu_sync=False needs do_expand=True: without a CPU sync only the expand layout "
                             "gives the experts their rows grouped by expert with the counts on the device")
        if self.expert_alignment is not None:
            check_int(1, expert_alignment=self.expert_alignment)
            if self.expert_alignment > MAX_EXPERT_ALIGNMENT:
                raise ValueError(f"expert_alignment={self.expert_alignment} exceeds {MAX_EXPERT_ALIGNMENT}")
        if self.quantize is not None and self.quantize not in quant.FP8_FORMATS:
            raise ValueError(f"quantize={self.quantize!r} is not one of {(None, *quant.FP8_FORMATS)}")
        check_int(0, num_sms=self.num_sms)  # 0: the analytical model
        if self.num_max_tokens_per_rank is not None:
            check_int(1, num_max_tokens_per_rank=self.num_max_tokens_per_rank)
        if isinstance(self.num_cpu_timeout_secs, bool) or not isinstance(self.num_cpu_timeout_secs, (int, float)) \
                or not 0 < self.num_cpu_timeout_secs <= MAX_TIMEOUT_SECS:
            raise ValueError(f"num_cpu_timeout_secs={self.num_cpu_timeout_secs!r} must be a number of seconds in "
                             f"(0, {MAX_TIMEOUT_SECS}]")
        traffic_class.check_sl_idx(self.sl_idx)


__all__ = ["MoECommConfig"]
