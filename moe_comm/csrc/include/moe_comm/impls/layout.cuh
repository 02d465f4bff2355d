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

// Layout: `a.num_blocks` co-resident blocks (a cooperative launch), block b owning a contiguous chunk of tokens
// taken in passes of kLayoutThreads tokens (a token per thread), in three phases, a grid-wide barrier after the
// first (none when there is one block); positions are deterministic (send_pos[t, d] = tokens before t that go to
// rank d; expert_rank[t, j] = tokens before t that chose slot j's expert). Columns: R destination ranks, then E
// experts, then one for the error flags. Shared memory per column: a hit mask per warp of a pass (bit = lane:
// which tokens of the pass hit the column), the position of each mask's first token in the column, the column's
// running count.
//  1. count: each thread its token of the first pass: the row cleaned (invalid slots -> -1, expert_rank -1; flags 1
//     out of range, 2 duplicate expert in a row) into clean_idx and registers, its columns' bits into the masks;
//     tokens of later passes (chunks over kLayoutThreads tokens) counted by shared-memory atomics. The chunk's count
//     per column (masks' popcounts + atomics) into scratch[b][column], or with one block straight into the totals.
//  2. prefix (more than one block): each block sums the counts of the chunks before it per column; the last block
//     writes the totals into num_tokens_per_rank / num_tokens_per_expert (the flags column: ORed into flags).
//  3. place, per pass: each column's masks turned into positions (its running count, from the prefix, plus the
//     bits of the masks before), then each thread's token's position in a column is its mask's position plus the
//     bits of the lanes before it. The first pass's masks and rows are still there from phase 1; a later pass marks
//     its masks again from clean_idx.
// The last block to finish runs the notify (notify_block) on the complete counts: one launch for both.
// NOTES: benchmarks/NOTES.md: session 7 measured the one-block-per-column kernel this replaced (every row read once
// per column: 46 us at 4096 tokens, top-8 of 256); session 13 this kernel against a warp placing 32 tokens a pass
// (~3-4 us a pass: a slot's load, a shared atomic and a store at a time): 17.9 -> 14.7 us at 128 tokens (one
// block), 21.8 -> 23.6 at 4096.
// ------------------------------------------------------------------------------------------------------------
// Slot j of a row, holding `e` (the first kMaxLayoutTopk slots in registers, indexed by constants only): the expert,
// or -1 when invalid (out of range, or a repeat of an earlier slot of the row); `flags` collects why.
// NOTES: reading the row from global memory inside the duplicate check, behind stores the compiler must assume may
// alias, made the layout 10x slower: the row is read into registers once.
__device__ __forceinline__ int64_t clean_slot(int64_t e, const int64_t (&row)[kMaxLayoutTopk], const int64_t* src,
                                              int j, int num_experts, int& flags) {
    if (e < -1 || e >= num_experts) {
        flags |= kRoutingOutOfRange;
        return -1;
    }
    if (e < 0) return -1;
    bool duplicate = false;
#pragma unroll
    for (int k = 0; k < kMaxLayoutTopk; ++k) duplicate |= k < j && row[k] == e;
    for (int k = kMaxLayoutTopk; k < j; ++k) duplicate |= src[k] == e;
    if (duplicate) flags |= kRoutingDuplicate;
    return duplicate ? -1 : e;
}

// Shared memory of a layout block (dynamic, sized by kernels/layout.cu): per column, a hit mask per warp of a pass
// and the position of that mask's first token in the column; the columns' running counts (in phase 1 the counts of
// later passes, the flags in [columns]).
struct LayoutShared {
    uint32_t* hits;  // [columns][kLayoutWarps]
    int* first;      // [columns][kLayoutWarps]
    int* running;    // [columns + 1]
    __device__ LayoutShared(int* smem, int columns)
        : hits(reinterpret_cast<uint32_t*>(smem)),
          first(smem + columns * kLayoutWarps),
          running(smem + 2 * columns * kLayoutWarps) {}
};

// A thread's token of a pass: its cleaned slots (the first kMaxLayoutTopk; -1 invalid) and the ranks it goes to.
struct LayoutRow {
    int e[kMaxLayoutTopk];
    uint32_t ranks;
};

// Column c's total into the layout's outputs: a rank's rows, an expert's rows, or (c == columns) the error flags.
__device__ __forceinline__ void write_total(const LayoutArgs& a, int R, int columns, int c, int total) {
    if (c < R) a.num_tokens_per_rank[c] = total;
    else if (c < columns) a.num_tokens_per_expert[c - R] = total;
    else a.flags[0] = total;
}

