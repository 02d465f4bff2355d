// Per-SM throughput of a fan-out copy on one GPU: every source row read once and stored to F scattered rows, the
// work of an expand dispatch's receivers (a row per (arrived token, local expert): 8 per token at EP1, top-8).
// The floor that `dispatch_recv_rows` stands on with few SMs (benchmarks/NOTES.md, eighteenth session).
//
// Methods (one warp per stream of rows or chunks):
//   tma:   lane 0 loads chunks global -> shared (cp.async.bulk + mbarrier) and stores each F times shared ->
//          global (bulk_group stores), `stages` chunk buffers per warp. Refill order "first": as the dispatch
//          receivers do (wait until every committed store has read its buffer, load the next chunk, then store the
//          current one); "after": store the current chunk, then refill the buffer of the one before it.
//   lanes: lane 0 loads chunks by TMA as above; all 32 lanes store them with 16-byte st.global from shared memory.
//   ldst:  16-byte loads into registers (`unroll` per lane in flight), each stored F times.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I moe_comm/csrc/include -o /tmp/fanout_bench \
//       benchmarks/microbench/fanout_bench.cu && /tmp/fanout_bench      (from the repository root)
// Prints one line per configuration: us per copy, GB/s of stored bytes, GB/s per block (SM).

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
    uint8_t* dst;
    int64_t rows;       // source rows; dst holds rows * fanout
    int64_t row_bytes;  // multiple of the chunk
    int fanout;
};

// Destination row of copy f of source row r: a bijection of [0, rows * fanout) (a power of two) that scatters
// the copies of one row, as an expand layout's expert runs do.
__host__ __device__ __forceinline__ int64_t dst_row(const Job& job, int64_t r, int f) {
    const uint64_t n = static_cast<uint64_t>(job.rows) * job.fanout;
    return static_cast<int64_t>((static_cast<uint64_t>(r * job.fanout + f) * 0x9E3779B1ull) & (n - 1));
}

__global__ void fill(uint8_t* src, int64_t rows, int64_t row_bytes) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rows * row_bytes;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x)
        src[i] = static_cast<uint8_t>((i / row_bytes) * 131 + i % row_bytes);
}

template <int kUnroll>
__global__ void ldst_fanout(Job job) {
    const int lane = threadIdx.x % 32;
    const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int64_t num_warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
    const int64_t n = job.row_bytes / 16;
    for (int64_t r = warp; r < job.rows; r += num_warps) {
        const int4* src = reinterpret_cast<const int4*>(job.src + r * job.row_bytes);
        for (int64_t v0 = 0; v0 < n; v0 += kUnroll * 32) {
            int4 v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int64_t i = v0 + lane + u * 32;
                if (i < n) v[u] = ld_nc_v4(src + i);
            }
            for (int f = 0; f < job.fanout; ++f) {
                int4* dst = reinterpret_cast<int4*>(job.dst + dst_row(job, r, f) * job.row_bytes);
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) {
                    const int64_t i = v0 + lane + u * 32;
                    if (i < n) dst[i] = v[u];
                }
            }
        }
    }
}

