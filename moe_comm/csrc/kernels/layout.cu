// Launcher of the first step of a fresh dispatch: the layout with the notify run by its last block
// (include/moe_comm/impls/layout.cuh, impls/notify.cuh), a cooperative launch (its blocks meet at grid barriers).
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
    MOE_COMM_REQUIRE((n->summary == nullptr) == (n->summary_done == nullptr), "summary=%p, summary_done=%p",
                     static_cast<void*>(n->summary), static_cast<void*>(n->summary_done));
    return 0;
}

}  // namespace

extern "C" int moe_comm_layout(const EpParams* p, const LayoutArgs* a, const NotifyArgs* n, cudaStream_t stream) {
    if (check_notify(p, n)) return 1;
    MOE_COMM_REQUIRE(p->num_experts % p->num_ranks == 0 && p->num_local_experts == p->num_experts / p->num_ranks,
                     "num_experts=%d, num_ranks=%d, num_local_experts=%d", p->num_experts, p->num_ranks,
                     p->num_local_experts);
    MOE_COMM_REQUIRE(a->num_blocks >= 1 && a->num_blocks <= kLayoutMaxBlocks && a->scratch != nullptr,
                     "num_blocks=%d (at most %d), scratch=%p", a->num_blocks, kLayoutMaxBlocks,
                     static_cast<void*>(a->scratch));
    // Shared memory (LayoutShared, moe_comm.layout.layout_smem_bytes, which the host checks first).
    static_assert(kLayoutSmemWordsPerColumn == 2 * kLayoutWarps + 1, "LayoutShared: hits, first, running per column");
    const int64_t columns = p->num_ranks + p->num_experts;
    const int64_t smem_bytes = 4 * (kLayoutSmemWordsPerColumn * columns + kLayoutSmemWordsFixed);
    MOE_COMM_REQUIRE(smem_bytes <= kMaxDynamicSmem, "num_experts=%d needs %lld bytes of shared memory (limit %lld)",
                     p->num_experts, static_cast<long long>(smem_bytes), static_cast<long long>(kMaxDynamicSmem));
    static bool opted_in[kMaxDevices] = {};
    if (opt_in_shared_memory(layout_notify_impl, opted_in)) return 1;
    EpParams q = *p;
    q.with_barrier = 0;  // the notify runs its own barrier
    LayoutArgs args = *a;
    NotifyArgs notify = *n;
    void* kernel_args[] = {&q, &args, &notify};
    const cudaError_t err = cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(layout_notify_impl),
                                                        a->num_blocks, kLayoutThreads, kernel_args, smem_bytes,
                                                        stream);
    if (err != cudaSuccess) cudaGetLastError();
    MOE_COMM_REQUIRE(err == cudaSuccess, "cooperative launch of layout_notify_impl (%d blocks x %d threads, %lld "
                     "bytes of dynamic shared memory): %s", a->num_blocks, kLayoutThreads,
                     static_cast<long long>(smem_bytes), cudaGetErrorString(err));
    return 0;
}

#ifdef MOE_COMM_BLOCK_TIMES
// [num_blocks][kLayoutSteps] ns of the last layout_notify_impl launch (impls/notify.cuh).
extern "C" int moe_comm_layout_step_times(uint64_t* host, int num_blocks) {
    return copy_block_times(g_layout_step_times, host, num_blocks);
}
#endif
