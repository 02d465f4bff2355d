// Launchers of the handshakes (include/moe_comm/impls/notify.cuh): the barrier before every operation and the
// dispatch notify (barrier, counts, exchange).
#include "moe_comm/host/launch.h"
#include "moe_comm/impls/notify.cuh"

namespace moe_comm {

int launch_barrier(const EpParams& p, cudaStream_t stream) {
    MOE_COMM_REQUIRE(p.num_ranks >= 1 && p.num_ranks <= kMaxRanks, "num_ranks=%d, kMaxRanks=%d", p.num_ranks,
                     kMaxRanks);
    barrier_impl<<<1, kMaxRanks, 0, stream>>>(p);
    return launch_result("barrier_impl", 1, kMaxRanks, 0);
}

}  // namespace moe_comm

using namespace moe_comm;

extern "C" int moe_comm_barrier(const EpParams* p, cudaStream_t stream) { return launch_barrier(*p, stream); }

extern "C" int moe_comm_dispatch_notify(const EpParams* p, const NotifyArgs* n, cudaStream_t stream) {
    MOE_COMM_REQUIRE(p->num_ranks >= 1 && p->num_ranks <= kMaxRanks, "num_ranks=%d, kMaxRanks=%d", p->num_ranks,
                     kMaxRanks);
    MOE_COMM_REQUIRE(kSignatureLen + p->num_local_experts + 2 <= kSlotStride,
                     "num_local_experts=%d, kSlotStride=%lld", p->num_local_experts,
                     static_cast<long long>(kSlotStride));
    MOE_COMM_REQUIRE(n->summary != nullptr || n->pending_flags != nullptr, "summary=%p, pending_flags=%p",
                     static_cast<void*>(n->summary), static_cast<void*>(n->pending_flags));
    // Thread d < num_ranks talks to rank d; all threads copy what arrived (a few hundred values: with one warp
    // the copies were ~20 us of serial global loads).
    dispatch_notify_impl<<<1, kNotifyThreads, 0, stream>>>(*p, *n);
    return launch_result("dispatch_notify_impl", 1, kNotifyThreads, 0);
}
