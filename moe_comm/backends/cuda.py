"""CUDA backend: dispatch and combine kernels over NVLink peer memory (`csrc/ep_kernels.cu`).

Every rank owns one symmetric buffer (`torch.distributed._symmetric_memory`, peers mapped through CUDA IPC):

    [0, CONTROL_BYTES)          flags and sequence counters (offsets below), then one control slot per source
                                rank: the call's signature, rows sent to us, per-local-expert counts, error flags
    [CONTROL_BYTES, num_bytes)  the receive region: block s (`num_max_tokens_per_rank` rows) from rank s

A dispatch: layout kernel (send positions, counts) -> notify kernel (the barrier: nobody writes into a region its
owner still reads; every rank's counts and call signature into every peer's control slot; a summary in host-mapped
memory that the host reads when the call syncs, then sizes the outputs) -> dispatch kernel: sender blocks write each
row once per destination rank straight into that rank's block with its metadata (a non-expand dispatch writes the
own rank's rows straight into the outputs), receiver blocks copy the rows that arrive into the output rows
(non-expand, or expand with padding). A cached dispatch runs the barrier and the dispatch kernel only.
A combine: barrier -> one kernel: senders return rows to their sources, reducers add each token's rows (their own
from the combine input) in FP32/FP64 in DESIGN 2.2's order.
Small exchanges (argument agreement under MOE_COMM_CHECK_INPUTS) use `_exchange`: block copies into the region.
Everything is stream-ordered on the comm stream and nothing reads device values on the host unless the call
asked for a CPU sync, so no-sync steps can be captured in a CUDA graph.

Every wait spins with a timeout (`num_gpu_timeout_secs`); a timed-out wait fills a host-mapped ErrorRecord and
lets the stream go on, and the host raises a TimeoutError naming rank, phase and peer at its next check (the
next host sync of a call, or the start of the next call). After a timeout the buffer refuses further work.

Kernels: `csrc/transport.cu` and `csrc/ep_kernels.cu`, built by `moe_comm.jit` at first use (never at import).
The receive order is deterministic (source rank, then source token), so `deterministic=True` costs nothing.
"""

from __future__ import annotations

import ctypes
import functools
import socket
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .. import jit, quant, sizing
from ..handle import EPHandle
from .torch_ref import TorchRefBackend

# Kernel libraries of this backend: name -> sources under csrc/ (CI compiles every one of them).
KERNEL_SOURCES = {"moe_comm_kernels": ("transport.cu", "ep_kernels.cu")}
KERNEL_INCLUDE_DIRS = ("include",)
KERNEL_FLAGS: tuple[str, ...] = ()  # extra nvcc flags (scripts/profile_ops.py --variants tries -D settings)
SEND_FRACTION: dict[str, float] = {}  # "dispatch"/"combine": share of sending blocks, overriding _num_send_blocks
                                    # (scripts/profile_ops.py --variants send=F,csend=F)

MAX_RANKS = 32                      # csrc/ep_kernels.cu kMaxEpRanks (destinations fit one warp)
CONTROL_BYTES = sizing.BUFFER_CONTROL_BYTES
BARRIER_FLAGS_OFFSET = 0            # [MAX_RANKS] int64, written by peers
EXCHANGE_FLAGS_OFFSET = 4096        # [MAX_RANKS] int64, written by peers
BARRIER_SEQ_OFFSET = 8192           # this rank's counters (device-side, so graph replays advance them)
EXCHANGE_SEQ_OFFSET = 8200
SLOTS_OFFSET = 16384                # control slots [num_ranks][SLOT_STRIDE] int64, see _slots
SLOT_STRIDE = (CONTROL_BYTES - SLOTS_OFFSET) // (8 * MAX_RANKS)  # fixed, so ranks that disagree on sizes
                                    # still read each other's signature where it was written
