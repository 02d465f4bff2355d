// Launcher of the layout kernel (include/moe_comm/impls/layout.cuh).
#include "moe_comm/host/launch.h"
#include "moe_comm/impls/layout.cuh"

using namespace moe_comm;

extern "C" int moe_comm_layout(const EpParams* p, const LayoutArgs* a, cudaStream_t stream) {
    MOE_COMM_REQUIRE(p->num_ranks >= 1 && p->num_ranks <= kMaxRanks, "num_ranks=%d, kMaxRanks=%d", p->num_ranks,
                     kMaxRanks);
    MOE_COMM_REQUIRE(p->num_experts % p->num_ranks == 0, "num_experts=%d, num_ranks=%d", p->num_experts,
                     p->num_ranks);
    const int num_blocks = p->num_ranks + p->num_experts;  // one per destination rank, then one per expert
    layout_impl<<<num_blocks, kLayoutThreads, 0, stream>>>(a->topk_idx, p->num_tokens, p->num_topk, p->num_experts,
                                                           p->num_ranks, a->clean_idx, a->send_pos, a->expert_rank,
                                                           a->num_tokens_per_rank, a->num_tokens_per_expert,
                                                           a->flags);
    return launch_result("layout_impl", num_blocks, kLayoutThreads, 0);
}