// Phase 1 into `sh` and `row` (the thread's token of the first pass, kept for phase 3).
__device__ void layout_count(const EpParams& p, const LayoutArgs& a, int64_t begin, int64_t end,
                             const LayoutShared& sh, LayoutRow& row) {
    const int K = p.num_topk, R = p.num_ranks, L = p.num_local_experts, columns = R + p.num_experts;
    for (int i = threadIdx.x; i < columns * kLayoutWarps; i += blockDim.x) sh.hits[i] = 0;
    for (int c = threadIdx.x; c <= columns; c += blockDim.x) sh.running[c] = 0;
    __syncthreads();
    const int warp = threadIdx.x / kWarpSize;
    const uint32_t bit = 1u << (threadIdx.x % kWarpSize);
    int flags = 0;
    for (int64_t t = begin + threadIdx.x; t < end; t += kLayoutThreads) {
        const bool first_pass = t - begin < kLayoutThreads;
        auto hit = [&](int c) {
            if (first_pass) atomicOr(&sh.hits[c * kLayoutWarps + warp], bit);
            else atomicAdd(&sh.running[c], 1);
        };
        const int64_t* src = a.topk_idx + t * K;
        int64_t raw[kMaxLayoutTopk];
#pragma unroll
        for (int j = 0; j < kMaxLayoutTopk; ++j) raw[j] = j < K ? src[j] : -1;
        uint32_t ranks = 0;
        auto visit = [&](int j, int64_t value) {
            const int e = static_cast<int>(clean_slot(value, raw, src, j, p.num_experts, flags));
            a.clean_idx[t * K + j] = e;
            if (e < 0) {
                a.expert_rank[t * K + j] = -1;
                return e;
            }
            hit(R + e);
            ranks |= 1u << (e / L);
            return e;
        };
        LayoutRow mine;
#pragma unroll
        for (int j = 0; j < kMaxLayoutTopk; ++j) mine.e[j] = j < K ? visit(j, raw[j]) : -1;  // unrolled: registers
        for (int j = kMaxLayoutTopk; j < K; ++j) visit(j, src[j]);  // rare wide rows: the extra slots from memory
        for (uint32_t r = ranks; r; r &= r - 1) hit(__ffs(r) - 1);
        mine.ranks = ranks;
        if (first_pass) row = mine;
    }
    if (flags) atomicOr(&sh.running[columns], flags);
    __syncthreads();
    // The chunk's count per column: into scratch for phase 2, or with one block the totals themselves (and its
    // prefixes, all 0, into the running counts; with more blocks phase 2 sets them, the same thread per column).
    int* counts = a.scratch + static_cast<int64_t>(blockIdx.x) * (columns + 1);
    for (int c = threadIdx.x; c <= columns; c += blockDim.x) {
        int total = sh.running[c];
        if (c < columns)
            for (int w = 0; w < kLayoutWarps; ++w) total += __popc(sh.hits[c * kLayoutWarps + w]);
        if (gridDim.x > 1) {
            counts[c] = total;
            continue;
        }
        write_total(a, R, columns, c, total);
        if (c < columns) sh.running[c] = 0;
    }
}

// Phase 2 (more than one block, after the grid barrier): the block's prefix per column, the counts of the chunks
// before it, into the running counts; the last block also writes the totals (every chunk's counts; the flags
// column ORed). Every block reads the counts it needs itself: no scan phase, no second grid barrier.
// NOTES: a scan by warps over all chunks then a second grid barrier cost ~3.5 us at 4096 tokens (32 blocks) with
// the prefix load after it (benchmarks/NOTES.md, thirteenth session).
__device__ void layout_prefix(const EpParams& p, const LayoutArgs& a, const LayoutShared& sh) {
    constexpr int kInFlight = 8;  // independent loads per thread at a time
    const int R = p.num_ranks, columns = R + p.num_experts, stride = columns + 1;
    const int b = blockIdx.x, G = gridDim.x;
    const bool last = b == G - 1;
    const int upto = last ? G : b;  // the last block reads its own chunk too: the totals
    for (int c = threadIdx.x; c <= columns; c += blockDim.x) {
        int sum[kInFlight] = {}, own = 0, bits = 0;
        for (int first = 0; first < upto; first += kInFlight) {
#pragma unroll
            for (int k = 0; k < kInFlight; ++k) {
                const int chunk = first + k;
                const int v = chunk < upto ? __ldcg(a.scratch + static_cast<int64_t>(chunk) * stride + c) : 0;
                if (chunk < b) sum[k] += v;  // the prefix
                else own += v;               // the last block's own chunk (0 past `upto`)
                bits |= v;
            }
        }
        int before = 0;
#pragma unroll
        for (int k = 0; k < kInFlight; ++k) before += sum[k];
        if (c < columns) sh.running[c] = before;
        if (last) write_total(a, R, columns, c, c < columns ? before + own : bits);
    }
}

