// Per-SM throughput of row copies on 2 GPUs at once: the floor that the dispatch and combine kernels stand on.
//
// Every GPU copies `rows` rows of `row_bytes` from its own memory to the peer GPU, to itself, or to both (a
// dispatch row that goes to both ranks), with a fixed number of blocks, in two ways:
//   ldst: one warp per row, 16-byte loads (`unroll` in flight per lane) then stores (registers hold the bytes);
//   tma:  one warp per row stream, lane 0 moves chunks global -> shared (cp.async.bulk + mbarrier) and shared ->
//         destination (cp.async.bulk bulk_group store), `stages` chunks in flight per warp (shared memory holds
//         the bytes, the copy engine moves them).
// Both GPUs run the same kernel at the same time (NVLink loaded in both directions, as in an all-to-all).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I moe_comm/csrc/include -o /tmp/copy_bench \
//       benchmarks/microbench/copy_bench.cu && /tmp/copy_bench      (from the repository root)
// Prints one line per configuration: us per copy (slower GPU), GB/s of stored bytes, GB/s per block (SM).

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda_check.h"
#include "moe_comm/common/copy.cuh"

using namespace moe_comm;

struct Job {
    const uint8_t* src;
    uint8_t* dst0;   // first destination
    uint8_t* dst1;   // second destination or null
    int64_t rows;
    int64_t row_bytes;  // multiple of 16
};

template <int kUnroll>
__global__ void ldst_copy(Job job) {
    const int lane = threadIdx.x % 32;
    const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int64_t num_warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
    const int64_t n = job.row_bytes / 16;
    for (int64_t r = warp; r < job.rows; r += num_warps) {
        const int4* src = reinterpret_cast<const int4*>(job.src + r * job.row_bytes);
        int4* d0 = reinterpret_cast<int4*>(job.dst0 + r * job.row_bytes);
        int4* d1 = job.dst1 ? reinterpret_cast<int4*>(job.dst1 + r * job.row_bytes) : nullptr;
        for (int64_t v0 = 0; v0 < n; v0 += kUnroll * 32) {
            int4 v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int64_t i = v0 + lane + u * 32;
                if (i < n) v[u] = __ldg(src + i);
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int64_t i = v0 + lane + u * 32;
                if (i < n) {
                    d0[i] = v[u];
                    if (d1) d1[i] = v[u];
                }
            }
        }
    }
}

// Items are (row, chunk) pairs; warp w takes items w, w + num_warps, ... with `kStages` chunk buffers.
template <int kStages>
__global__ void tma_copy(Job job, int chunk_bytes) {
    extern __shared__ __align__(128) uint8_t smem[];
    const int lane = threadIdx.x % 32, warp_in_block = threadIdx.x / 32;
    const int warps_per_block = blockDim.x / 32;
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem) + warp_in_block * kStages;
    uint8_t* buf = smem + 1024 + static_cast<int64_t>(warp_in_block) * kStages * chunk_bytes;
    if (lane != 0) return;
    for (int s = 0; s < kStages; ++s) mbarrier_init(bars + s);
    const int64_t warp = static_cast<int64_t>(blockIdx.x) * warps_per_block + warp_in_block;
    const int64_t num_warps = static_cast<int64_t>(gridDim.x) * warps_per_block;
    const int64_t chunks_per_row = job.row_bytes / chunk_bytes;
    const int64_t items = job.rows * chunks_per_row;
    const int64_t my_items = warp < items ? (items - warp + num_warps - 1) / num_warps : 0;
    auto offset = [&](int64_t i) {
        const int64_t item = warp + i * num_warps;
        return (item / chunks_per_row) * job.row_bytes + (item % chunks_per_row) * chunk_bytes;
    };
    auto load = [&](int64_t i) {
        const int s = static_cast<int>(i % kStages);
        bulk_load(buf + s * chunk_bytes, job.src + offset(i), chunk_bytes, bars + s);
    };
    for (int64_t i = 0; i < my_items && i < kStages; ++i) load(i);
    for (int64_t i = 0; i < my_items; ++i) {
        const int s = static_cast<int>(i % kStages);
        mbarrier_wait(bars + s, static_cast<uint32_t>((i / kStages) & 1));
        bulk_store(job.dst0 + offset(i), buf + s * chunk_bytes, chunk_bytes);
        if (job.dst1) bulk_store(job.dst1 + offset(i), buf + s * chunk_bytes, chunk_bytes);
        bulk_commit();
        // The previous item's stores have read their buffer once at most one group (this one) is pending.
        if (i >= 1 && i - 1 + kStages < my_items) {
            asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
            load(i - 1 + kStages);
        }
    }
    bulk_wait();
}

struct Gpu {
    int dev;
    cudaStream_t stream;
    cudaEvent_t start, stop;
    uint8_t* src;
    uint8_t* local;  // written by this GPU (local copy)
    uint8_t* remote; // written by the peer
};

