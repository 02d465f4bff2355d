"""CUDA backend: dispatch and combine kernels over NVLink peer memory (`moe_comm/csrc`, layout in `moe_comm.layout`).
(Over 400 lines: the host side of three operations, fresh dispatch, cached dispatch and combine, each building its
launch structs; the C boundary itself is `cuda_kernels.py`.)

Every rank owns one symmetric buffer (`torch.distributed._symmetric_memory`; with `CudaTuning(peer_memory="ipc")`
memory of its own mapped to the peers with CUDA IPC handles, `cuda_ipc.py`, which also maps between ranks sharing a
GPU): a control region (flags, counters, one control slot per source rank) and a receive region (a dispatch's: a
block per source rank; a combine's: a block per peer, own rows being read from x).

A dispatch is two kernels: layout (send positions, counts), whose last block runs the notify (the barrier: nobody
writes into a region its owner still reads; every rank's counts into every peer's control slot; with a CPU sync a
summary in host-mapped memory that the host reads to size the outputs, without one the error flags into
`pending_flags`) -> dispatch: sender blocks write each row once per destination rank straight into that
rank's block with its metadata (a non-expand dispatch writes the own rank's rows straight into the outputs),
receiver blocks copy the rows that arrive into the output rows. A cached dispatch is the dispatch kernel alone,
with the barrier fused in (block 0 signals, sender blocks wait for every rank before writing to peers).
A combine is one kernel with the barrier fused in: senders return rows to their sources, reducers add each token's
rows (their own from the combine input) in FP32/FP64 in DESIGN 2.2's order.

Every operation's barrier carries the call's signature (`DispatchCall.signature`): ranks that disagree all see it
before any row moves, record it in host-mapped memory and set the abort word (`moe_comm.layout`), so every later
kernel moves nothing until the host raises a ValueError at its next synchronizing call (`after_host_sync`). A rank
that refused its arguments runs the barrier alone, with a refusal for a signature (`refuse`), so that its peers'
kernels end the same way instead of waiting for it.

Nothing reads device values on the host unless the call asked for a CPU sync, so no-sync steps can be captured in
a CUDA graph. Every wait spins with a timeout (`num_gpu_timeout_secs`); a timed-out wait fills a host-mapped
ErrorRecord, sets the abort word (every other wait of the rank ends at once) and lets the stream go on, and the host
raises a TimeoutError naming rank, phase and peer at its next check (the next host sync of a call, or the start of
the next call). After a timeout the buffer refuses work.

Host path: the launch structs of a call are built once per shape and kept on the backend (a cached dispatch's and
a combine's per handle, a fresh dispatch's per call signature); a call hands their addresses with its tensors to
the host extension (`cuda_kernels`), which allocates the outputs, sets the per-call pointers and launches, one
crossing per call (a fresh dispatch with a CPU sync waits inside it for the notify's summary). A fresh dispatch's
routing state lives in one or two int64 allocations.
"""

from __future__ import annotations

import ctypes
import functools
import socket
import weakref
from dataclasses import dataclass, field
from typing import NoReturn, Optional

import torch
import torch.distributed as dist

from .. import layout as lay
from ..event import EventOverlap
from ..handle import EPHandle
from .common import (DTYPE_CODES, REFUSED, SIGNATURE_FIELDS, Backend, accumulation_dtype, all_gather_single,
                     disagreement, padded_signature)
from .cuda_ipc import IpcMemory
from .cuda_kernels import current_stream, load_kernels

MAX_SHAPES = 64  # fresh-dispatch launch structs kept per buffer
# Added to the recorded sequence number after ranks disagreed: the restarted counters and handle epochs are the same
# on every rank and unlike any used before (row tags keep 48 bits: 65536 disagreements).
REALIGN_JUMP = 1 << 32
PHASES = ("barrier before dispatch", "dispatch", "barrier before combine", "combine",
          "pp_send (a free slot)", "pp_recv", "all_gather / reduce_scatter (a free slot)",
          "all_gather / reduce_scatter")
_PHASE = {name: i for i, name in enumerate(PHASES)}


@dataclass(frozen=True)
class CudaTuning:
    """Build and launch settings for experiments (`scripts/profile_ops.py --variants`); defaults are the measured
    best (benchmarks/NOTES.md).

    Arguments:
        kernel_flags: extra nvcc flags, e.g. `("-DMOE_COMM_COPY_UNROLL=4",)` (each set is its own cached build).
        dispatch_send_fraction: share of a dispatch kernel's blocks that send (None: `num_send_blocks`' rule).
        combine_send_fraction: the same for the combine kernel.
        max_round_slots: at most this many slots per round of an expand combine (None: as many as the receive
            region holds; the GPU tests force rounds with it on one rank, which needs no region). It lays out the
            combine's region, so it is in the combine's signature: ranks with different values get the ValueError
            of ranks that disagree (the other fields may differ between ranks).
        peer_memory: how peers map each other's buffer: None, torch's symmetric memory; "ipc", cudaMalloc and CUDA
            IPC handles exchanged over the group (`cuda_ipc`; every rank on one machine; lets two ranks share one
            GPU, which the GPU tier uses on a one-GPU machine).
    """

    kernel_flags: tuple[str, ...] = ()
    dispatch_send_fraction: Optional[float] = None
    combine_send_fraction: Optional[float] = None
    max_round_slots: Optional[int] = None
    peer_memory: Optional[str] = None

    def __post_init__(self) -> None:
        if self.peer_memory not in (None, "ipc"):
            raise ValueError(f"peer_memory={self.peer_memory!r} must be None (torch's symmetric memory) or 'ipc'")
        if self.max_round_slots is not None and not (type(self.max_round_slots) is int
                                                     and 1 <= self.max_round_slots <= lay.MAX_ROUND_SLOTS):
            raise ValueError(f"max_round_slots={self.max_round_slots!r} must be None or an int in "
                             f"[1, {lay.MAX_ROUND_SLOTS}]")


