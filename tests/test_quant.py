"""Tests for moe_comm.quant: hand-computed cases, an independent float64 oracle compared bitwise, error bounds.
(Over 400 lines: the oracle is written here, independently of the module.)

The oracle in this file shares no code with the module: it decodes all E4M3 codes from their bit fields,
rounds by a brute-force nearest-even search over them in float64, and emulates each float32 operation as an
exact float64 operation followed by one rounding to float32 (exact for the products here, and innocuous
double rounding for division, since 53 >= 2 * 24 + 2).
"""

from __future__ import annotations

import math
import struct
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_comm import quant
from moe_comm.quant import FP8_FORMATS, check_fp8_tuple, dequantize, format_of, quantize

GROUP_SIZE = {"fp8_block128": 128, "mxfp8": 32}


# ---------------------------------------------------------------------------------------------------------
# Independent oracle
# ---------------------------------------------------------------------------------------------------------


def f32(v: float) -> float:
    """Round a Python float to the nearest float32 (ties to even)."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


AMAX_MIN = f32(1e-4)


def e4m3_value(code: int) -> float:
    """Decode an OCP E4M3 (fn) byte: 1 sign, 4 exponent (bias 7), 3 mantissa bits, no infinities."""
    sign = -1.0 if code & 0x80 else 1.0
    exp_field, mant = (code >> 3) & 0xF, code & 0x7
    if exp_field == 0xF and mant == 0x7:
        return math.nan
    if exp_field == 0:
        return sign * mant * 2.0**-9
    return sign * (1 + mant / 8) * 2.0 ** (exp_field - 7)


# Magnitudes of codes 0x00..0x7E, strictly increasing
E4M3_MAGS = torch.tensor([e4m3_value(c) for c in range(0x7F)], dtype=torch.float64)
E4M3_VALUES = torch.tensor([e4m3_value(c) for c in range(256)], dtype=torch.float64)


def ref_e4m3_codes(y: torch.Tensor) -> torch.Tensor:
    """float64 values in [-448, 448] -> E4M3 bytes (uint8), nearest, ties to the even code, sign kept."""
    flat = y.reshape(-1)
    dist = (flat.abs().unsqueeze(-1) - E4M3_MAGS).abs()
    is_min = dist == dist.amin(dim=-1, keepdim=True)
    is_even = (torch.arange(0x7F) % 2 == 0).unsqueeze(0)
    # Among the nearest codes (two at a tie), prefer the even one
    code = (is_min.to(torch.int64) * (1 + is_even.to(torch.int64))).argmax(dim=-1)
    code = code | (torch.signbit(flat).to(torch.int64) << 7)
    return code.to(torch.uint8).view(y.shape)


def ref_ceil_log2(v: float) -> int:
    """Smallest integer e with 2**e >= v, by exact comparisons."""
    e = math.ceil(math.log2(v))
    while math.ldexp(1.0, e - 1) >= v:
        e -= 1
    while math.ldexp(1.0, e) < v:
        e += 1
    return e


def ref_group_params(x: torch.Tensor, fmt: str) -> tuple[list[list[float]], list[list[float]], list[list[int]]]:
    """Per group: the multiplier applied to x, the dequantize scale, and (mxfp8) the exponent byte."""
    group = GROUP_SIZE[fmt]
    num_tokens, hidden = x.shape
    amax_all = x.double().view(num_tokens, hidden // group, group).abs().amax(dim=-1).tolist()
    mults, scales, exp_bytes = [], [], []
    for row in amax_all:
        mults.append([])
        scales.append([])
        exp_bytes.append([])
        for amax in row:
            amax = max(amax, AMAX_MIN)
            if fmt == "fp8_block128":
                mults[-1].append(f32(448.0 / amax))
                scales[-1].append(f32(amax / 448.0))
            else:
                e = min(max(ref_ceil_log2(f32(amax / 448.0)), -127), 127)
                mults[-1].append(math.ldexp(1.0, -e))
                scales[-1].append(math.ldexp(1.0, e))
                exp_bytes[-1].append(e + 127)
    return mults, scales, exp_bytes


def ref_pack_words(exp_bytes: list[list[int]]) -> torch.Tensor:
    words = []
    for row in exp_bytes:
        words.append([])
        for i in range(0, len(row), 4):
            w = sum(b << (8 * k) for k, b in enumerate(row[i : i + 4]))
            words[-1].append(w - 2**32 if w >= 2**31 else w)
    return torch.tensor(words, dtype=torch.int32).view(len(exp_bytes), -1)


def ref_quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (E4M3 bytes as uint8 [N, H], scales as quantize stores them)."""
    group = GROUP_SIZE[fmt]
    num_tokens, hidden = x.shape
    mults, scales, exp_bytes = ref_group_params(x, fmt)
    mult = torch.tensor(mults, dtype=torch.float64).view(num_tokens, hidden // group, 1)
    # Exact in float64 (<= 24 x 24 significant bits), then one rounding to float32
    y = (x.double().view(num_tokens, hidden // group, group) * mult).to(torch.float32).double()
    codes = ref_e4m3_codes(y.clamp(-448.0, 448.0)).view(num_tokens, hidden)
    if fmt == "fp8_block128":
        return codes, torch.tensor(scales, dtype=torch.float32).view(num_tokens, -1)
    return codes, ref_pack_words(exp_bytes)


def ref_dequantize(codes: torch.Tensor, x: torch.Tensor, fmt: str, out_dtype: torch.dtype) -> torch.Tensor:
    group = GROUP_SIZE[fmt]
    num_tokens, hidden = codes.shape
    _, scales, _ = ref_group_params(x, fmt)
    scale = torch.tensor(scales, dtype=torch.float64).view(num_tokens, hidden // group, 1)
    values = E4M3_VALUES[codes.to(torch.int64)].view(num_tokens, hidden // group, group)
    # Exact product in float64, rounded once to float32, then once to out_dtype
    return (values * scale).to(torch.float32).to(out_dtype).view(num_tokens, hidden)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret as integers of the same width, for bitwise comparison (keeps -0.0 and NaN payloads)."""
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.view(int_dtype)


def random_rows(num_tokens: int, hidden: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Gaussian rows with per-32-channel magnitudes spread over 2**-40..2**40, zero groups, lone outliers
    (which push the rest of the group into E4M3 subnormals) and signed zeros."""
    gen = torch.Generator().manual_seed(seed)
    num_groups = hidden // 32
    x = torch.randn(num_tokens, num_groups, 32, generator=gen)
    x *= torch.exp2(torch.randint(-40, 41, (num_tokens, num_groups, 1), generator=gen).float())
    x[torch.rand(num_tokens, num_groups, generator=gen) < 0.05] = 0.0
    outlier = torch.rand(num_tokens, num_groups, generator=gen) < 0.1
    x[..., 0] = torch.where(outlier, x[..., 0] * 2.0**12, x[..., 0])
    x[torch.rand(num_tokens, num_groups, 32, generator=gen) < 0.01] = -0.0
    return x.view(num_tokens, hidden).to(dtype).contiguous()


# ---------------------------------------------------------------------------------------------------------
# The oracle itself
# ---------------------------------------------------------------------------------------------------------


def test_oracle_e4m3_table_and_constants():
    assert f32_bits(AMAX_MIN) == 0x38D1B717
    assert E4M3_MAGS[0x7E] == 448.0 and E4M3_MAGS[0x01] == 2.0**-9 and E4M3_MAGS[0x08] == 2.0**-6
    assert bool((E4M3_MAGS[1:] > E4M3_MAGS[:-1]).all())
    # The oracle's rounding agrees with torch's cast on every E4M3 value and every midpoint between them
    mids = (E4M3_MAGS[1:] + E4M3_MAGS[:-1]) / 2
    y = torch.cat([E4M3_MAGS, mids, -E4M3_MAGS, -mids, torch.tensor([-0.0])])
    assert torch.equal(ref_e4m3_codes(y), y.to(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8))


# ---------------------------------------------------------------------------------------------------------
# Hand-computed cases
# ---------------------------------------------------------------------------------------------------------


# (value, expected E4M3 byte) with amax = 448, so both formats have multiplier 1.0
UNIT_SCALE_CASES = [
    (448.0, 0x7E),  # 1.75 * 2**8, the largest finite value
    (-448.0, 0xFE),
    (1.0, 0x38),
    (17.0, 0x58),  # tie between 16 (mantissa 000) and 18 (001): to even, 16
    (19.0, 0x5A),  # tie between 18 (001) and 20 (010): to even, 20
    (-17.0, 0xD8),
    (232.0, 0x76),  # tie between 224 (110) and 240 (111): 224
    (240.0, 0x77),
    (2.0**-9, 0x01),  # smallest subnormal
    (2.0**-10, 0x00),  # tie between 0 and 2**-9: to even, zero
    (-(2.0**-10), 0x80),  # ... keeping the sign
    (3 * 2.0**-10, 0x02),  # tie between 2**-9 (code 1) and 2**-8 (code 2): code 2
    (0.0, 0x00),
    (-0.0, 0x80),
]


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_unit_scale_rounding(fmt):
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    for i, (value, _) in enumerate(UNIT_SCALE_CASES):
        x[0, i] = value
    # mxfp8 groups 1..3 are all zero except those the cases reach; keep amax = 448 in every 32-group
    if fmt == "mxfp8":
        x[0, 32:128:32] = 448.0
    q, scales = quantize(x, fmt)
    got = q.view(torch.uint8)[0, : len(UNIT_SCALE_CASES)].tolist()
    assert got == [code for _, code in UNIT_SCALE_CASES]
    if fmt == "fp8_block128":
        assert scales.tolist() == [[1.0]]
    else:
        assert scales.tolist() == [[127 | 127 << 8 | 127 << 16 | 127 << 24]]


def test_block128_non_power_of_two_amax():
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    x[0, :4] = torch.tensor([3.0, 1.0, -1.5, 0.5])
    q, scales = quantize(x, "fp8_block128")
    inv = f32(448.0 / 3.0)
    assert inv == 149.3333282470703 and f32(3.0 * inv) == 448.0
    assert bits(scales).item() == f32_bits(3.0 / 448.0)
    # 3 * inv rounds to 448.0 exactly; 1 * inv = 149.33 -> 144 (ulp 16 in [128, 256)); -1.5 * inv -> -224;
    # 0.5 * inv = 74.67 -> 72 (ulp 8 in [64, 128))
    assert q.view(torch.uint8)[0, :4].tolist() == [0x7E, 0x71, 0xF6, 0x69]


def test_block128_zero_group_clamps_amax():
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    x[0, 128] = 448.0
    x[1, 5] = -0.0
    q, scales = quantize(x, "fp8_block128")
    clamped = f32(AMAX_MIN / 448.0)
    assert bits(scales).tolist() == [[f32_bits(clamped), f32_bits(1.0)], [f32_bits(clamped)] * 2]
    expected = torch.zeros(2, 256, dtype=torch.uint8)
    expected[0, 128] = 0x7E
    expected[1, 5] = 0x80
    assert torch.equal(q.view(torch.uint8), expected)


def test_block128_max_element_maps_to_448():
    x = random_rows(16, 512, seed=1)
    q, _ = quantize(x, "fp8_block128")
    x_grouped = x.float().view(16, 4, 128)
    idx = x_grouped.abs().argmax(dim=-1, keepdim=True)
    amax = x_grouped.abs().gather(-1, idx)
    codes = q.view(torch.uint8).view(16, 4, 128).gather(-1, idx)
    # Groups whose amax was raised to 1e-4 do not reach 448
    saturated = amax >= 1e-4
    expected = torch.where(x_grouped.gather(-1, idx) < 0, 0xFE, 0x7E).to(torch.uint8)
    assert torch.equal(codes[saturated], expected[saturated])


def test_to_e4m3_clamps_out_of_range():
    y = torch.tensor([1000.0, -1e30, 464.0, 480.0, 448.00003, -448.00003])
    assert quant._to_e4m3(y).view(torch.uint8).tolist() == [0x7E, 0xFE, 0x7E, 0x7E, 0x7E, 0xFE]


def mxfp8_one_group(amax: float, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """(exponent byte, E4M3 byte of amax) for a row whose first group holds amax and the rest 448."""
    x = torch.full((1, 128), 448.0, dtype=dtype)
    x[0, :32] = 0.0
    x[0, 0] = amax
    assert x[0, 0].item() == amax, "amax must be representable in dtype"
    q, scales = quantize(x, "mxfp8")
    return quant._unpack_ue8m0(scales)[0, 0].item(), q.view(torch.uint8)[0, 0].item()


@pytest.mark.parametrize(
    "amax, dtype, exp_byte, code",
    [
        # amax = 448 * 2**k: v is exactly 2**k, so e = k (no bump) and amax maps to 448
        (448.0, torch.bfloat16, 127, 0x7E),
        (224.0, torch.bfloat16, 126, 0x7E),
        (56.0, torch.bfloat16, 124, 0x7E),
        (448.0 * 2.0**100, torch.bfloat16, 227, 0x7E),
        (448.0 * 2.0**-20, torch.bfloat16, 107, 0x7E),
        # Next bf16 above 448: v = 450/448 > 1, e = 1, 450 / 2 = 225 -> 224
        (450.0, torch.bfloat16, 128, 0x76),
        # Next float32 above 448: v rounds to 1 + 2**-23 (> 1), e = 1, 224.0000x -> 224
        (448.0 + 2.0**-15, torch.float32, 128, 0x76),
        # Same one ulp above 448 * 2**k far from k = 0, where a float32 log2(v) rounds to the integer k
        # and its ceil misses the bump: v = 2**k * (1 + 2**-23), e = k + 1
        ((448.0 + 2.0**-15) * 2.0**-10, torch.float32, 118, 0x76),
        ((448.0 + 2.0**-15) * 2.0**-20, torch.float32, 108, 0x76),
        ((448.0 + 2.0**-15) * 2.0**20, torch.float32, 148, 0x76),
        # Next float32 below 448: v rounds to 1 - 2**-24 (< 1), e = 0, 447.99997 -> 448
        (448.0 - 2.0**-15, torch.float32, 127, 0x7E),
        # 300/448 in (0.5, 1]: e = 0; 300 -> 288 (ulp 32 in [256, 512))
        (300.0, torch.bfloat16, 127, 0x79),
        # Zero group: amax = float32(1e-4), v ~ 2.23e-7 in (2**-23, 2**-22]: e = -22
        (0.0, torch.bfloat16, 105, 0x00),
    ],
)
def test_mxfp8_exponent_edges(amax, dtype, exp_byte, code):
    assert mxfp8_one_group(amax, dtype) == (exp_byte, code)


def test_mxfp8_v_rounding_edges_are_what_the_cases_claim():
    assert f32_bits(f32((448.0 + 2.0**-15) / 448.0)) == 0x3F800001
    assert f32(f32(448.0 - 2.0**-15) / 448.0) == 1.0 - 2.0**-24
    v = f32(AMAX_MIN / 448.0)
    assert 2.0**-23 < v <= 2.0**-22


def test_mxfp8_scale_packing_order():
    # Group g (32 channels) has amax 448 * 2**(g - 3), so its exponent byte is 124 + g
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    for g in range(8):
        x[0, 32 * g + 7] = 448.0 * 2.0 ** (g - 3)
        x[1, 32 * g + 7] = -448.0 * 2.0 ** (3 * g - 10)
    q, scales = quantize(x, "mxfp8")
    assert scales.dtype == torch.int32 and scales.shape == (2, 2)
    word0 = 124 | 125 << 8 | 126 << 16 | 127 << 24
    word1 = 128 | 129 << 8 | 130 << 16 | 131 << 24  # >= 2**31: a negative int32
    row1 = [117 + 3 * g for g in range(8)]
    word2 = sum(b << (8 * k) for k, b in enumerate(row1[:4]))
    word3 = sum(b << (8 * k) for k, b in enumerate(row1[4:])) - 2**32
    assert scales.tolist() == [[word0, word1 - 2**32], [word2, word3]]
    assert quant._unpack_ue8m0(scales).tolist() == [list(range(124, 132)), row1]
    if sys.byteorder == "little":
        assert scales.view(torch.uint8).tolist() == [list(range(124, 132)), row1]
    codes = q.view(torch.uint8)
    assert codes[0, 7::32].tolist() == [0x7E] * 8 and codes[1, 7::32].tolist() == [0xFE] * 8


def test_ue8m0_pack_unpack_roundtrip():
    gen = torch.Generator().manual_seed(3)
    exp_bytes = torch.randint(0, 256, (5, 16), generator=gen, dtype=torch.int32)
    words = quant._pack_ue8m0(exp_bytes)
    assert words.dtype == torch.int32 and words.shape == (5, 4)
    assert torch.equal(quant._unpack_ue8m0(words), exp_bytes)
    assert torch.equal(words, ref_pack_words(exp_bytes.tolist()))


def test_exact_float32_helpers():
    k = torch.arange(-127, 128, dtype=torch.int32)
    assert quant._exp2_f32(k).tolist() == [math.ldexp(1.0, i) for i in range(-127, 128)]
    # Powers of two, their float32 neighbours, and random normal values
    gen = torch.Generator().manual_seed(4)
    p = torch.exp2(torch.arange(-125, 127, dtype=torch.float32))
    v = torch.cat([p, torch.nextafter(p, p * 2), torch.nextafter(p, p / 2), torch.rand(1000, generator=gen) * 1e3])
    assert quant._ceil_log2_f32(v).tolist() == [ref_ceil_log2(val) for val in v.tolist()]


# ---------------------------------------------------------------------------------------------------------
# Bitwise against the oracle on random data
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_matches_oracle(fmt, dtype):
    x = random_rows(24, 512, seed=11 if dtype == torch.bfloat16 else 12, dtype=dtype)
    q, scales = quantize(x, fmt)
    ref_codes, ref_scales = ref_quantize(x, fmt)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and q.is_contiguous()
    assert scales.shape == (24, 4) and scales.is_contiguous()
    assert torch.equal(q.view(torch.uint8), ref_codes)
    assert torch.equal(bits(scales), bits(ref_scales))
    for out_dtype in (torch.bfloat16, torch.float32):
        out = dequantize(q, scales, out_dtype=out_dtype)
        assert out.dtype == out_dtype
        assert torch.equal(bits(out), bits(ref_dequantize(ref_codes, x, fmt, out_dtype)))


@settings(max_examples=40, deadline=None)
@given(
    fmt=st.sampled_from(FP8_FORMATS),
    values=st.lists(
        st.floats(min_value=-(2.0**60), max_value=2.0**60, allow_nan=False, width=32), min_size=128, max_size=128
    ),
    shift=st.integers(min_value=-60, max_value=60),
)
def test_quantize_matches_oracle_hypothesis(fmt, values, shift):
    x = (torch.tensor(values, dtype=torch.float32) * 2.0**shift).view(1, 128)
    for xi in (x, x.to(torch.bfloat16)):
        q, scales = quantize(xi, fmt)
        ref_codes, ref_scales = ref_quantize(xi, fmt)
        assert torch.equal(q.view(torch.uint8), ref_codes)
        assert torch.equal(bits(scales), bits(ref_scales))


def test_dequantize_rounds_twice_not_once():
    # q = 1.125 (0x39), scale = s: the exact product is 1 + 2**-8 + 2**-24. float32 rounds it (a tie, to even)
    # to 1 + 2**-8, which bf16 rounds (a tie, to even) to 1.0; one direct rounding would give 1 + 2**-7.
    s = float.fromhex("0x1.c8e390p-1")
    assert f32(s) == s and 1.125 * s == 1 + 2.0**-8 + 2.0**-24
    q = torch.zeros(1, 128, dtype=torch.uint8)
    q[0, 0] = 0x39
    out = dequantize(q.view(torch.float8_e4m3fn), torch.tensor([[s]], dtype=torch.float32))
    assert out[0, 0].item() == 1.0
    # (torch's own float64 -> bf16 cast also goes through float32, so it cannot show the single rounding)
    assert 1.125 * s > 1 + 2.0**-8, "a single rounding of the exact product goes up to 1 + 2**-7"


def test_dequantize_mxfp8_extreme_exponent_bytes():
    q = torch.full((1, 128), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)  # all 1.0
    words = quant._pack_ue8m0(torch.tensor([[0, 254, 255, 127]], dtype=torch.int32))
    out = dequantize(q, words, out_dtype=torch.float32)
    assert out[0, 0].item() == 2.0**-127 and out[0, 32].item() == 2.0**127
    assert bool(out[0, 64:96].isnan().all()) and out[0, 96].item() == 1.0


# ---------------------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_sign_symmetry_and_input_dtype(fmt):
    x = random_rows(8, 256, seed=5)
    q, scales = quantize(x, fmt)
    q_neg, scales_neg = quantize(-x, fmt)
    assert torch.equal(q_neg.view(torch.uint8), q.view(torch.uint8) ^ 0x80)
    assert torch.equal(bits(scales_neg), bits(scales))
    q_f32, scales_f32 = quantize(x.float(), fmt)
    assert torch.equal(q_f32.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(bits(scales_f32), bits(scales))


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_round_trip_error_bounds(fmt):
    x = random_rows(32, 1024, seed=7)
    q, scales = quantize(x, fmt)
    group = GROUP_SIZE[fmt]
    _, group_scales, _ = ref_group_params(x, fmt)
    scale = torch.tensor(group_scales, dtype=torch.float64).repeat_interleave(group, dim=1)
    x64 = x.double()
    # Elements that land in E4M3's normal range (|y| >= 2**-6), with a margin for the float32 roundings
    normal = x64.abs() >= scale * 2.0**-6 * (1 + 2.0**-10)
    assert 0.2 < normal.float().mean() < 0.9
    for out_dtype, out_rel in ((torch.float32, 0.0), (torch.bfloat16, 2.0**-8)):
        err = (dequantize(q, scales, out_dtype=out_dtype).double() - x64).abs()
        # Half an E4M3 step: 2**-4 relative for normals, 2**-10 * scale absolute for subnormals
        rel_bound = 2.0**-4 * (1 + 2.0**-10) * (1 + out_rel) + out_rel
        assert bool((err[normal] <= rel_bound * x64.abs()[normal]).all())
        abs_bound = (2.0**-10 * scale * (1 + 2.0**-10) + out_rel * x64.abs()) * (1 + out_rel)
        assert bool((err[~normal] <= abs_bound[~normal]).all())


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_empty_and_shapes(fmt):
    q, scales = quantize(torch.zeros(0, 256, dtype=torch.bfloat16), fmt)
    assert q.shape == (0, 256) and scales.shape == (0, 2)
    assert dequantize(q, scales).shape == (0, 256)
    assert format_of(scales) == fmt
    assert check_fp8_tuple(quantize(torch.ones(3, 384), fmt))[2] == fmt


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_cuda_matches_cpu_bitwise(fmt):
    x = random_rows(256, 2048, seed=13)
    q, scales = quantize(x, fmt)
    q_gpu, scales_gpu = quantize(x.cuda(), fmt)
    assert q_gpu.is_cuda and scales_gpu.is_cuda
    assert torch.equal(q_gpu.view(torch.uint8).cpu(), q.view(torch.uint8))
    assert torch.equal(bits(scales_gpu).cpu(), bits(scales))
    for out_dtype in (torch.bfloat16, torch.float32):
        out_gpu = dequantize(q_gpu, scales_gpu, out_dtype=out_dtype)
        assert torch.equal(bits(out_gpu).cpu(), bits(dequantize(q, scales, out_dtype=out_dtype)))


# ---------------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------------


def test_quantize_validation():
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"fmt='fp8'.*\('fp8_block128', 'mxfp8'\)"):
        quantize(x, "fp8")
    with pytest.raises(TypeError, match=r"x must have dtype torch.bfloat16 or torch.float32, got torch.float16"):
        quantize(x.half(), "mxfp8")
    with pytest.raises(TypeError, match=r"got torch.float64"):
        quantize(x.double(), "fp8_block128")
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor, got list"):
        quantize([[0.0] * 128], "mxfp8")
    with pytest.raises(ValueError, match=r"x must be 2-D .*got shape \(256,\)"):
        quantize(x[0], "mxfp8")
    with pytest.raises(ValueError, match=r"hidden=96"):
        quantize(torch.zeros(2, 96), "fp8_block128")
    with pytest.raises(ValueError, match=r"x must be contiguous.*stride \(1, 256\)"):
        quantize(torch.zeros(256, 256).t(), "mxfp8")


def test_dequantize_and_format_of_validation():
    q, scales = quantize(torch.ones(2, 256), "fp8_block128")
    with pytest.raises(TypeError, match=r"out_dtype must be .*got torch.float16"):
        dequantize(q, scales, out_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"scales must have dtype .*got torch.float64"):
        dequantize(q, scales.double())
    with pytest.raises(ValueError, match=r"scales must have shape \(2, 2\), got \(2, 1\)"):
        dequantize(q, scales[:, :1].contiguous())
    with pytest.raises(TypeError, match=r"q must have dtype torch.float8_e4m3fn, got torch.float32"):
        dequantize(q.float(), scales)
    assert format_of(scales) == "fp8_block128"
    assert format_of(scales.view(torch.int32)) == "mxfp8"
    with pytest.raises(ValueError, match=r"scales must have dtype .*got torch.uint8"):
        format_of(scales.view(torch.uint8))
    with pytest.raises(TypeError, match=r"scales must be a torch.Tensor, got NoneType"):
        format_of(None)


def _q(num_tokens: int, hidden: int) -> torch.Tensor:
    return torch.zeros(num_tokens, hidden, dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize(
    "value, exc, pattern",
    [
        ([_q(2, 128), torch.ones(2, 1)], TypeError, r"recv must be a \(q, scales\) tuple, got list"),
        ((_q(2, 128),), TypeError, r"recv must be a \(q, scales\) tuple of 2 tensors, got a tuple of length 1"),
        ((None, torch.ones(2, 1)), TypeError, r"recv\[0\] \(q\) must be a torch.Tensor, got NoneType"),
        ((_q(2, 128), 1.0), TypeError, r"recv\[1\] \(scales\) must be a torch.Tensor, got float"),
        (
            (torch.zeros(2, 128, dtype=torch.bfloat16), torch.ones(2, 1)),
            TypeError,
            r"recv\[0\] \(q\) must have dtype torch.float8_e4m3fn, got torch.bfloat16",
        ),
        ((_q(2, 128)[0], torch.ones(2, 1)), ValueError, r"recv\[0\] \(q\) must be 2-D .*got shape \(128,\)"),
        ((_q(2, 100), torch.ones(2, 1)), ValueError, r"recv\[0\] \(q\): hidden=100 must be a multiple of 128"),
        ((_q(256, 256).t(), torch.ones(256, 2)), ValueError, r"recv\[0\] \(q\) must be contiguous.*stride \(1, 256\)"),
        (
            (_q(2, 128), torch.ones(2, 1, dtype=torch.float16)),
            ValueError,
            r"recv\[1\] \(scales\) must have dtype torch.float32 \(fp8_block128\) or torch.int32 \(mxfp8\), "
            r"got torch.float16",
        ),
        ((_q(2, 128), torch.ones(2, 2)), ValueError, r"recv\[1\] \(scales\) must have shape \(2, 1\), got \(2, 2\)"),
        ((_q(2, 256), torch.ones(1, 2, dtype=torch.int32)), ValueError, r"must have shape \(2, 2\), got \(1, 2\)"),
        (
            (_q(2, 128), torch.ones(2, 1, device="meta")),
            ValueError,
            r"recv\[1\] \(scales\) must be on the device of recv\[0\] \(q\) \(cpu\), got meta",
        ),
        (
            (_q(2, 256), torch.ones(2, 4)[:, ::2]),
            ValueError,
            r"recv\[1\] \(scales\) must be contiguous, got shape \(2, 2\) and stride \(4, 2\)",
        ),
    ],
)
def test_check_fp8_tuple_errors(value, exc, pattern):
    with pytest.raises(exc, match=pattern):
        check_fp8_tuple(value, arg_name="recv")


def test_check_fp8_tuple_default_name_and_result():
    with pytest.raises(TypeError, match=r"^x must be a \(q, scales\) tuple, got Tensor$"):
        check_fp8_tuple(torch.zeros(2, 128))
    for fmt in FP8_FORMATS:
        q, scales = quantize(torch.ones(2, 256, dtype=torch.bfloat16), fmt)
        q_out, scales_out, fmt_out = check_fp8_tuple((q, scales))
        assert q_out is q and scales_out is scales and fmt_out == fmt
