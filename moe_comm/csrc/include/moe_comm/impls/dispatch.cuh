// Dispatch: every token to the ranks of its experts, senders and receivers of one kernel running at the same time.
// Device code only (launched by kernels/dispatch.cu); no torch headers. (Over 400 lines: the senders and the
// receivers of one kernel, which share its row format and tables.)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moe_comm/abi.h"
#include "moe_comm/common/comm.cuh"
#include "moe_comm/common/copy.cuh"
#include "moe_comm/common/fp8.cuh"
#include "moe_comm/common/rows.cuh"
#include "moe_comm/common/tuning.cuh"

namespace moe_comm {

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

struct RecvPlan {
    int64_t table_bytes;  // count tables, padded to 128 bytes
    int64_t chunk;        // bytes per bulk copy (a multiple of 16)
    int64_t warp_bytes;   // per copying warp: mbarriers and kRecvStages chunk buffers
    int warps;            // copying warps per receiver block
    int64_t smem_bytes;   // dynamic shared memory of a dispatch_impl block
};

// Output rows of this rank's own rows (non-expand): after the rows of every lower source rank, the same place the
// receivers would have put them.
__device__ __forceinline__ int64_t own_rows_start(const EpParams& p, const RecvOutputs& out, int lane) {
    int64_t start = lane < p.rank ? min(max(out.counts[lane * kSlotStride], int64_t(0)), p.cap) : 0;
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
    const int64_t out_row_bytes = out.dequantize ? 2 * p.data_bytes : p.data_bytes;  // bf16 outputs of FP8 rows
    // Where row data for destination d goes, or null when an own row falls outside the outputs.
    auto data_dst = [&](int d, int64_t pos) -> uint8_t* {
        if (direct && d == p.rank) {
            const int64_t m = own_start + pos;
            return m < out.num_rows ? out.x + m * out_row_bytes : nullptr;
        }
        return p.peer_bases[d] + kControlBytes + (block_base + pos) * p.row_stride;
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

            // `quantize=`: bf16 rows cast to FP8 on the way (moe_comm/common/fp8.cuh), a lane's 16-byte vector of 8
            // values giving 8 wire bytes, its half-warp's scale word written by the half's first lane.
            if (in.quantize) {
                const int4* src = reinterpret_cast<const int4*>(in.x + t * 2 * p.data_bytes);
                const int64_t num_in = p.data_bytes / 8;  // bf16 vectors; a multiple of 16 (hidden % 128 == 0)
                for (int64_t v0 = 0; v0 < num_in; v0 += kSendUnroll * kWarpSize) {
                    uint2 q[kSendUnroll];
                    uint32_t word[kSendUnroll];
#pragma unroll
                    for (int u = 0; u < kSendUnroll; ++u) {
                        const int64_t v = v0 + lane + u * kWarpSize;
                        fp8_cast8(v < num_in ? ld_nc_v4(src + v) : make_int4(0, 0, 0, 0), static_cast<int>(in.quantize),
                                  lane, &q[u], &word[u]);
                    }
                    for (unsigned mask = dest_mask; mask; mask &= mask - 1) {
                        const int d = __ffs(mask) - 1;
                        const int64_t pos = __shfl_sync(0xffffffffu, my_pos, d);
                        uint8_t* row = data_dst(d, pos);
                        if (row == nullptr) continue;
                        const bool own = direct && d == p.rank;
#pragma unroll
                        for (int u = 0; u < kSendUnroll; ++u) {
                            const int64_t v = v0 + lane + u * kWarpSize;
                            if (v >= num_in) continue;
                            if (own && out.dequantize) {  // cast back at once: bf16 outputs, no scales
                                reinterpret_cast<int4*>(row)[v] =
                                    fp8_dequant8(q[u], fp8_scale_of(word[u], static_cast<int>(in.quantize), v * 8));
                                continue;
                            }
                            reinterpret_cast<uint2*>(row)[v] = q[u];
                            uint8_t* scales = own ? out.scales + (own_start + pos) * p.scale_bytes : row + p.data_bytes;
                            if (lane % 16 == 0) reinterpret_cast<uint32_t*>(scales)[v / 16] = word[u];
                        }
                    }
                }
            }
            // Data: 16-byte vectors, kSendUnroll loads in flight before the stores to every destination.
            const int4* src = reinterpret_cast<const int4*>(in.x + t * p.data_bytes);
            const int64_t num_vecs = in.quantize ? 0 : p.data_bytes / 16;
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
                    if (direct && d == p.rank && out.dequantize) {
                        // Own FP8 rows (a pre-quantized tuple) cast back at once: 16 values, one scale, 32 bytes.
                        const uint32_t* scales = reinterpret_cast<const uint32_t*>(in.scales + t * p.scale_bytes);
#pragma unroll
                        for (int u = 0; u < kSendUnroll; ++u) {
                            const int64_t v = v0 + lane + u * kWarpSize;
                            if (v >= num_vecs) continue;
                            const float scale = fp8_scale_of(scales[v * 16 / kFp8ChannelsPerScale],
                                                             static_cast<int>(out.dequantize), v * 16);
                            dst[2 * v] = fp8_dequant8(make_uint2(values[u].x, values[u].y), scale);
                            dst[2 * v + 1] = fp8_dequant8(make_uint2(values[u].z, values[u].w), scale);
                        }
                        continue;
                    }
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
                    if (out.scales && in.scales)
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
                if (in.scales) warp_copy4(row + p.data_bytes, in.scales + t * p.scale_bytes, p.scale_bytes, lane);
                if (lane == 0) *reinterpret_cast<int64_t*>(row + p.meta_offset) = t;
                int32_t* local_ids = reinterpret_cast<int32_t*>(row + p.ids_offset);
                int32_t* ranks = reinterpret_cast<int32_t*>(row + p.ranks_offset);
                uint8_t* w = row + p.weights_offset;
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
    plan.table_bytes = p.recv_table_bytes;
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
    const int32_t l = ld_cg_i32(reinterpret_cast<const int32_t*>(row + p.ids_offset) + j);
    if (l < 0 || l >= p.num_local_experts) return -1;
    const int64_t r = run_base[s * p.num_local_experts + l] + ld_cg_i32(reinterpret_cast<const int32_t*>(row + p.ranks_offset) + j);
    return r >= 0 && r < out.num_expand_rows ? r : -1;
}

// Metadata of received row g (from source s, output row m): routing outputs, weights (non-expand) and FP8 scales;
// `ok` false (its tag timed out): routing that sends nothing back. Returns nothing; the data goes by bulk copies.
__device__ __forceinline__ void recv_row_meta(const EpParams& p, const RecvOutputs& out, const int64_t* run_base,
                                              const uint8_t* row, int s, int64_t m, bool ok, int lane) {
    const int K = p.num_topk;
    const int64_t wb = p.weight_bytes;
    if (!ok) {
        if (out.src_idx && lane == 0) out.src_idx[m] = -1;
        for (int j = lane; j < K; j += kWarpSize) {
            if (out.topk_idx) out.topk_idx[m * K + j] = -1;
            if (out.expand_row) out.expand_row[m * K + j] = -1;
        }
        return;
    }
    const int32_t* local_ids = reinterpret_cast<const int32_t*>(row + p.ids_offset);
    const uint8_t* w = row + p.weights_offset;
    if (out.src_idx && lane == 0) out.src_idx[m] = ld_cg_i64(reinterpret_cast<const int64_t*>(row + p.meta_offset));
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
    const int64_t stride = kSlotStride;
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
            return p.local_base + kControlBytes + (source_of(k) * p.cap + k / num_sources) * p.row_stride;
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
                          wait_flag_equal(row_tag_ptr(row_ptr(load_k), p), tag, p, p.phase, source_of(load_k));
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
            if (row_ok && out.dequantize) {
                // FP8 rows cast back to bf16 by the lanes from shared memory (16 values, one scale, 32 bytes out).
                const int64_t offset = c * plan.chunk, n = chunk_bytes(c) / 16;
                const int4* chunk = reinterpret_cast<const int4*>(stages + b * plan.chunk);
                const uint32_t* scales = reinterpret_cast<const uint32_t*>(row + p.data_bytes);
                auto store_row = [&](int64_t dst_row) {
                    int4* dst = reinterpret_cast<int4*>(out.x + dst_row * 2 * p.data_bytes + 2 * offset);
                    for (int64_t i = lane; i < n; i += kWarpSize) {
                        const int4 raw = chunk[i];
                        const int64_t channel = offset + i * 16;
                        const float scale = fp8_scale_of(__ldcg(scales + channel / kFp8ChannelsPerScale),
                                                         static_cast<int>(out.dequantize), channel);
                        dst[2 * i] = fp8_dequant8(make_uint2(raw.x, raw.y), scale);
                        dst[2 * i + 1] = fp8_dequant8(make_uint2(raw.z, raw.w), scale);
                    }
                };
                if (!out.do_expand) store_row(m);
                for (int j0 = 0; out.do_expand && j0 < K; j0 += kWarpSize) {
                    const int j = j0 + lane;
                    const int64_t r = j < K ? expand_row_of(p, out, run_base, row, s, j) : -1;
                    for (unsigned mask = __ballot_sync(0xffffffffu, r >= 0); mask; mask &= mask - 1)
                        store_row(__shfl_sync(0xffffffffu, r, __ffs(mask) - 1));
                }
                // These generic reads of the stage buffer before the bulk load (async proxy) that refills it.
                fence_proxy_async();
            } else if (row_ok) {
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
                const int64_t row_bytes = out.dequantize ? 2 * p.data_bytes : p.data_bytes;
                warp_zero16(out.x + r * row_bytes, row_bytes, lane);
                if (out.scales)
                    for (int64_t b = lane; b < p.scale_bytes / 4; b += kWarpSize)
                        reinterpret_cast<int32_t*>(out.scales + r * p.scale_bytes)[b] = 0;
                if (out.weights && lane < p.weight_bytes) out.weights[r * p.weight_bytes + lane] = 0;
            }
        }
    }
    // Routing outputs past the rows received (worst-case sized outputs of a call without a CPU sync) say "no row";
    // consecutive threads write consecutive values (coalesced).
    if (out.src_idx) {
        const int64_t first = rank_start[R - 1] + rows_from[R - 1];
        const int64_t num_threads = static_cast<int64_t>(num_recv_blocks) * blockDim.x;
        const int64_t start = recv_block * blockDim.x + threadIdx.x;
        for (int64_t i = first + start; i < out.num_rows; i += num_threads) out.src_idx[i] = -1;
        for (int64_t i = first * K + start; i < out.num_rows * K; i += num_threads) out.topk_idx[i] = -1;
    }
}

