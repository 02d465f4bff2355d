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

// `bytes` from `src` to `dst` by a copy engine (either may be a peer's memory mapped here).
int moe_comm_copy(void* dst, const void* src, int64_t bytes, cudaStream_t stream) {
    const cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream);
    MOE_COMM_REQUIRE(err == cudaSuccess, "cudaMemcpyAsync(%p <- %p, %lld bytes): %s", dst, src,
                     static_cast<long long>(bytes), cudaGetErrorString(err));
    return 0;
}

}  // extern "C"
