// Combine: every token's rows back to its source rank, summed there in FP32/FP64 in DESIGN 2.2's order; senders
// and reducers of one kernel running at the same time. Device code only (launched by kernels/combine.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "moe_comm/abi.h"
#include "moe_comm/common/comm.cuh"
#include "moe_comm/common/copy.cuh"
#include "moe_comm/common/rows.cuh"
#include "moe_comm/common/tuning.cuh"

namespace moe_comm {

// ------------------------------------------------------------------------------------------------------------
// Combine: one kernel, blocks [0, num_send_blocks) send and the others reduce, at the same time.
// Send: row m of the dispatch output goes back to its source rank s (another rank: our own rows stay here), into
// our block of s's region (`combine_block`) at the row it came from (expand: one row per (token, slot) of this
// round, at sub-row slot - slot_begin); a warp writes the rows of kCombineBatch items, then its lanes release
// their tags.
// Reduce, one warp per token of this rank: the lanes find the token's rows in the documented order (ascending
// rank, or ascending slot in expand mode), each acquires its row's tag (rows from this rank itself are read from
// x and have none), then the warp adds them in that order in Acc precision from zero (or the accumulator of
// earlier rounds); after the last round bias[0], then bias[1], and the cast. combined_topk_weights is the select
// of slot j's value on its owner rank. Unreduced (`terms` set, the hybrid path's deterministic combine): each row is
// copied to its term's place (expand: its slot; else its rank) instead, no sum, no bias.
// Partial sums (`partial`, expand, one round): a sender adds the rows of an item's slots here (ascending slot, from
// zero, in Acc precision) and sends that one row, with the weights of its slots at their places among the K, or the
// row itself when the item has one slot here; a reducer adds, per rank in ascending order, that rank's row (its own
// rank's: its slots' rows from x added from zero first).
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

// 16-byte vectors of T as Acc values: kVec = 16 / sizeof(T) values, kAccVecs 16-byte vectors of Acc.
template <typename T>
struct AccVec {
    using Acc = typename AccOf<T>::type;
    static constexpr int kVec = 16 / sizeof(T);
    static constexpr int kAccVecs = kVec * sizeof(Acc) / 16;
    static constexpr int kPerAccVec = 16 / sizeof(Acc);
};

// acc[u] += the values of vector v0 + lane + u * 32 of a row of T (vectors past num_vecs are left alone).
template <typename T>
__device__ __forceinline__ void add_row(typename AccOf<T>::type (&acc)[kReduceUnroll][AccVec<T>::kVec],
                                        const int4* src, int64_t v0, int64_t num_vecs, int lane) {
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
        for (int k = 0; k < AccVec<T>::kVec; ++k) acc[u][k] += to_acc<T>(values[k]);
    }
}

// The same for a row of Acc values (a partial sum): vector v is kAccVecs 16-byte vectors from src + v * kAccVecs.
template <typename T>
__device__ __forceinline__ void add_acc_row(typename AccOf<T>::type (&acc)[kReduceUnroll][AccVec<T>::kVec],
                                            const int4* src, int64_t v0, int64_t num_vecs, int lane) {
    using V = AccVec<T>;
#pragma unroll
    for (int u = 0; u < kReduceUnroll; ++u) {  // one vector at a time: all of them in flight would spill
        const int64_t v = v0 + lane + u * kWarpSize;
        if (v >= num_vecs) continue;
        int4 raw[V::kAccVecs];
#pragma unroll
        for (int q = 0; q < V::kAccVecs; ++q) raw[q] = __ldcg(src + v * V::kAccVecs + q);
#pragma unroll
        for (int q = 0; q < V::kAccVecs; ++q) {
            const typename V::Acc* values = reinterpret_cast<const typename V::Acc*>(&raw[q]);
#pragma unroll
            for (int k = 0; k < V::kPerAccVec; ++k) acc[u][q * V::kPerAccVec + k] += values[k];
        }
    }
}

// The tag of a partial-sum row says its format (bit 47 of the sequence number, never reached, set for an Acc sum):
// a reducer that counted another number of slots than the sender waits for a tag that never comes (a timeout naming
// the peer) instead of reading the row as the wrong type.
__device__ __forceinline__ int64_t partial_tag(int64_t tag, int num_slots) {
    return num_slots > 1 ? tag ^ (int64_t(1) << 47) : tag;
}

