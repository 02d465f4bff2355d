// Rows and control slots of the symmetric buffer (layout: moe_comm/layout.py, generated into moe_comm/abi.h):
// where a slot or a row tag lives, what a tag holds, loads of what peers wrote, and the walk over source ranks
// that dispatch receivers and combine senders share.
#pragma once

#include <cstdint>

#include "moe_comm/abi.h"
#include "moe_comm/common/comm.cuh"

namespace moe_comm {

// Control slot `slot` of the buffer at `base` for the operation with barrier sequence number `seq` (two sets by
// parity, as the call signatures): [rows][per-local-expert counts][flags].
__device__ __forceinline__ int64_t* control_slot(uint8_t* base, int64_t seq, int slot) {
    return reinterpret_cast<int64_t*>(base + kSlotsOffset) + ((seq & 1) * kMaxRanks + slot) * kSlotStride;
}

// The sequence number of the running operation: the barrier before every operation advances the barrier counter
// on all ranks alike, so it names the operation. A kernel with the barrier fused in (p.with_barrier) runs as
// counter + 1 and its last block advances the counter (kernel_done), so every block reads the same value.
__device__ __forceinline__ int64_t op_seq(const EpParams& p) {
    return *reinterpret_cast<const volatile int64_t*>(p.local_base + kBarrierSeqOffset) + (p.with_barrier ? 1 : 0);
}

// The tag that publishes a row of the current operation.
// NOTES: 48 bits of the sequence number (no wrap in practice); the magic keeps a tag from matching left-over row
// data by chance.
__device__ __forceinline__ int64_t row_tag(const EpParams& p) {
    return (kTagMagic << 48) | (op_seq(p) & 0xffffffffffffll);
}

// True in every thread of the block when this rank's abort word is set (read once per block: the block acts alike).
__device__ __forceinline__ bool block_aborted(const EpParams& p) {
    __shared__ int skip;
    __syncthreads();
    if (threadIdx.x == 0) skip = aborted(p.local_base);
    __syncthreads();
    return skip;
}

// The barrier fused into an operation's kernel (p.with_barrier): block 0 tells every rank that this rank reached the
// operation (its earlier operations on the stream are complete, so its region is free) and with which signature; a
// sender block waits until every rank did the same before it writes into peers' regions. False when a wait ended
// without every rank or a rank called with another signature (the block then sends nothing; the host raises what
// was recorded). Every thread of the block must call it.
// NOTES: no block reads the host-mapped ErrorRecord here: reads over PCIe from every sender block serialize
// (~1 us per block: 130 us for a 132-block dispatch on one H200).
__device__ __forceinline__ bool barrier_arrive_and_wait(const EpParams& p, bool is_sender) {
    const int64_t seq = op_seq(p);
    const int peer = threadIdx.x;
    if (blockIdx.x == 0 && peer < p.num_ranks) barrier_arrive(p, peer, kBarrierFlagsOffset, seq);
    if (!is_sender) return true;
    const int verdict = peer < p.num_ranks ? barrier_wait(p, peer, kBarrierFlagsOffset, seq, p.barrier_phase) : 1;
    return barrier_agreed(p, verdict, p.barrier_phase, seq);
}

// End of every block of a kernel that keeps kernel_done: the last block to finish resets the count and, with the
// barrier fused in, advances the barrier counter (all blocks have read it by then). Every thread must call it.
// Returns true in the last block (after a fence: every other block's writes are visible to it).
__device__ __forceinline__ bool kernel_done(const EpParams& p) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        int* done = reinterpret_cast<int*>(p.local_base + kKernelDoneOffset);
        last = atomicAdd(done, 1) == static_cast<int>(gridDim.x) - 1;
        if (last) {
            *done = 0;
            if (p.with_barrier) *reinterpret_cast<int64_t*>(p.local_base + kBarrierSeqOffset) = op_seq(p);
            __threadfence();
        }
    }
    __syncthreads();
    return last;
}

__device__ __forceinline__ int64_t* row_tag_ptr(uint8_t* row, const EpParams& p) {
    return reinterpret_cast<int64_t*>(row + p.tag_offset);
}

// Loads of what peers wrote into our region go through L2 only (`__ldcg`): L1 is not coherent with them.
__device__ __forceinline__ int64_t ld_cg_i64(const int64_t* ptr) {
    return __ldcg(reinterpret_cast<const long long*>(ptr));
}
__device__ __forceinline__ int32_t ld_cg_i32(const int32_t* ptr) { return __ldcg(ptr); }
__device__ __forceinline__ uint8_t ld_cg_u8(const uint8_t* ptr) { return __ldcg(ptr); }

// Weight of slot `index` into `dst` (wb = 4 or 8 bytes; nothing for 0): the token's weight when `keep`, else 0.
__device__ __forceinline__ void put_weight(uint8_t* dst, const uint8_t* weights, int64_t index, bool keep, int wb) {
    if (wb == 4)
        *reinterpret_cast<int32_t*>(dst) = keep ? reinterpret_cast<const int32_t*>(weights)[index] : 0;
    else if (wb == 8)
        *reinterpret_cast<int64_t*>(dst) = keep ? reinterpret_cast<const int64_t*>(weights)[index] : 0;
}

// Block of `peer`'s rows in the combine region of rank `owner`: the region holds the other ranks' blocks only
// (rows of the owner itself are read from its x), so peers after the owner move down by one.
__device__ __forceinline__ int64_t combine_block(int peer, int owner) { return peer < owner ? peer : peer - 1; }

// Source of item k of a walk over the source ranks that leaves out `skip` (-1: none): item k is position
// k / num_sources of source index k % num_sources, so every source's rows are walked at the same pace.
__device__ __forceinline__ int walk_source(int64_t k, int num_sources, int skip) {
    const int q = static_cast<int>(k % num_sources);
    return skip >= 0 && q >= skip ? q + 1 : q;
}

}  // namespace moe_comm
