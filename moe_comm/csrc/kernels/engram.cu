// Launcher of the Engram fetch (include/moe_comm/impls/engram.cuh).
#include "moe_comm/host/launch.h"
#include "moe_comm/impls/engram.cuh"

using namespace moe_comm;

// out[i] = global row indices[i] of the table whose rank r holds rows [offsets[r], offsets[r + 1]) at bases[r]
// (device arrays; indices already checked to lie in [0, offsets[num_ranks])).
extern "C" int moe_comm_engram_gather(const int64_t* indices, int64_t num_rows, const int64_t* offsets, int num_ranks,
                                      const uint8_t* const* bases, int64_t row_bytes, uint8_t* out, int num_blocks,
                                      cudaStream_t stream) {
    MOE_COMM_REQUIRE(num_rows >= 0 && num_ranks >= 1 && num_ranks <= kMaxRanks && row_bytes >= 1 && num_blocks >= 1,
                     "num_rows=%lld, num_ranks=%d, row_bytes=%lld, num_blocks=%d", static_cast<long long>(num_rows),
                     num_ranks, static_cast<long long>(row_bytes), num_blocks);
    if (num_rows == 0) return 0;
    engram_gather_impl<<<num_blocks, 256, 0, stream>>>(indices, num_rows, offsets, num_ranks, bases, row_bytes, out);
    return launch_result("engram_gather_impl", num_blocks, 256, 0);
}