// The senders' walk over the rows this rank received in the dispatch: rows interleaved across sources (row i to
// every source before row i + 1), so that every link carries traffic all the time and every source's reducers can
// start at once. Rows from this rank itself stay: its reducers read them from x.
// NOTES: going source by source sent everything to rank 0 first, then to rank 1: half the links idle.
// The number of items: (R - 1) times the most rows received from one source.
__device__ __forceinline__ int64_t num_send_items(const EpParams& p, const CombineArgs& a) {
    int64_t max_rows = 0;
    for (int s = 0; s < p.num_ranks; ++s)
        if (s != p.rank) max_rows = max(max_rows, a.psum_rank[s] - (s ? a.psum_rank[s - 1] : 0));
    return (p.num_ranks - 1) * max_rows;
}

// Item k is row i received from source s, dispatch output row m; false when s sent fewer rows than that.
__device__ __forceinline__ bool send_item(const EpParams& p, const CombineArgs& a, int64_t k, int* s, int64_t* i,
                                          int64_t* m) {
    const int num_sources = p.num_ranks - 1;
    *s = walk_source(k, num_sources, p.rank);
    *i = k / num_sources;
    *m = (*s ? a.psum_rank[*s - 1] : 0) + *i;
    return *m < a.psum_rank[*s];
}

// Partial-sum sender (`a.partial`): one row per item; lane j < K holds the x row of slot j here (-1: none).
template <typename T>
__device__ void combine_send_partials(const EpParams& p, const CombineArgs& a, int64_t warp, int64_t num_warps,
                                      int lane) {
    using V = AccVec<T>;
    const int K = p.num_topk;
    const int64_t wb = p.weight_bytes, num_vecs = a.hidden / V::kVec;
    const int64_t tag = row_tag(p);
    constexpr int64_t kGroup = kReduceUnroll * kWarpSize;  // vectors per iteration of a warp
    const int64_t total = num_send_items(p, a);
    for (int64_t k = warp; k < total; k += num_warps) {
        int s;
        int64_t i, m;
        if (!send_item(p, a, k, &s, &i, &m)) continue;
        int64_t x_row = lane < K ? a.expand_row[m * K + lane] : -1;
        if (x_row >= a.num_x_rows) x_row = -1;
        const unsigned present = __ballot_sync(0xffffffffu, x_row >= 0);
        if (present == 0) continue;
        uint8_t* dst = p.peer_bases[s] + kControlBytes + (combine_block(p.rank, s) * p.cap + i) * p.row_stride;
        if (a.weights && x_row >= 0)
            for (int64_t b = 0; b < wb; ++b) dst[p.weights_offset + lane * wb + b] = a.weights[x_row * wb + b];
        if (__popc(present) == 1) {
            const int64_t r = __shfl_sync(0xffffffffu, x_row, __ffs(present) - 1);
            warp_copy16<kCopyUnroll>(dst, a.x + r * p.data_bytes, p.data_bytes, lane);
        } else {
            for (int64_t v0 = 0; v0 < num_vecs; v0 += kGroup) {
                typename V::Acc acc[kReduceUnroll][V::kVec];
#pragma unroll
                for (int u = 0; u < kReduceUnroll; ++u)
#pragma unroll
                    for (int e = 0; e < V::kVec; ++e) acc[u][e] = 0;
                for (unsigned rest = present; rest != 0; rest &= rest - 1) {
                    const int64_t r = __shfl_sync(0xffffffffu, x_row, __ffs(rest) - 1);
                    add_row<T>(acc, reinterpret_cast<const int4*>(a.x + r * p.data_bytes), v0, num_vecs, lane);
                }
#pragma unroll
                for (int u = 0; u < kReduceUnroll; ++u) {
                    const int64_t v = v0 + lane + u * kWarpSize;
                    if (v >= num_vecs) continue;
#pragma unroll
                    for (int q = 0; q < V::kAccVecs; ++q) {
                        int4 packed;
                        auto* values = reinterpret_cast<typename V::Acc*>(&packed);
#pragma unroll
                        for (int e = 0; e < V::kPerAccVec; ++e) values[e] = acc[u][q * V::kPerAccVec + e];
                        reinterpret_cast<int4*>(dst)[v * V::kAccVecs + q] = packed;
                    }
                }
            }
        }
        __syncwarp();  // every lane's stores above happen before the release below
        if (lane == 0) st_release_sys(row_tag_ptr(dst, p), partial_tag(tag, __popc(present)));
    }
}

