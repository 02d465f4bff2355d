// Launcher of the dispatch kernel (include/moe_comm/impls/dispatch.cuh).
#include "moe_comm/host/launch.h"
#include "moe_comm/impls/dispatch.cuh"

using namespace moe_comm;

// num_blocks: p->num_send_blocks senders, then the receivers (at least one of each). with_barrier: the kernel runs
// the barrier itself (a cached dispatch; a fresh one ran it in the notify). part: kPartWhole, or kPartSend (every
// block a sender, the barrier as with_barrier says) then later kPartReceive (every block a receiver, no barrier: the
// send launch advanced the counter, so both read the same row tag).
extern "C" int moe_comm_dispatch(const EpParams* p, const DispatchInputs* in, const RecvOutputs* out, int num_blocks,
                                 int with_barrier, int part, cudaStream_t stream) {
    const RecvPlan plan = recv_plan(*p, kMaxWarpsPerBlock);
    MOE_COMM_REQUIRE(p->num_ranks >= 1 && p->num_ranks <= kMaxRanks, "num_ranks=%d, kMaxRanks=%d", p->num_ranks,
                     kMaxRanks);
    MOE_COMM_REQUIRE(p->data_bytes > 0 && p->data_bytes % 16 == 0 && p->scale_bytes % 4 == 0 &&
                         p->row_stride % 16 == 0,
                     "data_bytes=%lld, scale_bytes=%lld, row_stride=%lld", static_cast<long long>(p->data_bytes),
                     static_cast<long long>(p->scale_bytes), static_cast<long long>(p->row_stride));
    MOE_COMM_REQUIRE(part == kPartWhole || part == kPartSend || part == kPartReceive, "part=%d", part);
    MOE_COMM_REQUIRE(part == kPartWhole ? p->num_send_blocks >= 1 && p->num_send_blocks < num_blocks : num_blocks >= 1,
                     "part=%d, num_send_blocks=%d, num_blocks=%d", part, p->num_send_blocks, num_blocks);
    MOE_COMM_REQUIRE(plan.table_bytes <= kRecvTableLimit && plan.warps >= 1,
                     "count tables %lld bytes (limit %lld), copying warps %d", static_cast<long long>(plan.table_bytes),
                     static_cast<long long>(kRecvTableLimit), plan.warps);
    static bool opted_in[kMaxDevices] = {};
    if (opt_in_shared_memory(dispatch_impl, opted_in)) return 1;
    EpParams q = *p;
    q.num_send_blocks = part == kPartSend ? num_blocks : part == kPartReceive ? 0 : p->num_send_blocks;
    q.with_barrier = with_barrier && part != kPartReceive ? 1 : 0;
    const int64_t smem_bytes = part == kPartSend ? 0 : plan.smem_bytes;  // senders use no dynamic shared memory
    dispatch_impl<<<num_blocks, kThreadsPerBlock, smem_bytes, stream>>>(q, *in, *out);
    return launch_result("dispatch_impl", num_blocks, kThreadsPerBlock, smem_bytes);
}

#ifdef MOE_COMM_BLOCK_TIMES
// [num_blocks][start, end] ns of the last dispatch_impl launch.
extern "C" int moe_comm_dispatch_block_times(uint64_t* host, int num_blocks) {
    return copy_block_times(g_dispatch_block_times, host, num_blocks);
}
#endif
