// FP8 cast of bf16 rows inside a kernel (a dispatch's `quantize=`), bitwise the recipe of moe_comm/quant.py:
// every step one IEEE float32 operation in the order written there (no fast math, no FMA, no reciprocal tricks).
// A warp casts 16-byte vectors of 8 bf16 values, one per lane; consecutive lanes hold consecutive vectors, so a
// 128-channel group is 16 lanes and a 32-channel group 4 lanes. Device code only, no torch headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moe_comm {

constexpr int kFp8Block128 = 1;  // DispatchInputs::quantize: moe_comm.quant.FP8_FORMATS index + 1
constexpr int kFp8Mx = 2;
constexpr uint32_t kAmaxMinBits = 0x38D1B717u;  // float32(1e-4), quant.AMAX_MIN

// The 8 values of one lane's vector as FP8 bytes (packed little-endian in a uint2), and the 4-byte scale word of the
// 128 channels of its 16-lane half-warp (fp8_block128: the float32 scale; mxfp8: the four UE8M0 bytes of its 32-
// channel groups): every lane of the warp must call it (the reductions shuffle), lanes past the row with zeros.
__device__ __forceinline__ void fp8_cast8(int4 raw, int format, int lane, uint2* q, uint32_t* scale_word) {
    const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
    float f[8];
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        f[k] = __bfloat162float(h[k]);
        amax = fmaxf(amax, fabsf(f[k]));
    }
    // Group maximum: 16 lanes (128 channels) or 4 lanes (32 channels), exact.
    const int lanes = format == kFp8Block128 ? 16 : 4;
    for (int offset = lanes / 2; offset; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    amax = fmaxf(amax, __uint_as_float(kAmaxMinBits));
    float mult;
    uint32_t word;
    if (format == kFp8Block128) {
        word = __float_as_uint(__fdiv_rn(amax, 448.0f));  // the stored scale
        mult = __fdiv_rn(448.0f, amax);                   // not 1 / scale
    } else {
        // e = ceil(log2(amax / 448)) from the bits (a normal float: exact), clamped; multiplier 2**-e, exact.
        const uint32_t b = __float_as_uint(__fdiv_rn(amax, 448.0f));
        int e = static_cast<int>((b >> 23) & 0xFFu) - 127 + ((b & 0x7FFFFFu) != 0);
        e = min(max(e, -127), 127);
        const int k = -e;
        mult = k >= -126 ? __uint_as_float(static_cast<uint32_t>(k + 127) << 23)
                         : __uint_as_float(1u << (k + 149));  // 2**-127: a subnormal
        // The half-warp's four group bytes, group g from lane 4g of the half, little-endian in one word.
        const int base = lane & ~15;
        const uint32_t byte = static_cast<uint32_t>(e + 127);
        word = 0;
#pragma unroll
        for (int g = 0; g < 4; ++g) word |= __shfl_sync(0xffffffffu, byte, base + 4 * g) << (8 * g);
    }
    uint32_t packed[2] = {0, 0};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const float y = fminf(fmaxf(__fmul_rn(f[k], mult), -448.0f), 448.0f);
        const uint32_t byte = static_cast<uint8_t>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3));
        packed[k / 4] |= byte << (8 * (k % 4));
    }
    *q = make_uint2(packed[0], packed[1]);
    *scale_word = word;
}

}  // namespace moe_comm