def num_send_blocks(op: str, num_sms: int, num_ranks: int, do_expand: bool, fraction: Optional[float] = None) -> int:
    """Blocks of a dispatch/combine kernel that send (the others receive), in proportion to the rows each side
    stores: dispatch senders store every row (a non-expand dispatch writes the own rank's rows straight into the
    outputs) and its receivers the rows from peers; combine senders store the rows that go back to peers and its
    reducers load every row of a token, their own from x (benchmarks/NOTES.md). An expand dispatch's receivers
    store a row per (arrived token, local expert): 30% senders, measured (EP1, 4096 tokens, top-8: 22 SMs 774 ->
    574 us against half, 66 SMs 300 -> 231, 132 SMs 207 -> 223)."""
    R = num_ranks
    if fraction is None:
        fraction = (0.3 if do_expand else R / (2 * R - 1)) if op == "dispatch" else (R - 1) / (2 * R - 1)
    return max(1, min(num_sms - 1, round(num_sms * fraction)))


@dataclass(eq=False)
class CudaLayout:
    """Routing state of a CUDA dispatch, kept in `EPHandle.layout` (private to the backend).

    clean_idx: the handle's `topk_idx` `[N, K]`, the view at the start of one int64 device allocation (the
        workspace) holding, at `offsets` (`moe_comm.layout.workspace_offsets`): send_pos (row of each token inside
        its destination block, -1 if not sent there), counts (rows per destination rank, rows per expert, error
        flags), recv_slots (copy of the control slots this dispatch received, for the receivers of cached
        dispatches), expert_rank (tokens before this one that chose the slot's expert), expand_row (expand only:
        output row of each (received row, slot)), the layout kernel's scratch (~130 KB at 132 blocks and 256
        experts; used by that kernel only); without a CPU sync, the dispatch's routing outputs after them (so any
        of the handle's routing tensors, or `recv_topk_idx`, keeps the whole workspace allocated: 1.3-1.5 MB at 4096
        tokens, top-8 of 256 experts at EP2).
    """

    clean_idx: torch.Tensor
    offsets: tuple[int, ...]
    do_expand: bool

    def pointer(self, piece: str) -> int:
        """Device address of "clean_idx" (the workspace's start) or a piece (`moe_comm.layout.WORKSPACE_PIECES`); 0
        for expand_row without expand."""
        if piece == "expand_row" and not self.do_expand:
            return 0
        # The storage's address: the view of a dispatch of 0 tokens has a null data_ptr().
        base = self.clean_idx.untyped_storage().data_ptr()
        return base if piece == "clean_idx" else base + 8 * self.offsets[lay.WORKSPACE_PIECES.index(piece)]


@dataclass(eq=False)
class _Plan:
    """The launch structs of an operation at one shape, built at its first call: later calls hand their addresses
    with the call's tensors to the host extension, which sets the per-call pointers and launches.

    structs: EpParams, then the operation's other structs in the launcher's order (fresh dispatch: LayoutArgs,
        NotifyArgs, DispatchInputs, RecvOutputs; cached dispatch: DispatchInputs, RecvOutputs; combine: CombineArgs).
    addresses: their `ctypes.addressof`, in the same order.
    offsets: a fresh dispatch's workspace offsets (`moe_comm.layout.workspace_offsets`); `offsets_address`: the
        address of the same values as int64 words, which the host extension reads.
    num_rows, num_expand_rows: a fresh dispatch's worst-case M and P (without CPU sync).
    num_slots, num_rounds: an expand combine's slots per round and rounds (1 and 1 otherwise).
    combine_dtype: a combine's row dtype code (`DTYPE_CODES`), 0 for a dispatch.
    """

    structs: tuple
    offsets: tuple[int, ...] = ()
    num_rows: int = 0
    num_expand_rows: int = 0
    num_slots: int = 1
    num_rounds: int = 1
    combine_dtype: int = 0
    addresses: tuple[int, ...] = field(init=False)
    offsets_address: int = field(init=False)
    _offsets_words: ctypes.Array = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.addresses = tuple(ctypes.addressof(s) for s in self.structs)
        self._offsets_words = (ctypes.c_int64 * len(self.offsets))(*self.offsets)
        self.offsets_address = ctypes.addressof(self._offsets_words)


def _part(c) -> int:
    """The launch part of a call: the whole kernel, or its senders alone with a hook (the receivers in the hook)."""
    return lay.PART_SEND if c.return_recv_hook else lay.PART_WHOLE


# The compute capability the kernel library is built for (sm_90a code, no PTX: no other GPU can run it).
KERNEL_CAPABILITY = (9, 0)


