// Rows and control slots of the symmetric buffer (layout: moe_comm/layout.py, generated into moe_comm/abi.h):
// where a slot or a row tag lives, what a tag holds, loads of what peers wrote, and the walk over source ranks
// that dispatch receivers and combine senders share.
#pragma once

#include <cstdint>

#include "moe_comm/abi.h"

namespace moe_comm {

// Control slot `slot` of the buffer at `base`: [signature (kSignatureLen)][rows][per-local-expert counts][flags].
__device__ __forceinline__ int64_t* control_slot(uint8_t* base, int slot) {
    return reinterpret_cast<int64_t*>(base + kSlotsOffset) + static_cast<int64_t>(slot) * kSlotStride;
}

// The tag that publishes a row of the current operation.
// NOTES: the barrier before every operation advances this counter on all ranks alike, so it names the operation
// (48 bits: no wrap in practice); the magic keeps a tag from matching left-over row data by chance.
__device__ __forceinline__ int64_t row_tag(const EpParams& p) {
    const int64_t seq = *reinterpret_cast<const int64_t*>(p.local_base + kBarrierSeqOffset);
    return (kTagMagic << 48) | (seq & 0xffffffffffffll);
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

// Source of item k of a walk over the source ranks that leaves out `skip` (-1: none): item k is position
// k / num_sources of source index k % num_sources, so every source's rows are walked at the same pace.
__device__ __forceinline__ int walk_source(int64_t k, int num_sources, int skip) {
    const int q = static_cast<int>(k % num_sources);
    return skip >= 0 && q >= skip ? q + 1 : q;
}

}  // namespace moe_comm
