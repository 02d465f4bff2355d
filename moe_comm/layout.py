"""The symmetric buffer's layout and the kernels' interface (argument structs, codes, C functions), defined once for
both languages. (Over 400 lines: one table for both sides is the point of the module.)

The CUDA sources include `moe_comm/abi.h`, which `render_header()` writes from this module whenever the JIT builds
them (the text is part of the build's cache key), so no offset, limit, code, struct field or function signature is
typed twice: the header declares every function of `FUNCTIONS`, so the compiler holds the definitions in
csrc/kernels to this table, and ctypes takes its types from it (`ctypes_signature`). The host reads the same values
from here, `moe_comm.sizing` sizes the buffer with `dispatch_row`, and the CUDA backend
checks at load time that the compiler laid every struct out as ctypes did (`abi_table`, field by field).

Buffer of every rank (identical layout on every rank; offsets in bytes from the buffer base):

    [0, CONTROL_BYTES)          control region
        BARRIER_FLAGS_OFFSET    [MAX_RANKS] int64 barrier flags, entry s written by rank s
        BARRIER_SEQ_OFFSET      int64 this rank's barrier counter (on the device, so CUDA graph replays advance it)
        KERNEL_DONE_OFFSET      int32 blocks of the running kernel that finished (the last one resets it and, in a
                                kernel with the barrier fused in, advances the barrier counter)
        ABORT_OFFSET            int64 this rank's abort word: 0 while operations run, else the ErrorRecord code
                                that stopped them (every kernel then skips its work and every wait returns at once)
        SIGNATURES_OFFSET       [2][MAX_RANKS][SIGNATURE_LEN] int64 call signatures, [seq % 2][s] written by rank s
                                before its barrier flag (every operation's barrier: ranks compare them after it).
                                Two sets: a rank may start the next operation while a peer's block still reads
                                this one's
        SLOTS_OFFSET            [2][MAX_RANKS][SLOT_STRIDE] int64 control slots, [seq % 2][s] written by rank s
                                before its barrier flag (a fresh dispatch's notify; read after the barrier):
                                [rows sent to us][per-local-expert counts (L)][flags]. Two sets, as the signatures
    [CONTROL_BYTES, num_bytes)  receive region. Dispatch: block s (num_max_tokens_per_rank rows) from rank s.
                                Combine: a block (num_max_tokens_per_rank rows, or row groups of an expand round)
                                per peer, the rank's own left out (its rows are read from its x): peer s at s, or
                                s - 1 after the owner

Region rows, `dispatch_row` / `combine_row`: [data | FP8 scales][pad to 16][meta][pad to 16][tag][pad to 16].
Dispatch meta: int64 source token index; per slot an int32 local expert id (-1: not ours), an int32 rank of the
token among its source's tokens of that expert, a weight (0, 4 or 8 bytes). Combine meta: the weights (per slot,
or one per row in expand mode). Tag: `(TAG_MAGIC << 48) | barrier sequence number`, released after the row.

Host-mapped memory of a CUDA buffer: the `ErrorRecord` at 0, at MAPPED_SIGNATURES_OFFSET every rank's signature of
the operation whose ranks disagreed (written with ERROR_DISAGREE), at NOTIFY_DONE_OFFSET the word a synchronized
dispatch's notify sets to its call's NotifyArgs.done_value (a number the host extension never gives twice) once its
summary (at SUMMARY_OFFSET) is final.
"""

from __future__ import annotations

import ctypes
import re
import struct
from dataclasses import dataclass

# Limits
MAX_RANKS = 32                      # a destination per warp lane
SIGNATURE_LEN = 16                  # int64 values of a call's signature (zero-padded), operation first
MAX_ROUND_SLOTS = 32                # expand combine: slots per round, one reducer lane each
RECV_TABLE_LIMIT = 48 * 1024 - 256  # bytes of count tables in a dispatch receiver block's shared memory
MAX_DYNAMIC_SMEM = 220 * 1024       # dynamic shared memory per block (sm_90: 227 KB including static)
LAYOUT_THREADS = 256                # threads of a layout block: the tokens of a pass, one each

# Control region
CONTROL_BYTES = 1 << 20
BARRIER_FLAGS_OFFSET = 0
BARRIER_SEQ_OFFSET = 8192
KERNEL_DONE_OFFSET = 8208
ABORT_OFFSET = 8216
SIGNATURES_OFFSET = 16384
SLOTS_OFFSET = 24576
# Fixed, so that ranks that disagree on sizes still read each other's signature where it was written.
SLOT_STRIDE = (CONTROL_BYTES - SLOTS_OFFSET) // (8 * 2 * MAX_RANKS)

