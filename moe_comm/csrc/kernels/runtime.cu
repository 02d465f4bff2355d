// What the host needs besides kernels: host-mapped memory (the ErrorRecord and the notify summary), the wait for a
// synchronized dispatch's notify, a refused call's barrier and the clearing of a disagreement, the message of the
// last failure, and the ABI table that the host compares with its ctypes structs (moe_comm/layout.py).
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstring>

#include "moe_comm/common/comm.cuh"
#include "moe_comm/common/rows.cuh"
#include "moe_comm/common/tuning.cuh"
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

// The barrier of an operation whose arguments this rank refused, run as a kernel with the barrier fused in (one
// block), with the refusal as its signature: the peers' kernels of that operation see the disagreement and move
// nothing, and every rank raises it at its next synchronizing call, instead of the peers waiting for this rank until
// their timeout. Nothing when this rank is already aborted (as every operation's kernel).
__global__ void __launch_bounds__(kThreadsPerBlock) refuse_impl(EpParams p) {
    if (!block_aborted(p)) barrier_arrive_and_wait(p, true);
    kernel_done(p);
}

// The record's code, then the abort word, from kErrorDisagree to 0, each only if it still holds the disagreement: a
// copy-engine wait on another stream that timed out meanwhile took both over (comm.cuh wait_flag) and keeps them.
// Whatever order the two run in, the record and the abort word end up agreeing.
__global__ void clear_disagreement_impl(uint8_t* local_base, ErrorRecord* error) {
    const auto disagree = static_cast<unsigned long long>(kErrorDisagree);
    if (atomicCAS(reinterpret_cast<unsigned long long*>(&error->code), disagree, 0ull) == disagree)
        atomicCAS(reinterpret_cast<unsigned long long*>(abort_word(local_base)), disagree, 0ull);
    __threadfence_system();
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

// Wait for a synchronized dispatch's notify before the host extension reads its summary (csrc/torch/ops.cpp, without
// the GIL): until the notify writes `value` (this call's number) into `*done` (host-mapped), or until `stream` has
// nothing left to run (a kernel that stopped before its summary: what it recorded in the ErrorRecord says why). The
// acquire fence orders the caller's reads of the summary after the read that saw `value` (needed on ARM hosts).
// NOTES: polling the word instead of cudaStreamSynchronize leaves out the layout kernel's exit and the stream's
// completion signal (benchmarks/NOTES.md, fourteenth session).
int moe_comm_wait_notify(const volatile int64_t* done, int64_t value, cudaStream_t stream) {
    for (uint32_t spin = 1; *done != value; ++spin) {
        if (spin % 4096) continue;  // the stream now and then: a query costs more than a read of the word
        const cudaError_t err = cudaStreamQuery(stream);
        if (err == cudaErrorNotReady) continue;
        MOE_COMM_REQUIRE(err == cudaSuccess, "cudaStreamQuery: %s (%s)", cudaGetErrorName(err),
                         cudaGetErrorString(err));
        break;
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    return 0;
}

// Zeroed device memory that other processes of this machine can map (`*handle`: a cudaIpcMemHandle_t, 64 bytes):
// the CUDA backend's buffer when its peers are mapped with CUDA IPC instead of torch's symmetric memory
// (CudaTuning.peer_memory="ipc", which also lets two ranks share one GPU).
int moe_comm_ipc_alloc(int64_t bytes, void** ptr, void* handle) {
    cudaError_t err = cudaMalloc(ptr, bytes);
    if (err != cudaSuccess) cudaGetLastError();  // not left for the next launch check to report
    MOE_COMM_REQUIRE(err == cudaSuccess, "cudaMalloc(%lld bytes): %s", static_cast<long long>(bytes),
                     cudaGetErrorString(err));
    err = cudaMemset(*ptr, 0, bytes);
    if (err == cudaSuccess) err = cudaIpcGetMemHandle(static_cast<cudaIpcMemHandle_t*>(handle), *ptr);
    if (err != cudaSuccess) {
        cudaGetLastError();
        cudaFree(*ptr);
    }
    MOE_COMM_REQUIRE(err == cudaSuccess, "zeroing or exporting %lld bytes: %s", static_cast<long long>(bytes),
                     cudaGetErrorString(err));
    return 0;
}

// A peer's memory from its handle (moe_comm_ipc_alloc in that process).
int moe_comm_ipc_open(const void* handle, void** ptr) {
    cudaIpcMemHandle_t h;
    memcpy(&h, handle, sizeof(h));
    const cudaError_t err = cudaIpcOpenMemHandle(ptr, h, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) cudaGetLastError();
    MOE_COMM_REQUIRE(err == cudaSuccess, "cudaIpcOpenMemHandle: %s", cudaGetErrorString(err));
    return 0;
}

int moe_comm_ipc_close(void* ptr) {
    const cudaError_t err = cudaIpcCloseMemHandle(ptr);
    MOE_COMM_REQUIRE(err == cudaSuccess, "cudaIpcCloseMemHandle: %s", cudaGetErrorString(err));
    return 0;
}

int moe_comm_ipc_free(void* ptr) {
    const cudaError_t err = cudaFree(ptr);
    MOE_COMM_REQUIRE(err == cudaSuccess, "cudaFree: %s", cudaGetErrorString(err));
    return 0;
}

// A refused call's barrier (refuse_impl): p carries the buffer, the rank, the timeout, the barrier's phase and the
// refusal's signature, with the barrier fused in.
int moe_comm_refuse(const EpParams* p, cudaStream_t stream) {
    MOE_COMM_REQUIRE(p->with_barrier == 1 && p->num_ranks >= 1 && p->num_ranks <= kWarpSize && p->local_base &&
                         p->error,
                     "with_barrier=%d, num_ranks=%d, local_base=%p, error=%p", p->with_barrier, p->num_ranks,
                     static_cast<void*>(p->local_base), static_cast<void*>(p->error));
    refuse_impl<<<1, kThreadsPerBlock, 0, stream>>>(*p);
    return launch_result("refuse_impl", 1, kThreadsPerBlock, 0);
}

// After ranks disagreed (the host realigns at a synchronizing call): clear the record and the abort word on `stream`
// unless a timeout took them over (clear_disagreement_impl); the host reads the record's code after the stream.
int moe_comm_clear_disagreement(uint8_t* local_base, ErrorRecord* error, cudaStream_t stream) {
    MOE_COMM_REQUIRE(local_base != nullptr && error != nullptr, "local_base=%p, error=%p",
                     static_cast<void*>(local_base), static_cast<void*>(error));
    clear_disagreement_impl<<<1, 1, 0, stream>>>(local_base, error);
    return launch_result("clear_disagreement_impl", 1, 1, 0);
}

// Copies up to `capacity` values of kAbiTable into `out`; returns how many the table has.
int moe_comm_abi(int64_t* out, int capacity) {
    const int n = static_cast<int>(sizeof(kAbiTable) / sizeof(kAbiTable[0]));
    for (int i = 0; i < n && i < capacity; ++i) out[i] = kAbiTable[i];
    return n;
}

}  // extern "C"