__device__ void combine_send_rows(const EpParams& p, const CombineArgs& a, int64_t warp, int64_t num_warps,
                                  int lane) {
    const int K = p.num_topk;
    const int64_t wb = p.weight_bytes;
    const int64_t tag = row_tag(p);
    const int64_t slots = a.do_expand ? a.num_slots : 1;  // region rows per dispatch output row
    const int64_t total = num_send_items(p, a);
    // Sub-row q of item k is slot slot_begin + q (expand): the region row it goes to on the item's source and the x
    // row it comes from, or false when there is none.
    auto locate = [&](int64_t k, int64_t q, uint8_t** dst, int64_t* x_row) {
        int s;
        int64_t i, m;
        if (k >= total || !send_item(p, a, k, &s, &i, &m) || a.slot_begin + q >= a.slot_end) return false;
        *x_row = a.do_expand ? a.expand_row[m * K + a.slot_begin + q] : m;
        if (*x_row < 0 || *x_row >= a.num_x_rows) return false;
        *dst = p.peer_bases[s] + kControlBytes +
               ((combine_block(p.rank, s) * p.cap + i) * slots + q) * p.row_stride;
        return true;
    };
    // A warp sends the rows of kCombineBatch consecutive items, then publishes them all: one release fence per batch.
    for (int64_t k0 = warp * kCombineBatch; k0 < total; k0 += num_warps * kCombineBatch) {
        for (int64_t n = 0; n < kCombineBatch * slots; ++n) {
            uint8_t* dst;
            int64_t r;
            if (!locate(k0 + n / slots, n % slots, &dst, &r)) continue;
            warp_copy16<kCopyUnroll>(dst, a.x + r * p.data_bytes, p.data_bytes, lane);
            if (a.weights && !a.do_expand)
                for (int64_t b = lane; b < K * wb; b += kWarpSize) dst[p.weights_offset + b] = a.weights[r * K * wb + b];
            if (a.weights && a.do_expand && lane < wb) dst[p.weights_offset + lane] = a.weights[r * wb + lane];
        }
        __syncwarp();  // every lane's stores above happen before the releases below
        for (int64_t n = lane; n < kCombineBatch * slots; n += kWarpSize) {
            uint8_t* dst;
            int64_t r;
            if (locate(k0 + n / slots, n % slots, &dst, &r)) st_release_sys(row_tag_ptr(dst, p), tag);
        }
    }
}

// Flags in the low bits of a reducer's row pointers (rows are 16-byte aligned).
constexpr uintptr_t kAccRow = 1, kOwnRun = 2, kRowFlags = 15;

