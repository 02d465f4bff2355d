// Launchers of the first steps of a fresh dispatch: the layout with the notify run by its last block
// (include/moe_comm/impls/layout.cuh), and the notify alone (impls/notify.cuh), for a cached dispatch whose ranks
// check their agreement (MOE_COMM_CHECK_INPUTS).
#include "moe_comm/host/launch.h"
#include "moe_comm/impls/layout.cuh"

using namespace moe_comm;

namespace {

int check_notify(const EpParams* p, const NotifyArgs* n) {
    MOE_COMM_REQUIRE(p->num_ranks >= 1 && p->num_ranks <= kMaxRanks, "num_ranks=%d, kMaxRanks=%d", p->num_ranks,
                     kMaxRanks);
    MOE_COMM_REQUIRE(kSignatureLen + p->num_local_experts + 2 <= kSlotStride,
                     "num_local_experts=%d, kSlotStride=%lld", p->num_local_experts,
                     static_cast<long long>(kSlotStride));
    MOE_COMM_REQUIRE(n->summary != nullptr || n->pending_flags != nullptr, "summary=%p, pending_flags=%p",
                     static_cast<void*>(n->summary), static_cast<void*>(n->pending_flags));
    return 0;
}

}  // namespace

extern "C" int moe_comm_layout(const EpParams* p, const LayoutArgs* a, const NotifyArgs* n, cudaStream_t stream) {
    if (check_notify(p, n)) return 1;
    MOE_COMM_REQUIRE(p->num_experts % p->num_ranks == 0, "num_experts=%d, num_ranks=%d", p->num_experts,
                     p->num_ranks);
    EpParams q = *p;
    q.with_barrier = 0;  // the notify runs its own barrier
    const int num_blocks = p->num_ranks + p->num_experts;  // one per destination rank, then one per expert
    layout_notify_impl<<<num_blocks, kLayoutThreads, 0, stream>>>(q, *a, *n);
    return launch_result("layout_notify_impl", num_blocks, kLayoutThreads, 0);
}

extern "C" int moe_comm_dispatch_notify(const EpParams* p, const NotifyArgs* n, cudaStream_t stream) {
    if (check_notify(p, n)) return 1;
    // Thread d < num_ranks talks to rank d; all threads copy what arrived (a few hundred values: with one warp
    // the copies were ~20 us of serial global loads).
    dispatch_notify_impl<<<1, kNotifyThreads, 0, stream>>>(*p, *n);
    return launch_result("dispatch_notify_impl", 1, kNotifyThreads, 0);
}
