"""The CUDA backend's pipeline send/recv, all-gather and reduce-scatter by copy engines: the data moves with
cudaMemcpyAsync into the receiver's slots (peer memory over NVLink), and the only kernels are one-warp waits for
flags and releases of flags, so no SM is held while data moves (DESIGN 8.4); the reduce-scatter's sum is one kernel.
Engram: `engram_write` puts each rank's rows in an IPC region that every rank maps; `engram_fetch` reads the
requested rows one-sided with one small kernel (peer loads; the owners take no part), after the index check that
raises the same error on every rank (one exchange).

All-gather / reduce-scatter: one region per rank, made at the first such call (the ranks agree on the operation and
the tensor first; a later call needing more makes a larger region, agreeing again), flags arrived[R] and released[R]
(call numbers), and 2 parities x R slots. Call s (the same number on every rank) uses parity s % 2: wait until every
peer released its slots of call s - 2, copy into every rank's slot `me` (own included: the reduce-scatter sums its own
block from there), release `arrived[me] = s` on every peer, wait for every peer's arrival, read the slots
(all-gather: copy out; reduce-scatter: sum in rank order), release `released[me] = s` on every peer.

Memory: `pp_set_config` (collective) allocates each rank's pipeline region with CUDA IPC (`cuda_ipc`: the same code
maps peers on one GPU or several) and maps every peer's:

    [arrived: int64 per source rank][credit: int64 per destination rank] (CONTROL_BYTES)
    [slots: 2 neighbour directions x num_max_inflight_tensors x slot_bytes]

A source's tensors land in the receiver's slots of that source's direction (0: the previous rank, 1: the next;
with two ranks both are direction 0). Sequence numbers count per (source, destination) pair on the host, from 1:
tensor s of a pair goes to slot s % inflight.

    pp_send(t, dst), s = sends to dst so far + 1:
        wait until credit[dst] >= s - inflight   (dst has received the tensor that used this slot; own region)
        copy t into dst's slot                   (copy engine)
        arrived[me] = s on dst                   (release, after the copy)
    pp_recv(t, src), r = receives from src so far + 1:
        wait until arrived[src] >= r             (own region)
        copy the slot into t                     (copy engine)
        credit[me] = r on src                    (release: the slot is free again)

A wait that a peer never satisfies ends after `num_gpu_timeout_secs` in the backend's ErrorRecord (phase "pp_send
(a free slot)" or "pp_recv", and the peer), and the next call raises the TimeoutError. The sequence numbers live on
the host, so these calls cannot be captured in a CUDA graph (refused). Sizes of a send and its receive must match,
as with torch.distributed. An async send or receive runs on a stream of its own per neighbour and direction
(`PrimitivesBase.pp_stream`), so a receive posted before the send it waits for holds back neither that send nor
the buffer's other operations. `pp_set_config` again (every tensor sent received: the ranks check) waits for the
device and makes new slots.
"""

from __future__ import annotations

import ctypes
import math
import weakref
from typing import Callable

import torch
import torch.distributed as dist

from .. import layout as lay
from .common import DTYPE_CODES, MAX_TENSOR_DIMS, group_is_live, tensor_words
from .cuda import _PHASE, CudaBackend
from .cuda_ipc import IpcMemory
from .primitives_base import PrimitivesBase

CONTROL_BYTES = 16 * lay.MAX_RANKS  # arrived[MAX_RANKS], credit[MAX_RANKS]
SLOT_ALIGN = 256
# The all-gather / reduce-scatter region: arrived[MAX_RANKS] (call number of each source's copy into our slot),
# released[MAX_RANKS] (call number each peer last read its slots, ours among them), then 2 parities x R slots.
AGRS_ARRIVED, AGRS_RELEASED = 0, 8 * lay.MAX_RANKS
AGRS_CONTROL_BYTES = 16 * lay.MAX_RANKS
REDUCE_BLOCKS = 264  # the reduce-scatter's sum: two blocks of 256 threads per SM of an H200
ENGRAM_BLOCKS = 16  # the fetch's one-sided reads: 128 warps, a row each at a time


