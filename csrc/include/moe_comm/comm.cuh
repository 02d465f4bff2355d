// Device-side primitives for peer-memory communication: system-scope release/acquire flags and the one
// timeout helper every spin-wait goes through. No torch headers: this compiles with plain nvcc.
#pragma once

#include <cstdint>
#include <cstdio>

namespace moe_comm {

// What a timed-out wait leaves for the host (host-mapped memory, read by moe_comm/backends/cuda.py).
struct ErrorRecord {
    int64_t code;       // 0: no error, 1: timeout
    int64_t rank;
    int64_t phase;      // index into the host's phase names
    int64_t peer;
    int64_t observed;
    int64_t expected;
};

constexpr int64_t kErrorTimeout = 1;

__device__ __forceinline__ void st_release_sys(int64_t* ptr, int64_t value) {
    asm volatile("st.release.sys.global.s64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

__device__ __forceinline__ int64_t ld_acquire_sys(const int64_t* ptr) {
    int64_t value;
    asm volatile("ld.acquire.sys.global.s64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
    return value;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Spin until *flag >= expected (or == expected with `exact`). On timeout, record who waited for whom, print it,
// and return false (the host raises; NOTES: no __trap, so the process keeps a usable context and a traceback).
__device__ __forceinline__ bool wait_flag(const int64_t* flag, int64_t expected, bool exact, uint64_t timeout_ns,
                                          ErrorRecord* error, int rank, int phase, int peer) {
    const uint64_t start = global_timer_ns();
    int64_t observed = ld_acquire_sys(flag);
    while (exact ? observed != expected : observed < expected) {
        if (global_timer_ns() - start > timeout_ns) {
            // Only the first failing waiter fills the record and prints.
            if (atomicCAS(reinterpret_cast<unsigned long long*>(&error->code), 0ull,
                          static_cast<unsigned long long>(kErrorTimeout)) == 0ull) {
                error->rank = rank;
                error->phase = phase;
                error->peer = peer;
                error->observed = observed;
                error->expected = expected;
                __threadfence_system();
                printf("moe_comm: rank %d timed out in phase %d waiting for peer %d (flag %lld, expected %lld)\n",
                       rank, phase, peer, static_cast<long long>(observed), static_cast<long long>(expected));
            }
            return false;
        }
        observed = ld_acquire_sys(flag);
    }
    return true;
}

__device__ __forceinline__ bool wait_flag_at_least(const int64_t* flag, int64_t expected, uint64_t timeout_ns,
                                                   ErrorRecord* error, int rank, int phase, int peer) {
    return wait_flag(flag, expected, false, timeout_ns, error, rank, phase, peer);
}

__device__ __forceinline__ bool wait_flag_equal(const int64_t* flag, int64_t expected, uint64_t timeout_ns,
                                                ErrorRecord* error, int rank, int phase, int peer) {
    return wait_flag(flag, expected, true, timeout_ns, error, rank, phase, peer);
}

}  // namespace moe_comm