template <typename T, bool kPartial>
__device__ void combine_reduce_rows(const EpParams& p, const CombineArgs& a, int64_t warp, int64_t num_warps,
                                    int lane, const uint8_t** rows) {
    using Acc = typename AccOf<T>::type;
    constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte vector
    const int R = p.num_ranks, K = p.num_topk, L = p.num_local_experts;
    uint8_t* region = p.local_base + kControlBytes;
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
    // Work items: (token, slice of its groups of vectors). With fewer tokens than warps a token's hidden range is
    // split over several warps: a warp's loads of a token's rows wait one after another (each add stalls the warp
    // before the next row's loads issue), so few tokens would leave most warps idle behind long chains. Every
    // element still adds its rows in the same order.
    constexpr int64_t kGroup = kReduceUnroll * kWarpSize;  // vectors per iteration of a warp
    const int64_t num_groups = (num_vecs + kGroup - 1) / kGroup;
    const int64_t slices = max(int64_t(1), min(num_groups, num_warps / max(p.num_tokens, int64_t(1))));
    const int64_t slice_vecs = (num_groups + slices - 1) / slices * kGroup;
    for (int64_t item = warp; item < p.num_tokens * slices; item += num_warps) {
        const int64_t t = item / slices, v_begin = item % slices * slice_vecs;
        const int64_t v_end = min(num_vecs, v_begin + slice_vecs);
        const int64_t* pos = a.send_pos + t * R;
        const int64_t* experts = a.clean_idx + t * K;
        // The token's rows, in the documented order, into rows[] (flagged in their low bits: kAccRow a partial sum,
        // kOwnRun one of our own slots' rows that partial sums add up first). A peer's row is in the region behind
        // its tag, which the lane of that rank (non-partial: of that candidate) waits for; our own is a row of x.
        uint8_t* region_row = nullptr;
        int64_t row_tag_expected = tag;
        int peer = -1;
        unsigned present = 0;
        int num_rows = 0;
        if constexpr (kPartial) {
            // Candidates by rank: a peer's one row, or our own slots' rows in ascending slot order.
            const int d = lane < K && experts[lane] >= 0 ? static_cast<int>(experts[lane] / L) : -1;
            for (int q = 0; q < R; ++q) {
                const unsigned slots = __ballot_sync(0xffffffffu, d == q);
                if (slots == 0) continue;
                if (q == p.rank) {
                    // First among the ranks, our rows may go straight into acc: 0 + (0 + a + b) == (0 + a) + b.
                    const uintptr_t flag = num_rows ? kOwnRun : 0;
                    for (unsigned rest = slots; rest != 0; rest &= rest - 1) {
                        const int64_t x_row = own_x_row(pos[q], __ffs(rest) - 1);
                        if (x_row < 0) continue;
                        if (lane == 0) rows[num_rows] = a.x + x_row * p.data_bytes + flag;
                        ++num_rows;
                    }
                } else {
                    const int64_t block_row = combine_block(q, p.rank) * p.cap + pos[q];
                    if (lane == q) {
                        peer = q;
                        region_row = region + block_row * p.row_stride;
                        rows[num_rows] = region_row + (__popc(slots) > 1 ? kAccRow : 0);
                        row_tag_expected = partial_tag(tag, __popc(slots));
                    }
                    ++num_rows;
                }
            }
        } else {
            // Lane r owns one candidate row (rank r, or slot slot_begin + r); the rows that exist, in lane order,
            // are the documented order.
            const uint8_t* row = nullptr;
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
                const int64_t block_row = combine_block(peer, p.rank) * p.cap + pos[peer];
                region_row = region + (a.do_expand ? block_row * a.num_slots + lane : block_row) * p.row_stride;
                row = region_row;
            }
            present = __ballot_sync(0xffffffffu, row != nullptr);
            num_rows = __popc(present);
            if (row != nullptr) rows[__popc(present & ((1u << lane) - 1))] = row;
        }
        if (region_row != nullptr && !*reinterpret_cast<volatile int*>(&timed_out) &&
            !wait_flag_equal(row_tag_ptr(region_row, p), row_tag_expected, p, p.phase, peer))
            timed_out = 1;
        __syncwarp();
        if (a.terms != nullptr) {
            // The r-th row is that of the r-th lane set in `present`: a rank, or slot slot_begin + lane.
            const int64_t num_terms = a.do_expand ? K : R;
            unsigned rest = present;
            for (int r = 0; rest != 0; ++r, rest &= rest - 1) {
                const int term = (a.do_expand ? a.slot_begin : 0) + __ffs(rest) - 1;
                const int4* src = reinterpret_cast<const int4*>(rows[r]);
                int4* dst = reinterpret_cast<int4*>(static_cast<T*>(a.terms) + (t * num_terms + term) * H);
                for (int64_t v = v_begin + lane; v < v_end; v += kWarpSize) dst[v] = __ldcg(src + v);
            }
        }
        for (int64_t v0 = v_begin; a.terms == nullptr && v0 < v_end; v0 += kGroup) {
            Acc acc[kReduceUnroll][kVec];
#pragma unroll
            for (int u = 0; u < kReduceUnroll; ++u) {
                const int64_t v = v0 + lane + u * kWarpSize;
#pragma unroll
                for (int k = 0; k < kVec; ++k)
                    acc[u][k] = a.first_round || v >= num_vecs ? Acc(0)
                                                               : static_cast<const Acc*>(a.acc)[t * H + v * kVec + k];
            }
            for (int r = 0; r < num_rows;) {
                const uintptr_t entry = reinterpret_cast<uintptr_t>(rows[r]);
                const int4* src = reinterpret_cast<const int4*>(entry & ~kRowFlags);
                if (kPartial && (entry & kAccRow)) {
                    add_acc_row<T>(acc, src, v0, num_vecs, lane);
                    ++r;
                } else if (kPartial && (entry & kOwnRun)) {  // our own partial sum: its rows from zero, then into acc
                    Acc part[kReduceUnroll][kVec];
#pragma unroll
                    for (int u = 0; u < kReduceUnroll; ++u)
#pragma unroll
                        for (int k = 0; k < kVec; ++k) part[u][k] = 0;
                    for (; r < num_rows && (reinterpret_cast<uintptr_t>(rows[r]) & kOwnRun); ++r)
                        add_row<T>(part, reinterpret_cast<const int4*>(reinterpret_cast<uintptr_t>(rows[r]) &
                                                                       ~kRowFlags),
                                   v0, num_vecs, lane);
#pragma unroll
                    for (int u = 0; u < kReduceUnroll; ++u)
#pragma unroll
                        for (int k = 0; k < kVec; ++k) acc[u][k] += part[u][k];
                } else {
                    add_row<T>(acc, src, v0, num_vecs, lane);
                    ++r;
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
        if (a.out_weights && v_begin == 0) {  // once per token: by its first slice
            for (int j = lane; j < K; j += kWarpSize) {
                if (a.do_expand && (j < a.slot_begin || j >= a.slot_end)) continue;
                uint8_t* dst = a.out_weights + (t * K + j) * wb;
                if (experts[j] < 0) {
                    for (int64_t b = 0; b < wb; ++b) dst[b] = 0;
                    continue;
                }
                const int d = static_cast<int>(experts[j] / L);
                const int64_t block_row = combine_block(d, p.rank) * p.cap + pos[d];
                const int64_t x_row = d == p.rank ? own_x_row(pos[d], j) : 0;
                const uint8_t* src =
                    d == p.rank ? (a.do_expand ? a.weights + x_row * wb : a.weights + (x_row * K + j) * wb)
                    : a.do_expand && !kPartial
                        ? region + (block_row * a.num_slots + (j - a.slot_begin)) * p.row_stride + p.weights_offset
                        : region + block_row * p.row_stride + p.weights_offset + j * wb;
                for (int64_t b = 0; b < wb; ++b) dst[b] = x_row < 0 ? 0 : ld_cg_u8(src + b);
            }
        }
        __syncwarp();  // rows[] is rebuilt for the next token
    }
}

#ifdef MOE_COMM_BLOCK_TIMES
__device__ uint64_t g_combine_block_times[kMaxTimedBlocks][2];  // this header is included by kernels/combine.cu only
#endif

// kPartial: a.partial (a kernel of its own: the partial sums' registers would make the plain kernel spill).
template <typename T, bool kPartial>
__global__ void __launch_bounds__(kThreadsPerBlock) combine_impl(EpParams p, CombineArgs a) {
    __shared__ const uint8_t* rows[kMaxWarpsPerBlock][kWarpSize];
    const int lane = threadIdx.x % kWarpSize, warp_in_block = threadIdx.x / kWarpSize;
    const int warps_per_block = blockDim.x / kWarpSize;
    BLOCK_TIME_START(g_combine_block_times);
    const bool is_sender = static_cast<int>(blockIdx.x) < p.num_send_blocks;
    // After a timeout or a disagreement this rank moves nothing until the host has dealt with it.
    const bool skip = block_aborted(p);
    const bool go = !skip && (!p.with_barrier || barrier_arrive_and_wait(p, is_sender));
    if (is_sender) {
        const int64_t warp = static_cast<int64_t>(blockIdx.x) * warps_per_block + warp_in_block;
        const int64_t num_warps = static_cast<int64_t>(p.num_send_blocks) * warps_per_block;
        if constexpr (kPartial) {
            if (go) combine_send_partials<T>(p, a, warp, num_warps, lane);
        } else if (go) {
            combine_send_rows(p, a, warp, num_warps, lane);
        }
    } else if (!skip) {
        const int64_t warp = static_cast<int64_t>(blockIdx.x - p.num_send_blocks) * warps_per_block + warp_in_block;
        const int64_t num_warps = static_cast<int64_t>(gridDim.x - p.num_send_blocks) * warps_per_block;
        combine_reduce_rows<T, kPartial>(p, a, warp, num_warps, lane, rows[warp_in_block]);
    }
    BLOCK_TIME_END(g_combine_block_times);
    kernel_done(p);
}

}  // namespace moe_comm