SIGNATURE_LEN = 16                  # csrc/ep_kernels.cu kMaxSignature
SUMMARY_OFFSET = 64                 # the notify summary in the host-mapped memory (after the ErrorRecord)
COPY_THREADS = 512                  # csrc/ep_kernels.cu: at most kMaxWarpsPerBlock warps per block
TAG_BYTES = 16                      # csrc/ep_kernels.cu kTagBytes: a dispatch region row ends in its tag
MAX_ROUND_SLOTS = 32                # expand combine slots per round: one reducer lane each
RECV_TABLE_LIMIT = 48 * 1024 - 256  # csrc/ep_kernels.cu kMaxTableSmem: count tables of the receivers
DTYPE_CODES = {torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


def _align16(n: int) -> int:
    return -(-n // 16) * 16


class _BlockCopyParams(ctypes.Structure):
    _fields_ = [("send", ctypes.c_void_p), ("send_rows", ctypes.c_void_p), ("peer_bases", ctypes.c_void_p),
                ("width", ctypes.c_int64), ("send_block_rows", ctypes.c_int64), ("round_first_row", ctypes.c_int64),
                ("round_rows", ctypes.c_int64), ("region_offset", ctypes.c_int64), ("rank", ctypes.c_int32),
                ("num_ranks", ctypes.c_int32)]


class _SyncParams(ctypes.Structure):
    _fields_ = [("peer_bases", ctypes.c_void_p), ("local_base", ctypes.c_void_p), ("error", ctypes.c_void_p),
                ("flags_offset", ctypes.c_int64), ("seq_offset", ctypes.c_int64), ("timeout_ns", ctypes.c_uint64),
                ("rank", ctypes.c_int32), ("num_ranks", ctypes.c_int32), ("phase", ctypes.c_int32),
                ("padding", ctypes.c_int32)]


class _EpParams(ctypes.Structure):
    _fields_ = [("peer_bases", ctypes.c_void_p), ("local_base", ctypes.c_void_p), ("region_offset", ctypes.c_int64),
                ("counts_offset", ctypes.c_int64), ("counts_stride", ctypes.c_int64), ("num_tokens", ctypes.c_int64),
                ("cap", ctypes.c_int64), ("row_stride", ctypes.c_int64), ("data_bytes", ctypes.c_int64),
                ("scale_bytes", ctypes.c_int64), ("meta_offset", ctypes.c_int64), ("rank", ctypes.c_int32),
                ("num_ranks", ctypes.c_int32), ("num_experts", ctypes.c_int32), ("num_local_experts", ctypes.c_int32),
                ("num_topk", ctypes.c_int32), ("weight_bytes", ctypes.c_int32), ("expert_alignment", ctypes.c_int32),
                ("num_signature", ctypes.c_int32), ("signature", ctypes.c_int64 * SIGNATURE_LEN),
                ("error", ctypes.c_void_p), ("timeout_ns", ctypes.c_uint64), ("seq_offset", ctypes.c_int64),
                ("phase", ctypes.c_int32), ("num_send_blocks", ctypes.c_int32)]


class _NotifyArgs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("num_tokens_per_rank", "num_tokens_per_expert", "flags",
                                                     "pending_flags", "recv_slots", "summary")] + \
               [(name, ctypes.c_int64) for name in ("barrier_flags_offset", "exchange_flags_offset",
                                                    "exchange_seq_offset")] + \
               [("barrier_phase", ctypes.c_int32), ("exchange_phase", ctypes.c_int32)]


class _DispatchInputs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("x", "scales", "clean_idx", "weights", "send_pos",
                                                     "expert_rank")]


class _RecvOutputs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("counts", "x", "scales", "topk_idx", "weights", "src_idx",
                                                     "expand_row", "psum_rank", "psum_expert")] + \
               [("num_rows", ctypes.c_int64), ("num_expand_rows", ctypes.c_int64), ("do_expand", ctypes.c_int32),
                ("padding", ctypes.c_int32)]


class _CombineArgs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("x", "weights", "psum_rank", "expand_row", "send_pos",
                                                     "clean_idx", "acc", "bias0", "bias1", "out", "out_weights")] + \
               [("hidden", ctypes.c_int64), ("num_x_rows", ctypes.c_int64)] + \
               [(name, ctypes.c_int32) for name in ("do_expand", "slot_begin", "slot_end", "num_slots", "first_round",
                                                    "last_round")]


