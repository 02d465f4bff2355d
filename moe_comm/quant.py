"""FP8 formats for dispatch: the reference cast and cast-back (DESIGN 2.3).

The reference backend casts with this module (`quantize=` before the rows travel, `dequantize=True` after they
arrived); the CUDA backend casts inside its dispatch kernel (moe_comm/csrc/include/moe_comm/common/fp8.cuh: the
senders quantize, the receivers dequantize). A fused cast must match this module BITWISE, on data and on scales
(NaN payloads aside: a NaN is a NaN, its bits are not part of the contract): every arithmetic step below is one IEEE-754 float32
operation with round-to-nearest-even, done in the order written, and the notes say which tempting shortcuts
change bits.

Formats
-------
Input `x`: `[num_tokens, hidden]`, `torch.bfloat16` (or `torch.float32`), `hidden % 128 == 0`, finite values
(the result for inf/NaN input is not part of the contract; in mxfp8 the eight largest finite bf16 magnitudes,
>= 248 * 2**120 ~ 3.30e38, cast back to inf: q rounds up to 256 at scale 2**120, and 2**128 overflows
float32). Output `q`: `[num_tokens, hidden]`, `torch.float8_e4m3fn` (OCP E4M3, max 448, no infinities). Output
`scales`: `[num_tokens, hidden // 128]` in both formats, row-major, contiguous; its dtype names the format:

- `"fp8_block128"`: one float32 scale per token and 128-channel group (DeepEP V1's format), `torch.float32`.
- `"mxfp8"`: one UE8M0 exponent byte per token and 32-channel group, four bytes packed per `torch.int32`
  word, little-endian by value: `word[t, i] = sum(byte[t, 4 * i + k] << (8 * k) for k in 0..3)` taken as a
  uint32 and reinterpreted as int32 (so byte k of word i, in memory on a little-endian machine, is group
  4i + k).

Quantize recipe, per token t and group g of G channels (G = 128 or 32); all values float32
--------------------------------------------------------------------------------------------
1. `x32 = float32(x)` (exact for bf16).
2. `amax = max over the group of |x32|` (exact), then `amax = max(amax, AMAX_MIN)` where
   `AMAX_MIN = float32(1e-4)` = bits `0x38D1B717`. An all-zero group therefore gets `amax = AMAX_MIN`.
3. fp8_block128:
   - `scale = amax / 448.0f`  (one correctly rounded float32 division; this is the stored scale)
   - `inv   = 448.0f / amax`  (one correctly rounded float32 division, NOT `1 / scale`, NOT `amax * (1/448)`)
   - `y     = x32 * inv`      (one float32 multiplication, per element)
   mxfp8:
   - `v = amax / 448.0f`      (one correctly rounded float32 division)
   - `e = ceil(log2(v))`, the smallest integer with `2**e >= v`, computed exactly from the bits of `v`:
     `b = bits(v); e = ((b >> 23) & 0xFF) - 127 + ((b & 0x7FFFFF) != 0)`. `v` is always a normal float32
     (`v >= AMAX_MIN / 448 > 2**-126`), so this is exact; never use a floating-point `log2`.
   - `e = min(max(e, -127), 127)`; the stored byte is `e + 127` (UE8M0, in [0, 254]).
   - `y = x32 * 2.0f**-e`     (one float32 multiplication by the exact power of two; exact unless it underflows)
4. `y = min(max(y, -448.0f), 448.0f)`, then `q = e4m3(y)` with round-to-nearest-even, E4M3 subnormals
   included (smallest 2**-9), sign of zero kept (`-0.0` gives byte 0x80). For finite input the clamp never
   changes `q`; it is part of the recipe because torch's float32 -> e4m3 cast turns out-of-range values into
   NaN, while `__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3)` (= `cvt.rn.satfinite.e4m3x2.f32`)
   saturates: both agree once y is clamped.

Dequantize recipe, per element
------------------------------
`out = out_dtype(float32(q) * s)`: the product is one float32 multiplication, then one rounding to
`out_dtype` (round-to-nearest-even; bfloat16 by default, float32 leaves the product as is). `s` is the stored
float32 scale for fp8_block128 and the exact float32 `2.0f**(byte - 127)` for mxfp8 (byte 0 gives the
subnormal `2**-127`; byte 255, never produced by `quantize`, gives NaN as in the OCP MX spec). Rounding the
exact product straight to bfloat16 (a single rounding) differs from this in rare ties: do not fuse it.

NOTES for kernel authors (each one changes bits if ignored):
- Build without `--use_fast_math` / `-prec-div=false`: the divisions must be IEEE (`__fdiv_rn`). 448 is
  7 * 2**6, so `1/448` is inexact and `amax * (1.0f/448)` differs from `amax / 448` for some amax.
- Do not compute `inv` as `1 / scale` or as `448 * (1 / amax)`.
- Flush-to-zero (`-ftz=true`) does not change `q` (a float32-subnormal `y` rounds to a signed E4M3 zero
  either way), and for scales that `quantize` produced no dequantize product is subnormal; still, prefer
  building without it so that arbitrary pre-quantized tuples dequantize identically.
- In PyTorch itself, `tensor / python_scalar` on CUDA is computed as a multiplication by the reciprocal, and
  `python_scalar / tensor` (CPU and CUDA) as `reciprocal(tensor) * scalar`; both change about a quarter to a
  half of the results (measured on an H200), which is why this module divides tensor by tensor (`_div_f32`).

Public API: `FP8_FORMATS`, `quantize`, `dequantize`, `format_of`, `check_fp8_tuple`.
"""

