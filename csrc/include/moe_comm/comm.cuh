// Device-side primitives for peer-memory communication: system-scope release/acquire flags, the one strided
// 16-byte copy loop both kernel files use, and the one timeout helper every spin-wait goes through. No torch
// headers: this compiles with plain nvcc.
#pragma once

#include <cuda_runtime.h>

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

// How a copy loads its source: plain, read-only through the non-coherent path (`__ldg`, data nobody writes during
// the kernel), or through L2 only (`__ldcg`, data that peers wrote: L1 is not coherent with their stores).
enum class Load { kPlain, kReadOnly, kL2 };

template <Load kLoad>
__device__ __forceinline__ int4 load16(const int4* ptr) {
    if constexpr (kLoad == Load::kReadOnly) return __ldg(ptr);
    else if constexpr (kLoad == Load::kL2) return __ldcg(ptr);
    else return *ptr;
}

// Copy n 16-byte vectors, this thread taking vectors first, first + stride, ... with kUnroll loads in flight before
// the stores (the pointers may alias as far as the compiler knows, so the order is spelled out). A warp copies
// with first = lane and stride = 32, a whole grid with first = its thread index and stride = its thread count.
// NOTES: the last batch is predicated, not a one-vector-at-a-time tail loop: with unroll 8 a 14 KB row left
// 4 serial load round trips in such a tail, which ate the whole gain of the wider batches.
template <int kUnroll, Load kLoad>
__device__ __forceinline__ void strided_copy16(int4* dst, const int4* src, int64_t n, int64_t first, int64_t stride) {
    for (int64_t i = first; i < n; i += kUnroll * stride) {
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (i + u * stride < n) v[u] = load16<kLoad>(src + i + u * stride);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (i + u * stride < n) dst[i + u * stride] = v[u];
    }
}

// Bulk copies through shared memory (TMA, sm_90): one thread moves a whole chunk global -> shared
// (cp.async.bulk with an mbarrier that counts the bytes) and shared -> global (bulk_group store), so a chunk of
// kilobytes costs a few instructions and no registers. Addresses and sizes must be multiples of 16.
__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)) : "memory");
    // The async proxy (the bulk copies) must see the initialized barrier.
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Wait until phase `parity` of the barrier completed (the chunk it counts has landed in shared memory).
// NOTES: no timeout: it waits for a local copy, which always completes.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "wait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n"
        "}\n" ::"r"(smem_u32(bar)),
        "r"(parity)
        : "memory");
}

// Load `bytes` from global memory into shared memory; `bar`'s current phase completes when they have landed.
__device__ __forceinline__ void bulk_load(void* smem, const void* gmem, uint32_t bytes, uint64_t* bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(smem)), "l"(gmem), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}

// Store `bytes` from shared memory to global memory, in the current bulk group (bulk_commit closes it).
__device__ __forceinline__ void bulk_store(void* gmem, const void* smem, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem), "r"(smem_u32(smem)),
                 "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Every committed bulk store has read its shared memory (the buffer may be refilled).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

// Every committed bulk store has completed.
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Order this thread's earlier generic-proxy accesses (an acquire of what peers wrote, reads of shared memory)
// before its later bulk copies, which go through the async proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async;" ::: "memory"); }

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
