// Engram fetch: rows of a table spread over the ranks' IPC regions, read one-sided by global index (peer loads
// over NVLink; the owners take no part). Device code only (launched by kernels/engram.cu); no torch headers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moe_comm {

// Row i of the output is global row indices[i]: the owner r is the last rank whose offsets[r] <= index (offsets
// has num_ranks + 1 entries, ranks in order), the row `index - offsets[r]` of bases[r]. One warp per row; 16-byte
// vectors when rows are a multiple of 16 bytes, else bytes.
__global__ void engram_gather_impl(const int64_t* indices, int64_t num_rows, const int64_t* offsets, int num_ranks,
                                   const uint8_t* const* bases, int64_t row_bytes, uint8_t* out) {
    const int lane = threadIdx.x % 32;
    const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int64_t num_warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
    for (int64_t i = warp; i < num_rows; i += num_warps) {
        const int64_t index = indices[i];
        int owner = 0;
        while (owner + 1 < num_ranks && offsets[owner + 1] <= index) ++owner;
        const uint8_t* src = bases[owner] + (index - offsets[owner]) * row_bytes;
        uint8_t* dst = out + i * row_bytes;
        if (row_bytes % 16 == 0) {
            for (int64_t v = lane; v < row_bytes / 16; v += 32)
                reinterpret_cast<int4*>(dst)[v] = __ldcg(reinterpret_cast<const int4*>(src) + v);
        } else {
            for (int64_t b = lane; b < row_bytes; b += 32) dst[b] = src[b];
        }
    }
}

}  // namespace moe_comm