int main() {
    const int64_t rows = 4096, row_bytes = 7168 * 2;
    const int64_t bytes = rows * row_bytes;
    int count = 0;
    CHECK(cudaGetDeviceCount(&count));
    if (count < 2) {
        fprintf(stderr, "needs 2 GPUs\n");
        return 1;
    }
    Gpu g[2];
    for (int i = 0; i < 2; ++i) {
        g[i].dev = i;
        CHECK(cudaSetDevice(i));
        CHECK(cudaDeviceEnablePeerAccess(1 - i, 0));
        CHECK(cudaStreamCreateWithFlags(&g[i].stream, cudaStreamNonBlocking));
        CHECK(cudaEventCreate(&g[i].start));
        CHECK(cudaEventCreate(&g[i].stop));
        CHECK(cudaMalloc(&g[i].src, bytes));
        CHECK(cudaMalloc(&g[i].local, bytes));
        CHECK(cudaMalloc(&g[i].remote, bytes));
        CHECK(cudaMemset(g[i].src, 1 + i, bytes));
        CHECK(cudaFuncSetAttribute(tma_copy<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
        CHECK(cudaFuncSetAttribute(tma_copy<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
    }
    // mode 0: peer only, 1: local only, 2: both.
    const char* mode_names[] = {"peer", "local", "both"};
    auto run = [&](const char* name, int mode, int blocks, auto launch) {
        const int iters = 20;
        float worst = 0;
        for (int rep = 0; rep < 2; ++rep) {  // rep 0 warms up
            for (int i = 0; i < 2; ++i) {
                CHECK(cudaSetDevice(i));
                CHECK(cudaDeviceSynchronize());
            }
            for (int i = 0; i < 2; ++i) {
                CHECK(cudaSetDevice(i));
                Job job{g[i].src, mode == 1 ? g[i].local : g[1 - i].remote, mode == 2 ? g[i].local : nullptr, rows,
                        row_bytes};
                CHECK(cudaEventRecord(g[i].start, g[i].stream));
                for (int it = 0; it < iters; ++it) launch(job, g[i].stream);
                CHECK(cudaGetLastError());
                CHECK(cudaEventRecord(g[i].stop, g[i].stream));
            }
            worst = 0;
            for (int i = 0; i < 2; ++i) {
                CHECK(cudaSetDevice(i));
                CHECK(cudaEventSynchronize(g[i].stop));
                float ms = 0;
                CHECK(cudaEventElapsedTime(&ms, g[i].start, g[i].stop));
                worst = ms > worst ? ms : worst;
            }
        }
        const double us = worst * 1e3 / iters;
        const double stored = static_cast<double>(bytes) * (mode == 2 ? 2 : 1);
        printf("%-28s %-5s blocks %3d: %8.1f us  %7.1f GB/s  %6.1f GB/s per SM\n", name, mode_names[mode], blocks, us,
               stored / us / 1e3, stored / us / 1e3 / blocks);
        fflush(stdout);
    };
    // Check once that the TMA copy moves the right bytes (both destinations).
    {
        CHECK(cudaSetDevice(0));
        CHECK(cudaMemset(g[0].local, 0, bytes));
        Job job{g[0].src, g[0].local, nullptr, rows, row_bytes};
        tma_copy<2><<<4, 128, 1024 + 4 * 2 * 3584, g[0].stream>>>(job, 3584);
        CHECK(cudaStreamSynchronize(g[0].stream));
        std::vector<uint8_t> host(bytes);
        CHECK(cudaMemcpy(host.data(), g[0].local, bytes, cudaMemcpyDeviceToHost));
        for (int64_t i = 0; i < bytes; ++i)
            if (host[i] != 1) {
                fprintf(stderr, "tma copy wrong at byte %lld\n", static_cast<long long>(i));
                return 1;
            }
        printf("tma copy check: ok\n");
    }
    const int block_counts[] = {1, 2, 4, 8, 12, 16, 24};
    for (int mode = 0; mode < 3; ++mode) {
        for (int threads : {256, 512, 768}) {
            for (int blocks : block_counts) {
                char name[64];
                snprintf(name, sizeof(name), "ldst unroll4 threads%d", threads);
                run(name, mode, blocks, [&](Job job, cudaStream_t s) { ldst_copy<4><<<blocks, threads, 0, s>>>(job); });
                snprintf(name, sizeof(name), "ldst unroll8 threads%d", threads);
                run(name, mode, blocks, [&](Job job, cudaStream_t s) { ldst_copy<8><<<blocks, threads, 0, s>>>(job); });
            }
        }
        // TMA: (warps, stages, chunk) with shared memory <= 227 KB per block.
        struct TmaCfg { int warps, stages, chunk; };
        for (TmaCfg c : {TmaCfg{4, 2, 14336}, TmaCfg{7, 2, 14336}, TmaCfg{8, 4, 3584}, TmaCfg{14, 4, 3584},
                         TmaCfg{14, 2, 7168}, TmaCfg{28, 2, 3584}}) {
            const int smem = 1024 + c.warps * c.stages * c.chunk;
            for (int blocks : block_counts) {
                char name[64];
                snprintf(name, sizeof(name), "tma w%d s%d chunk%d", c.warps, c.stages, c.chunk);
                run(name, mode, blocks, [&](Job job, cudaStream_t s) {
                    if (c.stages == 2) tma_copy<2><<<blocks, 32 * c.warps, smem, s>>>(job, c.chunk);
                    else tma_copy<4><<<blocks, 32 * c.warps, smem, s>>>(job, c.chunk);
                });
            }
        }
    }
    return 0;
}
