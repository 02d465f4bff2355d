// Synchronization between ranks over peer memory: system-scope release/acquire flags, the abort word, the one
// timeout helper every spin-wait goes through, and the barrier every operation starts with (carrying the call's
// signature, so that ranks that disagree stop before any row moves). No torch headers: plain nvcc builds this.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "moe_comm/abi.h"

namespace moe_comm {

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

// The abort word of a rank's buffer (kAbortOffset): 0 while operations run, else the ErrorRecord code that stopped
// them. Set by a timed-out wait or by ranks that disagree; every kernel skips its work while it is set and every
// wait returns at once (the copy-engine paths' waits only on a timeout: wait_flag_unless_timed_out), until the host
// clears it (a disagreement) or refuses the buffer (a timeout).
__device__ __forceinline__ int64_t* abort_word(uint8_t* base) {
    return reinterpret_cast<int64_t*>(base + kAbortOffset);
}
__device__ __forceinline__ bool aborted(uint8_t* base) {
    return *reinterpret_cast<volatile int64_t*>(abort_word(base)) != 0;
}
__device__ __forceinline__ void set_abort(uint8_t* base, int64_t code) {
    atomicCAS(reinterpret_cast<unsigned long long*>(abort_word(base)), 0ull, static_cast<unsigned long long>(code));
}

// Spin until *flag >= expected (or == expected with `exact`); false at once when this rank's abort word is set (with
// `timeouts_only`, only when a wait timed out). On timeout, record who waited for whom, print it, set the abort word
// (every other wait of this rank ends at once) and return false (the host raises; NOTES: no __trap, so the process
// keeps a usable context and a traceback). A `timeouts_only` wait, which goes on through a disagreement, takes the
// record and the abort word over from one: the buffer is unusable now, so the host must raise the timeout (a
// disagreement it would realign and go on).
__device__ __forceinline__ bool wait_flag(const int64_t* flag, int64_t expected, bool exact, const EpParams& p,
                                          int phase, int peer, bool timeouts_only = false) {
    const uint64_t start = global_timer_ns();
    int64_t observed = ld_acquire_sys(flag);
    while (exact ? observed != expected : observed < expected) {
        const int64_t abort = *reinterpret_cast<volatile int64_t*>(abort_word(p.local_base));
        if (abort != 0 && (!timeouts_only || abort == kErrorTimeout)) return false;
        if (global_timer_ns() - start > p.timeout_ns) {
            // Only the first failing waiter fills the record and prints.
            ErrorRecord* error = p.error;
            auto* code = reinterpret_cast<unsigned long long*>(&error->code);
            const auto timeout = static_cast<unsigned long long>(kErrorTimeout);
            const auto disagree = static_cast<unsigned long long>(kErrorDisagree);
            unsigned long long prior;
            for (;;) {  // claim the record: from no error, or (timeouts_only) from a disagreement the host may clear
                prior = atomicCAS(code, 0ull, timeout);
                if (prior != disagree || !timeouts_only) break;
                if (atomicCAS(code, disagree, timeout) == disagree) {
                    prior = 0ull;
                    break;
                }
            }
            if (prior == 0ull) {
                error->rank = p.rank;
                error->phase = phase;
                error->peer = peer;
                error->observed = observed;
                error->expected = expected;
                __threadfence_system();
                printf("moe_comm: rank %d timed out in phase %d waiting for peer %d (flag %lld, expected %lld)\n",
                       p.rank, phase, peer, static_cast<long long>(observed), static_cast<long long>(expected));
            }
            if (timeouts_only)
                atomicExch(reinterpret_cast<unsigned long long*>(abort_word(p.local_base)), timeout);
            else
                set_abort(p.local_base, kErrorTimeout);
            return false;
        }
        observed = ld_acquire_sys(flag);
    }
    return true;
}

__device__ __forceinline__ bool wait_flag_at_least(const int64_t* flag, int64_t expected, const EpParams& p, int phase,
                                                   int peer) {
    return wait_flag(flag, expected, false, p, phase, peer);
}

// The copy-engine paths' wait (pipeline, all-gather, reduce-scatter: a copy and a release follow it on the stream
// whatever it returns). Ranks that disagreed in a dispatch or combine set the abort word to stop those operations,
// but these paths' flags stay in step, so their waits go on: ending early would let the copy move a slot that no
// peer has written yet, or overwrite one not yet received. A timeout still ends them (the buffer is unusable then).
__device__ __forceinline__ bool wait_flag_unless_timed_out(const int64_t* flag, int64_t expected, const EpParams& p,
                                                           int phase, int peer) {
    return wait_flag(flag, expected, false, p, phase, peer, true);
}

__device__ __forceinline__ bool wait_flag_equal(const int64_t* flag, int64_t expected, const EpParams& p, int phase,
                                                int peer) {
    return wait_flag(flag, expected, true, p, phase, peer);
}

// Call signature of `rank` for the operation with barrier sequence number `seq` in the buffer at `base`
// (kSignaturesOffset; two sets by parity: a peer may arrive at the next operation while one of our blocks still
// compares this one's, never two ahead, as it cannot pass that barrier before this kernel has ended).
__device__ __forceinline__ int64_t* call_signature(uint8_t* base, int rank, int64_t seq) {
    return reinterpret_cast<int64_t*>(base + kSignaturesOffset) + ((seq & 1) * kMaxRanks + rank) * kSignatureLen;
}

// Thread `peer` of a barrier: this rank's call signature into `peer`'s buffer, then the flag (a release at system
// scope: a peer that has seen the flag sees the signature, this thread's stores before it).
__device__ __forceinline__ void barrier_arrive(const EpParams& p, int peer, int64_t flags_offset, int64_t seq) {
    longlong2* signature = reinterpret_cast<longlong2*>(call_signature(p.peer_bases[peer], p.rank, seq));
#pragma unroll
    for (int i = 0; i < kSignatureLen / 2; ++i)
        signature[i] = make_longlong2(p.signature[2 * i], p.signature[2 * i + 1]);
    st_release_sys(reinterpret_cast<int64_t*>(p.peer_bases[peer] + flags_offset) + p.rank, seq);
}

// Thread `peer` of a barrier: wait for `peer`'s flag, then compare its call signature with ours. 1: arrived and
// agrees; 0: the wait ended without it (timeout or abort); -1: it arrived with another signature.
__device__ __forceinline__ int barrier_wait(const EpParams& p, int peer, int64_t flags_offset, int64_t seq,
                                            int phase) {
    if (!wait_flag_at_least(reinterpret_cast<const int64_t*>(p.local_base + flags_offset) + peer, seq, p, phase,
                            peer))
        return 0;
    // NOTES: all loads issued before any compare (one round trip, not kSignatureLen); through L2 (`__ldcg`), as a
    // peer wrote them.
    const longlong2* theirs = reinterpret_cast<const longlong2*>(call_signature(p.local_base, peer, seq));
    longlong2 words[kSignatureLen / 2];
#pragma unroll
    for (int i = 0; i < kSignatureLen / 2; ++i) words[i] = __ldcg(theirs + i);
    bool same = true;
#pragma unroll
    for (int i = 0; i < kSignatureLen / 2; ++i)
        same &= words[i].x == p.signature[2 * i] && words[i].y == p.signature[2 * i + 1];
    return same ? 1 : -1;
}

// End of a block's barrier waits at sequence number `seq`, `verdict` from barrier_wait (1 for threads that waited
// for nobody): true when every rank arrived with this call's signature. Ranks that disagree all see it (every rank
// compares every rank's signature, at the same `seq`); the first block that sees it leaves every rank's signature in
// host-mapped memory for the host's error message, with `seq` (the host restarts the barrier counter past it, the
// same on every rank), and sets the abort word, so this operation and those after it move nothing until the host,
// at its next synchronizing call, raises and clears it. Every thread must call it.
__device__ __forceinline__ bool barrier_agreed(const EpParams& p, int verdict, int phase, int64_t seq) {
    __shared__ int any_missing, any_differ, record;
    if (threadIdx.x == 0) any_missing = any_differ = record = 0;
    __syncthreads();
    if (verdict == 0) any_missing = 1;
    if (verdict < 0) any_differ = 1;
    __syncthreads();
    if (any_differ && !any_missing) {
        if (threadIdx.x == 0) {
            set_abort(p.local_base, kErrorDisagree);
            record = atomicCAS(reinterpret_cast<unsigned long long*>(&p.error->code), 0ull,
                               static_cast<unsigned long long>(kErrorDisagree)) == 0ull;
        }
        __syncthreads();
        if (record) {
            int64_t* mapped = reinterpret_cast<int64_t*>(reinterpret_cast<uint8_t*>(p.error) +
                                                         kMappedSignaturesOffset);
            for (int i = threadIdx.x; i < p.num_ranks * kSignatureLen; i += blockDim.x)
                mapped[i] = __ldcg(reinterpret_cast<const long long*>(
                    call_signature(p.local_base, i / kSignatureLen, seq) + i % kSignatureLen));
            __syncthreads();
            if (threadIdx.x == 0) {
                p.error->rank = p.rank;
                p.error->phase = phase;
                p.error->observed = seq;
                __threadfence_system();
            }
        }
    }
    __syncthreads();
    return !any_missing && !any_differ;
}

}  // namespace moe_comm
