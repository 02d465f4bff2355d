// Kernel-side constants: launch shapes, copy depths and the build variants that scripts/profile_ops.py --variants
// compares (-D flags; benchmarks/NOTES.md says what each setting measured). Values the host also knows live in
// the generated moe_comm/abi.h instead.
#pragma once

#include <cstdint>

#include "moe_comm/abi.h"

namespace moe_comm {

constexpr int kWarpSize = 32;
constexpr int kMaxWarpsPerBlock = 16;        // dispatch_impl / combine_impl blocks: 512 threads
constexpr int kThreadsPerBlock = kMaxWarpsPerBlock * kWarpSize;
constexpr int kLayoutWarps = kLayoutThreads / kWarpSize;  // hit masks per column of a layout pass (abi.h)
constexpr int kMaxLayoutTopk = 16;           // slots a layout thread keeps in registers (more are re-read)
constexpr int kMaxDevices = 64;              // devices one process may launch dispatches on

#ifndef MOE_COMM_COPY_UNROLL
#define MOE_COMM_COPY_UNROLL 8               // 16-byte loads in flight per lane in warp row copies
#endif
constexpr int kCopyUnroll = MOE_COMM_COPY_UNROLL;
constexpr int kSendUnroll = 4;               // dispatch senders (each load feeds a store per destination)
constexpr int kReduceUnroll = 4;             // combine reducers (registers: an FP32 accumulator per element)
#ifndef MOE_COMM_SEND_BATCH
#define MOE_COMM_SEND_BATCH 4                // tokens a dispatch sender warp writes before publishing their rows
#endif
constexpr int kSendBatch = MOE_COMM_SEND_BATCH;
#ifndef MOE_COMM_COMBINE_BATCH
#define MOE_COMM_COMBINE_BATCH 1             // rows a combine sender warp writes before publishing them (4 made
#endif                                       // the reducers finish later: 378 vs 334 us at 24 SMs)
constexpr int kCombineBatch = MOE_COMM_COMBINE_BATCH;

// Dispatch receivers: chunk buffers in shared memory, filled by bulk copies.
#ifndef MOE_COMM_RECV_STAGES
#define MOE_COMM_RECV_STAGES 2               // chunk buffers per copying warp (loads in flight: stages - 1)
#endif
constexpr int kRecvStages = MOE_COMM_RECV_STAGES;
#ifndef MOE_COMM_RECV_CHUNK
#define MOE_COMM_RECV_CHUNK 8192             // bytes per bulk copy
#endif
constexpr int64_t kRecvChunk = MOE_COMM_RECV_CHUNK;
constexpr int64_t kBarrierBytes = 128;       // a copying warp's mbarriers (first half) and their stages' row-ok
                                             // flags (second half), padded so its buffers stay 128-aligned
static_assert(kRecvStages >= 2 && kRecvStages * 8 <= kBarrierBytes / 2, "receiver stages: 2 to 8");

// Profiling build (-DMOE_COMM_BLOCK_TIMES, profile_ops --variants times=1): the global timer at start and end of
// every block of the last launch of a kernel, into a __device__ array of the kernel's own translation unit.
constexpr int kMaxTimedBlocks = 1024;
#ifdef MOE_COMM_BLOCK_TIMES
#define BLOCK_TIME_START(times)                                                                 \
    if (threadIdx.x == 0 && blockIdx.x < kMaxTimedBlocks) times[blockIdx.x][0] = global_timer_ns()
#define BLOCK_TIME_END(times)                                                                   \
    __syncthreads();                                                                            \
    if (threadIdx.x == 0 && blockIdx.x < kMaxTimedBlocks) times[blockIdx.x][1] = global_timer_ns()
// The same build: the global timer at step `step` of a block (a kernel's phases), into times[blockIdx.x][step].
#define STEP_TIME(times, step)                                                                    \
    do {                                                                                          \
        if (threadIdx.x == 0 && blockIdx.x < kMaxTimedBlocks) times[blockIdx.x][step] = global_timer_ns(); \
    } while (0)
#else
#define BLOCK_TIME_START(times)
#define BLOCK_TIME_END(times)
#define STEP_TIME(times, step) \
    do {                       \
    } while (0)
#endif

}  // namespace moe_comm
