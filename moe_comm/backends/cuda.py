"""CUDA backend: the reference backend's layout logic over a symmetric-memory transport on NVLink.

Every rank owns one symmetric buffer (`torch.distributed._symmetric_memory`, peers mapped through CUDA IPC):

    [0, CONTROL_BYTES)          flags and sequence counters (see the offsets below)
    [CONTROL_BYTES, num_bytes)  the receive region: one block per source rank

An exchange of row blocks (`_exchange`) is: a barrier (nobody writes into a region its owner still reads), one
kernel that writes every block straight into its destination rank's region (16-byte vector stores over
NVLink, the local block by a local copy), and a signal/wait handshake (system-scope release/acquire flags).
Blocks larger than the region go in rounds. Everything is stream-ordered on the comm stream and nothing reads
device values on the host unless the call asked for a CPU sync, so no-sync steps can be captured in a CUDA graph.

Every wait spins with a timeout (`num_gpu_timeout_secs`); a timed-out wait fills a host-mapped ErrorRecord and
lets the stream go on, and the host raises a TimeoutError naming rank, phase and peer at its next check (the
next host sync of a call, or the start of the next call). After a timeout the buffer refuses further work.

Kernels: `csrc/transport.cu`, built by `moe_comm.jit` at first use (never at import).
"""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .. import jit, sizing
from .torch_ref import TorchRefBackend

# Kernel libraries of this backend: name -> sources under csrc/ (CI compiles every one of them).
KERNEL_SOURCES = {"moe_comm_transport": ("transport.cu",)}
KERNEL_INCLUDE_DIRS = ("include",)

MAX_RANKS = 64                      # csrc/transport.cu kMaxRanks
CONTROL_BYTES = sizing.BUFFER_CONTROL_BYTES
BARRIER_FLAGS_OFFSET = 0            # [MAX_RANKS] int64, written by peers
EXCHANGE_FLAGS_OFFSET = 4096        # [MAX_RANKS] int64, written by peers
BARRIER_SEQ_OFFSET = 8192           # this rank's counters (device-side, so graph replays advance them)
EXCHANGE_SEQ_OFFSET = 8200
COPY_THREADS = 512


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


def kernel_sources() -> dict[str, tuple[list, list]]:
    """Every kernel library as `name -> (source paths, include dirs)`."""
    includes = [jit.CSRC_DIR / d for d in KERNEL_INCLUDE_DIRS]
    return {name: ([jit.CSRC_DIR / s for s in srcs], includes) for name, srcs in KERNEL_SOURCES.items()}


def load_transport() -> ctypes.CDLL:
    sources, includes = kernel_sources()["moe_comm_transport"]
    lib = jit.load("moe_comm_transport", sources, include_dirs=includes)
    for fn in (lib.moe_comm_copy_blocks, lib.moe_comm_signal_wait):
        fn.restype = ctypes.c_int
    lib.moe_comm_error_string.restype = ctypes.c_char_p
    lib.moe_comm_sizeof_params.restype = ctypes.c_int
    # The structs above must match the C++ ones byte for byte.
    assert lib.moe_comm_sizeof_params(0) == ctypes.sizeof(_BlockCopyParams)
    assert lib.moe_comm_sizeof_params(1) == ctypes.sizeof(_SyncParams)
    return lib


def peers_reachable(group: dist.ProcessGroup) -> bool:
    """Whether every rank of `group` is a GPU of this host that this GPU can access directly (NVLink/P2P)."""
    if not torch.cuda.is_available():
        return False
    num_ranks = dist.get_world_size(group)
    if num_ranks > torch.cuda.device_count() or num_ranks > MAX_RANKS:
        return False
    me = torch.cuda.current_device()
    return all(torch.cuda.can_device_access_peer(me, d) for d in range(torch.cuda.device_count()) if d != me)


