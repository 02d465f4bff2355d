// Flags beside copy-engine transfers (the buffer's pipeline send/recv): a one-warp wait for a flag and a one-thread
// release of a flag, so that the data itself moves by cudaMemcpyAsync (copy engines) and no kernel holds more than a
// warp while it waits. Device code only (launched by kernels/signal.cu); no torch headers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moe_comm/abi.h"
#include "moe_comm/common/comm.cuh"

namespace moe_comm {

// Wait until *flag >= expected: one lane spins (through the timeout helper: a peer that never writes ends in the
// ErrorRecord naming rank, phase and peer, and the abort word); nothing after it on the stream runs before.
__global__ void __launch_bounds__(32) wait_flag_impl(EpParams p, const int64_t* flag, int64_t expected, int peer,
                                                     int phase) {
    if (threadIdx.x == 0) wait_flag_at_least(flag, expected, p, phase, peer);
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

}  // namespace moe_comm