// Items are (row, chunk) pairs; warp w takes items w, w + num_warps, ... kRefillFirst: the dispatch receivers'
// order. kLanes: the lanes store from shared memory instead of bulk stores.
template <int kStages, bool kRefillFirst, bool kLanes>
__global__ void tma_fanout(Job job, int chunk_bytes) {
    extern __shared__ __align__(128) uint8_t smem[];
    const int lane = threadIdx.x % 32, warp_in_block = threadIdx.x / 32;
    const int warps_per_block = blockDim.x / 32;
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem) + warp_in_block * kStages;
    uint8_t* buf = smem + 1024 + static_cast<int64_t>(warp_in_block) * kStages * chunk_bytes;
    if (!kLanes && lane != 0) return;
    if (lane == 0)
        for (int s = 0; s < kStages; ++s) mbarrier_init(bars + s);
    if (kLanes) __syncwarp();
    const int64_t warp = static_cast<int64_t>(blockIdx.x) * warps_per_block + warp_in_block;
    const int64_t num_warps = static_cast<int64_t>(gridDim.x) * warps_per_block;
    const int64_t chunks_per_row = job.row_bytes / chunk_bytes;
    const int64_t items = job.rows * chunks_per_row;
    const int64_t my_items = warp < items ? (items - warp + num_warps - 1) / num_warps : 0;
    auto row_of = [&](int64_t i) { return (warp + i * num_warps) / chunks_per_row; };
    auto offset_in_row = [&](int64_t i) { return ((warp + i * num_warps) % chunks_per_row) * chunk_bytes; };
    auto load = [&](int64_t i) {
        const int s = static_cast<int>(i % kStages);
        bulk_load(buf + s * chunk_bytes, job.src + row_of(i) * job.row_bytes + offset_in_row(i), chunk_bytes,
                  bars + s);
    };
    if (lane == 0)
        for (int64_t i = 0; i < my_items && i < (kRefillFirst ? kStages - 1 : kStages); ++i) load(i);
    for (int64_t i = 0; i < my_items; ++i) {
        const int s = static_cast<int>(i % kStages);
        if (kRefillFirst && lane == 0 && i + kStages - 1 < my_items) {
            bulk_wait_read();
            load(i + kStages - 1);
        }
        if (kLanes) {
            __syncwarp();
            mbarrier_wait(bars + s, static_cast<uint32_t>((i / kStages) & 1));
            const int4* chunk = reinterpret_cast<const int4*>(buf + s * chunk_bytes);
            const int64_t n = chunk_bytes / 16;
            for (int f = 0; f < job.fanout; ++f) {
                int4* dst = reinterpret_cast<int4*>(job.dst + dst_row(job, row_of(i), f) * job.row_bytes +
                                                    offset_in_row(i));
                for (int64_t v = lane; v < n; v += 32) dst[v] = chunk[v];
            }
            // Every lane's reads of the buffer (generic proxy) ordered before lane 0's next bulk load into it.
            fence_proxy_async();
            __syncwarp();
            if (!kRefillFirst && lane == 0 && i + kStages < my_items) load(i + kStages);
            continue;
        }
        mbarrier_wait(bars + s, static_cast<uint32_t>((i / kStages) & 1));
        for (int f = 0; f < job.fanout; ++f)
            bulk_store(job.dst + dst_row(job, row_of(i), f) * job.row_bytes + offset_in_row(i), buf + s * chunk_bytes,
                       chunk_bytes);
        bulk_commit();
        if (!kRefillFirst && i >= 1 && i - 1 + kStages < my_items) {
            // The previous item's stores have read their buffer once at most one group (this one) is pending.
            asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
            load(i - 1 + kStages);
        }
    }
    if (lane == 0) bulk_wait();
}

