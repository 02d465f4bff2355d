// Launcher of the combine kernel (include/moe_comm/impls/combine.cuh), which runs the barrier itself.
#include "moe_comm/host/launch.h"
#include "moe_comm/impls/combine.cuh"

using namespace moe_comm;

// combine_impl<T, partial> on `stream`.
template <typename T>
static void launch_combine(bool partial, int num_blocks, cudaStream_t stream, const EpParams& p, const CombineArgs& a) {
    if (partial) {
        combine_impl<T, true><<<num_blocks, kThreadsPerBlock, 0, stream>>>(p, a);
    } else {
        combine_impl<T, false><<<num_blocks, kThreadsPerBlock, 0, stream>>>(p, a);
    }
}

// dtype: 1 bf16, 2 float32, 3 float64 (accumulating in float32, float32, float64). num_blocks: p->num_send_blocks
// senders, then the reducers (at least one of each). part: kPartWhole, or kPartSend (every block a sender, with the
// barrier) then later kPartReceive (every block a reducer, no barrier: the same row tag as the send launch's).
extern "C" int moe_comm_combine(const EpParams* p, const CombineArgs* a, int dtype, int num_blocks, int part,
                                cudaStream_t stream) {
    MOE_COMM_REQUIRE(p->num_ranks >= 1 && p->num_ranks <= kWarpSize, "num_ranks=%d", p->num_ranks);
    MOE_COMM_REQUIRE(a->slot_end - a->slot_begin <= kWarpSize, "slot_begin=%d, slot_end=%d", a->slot_begin,
                     a->slot_end);
    MOE_COMM_REQUIRE(part == kPartWhole || part == kPartSend || part == kPartReceive, "part=%d", part);
    MOE_COMM_REQUIRE(part == kPartWhole ? p->num_send_blocks >= 1 && p->num_send_blocks < num_blocks : num_blocks >= 1,
                     "part=%d, num_send_blocks=%d, num_blocks=%d", part, p->num_send_blocks, num_blocks);
    // A split combine is one round: the next round's senders would overwrite what the reducers have not read.
    MOE_COMM_REQUIRE(part == kPartWhole || (a->first_round && a->last_round), "part=%d, first_round=%d, last_round=%d",
                     part, a->first_round, a->last_round);
    // Partial sums: one row per (token, peer) in one round, summed (never the hybrid path's unreduced terms).
    MOE_COMM_REQUIRE(!a->partial || (a->do_expand && !a->terms && a->first_round && a->last_round),
                     "partial=%d, do_expand=%d, terms set=%d, first_round=%d, last_round=%d", a->partial, a->do_expand,
                     a->terms != nullptr, a->first_round, a->last_round);
    MOE_COMM_REQUIRE(p->data_bytes % 16 == 0 && p->row_stride % 16 == 0, "data_bytes=%lld, row_stride=%lld",
                     static_cast<long long>(p->data_bytes), static_cast<long long>(p->row_stride));
    MOE_COMM_REQUIRE(dtype == kDtypeBfloat16 || dtype == kDtypeFloat32 || dtype == kDtypeFloat64,
                     "dtype=%d (%d bf16, %d float32, %d float64)", dtype, kDtypeBfloat16, kDtypeFloat32, kDtypeFloat64);
    EpParams q = *p;
    q.num_send_blocks = part == kPartSend ? num_blocks : part == kPartReceive ? 0 : p->num_send_blocks;
    q.with_barrier = part == kPartReceive ? 0 : 1;
    const bool partial = a->partial != 0;
    switch (dtype) {
        case kDtypeBfloat16: launch_combine<__nv_bfloat16>(partial, num_blocks, stream, q, *a); break;
        case kDtypeFloat32: launch_combine<float>(partial, num_blocks, stream, q, *a); break;
        default: launch_combine<double>(partial, num_blocks, stream, q, *a); break;
    }
    return launch_result("combine_impl", num_blocks, kThreadsPerBlock, 0);
}

#ifdef MOE_COMM_BLOCK_TIMES
// [num_blocks][start, end] ns of the last combine_impl launch.
extern "C" int moe_comm_combine_block_times(uint64_t* host, int num_blocks) {
    return copy_block_times(g_combine_block_times, host, num_blocks);
}
#endif
