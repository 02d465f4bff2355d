// Dispatch and combine kernels of the CUDA backend (intranode, NVLink peer memory).
//
// A dispatch is: layout_impl (send positions and counts, one pass over topk_idx per rank/expert column; skipped
// when cached), dispatch_notify_impl (the barrier: nobody writes into a region its owner still reads; counts and
// the call's signature into every peer's control slot; a cached dispatch runs the barrier of transport.cu
// alone), then dispatch_impl: sender blocks write every row once per destination rank straight into that rank's
// receive block with its metadata and release a per-row tag; receiver blocks, running at the same time, acquire
// each row's tag and copy it to the output rows (non-expand or expand), so the copy overlaps the transfer. A
// non-expand dispatch writes this rank's own rows straight to their output rows instead (the receivers only copy
// what peers sent).
// A combine is: barrier, then combine_impl: sender blocks write rows back to their source rank's receive blocks and
// release a per-row tag; reducer blocks, at the same time, acquire the tags of each token's rows and add them in
// FP32/FP64 in the order of DESIGN 2.2, then the biases. Rows that came from this rank itself are not sent: the
// reducers read them from the combine input. Expand combines move one row per (token, slot); when the
// region cannot hold every slot at once they go in rounds of `num_slots` (<= 32) slots, accumulating into a float
// buffer between rounds (the order stays ascending slot order).
//
// Region row layout (bytes): [data | scales][pad to 16][meta][pad to 16][tag, pad: 16], meta = int64 source token
// index, int32 local expert id per slot, int32 rank of the token among this source's tokens of that expert per
// slot, weight per slot (4 or 8 bytes); tag = kTagMagic << 48 | the operation's barrier sequence number.
// Combine rows: [data][pad to 16][weights][pad to 16][tag, pad: 16].
// No torch headers: plain nvcc builds this (CI compiles it for sm_90a without CUDA torch).

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "moe_comm/comm.cuh"

namespace moe_comm {

constexpr int kMaxEpRanks = 32;      // destinations fit one warp's lanes
constexpr int kLayoutThreads = 1024;
constexpr int kMaxLayoutTopk = 16;  // slots a layout thread keeps in registers (more are re-read)
constexpr int kWarpSize = 32;
#ifndef MOE_COMM_COPY_UNROLL
#define MOE_COMM_COPY_UNROLL 8       // 16-byte loads in flight per lane in warp row copies (benchmarks/NOTES.md)
#endif
constexpr int kCopyUnroll = MOE_COMM_COPY_UNROLL;
constexpr int kSendUnroll = 4;       // dispatch senders (each load feeds a store per destination)
constexpr int kReduceUnroll = 4;     // combine reducers (registers: an FP32 accumulator per loaded element)
#ifndef MOE_COMM_SEND_BATCH
#define MOE_COMM_SEND_BATCH 4        // tokens a dispatch sender warp writes before publishing their rows
#endif
constexpr int kSendBatch = MOE_COMM_SEND_BATCH;
#ifndef MOE_COMM_COMBINE_BATCH
#define MOE_COMM_COMBINE_BATCH 1     // rows a combine sender warp writes before publishing them (NOTES: 4 made the
#endif                               // reducers finish later, 378 vs 334 us at 24 SMs)
constexpr int kCombineBatch = MOE_COMM_COMBINE_BATCH;
constexpr int kMaxSignature = 16;
constexpr int kMaxTableSmem = 48 * 1024 - 256;  // count tables of dispatch receivers (moe_comm/backends/cuda.py)
constexpr int64_t kMaxDynamicSmem = 220 * 1024;   // dynamic shared memory of a dispatch block (sm_90 allows
                                                  // 227 KB per block, static shared memory included)
#ifndef MOE_COMM_RECV_STAGES
#define MOE_COMM_RECV_STAGES 2       // chunk buffers per copying receiver warp (loads in flight: stages - 1)
#endif
constexpr int kRecvStages = MOE_COMM_RECV_STAGES;
#ifndef MOE_COMM_RECV_CHUNK
#define MOE_COMM_RECV_CHUNK 8192     // bytes per bulk copy of a receiver (benchmarks/NOTES.md)
#endif
constexpr int64_t kRecvChunk = MOE_COMM_RECV_CHUNK;
constexpr int kMaxDevices = 64;     // devices one process may launch dispatches on
constexpr int64_t kBarrierBytes = 128;  // a copying warp's mbarriers (first half) and their stages' row-ok flags
                                        // (second half), padded so its buffers stay 128-aligned
static_assert(kRecvStages >= 2 && kRecvStages * 8 <= kBarrierBytes / 2, "receiver stages: 2 to 8");
constexpr int kMaxWarpsPerBlock = 16;  // dispatch_impl / combine_impl blocks: at most 512 threads
constexpr int64_t kTagMagic = 0x6d63;      // top 16 bits of a row tag (the other 48: the sequence number)
constexpr int kTagBytes = 16;        // the last 16 bytes of a dispatch region row: its tag (int64) and padding

// Profiling build (-DMOE_COMM_BLOCK_TIMES, scripts/profile_ops.py --variants times=1): the global timer at start
// and end of every block of the last dispatch_impl (kernel 0) and combine_impl (kernel 1).
#ifdef MOE_COMM_BLOCK_TIMES
constexpr int kMaxTimedBlocks = 1024;
__device__ uint64_t g_block_times[2][kMaxTimedBlocks][2];
#define BLOCK_TIME_START(kernel)                                                                \
    if (threadIdx.x == 0 && blockIdx.x < kMaxTimedBlocks) g_block_times[kernel][blockIdx.x][0] = global_timer_ns()
#define BLOCK_TIME_END(kernel)                                                                  \
    __syncthreads();                                                                            \
    if (threadIdx.x == 0 && blockIdx.x < kMaxTimedBlocks) g_block_times[kernel][blockIdx.x][1] = global_timer_ns()
#else
#define BLOCK_TIME_START(kernel)
#define BLOCK_TIME_END(kernel)
#endif

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
    ErrorRecord* error;           // host-mapped: what a timed-out wait reports
    uint64_t timeout_ns;
    int64_t seq_offset;           // this rank's barrier counter (names the operation in row tags)
    int32_t phase;                // reported on timeout
    int32_t num_send_blocks;      // dispatch_impl: blocks [0, n) send, the others receive
};