from __future__ import annotations

import torch

from . import layout

__all__ = ["FP8_FORMATS", "quantize", "dequantize", "format_of", "check_fp8_tuple"]

FP8_FORMATS = tuple(layout.FP8_CODES)  # ("fp8_block128", "mxfp8"); the kernels take the codes

# Channels covered by one element of `scales` in both formats (one float32 scale, or one word of 4 bytes)
_CHANNELS_PER_SCALE = layout.FP8_CHANNELS_PER_SCALE  # 128
_GROUP_SIZE = {"fp8_block128": 128, "mxfp8": 32}
_SCALE_DTYPE_TO_FORMAT = {torch.float32: "fp8_block128", torch.int32: "mxfp8"}

_E4M3_MAX = 448.0
# Rounded to float32 (bits 0x38D1B717) wherever it is used
_AMAX_MIN = layout.AMAX_MIN  # 1e-4
_UE8M0_BIAS = 127
_MAX_EXP = 127
_QUANTIZE_DTYPES = (torch.bfloat16, torch.float32)
_DEQUANTIZE_DTYPES = (torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------------------
# Exact float32 building blocks
# ---------------------------------------------------------------------------------------------------------


def _full_f32(like: torch.Tensor, value: float) -> torch.Tensor:
    # A full tensor on the same device, never a Python scalar (see the NOTES on CUDA scalar division)
    return torch.full_like(like, value, dtype=torch.float32)


def _div_f32(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """One correctly rounded float32 division `a / b`; at least one argument is a float32 tensor."""
    like = a if isinstance(a, torch.Tensor) else b
    a_t = a if isinstance(a, torch.Tensor) else _full_f32(like, a)
    b_t = b if isinstance(b, torch.Tensor) else _full_f32(like, b)
    if a_t.dtype != torch.float32 or b_t.dtype != torch.float32:
        raise TypeError(f"_div_f32 divides float32 values, got {a_t.dtype} and {b_t.dtype}")
    return torch.div(a_t, b_t)


def _group_amax(x_grouped: torch.Tensor) -> torch.Tensor:
    """`[N, num_groups, G]` float32 -> `[N, num_groups]` float32 `max(max|x|, float32(1e-4))`."""
    amax = x_grouped.abs().amax(dim=-1)
    return torch.maximum(amax, _full_f32(amax, _AMAX_MIN))


def _ceil_log2_f32(v: torch.Tensor) -> torch.Tensor:
    """Exact `ceil(log2(v))` of positive normal float32 values, as int32, from the bits."""
    bits = v.view(torch.int32)
    biased_exp = (bits >> 23) & 0xFF
    has_mantissa = (bits & 0x7FFFFF) != 0
    return biased_exp - 127 + has_mantissa.to(torch.int32)


def _exp2_f32(k: torch.Tensor) -> torch.Tensor:
    """Exact float32 `2**k` for int32 `k` in [-127, 127] (`2**-127` is subnormal), built from bits."""
    normal = ((k + 127).clamp(min=1) << 23).view(torch.float32)
    subnormal = _full_f32(normal, 2.0**-127)
    return torch.where(k >= -126, normal, subnormal)


def _to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """float32 -> `torch.float8_e4m3fn`: clamp to [-448, 448], then round to nearest even."""
    return y.clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)


def _pack_ue8m0(exp_bytes: torch.Tensor) -> torch.Tensor:
    """`[N, 4 * W]` integer bytes in [0, 255] -> `[N, W]` int32 words, byte k of word i = group 4i + k."""
    num_tokens, num_groups = exp_bytes.shape
    if num_groups % 4:
        raise ValueError(f"_pack_ue8m0 packs 4 scale bytes a word, got {num_groups} per row")
    b = exp_bytes.to(torch.int64).view(num_tokens, num_groups // 4, 4)
    shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=b.device)
    words = (b << shifts).sum(dim=-1)
    # uint32 value -> the int32 with the same bits (done in int64, independent of the host's byte order)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def _unpack_ue8m0(words: torch.Tensor) -> torch.Tensor:
    """`[N, W]` int32 words -> `[N, 4 * W]` int32 bytes in [0, 255] (inverse of `_pack_ue8m0`)."""
    num_tokens, num_words = words.shape
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=w.device)
    return ((w.unsqueeze(-1) >> shifts) & 0xFF).to(torch.int32).view(num_tokens, num_words * 4)


