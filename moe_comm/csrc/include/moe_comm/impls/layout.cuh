// Layout of a dispatch: where each of this rank's tokens goes and how many rows each rank and expert gets, then (in
// the same kernel, by its last block) the dispatch notify. Device code only (launched by kernels/layout.cu).
#pragma once

#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "moe_comm/abi.h"
#include "moe_comm/common/rows.cuh"
#include "moe_comm/common/tuning.cuh"
#include "moe_comm/impls/notify.cuh"

namespace moe_comm {

// Layout: one block per column (R destination ranks, then E experts). A column's block walks the tokens in order,
// one token per thread and pass, so positions are deterministic: send_pos[t, d] = tokens before t that go to
// rank d; expert_rank[t, j] = tokens before t that chose slot j's expert. Block 0 also writes the cleaned routing
// (invalid slots -> -1) and the error flags (1: out of range, 2: duplicate expert in a row).
// NOTES: a row is read into registers once (up to kMaxLayoutTopk slots): re-reading it from global memory inside
// the duplicate check, behind stores the compiler must assume may alias, made this kernel 10x slower.
// The last block to finish runs the notify (notify_block) on the complete counts: one launch for both.
// ------------------------------------------------------------------------------------------------------------
__device__ void layout_column(const int64_t* __restrict__ topk_idx, int64_t num_tokens, int num_topk,
                              int num_experts, int num_ranks, int64_t* __restrict__ clean_idx,
                              int64_t* __restrict__ send_pos, int32_t* __restrict__ expert_rank,
                              int64_t* num_tokens_per_rank, int64_t* num_tokens_per_expert, int64_t* flags) {
    using Scan = cub::BlockScan<int, kLayoutThreads>;
    __shared__ typename Scan::TempStorage scan_storage;
    __shared__ int flag_bits;
    const int column = blockIdx.x;
    const bool is_rank = column < num_ranks;
    const int target = is_rank ? column : column - num_ranks;
    const int num_local = num_experts / num_ranks;
    if (threadIdx.x == 0) flag_bits = 0;
    __syncthreads();

    int64_t carry = 0;
    int my_flags = 0;
    for (int64_t base = 0; base < num_tokens; base += kLayoutThreads) {
        const int64_t t = base + threadIdx.x;
        int hit_slot = -1;
        if (t < num_tokens) {
            const int64_t* src = topk_idx + t * num_topk;
            int64_t row[kMaxLayoutTopk];
#pragma unroll
            for (int j = 0; j < kMaxLayoutTopk; ++j) row[j] = j < num_topk ? src[j] : -1;
            // Slot j of this token: valid (in range, not a repeat of an earlier slot), hit, cleaned copy, flags.
            auto visit = [&](int j, int64_t e, bool duplicate) {
                const bool out_of_range = e < -1 || e >= num_experts;
                duplicate = duplicate && e >= 0 && !out_of_range;
                const bool valid = e >= 0 && !out_of_range && !duplicate;
                if (valid && (is_rank ? e / num_local == target : e == target)) hit_slot = j;
                if (column == 0) {
                    clean_idx[t * num_topk + j] = valid ? e : -1;
                    if (!valid) expert_rank[t * num_topk + j] = -1;
                    my_flags |= (out_of_range ? 1 : 0) | (duplicate ? 2 : 0);
                }
            };
#pragma unroll
            for (int j = 0; j < kMaxLayoutTopk; ++j) {
                if (j >= num_topk) break;
                bool duplicate = false;
#pragma unroll
                for (int k = 0; k < j; ++k) duplicate |= row[k] == row[j];
                visit(j, row[j], duplicate);
            }
            for (int j = kMaxLayoutTopk; j < num_topk; ++j) {  // rare wide rows: the extra slots from memory
                bool duplicate = false;
                for (int k = 0; k < j; ++k) duplicate |= src[k] == src[j];
                visit(j, src[j], duplicate);
            }
        }
        int prefix, total;
        Scan(scan_storage).ExclusiveSum(hit_slot >= 0 ? 1 : 0, prefix, total);
        if (t < num_tokens) {
            if (is_rank)
                send_pos[t * num_ranks + target] = hit_slot >= 0 ? carry + prefix : -1;
            else if (hit_slot >= 0)
                expert_rank[t * num_topk + hit_slot] = static_cast<int32_t>(carry + prefix);
        }
        carry += total;
        __syncthreads();  // scan_storage is reused by the next pass
    }
    if (column == 0 && my_flags) atomicOr(&flag_bits, my_flags);
    __syncthreads();
    if (threadIdx.x == 0) {
        if (is_rank) num_tokens_per_rank[target] = carry;
        else num_tokens_per_expert[target] = carry;
        if (column == 0) flags[0] = flag_bits;
    }
}


__global__ void __launch_bounds__(kLayoutThreads) layout_notify_impl(EpParams p, LayoutArgs a, NotifyArgs n) {
    layout_column(a.topk_idx, p.num_tokens, p.num_topk, p.num_experts, p.num_ranks, a.clean_idx, a.send_pos,
                  a.expert_rank, a.num_tokens_per_rank, a.num_tokens_per_expert, a.flags);
    if (kernel_done(p)) notify_block(p, n);
}

}  // namespace moe_comm
