// Layout of a dispatch: where each of this rank's tokens goes and how many rows each rank and expert gets, then (in
// the same kernel, by its last block) the dispatch notify. Device code only (launched by kernels/layout.cu).
#pragma once

#include <cstdint>
#include <cooperative_groups.h>

#include "moe_comm/abi.h"
#include "moe_comm/common/rows.cuh"
#include "moe_comm/common/tuning.cuh"
#include "moe_comm/impls/notify.cuh"

namespace moe_comm {

// Layout: `a.num_blocks` co-resident blocks (a cooperative launch), block b owning a contiguous chunk of tokens,
// in three phases between grid-wide barriers; every token's row is read twice and positions are deterministic
// (send_pos[t, d] = tokens before t that go to rank d; expert_rank[t, j] = tokens before t that chose slot j's
// expert). Columns: R destination ranks, then E experts, then one for the error flags.
//  1. count: the chunk's hits per column into scratch[b][column] (shared-memory atomics: counts only), its flags
//     (1 out of range, 2 duplicate expert in a row) into the flags column; the cleaned routing (invalid slots ->
//     -1) and expert_rank -1 for invalid slots.
//  2. scan: a group of lanes per column: the exclusive prefix over the chunks, in place, and the column's total into
//     num_tokens_per_rank / num_tokens_per_expert (the flags column: ORed into flags).
//  3. place: warp 0 walks the chunk in token order, a token per lane and pass: each lane marks its token's columns
//     in a shared bit mask per column, so its position in a column is the column's running count (from the
//     prefix) plus the lanes before it that hit the column.
// The last block to finish runs the notify (notify_block) on the complete counts: one launch for both.
// NOTES: benchmarks/NOTES.md (session 7) has the measurements against the one-block-per-column kernel it replaced
// (which read every row once per column: 46 us at 4096 tokens, top-8 of 256).
// ------------------------------------------------------------------------------------------------------------
// Slot j of a row, holding `e` (the first kMaxLayoutTopk slots in registers, indexed by constants only): the expert,
// or -1 when invalid (out of range, or a repeat of an earlier slot of the row); `flags` collects why.
// NOTES: reading the row from global memory inside the duplicate check, behind stores the compiler must assume may
// alias, made the layout 10x slower: the row is read into registers once.
__device__ __forceinline__ int64_t clean_slot(int64_t e, const int64_t (&row)[kMaxLayoutTopk], const int64_t* src,
                                              int j, int num_experts, int& flags) {
    if (e < -1 || e >= num_experts) {
        flags |= 1;
        return -1;
    }
    if (e < 0) return -1;
    bool duplicate = false;
#pragma unroll
    for (int k = 0; k < kMaxLayoutTopk; ++k) duplicate |= k < j && row[k] == e;
    for (int k = kMaxLayoutTopk; k < j; ++k) duplicate |= src[k] == e;
    if (duplicate) flags |= 2;
    return duplicate ? -1 : e;
}

__device__ void layout_count(const EpParams& p, const LayoutArgs& a, int64_t begin, int64_t end, int* counts) {
    const int K = p.num_topk, R = p.num_ranks, L = p.num_local_experts;
    const int columns = R + p.num_experts;
    for (int c = threadIdx.x; c <= columns; c += blockDim.x) counts[c] = 0;
    __syncthreads();
    int flags = 0;
    for (int64_t t = begin + threadIdx.x; t < end; t += blockDim.x) {
        const int64_t* src = a.topk_idx + t * K;
        int64_t row[kMaxLayoutTopk];
#pragma unroll
        for (int j = 0; j < kMaxLayoutTopk; ++j) row[j] = j < K ? src[j] : -1;
        uint32_t ranks = 0;
        auto visit = [&](int j, int64_t value) {
            const int64_t e = clean_slot(value, row, src, j, p.num_experts, flags);
            a.clean_idx[t * K + j] = e;
            if (e < 0) {
                a.expert_rank[t * K + j] = -1;
                return;
            }
            atomicAdd(&counts[R + e], 1);
            ranks |= 1u << (e / L);
        };
#pragma unroll
        for (int j = 0; j < kMaxLayoutTopk; ++j) {  // unrolled: the row stays in registers
            if (j >= K) break;
            visit(j, row[j]);
        }
        for (int j = kMaxLayoutTopk; j < K; ++j) visit(j, src[j]);  // rare wide rows: the extra slots from memory
        for (; ranks; ranks &= ranks - 1) atomicAdd(&counts[__ffs(ranks) - 1], 1);
    }
    if (flags) atomicOr(&counts[columns], flags);
    __syncthreads();
    int* mine = a.scratch + static_cast<int64_t>(blockIdx.x) * (columns + 1);
    for (int c = threadIdx.x; c <= columns; c += blockDim.x) mine[c] = counts[c];
}

__device__ void layout_scan(const EpParams& p, const LayoutArgs& a) {
    // A group of `width` lanes per column (a power of two covering the chunks, at most a warp), each lane holding
    // up to kMaxScanPerLane chunks' counts in registers; groups of a warp take consecutive columns, so every lane
    // runs the same iterations (the shuffles need the whole warp).
    constexpr int kMaxScanPerLane = kLayoutMaxBlocks / kWarpSize;  // gridDim.x <= kLayoutMaxBlocks (the launcher)
    const int columns = p.num_ranks + p.num_experts, stride = columns + 1, G = gridDim.x;
    int width = 1;
    while (width < kWarpSize && width < G) width *= 2;
    const int per_lane = (G + width - 1) / width;
    const int lane = threadIdx.x % kWarpSize, sub = lane % width, groups_per_warp = kWarpSize / width;
    const int warps = blockDim.x / kWarpSize, warp = blockIdx.x * warps + threadIdx.x / kWarpSize;
    for (int first = warp * groups_per_warp; first <= columns; first += G * warps * groups_per_warp) {
        const int c = first + lane / width;
        int v[kMaxScanPerLane];
        int sum = 0, bits = 0;
#pragma unroll
        for (int i = 0; i < kMaxScanPerLane; ++i) {
            const int b = sub * per_lane + i;
            v[i] = i < per_lane && b < G && c <= columns ? __ldcg(a.scratch + static_cast<int64_t>(b) * stride + c) : 0;
            sum += v[i];
            bits |= v[i];
        }
        int inclusive = sum;
#pragma unroll
        for (int o = 1; o < kWarpSize; o *= 2) {
            const int up = __shfl_up_sync(0xffffffffu, inclusive, o, width);
            if (o < width && sub >= o) inclusive += up;
        }
#pragma unroll
        for (int o = 1; o < kWarpSize; o *= 2) bits |= o < width ? __shfl_xor_sync(0xffffffffu, bits, o, width) : 0;
        if (c > columns) continue;
        if (c == columns) {  // the flags column
            if (sub == 0) a.flags[0] = bits;
            continue;
        }
        int running = inclusive - sum;  // exclusive prefix of this lane's first chunk
#pragma unroll
        for (int i = 0; i < kMaxScanPerLane; ++i) {
            const int b = sub * per_lane + i;
            if (i < per_lane && b < G) a.scratch[static_cast<int64_t>(b) * stride + c] = running;
            running += v[i];
        }
        if (sub == width - 1) {  // the group's last lane holds the column's total
            if (c < p.num_ranks) a.num_tokens_per_rank[c] = inclusive;
            else a.num_tokens_per_expert[c - p.num_ranks] = inclusive;
        }
    }
}

__device__ void layout_place(const EpParams& p, const LayoutArgs& a, int64_t begin, int64_t end, int* run,
                             uint32_t* hits) {
    const int K = p.num_topk, R = p.num_ranks, L = p.num_local_experts;
    const int columns = R + p.num_experts;
    const int* prefix = a.scratch + static_cast<int64_t>(blockIdx.x) * (columns + 1);
    for (int c = threadIdx.x; c < columns; c += blockDim.x) {
        run[c] = __ldcg(prefix + c);
        hits[c] = 0;
    }
    __syncthreads();
    if (threadIdx.x >= kWarpSize) return;
    const int lane = threadIdx.x;
    const uint32_t before = (1u << lane) - 1;
    for (int64_t pass = begin; pass < end; pass += kWarpSize) {
        const int64_t t = pass + lane;
        const int64_t* row = a.clean_idx + t * K;
        uint32_t ranks = 0;
        if (t < end) {  // mark this token's columns
            for (int j = 0; j < K; ++j) {
                const int64_t e = row[j];
                if (e < 0) continue;
                atomicOr(&hits[R + e], 1u << lane);
                ranks |= 1u << (e / L);
            }
            for (uint32_t r = ranks; r; r &= r - 1) atomicOr(&hits[__ffs(r) - 1], 1u << lane);
        }
        __syncwarp();
        if (t < end) {  // positions: the running count plus the lanes before this one
            for (int j = 0; j < K; ++j) {
                const int64_t e = row[j];
                if (e >= 0) a.expert_rank[t * K + j] = run[R + e] + __popc(hits[R + e] & before);
            }
            for (int d = 0; d < R; ++d)
                a.send_pos[t * R + d] = (ranks >> d) & 1 ? run[d] + __popc(hits[d] & before) : -1;
        }
        __syncwarp();
        for (int c = lane; c < columns; c += kWarpSize) {  // advance the columns this pass hit
            const uint32_t m = hits[c];
            if (m) {
                run[c] += __popc(m);
                hits[c] = 0;
            }
        }
        __syncwarp();
    }
}

// Dynamic shared memory: counts [columns + 1] in phase 1, then run [columns] and hits [columns] in phase 3.
__global__ void __launch_bounds__(kLayoutThreads) layout_notify_impl(EpParams p, LayoutArgs a, NotifyArgs n) {
    extern __shared__ int layout_smem[];
    namespace cg = cooperative_groups;
    const int64_t chunk = (p.num_tokens + gridDim.x - 1) / gridDim.x;
    const int64_t begin = min(p.num_tokens, blockIdx.x * chunk), end = min(p.num_tokens, begin + chunk);
#ifdef MOE_COMM_BLOCK_TIMES
    if (threadIdx.x < kLayoutSteps && blockIdx.x < kMaxTimedBlocks) g_layout_step_times[blockIdx.x][threadIdx.x] = 0;
#endif
    STEP_TIME(g_layout_step_times, 0);
    layout_count(p, a, begin, end, layout_smem);
    STEP_TIME(g_layout_step_times, 1);
    cg::this_grid().sync();
    STEP_TIME(g_layout_step_times, 2);
    layout_scan(p, a);
    STEP_TIME(g_layout_step_times, 3);
    cg::this_grid().sync();
    STEP_TIME(g_layout_step_times, 4);
    const int columns = p.num_ranks + p.num_experts;
    layout_place(p, a, begin, end, layout_smem, reinterpret_cast<uint32_t*>(layout_smem + columns));
    STEP_TIME(g_layout_step_times, 5);
    if (kernel_done(p)) {
        notify_block(p, n);
#ifdef MOE_COMM_BLOCK_TIMES
        __syncthreads();
        STEP_TIME(g_layout_step_times, 9);
#endif
    }
}

}  // namespace moe_comm
