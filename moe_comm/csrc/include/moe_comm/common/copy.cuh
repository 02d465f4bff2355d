// Copies: the strided 16-byte loop, warp-level row copies, and bulk copies through shared
// memory (TMA). Device code only, no torch headers; benchmarks/microbench/copy_bench.cu uses it too.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moe_comm {

// Copy n 16-byte vectors, this thread taking vectors first, first + stride, ... with kUnroll loads in flight before
// the stores (the pointers may alias as far as the compiler knows, so the order is spelled out).
// NOTES: the last batch is predicated, not a one-vector-at-a-time tail loop: with unroll 8 a 14 KB row left
// 4 serial load round trips in such a tail, which ate the whole gain of the wider batches.
template <int kUnroll>
__device__ __forceinline__ void strided_copy16(int4* dst, const int4* src, int64_t n, int64_t first, int64_t stride) {
    for (int64_t i = first; i < n; i += kUnroll * stride) {
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (i + u * stride < n) v[u] = src[i + u * stride];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (i + u * stride < n) dst[i + u * stride] = v[u];
    }
}

// Load 16 bytes that nobody writes during the kernel, bypassing L1 (each row is read once).
__device__ __forceinline__ int4 ld_nc_v4(const int4* ptr) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
    return v;
}

// Copy `bytes` (a multiple of 16) with the lanes of one warp, kUnroll loads in flight per lane.
template <int kUnroll>
__device__ __forceinline__ void warp_copy16(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane) {
    strided_copy16<kUnroll>(reinterpret_cast<int4*>(dst), reinterpret_cast<const int4*>(src), bytes / 16, lane, 32);
}

template <bool kViaL2 = false>
__device__ __forceinline__ void warp_copy4(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane) {
    const int* s = reinterpret_cast<const int*>(src);
    int* d = reinterpret_cast<int*>(dst);
    for (int64_t i = lane; i < bytes / 4; i += 32) d[i] = kViaL2 ? __ldcg(s + i) : s[i];
}

__device__ __forceinline__ void warp_zero16(uint8_t* dst, int64_t bytes, int lane) {
    int4* d = reinterpret_cast<int4*>(dst);
    for (int64_t i = lane; i < bytes / 16; i += 32) d[i] = make_int4(0, 0, 0, 0);
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

}  // namespace moe_comm