def _slot_size(num_bytes: int) -> int:
    return max(SLOT_ALIGN, -(-num_bytes // SLOT_ALIGN) * SLOT_ALIGN)


def pp_region_bytes(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
    """Bytes of a rank's pipeline region: the flags, then a slot per (neighbour direction, tensor in flight) of the
    largest tensor rounded up to SLOT_ALIGN."""
    return CONTROL_BYTES + 2 * num_max_inflight_tensors * _slot_size(num_max_tensor_bytes)


def agrs_region_bytes(num_ranks: int, slot_bytes: int) -> int:
    """Bytes of a rank's all-gather / reduce-scatter region whose slots hold `slot_bytes` (the largest block one
    rank sends another: an all_gather's tensor, a reduce_scatter's output): the flags, 2 parities x R slots."""
    return AGRS_CONTROL_BYTES + 2 * num_ranks * _slot_size(slot_bytes)


def engram_region_bytes(table_bytes: int) -> int:
    """Bytes of a rank's Engram region for a table of `table_bytes`."""
    return max(SLOT_ALIGN, table_bytes)


class CudaPrimitives(PrimitivesBase):
    """The primitives of a CUDA-backend Buffer: pipeline send/recv, all-gather and reduce-scatter by copy engines,
    Engram by one-sided reads (module docstring).

    Arguments:
        backend: the Buffer's `CudaBackend` (its kernels, ErrorRecord, abort word and timeout serve the waits).
    """

    def __init__(self, backend: CudaBackend) -> None:
        super().__init__(backend)
        self._region: IpcMemory | None = None
        self._finalizers: dict[int, weakref.finalize] = {}  # per region (`_new_region`)
        self._slot_bytes = 0
        # The waits' parameters: the backend's buffer, ErrorRecord (a timeout names rank, phase and peer), timeout.
        self._wait_params = lay.EpParams(local_base=backend.buffer.data_ptr(), error=backend._mapped_dev,
                                         timeout_ns=backend.timeout_ns, rank=backend.rank, num_ranks=backend.num_ranks)
        self._agrs: IpcMemory | None = None  # the all-gather / reduce-scatter region (`_agrs_region`)
        self._agrs_slot_bytes = 0
        self._agrs_seq = 0  # calls so far: the same on every rank (collective order)
        self._engram: IpcMemory | None = None  # the Engram table's region (`engram_write`)

    # ------------------------------------------------------------------------------------------------
    # Regions, launches, checks
    # ------------------------------------------------------------------------------------------------
    def _new_region(self, num_bytes: int) -> IpcMemory:
        """A zeroed IPC region of this rank with every rank's mapped here (collective). Dropped with these
        primitives without `close()`: its mappings are closed and its memory kept (a peer may still write into it:
        the last release of a slot is a write its owner never waits for)."""
        b = self.backend
        region = IpcMemory(b.kernels, num_bytes, b.device, b.rank)
        self._finalizers[id(region)] = weakref.finalize(self, _drop, region, b.device)
        self._finalizers[id(region)].atexit = False
        region.connect(b.group)
        torch.cuda.synchronize(b.device)  # every region zeroed before a peer signals into it
        dist.barrier(group=b.group)
        return region

    def _free_region(self, region: IpcMemory) -> None:
        """Collective: every rank's work on the regions done and the ranks met, then this rank's region freed (no
        peer writes into it any more)."""
        b = self.backend
        torch.cuda.synchronize(b.device)
        if not group_is_live(b.group):  # the ranks cannot meet: this rank's memory stays, as when dropped (`_drop`)
            self._finalizers.pop(id(region)).detach()
            region.close_peers()
            return
        dist.barrier(group=b.group)
        self._finalizers.pop(id(region)).detach()
        region.free()

    def _check(self, result: int, what: str) -> None:
        """A launch or copy that failed leaves the ranks' flags out of step: the group is broken from here."""
        if result:
            b = self.backend
            why = f"rank {b.rank} {what} failed: {b.kernels.last_error().decode()}"
            b.mark_broken(why)
            raise RuntimeError(f"moe_comm: {why}")

    def before_call(self, what: str) -> None:
        """Refuse what the copy-engine paths cannot do: run inside a CUDA graph capture (their sequence numbers live
        on the host). An error the kernels recorded (ranks that disagreed in a dispatch) is not checked here: ranks
        see it in mapped memory at different moments, so one rank would raise alone while its peers wait for it; the
        next synchronizing call raises it on every rank."""
        if torch.cuda.is_current_stream_capturing():
            raise ValueError(f"{what} cannot be captured in a CUDA graph on the CUDA backend (its sequence numbers "
                             f"live on the host)")

    # ------------------------------------------------------------------------------------------------
    # Layout of a region
    # ------------------------------------------------------------------------------------------------
    def _direction(self, receiver: int, source: int) -> int:
        return 0 if source == (receiver - 1) % self.backend.num_ranks else 1

    def _slot(self, receiver: int, source: int, seq: int) -> int:
        """Address, as mapped here, of the slot of `source`'s tensor `seq` in `receiver`'s region."""
        inflight = self.pp_config[1]
        index = self._direction(receiver, source) * inflight + seq % inflight
        return self._region.addresses[receiver] + CONTROL_BYTES + index * self._slot_bytes

    def _arrived(self, receiver: int, source: int) -> int:
        return self._region.addresses[receiver] + 8 * source

    def _credit(self, sender: int, receiver: int) -> int:
        return self._region.addresses[sender] + 8 * (lay.MAX_RANKS + receiver)

    # ------------------------------------------------------------------------------------------------
    # Pipeline send/recv
    # ------------------------------------------------------------------------------------------------
    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int, error=None) -> None:
        self.agree_pp_config(num_max_tensor_bytes, num_max_inflight_tensors, error)  # sequence numbers from 1 again
        if self._region is not None:
            self._free_region(self._region)
            self._region, self.pp_config = None, None
        self._slot_bytes = _slot_size(num_max_tensor_bytes)
        self._region = self._new_region(pp_region_bytes(num_max_tensor_bytes, num_max_inflight_tensors))
        self.pp_config = (num_max_tensor_bytes, num_max_inflight_tensors)

    def pp_send(self, t: torch.Tensor, dst: int):
        b, k = self.backend, self.backend.kernels
        me, seq = b.rank, self.num_sent[dst] + 1
        stream = b._raw_stream()
        if seq > self.pp_config[1]:
            self._check(k.wait_flag(ctypes.byref(self._wait_params), self._credit(me, dst), seq - self.pp_config[1],
                                    dst, _PHASE["pp_send (a free slot)"], stream), "pp_send wait")
        self._check(k.copy(self._slot(dst, me, seq), t.data_ptr(), t.nbytes, stream), "pp_send copy")
        self._check(k.signal_flag(self._arrived(dst, me), seq, stream), "pp_send signal")
        self.num_sent[dst] = seq
        return (), [], []

    def pp_recv(self, t: torch.Tensor, src: int):
        b, k = self.backend, self.backend.kernels
        me, seq = b.rank, self.num_received[src] + 1
        stream = b._raw_stream()
        self._check(k.wait_flag(ctypes.byref(self._wait_params), self._arrived(me, src), seq, src, _PHASE["pp_recv"],
                            stream), "pp_recv wait")
        self._check(k.copy(t.data_ptr(), self._slot(me, src, seq), t.nbytes, stream), "pp_recv copy")
        self._check(k.signal_flag(self._credit(src, me), seq, stream), "pp_recv signal")
        self.num_received[src] = seq
        return (), [], []

    # ------------------------------------------------------------------------------------------------
    # All-gather, reduce-scatter
    # ------------------------------------------------------------------------------------------------
    def _agrs_region(self, what: str, t: torch.Tensor, slot_bytes: int) -> None:
        """The all-gather / reduce-scatter region with slots of at least `slot_bytes` (of `what`'s tensor `t`): made
        at the first call, made again when a call needs more (collective either way; the ranks agree on `what` and
        `t`'s shape and dtype first, one exchange and a host sync, so no copy can overrun a peer's slot)."""
        b = self.backend
        if self._agrs is not None and slot_bytes <= self._agrs_slot_bytes:
            return
        self.agree(what, tensor_words(MAX_TENSOR_DIMS, t.dtype, t.shape))
        if self._agrs is not None:
            self._free_region(self._agrs)
            self._agrs = None
        R = b.num_ranks
        self._agrs_slot_bytes = _slot_size(slot_bytes)
        region = self._new_region(agrs_region_bytes(R, self._agrs_slot_bytes))
        # Where this rank signals on every peer: its arrival, its release of a slot.
        me, bases = b.rank, region.addresses
        signal = [[bases[p] + offset + 8 * me if p != me else 0 for p in range(R)]
                  for offset in (AGRS_ARRIVED, AGRS_RELEASED)]
        self._agrs_signals = torch.tensor(signal, dtype=torch.int64, device=b.device)
        self._agrs, self._agrs_seq = region, 0

    def _agrs_slot(self, rank: int, parity: int, source: int) -> int:
        return self._agrs.addresses[rank] + AGRS_CONTROL_BYTES + \
            (parity * self.backend.num_ranks + source) * self._agrs_slot_bytes

    def _agrs_exchange(self, block_of: Callable[[int], tuple[int, int] | None], what: str) -> tuple[int, int]:
        """One all-gather / reduce-scatter exchange: every peer's slot `me` (of this call's parity) gets
        `block_of(peer)` = (address, bytes) by a copy engine once the peer released that slot (two calls ago), then
        every peer's arrival is awaited. Returns `(parity, stream)`; the caller reads its slots, then
        `_agrs_release`."""
        b, k = self.backend, self.backend.kernels
        R, me = b.num_ranks, b.rank
        self._agrs_seq += 1
        seq, parity = self._agrs_seq, self._agrs_seq % 2
        stream = b._raw_stream()
        base = self._agrs.addresses[me]
        params = ctypes.byref(self._wait_params)
        if seq > 2:  # the slots of this parity were last read two calls ago
            phase = _PHASE["all_gather / reduce_scatter (a free slot)"]
            self._check(k.wait_flags(params, base + AGRS_RELEASED, R, seq - 2, phase, stream), f"{what} wait")
        for p in range(R):
            block = block_of(p)
            if block is None:  # nothing for this rank's slot (the all-gather reads its own tensor)
                continue
            address, num_bytes = block
            self._check(k.copy(self._agrs_slot(p, parity, me), address, num_bytes, stream), f"{what} copy")
        self._check(k.signal_flags(self._agrs_signals[0].data_ptr(), R, seq, stream), f"{what} signal")
        phase = _PHASE["all_gather / reduce_scatter"]
        self._check(k.wait_flags(params, base + AGRS_ARRIVED, R, seq, phase, stream), f"{what} wait")
        return parity, stream

    def _agrs_release(self, stream: int, what: str) -> None:
        k = self.backend.kernels
        self._check(k.signal_flags(self._agrs_signals[1].data_ptr(), self.backend.num_ranks, self._agrs_seq, stream),
                    f"{what} release")

    def all_gather(self, t: torch.Tensor):
        """Copy engines: `t` into every rank's slot, then the slots (own: `t`) into `[R, *t.shape]`."""
        b, k = self.backend, self.backend.kernels
        R, me, nbytes = b.num_ranks, b.rank, t.nbytes
        out = t.new_empty(R, *t.shape)
        self._agrs_region("all_gather", t, nbytes)
        parity, stream = self._agrs_exchange(lambda p: None if p == me else (t.data_ptr(), nbytes), "all_gather")
        for q in range(R):
            source = t.data_ptr() if q == me else self._agrs_slot(me, parity, q)
            self._check(k.copy(out[q].data_ptr(), source, nbytes, stream), "all_gather copy out")
        self._agrs_release(stream, "all_gather")
        return (out,), [], []

    def reduce_scatter(self, t: torch.Tensor):
        """Copy engines: block p of `t` into rank p's slot, then one kernel sums this rank's slots in rank order."""
        b, k = self.backend, self.backend.kernels
        R, me = b.num_ranks, b.rank
        n = t.shape[0] // R
        out = t.new_empty(n, *t.shape[1:])
        block_bytes = out.nbytes
        self._agrs_region("reduce_scatter", t, block_bytes)
        parity, stream = self._agrs_exchange(lambda p: (t[p * n:(p + 1) * n].data_ptr(), block_bytes),
                                             "reduce_scatter")
        self._check(k.reduce_slots(self._agrs_slot(me, parity, 0), self._agrs_slot_bytes, R, out.numel(),
                                   out.data_ptr(), DTYPE_CODES[t.dtype], REDUCE_BLOCKS, stream), "reduce_scatter sum")
        self._agrs_release(stream, "reduce_scatter")
        return (out,), [], []

    # ------------------------------------------------------------------------------------------------
    # Engram
    # ------------------------------------------------------------------------------------------------
    def engram_write(self, storage: torch.Tensor, error=None) -> None:
        """The table's rows in an IPC region of this rank, every rank's mapped here (collective); the ranks agree
        on the row shape and dtype first (`PrimitivesBase.agree_table`)."""
        b = self.backend
        self.agree_table(storage, error)
        rows = storage.detach().contiguous()
        region = self._new_region(engram_region_bytes(rows.nbytes))
        table = region.tensor[:rows.nbytes].view(rows.dtype).view(rows.shape)
        table.copy_(rows)  # before the old region goes: `storage` may be a view of it
        if self._engram is not None:
            self._free_region(self._engram)
        self._engram, self.table = region, table
        self._engram_bases = torch.tensor(region.addresses, dtype=torch.int64, device=b.device)
        self._engram_offsets = torch.tensor(self.table_offsets, dtype=torch.int64, device=b.device)
        torch.cuda.synchronize(b.device)  # every table in place before a peer reads it
        dist.barrier(group=b.group)

    def engram_fetch(self, indices: torch.Tensor, error=None) -> Callable[[], torch.Tensor]:
        """One-sided: one kernel reads every requested row from its owner's region (peer loads over NVLink; the
        owners take no part); the callable returns the rows (stream-ordered, nothing to wait for)."""
        b, k = self.backend, self.backend.kernels
        self.check_fetch(indices, error)  # the same errors on every rank, one exchange
        table = self.table
        out = table.new_empty(indices.shape[0], *table.shape[1:])
        row_bytes = table.element_size() * math.prod(table.shape[1:])
        self._check(k.engram_gather(indices.data_ptr(), indices.shape[0], self._engram_offsets.data_ptr(),
                                    b.num_ranks, self._engram_bases.data_ptr(), row_bytes, out.data_ptr(),
                                    ENGRAM_BLOCKS, b._raw_stream()), "engram_fetch")
        return lambda: out

    def close(self) -> None:
        """Free the regions: collective (`Buffer.destroy()` on every rank), since a peer may still write into this
        rank's regions until every rank's work is done and the ranks have met."""
        super().close()
        for name in ("_region", "_agrs", "_engram"):
            region = getattr(self, name)
            if region is not None:
                self._free_region(region)
                setattr(self, name, None)
        self.table = None


def _drop(region: IpcMemory, device: torch.device) -> None:
    """A region whose primitives were dropped without `close()`: this rank stops writing into its peers' (the device
    synchronized, their mappings closed); its own memory stays, as a peer may still write into it."""
    if torch.cuda.is_initialized():  # False in a forked child: the memory is the parent's
        torch.cuda.synchronize(device)
        region.close_peers()

__all__ = ["CudaPrimitives"]