class CudaBackend(TorchRefBackend):
    """`Buffer(backend="cuda")`: layout as the reference, rows over NVLink peer writes."""

    name = "cuda"
    fixed_blocks = True

    def __init__(self, group: dist.ProcessGroup, device: torch.device, num_bytes: int, num_cpu_timeout_secs: float,
                 num_gpu_timeout_secs: float) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        super().__init__(group, device, num_cpu_timeout_secs)
        self.lib = load_transport()
        self.timeout_ns = int(num_gpu_timeout_secs * 1e9)
        self.buffer = symm_mem.empty(num_bytes, dtype=torch.uint8, device=device)
        self.buffer.zero_()
        self.symm = symm_mem.rendezvous(self.buffer, group.group_name)
        self.region_bytes = num_bytes - CONTROL_BYTES
        host, dev = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self.lib.moe_comm_alloc_error_record(ctypes.byref(host), ctypes.byref(dev)), "error record")
        self._error_host, self._error_dev = host.value, dev.value
        self._phases: list[str] = []
        self.broken: Optional[str] = None
        # Every peer's buffer is zeroed before anyone signals into it.
        torch.cuda.synchronize(device)
        dist.barrier(group=group)

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
        if self.broken is not None:
            raise RuntimeError(f"moe_comm: this buffer is unusable after an earlier error: {self.broken}")
        code, rank, phase, peer, observed, expected = (ctypes.c_int64 * 6).from_address(self._error_host)
        if code:
            name = self._phases[phase] if 0 <= phase < len(self._phases) else f"phase {phase}"
            self.broken = (f"rank {rank} timed out in {name} waiting for peer {peer} (flag {observed}, "
                           f"expected {expected}) after num_gpu_timeout_secs={self.timeout_ns / 1e9:g}")
            raise TimeoutError(f"moe_comm: {self.broken}")

    def _signal_wait(self, flags_offset: int, seq_offset: int, phase: str) -> None:
        params = _SyncParams(self.symm.buffer_ptrs_dev, self.buffer.data_ptr(), self._error_dev, flags_offset,
                             seq_offset, self.timeout_ns, self.rank, self.num_ranks, self._phase_id(phase), 0)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._check(self.lib.moe_comm_signal_wait(ctypes.byref(params), ctypes.c_void_p(stream)), phase)

    def _exchange(self, send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], phase: str,
                  send_rows: Optional[torch.Tensor] = None):
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
        # Rows past a block's count are not sent; the layout never reads them on arrival.
        rows_dev = None if send_rows is None else send_rows.to(torch.int64).contiguous()
        recv = send.new_empty(R * block_rows, width)
        region = self.buffer[CONTROL_BYTES:]
        stream = torch.cuda.current_stream(self.device).cuda_stream
        num_blocks = max(1, min(sizing.H200_NUM_SMS, -(-R * block_rows * width // (COPY_THREADS * 16 * 4))))
        first = 0
        while first < block_rows:
            rows = min(region_block_rows, block_rows - first)
            self._signal_wait(BARRIER_FLAGS_OFFSET, BARRIER_SEQ_OFFSET, f"barrier before {phase}")
            params = _BlockCopyParams(send.data_ptr(), 0 if rows_dev is None else rows_dev.data_ptr(),
                                      self.symm.buffer_ptrs_dev, width, block_rows, first, rows, CONTROL_BYTES,
                                      self.rank, R)
            self._check(self.lib.moe_comm_copy_blocks(ctypes.byref(params), num_blocks, COPY_THREADS,
                                                      ctypes.c_void_p(stream)), phase)
            self._signal_wait(EXCHANGE_FLAGS_OFFSET, EXCHANGE_SEQ_OFFSET, phase)
            # This round's blocks, source s at s * rows in the region, into their place in `recv`.
            arrived = region[:R * rows * width].view(R, rows, width)
            recv.view(R, block_rows, width)[:, first:first + rows] = arrived
            first += rows
        recv = recv[:, :nbytes].contiguous() if width != nbytes else recv
        return recv.view(dtype).view(R * block_rows, -1), []