@dataclass(frozen=True)
class CudaLayout:
    """Routing state of the CUDA backend, kept in `EPHandle.layout`.

    send_pos_NR: `[N, R]` int64 row of each token inside its destination block, -1 if not sent there.
    expert_rank_NK: `[N, K]` int32 tokens before this one (on this rank) that chose the slot's expert.
    num_tokens_per_rank: `[R]` int64; num_tokens_per_expert: `[E]` int64 (what this rank sends).
    flags: `[1]` int64 error flags of this rank's routing.
    expand_row_MK: `[M, K]` int32 output row of each (received row, slot) in expand mode, else None.
    recv_slots: `[R, SLOT_STRIDE]` int64 copy of the control slots this dispatch received (rows and per-expert
        counts from every source, in the first `SIGNATURE_LEN + L + 2` columns), for the receivers of a cached
        dispatch; None until received.
    """

    send_pos_NR: torch.Tensor
    expert_rank_NK: torch.Tensor
    num_tokens_per_rank: torch.Tensor
    num_tokens_per_expert: torch.Tensor
    flags: torch.Tensor
    expand_row_MK: Optional[torch.Tensor]
    recv_slots: Optional[torch.Tensor]


def _num_send_blocks(op: str, num_sms: int, num_ranks: int, do_expand: bool) -> int:
    """Blocks of a dispatch/combine kernel that send (the others receive), in proportion to the rows each side
    stores: dispatch senders store every row (a non-expand dispatch writes the own rank's rows straight into the
    outputs) and its receivers the rows from peers (all rows when expanding); combine senders store the rows that
    go back to peers and its reducers load every row of a token, their own from x (benchmarks/NOTES.md)."""
    R = num_ranks
    if op == "dispatch":
        fraction = 0.5 if do_expand else R / (2 * R - 1)
    else:
        fraction = (R - 1) / (2 * R - 1)
    fraction = SEND_FRACTION.get(op, fraction)
    return max(1, min(num_sms - 1, round(num_sms * fraction)))


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def kernel_sources() -> dict[str, tuple[list, list]]:
    """Every kernel library as `name -> (source paths, include dirs)`."""
    includes = [jit.CSRC_DIR / d for d in KERNEL_INCLUDE_DIRS]
    return {name: ([jit.CSRC_DIR / s for s in srcs], includes) for name, srcs in KERNEL_SOURCES.items()}


def load_kernels() -> ctypes.CDLL:
    sources, includes = kernel_sources()["moe_comm_kernels"]
    lib = jit.load("moe_comm_kernels", sources, include_dirs=includes, flags=KERNEL_FLAGS)
    lib.moe_comm_error_string.restype = ctypes.c_char_p
    # The structs above must match the C++ ones byte for byte.
    sizes = [(lib.moe_comm_sizeof_params, 0, _BlockCopyParams), (lib.moe_comm_sizeof_params, 1, _SyncParams),
             (lib.moe_comm_sizeof_ep_structs, 0, _EpParams), (lib.moe_comm_sizeof_ep_structs, 1, _RecvOutputs),
             (lib.moe_comm_sizeof_ep_structs, 2, _CombineArgs), (lib.moe_comm_sizeof_ep_structs, 3, _DispatchInputs),
             (lib.moe_comm_sizeof_ep_structs, 4, _NotifyArgs)]
    for fn, which, struct in sizes:
        assert fn(which) == ctypes.sizeof(struct), f"{struct.__name__}: C {fn(which)} != Python {ctypes.sizeof(struct)}"
    return lib


def peers_reachable(group: dist.ProcessGroup) -> bool:
    """Whether every rank of `group` is a GPU of one host that can access every other directly (NVLink/P2P).

    Collective over `group` (every rank must call it): ranks exchange their host name and local verdict, so all
    of them reach the same answer.
    """
    local_ok = torch.cuda.is_available() and dist.get_world_size(group) <= MAX_RANKS
    if local_ok:
        me = torch.cuda.current_device()
        local_ok = all(torch.cuda.can_device_access_peer(me, d) for d in range(torch.cuda.device_count()) if d != me)
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (socket.gethostname(), bool(local_ok)), group=group)
    return len({host for host, _ in everyone}) == 1 and all(ok for _, ok in everyone)


