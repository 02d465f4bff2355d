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
// them; else over elements), four rows' loads in flight per lane.
template <typename T, typename Acc>
__global__ void expert_sum_impl(const T* rows, const int64_t* bag_rows, const int64_t* bag_offsets, int64_t num_bags,
                                int64_t row_elems, bool vectors, T* out) {
    constexpr int kPerVector = 16 / sizeof(T);
    constexpr int kInFlight = 4;
    const int lane = threadIdx.x % 32;
    const int64_t num_warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
    for (int64_t bag = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; bag < num_bags;
         bag += num_warps) {
        const int64_t begin = bag_offsets[bag], end = bag_offsets[bag + 1];
        T* dst = out + bag * row_elems;
        if (!vectors) {
            for (int64_t c = lane; c < row_elems; c += 32) {
                Acc acc = 0;
                for (int64_t e = begin; e < end; ++e) acc += static_cast<Acc>(rows[bag_rows[e] * row_elems + c]);
                dst[c] = static_cast<T>(acc);
            }
            continue;
        }
        const int64_t num_vectors = row_elems / kPerVector;
        for (int64_t v = lane; v < num_vectors; v += 32) {
            Acc acc[kPerVector] = {};
            int64_t e = begin;
            for (; e + kInFlight <= end; e += kInFlight) {
                int4 q[kInFlight];
#pragma unroll
                for (int i = 0; i < kInFlight; ++i)
                    q[i] = __ldg(reinterpret_cast<const int4*>(rows + bag_rows[e + i] * row_elems) + v);
#pragma unroll
                for (int i = 0; i < kInFlight; ++i) add_vector<T, Acc>(acc, q[i]);
            }
            for (; e < end; ++e)
                add_vector<T, Acc>(acc, __ldg(reinterpret_cast<const int4*>(rows + bag_rows[e] * row_elems) + v));
            int4 result;
            T* values = reinterpret_cast<T*>(&result);
#pragma unroll
            for (int i = 0; i < kPerVector; ++i) values[i] = static_cast<T>(acc[i]);
            reinterpret_cast<int4*>(dst)[v] = result;
        }
    }
}

}  // namespace moe_comm
