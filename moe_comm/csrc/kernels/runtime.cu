// What the host needs besides kernels: host-mapped memory (the ErrorRecord and the notify summary), the message of
// the last failure, and the ABI table that the host compares with its ctypes structs (moe_comm/layout.py).
#include <cstdarg>
#include <cstdio>
#include <cstring>

#include "moe_comm/host/launch.h"

namespace moe_comm {

namespace {
thread_local char g_last_error[1024] = "";
}  // namespace

void set_last_error(const char* format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(g_last_error, sizeof(g_last_error), format, args);
    va_end(args);
}

}  // namespace moe_comm

using namespace moe_comm;

extern "C" {

const char* moe_comm_last_error() { return g_last_error; }

// `bytes` of zeroed host-mapped memory: `*host` for the CPU, `*device` for kernels.
int moe_comm_alloc_mapped(int64_t bytes, void** host, void** device) {
    cudaError_t err = cudaHostAlloc(host, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
    MOE_COMM_REQUIRE(err == cudaSuccess, "cudaHostAlloc(%lld bytes): %s", static_cast<long long>(bytes),
                     cudaGetErrorString(err));
    memset(*host, 0, bytes);
    err = cudaHostGetDevicePointer(device, *host, 0);
    MOE_COMM_REQUIRE(err == cudaSuccess, "cudaHostGetDevicePointer: %s", cudaGetErrorString(err));
    return 0;
}

int moe_comm_free_mapped(void* host) {
    const cudaError_t err = cudaFreeHost(host);
    MOE_COMM_REQUIRE(err == cudaSuccess, "cudaFreeHost: %s", cudaGetErrorString(err));
    return 0;
}

// Copies up to `capacity` values of kAbiTable into `out`; returns how many the table has.
int moe_comm_abi(int64_t* out, int capacity) {
    const int n = static_cast<int>(sizeof(kAbiTable) / sizeof(kAbiTable[0]));
    for (int i = 0; i < n && i < capacity; ++i) out[i] = kAbiTable[i];
    return n;
}

}  // extern "C"