class CudaBackend(TorchRefBackend):
    """`Buffer(backend="cuda")`: dispatch and combine kernels over NVLink peer memory.

    It shares the reference backend's argument and value checks, stream handling (`_run`) and error flags; its
    own `_dispatch_steps` / `_combine_steps` launch the kernels, and `_exchange` (block copies) serves the small
    exchanges of the shared checks.
    """

    name = "cuda"

    def __init__(self, group: dist.ProcessGroup, device: torch.device, num_bytes: int, num_cpu_timeout_secs: float,
                 num_gpu_timeout_secs: float) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        super().__init__(group, device, num_cpu_timeout_secs)
        self.lib = load_kernels()
        self.timeout_ns = int(num_gpu_timeout_secs * 1e9)
        self.buffer = symm_mem.empty(num_bytes, dtype=torch.uint8, device=device)
        self.buffer.zero_()
        self.symm = symm_mem.rendezvous(self.buffer, group.group_name)
        self.region_bytes = num_bytes - CONTROL_BYTES
        self.num_device_sms = torch.cuda.get_device_properties(device).multi_processor_count
        # Host-mapped memory: the ErrorRecord (6 int64) at 0, the dispatch notify's summary at SUMMARY_OFFSET.
        host, dev = ctypes.c_void_p(), ctypes.c_void_p()
        summary_len = MAX_RANKS * (SIGNATURE_LEN + 2) + MAX_RANKS + 1 + SLOT_STRIDE
        self._check(self.lib.moe_comm_alloc_mapped(ctypes.c_int64(SUMMARY_OFFSET + 8 * summary_len),
                                                   ctypes.byref(host), ctypes.byref(dev)), "host-mapped memory")
        self._error_host, self._error_dev = host.value, dev.value
        self._phases: list[str] = []
        self.broken: Optional[str] = None
        # Every peer's buffer is zeroed before anyone signals into it.
        torch.cuda.synchronize(device)
        dist.barrier(group=group)

    def close(self) -> None:
        """Wait for our streams to finish with the symmetric buffer, then free the host-mapped memory."""
        torch.cuda.synchronize(self.device)
        if self._error_host is not None:
            self._check(self.lib.moe_comm_free_mapped(ctypes.c_void_p(self._error_host)), "free")
            self._error_host = None

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"moe_comm: {what} failed on rank {self.rank}: "
                               f"{self.lib.moe_comm_error_string(code).decode()}")

    def _phase_id(self, phase: str) -> int:
        if phase not in self._phases:
            self._phases.append(phase)
        return self._phases.index(phase)

    def after_host_sync(self) -> None:
        """Raise (once, then refuse work) if a kernel wait timed out."""
        if self._error_host is None:
            raise RuntimeError("moe_comm: this buffer was destroyed")
        if self.broken is not None:
            raise RuntimeError(f"moe_comm: this buffer is unusable after an earlier error: {self.broken}")
        code, rank, phase, peer, observed, expected = (ctypes.c_int64 * 6).from_address(self._error_host)
        if code:
            name = self._phases[phase] if 0 <= phase < len(self._phases) else f"phase {phase}"
            self.broken = (f"rank {rank} timed out in {name} waiting for peer {peer} (flag {observed}, "
                           f"expected {expected}) after num_gpu_timeout_secs={self.timeout_ns / 1e9:g}")
            raise TimeoutError(f"moe_comm: {self.broken}")

    def _signal_wait(self, flags_offset: int, seq_offset: int, phase: str, stream: ctypes.c_void_p) -> None:
        params = _SyncParams(self.symm.buffer_ptrs_dev, self.buffer.data_ptr(), self._error_dev, flags_offset,
                             seq_offset, self.timeout_ns, self.rank, self.num_ranks, self._phase_id(phase), 0)
        self._check(self.lib.moe_comm_signal_wait(ctypes.byref(params), stream), phase)

    def _exchange(self, send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], phase: str):
        R = self.num_ranks
        block_rows = send_splits[0]
        assert list(send_splits) == [block_rows] * R == list(recv_splits), "fixed blocks expected"
        dtype = send.dtype
        send = send[:R * block_rows].contiguous().view(torch.uint8).view(R * block_rows, -1)
        nbytes = send.shape[1]
        width = -(-nbytes // 16) * 16
        if width != nbytes:
            # Rows travel as 16-byte vectors: pad (small tensors only: counts and agreement rows).
            padded = send.new_zeros(R * block_rows, width)
            padded[:, :nbytes] = send
            send = padded
        region_block_rows = self.region_bytes // (R * width) if width else 0
        if block_rows and region_block_rows == 0:
            raise ValueError(f"rows of {width} bytes do not fit the buffer's receive region ({self.region_bytes} "
                             f"bytes for {R} ranks); create the Buffer with a larger hidden size")
        recv = send.new_empty(R * block_rows, width)
        region = self.buffer[CONTROL_BYTES:]
        stream = self._stream()
        num_blocks = max(1, min(self.num_device_sms, -(-R * block_rows * width // (COPY_THREADS * 16 * 4))))
        first = 0
        while first < block_rows:
            rows = min(region_block_rows, block_rows - first)
            self._signal_wait(BARRIER_FLAGS_OFFSET, BARRIER_SEQ_OFFSET, f"barrier before {phase}", stream)
            # send_rows = null: whole blocks (the small exchanges that use this path have no unused rows).
            params = _BlockCopyParams(send.data_ptr(), 0,
                                      self.symm.buffer_ptrs_dev, width, block_rows, first, rows, CONTROL_BYTES,
                                      self.rank, R)
            self._check(self.lib.moe_comm_copy_blocks(ctypes.byref(params), num_blocks, COPY_THREADS, stream),
                        phase)
            self._signal_wait(EXCHANGE_FLAGS_OFFSET, EXCHANGE_SEQ_OFFSET, phase, stream)
            # This round's blocks, source s at s * rows in the region, into their place in `recv`.
            arrived = region[:R * rows * width].view(R, rows, width)
            recv.view(R, block_rows, width)[:, first:first + rows] = arrived
            first += rows
        recv = recv[:, :nbytes].contiguous() if width != nbytes else recv
        return recv.view(dtype).view(R * block_rows, -1), []

    # ------------------------------------------------------------------------------------------------
    # Kernel plumbing
    # ------------------------------------------------------------------------------------------------
    def _stream(self) -> ctypes.c_void_p:
        """The stream kernels go to (read once per operation: the lookup costs host time)."""
        return ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)

    def _ep_params(self, num_tokens: int, cap: int, num_experts: int, num_topk: int, row_stride: int,
                   data_bytes: int, scale_bytes: int, meta_offset: int, weight_bytes: int, expert_alignment: int,
                   signature: Sequence[int] = (), rows_per_token: int = 1, phase: str = "",
                   num_send_blocks: int = 0) -> _EpParams:
        R = self.num_ranks
        L = num_experts // R
        needed = R * cap * rows_per_token * row_stride
        if needed > self.region_bytes:
            raise ValueError(f"rows of {row_stride} bytes x {R} ranks x {cap} tokens x {rows_per_token} = {needed} "
                             f"bytes do not fit the buffer's receive region of {self.region_bytes} bytes")
        if SIGNATURE_LEN + L + 2 > SLOT_STRIDE:
            raise ValueError(f"num_experts={num_experts} over {R} ranks is {L} local experts; the CUDA backend takes "
                             f"at most {SLOT_STRIDE - SIGNATURE_LEN - 2} per rank (use backend='torch')")
        # Always SIGNATURE_LEN values (zero-padded): the slot layout must not depend on the call.
        sig = (ctypes.c_int64 * SIGNATURE_LEN)(*signature)
        return _EpParams(self.symm.buffer_ptrs_dev, self.buffer.data_ptr(), CONTROL_BYTES, SLOTS_OFFSET,
                         SLOT_STRIDE, num_tokens, cap, row_stride, data_bytes, scale_bytes, meta_offset,
                         self.rank, R, num_experts, L, num_topk, weight_bytes, expert_alignment, SIGNATURE_LEN, sig,
                         self._error_dev, self.timeout_ns, BARRIER_SEQ_OFFSET, self._phase_id(phase),
                         num_send_blocks)

    def _check_num_sms(self, num_sms: int) -> None:
        # Senders and receivers of one kernel must all be resident at once: one block per SM at most.
        if not 2 <= num_sms <= self.num_device_sms:
            raise ValueError(f"num_sms={num_sms}: the CUDA backend needs 2 (a sender and a receiver) to "
                             f"{self.num_device_sms} (the SMs of {self.device})")

    def _slots(self, num_local_experts: int) -> torch.Tensor:
        """The control slots as `[R, SIGNATURE_LEN + L + 2]` int64 (a view of our buffer with row stride
        SLOT_STRIDE): slot s, written by rank s, holds its signature, the rows it sent us, its per-expert counts
        and its error flags."""
        R = self.num_ranks
        slots = self.buffer[SLOTS_OFFSET:SLOTS_OFFSET + R * SLOT_STRIDE * 8].view(torch.int64).view(R, SLOT_STRIDE)
        return slots[:, :SIGNATURE_LEN + num_local_experts + 2]

    # ------------------------------------------------------------------------------------------------
    # Dispatch
    # ------------------------------------------------------------------------------------------------
    def _dispatch_steps(self, c, verify_agreement: bool):
        """Layout, barrier, notify (counts and the sizes' agreement through the control slots), then one kernel
        that sends and receives at the same time. A cached dispatch skips layout and notify."""
        R, K, N, E = self.num_ranks, c.num_topk, c.num_tokens, c.num_experts
        L, cap, dev, hidden = E // R, c.num_max_tokens_per_rank, self.device, c.hidden
        handle: Optional[EPHandle] = c.handle
        table_bytes = -(-8 * (2 * R + 3 * L + R * L) // 128) * 128
        if table_bytes > RECV_TABLE_LIMIT:
            raise ValueError(f"num_experts={E} over {R} ranks needs {table_bytes} bytes of shared memory in the "
                             f"receive kernel (limit {RECV_TABLE_LIMIT}); use backend='torch'")
        self._check_num_sms(c.num_sms)

        # Rows on the wire: x, or FP8 data and scales (cast here for `quantize=`), as bytes.
        wire = self._wire_tensors(c)
        data, scales = (wire["x"].view(torch.uint8), None) if c.wire_format is None else (wire["q"], wire["scales"])
        data_bytes = data.shape[1]
        scale_bytes = 0 if scales is None else (hidden // 128) * 4
        weights = c.topk_weights
        wb = 0 if weights is None else weights.element_size()
        meta_offset = _align16(data_bytes + scale_bytes)
        row_stride = meta_offset + _align16(8 + 8 * K + wb * K) + TAG_BYTES
        params = self._ep_params(N, cap, E, K, row_stride, data_bytes, scale_bytes, meta_offset, wb,
                                 c.expert_alignment, list(c.signature().values()), phase="dispatch",
                                 num_send_blocks=_num_send_blocks("dispatch", c.num_sms, R, c.do_expand))
        stream = self._stream()

        # Layout (skipped by a cached dispatch: the handle has it).
        if handle is None:
            i64 = dict(dtype=torch.int64, device=dev)
            clean_idx = torch.empty(N, K, **i64)
            layout = CudaLayout(torch.empty(N, R, **i64), torch.empty(N, K, dtype=torch.int32, device=dev),
                                torch.empty(R, **i64), torch.empty(E, **i64), torch.empty(1, **i64), None, None)
            self._check(self.lib.moe_comm_layout(
                ctypes.c_void_p(c.topk_idx.data_ptr()), ctypes.c_int64(N), K, E, R, ctypes.c_void_p(clean_idx.data_ptr()),
                ctypes.c_void_p(layout.send_pos_NR.data_ptr()), ctypes.c_void_p(layout.expert_rank_NK.data_ptr()),
                ctypes.c_void_p(layout.num_tokens_per_rank.data_ptr()),
                ctypes.c_void_p(layout.num_tokens_per_expert.data_ptr()), ctypes.c_void_p(layout.flags.data_ptr()),
                stream), "dispatch layout")
        else:
            layout, clean_idx = handle.layout, handle.topk_idx

        # Barrier, then the counts into every peer's control slot and theirs into ours (one kernel), read on the
        # host when the call syncs; a cached dispatch only needs the barrier.
        sync = verify_agreement or (handle is None and c.do_cpu_sync)
        # The receivers of later cached dispatches need these counts (same row stride as the slots).
        recv_slots = torch.empty(R, SLOT_STRIDE, dtype=torch.int64, device=dev) if handle is None else None
        if handle is None or verify_agreement:
            notify = _NotifyArgs(layout.num_tokens_per_rank.data_ptr(), layout.num_tokens_per_expert.data_ptr(),
                                 layout.flags.data_ptr(), self.pending_flags.data_ptr(), _ptr(recv_slots),
                                 self._error_dev + SUMMARY_OFFSET if sync else 0, BARRIER_FLAGS_OFFSET,
                                 EXCHANGE_FLAGS_OFFSET, EXCHANGE_SEQ_OFFSET,
                                 self._phase_id("barrier before dispatch"), self._phase_id("dispatch notify"))
            self._check(self.lib.moe_comm_dispatch_notify(ctypes.byref(params), ctypes.byref(notify), stream),
                        "dispatch notify")
        else:
            self._signal_wait(BARRIER_FLAGS_OFFSET, BARRIER_SEQ_OFFSET, "barrier before dispatch", stream)
        if sync:
            num_rows, rows_per_expert = self._read_summary(c, L)

        # Output sizes: from the handle, from the summary (host sync), or the worst case.
        aligned_list = None
        if handle is not None:
            M, P = handle.recv_src_idx.shape[0], handle.num_recv_rows
            aligned_list = handle.num_recv_tokens_per_expert_list
            recv_slots = layout.recv_slots
        elif c.do_cpu_sync:
            M = num_rows
            aligned_list = [-(-n // c.expert_alignment) * c.expert_alignment for n in rows_per_expert]
            P = sum(aligned_list) if c.do_expand else M
        else:
            slots = self._slots(L)
            torch.bitwise_or(self.pending_flags, slots[:, SIGNATURE_LEN + 1 + L], out=self.pending_flags)
            M = R * cap
            P = R * cap * min(K, L) + L * (c.expert_alignment - 1) if c.do_expand else M

        # Send and receive.
        out_dtype = c.x.dtype if c.wire_format is None else torch.float8_e4m3fn
        out_x = torch.empty(P, hidden, dtype=out_dtype, device=dev)
        out_scales = None if scales is None else torch.empty(P, hidden // 128, dtype=scales.dtype, device=dev)
        fresh = handle is None
        # With a CPU sync every row is received; the worst-case outputs of a no-sync call end in -1 rows.
        alloc = torch.empty if c.do_cpu_sync else functools.partial(torch.full, fill_value=-1)
        out_idx = alloc((M, K), dtype=torch.int64, device=dev) if fresh else None
        out_src = alloc((M,), dtype=torch.int64, device=dev) if fresh else None
        out_w = None
        if fresh and weights is not None:
            out_w = torch.empty((P,) if c.do_expand else (M, K), dtype=weights.dtype, device=dev)
        expand_row = torch.empty(M, K, dtype=torch.int32, device=dev) if fresh and c.do_expand else None
        psum_rank = torch.empty(R, dtype=torch.int64, device=dev) if fresh else None
        psum_expert = torch.empty(L, dtype=torch.int64, device=dev) if fresh else None
        inputs = _DispatchInputs(_ptr(data), _ptr(scales), clean_idx.data_ptr(), _ptr(weights),
                                 layout.send_pos_NR.data_ptr(), layout.expert_rank_NK.data_ptr())
        outputs = _RecvOutputs(recv_slots.data_ptr() + 8 * SIGNATURE_LEN, _ptr(out_x), _ptr(out_scales),
                               _ptr(out_idx), _ptr(out_w), _ptr(out_src), _ptr(expand_row), _ptr(psum_rank),
                               _ptr(psum_expert), M, P, int(c.do_expand), 0)
        self._check(self.lib.moe_comm_dispatch(ctypes.byref(params), ctypes.byref(inputs), ctypes.byref(outputs),
                                               c.num_sms, COPY_THREADS, stream), "dispatch")
        recv_x = (out_x, out_scales) if scales is not None else out_x
        if c.dequantize:
            recv_x = quant.dequantize(out_x, out_scales)

        if not fresh:
            return (recv_x, None if handle.do_expand else handle.recv_topk_idx, handle.recv_topk_weights, handle), \
                [], []
        layout = CudaLayout(layout.send_pos_NR, layout.expert_rank_NK, layout.num_tokens_per_rank,
                            layout.num_tokens_per_expert, layout.flags, expand_row, recv_slots)
        handle = EPHandle(
            group=self.group, num_experts=E, num_topk=K, num_tokens=N, num_max_tokens_per_rank=cap,
            do_expand=c.do_expand, expert_alignment=c.expert_alignment, num_sms=c.num_sms, do_cpu_sync=c.do_cpu_sync,
            topk_idx=clean_idx, recv_src_idx=out_src, recv_topk_idx=out_idx, recv_topk_weights=out_w,
            psum_num_recv_tokens_per_rank=psum_rank, psum_num_recv_tokens_per_expert=psum_expert,
            num_recv_tokens=P if c.do_cpu_sync else None, num_recv_tokens_per_expert_list=aligned_list,
            num_recv_rows=P, layout=layout)
        return (recv_x, None if c.do_expand else out_idx, out_w, handle), [], []

    def _read_summary(self, c, num_local_experts: int) -> tuple[int, list[int]]:
        """Wait for the notify kernel, check every rank's signature and error flags in its host-mapped summary, and
        return (rows this rank receives, rows per local expert)."""
        R, S, L = self.num_ranks, SIGNATURE_LEN, num_local_experts
        torch.cuda.current_stream(self.device).synchronize()
        self.after_host_sync()
        values = (ctypes.c_int64 * (R * (S + 2) + R + 1 + L)).from_address(self._error_host + SUMMARY_OFFSET)[:]
        per_source, pending = [values[s * (S + 2):(s + 1) * (S + 2)] for s in range(R)], values[R * (S + 2):][:R]
        names = list(c.signature())
        assert len(names) <= S
        differing = [f"{name}: {[row[i] for row in per_source]}" for i, name in enumerate(names)
                     if len({row[i] for row in per_source}) > 1]
        if differing:
            raise ValueError("ranks called dispatch with different arguments (per rank): " + "; ".join(differing))
        if c.handle is None:
            if any(pending):
                self.check_pending_errors()
            self.raise_for_flags([row[S + 1] for row in per_source], c.topk_idx, c.num_experts, "")
        return values[R * (S + 2) + R], values[R * (S + 2) + R + 1:]

    # ------------------------------------------------------------------------------------------------
    # Combine
    # ------------------------------------------------------------------------------------------------
    def _combine_steps(self, c):
        """Rows back to their sources while the reducers add them, in slot rounds for expand combines that need
        them."""
        handle: EPHandle = c.handle
        lay: CudaLayout = handle.layout
        R, K, N, E = self.num_ranks, handle.num_topk, handle.num_tokens, handle.num_experts
        cap, dev, hidden = handle.num_max_tokens_per_rank, self.device, c.x.shape[1]
        self._check_num_sms(c.num_sms)
        data_bytes = hidden * c.x.element_size()
        weights = c.topk_weights
        wb = 0 if weights is None else weights.element_size()
        meta_offset = _align16(data_bytes)
        row_stride = meta_offset + _align16(wb * (1 if handle.do_expand else K)) + TAG_BYTES
        num_slots = 1
        if handle.do_expand:
            # As many slots per round as the region holds: each round adds its slots in ascending order.
            num_slots = min(K, MAX_ROUND_SLOTS, self.region_bytes // max(1, R * cap * row_stride))
            if num_slots == 0:
                raise ValueError(f"combine rows of {row_stride} bytes do not fit the receive region "
                                 f"({self.region_bytes} bytes for {R} ranks x {cap} tokens)")
        num_rounds = -(-K // num_slots) if handle.do_expand else 1
        params = self._ep_params(N, cap, E, K, row_stride, data_bytes, 0, meta_offset, wb, 1, rows_per_token=num_slots,
                                 phase="combine",
                                 num_send_blocks=_num_send_blocks("combine", c.num_sms, R, handle.do_expand))

        combined = torch.empty(N, hidden, dtype=c.x.dtype, device=dev)
        combined_w = None if weights is None else torch.empty(N, K, dtype=weights.dtype, device=dev)
        acc_dtype = torch.float64 if c.x.dtype == torch.float64 else torch.float32
        acc = torch.empty(N, hidden, dtype=acc_dtype, device=dev) if num_rounds > 1 else None
        bias = list(c.bias) + [None] * (2 - len(c.bias))
        stream = self._stream()
        for r in range(num_rounds):
            slot_begin, slot_end = r * num_slots, min(K, (r + 1) * num_slots)
            self._signal_wait(BARRIER_FLAGS_OFFSET, BARRIER_SEQ_OFFSET, "barrier before combine", stream)
            args = _CombineArgs(c.x.data_ptr(), _ptr(weights), handle.psum_num_recv_tokens_per_rank.data_ptr(),
                                _ptr(lay.expand_row_MK), lay.send_pos_NR.data_ptr(), handle.topk_idx.data_ptr(),
                                _ptr(acc), _ptr(bias[0]), _ptr(bias[1]), combined.data_ptr(), _ptr(combined_w),
                                hidden, c.x.shape[0], int(handle.do_expand), slot_begin, slot_end, num_slots,
                                int(r == 0), int(r == num_rounds - 1))
            self._check(self.lib.moe_comm_combine(ctypes.byref(params), ctypes.byref(args), DTYPE_CODES[c.x.dtype],
                                                  c.num_sms, COPY_THREADS, stream), "combine")
        return (combined, combined_w), [], []
