// FP8 casts inside a kernel (a dispatch's `quantize=` and `dequantize=True`), bitwise the recipes of
// moe_comm/quant.py: every step one IEEE float32 operation in the order written there (no fast math, no FMA, no
// reciprocal tricks). Quantize: a warp casts 16-byte vectors of 8 bf16 values, one per lane; consecutive lanes
// hold consecutive vectors, so a 128-channel group is 16 lanes and a 32-channel group 4 lanes. Dequantize: 8 FP8
// values and their scale to 8 bf16 values. The format codes (kFp8Block128, kFp8Mx) and the amax floor (kAmaxMinBits)
// come from moe_comm/layout.py through abi.h. Scales are 4-byte words, word i for channels 128i .. 128i + 127 in both
// formats (fp8_block128: a float32; mxfp8: four UE8M0 bytes, byte k for channels 128i + 32k ...). Device code only,
// no torch headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "moe_comm/abi.h"

namespace moe_comm {

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
        e = min(max(e, -127), 127);  // the recipe's clamp: amax >= AMAX_MIN keeps e in [-22, 120] here
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

// The scale of channel `channel` from its 128 channels' scale word: the float32 (fp8_block128), or 2**(byte - 127)
// of its 32-channel group's byte (mxfp8; byte 0 is the subnormal 2**-127, byte 255 NaN), exact.
__device__ __forceinline__ float fp8_scale_of(uint32_t word, int format, int64_t channel) {
    if (format == kFp8Block128) return __uint_as_float(word);
    const uint32_t byte = (word >> (8 * (channel / 32 % 4))) & 0xFFu;
    return byte == 0 ? __uint_as_float(0x00400000u) : byte == 255 ? __uint_as_float(0x7FC00000u)
                                                                   : __uint_as_float(byte << 23);
}

// 8 FP8 values (little-endian in a uint2) times their scale, each rounded once to bf16: a 16-byte vector.
__device__ __forceinline__ int4 fp8_dequant8(uint2 q, float scale) {
    uint32_t packed[4];
#pragma unroll
    for (int k = 0; k < 8; k += 2) {
        uint16_t halves[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            __nv_fp8_e4m3 value;
            value.__x = static_cast<__nv_fp8_storage_t>(((k + i < 4 ? q.x : q.y) >> (8 * ((k + i) % 4))) & 0xFFu);
            halves[i] = __bfloat16_as_ushort(__float2bfloat16_rn(__fmul_rn(static_cast<float>(value), scale)));
        }
        packed[k / 2] = halves[0] | (static_cast<uint32_t>(halves[1]) << 16);
    }
    return make_int4(static_cast<int>(packed[0]), static_cast<int>(packed[1]), static_cast<int>(packed[2]),
                     static_cast<int>(packed[3]));
}

}  // namespace moe_comm
