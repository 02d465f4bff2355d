// The dispatch notify: the handshake before a dispatch moves rows (barrier, counts, exchange). Device code only
// (launched by kernels/layout.cu, after the layout in the same kernel or alone); no torch headers.
#pragma once

#include <cstdint>

#include "moe_comm/abi.h"
#include "moe_comm/common/comm.cuh"
#include "moe_comm/common/rows.cuh"
#include "moe_comm/common/tuning.cuh"

namespace moe_comm {

// ------------------------------------------------------------------------------------------------------------
// Dispatch notify, one block (thread d < num_ranks talks to rank d): the barrier before the dispatch (nobody
// writes into a region its owner still reads; it advances the barrier counter that names the operation),
// this rank's control slot on every peer (signature, rows, per-expert counts, flags), the exchange (every peer's
// slot has arrived here), then what arrived goes on: a copy of the slots for the receivers of this and later
// cached dispatches; with a CPU sync a summary for the host, without one the flags into the pending flags that
// the next synchronizing call raises.
// ------------------------------------------------------------------------------------------------------------
__device__ void notify_block(const EpParams& p, const NotifyArgs& n) {
    const int R = p.num_ranks, L = p.num_local_experts, S = kSignatureLen;
    signal_wait_block(p.peer_bases, p.local_base, p.error, kBarrierFlagsOffset, kBarrierSeqOffset, p.timeout_ns,
                      p.rank, R, p.barrier_phase);
    // Our slot on every peer d: signature, rows for d, d's experts' counts, flags (every thread takes values).
    // NOTES: the exchange's barrier (__syncthreads, then a system fence and release per peer) publishes them.
    const int width = S + L + 2;
    for (int i = threadIdx.x; i < R * width; i += blockDim.x) {
        const int d = i / width, c = i % width;
        // NOTES: __ldcg, as the counts may come from other blocks of the same kernel (layout_notify_impl).
        const int64_t value = c < S ? p.signature[c] : c == S ? __ldcg(n.num_tokens_per_rank + d)
                              : c <= S + L ? __ldcg(n.num_tokens_per_expert + d * L + c - S - 1) : __ldcg(n.flags);
        control_slot(p.peer_bases[d], p.rank)[c] = value;
    }
    signal_wait_block(p.peer_bases, p.local_base, p.error, kExchangeFlagsOffset, kExchangeSeqOffset, p.timeout_ns,
                      p.rank, R, n.exchange_phase);
    // Slots written by peers: volatile loads (not through L1).
    auto slot_value = [&](int s, int i) {
        return *reinterpret_cast<volatile const int64_t*>(control_slot(p.local_base, s) + i);
    };
    if (n.recv_slots)
        for (int i = threadIdx.x; i < R * width; i += blockDim.x)
            n.recv_slots[(i / width) * kSlotStride + i % width] = slot_value(i / width, i % width);
    if (!n.summary) {
        for (int s = threadIdx.x; s < R; s += blockDim.x) n.pending_flags[s] |= slot_value(s, S + 1 + L);
        return;
    }
    // Summary: [R][S + 2] signature, rows, flags per source; [R] pending flags; rows in all; [L] rows per expert.
    int64_t* per_source = n.summary;
    for (int i = threadIdx.x; i < R * (S + 2); i += blockDim.x) {
        const int s = i / (S + 2), c = i % (S + 2);
        per_source[i] = slot_value(s, c <= S ? c : S + 1 + L);
    }
    int64_t* pending = per_source + R * (S + 2);
    int64_t* totals = pending + R;
    for (int s = threadIdx.x; s < R; s += blockDim.x) pending[s] = n.pending_flags[s];
    for (int i = threadIdx.x; i < 1 + L; i += blockDim.x) {
        int64_t rows = 0;
        for (int s = 0; s < R; ++s) rows += slot_value(s, S + i);
        totals[i] = rows;
    }
}

__global__ void dispatch_notify_impl(EpParams p, NotifyArgs n) { notify_block(p, n); }

}  // namespace moe_comm