#ifdef MOE_COMM_BLOCK_TIMES
__device__ uint64_t g_dispatch_block_times[kMaxTimedBlocks][2];  // this header is included by kernels/dispatch.cu only
#endif

__global__ void __launch_bounds__(kThreadsPerBlock) dispatch_impl(EpParams p, DispatchInputs in,
                                                                                RecvOutputs out) {
    extern __shared__ __align__(128) uint8_t dyn_smem[];
    BLOCK_TIME_START(g_dispatch_block_times);
    const int lane = threadIdx.x % kWarpSize;
    const int warps_per_block = blockDim.x / kWarpSize;
    const bool is_sender = static_cast<int>(blockIdx.x) < p.num_send_blocks;
    // After a timeout or a disagreement this rank moves nothing until the host has dealt with it.
    const bool skip = block_aborted(p);
    const bool go = !skip && (!p.with_barrier || barrier_arrive_and_wait(p, is_sender));
    if (is_sender) {
        const int64_t warp = static_cast<int64_t>(blockIdx.x) * warps_per_block + threadIdx.x / kWarpSize;
        if (go)
            dispatch_send_rows(p, in, out, warp, static_cast<int64_t>(p.num_send_blocks) * warps_per_block, lane);
    } else if (!skip) {
        dispatch_recv_rows(p, out, recv_plan(p, warps_per_block), lane, dyn_smem);
    }
    BLOCK_TIME_END(g_dispatch_block_times);
    kernel_done(p);
}

}  // namespace moe_comm
