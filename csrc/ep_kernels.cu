// Dispatch and combine kernels of the CUDA backend (intranode, NVLink peer memory).
//
// A dispatch is: layout_impl (send positions and counts, one pass over topk_idx per rank/expert column),
// the barrier (transport.cu), dispatch_send_impl (every row written once per destination rank straight into
// that rank's receive block, with its metadata; counts and the call's signature into the rank's control slot),
// the signal/wait handshake, then dispatch_recv_impl (receive blocks -> output rows, non-expand or expand).
// A combine is: barrier, combine_send_impl (rows back to their source rank's receive blocks), signal/wait,
// combine_reduce_impl (FP32/FP64 sum in the order of DESIGN 2.2, then the biases). Expand combines move one row
// per (token, slot); when the region cannot hold every slot at once they go in rounds of `num_slots` slots,
// accumulating into a float buffer between rounds (the order stays ascending slot order).
//
// Region row layout (bytes): [data | scales][pad to 16][meta], meta = int64 source token index,
// int32 local expert id per slot, int32 rank of the token among this source's tokens of that expert per slot,
// weight per slot (4 or 8 bytes). Combine rows: [data][pad to 16][weights].
// No torch headers: plain nvcc builds this (CI compiles it for sm_90a without CUDA torch).

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>

namespace moe_comm {

constexpr int kMaxEpRanks = 32;      // destinations fit one warp's lanes
constexpr int kLayoutThreads = 1024;
constexpr int kLayoutItems = 8;     // consecutive tokens per layout thread and pass
constexpr int kWarpSize = 32;
constexpr int kUnroll = 4;
constexpr int kMaxSignature = 16;
constexpr int kMaxReduceRows = 64;   // rows added per token and round: <= max(ranks, slots per round)

struct EpParams {
    uint8_t* const* peer_bases;   // [num_ranks] buffer bases (device array)
    uint8_t* local_base;
    int64_t region_offset;        // receive region (from a buffer base)
    int64_t counts_offset;        // control slots [num_ranks][counts_stride] int64, slot s written by rank s
    int64_t counts_stride;
    int64_t num_tokens;           // this rank's tokens
    int64_t cap;                  // rows per source block (num_max_tokens_per_rank)
    int64_t row_stride;           // bytes per region row
    int64_t data_bytes;           // row data bytes (a multiple of 16)
    int64_t scale_bytes;          // FP8 scale bytes per row (a multiple of 4), 0 without FP8
    int64_t meta_offset;          // start of the metadata (or combine weights) inside a row
    int32_t rank;
    int32_t num_ranks;
    int32_t num_experts;
    int32_t num_local_experts;
    int32_t num_topk;
    int32_t weight_bytes;         // 0 (no weights), 4 or 8
    int32_t expert_alignment;
    int32_t num_signature;        // values of `signature` written at the start of a control slot
    int64_t signature[kMaxSignature];  // the call's sizes, compared on the host when it syncs
};

// Control slot: [signature (num_signature)] [rows] [per-local-expert counts (L)] [error flags].
__device__ __forceinline__ int64_t* control_slot(uint8_t* base, const EpParams& p, int slot) {
    return reinterpret_cast<int64_t*>(base + p.counts_offset) + static_cast<int64_t>(slot) * p.counts_stride;
}

__device__ __forceinline__ int4 ld_nc_v4(const int4* ptr) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
    return v;
}

// Copy `bytes` (a multiple of 16) with the lanes of one warp, kUnroll 16-byte loads in flight per lane before
// the stores (the pointers may alias as far as the compiler knows, so the order is spelled out).
__device__ __forceinline__ void warp_copy16(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane) {
    const int4* s = reinterpret_cast<const int4*>(src);
    int4* d = reinterpret_cast<int4*>(dst);
    const int64_t n = bytes / 16;
    int64_t i = lane;
    for (; i + (kUnroll - 1) * kWarpSize < n; i += kUnroll * kWarpSize) {
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) v[u] = s[i + u * kWarpSize];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) d[i + u * kWarpSize] = v[u];
    }
    for (; i < n; i += kWarpSize) d[i] = s[i];
}

__device__ __forceinline__ void warp_copy4(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane) {
    const int* s = reinterpret_cast<const int*>(src);
    int* d = reinterpret_cast<int*>(dst);
    for (int64_t i = lane; i < bytes / 4; i += kWarpSize) d[i] = s[i];
}