struct RecvPlan {
    int64_t table_bytes;  // count tables, padded to 128 bytes
    int64_t chunk;        // bytes per bulk copy (a multiple of 16)
    int64_t warp_bytes;   // per copying warp: mbarriers and kRecvStages chunk buffers
    int warps;            // copying warps per receiver block
    int64_t smem_bytes;   // dynamic shared memory of a dispatch_impl block
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

// Copy `bytes` (a multiple of 16) with the lanes of one warp. kViaL2: load through L2 only, for what peers
// wrote into our region.
template <bool kViaL2 = false>
__device__ __forceinline__ void warp_copy16(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane) {
    strided_copy16<kCopyUnroll, kViaL2 ? Load::kL2 : Load::kPlain>(reinterpret_cast<int4*>(dst),
                                                               reinterpret_cast<const int4*>(src), bytes / 16, lane,
                                                               kWarpSize);
}

template <bool kViaL2 = false>
__device__ __forceinline__ void warp_copy4(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane) {
    const int* s = reinterpret_cast<const int*>(src);
    int* d = reinterpret_cast<int*>(dst);
    for (int64_t i = lane; i < bytes / 4; i += kWarpSize) d[i] = kViaL2 ? __ldcg(s + i) : s[i];
}

__device__ __forceinline__ void warp_zero16(uint8_t* dst, int64_t bytes, int lane) {
    int4* d = reinterpret_cast<int4*>(dst);
    for (int64_t i = lane; i < bytes / 16; i += kWarpSize) d[i] = make_int4(0, 0, 0, 0);
}

// ------------------------------------------------------------------------------------------------------------
// Layout: one block per column (R destination ranks, then E experts). A column's block walks the tokens in order,
// one token per thread and pass, so positions are deterministic: send_pos[t, d] = tokens before t that go to
// rank d; expert_rank[t, j] = tokens before t that chose slot j's expert. Block 0 also writes the cleaned routing
// (invalid slots -> -1) and the error flags (1: out of range, 2: duplicate expert in a row).
// NOTES: a row is read into registers once (up to kMaxLayoutTopk slots): re-reading it from global memory inside
// the duplicate check, behind stores the compiler must assume may alias, made this kernel 10x slower.
// ------------------------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kLayoutThreads)
layout_impl(const int64_t* __restrict__ topk_idx, int64_t num_tokens, int num_topk, int num_experts,
            int num_ranks, int64_t* __restrict__ clean_idx, int64_t* __restrict__ send_pos,
            int32_t* __restrict__ expert_rank, int64_t* num_tokens_per_rank, int64_t* num_tokens_per_expert,
            int64_t* flags) {
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

// ------------------------------------------------------------------------------------------------------------
// Dispatch notify, one block of kMaxEpRanks threads (thread d talks to rank d): the barrier before the dispatch
// (nobody writes into a region or slot its owner still reads), this rank's control slot on every peer (signature,
// rows, per-expert counts, flags), the exchange (every peer's slot has arrived here), then copies of what arrived:
// the slots for the receivers of this and later cached dispatches, and a summary for the host when the call syncs.
// ------------------------------------------------------------------------------------------------------------
struct NotifyArgs {
    const int64_t* num_tokens_per_rank;    // [R] rows this rank sends to each rank
    const int64_t* num_tokens_per_expert;  // [E]
    const int64_t* flags;                  // [1] error flags of this rank's routing
    const int64_t* pending_flags;          // [R] flags of earlier no-sync dispatches (for the summary)
    int64_t* recv_slots;                   // [R][counts_stride] copy of the slots, or null
    int64_t* summary;                      // host-mapped, or null: [R][num_signature + 2] signature, rows, flags
                                           // per source; [R] pending flags; rows in all; [L] rows per local expert
    int64_t barrier_flags_offset;
    int64_t exchange_flags_offset;
    int64_t exchange_seq_offset;
    int32_t barrier_phase;
    int32_t exchange_phase;
};

__global__ void dispatch_notify_impl(EpParams p, NotifyArgs n) {
    const int R = p.num_ranks, L = p.num_local_experts, S = p.num_signature;
    signal_wait_block(p.peer_bases, p.local_base, p.error, n.barrier_flags_offset, p.seq_offset, p.timeout_ns,
                      p.rank, R, n.barrier_phase);
    const int d = threadIdx.x;
    if (d < R) {
        int64_t* slot = control_slot(p.peer_bases[d], p, p.rank);
        for (int i = 0; i < S; ++i) slot[i] = p.signature[i];
        int64_t* counts = slot + S;
        counts[0] = n.num_tokens_per_rank[d];
        for (int l = 0; l < L; ++l) counts[1 + l] = n.num_tokens_per_expert[d * L + l];
        counts[1 + L] = n.flags[0];
    }
    signal_wait_block(p.peer_bases, p.local_base, p.error, n.exchange_flags_offset, n.exchange_seq_offset,
                      p.timeout_ns, p.rank, R, n.exchange_phase);
    // Slots written by peers: volatile loads (not through L1).
    auto slot_value = [&](int s, int i) {
        return *reinterpret_cast<volatile const int64_t*>(control_slot(p.local_base, p, s) + i);
    };
    const int width = S + L + 2;
    if (n.recv_slots)
        for (int i = threadIdx.x; i < R * width; i += blockDim.x)
            n.recv_slots[(i / width) * p.counts_stride + i % width] = slot_value(i / width, i % width);
    if (n.summary) {
        int64_t* per_source = n.summary;
        for (int i = threadIdx.x; i < R * (S + 2); i += blockDim.x) {
            const int s = i / (S + 2), c = i % (S + 2);
            per_source[i] = slot_value(s, c <= S ? c : S + 1 + L);
        }
        int64_t* pending = per_source + R * (S + 2);
        int64_t* totals = pending + R;  // rows in all, then rows per local expert
        for (int s = threadIdx.x; s < R; s += blockDim.x) pending[s] = n.pending_flags[s];
        for (int i = threadIdx.x; i < 1 + L; i += blockDim.x) {
            int64_t rows = 0;
            for (int s = 0; s < R; ++s) rows += slot_value(s, S + i);
            totals[i] = rows;
        }
    }
}

// ------------------------------------------------------------------------------------------------------------
// Dispatch: one kernel, blocks [0, num_send_blocks) send and the others receive, at the same time.
// Send: one warp per token; the row is read once (16-byte loads, several in flight) and stored into the receive
// block of every destination rank with that rank's view of the metadata; then the warp's lane d publishes the
// row on rank d with a release store of the row tag (the warp barrier orders every lane's stores before it).
// Non-expand, the row for this rank goes straight to its output row instead, metadata included. Receive: each
// copying warp takes rows in turn; its lane 0 acquires a row's tag and moves the row through shared memory with
// bulk copies (TMA) into the output rows (non-expand or expand), the warp's lanes write the metadata. The rows
// received from each source come from the counts (the notify kernel's copy of the control slots, kept in the
// handle for cached dispatches).
// ------------------------------------------------------------------------------------------------------------
struct DispatchInputs {
    const uint8_t* x;            // [N, data_bytes]
    const uint8_t* scales;       // [N, scale_bytes] or null
    const int64_t* clean_idx;    // [N, K]
    const uint8_t* weights;      // [N, K * wb] or null
    const int64_t* send_pos;     // [N, R]
    const int32_t* expert_rank;  // [N, K]
};

struct RecvOutputs {
    const int64_t* counts;   // [R][counts_stride]: rows from source s, then its per-local-expert counts
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

__device__ __forceinline__ int64_t row_tag(const EpParams& p) {
    // The barrier before every operation advances this counter on all ranks alike, so it names the operation
    // (48 bits: no wrap in practice); the magic keeps a tag from matching left-over row data by chance.
    const int64_t seq = *reinterpret_cast<const int64_t*>(p.local_base + p.seq_offset);
    return (kTagMagic << 48) | (seq & 0xffffffffffffll);
}

__device__ __forceinline__ int64_t* row_tag_ptr(uint8_t* row, const EpParams& p) {
    return reinterpret_cast<int64_t*>(row + p.row_stride - kTagBytes);
}

// Loads of what peers wrote into our region go through L2 only (`__ldcg`): L1 is not coherent with them.
__device__ __forceinline__ int64_t ld_cg_i64(const int64_t* ptr) {
    return __ldcg(reinterpret_cast<const long long*>(ptr));
}
__device__ __forceinline__ int32_t ld_cg_i32(const int32_t* ptr) { return __ldcg(ptr); }
__device__ __forceinline__ uint8_t ld_cg_u8(const uint8_t* ptr) { return __ldcg(ptr); }

// Weight of slot `j` of a row into `dst` (wb = 4 or 8 bytes; nothing for 0): the token's weight when `keep`, else 0.
__device__ __forceinline__ void put_weight(uint8_t* dst, const uint8_t* weights, int64_t index, bool keep, int wb) {
    if (wb == 4)
        *reinterpret_cast<int32_t*>(dst) = keep ? reinterpret_cast<const int32_t*>(weights)[index] : 0;
    else if (wb == 8)
        *reinterpret_cast<int64_t*>(dst) = keep ? reinterpret_cast<const int64_t*>(weights)[index] : 0;
}

// Source of item k of a walk over the source ranks that leaves out `skip` (-1: none): item k is position
// k / num_sources of source index k % num_sources, so every source's rows are walked at the same pace.
__device__ __forceinline__ int walk_source(int64_t k, int num_sources, int skip) {
    const int q = static_cast<int>(k % num_sources);
    return skip >= 0 && q >= skip ? q + 1 : q;
}

// Output rows of this rank's own rows (non-expand): after the rows of every lower source rank, the same place the
// receivers would have put them.
__device__ __forceinline__ int64_t own_rows_start(const EpParams& p, const RecvOutputs& out, int lane) {
    int64_t start = lane < p.rank ? min(max(out.counts[lane * p.counts_stride], int64_t(0)), p.cap) : 0;
    for (int offset = kWarpSize / 2; offset; offset /= 2) start += __shfl_xor_sync(0xffffffffu, start, offset);
    return start;
}

__device__ void dispatch_send_rows(const EpParams& p, const DispatchInputs& in, const RecvOutputs& out,
                                   int64_t warp, int64_t num_warps, int lane) {
    const int L = p.num_local_experts, K = p.num_topk;
    const int64_t tag = row_tag(p);
    const int64_t block_base = static_cast<int64_t>(p.rank) * p.cap;
    // Non-expand: a token's row for this rank goes straight to its output row, with its metadata (no region, no
    // tag; the receivers skip our block). Expand: through the region like any other (a row has several outputs).
    const bool direct = !out.do_expand;
    const int64_t own_start = direct ? own_rows_start(p, out, lane) : 0;
    // Where row data for destination d goes, or null when an own row falls outside the outputs.
    auto data_dst = [&](int d, int64_t pos) -> uint8_t* {
        if (direct && d == p.rank) {
            const int64_t m = own_start + pos;
            return m < out.num_rows ? out.x + m * p.data_bytes : nullptr;
        }
        return p.peer_bases[d] + p.region_offset + (block_base + pos) * p.row_stride;
    };
    // A warp sends `batch` consecutive tokens, then publishes all their rows: one release fence per batch. Up to
    // kSendBatch, as long as every warp still gets a batch (a warp's tokens go one after another: a small call
    // spread over all warps finishes sooner).
    const int64_t batch = max(int64_t(1), min(int64_t(kSendBatch), p.num_tokens / num_warps));
    for (int64_t t0 = warp * batch; t0 < p.num_tokens; t0 += num_warps * batch) {
        const int64_t t_end = min(t0 + batch, p.num_tokens);
        for (int64_t t = t0; t < t_end; ++t) {
            const int64_t my_pos = lane < p.num_ranks ? in.send_pos[t * p.num_ranks + lane] : -1;
            const unsigned dest_mask = __ballot_sync(0xffffffffu, my_pos >= 0);

            // Data: 16-byte vectors, kSendUnroll loads in flight before the stores to every destination.
            const int4* src = reinterpret_cast<const int4*>(in.x + t * p.data_bytes);
            const int64_t num_vecs = p.data_bytes / 16;
            // NOTES: the loop bounds are warp-uniform, because the shuffle below needs every lane.
            for (int64_t v0 = 0; v0 < num_vecs; v0 += kSendUnroll * kWarpSize) {
                int4 values[kSendUnroll];
#pragma unroll
                for (int u = 0; u < kSendUnroll; ++u) {
                    const int64_t v = v0 + lane + u * kWarpSize;
                    if (v < num_vecs) values[u] = ld_nc_v4(src + v);
                }
                for (unsigned mask = dest_mask; mask; mask &= mask - 1) {
                    const int d = __ffs(mask) - 1;
                    int4* dst = reinterpret_cast<int4*>(data_dst(d, __shfl_sync(0xffffffffu, my_pos, d)));
                    if (dst == nullptr) continue;
#pragma unroll
                    for (int u = 0; u < kSendUnroll; ++u) {
                        const int64_t v = v0 + lane + u * kWarpSize;
                        if (v < num_vecs) dst[v] = values[u];
                    }
                }
            }
            // Scales (FP8) and metadata, per destination: the region row's, or the outputs of an own row.
            for (unsigned mask = dest_mask; mask; mask &= mask - 1) {
                const int d = __ffs(mask) - 1;
                const int64_t pos = __shfl_sync(0xffffffffu, my_pos, d);
                if (direct && d == p.rank) {
                    const int64_t m = own_start + pos;
                    if (m >= out.num_rows) continue;
                    if (out.scales)
                        warp_copy4(out.scales + m * p.scale_bytes, in.scales + t * p.scale_bytes, p.scale_bytes, lane);
                    if (out.src_idx && lane == 0) out.src_idx[m] = t;
                    for (int j = lane; j < K; j += kWarpSize) {
                        const int64_t e = in.clean_idx[t * K + j];
                        const bool local = e >= 0 && e / L == d;
                        if (out.topk_idx) out.topk_idx[m * K + j] = local ? e - static_cast<int64_t>(d) * L : -1;
                        if (out.weights)
                            put_weight(out.weights + (m * K + j) * p.weight_bytes, in.weights, t * K + j, local,
                                       p.weight_bytes);
                    }
                    continue;
                }
                uint8_t* row = data_dst(d, pos);
                if (p.scale_bytes) warp_copy4(row + p.data_bytes, in.scales + t * p.scale_bytes, p.scale_bytes, lane);
                uint8_t* meta = row + p.meta_offset;
                if (lane == 0) *reinterpret_cast<int64_t*>(meta) = t;
                int32_t* local_ids = reinterpret_cast<int32_t*>(meta + 8);
                int32_t* ranks = local_ids + K;
                uint8_t* w = meta + 8 + 8 * K;
                for (int j = lane; j < K; j += kWarpSize) {
                    const int64_t e = in.clean_idx[t * K + j];
                    const bool local = e >= 0 && e / L == d;
                    local_ids[j] = local ? static_cast<int32_t>(e - static_cast<int64_t>(d) * L) : -1;
                    ranks[j] = local ? in.expert_rank[t * K + j] : -1;
                    put_weight(w + j * p.weight_bytes, in.weights, t * K + j, local, p.weight_bytes);
                }
            }
        }
        // Publish: every lane's stores above happen before the releases of the batch's row tags (one lane per row
        // and destination; own rows written directly have none).
        __syncwarp();
        for (int64_t q = lane; q < (t_end - t0) * p.num_ranks; q += kWarpSize) {
            const int64_t t = t0 + q / p.num_ranks;
            const int d = static_cast<int>(q % p.num_ranks);
            const int64_t pos = in.send_pos[t * p.num_ranks + d];
            if (pos >= 0 && !(direct && d == p.rank))
                st_release_sys(row_tag_ptr(data_dst(d, pos), p), tag);
        }
    }
}

// Receiver blocks: shared memory holds the count tables, then, per copying warp, kRecvStages chunk buffers and
// their mbarriers. A chunk is at most kRecvChunk bytes of a row's data; as many warps copy as fit.
__host__ __device__ inline RecvPlan recv_plan(const EpParams& p, int warps_per_block) {
    RecvPlan plan;
    const int64_t R = p.num_ranks, L = p.num_local_experts;
    plan.table_bytes = (8 * (2 * R + 3 * L + R * L) + 127) / 128 * 128;
    plan.chunk = p.data_bytes < kRecvChunk ? p.data_bytes : kRecvChunk;
    plan.warp_bytes = kBarrierBytes + kRecvStages * plan.chunk;
    const int64_t fit = (kMaxDynamicSmem - plan.table_bytes) / plan.warp_bytes;
    plan.warps = static_cast<int>(fit < warps_per_block ? fit : warps_per_block);
    plan.smem_bytes = plan.table_bytes + plan.warps * plan.warp_bytes;
    return plan;
}

// Expand row of slot j of received row `row` from source s: its expert's run for that source plus the token's rank
// in it, or -1 when the slot is not one of our experts or the row falls outside the outputs.
__device__ __forceinline__ int64_t expand_row_of(const EpParams& p, const RecvOutputs& out, const int64_t* run_base,
                                                 const uint8_t* row, int s, int j) {
    const int32_t* local_ids = reinterpret_cast<const int32_t*>(row + p.meta_offset + 8);
    const int32_t l = ld_cg_i32(local_ids + j);
    if (l < 0 || l >= p.num_local_experts) return -1;
    const int64_t r = run_base[s * p.num_local_experts + l] + ld_cg_i32(local_ids + p.num_topk + j);
    return r >= 0 && r < out.num_expand_rows ? r : -1;
}

// Metadata of received row g (from source s, output row m): routing outputs, weights (non-expand) and FP8 scales;
// `ok` false (its tag timed out): routing that sends nothing back. Returns nothing; the data goes by bulk copies.
__device__ __forceinline__ void recv_row_meta(const EpParams& p, const RecvOutputs& out, const int64_t* run_base,
                                              const uint8_t* row, int s, int64_t m, bool ok, int lane) {
    const int K = p.num_topk;
    const int64_t wb = p.weight_bytes;
    if (!ok) {
        for (int j = lane; j < K; j += kWarpSize) {
            if (out.topk_idx) out.topk_idx[m * K + j] = -1;
            if (out.expand_row) out.expand_row[m * K + j] = -1;
        }
        return;
    }
    const uint8_t* meta = row + p.meta_offset;
    const int32_t* local_ids = reinterpret_cast<const int32_t*>(meta + 8);
    const uint8_t* w = meta + 8 + 8 * K;
    if (out.src_idx && lane == 0) out.src_idx[m] = ld_cg_i64(reinterpret_cast<const int64_t*>(meta));
    for (int j = lane; j < K; j += kWarpSize) {
        const int64_t r = expand_row_of(p, out, run_base, row, s, j);
        const bool r_ok = r >= 0;
        if (out.topk_idx) out.topk_idx[m * K + j] = ld_cg_i32(local_ids + j);
        if (out.expand_row) out.expand_row[m * K + j] = r_ok ? static_cast<int32_t>(r) : -1;
        if (out.weights && !out.do_expand)
            for (int64_t b = 0; b < wb; ++b) out.weights[(m * K + j) * wb + b] = ld_cg_u8(w + j * wb + b);
        if (out.do_expand && r_ok) {
            if (out.weights)
                for (int64_t b = 0; b < wb; ++b) out.weights[r * wb + b] = ld_cg_u8(w + j * wb + b);
            if (out.scales)
                for (int64_t b = 0; b < p.scale_bytes / 4; ++b)
                    reinterpret_cast<int32_t*>(out.scales + r * p.scale_bytes)[b] =
                        ld_cg_i32(reinterpret_cast<const int32_t*>(row + p.data_bytes) + b);
        }
    }
    if (!out.do_expand && out.scales)
        warp_copy4<true>(out.scales + m * p.scale_bytes, row + p.data_bytes, p.scale_bytes, lane);
}

__device__ void dispatch_recv_rows(const EpParams& p, const RecvOutputs& out, const RecvPlan& plan, int lane,
                                   uint8_t* smem) {
    const int R = p.num_ranks, L = p.num_local_experts, K = p.num_topk;
    // Tables: rows_from[R], rank_start[R], expert_start[L], expert_count[L], aligned[L], run_base[R * L]
    int64_t* rows_from = reinterpret_cast<int64_t*>(smem);
    int64_t* rank_start = rows_from + R;
    int64_t* expert_start = rank_start + R;
    int64_t* expert_count = expert_start + L;
    int64_t* aligned = expert_count + L;
    int64_t* run_base = aligned + L;
    __shared__ int timed_out;  // a wait of this block timed out: later rows are skipped, not waited for
    const int64_t* counts = out.counts;
    const int64_t stride = p.counts_stride;
    const bool first_block = blockIdx.x == p.num_send_blocks;

    // NOTES: counts come from peers; clamping keeps a disagreeing or timed-out peer from pushing writes past
    // the block or the outputs (its rows are then wrong, and the host raises for the timeout).
    if (threadIdx.x == 0) timed_out = 0;
    for (int s = threadIdx.x; s < R; s += blockDim.x)
        rows_from[s] = min(max(counts[s * stride], int64_t(0)), p.cap);
    for (int l = threadIdx.x; l < L; l += blockDim.x) {
        int64_t c = 0;
        for (int s = 0; s < R; ++s) c += counts[s * stride + 1 + l];
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
            if (first_block && out.psum_rank) out.psum_rank[s] = acc;
        }
        acc = 0;
        for (int l = 0; l < L; ++l) {
            expert_start[l] = acc;
            acc += aligned[l];
            if (first_block && out.psum_expert) out.psum_expert[l] = acc;
        }
    }
    __syncthreads();
    if (out.do_expand) {
        for (int l = threadIdx.x; l < L; l += blockDim.x) {
            int64_t acc = expert_start[l];
            for (int s = 0; s < R; ++s) {
                run_base[s * L + l] = acc;
                acc += counts[s * stride + 1 + l];
            }
        }
        __syncthreads();
    }

    const int warp_in_block = threadIdx.x / kWarpSize;
    const int64_t recv_block = blockIdx.x - p.num_send_blocks, num_recv_blocks = gridDim.x - p.num_send_blocks;
    if (warp_in_block < plan.warps) {
        // Copying warp: rows in the order they arrive (position i from every source before position i + 1: every
        // source sends in position order at the same time). Lane 0 drives the bulk copies, kRecvStages - 1 chunks
        // ahead: it acquires a row's tag before loading its first chunk and loads the chunks ahead into the other
        // buffers while the current chunk is stored to the output row(s); the lanes write each row's metadata.
        // NOTES: walking the blocks source by source left the receivers waiting on source 0 while source 1's
        // rows piled up; one warp copying one row at a time with registers was latency bound (~9 dependent
        // round trips per 14 KB row).
        uint8_t* area = smem + plan.table_bytes + warp_in_block * plan.warp_bytes;
        uint64_t* bars = reinterpret_cast<uint64_t*>(area);                    // one mbarrier per buffer
        int* stage_ok = reinterpret_cast<int*>(area + kBarrierBytes / 2);      // its chunk's row tag arrived
        uint8_t* stages = area + kBarrierBytes;
        if (lane == 0)
            for (int b = 0; b < kRecvStages; ++b) mbarrier_init(bars + b);
        __syncwarp();
        const int64_t warp = recv_block * plan.warps + warp_in_block, num_warps = num_recv_blocks * plan.warps;
        // Non-expand: our own rows were written to the outputs by our senders; only the peers' blocks are read.
        const bool direct = !out.do_expand;
        const int num_sources = direct ? R - 1 : R;
        auto source_of = [&](int64_t k) { return walk_source(k, num_sources, direct ? p.rank : -1); };
        int64_t max_rows = 0;
        for (int s = 0; s < R; ++s)
            if (!(direct && s == p.rank)) max_rows = max(max_rows, rows_from[s]);
        const int64_t total = num_sources * max_rows;
        const int64_t num_chunks = (p.data_bytes + plan.chunk - 1) / plan.chunk;
        const int64_t tag = row_tag(p);
        auto next_row = [&](int64_t k) {  // this warp's first row >= k that exists
            for (; k < total; k += num_warps) {
                const int s = source_of(k);
                if (k / num_sources < rows_from[s] && rank_start[s] + k / num_sources < out.num_rows) return k;
            }
            return total;
        };
        auto advance = [&](int64_t& k, int64_t& c) {  // the next chunk of this warp: (row k, chunk c)
            if (++c == num_chunks) {
                c = 0;
                k = next_row(k + num_warps);
            }
        };
        auto row_ptr = [&](int64_t k) {
            return p.local_base + p.region_offset + (source_of(k) * p.cap + k / num_sources) * p.row_stride;
        };
        auto chunk_bytes = [&](int64_t c) {
            return static_cast<uint32_t>(min(plan.chunk, p.data_bytes - c * plan.chunk));
        };
        // Lane 0 loads chunk i of the warp's walk, at (row load_k, chunk load_c), into buffer i % kRecvStages,
        // waiting for the row's tag first if it is the row's first chunk.
        int64_t load_k = next_row(warp), load_c = 0, loaded = 0;
        bool load_ok = true;
        auto issue = [&]() {
            if (load_c == 0) {
                load_ok = !*reinterpret_cast<volatile int*>(&timed_out) &&
                          wait_flag_equal(row_tag_ptr(row_ptr(load_k), p), tag, p.timeout_ns, p.error, p.rank,
                                          p.phase, source_of(load_k));
                if (!load_ok) timed_out = 1;
                fence_proxy_async();  // the acquire above before the bulk load's reads
            }
            const int b = static_cast<int>(loaded % kRecvStages);
            stage_ok[b] = load_ok;
            bulk_wait_read();  // the buffer's previous chunk (the last one stored) has been read by its stores
            bulk_load(stages + b * plan.chunk, row_ptr(load_k) + load_c * plan.chunk, chunk_bytes(load_c), bars + b);
            advance(load_k, load_c);
            ++loaded;
        };
        if (lane == 0)
            while (loaded < kRecvStages - 1 && load_k < total) issue();
        int64_t k = next_row(warp), c = 0;
        for (int64_t it = 0; k < total; ++it) {
            __syncwarp();  // every lane is done with the buffer that the next load refills
            if (lane == 0 && load_k < total) issue();
            __syncwarp();  // lane 0's acquire and stage_ok before every lane's reads
            const int b = static_cast<int>(it % kRecvStages);
            const bool row_ok = stage_ok[b];
            const int s = source_of(k);
            const int64_t m = rank_start[s] + k / num_sources;
            const uint8_t* row = row_ptr(k);
            if (c == 0) recv_row_meta(p, out, run_base, row, s, m, row_ok, lane);
            mbarrier_wait(bars + b, static_cast<uint32_t>((it / kRecvStages) & 1));
            if (row_ok) {
                const int64_t offset = c * plan.chunk;
                if (!out.do_expand) {
                    if (lane == 0)
                        bulk_store(out.x + m * p.data_bytes + offset, stages + b * plan.chunk, chunk_bytes(c));
                } else {
                    // Slot j's expand row, from lane j % 32; lane 0 stores the chunk to each.
                    for (int j0 = 0; j0 < K; j0 += kWarpSize) {
                        const int j = j0 + lane;
                        const int64_t r = j < K ? expand_row_of(p, out, run_base, row, s, j) : -1;
                        for (unsigned mask = __ballot_sync(0xffffffffu, r >= 0); mask; mask &= mask - 1) {
                            const int64_t dst = __shfl_sync(0xffffffffu, r, __ffs(mask) - 1);
                            if (lane == 0)
                                bulk_store(out.x + dst * p.data_bytes + offset, stages + b * plan.chunk,
                                           chunk_bytes(c));
                        }
                    }
                }
            }
            if (lane == 0) bulk_commit();
            advance(k, c);
        }
        if (lane == 0) bulk_wait();  // the stores read shared memory until they complete
    }
    // Expand padding rows are zero (data, scales, weight).
    if (out.do_expand) {
        const int warps_per_block = blockDim.x / kWarpSize;
        for (int64_t l = recv_block * warps_per_block + warp_in_block; l < L; l += num_recv_blocks * warps_per_block) {
            const int64_t end = min(expert_start[l] + aligned[l], out.num_expand_rows);
            for (int64_t r = expert_start[l] + expert_count[l]; r < end; ++r) {
                warp_zero16(out.x + r * p.data_bytes, p.data_bytes, lane);
                if (out.scales)
                    for (int64_t b = lane; b < p.scale_bytes / 4; b += kWarpSize)
                        reinterpret_cast<int32_t*>(out.scales + r * p.scale_bytes)[b] = 0;
                if (out.weights && lane < p.weight_bytes) out.weights[r * p.weight_bytes + lane] = 0;
            }
        }
    }
}

__global__ void __launch_bounds__(kMaxWarpsPerBlock * kWarpSize) dispatch_impl(EpParams p, DispatchInputs in,
                                                                                RecvOutputs out) {
    extern __shared__ __align__(128) uint8_t dyn_smem[];
    BLOCK_TIME_START(0);
    const int lane = threadIdx.x % kWarpSize;
    const int warps_per_block = blockDim.x / kWarpSize;
    if (static_cast<int>(blockIdx.x) < p.num_send_blocks) {
        const int64_t warp = static_cast<int64_t>(blockIdx.x) * warps_per_block + threadIdx.x / kWarpSize;
        dispatch_send_rows(p, in, out, warp, static_cast<int64_t>(p.num_send_blocks) * warps_per_block, lane);
    } else {
        dispatch_recv_rows(p, out, recv_plan(p, warps_per_block), lane, dyn_smem);
    }
    BLOCK_TIME_END(0);
}

// ------------------------------------------------------------------------------------------------------------
// Combine: one kernel, blocks [0, num_send_blocks) send and the others reduce, at the same time.
// Send: row m of the dispatch output goes back to its source rank s (another rank: our own rows stay here), into
// block `rank` at the row it came from (expand: one row per (token, slot) of this round, at sub-row
// slot - slot_begin); a warp writes the rows of kCombineBatch items, then its lanes release their tags.
// Reduce, one warp per token of this rank: the lanes find the token's rows in the documented order (ascending
// rank, or ascending slot in expand mode), each acquires its row's tag (rows from this rank itself are read from
// x and have none), then the warp adds them in that order in Acc precision from zero (or the accumulator of
// earlier rounds); after the last round bias[0], then bias[1], and the cast. combined_topk_weights is the select
// of slot j's value on its owner rank.
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

struct CombineArgs {
    // Send side (the dispatch outputs of this rank).
    const uint8_t* x;             // [M or P, data_bytes]
    const uint8_t* weights;       // non-expand [M, K * wb], expand [P * wb], or null
    const int64_t* psum_rank;     // [R] inclusive rows received from each source
    const int32_t* expand_row;    // [M, K] or null (non-expand)
    // Reduce side (this rank's tokens).
    const int64_t* send_pos;      // [N, R]
    const int64_t* clean_idx;     // [N, K]
    void* acc;                    // [N, H] Acc between rounds, or null (single round)
    const void* bias0;            // [N, H] T or null
    const void* bias1;
    void* out;                    // [N, H] T
    uint8_t* out_weights;         // [N, K * wb] or null
    int64_t hidden;
    int64_t num_x_rows;           // rows of x (a row index from the handle past it is never followed)
    int32_t do_expand;
    int32_t slot_begin;
    int32_t slot_end;
    int32_t num_slots;            // sub-rows per token in the region this round
    int32_t first_round;
    int32_t last_round;
};

__device__ void combine_send_rows(const EpParams& p, const CombineArgs& a, int64_t warp, int64_t num_warps,
                                  int lane) {
    const int R = p.num_ranks, K = p.num_topk;
    const int64_t wb = p.weight_bytes;
    const int64_t tag = row_tag(p);
    const int64_t slots = a.do_expand ? a.num_slots : 1;  // region rows per dispatch output row
    // Rows interleaved across sources (row i to every source before row i + 1), so that every link carries
    // traffic all the time and every source's reducers can start at once. Rows from this rank itself stay: its
    // reducers read them from x.
    // NOTES: going source by source sent everything to rank 0 first, then to rank 1: half the links idle.
    const int num_sources = R - 1;
    int64_t max_rows = 0;
    for (int s = 0; s < R; ++s)
        if (s != p.rank) max_rows = max(max_rows, a.psum_rank[s] - (s ? a.psum_rank[s - 1] : 0));
    const int64_t total = num_sources * max_rows;
    // Item k is row k / num_sources received from the walk's source; sub-row q is slot slot_begin + q (expand).
    // The region row it goes to on that source and the x row it comes from, or false when there is none.
    auto locate = [&](int64_t k, int64_t q, uint8_t** dst, int64_t* x_row) {
        if (k >= total) return false;
        const int s = walk_source(k, num_sources, p.rank);
        const int64_t i = k / num_sources;
        const int64_t first = s ? a.psum_rank[s - 1] : 0;
        if (i >= a.psum_rank[s] - first || a.slot_begin + q >= a.slot_end) return false;
        const int64_t m = first + i;
        *x_row = a.do_expand ? a.expand_row[m * K + a.slot_begin + q] : m;
        if (*x_row < 0 || *x_row >= a.num_x_rows) return false;
        *dst = p.peer_bases[s] + p.region_offset +
               ((static_cast<int64_t>(p.rank) * p.cap + i) * slots + q) * p.row_stride;
        return true;
    };
    // A warp sends the rows of kCombineBatch consecutive items, then publishes them all: one release fence per batch.
    for (int64_t k0 = warp * kCombineBatch; k0 < total; k0 += num_warps * kCombineBatch) {
        for (int64_t n = 0; n < kCombineBatch * slots; ++n) {
            uint8_t* dst;
            int64_t r;
            if (!locate(k0 + n / slots, n % slots, &dst, &r)) continue;
            warp_copy16(dst, a.x + r * p.data_bytes, p.data_bytes, lane);
            if (a.weights && !a.do_expand)
                for (int64_t b = lane; b < K * wb; b += kWarpSize) dst[p.meta_offset + b] = a.weights[r * K * wb + b];
            if (a.weights && a.do_expand && lane < wb) dst[p.meta_offset + lane] = a.weights[r * wb + lane];
        }
        __syncwarp();  // every lane's stores above happen before the releases below
        for (int64_t n = lane; n < kCombineBatch * slots; n += kWarpSize) {
            uint8_t* dst;
            int64_t r;
            if (locate(k0 + n / slots, n % slots, &dst, &r)) st_release_sys(row_tag_ptr(dst, p), tag);
        }
    }
}

template <typename T>
__device__ void combine_reduce_rows(const EpParams& p, const CombineArgs& a, int64_t warp, int64_t num_warps,
                                    int lane, const uint8_t** rows) {
    using Acc = typename AccOf<T>::type;
    constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte vector
    const int R = p.num_ranks, K = p.num_topk, L = p.num_local_experts;
    uint8_t* region = p.local_base + p.region_offset;
    const int64_t H = a.hidden, wb = p.weight_bytes, num_vecs = a.hidden / kVec;
    const int64_t tag = row_tag(p);
    __shared__ int timed_out;  // a wait of this block timed out: later rows are not waited for
    if (threadIdx.x == 0) timed_out = 0;
    __syncthreads();
    const int64_t own_first = p.rank ? a.psum_rank[p.rank - 1] : 0;  // x rows of the rows we sent ourselves
    // The x row of (our own token row at `pos`, slot j), or -1 when it has none.
    auto own_x_row = [&](int64_t pos, int j) -> int64_t {
        const int64_t x_row = a.do_expand ? a.expand_row[(own_first + pos) * K + j] : own_first + pos;
        return x_row >= 0 && x_row < a.num_x_rows ? x_row : -1;
    };
    for (int64_t t = warp; t < p.num_tokens; t += num_warps) {
        const int64_t* pos = a.send_pos + t * R;
        const int64_t* experts = a.clean_idx + t * K;
        // Lane r owns one candidate row (rank r, or slot slot_begin + r); the rows that exist, in lane order,
        // are the documented order. A peer's row is in the region behind its tag; our own is a row of x.
        const uint8_t* row = nullptr;
        uint8_t* region_row = nullptr;
        int peer = -1;
        if (!a.do_expand) {
            if (lane < R && pos[lane] >= 0) peer = lane;
        } else {
            const int j = a.slot_begin + lane;
            if (j < a.slot_end && experts[j] >= 0) peer = static_cast<int>(experts[j] / L);
        }
        if (peer == p.rank) {
            const int64_t x_row = own_x_row(pos[peer], a.slot_begin + lane);
            row = x_row >= 0 ? a.x + x_row * p.data_bytes : nullptr;
        } else if (peer >= 0) {
            const int64_t block_row = static_cast<int64_t>(peer) * p.cap + pos[peer];
            region_row = region + (a.do_expand ? block_row * a.num_slots + lane : block_row) * p.row_stride;
            row = region_row;
        }
        const unsigned present = __ballot_sync(0xffffffffu, row != nullptr);
        const int num_rows = __popc(present);
        if (row != nullptr) rows[__popc(present & ((1u << lane) - 1))] = row;
        if (region_row != nullptr && !*reinterpret_cast<volatile int*>(&timed_out) &&
            !wait_flag_equal(row_tag_ptr(region_row, p), tag, p.timeout_ns, p.error, p.rank, p.phase, peer))
            timed_out = 1;
        __syncwarp();
        for (int64_t v0 = 0; v0 < num_vecs; v0 += kReduceUnroll * kWarpSize) {
            Acc acc[kReduceUnroll][kVec];
#pragma unroll
            for (int u = 0; u < kReduceUnroll; ++u) {
                const int64_t v = v0 + lane + u * kWarpSize;
#pragma unroll
                for (int k = 0; k < kVec; ++k)
                    acc[u][k] = a.first_round || v >= num_vecs ? Acc(0)
                                                               : static_cast<const Acc*>(a.acc)[t * H + v * kVec + k];
            }
            for (int r = 0; r < num_rows; ++r) {
                const int4* src = reinterpret_cast<const int4*>(rows[r]);
                int4 raw[kReduceUnroll];
#pragma unroll
                for (int u = 0; u < kReduceUnroll; ++u) {
                    const int64_t v = v0 + lane + u * kWarpSize;
                    if (v < num_vecs) raw[u] = __ldcg(src + v);
                }
#pragma unroll
                for (int u = 0; u < kReduceUnroll; ++u) {
                    const T* values = reinterpret_cast<const T*>(&raw[u]);
#pragma unroll
                    for (int k = 0; k < kVec; ++k) acc[u][k] += to_acc<T>(values[k]);
                }
            }
#pragma unroll
            for (int u = 0; u < kReduceUnroll; ++u) {
                const int64_t v = v0 + lane + u * kWarpSize;
                if (v >= num_vecs) continue;
                const int64_t first = t * H + v * kVec;
                if (!a.last_round) {
#pragma unroll
                    for (int k = 0; k < kVec; ++k) static_cast<Acc*>(a.acc)[first + k] = acc[u][k];
                    continue;
                }
                for (const void* bias : {a.bias0, a.bias1}) {
                    if (bias == nullptr) continue;
                    const int4 raw = reinterpret_cast<const int4*>(static_cast<const T*>(bias) + first)[0];
                    const T* values = reinterpret_cast<const T*>(&raw);
#pragma unroll
                    for (int k = 0; k < kVec; ++k) acc[u][k] += to_acc<T>(values[k]);
                }
                int4 packed;
                T* out_values = reinterpret_cast<T*>(&packed);
#pragma unroll
                for (int k = 0; k < kVec; ++k) out_values[k] = from_acc<T>(acc[u][k]);
                reinterpret_cast<int4*>(static_cast<T*>(a.out) + first)[0] = packed;
            }
        }
        if (a.out_weights) {
            for (int j = lane; j < K; j += kWarpSize) {
                if (a.do_expand && (j < a.slot_begin || j >= a.slot_end)) continue;
                uint8_t* dst = a.out_weights + (t * K + j) * wb;
                if (experts[j] < 0) {
                    for (int64_t b = 0; b < wb; ++b) dst[b] = 0;
                    continue;
                }
                const int d = static_cast<int>(experts[j] / L);
                const int64_t block_row = static_cast<int64_t>(d) * p.cap + pos[d];
                const int64_t x_row = d == p.rank ? own_x_row(pos[d], j) : 0;
                const uint8_t* src =
                    d == p.rank ? (a.do_expand ? a.weights + x_row * wb : a.weights + (x_row * K + j) * wb)
                    : a.do_expand
                        ? region + (block_row * a.num_slots + (j - a.slot_begin)) * p.row_stride + p.meta_offset
                        : region + block_row * p.row_stride + p.meta_offset + j * wb;
                for (int64_t b = 0; b < wb; ++b) dst[b] = x_row < 0 ? 0 : ld_cg_u8(src + b);
            }
        }
        __syncwarp();  // rows[] is rebuilt for the next token
    }
}

template <typename T>
__global__ void __launch_bounds__(kMaxWarpsPerBlock * kWarpSize) combine_impl(EpParams p, CombineArgs a) {
    __shared__ const uint8_t* rows[kMaxWarpsPerBlock][kWarpSize];
    const int lane = threadIdx.x % kWarpSize, warp_in_block = threadIdx.x / kWarpSize;
    const int warps_per_block = blockDim.x / kWarpSize;
    BLOCK_TIME_START(1);
    if (static_cast<int>(blockIdx.x) < p.num_send_blocks) {
        const int64_t warp = static_cast<int64_t>(blockIdx.x) * warps_per_block + warp_in_block;
        combine_send_rows(p, a, warp, static_cast<int64_t>(p.num_send_blocks) * warps_per_block, lane);
    } else {
        const int64_t warp = static_cast<int64_t>(blockIdx.x - p.num_send_blocks) * warps_per_block + warp_in_block;
        const int64_t num_warps = static_cast<int64_t>(gridDim.x - p.num_send_blocks) * warps_per_block;
        combine_reduce_rows<T>(p, a, warp, num_warps, lane, rows[warp_in_block]);
    }
    BLOCK_TIME_END(1);
}

}  // namespace moe_comm

using moe_comm::DispatchInputs;
using moe_comm::EpParams;
using moe_comm::NotifyArgs;
using moe_comm::CombineArgs;
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

int moe_comm_dispatch_notify(const EpParams* p, const NotifyArgs* n, cudaStream_t stream) {
    if (p->num_ranks > moe_comm::kMaxEpRanks || p->num_signature > moe_comm::kMaxSignature)
        return static_cast<int>(cudaErrorInvalidValue);
    moe_comm::dispatch_notify_impl<<<1, moe_comm::kMaxEpRanks, 0, stream>>>(*p, *n);
    return static_cast<int>(cudaGetLastError());
}

// num_blocks: p->num_send_blocks senders, then the receivers (at least one of each).
int moe_comm_dispatch(const EpParams* p, const DispatchInputs* in, const RecvOutputs* out, int num_blocks,
                      int num_threads, cudaStream_t stream) {
    const moe_comm::RecvPlan plan = moe_comm::recv_plan(*p, num_threads / moe_comm::kWarpSize);
    if (p->num_ranks > moe_comm::kMaxEpRanks || p->data_bytes <= 0 || p->data_bytes % 16 || p->scale_bytes % 4 ||
        p->row_stride % 16 || p->num_send_blocks < 1 || p->num_send_blocks >= num_blocks ||
        plan.table_bytes > moe_comm::kMaxTableSmem || plan.warps < 1 || num_threads % moe_comm::kWarpSize ||
        num_threads > moe_comm::kMaxWarpsPerBlock * moe_comm::kWarpSize)
        return static_cast<int>(cudaErrorInvalidValue);
    // The opt-in to more than 48 KB of shared memory is a per-device setting of the function: once per device.
    static bool opted_in[moe_comm::kMaxDevices] = {};
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess && (device < 0 || device >= moe_comm::kMaxDevices)) err = cudaErrorInvalidDevice;
    if (err == cudaSuccess && !opted_in[device]) {
        err = cudaFuncSetAttribute(moe_comm::dispatch_impl, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   moe_comm::kMaxDynamicSmem);
        opted_in[device] = err == cudaSuccess;
    }
    if (err != cudaSuccess) {
        cudaGetLastError();  // not sticky: later launches must not report it again
        return static_cast<int>(err);
    }
    moe_comm::dispatch_impl<<<num_blocks, num_threads, plan.smem_bytes, stream>>>(*p, *in, *out);
    return static_cast<int>(cudaGetLastError());
}

