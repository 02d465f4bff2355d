// Route A's non-expand receiver: each received row's local expert outputs summed back into one row
// (moe_comm.integrations.megatron's ExpertRows.sum). Device code only (launched by kernels/expert_sum.cu); no torch
// headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moe_comm {

template <typename T, typename Acc>
__device__ __forceinline__ void add_vector(Acc* acc, const int4& q) {
    const T* values = reinterpret_cast<const T*>(&q);
#pragma unroll
    for (int i = 0; i < static_cast<int>(16 / sizeof(T)); ++i) acc[i] += static_cast<Acc>(values[i]);
}

// Bag b (b < num_bags): out row b = rows bag_rows[bag_offsets[b]], ..., bag_rows[bag_offsets[b + 1] - 1] of `rows`
// added in that order in Acc precision from zero, rounded once to T (what torch's embedding_bag(mode="sum") gives
// on CUDA). One warp per bag, lanes over the row's 16-byte vectors (`vectors`: rows, `out` and the row size allow
// them; else over elements). The bag's row indices are read once per 32 (a lane each, passed round by shuffles),
// not once per vector, and kInFlight rows' loads are in flight per lane.
template <typename T, typename Acc>
__global__ void __launch_bounds__(256, 4)
    expert_sum_impl(const T* rows, const int64_t* bag_rows, const int64_t* bag_offsets, int64_t num_bags,
                    int64_t row_elems, bool vectors, T* out) {
    constexpr int kPerVector = 16 / sizeof(T);
    constexpr int kInFlight = 4;
    static_assert(32 % kInFlight == 0, "a batch of loads stays inside one 32-entry chunk of the bag");
    constexpr unsigned kAll = 0xffffffffu;
    const int lane = threadIdx.x % 32;
    const int64_t num_warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
    for (int64_t bag = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; bag < num_bags;
         bag += num_warps) {
        const int64_t begin = bag_offsets[bag], size = bag_offsets[bag + 1] - begin;
        T* dst = out + bag * row_elems;
        // Row index of the bag's entry `lane`. Entries 32 and on (bags that long are rare) are read again per pass:
        // a lane each per 32 of them on the vector path, every entry for each 32 elements on the element path.
        const int64_t first = lane < size ? bag_rows[begin + lane] : 0;
        // Every lane runs every step (the shuffles need the whole warp); lanes past the row's end load nothing.
        if (!vectors) {
            for (int64_t c0 = 0; c0 < row_elems; c0 += 32) {
                const int64_t c = c0 + lane;
                Acc acc = 0;
                for (int64_t e = 0; e < size; ++e) {
                    const int64_t row = e < 32 ? __shfl_sync(kAll, first, static_cast<int>(e)) : bag_rows[begin + e];
                    if (c < row_elems) acc += static_cast<Acc>(rows[row * row_elems + c]);
                }
                if (c < row_elems) dst[c] = static_cast<T>(acc);
            }
            continue;
        }
        const int64_t num_vectors = row_elems / kPerVector;
        for (int64_t v0 = 0; v0 < num_vectors; v0 += 32) {
            const int64_t v = v0 + lane;
            const bool active = v < num_vectors;
            Acc acc[kPerVector] = {};
            for (int64_t e0 = 0; e0 < size; e0 += 32) {
                const int64_t chunk = e0 == 0 ? first : (e0 + lane < size ? bag_rows[begin + e0 + lane] : 0);
                const int in_chunk = static_cast<int>(size - e0 < 32 ? size - e0 : 32);
                for (int e = 0; e < in_chunk; e += kInFlight) {
                    int4 q[kInFlight];
#pragma unroll
                    for (int i = 0; i < kInFlight; ++i) {
                        const int64_t row = __shfl_sync(kAll, chunk, e + i);
                        if (active && e + i < in_chunk)
                            q[i] = __ldg(reinterpret_cast<const int4*>(rows + row * row_elems) + v);
                    }
#pragma unroll
                    for (int i = 0; i < kInFlight; ++i)
                        if (active && e + i < in_chunk) add_vector<T, Acc>(acc, q[i]);
                }
            }
            if (!active) continue;
            int4 result;
            T* values = reinterpret_cast<T*>(&result);
#pragma unroll
            for (int i = 0; i < kPerVector; ++i) values[i] = static_cast<T>(acc[i]);
            reinterpret_cast<int4*>(dst)[v] = result;
        }
    }
}

}  // namespace moe_comm