# ---------------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------------


def _check_format(fmt: object) -> str:
    if not isinstance(fmt, str) or fmt not in FP8_FORMATS:
        raise ValueError(f"fmt={fmt!r} is not a known FP8 format; allowed: {FP8_FORMATS}")
    return fmt


def _format_from_dtype(dtype: torch.dtype, name: str) -> str:
    fmt = _SCALE_DTYPE_TO_FORMAT.get(dtype)
    if fmt is None:
        raise ValueError(
            f"{name} must have dtype torch.float32 (fp8_block128) or torch.int32 (mxfp8), got {dtype}"
        )
    return fmt


def _check_tensor(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:  # a sparse CSR tensor cannot even answer is_contiguous()
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    return t


def _check_pair(q: object, scales: object, q_name: str, scales_name: str) -> str:
    """Validate a (q, scales) pair; returns the format."""
    q = _check_tensor(q, q_name)
    scales = _check_tensor(scales, scales_name)
    if q.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{q_name} must have dtype torch.float8_e4m3fn, got {q.dtype}")
    if q.dim() != 2:
        raise ValueError(f"{q_name} must be 2-D [num_tokens, hidden], got shape {tuple(q.shape)}")
    num_tokens, hidden = q.shape
    if hidden % _CHANNELS_PER_SCALE != 0:
        raise ValueError(f"{q_name}: hidden={hidden} must be a multiple of {_CHANNELS_PER_SCALE}")
    if not q.is_contiguous():
        raise ValueError(f"{q_name} must be contiguous, got shape {tuple(q.shape)} and stride {q.stride()}")
    fmt = _format_from_dtype(scales.dtype, scales_name)
    expected = (num_tokens, hidden // _CHANNELS_PER_SCALE)
    if tuple(scales.shape) != expected:
        raise ValueError(f"{scales_name} must have shape {expected}, got {tuple(scales.shape)}")
    if scales.device != q.device:
        raise ValueError(f"{scales_name} must be on the device of {q_name} ({q.device}), got {scales.device}")
    if not scales.is_contiguous():
        raise ValueError(
            f"{scales_name} must be contiguous, got shape {tuple(scales.shape)} and stride {scales.stride()}"
        )
    return fmt


def _check_input(x: object) -> torch.Tensor:
    x = _check_tensor(x, "x")
    if x.dtype not in _QUANTIZE_DTYPES:
        raise TypeError(f"x must have dtype torch.bfloat16 or torch.float32, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [num_tokens, hidden], got shape {tuple(x.shape)}")
    hidden = x.shape[1]
    if hidden % _CHANNELS_PER_SCALE != 0:
        raise ValueError(f"FP8 needs hidden % {_CHANNELS_PER_SCALE} == 0, got hidden={hidden}")
    if not x.is_contiguous():
        raise ValueError(f"x must be contiguous, got shape {tuple(x.shape)} and stride {x.stride()}")
    return x


# ---------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------


def quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast rows to FP8 with per-group scales, bit for bit as the module docstring's recipe.

    Arguments:
        x: `[num_tokens, hidden]`, `torch.bfloat16` or `torch.float32`, contiguous, CPU or CUDA.
        fmt: one of `FP8_FORMATS`: `"fp8_block128"` or `"mxfp8"`.

    Returns:
        q: `[num_tokens, hidden]`, `torch.float8_e4m3fn`, on `x.device`.
        scales: `[num_tokens, hidden // 128]`, `torch.float32` for fp8_block128 (one scale per 128 channels),
            `torch.int32` for mxfp8 (four UE8M0 bytes per word, byte k of word i for 32-channel group 4i + k).

    Requirements:
        `hidden % 128 == 0`; finite values (inf/NaN give unspecified results).

    Raises:
        ValueError: unknown `fmt`, `x` not 2-D, `hidden % 128 != 0`, `x` not contiguous.
        TypeError: `x` not a tensor or of another dtype.
    """
    fmt = _check_format(fmt)
    x = _check_input(x)
    num_tokens, hidden = x.shape
    group = _GROUP_SIZE[fmt]
    x_grouped = x.float().view(num_tokens, hidden // group, group)
    amax = _group_amax(x_grouped)

    if fmt == "fp8_block128":
        scales = _div_f32(amax, _E4M3_MAX)
        inv = _div_f32(_E4M3_MAX, amax)
        y = x_grouped * inv.unsqueeze(-1)
    else:
        v = _div_f32(amax, _E4M3_MAX)
        e = _ceil_log2_f32(v).clamp(-_MAX_EXP, _MAX_EXP)
        y = x_grouped * _exp2_f32(-e).unsqueeze(-1)
        scales = _pack_ue8m0(e + _UE8M0_BIAS)

    q = _to_e4m3(y).view(num_tokens, hidden)
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Cast FP8 rows back: `out_dtype(float32(q) * scale)` per element, the product in float32.

    Arguments:
        q: `[num_tokens, hidden]`, `torch.float8_e4m3fn`, contiguous.
        scales: `[num_tokens, hidden // 128]`, contiguous, on `q.device`; `torch.float32` means fp8_block128,
            `torch.int32` means mxfp8 (see `quantize`).
        out_dtype: `torch.bfloat16` (default) or `torch.float32` (the float32 product itself).

    Returns:
        `[num_tokens, hidden]` tensor of `out_dtype` on `q.device`.

    Raises:
        TypeError: `q`/`scales` not tensors, `q` not float8_e4m3fn, `out_dtype` not allowed.
        ValueError: `scales` of another dtype, or shapes, devices or contiguity as in `check_fp8_tuple`.
    """
    fmt = _check_pair(q, scales, "q", "scales")
    if out_dtype not in _DEQUANTIZE_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    num_tokens, hidden = q.shape
    group = _GROUP_SIZE[fmt]
    q_grouped = q.float().view(num_tokens, hidden // group, group)

    if fmt == "fp8_block128":
        group_scale = scales
    else:
        exp_bytes = _unpack_ue8m0(scales)
        # Byte 255 is the UE8M0 NaN; clamp first so that _exp2_f32 sees a valid exponent
        e = (exp_bytes - _UE8M0_BIAS).clamp(max=_MAX_EXP)
        group_scale = torch.where(exp_bytes == 255, _full_f32(exp_bytes, float("nan")), _exp2_f32(e))

    x32 = q_grouped * group_scale.unsqueeze(-1)
    return x32.view(num_tokens, hidden).to(out_dtype)


def format_of(scales: torch.Tensor) -> str:
    """The FP8 format a scales tensor belongs to: `torch.float32` -> `"fp8_block128"`, `torch.int32` ->
    `"mxfp8"`.

    Raises:
        TypeError: `scales` is not a tensor.
        ValueError: any other dtype.
    """
    scales = _check_tensor(scales, "scales")
    return _format_from_dtype(scales.dtype, "scales")


def check_fp8_tuple(x: object, arg_name: str = "x") -> tuple[torch.Tensor, torch.Tensor, str]:
    """Validate a pre-quantized `(q, scales)` tuple as `quantize` returns it.

    Arguments:
        x: `(q, scales)`: q `[num_tokens, hidden]` `torch.float8_e4m3fn`, contiguous, `hidden % 128 == 0`;
            scales `[num_tokens, hidden // 128]`, `torch.float32` (fp8_block128) or `torch.int32` (mxfp8),
            contiguous, on q's device.
        arg_name: the caller's argument name, used in error messages (`"x[1] (scales) must have ..."`).

    Returns:
        `(q, scales, fmt)` with `fmt` in `FP8_FORMATS`.

    Raises:
        TypeError: not a tuple of two tensors, or q not float8_e4m3fn.
        ValueError: scales of another dtype, wrong shapes, devices or contiguity; the message names the argument
            and the observed values.
    """
    if not isinstance(x, tuple):
        raise TypeError(f"{arg_name} must be a (q, scales) tuple, got {type(x).__name__}")
    if len(x) != 2:
        raise TypeError(f"{arg_name} must be a (q, scales) tuple of 2 tensors, got a tuple of length {len(x)}")
    q, scales = x
    fmt = _check_pair(q, scales, f"{arg_name}[0] (q)", f"{arg_name}[1] (scales)")
    return q, scales, fmt