# Rows
ROW_ALIGN = 16                      # rows move as 16-byte vectors
TAG_BYTES = 16                      # a region row ends in its tag (int64) and padding
TAG_MAGIC = 0x6D63                  # top 16 bits of a tag: left-over row data never matches by chance

# Host-mapped memory
MAPPED_SIGNATURES_OFFSET = 64       # after the ErrorRecord: [MAX_RANKS][SIGNATURE_LEN] int64
NOTIFY_DONE_OFFSET = MAPPED_SIGNATURES_OFFSET + 8 * MAX_RANKS * SIGNATURE_LEN  # int64: the summary's call, once final
SUMMARY_OFFSET = NOTIFY_DONE_OFFSET + 8
ERROR_TIMEOUT = 1                   # ErrorRecord.code of a timed-out wait
ERROR_DISAGREE = 2                  # ErrorRecord.code of an operation whose ranks' signatures differ

# What a dispatch or combine launch runs: the whole kernel (senders and receivers at once), its senders alone (a
# call with `return_recv_hook=True`) or its receivers alone (that call's hook).
PART_WHOLE, PART_SEND, PART_RECEIVE = 0, 1, 2

# Codes and constants of the kernels' arguments
DTYPE_CODES = {"bfloat16": 1, "float32": 2, "float64": 3}  # a combine's or a reduce-scatter's element type
FP8_CODES = {"fp8_block128": 1, "mxfp8": 2}  # quantize / dequantize (0: none); the formats of moe_comm.quant
FP8_CHANNELS_PER_SCALE = 128        # channels per 4-byte scale word, in both FP8 formats
AMAX_MIN = 1e-4                     # the FP8 casts' floor of a group's amax (moe_comm.quant; in float32)
ROUTING_OUT_OF_RANGE, ROUTING_DUPLICATE = 1, 2  # error flag bits of a rank's routing


