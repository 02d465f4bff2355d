// Launcher of the first step of a fresh dispatch: the layout with the notify run by its last block
// (include/moe_comm/impls/layout.cuh, impls/notify.cuh).
#include "moe_comm/host/launch.h"
#include "moe_comm/impls/layout.cuh"

using namespace moe_comm;

namespace {

int check_notify(const EpParams* p, const NotifyArgs* n) {
    MOE_COMM_REQUIRE(p->num_ranks >= 1 && p->num_ranks <= kMaxRanks, "num_ranks=%d, kMaxRanks=%d", p->num_ranks,
                     kMaxRanks);
    MOE_COMM_REQUIRE(p->num_local_experts + 2 <= kSlotStride,
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
