"""FP8 on the wire through the reference backend: pre-quantized tuples move bit for bit (data and scales),
`quantize=` equals the reference cast on the source, `dequantize=True` equals the reference cast-back."""

from __future__ import annotations

import itertools

import pytest
import torch

import moe_comm
from moe_comm import quant
from moe_comm.testing.checks import assert_same
from moe_comm.testing.routing import Case, draw_cases, expected_dispatch, rank_inputs


def fp8_cases(seed: int) -> list[Case]:
    cases = draw_cases(seed, 6, 2, max_tokens=40, dtypes=("bfloat16",))
    return [Case(**{**c.__dict__, "hidden": h}) for c, h in zip(cases, itertools.cycle([128, 256, 384]))]


def expected_fp8(exp_x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference cast of every real row; padding rows (all zero) stay zero bytes and zero scales."""
    q, scales = quant.quantize(exp_x, fmt)
    padding = (exp_x == 0).all(dim=1)
    q = torch.where(padding[:, None], torch.zeros_like(q.view(torch.uint8)), q.view(torch.uint8))
    scales = torch.where(padding[:, None], torch.zeros_like(scales), scales)
    return q.view(torch.float8_e4m3fn), scales


def fp8_rank(rank: int, world_size: int, cases: list[Case], fmt: str, mode: str) -> int:
    checked = 0
    for case in cases:
        buf = moe_comm.Buffer(None, num_max_tokens_per_rank=case.num_max_tokens_per_rank, hidden=case.hidden,
                              num_topk=case.num_topk, use_fp8_dispatch=True, backend="torch",
                              num_cpu_timeout_secs=60)
        x, idx, w = rank_inputs(case, rank)
        kwargs = dict(num_experts=case.num_experts, do_expand=case.do_expand,
                      expert_alignment=case.expert_alignment, do_cpu_sync=case.do_cpu_sync)
        if mode == "tuple":
            recv, _, _, handle, _ = buf.dispatch(quant.quantize(x, fmt), idx, w, **kwargs)
        else:
            recv, _, _, handle, _ = buf.dispatch(x, idx, w, quantize=fmt, dequantize=mode == "dequantize",
                                                 **kwargs)
        exp = expected_dispatch(case, rank)
        rows = exp.x.shape[0]
        exp_q, exp_scales = expected_fp8(exp.x, fmt)
        if mode == "dequantize":
            exp_bf16 = quant.dequantize(exp_q, exp_scales)
            exp_bf16 = torch.where((exp.x == 0).all(1)[:, None], torch.zeros_like(exp_bf16), exp_bf16)
            assert_same(f"{case} dequantized rows", recv[:rows], exp_bf16)
        else:
            assert isinstance(recv, tuple) and recv[0].dtype == torch.float8_e4m3fn
            assert_same(f"{case} fp8 data", recv[0][:rows], exp_q)
            assert_same(f"{case} fp8 scales", recv[1][:rows], exp_scales)
            # A cached FP8 dispatch moves another tuple along the same layout.
            q2, s2 = quant.quantize(x * 2, fmt)
            recv2, _, _, _, _ = buf.dispatch((q2, s2), handle=handle, do_expand=case.do_expand,
                                             expert_alignment=case.expert_alignment)
            exp_q2, exp_s2 = expected_fp8(exp.x * 2, fmt)
            assert_same(f"{case} cached fp8 data", recv2[0][:rows], exp_q2)
            assert_same(f"{case} cached fp8 scales", recv2[1][:rows], exp_s2)
        checked += 1
    return checked


@pytest.mark.parametrize("fmt,mode", list(itertools.product(quant.FP8_FORMATS, ["tuple", "quantize", "dequantize"])))
def test_fp8_dispatch(pools, seed, fmt, mode):
    cases = fp8_cases(seed + 5)
    assert {c.do_expand for c in cases} == {True, False}
    assert pools(2).run(fp8_rank, cases, fmt, mode) == [len(cases)] * 2