// Phase 3: `row` is the thread's token of the first pass from phase 1 (whose masks are still in `sh`); the
// running counts hold the block's prefixes (phase 2, or phase 1 with one block).
__device__ void layout_place(const EpParams& p, const LayoutArgs& a, int64_t begin, int64_t end,
                             const LayoutShared& sh, LayoutRow row) {
    const int K = p.num_topk, R = p.num_ranks, L = p.num_local_experts, columns = R + p.num_experts;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const uint32_t before = (1u << lane) - 1;
    for (int64_t pass = begin; pass < end; pass += kLayoutThreads) {
        const int64_t t = pass + threadIdx.x;
        if (pass != begin) {  // a later pass: its rows again from clean_idx, its masks
            __syncthreads();  // the pass before has read its masks
            for (int i = threadIdx.x; i < columns * kLayoutWarps; i += blockDim.x) sh.hits[i] = 0;
            __syncthreads();
            row.ranks = 0;
            if (t < end) {
                const int64_t* src = a.clean_idx + t * K;
#pragma unroll
                for (int j = 0; j < kMaxLayoutTopk; ++j) row.e[j] = j < K ? static_cast<int>(src[j]) : -1;
                auto mark = [&](int e) {
                    if (e < 0) return;
                    atomicOr(&sh.hits[(R + e) * kLayoutWarps + warp], 1u << lane);
                    row.ranks |= 1u << (e / L);
                };
#pragma unroll
                for (int j = 0; j < kMaxLayoutTopk; ++j) mark(row.e[j]);
                for (int j = kMaxLayoutTopk; j < K; ++j) mark(static_cast<int>(src[j]));
                for (uint32_t r = row.ranks; r; r &= r - 1)
                    atomicOr(&sh.hits[(__ffs(r) - 1) * kLayoutWarps + warp], 1u << lane);
            }
        }
        __syncthreads();  // the pass's masks are complete
        for (int c = threadIdx.x; c < columns; c += blockDim.x) {
            int running = sh.running[c];
            for (int w = 0; w < kLayoutWarps; ++w) {
                sh.first[c * kLayoutWarps + w] = running;
                running += __popc(sh.hits[c * kLayoutWarps + w]);
            }
            sh.running[c] = running;
        }
        __syncthreads();
        if (t >= end) continue;
        auto position = [&](int c) {
            return sh.first[c * kLayoutWarps + warp] + __popc(sh.hits[c * kLayoutWarps + warp] & before);
        };
#pragma unroll
        for (int j = 0; j < kMaxLayoutTopk; ++j)
            if (j < K && row.e[j] >= 0) a.expert_rank[t * K + j] = position(R + row.e[j]);
        for (int j = kMaxLayoutTopk; j < K; ++j) {
            const int e = static_cast<int>(a.clean_idx[t * K + j]);
            if (e >= 0) a.expert_rank[t * K + j] = position(R + e);
        }
        for (int d = 0; d < R; ++d) a.send_pos[t * R + d] = (row.ranks >> d) & 1 ? position(d) : -1;
    }
}

__global__ void __launch_bounds__(kLayoutThreads) layout_notify_impl(EpParams p, LayoutArgs a, NotifyArgs n) {
    extern __shared__ int layout_smem[];
    namespace cg = cooperative_groups;
    const LayoutShared sh(layout_smem, p.num_ranks + p.num_experts);
    const int64_t chunk = (p.num_tokens + gridDim.x - 1) / gridDim.x;
    const int64_t begin = min(p.num_tokens, blockIdx.x * chunk), end = min(p.num_tokens, begin + chunk);
#ifdef MOE_COMM_BLOCK_TIMES
    if (threadIdx.x < kLayoutSteps && blockIdx.x < kMaxTimedBlocks) g_layout_step_times[blockIdx.x][threadIdx.x] = 0;
#endif
    LayoutRow row{};
    STEP_TIME(g_layout_step_times, 0);
    layout_count(p, a, begin, end, sh, row);
    STEP_TIME(g_layout_step_times, 1);
    const bool grid = gridDim.x > 1;  // one block: phase 1 wrote the totals, every prefix is 0
    if (grid) cg::this_grid().sync();
    STEP_TIME(g_layout_step_times, 2);
    if (grid) layout_prefix(p, a, sh);
    STEP_TIME(g_layout_step_times, 3);
    layout_place(p, a, begin, end, sh, row);
    STEP_TIME(g_layout_step_times, 4);
    if (kernel_done(p)) {
        notify_block(p, n);
#ifdef MOE_COMM_BLOCK_TIMES
        __syncthreads();
        STEP_TIME(g_layout_step_times, 8);
#endif
    }
}

}  // namespace moe_comm
