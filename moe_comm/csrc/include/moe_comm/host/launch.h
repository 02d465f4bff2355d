// Host side of the launchers (kernels/*.cu): a launcher returns 0, or 1 after leaving a message that names the
// failed condition with its values, or the CUDA error of the launch; moe_comm_last_error() returns it and the
// Python side raises it as a RuntimeError. Plain C++ with the CUDA runtime, no torch headers.
#pragma once

#include <cuda_runtime.h>

#include <cstring>

#include "moe_comm/abi.h"
#include "moe_comm/common/tuning.cuh"

namespace moe_comm {

// printf-style; the message of this thread's last failure (kernels/runtime.cu).
void set_last_error(const char* format, ...) __attribute__((format(printf, 1, 2)));

inline const char* file_name(const char* path) {
    const char* slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}

// 0, or 1 with the launch's CUDA error named.
inline int launch_result(const char* kernel, int num_blocks, int num_threads, int64_t smem_bytes) {
    const cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess) return 0;
    set_last_error("launch of %s (%d blocks x %d threads, %lld bytes of dynamic shared memory) failed: %s (%s)",
                   kernel, num_blocks, num_threads, static_cast<long long>(smem_bytes), cudaGetErrorName(err),
                   cudaGetErrorString(err));
    return 1;
}

#ifdef MOE_COMM_BLOCK_TIMES
// Copy the first `num_blocks` rows ([start, end] ns, or a row of steps) of a kernel's last launch from its
// __device__ array (tuning.cuh BLOCK_TIME_*, STEP_TIME).
template <typename Times>
int copy_block_times(const Times& times, uint64_t* host, int num_blocks) {
    if (num_blocks < 0 || num_blocks > kMaxTimedBlocks) {
        set_last_error("block times: num_blocks=%d is outside [0, %d]", num_blocks, kMaxTimedBlocks);
        return 1;
    }
    const cudaError_t err = cudaMemcpyFromSymbol(host, times, sizeof(times[0]) * num_blocks);
    if (err != cudaSuccess) set_last_error("block times: cudaMemcpyFromSymbol: %s", cudaGetErrorString(err));
    return err == cudaSuccess ? 0 : 1;
}
#endif

}  // namespace moe_comm

// In a launcher: when `condition` is false, leave "file:line: launcher: `condition` failed (values)" and return 1.
#define MOE_COMM_REQUIRE(condition, values_format, ...)                                                          \
    do {                                                                                                       \
        if (!(condition)) {                                                                                    \
            ::moe_comm::set_last_error("%s:%d: %s: `%s` failed (" values_format ")",                           \
                                       ::moe_comm::file_name(__FILE__), __LINE__, __func__, #condition,        \
                                       ##__VA_ARGS__);                                                         \
            return 1;                                                                                          \
        }                                                                                                      \
    } while (0)

namespace moe_comm {

// The opt-in to more than 48 KB of dynamic shared memory is a per-device setting of a kernel function: made once
// per device (`opted_in`: the launcher's own flags).
template <typename Kernel>
int opt_in_shared_memory(Kernel kernel, bool (&opted_in)[kMaxDevices]) {
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    MOE_COMM_REQUIRE(err == cudaSuccess && device >= 0 && device < kMaxDevices, "cudaGetDevice: %s, device=%d",
                     cudaGetErrorString(err), device);
    if (!opted_in[device]) {
        err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxDynamicSmem);
        if (err != cudaSuccess) cudaGetLastError();  // not sticky: later launches must not report it again
        MOE_COMM_REQUIRE(err == cudaSuccess, "cudaFuncSetAttribute(MaxDynamicSharedMemorySize=%lld): %s",
                         static_cast<long long>(kMaxDynamicSmem), cudaGetErrorString(err));
        opted_in[device] = true;
    }
    return 0;
}

}  // namespace moe_comm
