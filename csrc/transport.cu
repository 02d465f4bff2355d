// Symmetric-memory transport of the CUDA backend: block copies into peers' receive regions over NVLink,
// and the signal/wait handshake that orders them. Launched through the extern "C" API at the bottom
// (loaded with ctypes by moe_comm/backends/cuda.py; no torch headers, so CI compiles it without CUDA torch).
//
// Buffer layout, identical on every rank (offsets in bytes from the buffer base):
//   control region: per phase a flag array [num_ranks] int64 (written by peers) and this rank's own
//                   sequence counter; a timed-out wait is reported through a host-mapped ErrorRecord.
//   receive region: blocks of rows, block `s` holding what source rank `s` sent in the current round.

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "moe_comm/comm.cuh"

namespace moe_comm {

constexpr int kMaxRanks = 64;
constexpr int kCopyUnroll = 4;

struct BlockCopyParams {
    const uint8_t* send;          // local staging rows: block d (for rank d) at d * send_block_rows
    const int64_t* send_rows;     // [num_ranks] rows actually used per block (device), or null: whole blocks
    uint8_t* const* peer_bases;   // [num_ranks] buffer bases (device array; ours included)
    int64_t width;                // bytes per row, a multiple of 16
    int64_t send_block_rows;      // rows per send block
    int64_t round_first_row;      // first row of this round inside every block
    int64_t round_rows;           // rows per block in this round (the receive region's block capacity)
    int64_t region_offset;        // receive region, from a buffer base
    int32_t rank;
    int32_t num_ranks;
};

struct SyncParams {
    uint8_t* const* peer_bases;   // [num_ranks] buffer bases (device array)
    uint8_t* local_base;          // this rank's buffer base
    ErrorRecord* error;           // host-mapped
    int64_t flags_offset;         // this phase's flag array [num_ranks] int64, same offset on every rank
    int64_t seq_offset;           // this rank's sequence counter of the phase
    uint64_t timeout_ns;
    int32_t rank;
    int32_t num_ranks;
    int32_t phase;                // reported on timeout
    int32_t padding;
};

// Copy this round's rows of every block to its destination rank's receive region (block `rank` there).
// Peers are visited starting after ourselves so that ranks do not all hit the same peer first.
__global__ void copy_blocks_impl(const BlockCopyParams p) {
    const int64_t num_threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
    const int64_t thread_idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    for (int i = 0; i < p.num_ranks; ++i) {
        const int d = (p.rank + 1 + i) % p.num_ranks;
        int64_t rows = p.send_rows != nullptr ? min(p.send_block_rows, p.send_rows[d]) : p.send_block_rows;
        rows = rows - p.round_first_row < p.round_rows ? rows - p.round_first_row : p.round_rows;
        if (rows < 0) rows = 0;
        const int64_t num_vecs = rows * p.width / 16;
        const int4* src = reinterpret_cast<const int4*>(p.send + (d * p.send_block_rows + p.round_first_row) * p.width);
        int4* dst = reinterpret_cast<int4*>(p.peer_bases[d] + p.region_offset +
                                            static_cast<int64_t>(p.rank) * p.round_rows * p.width);
        strided_copy16<kCopyUnroll, Load::kReadOnly>(dst, src, num_vecs, thread_idx, num_threads);
    }
    // NOTES: the flag that publishes these rows is written by the next kernel on the stream; the fence makes
    // every thread's remote stores visible system-wide before this kernel retires.
    __threadfence_system();
}

// The signal/wait of one phase (comm.cuh signal_wait_block), as a kernel of its own.
__global__ void signal_wait_impl(const SyncParams p) {
    signal_wait_block(p.peer_bases, p.local_base, p.error, p.flags_offset, p.seq_offset, p.timeout_ns, p.rank,
                      p.num_ranks, p.phase);
}

}  // namespace moe_comm

using moe_comm::BlockCopyParams;
using moe_comm::SyncParams;

extern "C" {

// Every launcher returns a cudaError_t (0 = success); moe_comm_error_string names it.
int moe_comm_copy_blocks(const BlockCopyParams* params, int num_blocks, int num_threads, cudaStream_t stream) {
    if (params->num_ranks < 1 || params->num_ranks > moe_comm::kMaxRanks || params->width % 16 != 0)
        return static_cast<int>(cudaErrorInvalidValue);
    moe_comm::copy_blocks_impl<<<num_blocks, num_threads, 0, stream>>>(*params);
    return static_cast<int>(cudaGetLastError());
}

int moe_comm_signal_wait(const SyncParams* params, cudaStream_t stream) {
    if (params->num_ranks < 1 || params->num_ranks > moe_comm::kMaxRanks)
        return static_cast<int>(cudaErrorInvalidValue);
    moe_comm::signal_wait_impl<<<1, moe_comm::kMaxRanks, 0, stream>>>(*params);
    return static_cast<int>(cudaGetLastError());
}

// `bytes` of zeroed host-mapped memory (the ErrorRecord, the dispatch's notify summary): `*host` for the CPU,
// `*device` for kernels.
int moe_comm_alloc_mapped(int64_t bytes, void** host, void** device) {
    cudaError_t err = cudaHostAlloc(host, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
    if (err != cudaSuccess) return static_cast<int>(err);
    memset(*host, 0, bytes);
    return static_cast<int>(cudaHostGetDevicePointer(device, *host, 0));
}

int moe_comm_free_mapped(void* host) { return static_cast<int>(cudaFreeHost(host)); }

const char* moe_comm_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

int moe_comm_sizeof_params(int which) {
    return which == 0 ? static_cast<int>(sizeof(BlockCopyParams)) : static_cast<int>(sizeof(SyncParams));
}

}  // extern "C"