def why_not_usable(group: dist.ProcessGroup, tuning: Optional[CudaTuning] = None) -> Optional[str]:
    """None when the CUDA backend can run on `group`, else why not, the same answer on every rank.

    Usable: every rank is a Hopper GPU of one host that reaches every other by peer access (NVLink/P2P), the group has
    at most MAX_RANKS ranks, and every rank can build or load the kernel library. Collective over `group` (every
    rank must call it): ranks exchange their host name and local verdicts.
    """
    reasons = []
    if dist.get_world_size(group) > lay.MAX_RANKS:
        reasons.append(f"{dist.get_world_size(group)} ranks (the kernels take at most {lay.MAX_RANKS})")
    if torch.cuda.is_available():
        me = torch.cuda.current_device()
        capability = torch.cuda.get_device_capability(me)
        if capability != KERNEL_CAPABILITY:
            reasons.append(f"GPU {me} is of compute capability {capability[0]}.{capability[1]}; the kernels are built "
                           f"for sm_90a (Hopper: H100, H200) only")
        blind = [d for d in range(torch.cuda.device_count())
                 if d != me and not torch.cuda.can_device_access_peer(me, d)]
        if blind:
            reasons.append(f"GPU {me} has no peer access to GPU(s) {blind}")
    else:
        reasons.append("CUDA is not available")
    if not reasons:
        try:
            load_kernels((tuning or CudaTuning()).kernel_flags)
        except (RuntimeError, OSError, ValueError, ImportError) as exc:  # ImportError: the host extension
            reasons.append(f"the kernels cannot be built or loaded ({str(exc).splitlines()[0]})")
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (socket.gethostname(), reasons), group=group)
    hosts = sorted({host for host, _ in everyone})
    problems = [f"rank {r}: {'; '.join(why)}" for r, (_, why) in enumerate(everyone) if why]
    if len(hosts) > 1:
        problems.insert(0, f"the group spans {len(hosts)} hosts ({', '.join(hosts)})")
    return "; ".join(problems) or None


def _release(kernels, device: torch.device, rank: int, mapped_host: int, ipc: Optional[IpcMemory]) -> None:
    """Free a CudaBackend's host-mapped memory (and its IPC buffer) once no kernel of ours can still use it: its
    `close()`, or its finalizer. Raises like `close()`; from the garbage collector, Python reports the error as
    unraisable, goes on."""
    # False in a forked child, where CUDA cannot be used and the memory belongs to the parent.
    if torch.cuda.is_initialized():
        torch.cuda.synchronize(device)
        try:
            kernels.check(kernels.free_mapped(mapped_host), "free host-mapped memory", rank)
        finally:
            if ipc is not None:
                ipc.free()