def align16(n: int) -> int:
    return -(-n // ROW_ALIGN) * ROW_ALIGN


@dataclass(frozen=True)
class RowFormat:
    """Byte offsets inside a region row (from the row's start) and its stride."""

    meta_offset: int
    ids_offset: int                 # dispatch: int32 local expert id per slot
    ranks_offset: int               # dispatch: int32 rank of the token in its expert per slot
    weights_offset: int             # weights (dispatch: per slot; combine: per slot or one per row)
    tag_offset: int
    stride: int


def dispatch_row(data_bytes: int, scale_bytes: int, num_topk: int, weight_bytes: int) -> RowFormat:
    """Region row of a dispatch: `data_bytes` of row data (or FP8 data) and `scale_bytes` of FP8 scales."""
    meta = align16(data_bytes + scale_bytes)
    ids, ranks = meta + 8, meta + 8 + 4 * num_topk
    weights = ranks + 4 * num_topk
    tag = align16(weights + weight_bytes * num_topk)
    return RowFormat(meta, ids, ranks, weights, tag, tag + TAG_BYTES)


def combine_row(data_bytes: int, weights_per_row: int, weight_bytes: int) -> RowFormat:
    """Region row of a combine: the row data and `weights_per_row` weights of `weight_bytes` each."""
    meta = align16(data_bytes)
    tag = align16(meta + weight_bytes * weights_per_row)
    return RowFormat(meta, meta, meta, meta, tag, tag + TAG_BYTES)


# Tokens per layout block at least (a block takes 256 a pass, a token per thread): 128 measured best over 128-8192
# tokens (benchmarks/NOTES.md, thirteenth session).
LAYOUT_MIN_CHUNK = 128
LAYOUT_MAX_BLOCKS = 256  # a block reads the counts of every block before it (and one per SM at most anyway)


def layout_blocks(num_tokens: int, num_sms: int) -> int:
    """Blocks of a dispatch's layout kernel: one per SM at most (they meet at grid-wide barriers), each a chunk of
    at least LAYOUT_MIN_CHUNK tokens."""
    return max(1, min(num_sms, LAYOUT_MAX_BLOCKS, -(-num_tokens // LAYOUT_MIN_CHUNK)))


# A layout block's dynamic shared memory (impls/layout.cuh LayoutShared), in 4-byte words: per column (ranks, then
# experts) a hit mask and a first position per warp and a running count, then the flags' running count.
LAYOUT_SMEM_WORDS_PER_COLUMN = 2 * (LAYOUT_THREADS // 32) + 1
LAYOUT_SMEM_WORDS_FIXED = 1
# What a profiling build (-DMOE_COMM_BLOCK_TIMES) records per layout block after its start (step 0): the first
# LAYOUT_BLOCK_STEPS in every block, the rest (the notify's) in the last block only.
LAYOUT_STEPS = ("counted", "grid barrier", "prefixed", "placed",
                "notify started", "slots written", "notify barrier", "notify done")
LAYOUT_BLOCK_STEPS = 4


def layout_smem_bytes(num_ranks: int, num_experts: int) -> int:
    """Dynamic shared memory of a layout block."""
    return 4 * (LAYOUT_SMEM_WORDS_PER_COLUMN * (num_ranks + num_experts) + LAYOUT_SMEM_WORDS_FIXED)


def layout_scratch_ints(num_blocks: int, num_ranks: int, num_experts: int) -> int:
    """int32 values of the layout kernel's scratch: per block, a count per column (ranks, experts, flags)."""
    return num_blocks * (num_ranks + num_experts + 1)


# A fresh dispatch's int64 workspace (moe_comm.backends.cuda.CudaLayout): its clean topk_idx [N, K] at 0, then these
# pieces in this order; `workspace_offsets` gives each one's element offset, then the total length. The host extension
# reads them at the indices kWorkspace<Piece> (generated below), kWorkspaceLength is the total's index.
WORKSPACE_PIECES = ("send_pos", "counts", "recv_slots", "expert_rank", "expand_row", "layout_scratch")


def workspace_offsets(num_tokens: int, num_topk: int, num_ranks: int, num_experts: int, cap: int,
                      do_expand: bool, layout_blocks: int) -> tuple[int, ...]:
    """Element offsets of WORKSPACE_PIECES, then the workspace's length: send_pos `[N, R]` int64, counts `[R + E + 1]`
    int64, recv_slots `[R, SLOT_STRIDE]` int64, expert_rank `[N, K]` int32, expand_row `[R * cap, K]` int32 (expand
    only), the layout kernel's scratch (`layout_scratch_ints` int32)."""
    N, K, R = num_tokens, num_topk, num_ranks
    sizes = (N * K, N * R, R + num_experts + 1, R * SLOT_STRIDE, -(-N * K // 2), -(-R * cap * K // 2) * do_expand,
             -(-layout_scratch_ints(layout_blocks, R, num_experts) // 2))
    offsets = [sizes[0]]
    for size in sizes[1:]:
        offsets.append(offsets[-1] + size)
    return tuple(offsets)


# The notify summary (host-mapped int64 values at SUMMARY_OFFSET): value i of each entry is at
# `a * R + b * L + c + stride * i` for (a, b, c, stride) below (R ranks, L local experts). The generated header has
# a function per entry, `summary_<name>(R, L, i)`.
SUMMARY = {
    "rows_from": (0, 0, 0, 2),      # [R] rows source rank i sends us
    "flags_from": (0, 0, 1, 2),     # [R] the error flags of source i's routing (interleaved with its rows)
    "pending_from": (2, 0, 0, 1),   # [R] source i's flags of earlier dispatches without CPU sync
    "total": (3, 0, 0, 0),          # rows received in all
    "per_expert": (3, 0, 1, 1),     # [L] rows for local expert i
}


def summary_index(name: str, num_ranks: int, num_local_experts: int, i: int = 0) -> int:
    a, b, c, stride = SUMMARY[name]
    return a * num_ranks + b * num_local_experts + c + stride * i


def summary_len(num_ranks: int, num_local_experts: int) -> int:
    """int64 values of the notify summary."""
    return summary_index("per_expert", num_ranks, num_local_experts, num_local_experts)


def recv_table_bytes(num_ranks: int, num_local_experts: int) -> int:
    """Shared memory of a dispatch receiver block's count tables (int64 rows_from[R], rank_start[R],
    expert_start[L], expert_count[L], aligned[L], run_base[R * L]), padded to 128 bytes."""
    R, L = num_ranks, num_local_experts
    return -(-8 * (2 * R + 3 * L + R * L) // 128) * 128


# ----------------------------------------------------------------------------------------------------------------
# Argument structs: (name, [(C type, field, comment)]). Pointer fields become ctypes.c_void_p on the host.
# ----------------------------------------------------------------------------------------------------------------
STRUCTS = {
    "ErrorRecord": [  # host-mapped: what a timed-out wait leaves for the host
        ("int64_t", "code", "0: no error, ERROR_TIMEOUT: a wait timed out, ERROR_DISAGREE: signatures differ"),
        ("int64_t", "rank", ""),
        ("int64_t", "phase", "index into the host's phase names"),
        ("int64_t", "peer", ""),
        ("int64_t", "observed", "flag value seen last"),
        ("int64_t", "expected", ""),
    ],
    "EpParams": [  # everything a dispatch, notify, barrier or combine kernel knows about the buffer and the call
        ("uint8_t* const*", "peer_bases", "[num_ranks] buffer bases (device array)"),
        ("uint8_t*", "local_base", ""),
        ("ErrorRecord*", "error", "host-mapped"),
        ("int64_t", "num_tokens", "this rank's tokens"),
        ("int64_t", "cap", "rows per source block (num_max_tokens_per_rank)"),
        ("int64_t", "row_stride", "bytes per region row"),
        ("int64_t", "data_bytes", "row data bytes (a multiple of 16)"),
        ("int64_t", "scale_bytes", "FP8 scale bytes per row (a multiple of 4), 0 without FP8"),
        ("int64_t", "meta_offset", "RowFormat offsets"),
        ("int64_t", "ids_offset", ""),
        ("int64_t", "ranks_offset", ""),
        ("int64_t", "weights_offset", ""),
        ("int64_t", "tag_offset", ""),
        ("int64_t", "recv_table_bytes", "dispatch receivers: shared memory of the count tables"),
        ("uint64_t", "timeout_ns", ""),
        ("int32_t", "rank", ""),
        ("int32_t", "num_ranks", ""),
        ("int32_t", "num_experts", ""),
        ("int32_t", "num_local_experts", ""),
        ("int32_t", "num_topk", ""),
        ("int32_t", "weight_bytes", "0 (no weights), 4 or 8"),
        ("int32_t", "expert_alignment", ""),
        ("int32_t", "num_send_blocks", "blocks [0, n) send, the others receive or reduce"),
        ("int32_t", "phase", "of the operation, reported on timeout"),
        ("int32_t", "barrier_phase", "of the barrier before it"),
        ("int32_t", "with_barrier", "the kernel runs the barrier itself (set by the launcher)"),
        ("int32_t", "padding", ""),
        ("int64_t[kSignatureLen]", "signature", "the call's signature, compared across ranks at its barrier"),
    ],
    "LayoutArgs": [  # layout kernel: send positions and counts of this rank's routing
        ("const int64_t*", "topk_idx", "[N, K]"),
        ("int64_t*", "clean_idx", "[N, K] invalid slots -> -1"),
        ("int64_t*", "send_pos", "[N, R] row inside destination block d, -1 if not sent there"),
        ("int32_t*", "expert_rank", "[N, K] tokens before this one that chose the slot's expert"),
        ("int64_t*", "num_tokens_per_rank", "[R]"),
        ("int64_t*", "num_tokens_per_expert", "[E]"),
        ("int64_t*", "flags", "[1] error flags: 1 out of range, 2 duplicate expert in a row"),
        ("int32_t*", "scratch", "[num_blocks][R + E + 1] per-chunk counts (each block sums those before it)"),
        ("int32_t", "num_blocks", "co-resident blocks, each a chunk of tokens (layout_blocks)"),
        ("int32_t", "padding", ""),
    ],
    "NotifyArgs": [  # notify (the layout kernel's last block): counts into every peer's control slot, barrier, copies
        ("const int64_t*", "num_tokens_per_rank", "[R] rows this rank sends to each rank"),
        ("const int64_t*", "num_tokens_per_expert", "[E]"),
        ("const int64_t*", "flags", "[1] error flags of this rank's routing"),
        ("int64_t*", "pending_flags", "[R] flags of no-sync dispatches: ORed in, copied to the summary"),
        ("int64_t*", "recv_slots", "[R][SLOT_STRIDE] copy of the slots, or null"),
        ("int64_t*", "summary", "host-mapped summary (summary_len values), or null: no CPU sync"),
        ("int64_t*", "summary_done", "host-mapped word (NOTIFY_DONE_OFFSET) set after the summary, null with it"),
        ("int64_t", "done_value", "what the notify writes there: this call's number (the host extension's count)"),
    ],
    "DispatchInputs": [
        ("const uint8_t*", "x", "[N, data_bytes]"),
        ("const uint8_t*", "scales", "[N, scale_bytes] or null"),
        ("const int64_t*", "clean_idx", "[N, K]"),
        ("const uint8_t*", "weights", "[N, K * wb] or null"),
        ("const int64_t*", "send_pos", "[N, R]"),
        ("const int32_t*", "expert_rank", "[N, K]"),
        ("int64_t", "quantize", "0, or the FP8 format (1 fp8_block128, 2 mxfp8) the senders cast bf16 x [N, 2 * "
                                "data_bytes] to (`quantize=`; scales null)"),
    ],
    "RecvOutputs": [
        ("const int64_t*", "counts", "[R][SLOT_STRIDE] from the counts of a slot: rows from source s, then its "
                                     "per-local-expert counts"),
        ("uint8_t*", "x", "[P, data_bytes]"),
        ("uint8_t*", "scales", "[P, scale_bytes] or null"),
        ("int64_t*", "topk_idx", "[M, K] local ids, or null (cached dispatch)"),
        ("int64_t", "dequantize", "0, or the FP8 format (1 fp8_block128, 2 mxfp8) of the wire rows, which the "
                                  "receivers (and senders, for own rows) cast to bf16 x [P, 2 * data_bytes]; "
                                  "scales then null"),
        ("uint8_t*", "weights", "non-expand [M, K * wb], expand [P * wb], or null"),
        ("int64_t*", "src_idx", "[M] or null"),
        ("int32_t*", "expand_row", "[M, K] or null (non-expand)"),
        ("int64_t*", "psum_rank", "[R] inclusive, or null"),
        ("int64_t*", "psum_expert", "[L] inclusive aligned, or null"),
        ("int64_t", "num_rows", "M: rows of topk_idx / src_idx / expand_row (and x when not expanding)"),
        ("int64_t", "num_expand_rows", "P when expanding"),
        ("int32_t", "do_expand", ""),
        ("int32_t", "padding", ""),
    ],
    "CombineArgs": [
        ("const uint8_t*", "x", "[M or P, data_bytes] the dispatch outputs' layout"),
        ("const uint8_t*", "weights", "non-expand [M, K * wb], expand [P * wb], or null"),
        ("const int64_t*", "psum_rank", "[R] inclusive rows received from each source"),
        ("const int32_t*", "expand_row", "[M, K] or null (non-expand)"),
        ("const int64_t*", "send_pos", "[N, R] (reduce side: this rank's tokens)"),
        ("const int64_t*", "clean_idx", "[N, K]"),
        ("void*", "acc", "[N, H] accumulator between rounds, or null (single round)"),
        ("const void*", "bias0", "[N, H] or null"),
        ("const void*", "bias1", "[N, H] or null"),
        ("void*", "out", "[N, H] the sums, unless terms is set"),
        ("void*", "terms", "[N, T, H] each row at its term (expand: slot, T = K; else rank, T = R), not summed; "
                           "or null"),
        ("uint8_t*", "out_weights", "[N, K * wb] or null"),
        ("int64_t", "hidden", ""),
        ("int64_t", "num_x_rows", "rows of x (a row index from the handle past it is never followed)"),
        ("int32_t", "do_expand", ""),
        ("int32_t", "slot_begin", ""),
        ("int32_t", "slot_end", ""),
        ("int32_t", "num_slots", "sub-rows per token in the region this round"),
        ("int32_t", "first_round", ""),
        ("int32_t", "last_round", ""),
        ("int32_t", "partial", "expand: a token's rows on this rank go back added (one row: the FP32/FP64 sum, or "
                               "the row itself for one slot; K weights), the source adds them per rank"),
    ],
}

CONSTANTS = {  # name in C -> (value, C type)
    "kMaxRanks": (MAX_RANKS, "int"), "kSignatureLen": (SIGNATURE_LEN, "int"),
    "kRecvTableLimit": (RECV_TABLE_LIMIT, "int64_t"),
    "kMaxDynamicSmem": (MAX_DYNAMIC_SMEM, "int64_t"), "kLayoutThreads": (LAYOUT_THREADS, "int"),
    "kLayoutMaxBlocks": (LAYOUT_MAX_BLOCKS, "int"),
    **{"kWorkspace" + piece.title().replace("_", ""): (i, "int") for i, piece in enumerate(WORKSPACE_PIECES)},
    "kWorkspaceLength": (len(WORKSPACE_PIECES), "int"),
    "kControlBytes": (CONTROL_BYTES, "int64_t"), "kBarrierFlagsOffset": (BARRIER_FLAGS_OFFSET, "int64_t"),
    "kBarrierSeqOffset": (BARRIER_SEQ_OFFSET, "int64_t"),
    "kKernelDoneOffset": (KERNEL_DONE_OFFSET, "int64_t"), "kAbortOffset": (ABORT_OFFSET, "int64_t"),
    "kSignaturesOffset": (SIGNATURES_OFFSET, "int64_t"), "kSlotsOffset": (SLOTS_OFFSET, "int64_t"),
    "kMappedSignaturesOffset": (MAPPED_SIGNATURES_OFFSET, "int64_t"),
    "kNotifyDoneOffset": (NOTIFY_DONE_OFFSET, "int64_t"), "kSummaryOffset": (SUMMARY_OFFSET, "int64_t"),
    "kSlotStride": (SLOT_STRIDE, "int64_t"), "kTagMagic": (TAG_MAGIC, "int64_t"),
    "kErrorTimeout": (ERROR_TIMEOUT, "int64_t"), "kErrorDisagree": (ERROR_DISAGREE, "int64_t"),
    "kPartWhole": (PART_WHOLE, "int"), "kPartSend": (PART_SEND, "int"), "kPartReceive": (PART_RECEIVE, "int"),
    **{"kDtype" + name[0].upper() + name[1:]: (code, "int") for name, code in DTYPE_CODES.items()},
    "kFp8Block128": (FP8_CODES["fp8_block128"], "int"), "kFp8Mx": (FP8_CODES["mxfp8"], "int"),
    "kFp8ChannelsPerScale": (FP8_CHANNELS_PER_SCALE, "int"),
    "kAmaxMinBits": (struct.unpack("<I", struct.pack("<f", AMAX_MIN))[0], "uint32_t"),
    "kRoutingOutOfRange": (ROUTING_OUT_OF_RANGE, "int"), "kRoutingDuplicate": (ROUTING_DUPLICATE, "int"),
    "kLayoutSmemWordsPerColumn": (LAYOUT_SMEM_WORDS_PER_COLUMN, "int64_t"),
    "kLayoutSmemWordsFixed": (LAYOUT_SMEM_WORDS_FIXED, "int64_t"),
    "kLayoutSteps": (1 + len(LAYOUT_STEPS), "int"),
}

# The kernel library's C functions: name -> (return type, [(C type, parameter)]). The generated header declares them
# (so the compiler holds every definition in csrc/kernels to its row here), the host extension takes their types
# from those declarations, and moe_comm.backends.cuda_kernels gives ctypes the same (`ctypes_signature`).
FUNCTIONS = {
    "moe_comm_last_error": ("const char*", []),
    "moe_comm_abi": ("int", [("int64_t*", "out"), ("int", "capacity")]),
    "moe_comm_alloc_mapped": ("int", [("int64_t", "bytes"), ("void**", "host"), ("void**", "device")]),
    "moe_comm_free_mapped": ("int", [("void*", "host")]),
    "moe_comm_wait_notify": ("int", [("const volatile int64_t*", "done"), ("int64_t", "value"),
                                     ("cudaStream_t", "stream")]),
    "moe_comm_clear_disagreement": ("int", [("uint8_t*", "local_base"), ("ErrorRecord*", "error"),
                                            ("cudaStream_t", "stream")]),
    "moe_comm_ipc_alloc": ("int", [("int64_t", "bytes"), ("void**", "ptr"), ("void*", "handle")]),
    "moe_comm_ipc_open": ("int", [("const void*", "handle"), ("void**", "ptr")]),
    "moe_comm_ipc_close": ("int", [("void*", "ptr")]),
    "moe_comm_ipc_free": ("int", [("void*", "ptr")]),
    "moe_comm_layout": ("int", [("const EpParams*", "p"), ("const LayoutArgs*", "a"), ("const NotifyArgs*", "n"),
                                ("cudaStream_t", "stream")]),
    "moe_comm_dispatch": ("int", [("const EpParams*", "p"), ("const DispatchInputs*", "in"),
                                  ("const RecvOutputs*", "out"), ("int", "num_blocks"), ("int", "with_barrier"),
                                  ("int", "part"), ("cudaStream_t", "stream")]),
    "moe_comm_combine": ("int", [("const EpParams*", "p"), ("const CombineArgs*", "a"), ("int", "dtype"),
                                 ("int", "num_blocks"), ("int", "part"), ("cudaStream_t", "stream")]),
    "moe_comm_refuse": ("int", [("const EpParams*", "p"), ("cudaStream_t", "stream")]),
    "moe_comm_wait_flag": ("int", [("const EpParams*", "p"), ("const int64_t*", "flag"), ("int64_t", "expected"),
                                   ("int", "peer"), ("int", "phase"), ("cudaStream_t", "stream")]),
    "moe_comm_signal_flag": ("int", [("int64_t*", "flag"), ("int64_t", "value"), ("cudaStream_t", "stream")]),
    "moe_comm_copy": ("int", [("void*", "dst"), ("const void*", "src"), ("int64_t", "bytes"),
                              ("cudaStream_t", "stream")]),
    "moe_comm_wait_flags": ("int", [("const EpParams*", "p"), ("const int64_t*", "flags"), ("int", "n"),
                                    ("int64_t", "expected"), ("int", "phase"), ("cudaStream_t", "stream")]),
    "moe_comm_signal_flags": ("int", [("int64_t* const*", "targets"), ("int", "n"), ("int64_t", "value"),
                                      ("cudaStream_t", "stream")]),
    "moe_comm_reduce_slots": ("int", [("const void*", "slots"), ("int64_t", "slot_stride"), ("int", "num_slots"),
                                      ("int64_t", "numel"), ("void*", "out"), ("int", "dtype"), ("int", "num_blocks"),
                                      ("cudaStream_t", "stream")]),
    "moe_comm_engram_gather": ("int", [("const int64_t*", "indices"), ("int64_t", "num_rows"),
                                       ("const int64_t*", "offsets"), ("int", "num_ranks"),
                                       ("const uint8_t* const*", "bases"), ("int64_t", "row_bytes"),
                                       ("uint8_t*", "out"), ("int", "num_blocks"), ("cudaStream_t", "stream")]),
    "moe_comm_expert_sum": ("int", [("const void*", "rows"), ("const int64_t*", "bag_rows"),
                                    ("const int64_t*", "bag_offsets"), ("int64_t", "num_bags"),
                                    ("int64_t", "row_elems"), ("void*", "out"), ("int", "dtype"),
                                    ("int", "num_blocks"), ("cudaStream_t", "stream")]),
}
# Only in a profiling build (-DMOE_COMM_BLOCK_TIMES): per block the global timer at its steps.
BLOCK_TIME_FUNCTIONS = {name: ("int", [("uint64_t*", "host"), ("int", "num_blocks")])
                        for name in ("moe_comm_dispatch_block_times", "moe_comm_combine_block_times",
                                     "moe_comm_layout_step_times")}

_CTYPES = {"int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64, "int32_t": ctypes.c_int32}


def _ctype(c_type: str):
    if c_type.endswith("*"):
        return ctypes.c_void_p
    if c_type.endswith("]"):
        base, count = c_type[:-1].split("[")
        return _CTYPES[base] * CONSTANTS[count][0]
    return _CTYPES[c_type]


def _make_struct(name: str) -> type:
    return type(name, (ctypes.Structure,), {"_fields_": [(field, _ctype(t)) for t, field, _ in STRUCTS[name]]})


ErrorRecord = _make_struct("ErrorRecord")
EpParams = _make_struct("EpParams")
LayoutArgs = _make_struct("LayoutArgs")
NotifyArgs = _make_struct("NotifyArgs")
DispatchInputs = _make_struct("DispatchInputs")
RecvOutputs = _make_struct("RecvOutputs")
CombineArgs = _make_struct("CombineArgs")
CTYPES_STRUCTS = {s.__name__: s for s in (ErrorRecord, EpParams, LayoutArgs, NotifyArgs, DispatchInputs,
                                          RecvOutputs, CombineArgs)}


def ctypes_signature(name: str) -> tuple[object, list]:
    """`(restype, argtypes)` of a function of FUNCTIONS or BLOCK_TIME_FUNCTIONS: pointers to the structs typed,
    every other pointer an address (`ctypes.c_void_p`, which also takes ctypes arrays and `byref`)."""
    result, params = {**FUNCTIONS, **BLOCK_TIME_FUNCTIONS}[name]

    def ctype(c_type: str):
        if c_type == "const char*":
            return ctypes.c_char_p
        if c_type.endswith("*"):
            base = c_type.removeprefix("const ").rstrip("*")
            return ctypes.POINTER(CTYPES_STRUCTS[base]) if base in CTYPES_STRUCTS else ctypes.c_void_p
        return {"int": ctypes.c_int, "cudaStream_t": ctypes.c_void_p, **_CTYPES}[c_type]

    return ctype(result), [ctype(t) for t, _ in params]


def abi_table() -> list[tuple[str, int]]:
    """`(what, value)` pairs the compiled library must reproduce: every struct's size and every field's offset,
    in the order of `STRUCTS` (the generated header lists the same in `kAbiTable`)."""
    table = []
    for name, c_struct in CTYPES_STRUCTS.items():
        table.append((f"sizeof({name})", ctypes.sizeof(c_struct)))
        table += [(f"offsetof({name}, {field})", getattr(c_struct, field).offset) for _, field, _ in STRUCTS[name]]
    return table


def render_header() -> str:
    """The text of `moe_comm/abi.h` (generated; the CUDA sources include it)."""
    out = ["// Generated from moe_comm/layout.py by the JIT: do not edit. See that module for the buffer layout.",
           "#pragma once", "", "#include <cstddef>", "#include <cstdint>", "", "namespace moe_comm {", ""]
    out += [f"constexpr {c_type} {name} = {value};" for name, (value, c_type) in CONSTANTS.items()]
    for name, fields in STRUCTS.items():
        out += ["", f"struct {name} {{"]
        for c_type, field, comment in fields:
            decl = f"{c_type.split('[')[0]} {field}[{c_type.split('[')[1]}" if "[" in c_type else f"{c_type} {field}"
            out.append(f"    {decl};" + (f"  // {comment}" if comment else ""))
        out.append("};")
    out += ["", "// sizeof and offsetof of every struct and field, in moe_comm/layout.py's order (abi_table).",
            "constexpr int64_t kAbiTable[] = {"]
    for name, fields in STRUCTS.items():
        out.append(f"    sizeof({name}),")
        out += [f"    offsetof({name}, {field})," for _, field, _ in fields]
    out += ["};", "", "// The notify summary's entries (SUMMARY): where value i of each lies, in int64 values from",
            "// SUMMARY_OFFSET."]
    for name, (a, b, c, stride) in SUMMARY.items():
        factors = ((a, "R"), (b, "L"), (stride, "i"))
        terms = [v if k == 1 else f"{k} * {v}" for k, v in factors if k] + ([str(c)] if c else [])
        params = ", ".join("int64_t " + v if k else "int64_t" for k, v in factors)
        out.append(f"constexpr int64_t summary_{name}({params}) {{ return {' + '.join(terms) or '0'}; }}")
    out += ["", "}  // namespace moe_comm", "",
            "// The kernel library's C functions (FUNCTIONS; the definitions are in csrc/kernels).",
            "typedef struct CUstream_st* cudaStream_t;", 'extern "C" {']
    qualify = re.compile(r"\b(" + "|".join(STRUCTS) + r")\b")

    def declare(name: str, result: str, params: list) -> str:
        args = ", ".join(qualify.sub(r"moe_comm::\1", f"{t} {p}") for t, p in params)
        return f"{result} {name}({args});"

    out += [declare(name, *sig) for name, sig in FUNCTIONS.items()]
    out += ["#ifdef MOE_COMM_BLOCK_TIMES", *(declare(name, *sig) for name, sig in BLOCK_TIME_FUNCTIONS.items()),
            "#endif", '}  // extern "C"', ""]
    return "\n".join(out)


__all__ = ["MAX_RANKS", "SIGNATURE_LEN", "MAX_ROUND_SLOTS", "RECV_TABLE_LIMIT", "MAX_DYNAMIC_SMEM", "LAYOUT_THREADS",
           "CONTROL_BYTES", "SLOT_STRIDE", "TAG_BYTES", "LAYOUT_MIN_CHUNK", "LAYOUT_MAX_BLOCKS", "RowFormat",
           "dispatch_row", "combine_row", "layout_blocks", "layout_smem_bytes", "layout_scratch_ints",
           "WORKSPACE_PIECES", "workspace_offsets", "summary_len", "recv_table_bytes", "STRUCTS", "CTYPES_STRUCTS",
           "abi_table", "render_header"]
