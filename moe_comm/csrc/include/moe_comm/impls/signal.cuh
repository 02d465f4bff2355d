// Flags beside copy-engine transfers (the buffer's pipeline send/recv): a one-warp wait for a flag and a one-thread
// release of a flag, so that the data itself moves by cudaMemcpyAsync (copy engines) and no kernel holds more than a
// warp while it waits. Device code only (launched by kernels/signal.cu); no torch headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "moe_comm/abi.h"
#include "moe_comm/common/comm.cuh"

namespace moe_comm {

// Wait until *flag >= expected: one lane spins (through the timeout helper: a peer that never writes ends in the
// ErrorRecord naming rank, phase and peer, and the abort word; a dispatch's disagreement does not end it:
// wait_flag_unless_timed_out); nothing after it on the stream runs before.
__global__ void __launch_bounds__(32) wait_flag_impl(EpParams p, const int64_t* flag, int64_t expected, int peer,
                                                     int phase) {
    if (threadIdx.x == 0) wait_flag_unless_timed_out(flag, expected, p, phase, peer);
}

// *flag = value with release semantics at system scope, after the stream's earlier work (a copy into the peer's
// slot) has completed: the peer that acquires the flag sees the data.
// NOTES: the copy engine's writes are complete when this kernel starts (stream order); the fence orders them with
// this thread's store for observers on other GPUs.
__global__ void __launch_bounds__(32) signal_flag_impl(int64_t* flag, int64_t value) {
    if (threadIdx.x == 0) {
        __threadfence_system();
        st_release_sys(flag, value);
    }
}

// Lane i < n (other than this rank) waits until flags[i] >= expected: one launch for a flag per peer (the
// all-gather's and reduce-scatter's arrivals and releases, in this rank's region).
__global__ void __launch_bounds__(32) wait_flags_impl(EpParams p, const int64_t* flags, int n, int64_t expected,
                                                      int phase) {
    const int i = threadIdx.x;
    if (i < n && i != p.rank) wait_flag_unless_timed_out(flags + i, expected, p, phase, i);
}

// Lane i < n releases *targets[i] = value (a flag in peer i's region; null: none), after the stream's earlier work.
__global__ void __launch_bounds__(32) signal_flags_impl(int64_t* const* targets, int n, int64_t value) {
    const int i = threadIdx.x;
    __threadfence_system();
    if (i < n && targets[i] != nullptr) st_release_sys(targets[i], value);
}

// out[e] = slot 0 + slot 1 + ... + slot (num_slots - 1) at element e, added in that order in Acc precision from
// slot 0's value (the reduce-scatter's rank order); the slots are `slot_stride` bytes apart from `slots`.
template <typename T, typename Acc>
__global__ void reduce_slots_impl(const uint8_t* slots, int64_t slot_stride, int num_slots, int64_t numel, T* out) {
    for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < numel;
         e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        Acc acc = static_cast<Acc>(reinterpret_cast<const T*>(slots)[e]);
        for (int r = 1; r < num_slots; ++r)
            acc += static_cast<Acc>(reinterpret_cast<const T*>(slots + r * slot_stride)[e]);
        out[e] = static_cast<T>(acc);
    }
}

}  // namespace moe_comm