// dtype: 1 bf16, 2 float32, 3 float64 (accumulating in float32, float32, float64).
// num_blocks: p->num_send_blocks senders, then the reducers (at least one of each).
int moe_comm_combine(const EpParams* p, const CombineArgs* a, int dtype, int num_blocks, int num_threads,
                     cudaStream_t stream) {
    if (p->num_ranks > moe_comm::kWarpSize || a->slot_end - a->slot_begin > moe_comm::kWarpSize ||
        num_threads > moe_comm::kMaxWarpsPerBlock * moe_comm::kWarpSize || p->num_send_blocks < 1 ||
        p->num_send_blocks >= num_blocks || p->data_bytes % 16 || p->row_stride % 16)
        return static_cast<int>(cudaErrorInvalidValue);
    switch (dtype) {
        case 1: moe_comm::combine_impl<__nv_bfloat16><<<num_blocks, num_threads, 0, stream>>>(*p, *a); break;
        case 2: moe_comm::combine_impl<float><<<num_blocks, num_threads, 0, stream>>>(*p, *a); break;
        case 3: moe_comm::combine_impl<double><<<num_blocks, num_threads, 0, stream>>>(*p, *a); break;
        default: return static_cast<int>(cudaErrorInvalidValue);
    }
    return static_cast<int>(cudaGetLastError());
}

#ifdef MOE_COMM_BLOCK_TIMES
// Copy the block times of the last dispatch (kernel 0) or combine (kernel 1): [num_blocks][start, end] ns.
int moe_comm_block_times(int kernel, uint64_t* host, int num_blocks) {
    if (kernel < 0 || kernel > 1 || num_blocks < 0 || num_blocks > moe_comm::kMaxTimedBlocks)
        return static_cast<int>(cudaErrorInvalidValue);
    return static_cast<int>(cudaMemcpyFromSymbol(host, moe_comm::g_block_times, sizeof(uint64_t) * 2 * num_blocks,
                                                 sizeof(uint64_t) * 2 * moe_comm::kMaxTimedBlocks * kernel));
}
#endif

int moe_comm_sizeof_ep_structs(int which) {
    switch (which) {
        case 0: return static_cast<int>(sizeof(EpParams));
        case 1: return static_cast<int>(sizeof(RecvOutputs));
        case 2: return static_cast<int>(sizeof(CombineArgs));
        case 3: return static_cast<int>(sizeof(DispatchInputs));
        case 4: return static_cast<int>(sizeof(NotifyArgs));
        default: return -1;
    }
}

}  // extern "C"
