// The dispatch notify: the handshake before a dispatch moves rows (counts, barrier). Device code only
// (run by the last block of the layout kernel, kernels/layout.cu); no torch headers.
#pragma once

#include <cstdint>

#include "moe_comm/abi.h"
#include "moe_comm/common/comm.cuh"
#include "moe_comm/common/rows.cuh"
#include "moe_comm/common/tuning.cuh"

namespace moe_comm {

// Profiling build (-DMOE_COMM_BLOCK_TIMES): per layout block the global timer at its steps (layout.cuh), the last
// block's row also at the notify's (started, slots written, barrier passed, done); the others' notify steps 0
// (kLayoutSteps: moe_comm.layout.LAYOUT_STEPS and the start).
#ifdef MOE_COMM_BLOCK_TIMES
__device__ uint64_t g_layout_step_times[kMaxTimedBlocks][kLayoutSteps];  // included by kernels/layout.cu only
#endif

// ------------------------------------------------------------------------------------------------------------
// Dispatch notify, one block (thread d < num_ranks talks to rank d): this rank's control slot on every peer (rows,
// per-expert counts, flags), then the barrier before the dispatch, which publishes them (nobody writes into a region
// its owner still reads; it advances the barrier counter that names the operation; it carries the call's signature,
// and ranks that disagree stop there), then what arrived goes on: a copy of the slots for the receivers of this and
// later cached dispatches; with a CPU sync a summary for the host, without one the flags into the pending flags
// that the next synchronizing call raises.
// NOTES: the slots used to travel after the barrier, behind a second flag of their own (an exchange): folded into
// the barrier, one system fence and one wait fewer (benchmarks/NOTES.md, thirteenth session). Writing a peer's slot
// before the barrier is safe because the slots come in two sets by the sequence number's parity, as the signatures:
// this rank passed the barrier of the operation before (its earlier kernels are complete), so every peer had
// reached it, and had finished reading the set of two operations ago.
// ------------------------------------------------------------------------------------------------------------
// The barrier at sequence number `seq` (the counter + 1; it advances the counter to `seq`): thread d tells rank d
// that this rank reached the operation, with the call's signature, and waits until rank d did the same. What any
// thread of the block wrote before it reaches the peers with the flags. True when every rank arrived and agreed.
// Every thread of the block must call it.
__device__ __forceinline__ bool notify_barrier(const EpParams& p, int64_t seq) {
    __syncthreads();  // every thread's stores come before the flags (the fence below is cumulative)
    if (threadIdx.x == 0) *reinterpret_cast<int64_t*>(p.local_base + kBarrierSeqOffset) = seq;
    int verdict = 1;
    if (threadIdx.x < p.num_ranks) {
        __threadfence_system();
        barrier_arrive(p, threadIdx.x, kBarrierFlagsOffset, seq);
        verdict = barrier_wait(p, threadIdx.x, kBarrierFlagsOffset, seq, p.barrier_phase);
    }
    return barrier_agreed(p, verdict, p.barrier_phase, seq);
}

__device__ void notify_block(const EpParams& p, const NotifyArgs& n) {
    const int R = p.num_ranks, L = p.num_local_experts;
    STEP_TIME(g_layout_step_times, 5);
    if (block_aborted(p)) return;  // the dispatch kernel after it sees the abort word too and moves nothing
    const int64_t seq = *reinterpret_cast<volatile const int64_t*>(p.local_base + kBarrierSeqOffset) + 1;
    // Our slot on every peer d: rows for d, d's experts' counts, flags (every thread takes values).
    const int width = L + 2;
    for (int i = threadIdx.x; i < R * width; i += blockDim.x) {
        const int d = i / width, c = i % width;
        // NOTES: __ldcg, as the counts may come from other blocks of the same kernel (layout_notify_impl).
        const int64_t value = c == 0 ? __ldcg(n.num_tokens_per_rank + d)
                              : c <= L ? __ldcg(n.num_tokens_per_expert + d * L + c - 1) : __ldcg(n.flags);
        control_slot(p.peer_bases[d], seq, p.rank)[c] = value;
    }
    STEP_TIME(g_layout_step_times, 6);
    if (!notify_barrier(p, seq)) return;
    STEP_TIME(g_layout_step_times, 7);
    // Slots written by peers: volatile loads (not through L1).
    auto slot_value = [&](int s, int i) {
        return *reinterpret_cast<volatile const int64_t*>(control_slot(p.local_base, seq, s) + i);
    };
    if (n.recv_slots)
        for (int i = threadIdx.x; i < R * width; i += blockDim.x)
            n.recv_slots[(i / width) * kSlotStride + i % width] = slot_value(i / width, i % width);
    if (!n.summary) {
        for (int s = threadIdx.x; s < R; s += blockDim.x) n.pending_flags[s] |= slot_value(s, 1 + L);
        return;
    }
    // Summary (moe_comm.layout.SUMMARY): rows and flags per source (interleaved), pending flags per source, rows in
    // all, then rows per local expert.
    static_assert(summary_flags_from(0, 0, 0) == 1 && summary_rows_from(0, 0, 1) == 2 &&
                      summary_pending_from(0, 0, 1) == summary_pending_from(0, 0, 0) + 1 &&
                      summary_per_expert(0, 0, 1) == summary_per_expert(0, 0, 0) + 1 &&
                      summary_per_expert(0, 0, 0) == summary_total(0, 0, 0) + 1,
                  "the loops below write [rows, flags] per source, the pending flags in a row, and the totals then "
                  "the per-expert rows");
    int64_t* per_source = n.summary + summary_rows_from(R, L, 0);
    for (int i = threadIdx.x; i < R * 2; i += blockDim.x) per_source[i] = slot_value(i / 2, i % 2 == 0 ? 0 : 1 + L);
    int64_t* pending = n.summary + summary_pending_from(R, L, 0);
    int64_t* totals = n.summary + summary_total(R, L, 0);
    for (int s = threadIdx.x; s < R; s += blockDim.x) pending[s] = n.pending_flags[s];
    for (int i = threadIdx.x; i < 1 + L; i += blockDim.x) {
        int64_t rows = 0;
        for (int s = 0; s < R; ++s) rows += slot_value(s, i);
        totals[i] = rows;
    }
    // The host polls this word, not the stream: it allocates the outputs and queues the dispatch while the layout
    // kernel's blocks still exit. The fence is cumulative: every thread's summary values reach the host before it.
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        *reinterpret_cast<volatile int64_t*>(n.summary_done) = n.done_value;
    }
}

}  // namespace moe_comm