int main() {
    const int64_t rows = 4096, row_bytes = 7168 * 2;
    const int max_fanout = 8;
    uint8_t *src = nullptr, *dst = nullptr;
    CHECK(cudaMalloc(&src, rows * row_bytes));
    CHECK(cudaMalloc(&dst, rows * max_fanout * row_bytes));
    fill<<<264, 512>>>(src, rows, row_bytes);
    cudaStream_t stream;
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
#define ALLOW_SMEM(...) \
    CHECK(cudaFuncSetAttribute(__VA_ARGS__, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024))
    ALLOW_SMEM(tma_fanout<2, true, false>);
    ALLOW_SMEM(tma_fanout<3, true, false>);
    ALLOW_SMEM(tma_fanout<4, true, false>);
    ALLOW_SMEM(tma_fanout<2, false, false>);
    ALLOW_SMEM(tma_fanout<4, false, false>);
    ALLOW_SMEM(tma_fanout<2, true, true>);
    ALLOW_SMEM(tma_fanout<4, true, true>);

    // Every method's output against the expected bytes once (F = 8, 15 blocks).
    auto check = [&](const char* name, auto launch) {
        Job job{src, dst, rows, row_bytes, max_fanout};
        CHECK(cudaMemset(dst, 0, rows * max_fanout * row_bytes));
        launch(job, 15, stream);
        CHECK(cudaStreamSynchronize(stream));
        std::vector<uint8_t> host(rows * max_fanout * row_bytes);
        CHECK(cudaMemcpy(host.data(), dst, host.size(), cudaMemcpyDeviceToHost));
        for (int64_t r = 0; r < rows; ++r)
            for (int f = 0; f < max_fanout; ++f) {
                const uint8_t* row = host.data() + dst_row(job, r, f) * row_bytes;
                for (int64_t b = 0; b < row_bytes; ++b)
                    if (row[b] != static_cast<uint8_t>(r * 131 + b)) {
                        fprintf(stderr, "%s: row %lld copy %d wrong at byte %lld\n", name, static_cast<long long>(r),
                                f, static_cast<long long>(b));
                        exit(1);
                    }
            }
        printf("%s check: ok\n", name);
    };

    auto run = [&](const char* name, int fanout, int blocks, auto launch) {
        const int iters = 20;
        Job job{src, dst, rows, row_bytes, fanout};
        float ms = 0;
        for (int rep = 0; rep < 2; ++rep) {  // rep 0 warms up
            CHECK(cudaEventRecord(start, stream));
            for (int it = 0; it < iters; ++it) launch(job, blocks, stream);
            CHECK(cudaGetLastError());
            CHECK(cudaEventRecord(stop, stream));
            CHECK(cudaEventSynchronize(stop));
            CHECK(cudaEventElapsedTime(&ms, start, stop));
        }
        const double us = ms * 1e3 / iters;
        const double stored = static_cast<double>(rows) * row_bytes * fanout;
        printf("%-32s F %d blocks %3d: %8.1f us  %7.1f GB/s  %6.1f GB/s per SM\n", name, fanout, blocks, us,
               stored / us / 1e3, stored / us / 1e3 / blocks);
        fflush(stdout);
    };

    struct Method {
        const char* name;
        int warps, stages, chunk;  // TMA methods
        bool refill_first, lanes;
        int threads, unroll;       // ldst
    };
    const Method methods[] = {
        {"tma w13 s2 c7168 first", 13, 2, 7168, true, false, 0, 0},  // the dispatch receivers today
        {"tma w9 s3 c7168 first", 9, 3, 7168, true, false, 0, 0},
        {"tma w7 s4 c7168 first", 7, 4, 7168, true, false, 0, 0},
        {"tma w13 s4 c3584 first", 13, 4, 3584, true, false, 0, 0},
        {"tma w13 s2 c7168 after", 13, 2, 7168, false, false, 0, 0},
        {"tma w26 s2 c3584 after", 26, 2, 3584, false, false, 0, 0},
        {"tma w13 s4 c3584 after", 13, 4, 3584, false, false, 0, 0},
        {"lanes w13 s2 c7168", 13, 2, 7168, true, true, 0, 0},
        {"lanes w16 s4 c3584", 16, 4, 3584, true, true, 0, 0},
        {"ldst t512 u4", 0, 0, 0, false, false, 512, 4},
        {"ldst t512 u8", 0, 0, 0, false, false, 512, 8},
        {"ldst t1024 u4", 0, 0, 0, false, false, 1024, 4},
    };
    auto launcher = [&](const Method& m) {
        return [m](Job job, int blocks, cudaStream_t s) {
            const int smem = 1024 + m.warps * m.stages * m.chunk;
            const int threads = 32 * m.warps;
            if (m.threads) {
                if (m.unroll == 4) ldst_fanout<4><<<blocks, m.threads, 0, s>>>(job);
                else ldst_fanout<8><<<blocks, m.threads, 0, s>>>(job);
            } else if (m.lanes) {
                if (m.stages == 2) tma_fanout<2, true, true><<<blocks, threads, smem, s>>>(job, m.chunk);
                else tma_fanout<4, true, true><<<blocks, threads, smem, s>>>(job, m.chunk);
            } else if (m.refill_first) {
                if (m.stages == 2) tma_fanout<2, true, false><<<blocks, threads, smem, s>>>(job, m.chunk);
                else if (m.stages == 3) tma_fanout<3, true, false><<<blocks, threads, smem, s>>>(job, m.chunk);
                else tma_fanout<4, true, false><<<blocks, threads, smem, s>>>(job, m.chunk);
            } else {
                if (m.stages == 2) tma_fanout<2, false, false><<<blocks, threads, smem, s>>>(job, m.chunk);
                else tma_fanout<4, false, false><<<blocks, threads, smem, s>>>(job, m.chunk);
            }
        };
    };
    for (const Method& m : methods) check(m.name, launcher(m));
    for (int fanout : {1, 4, 8})
        for (const Method& m : methods)
            for (int blocks : {4, 8, 15, 22, 32, 66, 132}) run(m.name, fanout, blocks, launcher(m));
    return 0;
}