__device__ __forceinline__ void warp_zero16(uint8_t* dst, int64_t bytes, int lane) {
    int4* d = reinterpret_cast<int4*>(dst);
    for (int64_t i = lane; i < bytes / 16; i += kWarpSize) d[i] = make_int4(0, 0, 0, 0);
}

// ------------------------------------------------------------------------------------------------------------
// Layout: one block per column (R destination ranks, then E experts). A column's block walks the tokens in order,
// kLayoutItems consecutive tokens per thread and pass (one pass up to 8192 tokens), so positions are
// deterministic: send_pos[t, d] = tokens before t that go to rank d; expert_rank[t, j] = tokens before t that
// chose slot j's expert. Block 0 also writes the cleaned routing (invalid slots -> -1) and the error flags
// (1: out of range, 2: duplicate expert in a row).
// ------------------------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kLayoutThreads)
layout_impl(const int64_t* topk_idx, int64_t num_tokens, int num_topk, int num_experts, int num_ranks,
            int64_t* clean_idx, int64_t* send_pos, int32_t* expert_rank, int64_t* num_tokens_per_rank,
            int64_t* num_tokens_per_expert, int64_t* flags) {
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
    for (int64_t base = 0; base < num_tokens; base += static_cast<int64_t>(kLayoutThreads) * kLayoutItems) {
        const int64_t first = base + static_cast<int64_t>(threadIdx.x) * kLayoutItems;
        int hit_slot[kLayoutItems];  // slot of the token that hits this column, -1: no hit
        int hits = 0;
#pragma unroll
        for (int i = 0; i < kLayoutItems; ++i) {
            const int64_t t = first + i;
            hit_slot[i] = -1;
            if (t >= num_tokens) continue;
            const int64_t* row = topk_idx + t * num_topk;
            for (int j = 0; j < num_topk; ++j) {
                const int64_t e = row[j];
                const bool out_of_range = e < -1 || e >= num_experts;
                bool duplicate = false;
                if (e >= 0 && !out_of_range)
                    for (int k = 0; k < j; ++k) duplicate |= row[k] == e;
                const bool valid = e >= 0 && !out_of_range && !duplicate;
                if (valid && (is_rank ? e / num_local == target : e == target)) hit_slot[i] = j;
                if (column == 0) {
                    clean_idx[t * num_topk + j] = valid ? e : -1;
                    if (!valid) expert_rank[t * num_topk + j] = -1;
                    my_flags |= (out_of_range ? 1 : 0) | (duplicate ? 2 : 0);
                }
            }
            hits += hit_slot[i] >= 0;
        }
        int prefix, total;
        Scan(scan_storage).ExclusiveSum(hits, prefix, total);
        int64_t pos = carry + prefix;
#pragma unroll
        for (int i = 0; i < kLayoutItems; ++i) {
            const int64_t t = first + i;
            if (t >= num_tokens) continue;
            const bool hit = hit_slot[i] >= 0;
            if (is_rank)
                send_pos[t * num_ranks + target] = hit ? pos : -1;
            else if (hit)
                expert_rank[t * num_topk + hit_slot[i]] = static_cast<int32_t>(pos);
            pos += hit;
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

// ------------------------------------------------------------------------------------------------------------
// Dispatch send: one warp per token. The row is read once (16-byte loads, several in flight) and stored into the
// receive block of every destination rank (the local one included), followed by that rank's view of the
// metadata. Block 0 writes this rank's control slot on every peer: signature, rows, expert counts, flags.
// ------------------------------------------------------------------------------------------------------------
__global__ void dispatch_send_impl(EpParams p, const uint8_t* x, const uint8_t* scales, const int64_t* clean_idx,
                                   const uint8_t* weights, const int64_t* send_pos, const int32_t* expert_rank,
                                   const int64_t* num_tokens_per_rank, const int64_t* num_tokens_per_expert,
                                   const int64_t* flags) {
    const int lane = threadIdx.x % kWarpSize;
    const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
    const int64_t num_warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarpSize;
    const int L = p.num_local_experts, K = p.num_topk;

    // Control slots: ours on every rank.
    if (blockIdx.x == 0 && threadIdx.x < p.num_ranks) {
        const int d = threadIdx.x;
        int64_t* slot = control_slot(p.peer_bases[d], p, p.rank);
        for (int i = 0; i < p.num_signature; ++i) slot[i] = p.signature[i];
        int64_t* counts = slot + p.num_signature;
        counts[0] = num_tokens_per_rank[d];
        for (int l = 0; l < L; ++l) counts[1 + l] = num_tokens_per_expert[d * L + l];
        counts[1 + L] = flags[0];
    }

    const int64_t block_base = static_cast<int64_t>(p.rank) * p.cap;
    for (int64_t t = warp; t < p.num_tokens; t += num_warps) {
        const int64_t my_pos = lane < p.num_ranks ? send_pos[t * p.num_ranks + lane] : -1;
        const unsigned dest_mask = __ballot_sync(0xffffffffu, my_pos >= 0);

        // Data: 16-byte vectors, kUnroll loads in flight before the stores to every destination.
        const int4* src = reinterpret_cast<const int4*>(x + t * p.data_bytes);
        const int64_t num_vecs = p.data_bytes / 16;
        // NOTES: the loop bounds are warp-uniform, because the shuffle below needs every lane.
        for (int64_t v0 = 0; v0 < num_vecs; v0 += kUnroll * kWarpSize) {
            int4 values[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int64_t v = v0 + lane + u * kWarpSize;
                if (v < num_vecs) values[u] = ld_nc_v4(src + v);
            }
            for (unsigned mask = dest_mask; mask; mask &= mask - 1) {
                const int d = __ffs(mask) - 1;
                const int64_t pos = __shfl_sync(0xffffffffu, my_pos, d);
                int4* dst = reinterpret_cast<int4*>(p.peer_bases[d] + p.region_offset + (block_base + pos) * p.row_stride);
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) {
                    const int64_t v = v0 + lane + u * kWarpSize;
                    if (v < num_vecs) dst[v] = values[u];
                }
            }
        }
        // Scales (FP8) and metadata, per destination.
        for (unsigned mask = dest_mask; mask; mask &= mask - 1) {
            const int d = __ffs(mask) - 1;
            const int64_t pos = __shfl_sync(0xffffffffu, my_pos, d);
            uint8_t* row = p.peer_bases[d] + p.region_offset + (block_base + pos) * p.row_stride;
            if (p.scale_bytes) warp_copy4(row + p.data_bytes, scales + t * p.scale_bytes, p.scale_bytes, lane);
            uint8_t* meta = row + p.meta_offset;
            if (lane == 0) *reinterpret_cast<int64_t*>(meta) = t;
            int32_t* local_ids = reinterpret_cast<int32_t*>(meta + 8);
            int32_t* ranks = local_ids + K;
            uint8_t* w = meta + 8 + 8 * K;
            for (int j = lane; j < K; j += kWarpSize) {
                const int64_t e = clean_idx[t * K + j];
                const bool local = e >= 0 && e / L == d;
                local_ids[j] = local ? static_cast<int32_t>(e - static_cast<int64_t>(d) * L) : -1;
                ranks[j] = local ? expert_rank[t * K + j] : -1;
                if (p.weight_bytes == 4)
                    reinterpret_cast<int32_t*>(w)[j] = local ? reinterpret_cast<const int32_t*>(weights)[t * K + j] : 0;
                else if (p.weight_bytes == 8)
                    reinterpret_cast<int64_t*>(w)[j] = local ? reinterpret_cast<const int64_t*>(weights)[t * K + j] : 0;
            }
        }
    }
    // NOTES: the flag that publishes these rows is written by the next kernel on the stream (release, system
    // scope); the fence makes each thread's remote stores visible before this kernel retires.
    __threadfence_system();
}

// ------------------------------------------------------------------------------------------------------------
// Dispatch receive: from the receive blocks to the output rows. Every block first derives, from the control
// slots, where each source's rows start (non-expand) and where each (source, expert) run starts (expand).
// ------------------------------------------------------------------------------------------------------------
struct RecvOutputs {
    uint8_t* x;              // [P, data_bytes]
    uint8_t* scales;         // [P, scale_bytes] or null
    int64_t* topk_idx;       // [M, K] local ids, or null (cached dispatch)
    uint8_t* weights;        // non-expand [M, K * wb], expand [P * wb], or null
    int64_t* src_idx;        // [M] or null
    int32_t* expand_row;     // [M, K] or null (non-expand)
    int64_t* psum_rank;      // [R] inclusive, or null
    int64_t* psum_expert;    // [L] inclusive aligned, or null
    int64_t num_rows;        // M: rows of topk_idx / src_idx / expand_row (and x when not expanding)
    int64_t num_expand_rows; // P when expanding
    int32_t do_expand;
    int32_t padding;
};

__global__ void dispatch_recv_impl(EpParams p, RecvOutputs out) {
    extern __shared__ int64_t smem[];
    const int R = p.num_ranks, L = p.num_local_experts, K = p.num_topk;
    // smem: rows_from[R], rank_start[R], expert_start[L], expert_count[L], aligned[L], base[R * L]
    int64_t* rows_from = smem;
    int64_t* rank_start = rows_from + R;
    int64_t* expert_start = rank_start + R;
    int64_t* expert_count = expert_start + L;
    int64_t* aligned = expert_count + L;
    int64_t* run_base = aligned + L;
    const int64_t* slots = reinterpret_cast<const int64_t*>(p.local_base + p.counts_offset);

    // NOTES: counts come from peers; clamping keeps a disagreeing or timed-out peer from pushing writes past
    // the block or the outputs (its rows are then wrong, and the host raises for the timeout).
    for (int s = threadIdx.x; s < R; s += blockDim.x)
        rows_from[s] = min(max(slots[s * p.counts_stride + p.num_signature], int64_t(0)), p.cap);
    for (int l = threadIdx.x; l < L; l += blockDim.x) {
        int64_t c = 0;
        for (int s = 0; s < R; ++s) c += slots[s * p.counts_stride + p.num_signature + 1 + l];
        expert_count[l] = c;
        aligned[l] = (c + p.expert_alignment - 1) / p.expert_alignment * p.expert_alignment;
    }
    __syncthreads();
    // Prefix sums: few values (R ranks, L local experts), one thread is enough and keeps the order obvious.
    if (threadIdx.x == 0) {
        int64_t acc = 0;
        for (int s = 0; s < R; ++s) {
            rank_start[s] = acc;
            acc += rows_from[s];
            if (blockIdx.x == 0 && out.psum_rank) out.psum_rank[s] = acc;
        }
        acc = 0;
        for (int l = 0; l < L; ++l) {
            expert_start[l] = acc;
            acc += aligned[l];
            if (blockIdx.x == 0 && out.psum_expert) out.psum_expert[l] = acc;
        }
    }
    __syncthreads();
    if (out.do_expand) {
        for (int l = threadIdx.x; l < L; l += blockDim.x) {
            int64_t acc = expert_start[l];
            for (int s = 0; s < R; ++s) {
                run_base[s * L + l] = acc;
                acc += slots[s * p.counts_stride + p.num_signature + 1 + l];
            }
        }
        __syncthreads();
    }

    const int lane = threadIdx.x % kWarpSize;
    const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
    const int64_t num_warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarpSize;
    const int64_t wb = p.weight_bytes;
    for (int64_t g = warp; g < static_cast<int64_t>(R) * p.cap; g += num_warps) {
        const int s = static_cast<int>(g / p.cap);
        const int64_t i = g - static_cast<int64_t>(s) * p.cap;
        if (i >= rows_from[s]) continue;
        const uint8_t* row = p.local_base + p.region_offset + g * p.row_stride;
        const uint8_t* meta = row + p.meta_offset;
        const int32_t* local_ids = reinterpret_cast<const int32_t*>(meta + 8);
        const int32_t* ranks = local_ids + K;
        const uint8_t* w = meta + 8 + 8 * K;
        const int64_t m = rank_start[s] + i;
        if (m >= out.num_rows) continue;
        if (out.src_idx && lane == 0) out.src_idx[m] = *reinterpret_cast<const int64_t*>(meta);
        for (int j = lane; j < K; j += kWarpSize) {
            if (out.topk_idx) out.topk_idx[m * K + j] = local_ids[j];
            if (out.expand_row) {
                const int32_t l = local_ids[j];
                const int64_t r = l >= 0 && l < L ? run_base[s * L + l] + ranks[j] : -1;
                out.expand_row[m * K + j] = r >= 0 && r < out.num_expand_rows ? static_cast<int32_t>(r) : -1;
            }
            if (out.weights && !out.do_expand)
                for (int64_t b = 0; b < wb; ++b) out.weights[(m * K + j) * wb + b] = w[j * wb + b];
        }
        if (!out.do_expand) {
            warp_copy16(out.x + m * p.data_bytes, row, p.data_bytes, lane);
            if (out.scales) warp_copy4(out.scales + m * p.scale_bytes, row + p.data_bytes, p.scale_bytes, lane);
            continue;
        }
        for (int j = 0; j < K; ++j) {
            const int32_t l = local_ids[j];
            if (l < 0 || l >= L) continue;
            const int64_t r = run_base[s * L + l] + ranks[j];
            if (r < 0 || r >= out.num_expand_rows) continue;
            warp_copy16(out.x + r * p.data_bytes, row, p.data_bytes, lane);
            if (out.scales) warp_copy4(out.scales + r * p.scale_bytes, row + p.data_bytes, p.scale_bytes, lane);
            if (out.weights && lane < wb) out.weights[r * wb + lane] = w[j * wb + lane];
        }
    }
    // Expand padding rows are zero (data, scales, weight).
    if (out.do_expand) {
        for (int64_t l = warp; l < L; l += num_warps) {
            const int64_t end = min(expert_start[l] + aligned[l], out.num_expand_rows);
            for (int64_t r = expert_start[l] + expert_count[l]; r < end; ++r) {
                warp_zero16(out.x + r * p.data_bytes, p.data_bytes, lane);
                if (out.scales)
                    for (int64_t b = lane; b < p.scale_bytes / 4; b += kWarpSize)
                        reinterpret_cast<int32_t*>(out.scales + r * p.scale_bytes)[b] = 0;
                if (out.weights && lane < wb) out.weights[r * wb + lane] = 0;
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------------------
// Combine send: row m of the dispatch output goes back to its source rank s, into block `rank` at the row it
// came from. Expand: one row per (token, slot) for the slots of this round, at sub-row (slot - slot_begin).
// ------------------------------------------------------------------------------------------------------------
__global__ void combine_send_impl(EpParams p, const uint8_t* x, const uint8_t* weights, const int64_t* psum_rank,
                                  const int32_t* expand_row, int do_expand, int slot_begin, int slot_end,
                                  int num_slots) {
    const int lane = threadIdx.x % kWarpSize;
    const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
    const int64_t num_warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarpSize;
    const int R = p.num_ranks, K = p.num_topk;
    const int64_t total = psum_rank[R - 1];
    const int64_t wb = p.weight_bytes;
    for (int64_t m = warp; m < total; m += num_warps) {
        int s = 0;
        while (psum_rank[s] <= m) ++s;
        const int64_t i = m - (s ? psum_rank[s - 1] : 0);
        const int64_t block_row = static_cast<int64_t>(p.rank) * p.cap + i;
        uint8_t* region = p.peer_bases[s] + p.region_offset;
        if (!do_expand) {
            uint8_t* dst = region + block_row * p.row_stride;
            warp_copy16(dst, x + m * p.data_bytes, p.data_bytes, lane);
            if (weights)
                for (int64_t b = lane; b < K * wb; b += kWarpSize) dst[p.meta_offset + b] = weights[m * K * wb + b];
            continue;
        }
        for (int j = slot_begin; j < slot_end; ++j) {
            const int32_t r = expand_row[m * K + j];
            if (r < 0) continue;
            uint8_t* dst = region + (block_row * num_slots + (j - slot_begin)) * p.row_stride;
            warp_copy16(dst, x + r * p.data_bytes, p.data_bytes, lane);
            if (weights && lane < wb) dst[p.meta_offset + lane] = weights[static_cast<int64_t>(r) * wb + lane];
        }
    }
    __threadfence_system();
}

// ------------------------------------------------------------------------------------------------------------
// Combine reduce on the source: per token, start from zero and add the rows in ascending destination rank
// order (non-expand) or ascending slot order (expand), in Acc precision; after the last round add bias[0],
// then bias[1], and cast. combined_topk_weights is the select of slot j's value on its owner rank.
// ------------------------------------------------------------------------------------------------------------
template <typename T>
struct AccOf { using type = float; };
template <>
struct AccOf<double> { using type = double; };

template <typename T>
__device__ __forceinline__ typename AccOf<T>::type to_acc(T v) { return static_cast<typename AccOf<T>::type>(v); }
template <>
__device__ __forceinline__ float to_acc<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_acc(typename AccOf<T>::type v) { return static_cast<T>(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

struct ReduceArgs {
    const int64_t* send_pos;      // [N, R]
    const int64_t* clean_idx;     // [N, K]
    void* acc;                    // [N, H] Acc between rounds, or null (single round)
    const void* bias0;            // [N, H] T or null
    const void* bias1;
    void* out;                    // [N, H] T
    uint8_t* out_weights;         // [N, K * wb] or null
    int64_t hidden;
    int32_t do_expand;
    int32_t slot_begin;
    int32_t slot_end;
    int32_t num_slots;
    int32_t first_round;
    int32_t last_round;
};

template <typename T>
__global__ void combine_reduce_impl(EpParams p, ReduceArgs a) {
    using Acc = typename AccOf<T>::type;
    constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte vector
    __shared__ const uint8_t* rows[kMaxReduceRows];
    __shared__ int num_rows;
    const int R = p.num_ranks, K = p.num_topk, L = p.num_local_experts;
    const uint8_t* region = p.local_base + p.region_offset;
    const int64_t H = a.hidden, wb = p.weight_bytes, num_vecs = a.hidden / kVec;
    for (int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
        const int64_t* pos = a.send_pos + t * R;
        const int64_t* experts = a.clean_idx + t * K;
        // The rows to add, in the documented order: ascending rank (non-expand) or ascending slot (expand).
        if (threadIdx.x == 0) {
            int n = 0;
            if (!a.do_expand) {
                for (int d = 0; d < R; ++d)
                    if (pos[d] >= 0) rows[n++] = region + (static_cast<int64_t>(d) * p.cap + pos[d]) * p.row_stride;
            } else {
                for (int j = a.slot_begin; j < a.slot_end; ++j) {
                    if (experts[j] < 0) continue;
                    const int d = static_cast<int>(experts[j] / L);
                    rows[n++] = region + ((static_cast<int64_t>(d) * p.cap + pos[d]) * a.num_slots +
                                          (j - a.slot_begin)) * p.row_stride;
                }
            }
            num_rows = n;
        }
        __syncthreads();
        for (int64_t v = threadIdx.x; v < num_vecs; v += blockDim.x) {
            Acc acc[kVec];
            const int64_t first = t * H + v * kVec;
#pragma unroll
            for (int k = 0; k < kVec; ++k) acc[k] = a.first_round ? Acc(0) : static_cast<const Acc*>(a.acc)[first + k];
            for (int r = 0; r < num_rows; ++r) {
                const int4 raw = reinterpret_cast<const int4*>(rows[r])[v];
                const T* values = reinterpret_cast<const T*>(&raw);
#pragma unroll
                for (int k = 0; k < kVec; ++k) acc[k] += to_acc<T>(values[k]);
            }
            if (!a.last_round) {
#pragma unroll
                for (int k = 0; k < kVec; ++k) static_cast<Acc*>(a.acc)[first + k] = acc[k];
                continue;
            }
            for (const void* bias : {a.bias0, a.bias1}) {
                if (bias == nullptr) continue;
                const int4 raw = reinterpret_cast<const int4*>(static_cast<const T*>(bias) + first)[0];
                const T* values = reinterpret_cast<const T*>(&raw);
#pragma unroll
                for (int k = 0; k < kVec; ++k) acc[k] += to_acc<T>(values[k]);
            }
            int4 packed;
            T* out_values = reinterpret_cast<T*>(&packed);
#pragma unroll
            for (int k = 0; k < kVec; ++k) out_values[k] = from_acc<T>(acc[k]);
            reinterpret_cast<int4*>(static_cast<T*>(a.out) + first)[0] = packed;
        }
        if (a.out_weights) {
            for (int j = threadIdx.x; j < K; j += blockDim.x) {
                if (a.do_expand && (j < a.slot_begin || j >= a.slot_end)) continue;
                uint8_t* dst = a.out_weights + (t * K + j) * wb;
                if (experts[j] < 0) {
                    for (int64_t b = 0; b < wb; ++b) dst[b] = 0;
                    continue;
                }
                const int d = static_cast<int>(experts[j] / L);
                const int64_t block_row = static_cast<int64_t>(d) * p.cap + pos[d];
                const uint8_t* src = a.do_expand
                    ? region + (block_row * a.num_slots + (j - a.slot_begin)) * p.row_stride + p.meta_offset
                    : region + block_row * p.row_stride + p.meta_offset + j * wb;
                for (int64_t b = 0; b < wb; ++b) dst[b] = src[b];
            }
        }
        __syncthreads();  // rows[] is rebuilt for the next token
    }
}

}  // namespace moe_comm

using moe_comm::EpParams;
using moe_comm::ReduceArgs;
using moe_comm::RecvOutputs;

extern "C" {

int moe_comm_layout(const int64_t* topk_idx, int64_t num_tokens, int num_topk, int num_experts, int num_ranks,
                    int64_t* clean_idx, int64_t* send_pos, int32_t* expert_rank, int64_t* num_tokens_per_rank,
                    int64_t* num_tokens_per_expert, int64_t* flags, cudaStream_t stream) {
    if (num_ranks < 1 || num_ranks > moe_comm::kMaxEpRanks || num_experts % num_ranks != 0)
        return static_cast<int>(cudaErrorInvalidValue);
    moe_comm::layout_impl<<<num_ranks + num_experts, moe_comm::kLayoutThreads, 0, stream>>>(
        topk_idx, num_tokens, num_topk, num_experts, num_ranks, clean_idx, send_pos, expert_rank,
        num_tokens_per_rank, num_tokens_per_expert, flags);
    return static_cast<int>(cudaGetLastError());
}

int moe_comm_dispatch_send(const EpParams* p, const uint8_t* x, const uint8_t* scales, const int64_t* clean_idx,
                           const uint8_t* weights, const int64_t* send_pos, const int32_t* expert_rank,
                           const int64_t* num_tokens_per_rank, const int64_t* num_tokens_per_expert,
                           const int64_t* flags, int num_blocks, int num_threads, cudaStream_t stream) {
    if (p->num_ranks > moe_comm::kMaxEpRanks || p->data_bytes % 16 || p->scale_bytes % 4 || p->row_stride % 16 ||
        p->num_signature > moe_comm::kMaxSignature)
        return static_cast<int>(cudaErrorInvalidValue);
    moe_comm::dispatch_send_impl<<<num_blocks, num_threads, 0, stream>>>(
        *p, x, scales, clean_idx, weights, send_pos, expert_rank, num_tokens_per_rank, num_tokens_per_expert,
        flags);
    return static_cast<int>(cudaGetLastError());
}

int moe_comm_dispatch_recv(const EpParams* p, const RecvOutputs* out, int num_blocks, int num_threads,
                           cudaStream_t stream) {
    const size_t smem = sizeof(int64_t) * (2 * p->num_ranks + 3 * p->num_local_experts +
                                           static_cast<size_t>(p->num_ranks) * p->num_local_experts);
    if (smem > 48 * 1024) return static_cast<int>(cudaErrorInvalidValue);
    moe_comm::dispatch_recv_impl<<<num_blocks, num_threads, smem, stream>>>(*p, *out);
    return static_cast<int>(cudaGetLastError());
}

int moe_comm_combine_send(const EpParams* p, const uint8_t* x, const uint8_t* weights, const int64_t* psum_rank,
                          const int32_t* expand_row, int do_expand, int slot_begin, int slot_end, int num_slots,
                          int num_blocks, int num_threads, cudaStream_t stream) {
    moe_comm::combine_send_impl<<<num_blocks, num_threads, 0, stream>>>(*p, x, weights, psum_rank, expand_row,
                                                                        do_expand, slot_begin, slot_end, num_slots);
    return static_cast<int>(cudaGetLastError());
}

// dtype: 1 bf16, 2 float32, 3 float64 (accumulating in float32, float32, float64).
int moe_comm_combine_reduce(const EpParams* p, const ReduceArgs* a, int dtype, int num_blocks, int num_threads,
                            cudaStream_t stream) {
    switch (dtype) {
        case 1: moe_comm::combine_reduce_impl<__nv_bfloat16><<<num_blocks, num_threads, 0, stream>>>(*p, *a); break;
        case 2: moe_comm::combine_reduce_impl<float><<<num_blocks, num_threads, 0, stream>>>(*p, *a); break;
        case 3: moe_comm::combine_reduce_impl<double><<<num_blocks, num_threads, 0, stream>>>(*p, *a); break;
        default: return static_cast<int>(cudaErrorInvalidValue);
    }
    return static_cast<int>(cudaGetLastError());
}

int moe_comm_sizeof_ep_structs(int which) {
    switch (which) {
        case 0: return static_cast<int>(sizeof(EpParams));
        case 1: return static_cast<int>(sizeof(RecvOutputs));
        case 2: return static_cast<int>(sizeof(ReduceArgs));
        default: return -1;
    }
}

}  // extern "C"
