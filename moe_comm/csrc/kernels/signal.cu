// Launchers of the flags beside copy-engine transfers (include/moe_comm/impls/signal.cuh) and the copy itself.
#include "moe_comm/host/launch.h"
#include "moe_comm/impls/signal.cuh"

using namespace moe_comm;

extern "C" {

// Make `stream` wait until *flag >= expected (`p` gives the timeout, the ErrorRecord, the abort word, the rank).
int moe_comm_wait_flag(const EpParams* p, const int64_t* flag, int64_t expected, int peer, int phase,
                       cudaStream_t stream) {
    MOE_COMM_REQUIRE(flag != nullptr && p->error != nullptr && p->local_base != nullptr,
                     "flag=%p, error=%p, local_base=%p", static_cast<const void*>(flag), static_cast<void*>(p->error),
                     static_cast<void*>(p->local_base));
    wait_flag_impl<<<1, 32, 0, stream>>>(*p, flag, expected, peer, phase);
    return launch_result("wait_flag_impl", 1, 32, 0);
}

// *flag = value (release, system scope) once `stream`'s earlier work is done.
int moe_comm_signal_flag(int64_t* flag, int64_t value, cudaStream_t stream) {
    MOE_COMM_REQUIRE(flag != nullptr, "flag=%p", static_cast<void*>(flag));
    signal_flag_impl<<<1, 32, 0, stream>>>(flag, value);
    return launch_result("signal_flag_impl", 1, 32, 0);
}

// Make `stream` wait until flags[i] >= expected for every i < n but this rank (n <= kMaxRanks).
int moe_comm_wait_flags(const EpParams* p, const int64_t* flags, int n, int64_t expected, int phase,
                        cudaStream_t stream) {
    MOE_COMM_REQUIRE(flags != nullptr && n >= 1 && n <= kMaxRanks && p->error != nullptr, "flags=%p, n=%d",
                     static_cast<const void*>(flags), n);
    wait_flags_impl<<<1, 32, 0, stream>>>(*p, flags, n, expected, phase);
    return launch_result("wait_flags_impl", 1, 32, 0);
}

// *targets[i] = value for every i < n (a device array of flag addresses; null entries skipped).
int moe_comm_signal_flags(int64_t* const* targets, int n, int64_t value, cudaStream_t stream) {
    MOE_COMM_REQUIRE(targets != nullptr && n >= 1 && n <= kMaxRanks, "targets=%p, n=%d",
                     static_cast<const void*>(targets), n);
    signal_flags_impl<<<1, 32, 0, stream>>>(targets, n, value);
    return launch_result("signal_flags_impl", 1, 32, 0);
}

// The reduce-scatter's sum of `num_slots` slots into `out` (dtype: kDtype*; FP32 sums of bf16 and float32, FP64 of
// float64).
int moe_comm_reduce_slots(const void* slots, int64_t slot_stride, int num_slots, int64_t numel, void* out, int dtype,
                          int num_blocks, cudaStream_t stream) {
    MOE_COMM_REQUIRE(num_slots >= 1 && numel >= 0 && num_blocks >= 1 &&
                         (dtype == kDtypeBfloat16 || dtype == kDtypeFloat32 || dtype == kDtypeFloat64),
                     "num_slots=%d, numel=%lld, num_blocks=%d, dtype=%d", num_slots, static_cast<long long>(numel),
                     num_blocks, dtype);
    if (numel == 0) return 0;
    const auto* base = static_cast<const uint8_t*>(slots);
    switch (dtype) {
        case kDtypeBfloat16:
            reduce_slots_impl<__nv_bfloat16, float><<<num_blocks, 256, 0, stream>>>(
                base, slot_stride, num_slots, numel, static_cast<__nv_bfloat16*>(out));
            break;
        case kDtypeFloat32:
            reduce_slots_impl<float, float><<<num_blocks, 256, 0, stream>>>(base, slot_stride, num_slots, numel,
                                                                           static_cast<float*>(out));
            break;
        default:
            reduce_slots_impl<double, double><<<num_blocks, 256, 0, stream>>>(base, slot_stride, num_slots, numel,
                                                                             static_cast<double*>(out));
    }
    return launch_result("reduce_slots_impl", num_blocks, 256, 0);
}

// `bytes` from `src` to `dst` by a copy engine (either may be a peer's memory mapped here); none for 0 bytes (an
// empty tensor's address may be null, which cudaMemcpyDefault cannot place).
int moe_comm_copy(void* dst, const void* src, int64_t bytes, cudaStream_t stream) {
    if (bytes == 0) return 0;
    const cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream);
    if (err != cudaSuccess) cudaGetLastError();  // not left for the next launch check to report
    MOE_COMM_REQUIRE(err == cudaSuccess, "cudaMemcpyAsync(%p <- %p, %lld bytes): %s", dst, src,
                     static_cast<long long>(bytes), cudaGetErrorString(err));
    return 0;
}

}  // extern "C"