class CudaBackend(Backend):
    """`Buffer(backend="cuda")`: dispatch and combine kernels over NVLink peer memory.

    Construction allocates this rank's memory only; `connect()` (collective) maps the peers'. `close()` frees it, as
    does the finalizer of a backend dropped without `close()`.

    Arguments:
        group, device, num_cpu_timeout_secs: as `Backend`.
        num_bytes: size of the symmetric buffer (`moe_comm.sizing.get_buffer_size_hint`).
        num_gpu_timeout_secs: how long a kernel's wait for a peer may spin.
        tuning: `CudaTuning` (experiments only).
    """

    name = "cuda"
    steps_use_torch_ops = False

    def __init__(self, group: dist.ProcessGroup, device: torch.device, num_bytes: int, num_cpu_timeout_secs: float,
                 num_gpu_timeout_secs: float, tuning: Optional[CudaTuning] = None) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        super().__init__(group, device, num_cpu_timeout_secs)
        self.tuning = tuning or CudaTuning()
        self.kernels = load_kernels(self.tuning.kernel_flags)
        self.timeout_ns = int(num_gpu_timeout_secs * 1e9)
        self.region_bytes = num_bytes - lay.CONTROL_BYTES
        self.num_device_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self._raw_stream = functools.partial(current_stream, device.index)  # the current stream's handle
        self.launcher = self.kernels.launcher
        self._shapes: dict[tuple, _Plan] = {}  # a fresh dispatch's launch structs per call signature
        self._stale_epoch = 0  # handles of this epoch or older are refused (made before a disagreement, `_realign`)
        # Launch structs of cached dispatches and combines per handle (they hold this buffer's pointers, so they live
        # here, not in the handle: another buffer on the same group builds its own), built at their first call.
        self._plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

        # This rank's memory only: the peers' is mapped by `connect()`, once every rank has allocated its own.
        self._ipc = None
        if self.tuning.peer_memory == "ipc":
            self._ipc = IpcMemory(self.kernels, num_bytes, device, self.rank)
            self.buffer = self._ipc.tensor
        else:
            try:
                self.buffer = symm_mem.empty(num_bytes, dtype=torch.uint8, device=device)
            except torch.OutOfMemoryError as exc:
                raise torch.OutOfMemoryError(f"the symmetric buffer ({num_bytes} bytes on {device}): {exc}") from exc
            self.buffer.zero_()
        self.symm = None
        self._peer_bases = 0  # device address of every rank's buffer base (`connect()`)
        # Host-mapped memory: the ErrorRecord at 0, the signatures of ranks that disagreed at MAPPED_SIGNATURES_OFFSET,
        # the dispatch notify's done word at NOTIFY_DONE_OFFSET and its summary at SUMMARY_OFFSET.
        host, dev = ctypes.c_void_p(), ctypes.c_void_p()
        mapped_bytes = lay.SUMMARY_OFFSET + 8 * lay.summary_len(lay.MAX_RANKS, lay.SLOT_STRIDE)
        if self.kernels.alloc_mapped(mapped_bytes, ctypes.byref(host), ctypes.byref(dev)):
            self.buffer = None  # the traceback keeps this frame (and self) alive: let the symmetric buffer go now
            if self._ipc is not None:
                self._ipc.free()
            raise RuntimeError(f"host-mapped memory: {self.kernels.last_error().decode()}")  # names the bytes
        self._mapped_host, self._mapped_dev = host.value, dev.value
        self._error = lay.ErrorRecord.from_address(self._mapped_host)
        # Freed once, by `close()` or, for a backend dropped without it, when it is collected (the finalizer holds no
        # reference to self, which would keep it alive). CPython runs the finalizer before it clears the backend's
        # attributes, so the device is synchronized before the symmetric buffer goes with them. Not run at interpreter
        # exit: the driver reclaims a process's memory, and CUDA may be shutting down by then.
        self._finalizer = weakref.finalize(self, _release, self.kernels, device, self.rank, self._mapped_host,
                                           self._ipc)
        self._finalizer.atexit = False

    def connect(self) -> None:
        """Collective: map every peer's buffer, and wait until this rank's is zeroed. `moe_comm.Buffer` calls it once
        every rank has allocated its memory, then meets the others (its agreement on failures) before any call, so
        nobody signals into a buffer its owner has not cleared."""
        import torch.distributed._symmetric_memory as symm_mem

        if self._ipc is not None:
            self._peer_bases = self._ipc.connect(self.group)
        else:
            self.symm = symm_mem.rendezvous(self.buffer, self.group.group_name)
            self._peer_bases = self.symm.buffer_ptrs_dev
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Wait for the device to finish with our memory, then free it (idempotent; the finalizer's release)."""
        self._finalizer()
        self._mapped_host = self._error = None
        self.buffer = self.symm = self._ipc = None
        self._shapes.clear()
        self._plans.clear()

    def after_host_sync(self, synchronized: bool = False) -> None:
        """Raise what the kernels recorded. A timed-out wait: once, then the buffer refuses work. Ranks that
        disagreed at an operation's barrier (they all saw it and moved nothing since): at a synchronizing point,
        which every rank reaches alike, every rank raises the same ValueError after `_realign` (the buffer works
        again)."""
        if self._mapped_host is None:
            raise RuntimeError("moe_comm: this buffer was destroyed")
        super().after_host_sync(synchronized)
        e = self._error
        if e.code == lay.ERROR_TIMEOUT:
            self._raise_timeout()
        if e.code == lay.ERROR_DISAGREE and synchronized:
            R, S = self.num_ranks, lay.SIGNATURE_LEN
            words = (ctypes.c_int64 * (R * S)).from_address(self._mapped_host + lay.MAPPED_SIGNATURES_OFFSET)[:]
            rows = [words[r * S:(r + 1) * S] for r in range(R)]
            problem = disagreement(rows) or f"ranks' signatures differ (per rank): {rows}"
            self._realign()
            if e.code == lay.ERROR_TIMEOUT:  # a copy-engine wait timed out meanwhile and took the record over
                self._raise_timeout()
            raise ValueError(f"{problem} (found by the kernels; nothing moved from that call on until this "
                             f"synchronizing call)")

    def _raise_timeout(self) -> NoReturn:
        e = self._error
        name = PHASES[e.phase] if 0 <= e.phase < len(PHASES) else f"phase {e.phase}"
        why = (f"rank {e.rank} timed out in {name} waiting for peer {e.peer} (flag {e.observed}, "
               f"expected {e.expected}) after num_gpu_timeout_secs={self.timeout_ns / 1e9:g}")
        self.mark_broken(why)
        raise TimeoutError(f"moe_comm: {why}")

    def _realign(self) -> None:
        """After a disagreement: the ranks may have run different numbers of kernels since (each moving nothing), so
        every rank restarts its barrier counter and its handle epoch from the value recorded where they disagreed
        (the same on every rank) plus REALIGN_JUMP: later waits expect only flags written from now on.
        No communication: ranks reach their synchronizing calls at different points when they disagree. The record
        and the abort word are cleared on the device, each only while it still holds the disagreement: a pipeline
        wait on a side stream that timed out meanwhile took both over, and the caller raises that timeout."""
        e = self._error
        counter = self.buffer[lay.BARRIER_SEQ_OFFSET:lay.BARRIER_SEQ_OFFSET + 8].view(torch.int64)
        counter.fill_(e.observed + REALIGN_JUMP)
        self.kernels.check(self.kernels.clear_disagreement(self.buffer.data_ptr(), ctypes.cast(
            self._mapped_dev, ctypes.POINTER(lay.ErrorRecord)), self._raw_stream()), "clearing a disagreement",
            self.rank)
        # Handles made up to here may come from calls that moved nothing (their counts were never written).
        self._stale_epoch = self.epoch
        self.epoch = self.epoch_base + e.observed + REALIGN_JUMP
        torch.cuda.current_stream(self.device).synchronize()

    def gather_values(self, mine: torch.Tensor, phase: str) -> torch.Tensor:
        everyone = mine.new_empty(self.num_ranks, mine.numel())
        work = all_gather_single(everyone, mine.view(1, -1), group=self.group, async_op=True)
        self._wait([(work, f"rank {self.rank} {phase} (all-gather)")])
        return everyone

    # ------------------------------------------------------------------------------------------------
    # Launch structs
    # ------------------------------------------------------------------------------------------------
    def _handle_plans(self, handle: EPHandle) -> dict:
        plans = self._plans.get(handle)
        if plans is None:
            plans = self._plans[handle] = {}
        return plans

    def _check_num_sms(self, num_sms: int) -> None:
        # Senders and receivers of one kernel must all be resident at once: one block per SM at most.
        if not 2 <= num_sms <= self.num_device_sms:
            raise ValueError(f"num_sms={num_sms}: the CUDA backend needs 2 (a sender and a receiver) to "
                             f"{self.num_device_sms} (the SMs of {self.device})")

    def _params(self, num_tokens: int, cap: int, num_experts: int, num_topk: int, row: lay.RowFormat,
                data_bytes: int, scale_bytes: int, weight_bytes: int, expert_alignment: int, num_send: int,
                phase: str, region_blocks: int, rows_per_token: int = 1, signature=()) -> lay.EpParams:
        """An operation's EpParams, after the checks that need no device values (ValueError names the limit).
        `region_blocks` blocks of `cap` tokens' rows must fit the receive region (`moe_comm.layout`)."""
        R = self.num_ranks
        L = num_experts // R
        needed = region_blocks * cap * rows_per_token * row.stride
        if needed > self.region_bytes:
            raise ValueError(f"rows of {row.stride} bytes x {region_blocks} blocks x {cap} tokens x {rows_per_token} = "
                             f"{needed} bytes do not fit the buffer's receive region of {self.region_bytes} bytes")
        if L + 2 > lay.SLOT_STRIDE:
            raise ValueError(f"num_experts={num_experts} over {R} ranks is {L} local experts; the CUDA backend takes "
                             f"at most {lay.SLOT_STRIDE - 2} per rank (use backend='torch')")
        table_bytes = lay.recv_table_bytes(R, L)
        if table_bytes > lay.RECV_TABLE_LIMIT:
            raise ValueError(f"num_experts={num_experts} over {R} ranks needs {table_bytes} bytes of shared memory "
                             f"in the receive kernel (limit {lay.RECV_TABLE_LIMIT}); use backend='torch'")
        barrier = "barrier before combine" if phase == "combine" else "barrier before dispatch"
        return lay.EpParams(
            peer_bases=self._peer_bases, local_base=self.buffer.data_ptr(), error=self._mapped_dev,
            num_tokens=num_tokens, cap=cap, row_stride=row.stride, data_bytes=data_bytes, scale_bytes=scale_bytes,
            meta_offset=row.meta_offset, ids_offset=row.ids_offset, ranks_offset=row.ranks_offset,
            weights_offset=row.weights_offset, tag_offset=row.tag_offset, recv_table_bytes=table_bytes,
            timeout_ns=self.timeout_ns, rank=self.rank, num_ranks=R, num_experts=num_experts, num_local_experts=L,
            num_topk=num_topk, weight_bytes=weight_bytes, expert_alignment=expert_alignment,
            num_send_blocks=num_send, phase=_PHASE[phase], barrier_phase=_PHASE[barrier],
            signature=(ctypes.c_int64 * lay.SIGNATURE_LEN)(*signature))

    def _dispatch_params(self, c, num_tokens: int, num_topk: int, weight_bytes: int, signature=()) -> lay.EpParams:
        """EpParams of a dispatch with these sizes (cached by the caller)."""
        self._check_num_sms(c.num_sms)
        data_bytes = c.hidden * (c.x.element_size() if c.wire_format is None else 1)
        scale_bytes = 0 if c.wire_format is None else (c.hidden // lay.FP8_CHANNELS_PER_SCALE) * 4
        row = lay.dispatch_row(data_bytes, scale_bytes, num_topk, weight_bytes)
        num_send = num_send_blocks("dispatch", c.num_sms, self.num_ranks, c.do_expand,
                                   self.tuning.dispatch_send_fraction)
        return self._params(num_tokens, c.num_max_tokens_per_rank, c.num_experts, num_topk, row, data_bytes,
                            scale_bytes, weight_bytes, c.expert_alignment, num_send, "dispatch", self.num_ranks,
                            signature=signature)

    # ------------------------------------------------------------------------------------------------
    # Dispatch
    # ------------------------------------------------------------------------------------------------
    def _check_handle_epoch(self, handle: EPHandle) -> None:
        if handle.epoch <= self._stale_epoch:
            raise ValueError(f"handle (epoch {handle.epoch}) was made before the ranks' disagreement that a "
                             f"synchronizing call raised: its dispatch may have moved nothing; dispatch again")

    def refuse(self, what: str, previous_event: Optional[EventOverlap]) -> None:
        """The operation's barrier with the refusal as this rank's signature (one block): the peers' kernels see the
        disagreement and move nothing, and every rank raises it at its next synchronizing call, instead of the
        peers waiting for this rank until their timeout. Ordered on the current stream as a synchronous call."""
        if self.num_ranks == 1 or self.broken is not None:
            return
        barrier = _PHASE["barrier before combine" if what == "combine" else "barrier before dispatch"]
        params = lay.EpParams(
            peer_bases=self._peer_bases, local_base=self.buffer.data_ptr(), error=self._mapped_dev,
            timeout_ns=self.timeout_ns, rank=self.rank, num_ranks=self.num_ranks, phase=barrier,
            barrier_phase=barrier, with_barrier=1,
            signature=(ctypes.c_int64 * lay.SIGNATURE_LEN)(*padded_signature([REFUSED])))

        def launch():
            self.kernels.check(self.kernels.refuse(ctypes.byref(params), self._raw_stream()), "refusal", self.rank)
            return (), [], []

        self.run(launch, previous_event, False, ())

    def check_call(self, what: str, c) -> _Plan:
        """The launch plan of `what` ("dispatch", "combine") at the call's shape, made at its first call and kept,
        after the checks that need no device values (ValueError): the SM count, a handle made before a
        disagreement, the receive region and the kernels' limits, a hook on a combine in rounds. `Buffer` asks for
        it while validating, so that what this backend refuses is refused as any argument is (`refuse`). The SM
        count is checked when a plan is made (every plan's key holds it)."""
        if what == "combine":
            return self._combine_call_plan(c)
        if c.handle is None:
            return self._fresh_call_plan(c)
        return self._cached_call_plan(c)

    def dispatch_steps(self, c, agreed: bool):
        plan = c.plan or self.check_call("dispatch", c)
        return self._fresh_dispatch(c, plan) if c.handle is None else self._cached_dispatch(c, plan)

    @staticmethod
    def _kernel_rows(c) -> tuple[torch.Tensor, Optional[torch.Tensor], int, int]:
        """`(rows, scales or None, quantize, dequantize)` as the kernel takes them: x (bf16 with `quantize=`, which
        the senders cast), or a pre-quantized tuple; the casts as format codes (`layout.FP8_CODES`, 0: none),
        `dequantize` cast by the receivers."""
        dequantize = lay.FP8_CODES[c.wire_format] if c.dequantize else 0
        if c.quantize is not None:
            return c.x, None, lay.FP8_CODES[c.quantize], dequantize
        return (c.x, None, 0, 0) if c.wire_format is None else (c.fp8_q, c.fp8_scales, 0, dequantize)

    @staticmethod
    def _finish_x(out_x: torch.Tensor, out_scales: Optional[torch.Tensor]):
        """The dispatch's rows: a tensor (bf16 after `dequantize`), or an FP8 tuple."""
        return out_x if out_scales is None else (out_x, out_scales)

    def _fresh_plan(self, c, signature: list[int]) -> _Plan:
        """A fresh dispatch's launch structs for this call signature (the host extension sets the pointers)."""
        R, K, N, E = self.num_ranks, c.num_topk, c.num_tokens, c.num_experts
        L, cap = E // R, c.num_max_tokens_per_rank
        smem = lay.layout_smem_bytes(R, E)
        if smem > lay.MAX_DYNAMIC_SMEM:
            raise ValueError(f"num_experts={E} over {R} ranks needs {smem} bytes of shared memory in the layout kernel "
                             f"(limit {lay.MAX_DYNAMIC_SMEM}); use backend='torch'")
        weight_bytes = 0 if c.topk_weights is None else c.topk_weights.element_size()
        params = self._dispatch_params(c, N, K, weight_bytes, signature)
        sync = c.do_cpu_sync
        notify = lay.NotifyArgs(pending_flags=self.pending_flags.data_ptr(),
                                summary=self._mapped_dev + lay.SUMMARY_OFFSET if sync else 0,
                                summary_done=self._mapped_dev + lay.NOTIFY_DONE_OFFSET if sync else 0)
        M = R * cap  # the worst case, sizing the outputs of a call without CPU sync
        P = M * min(K, L) + L * (c.expert_alignment - 1) if c.do_expand else M
        blocks = lay.layout_blocks(N, self.num_device_sms)
        return _Plan((params, lay.LayoutArgs(num_blocks=blocks), notify, lay.DispatchInputs(), lay.RecvOutputs()),
                     offsets=lay.workspace_offsets(N, K, R, E, cap, c.do_expand, blocks), num_rows=M,
                     num_expand_rows=P)

    def _fresh_call_plan(self, c) -> _Plan:
        signature = c.signature()
        key = (*signature, c.num_tokens, c.num_sms)
        plan = self._shapes.get(key)
        if plan is None:
            if len(self._shapes) >= MAX_SHAPES:  # token counts that vary without end: keep the cache bounded
                self._shapes.clear()
            plan = self._shapes[key] = self._fresh_plan(c, signature)
        return plan

    def _fresh_dispatch(self, c, plan: _Plan):
        """Layout, notify (the barrier with the call's signature, then the counts through the control slots), then
        one kernel that sends and receives at the same time."""
        params, layout_args, notify, inputs, outputs = plan.addresses
        data, scales, quantize, dequantize = self._kernel_rows(c)
        stream, part = self._raw_stream(), _part(c)
        # Layout, then (its last block) the barrier with the call's signature and the counts into every peer's
        # control slot and theirs into ours; then send and receive (with a hook: send now, the receivers in the hook).
        # The handle's epoch: counted before the crossing, which launches on every rank even when this rank's outputs
        # cannot be allocated (then it raises; only the routing workspace's failure launches nothing, leaving the
        # peers to their timeout and the group broken); ranks that disagreed realign it (`_realign`).
        self.epoch += 1
        # One crossing: with a CPU sync it waits for the notify and sizes the outputs by its summary (None: a problem
        # that this call raises), without one the outputs are sized for the worst case.
        launched = self.launcher.layout_dispatch(
            params, layout_args, notify, inputs, outputs, c.topk_idx, data, scales, c.topk_weights,
            plan.offsets_address, self._mapped_host if c.do_cpu_sync else 0, c.expert_alignment, plan.num_rows,
            plan.num_expand_rows, c.do_expand, quantize, dequantize, c.num_sms, part, stream)
        if launched is None:
            self._raise_summary(c)
        outs, clean_idx, P, aligned_list = launched
        out_x, out_scales, out_idx, out_src, psum_rank, psum_expert, out_w = outs
        handle = EPHandle.make(
            group=self.group, backend=self.name, epoch=self.epoch,
            num_experts=c.num_experts, num_topk=c.num_topk, num_tokens=c.num_tokens,
            num_max_tokens_per_rank=c.num_max_tokens_per_rank, do_expand=c.do_expand,
            expert_alignment=c.expert_alignment, num_sms=c.num_sms, do_cpu_sync=c.do_cpu_sync,
            topk_idx=clean_idx, recv_src_idx=out_src, recv_topk_idx=out_idx, recv_topk_weights=out_w,
            psum_num_recv_tokens_per_rank=psum_rank, psum_num_recv_tokens_per_expert=psum_expert,
            num_recv_tokens=P if c.do_cpu_sync else None, num_recv_tokens_per_expert_list=aligned_list,
            num_recv_rows=P, layout=CudaLayout(clean_idx, plan.offsets, c.do_expand))
        results = (self._finish_x(out_x, out_scales), None if c.do_expand else out_idx, out_w, handle)
        return results, [], self._receivers(c, plan, results)

    def _cached_call_plan(self, c) -> _Plan:
        handle: EPHandle = c.handle
        self._check_handle_epoch(handle)
        layout: CudaLayout = handle.layout
        plans = self._handle_plans(handle)
        # Everything of the signature that is not the handle's (the plan carries it to the barrier).
        key = ("dispatch", c.x.dtype if c.x is not None else None, c.wire_format, c.dequantize, c.hidden, c.num_sms)
        plan = plans.get(key)
        if plan is None:
            params = self._dispatch_params(c, handle.num_tokens, handle.num_topk, 0, c.signature())
            inputs = lay.DispatchInputs(clean_idx=layout.pointer("clean_idx"), send_pos=layout.pointer("send_pos"),
                                        expert_rank=layout.pointer("expert_rank"))
            outputs = lay.RecvOutputs(counts=layout.pointer("recv_slots"), expand_row=layout.pointer("expand_row"),
                                      num_rows=handle.recv_src_idx.shape[0], num_expand_rows=handle.num_recv_rows,
                                      do_expand=int(handle.do_expand))
            plan = plans[key] = _Plan((params, inputs, outputs))
        return plan

    def _cached_dispatch(self, c, plan: _Plan):
        """The dispatch kernel along the handle's layout, barrier fused in (no layout work, no host sync)."""
        handle: EPHandle = c.handle
        data, scales, quantize, dequantize = self._kernel_rows(c)
        params, inputs, outputs = plan.addresses
        out_x, out_scales = self.launcher.cached_dispatch(params, inputs, outputs, data, scales, quantize, dequantize,
                                                          handle.num_recv_rows, c.num_sms, _part(c),
                                                          self._raw_stream())
        results = (self._finish_x(out_x, out_scales), None if handle.do_expand else handle.recv_topk_idx,
                   handle.recv_topk_weights, handle)
        return results, [], self._receivers(c, plan, results)

    def _receivers(self, c, plan: _Plan, tensors: tuple) -> list:
        """With a hook: `[launch of the receivers]`, the finalizer the hook runs (on the call's stream, along the
        structs the call set: no operation can run on the buffer in between), else `[]`. `tensors` (the outputs the
        receivers write, a combine's inputs and handle its reducers read) stay allocated until then, whatever the
        caller drops: freed, their memory could be handed to a tensor made before the hook."""
        if not c.return_recv_hook:
            return []
        if plan.combine_dtype:
            launch, args = self.launcher.receive_combine, (*plan.addresses, plan.combine_dtype)
        else:
            launch, args = self.launcher.receive_dispatch, plan.addresses[:1] + plan.addresses[-2:]

        num_sms, raw_stream = c.num_sms, self._raw_stream  # not `self`: the hook holds the backend weakly

        def receive(_keep=(plan, tensors)) -> None:
            launch(*args, num_sms, raw_stream())

        return [receive]

    def _raise_summary(self, c) -> NoReturn:
        """A synchronized dispatch's notify reported a problem (the launcher waited for it and launched nothing):
        raise what the kernels recorded (a disagreement, a timeout; a notify that stopped before its summary always
        recorded one, else the extension raised), then the flags of earlier dispatches without CPU sync, then every
        rank's flags of this call (every rank sees the same flags and raises alike)."""
        R = self.num_ranks
        self.after_host_sync(synchronized=True)
        L = c.num_experts // R
        values = (ctypes.c_int64 * lay.summary_len(R, L)).from_address(self._mapped_host + lay.SUMMARY_OFFSET)[:]
        if any(values[lay.summary_index("pending_from", R, L, s)] for s in range(R)):
            self.check_pending_errors()
        self.raise_for_flags([values[lay.summary_index("flags_from", R, L, s)] for s in range(R)], c.topk_idx,
                             c.num_experts, "")
        raise RuntimeError(f"moe_comm: the dispatch notify's summary on rank {self.rank} reported a problem that "
                           f"nothing names (summary {values}, error code {self._error.code}): a bug in moe_comm")

    # ------------------------------------------------------------------------------------------------
    # Combine
    # ------------------------------------------------------------------------------------------------
    def _combine_call_plan(self, c) -> _Plan:
        handle: EPHandle = c.handle
        self._check_handle_epoch(handle)
        weights = c.topk_weights
        plans = self._handle_plans(handle)
        key = ("combine", c.x.dtype, c.x.shape[1], None if weights is None else weights.dtype, c.num_sms, c.partial)
        plan = plans.get(key)
        if plan is None:
            plan = self._combine_plan(c)
            plans[key] = plan
        if c.return_recv_hook and plan.num_rounds > 1:
            raise ValueError(self._rounds_error(c, plan))
        return plan

    def combine_steps(self, c):
        """Rows back to their sources while the reducers add them, in slot rounds for expand combines that need
        them (each round one kernel, barrier fused in)."""
        handle: EPHandle = c.handle
        weights = c.topk_weights
        plan = c.plan or self.check_call("combine", c)
        bias = c.bias
        combined, combined_w = self.launcher.combine(
            *plan.addresses, c.x, weights, bias[0] if bias else None, bias[1] if len(bias) > 1 else None,
            handle.num_tokens, DTYPE_CODES[c.x.dtype], plan.num_slots, plan.num_rounds, c.unreduced, c.num_sms,
            _part(c), self._raw_stream())
        return (combined, combined_w), [], self._receivers(c, plan,
                                                           (combined, combined_w, c.x, weights, *bias, handle))

    def _rounds_error(self, c, plan: _Plan) -> str:
        K, cap = c.handle.num_topk, self.tuning.max_round_slots
        if K > lay.MAX_ROUND_SLOTS:
            why = f"top-{K} is more than the {lay.MAX_ROUND_SLOTS} slots a round takes"
        elif cap is not None and plan.num_slots == cap:
            why = f"CudaTuning.max_round_slots={cap} limits a round to {cap} of a token's {K} slots"
        else:
            why = (f"the receive region holds {plan.num_slots} of a token's {K} slots per peer: create the Buffer with "
                   f"use_recv_hook=True")
        return (f"return_recv_hook=True: this expand combine runs in {plan.num_rounds} rounds ({why}); rounds cannot "
                f"be split at a hook (each round's reducers free the region for the next round's senders)")

    def _combine_plan(self, c) -> _Plan:
        self._check_num_sms(c.num_sms)
        handle: EPHandle = c.handle
        layout: CudaLayout = handle.layout
        R, K, cap = self.num_ranks, handle.num_topk, handle.num_max_tokens_per_rank
        data_bytes = c.x.shape[1] * c.x.element_size()
        wb = 0 if c.topk_weights is None else c.topk_weights.element_size()
        # One rank: its partial sum is the whole sum in the slot order, which the plain kernel adds as fast as it can.
        partial = c.partial and R > 1
        if partial:
            # A token's row per peer: the partial sum in the accumulation precision (or the one row as it is), with
            # the weights of all its slots, as a non-expand row carries them. Always fits: the region holds two
            # dispatch rows (data, K weights and more) per (rank, token), so one round.
            acc_bytes = c.x.shape[1] * accumulation_dtype(c.x.dtype).itemsize
            row = lay.combine_row(acc_bytes, K, wb)
        else:
            row = lay.combine_row(data_bytes, 1 if handle.do_expand else K, wb)
        peers = R - 1  # the combine region's blocks: our own rows are read from x
        num_slots = 1
        if handle.do_expand and not partial:
            # As many slots per round as the region holds (one rank needs no region: one round); each round adds
            # its slots in ascending order.
            fit = self.region_bytes // (peers * cap * row.stride) if peers and cap else K
            # (One rank asked for partial sums gets them in one round: fit is K there, and K <= MAX_ROUND_SLOTS.)
            cap_slots = K if c.partial else self.tuning.max_round_slots or K
            num_slots = min(K, lay.MAX_ROUND_SLOTS, fit, cap_slots)
            if num_slots == 0:
                raise ValueError(f"combine rows of {row.stride} bytes do not fit the receive region "
                                 f"({self.region_bytes} bytes for {peers} peers x {cap} tokens)")
        num_send = num_send_blocks("combine", c.num_sms, R, handle.do_expand, self.tuning.combine_send_fraction)
        signature = c.signature()
        signature[SIGNATURE_FIELDS["combine"].index("slots per round")] = num_slots  # ranks must lay out alike
        params = self._params(handle.num_tokens, cap, handle.num_experts, K, row, data_bytes, 0, wb, 1, num_send,
                              "combine", peers, rows_per_token=num_slots, signature=signature)
        args = lay.CombineArgs(
            psum_rank=handle.psum_num_recv_tokens_per_rank.data_ptr(), expand_row=layout.pointer("expand_row"),
            send_pos=layout.pointer("send_pos"), clean_idx=layout.pointer("clean_idx"), hidden=c.x.shape[1],
            num_x_rows=c.x.shape[0], do_expand=int(handle.do_expand), num_slots=num_slots, slot_begin=0,
            slot_end=K if partial else min(K, num_slots), first_round=1,
            last_round=int(num_slots >= K or not handle.do_expand or partial), partial=int(partial))
        num_rounds = -(-K // num_slots) if handle.do_expand and not partial else 1
        return _Plan((params, args), num_slots=num_slots, num_rounds=num_rounds, combine_dtype=DTYPE_CODES[c.x.dtype])


__all__ = ["CudaBackend", "CudaLayout", "CudaTuning", "num_send_blocks", "why_not_usable"]
