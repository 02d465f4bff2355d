// Launcher of the non-expand receiver's per-row sum (include/moe_comm/impls/expert_sum.cuh).
#include "moe_comm/host/launch.h"
#include "moe_comm/impls/expert_sum.cuh"

using namespace moe_comm;

namespace {

template <typename T, typename Acc>
int launch(const void* rows, const int64_t* bag_rows, const int64_t* bag_offsets, int64_t num_bags,
           int64_t row_elems, void* out, int num_blocks, cudaStream_t stream) {
    const bool vectors = (row_elems * sizeof(T)) % 16 == 0 && reinterpret_cast<uintptr_t>(rows) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(out) % 16 == 0;
    expert_sum_impl<T, Acc><<<num_blocks, 256, 0, stream>>>(static_cast<const T*>(rows), bag_rows, bag_offsets,
                                                             num_bags, row_elems, vectors, static_cast<T*>(out));
    return launch_result("expert_sum_impl", num_blocks, 256, 0);
}

}  // namespace

// out[b] = the sum of rows bag_rows[bag_offsets[b] .. bag_offsets[b + 1]) for b < num_bags (device arrays, row
// indices already inside `rows`), dtype kDtype*: FP32 sums of bf16 and float32, FP64 of float64.
int moe_comm_expert_sum(const void* rows, const int64_t* bag_rows, const int64_t* bag_offsets, int64_t num_bags,
                        int64_t row_elems, void* out, int dtype, int num_blocks, cudaStream_t stream) {
    MOE_COMM_REQUIRE(num_bags >= 0 && row_elems >= 0 && num_blocks >= 1 &&
                         (dtype == kDtypeBfloat16 || dtype == kDtypeFloat32 || dtype == kDtypeFloat64),
                     "num_bags=%lld, row_elems=%lld, num_blocks=%d, dtype=%d", static_cast<long long>(num_bags),
                     static_cast<long long>(row_elems), num_blocks, dtype);
    if (num_bags == 0 || row_elems == 0) return 0;
    switch (dtype) {
        case kDtypeBfloat16:
            return launch<__nv_bfloat16, float>(rows, bag_rows, bag_offsets, num_bags, row_elems, out, num_blocks,
                                                stream);
        case kDtypeFloat32:
            return launch<float, float>(rows, bag_rows, bag_offsets, num_bags, row_elems, out, num_blocks, stream);
        default:
            return launch<double, double>(rows, bag_rows, bag_offsets, num_bags, row_elems, out, num_blocks, stream);
    }
}
