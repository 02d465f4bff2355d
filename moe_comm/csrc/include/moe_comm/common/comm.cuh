// Synchronization between ranks over peer memory: system-scope release/acquire flags, the one timeout helper every
// spin-wait goes through, and the barrier every operation starts with. No torch headers: plain nvcc builds this.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "moe_comm/abi.h"

namespace moe_comm {

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

// Tell every rank that this rank reached this point of a phase, then wait until every rank told us the same:
// thread d of the block signals and waits for rank d (every thread of the block must call this). The phase's flags
// are an int64 array [num_ranks] at `flags_offset` of every buffer (written by peers); its sequence counter, at
// `seq_offset` of our buffer, lives on the device so that CUDA graph replays advance it. On return every rank has
// arrived, or a wait timed out (recorded in `error`; after a timeout anywhere later waits return at once and the
// host raises at its next check). Release at system scope: whatever this stream wrote before is visible to a
// peer that has seen the flag.
__device__ __forceinline__ void signal_wait_block(uint8_t* const* peer_bases, uint8_t* local_base, ErrorRecord* error,
                                                  int64_t flags_offset, int64_t seq_offset, uint64_t timeout_ns,
                                                  int rank, int num_ranks, int phase) {
    __shared__ int64_t seq;
    __syncthreads();  // a previous call's waiters are done with `seq`
    if (threadIdx.x == 0) {
        int64_t* counter = reinterpret_cast<int64_t*>(local_base + seq_offset);
        seq = *counter + 1;
        *counter = seq;
    }
    __syncthreads();
    const int peer = threadIdx.x;
    if (peer < num_ranks) {
        __threadfence_system();
        st_release_sys(reinterpret_cast<int64_t*>(peer_bases[peer] + flags_offset) + rank, seq);
        if (*reinterpret_cast<volatile int64_t*>(&error->code) == 0)
            wait_flag_at_least(reinterpret_cast<const int64_t*>(local_base + flags_offset) + peer, seq, timeout_ns,
                               error, rank, phase, peer);
    }
    __syncthreads();
}

}  // namespace moe_comm
