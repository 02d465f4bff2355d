"""The CUDA backend's pipeline send/recv by copy engines: the rows move with cudaMemcpyAsync into the receiver's
slot (peer memory over NVLink), and the only kernels are a one-warp wait for a flag and a one-thread release of a
flag, so no SM is held while data moves (DESIGN 8.4). The all-gather, reduce-scatter and Engram stay the
reference's (`torch_primitives`) until their copy-engine paths exist.

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
as with torch.distributed; `pp_set_config` again waits for the device, drops what was sent and not received, and
makes new slots.
"""

from __future__ import annotations

import ctypes
import weakref

import torch
import torch.distributed as dist

from .. import layout as lay
from .cuda import _PHASE, CudaBackend
from .cuda_ipc import IpcMemory
from .cuda_kernels import current_stream
from .torch_primitives import TorchPrimitives

CONTROL_BYTES = 16 * lay.MAX_RANKS  # arrived[MAX_RANKS], credit[MAX_RANKS]
SLOT_ALIGN = 256


class CudaPrimitives(TorchPrimitives):
    """The primitives of a CUDA-backend Buffer: pipeline send/recv by copy engines (module docstring), the others
    the reference's.

    Arguments:
        backend: the Buffer's `CudaBackend` (its kernels, ErrorRecord, abort word and timeout serve the waits).
    """

    def __init__(self, backend: CudaBackend) -> None:
        super().__init__(backend)
        self._region: IpcMemory | None = None
        self._slot_bytes = 0
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}
        self._wait_params: lay.EpParams | None = None

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
        b = self.backend
        values = [0, 0] if error is not None else [num_max_tensor_bytes, num_max_inflight_tensors]
        self.agree(values, ("num_max_tensor_bytes", "num_max_inflight_tensors"), "pp_set_config", error)
        self.pp_config = (num_max_tensor_bytes, num_max_inflight_tensors)
        if self._region is not None:  # every rank's copies done before any region goes
            torch.cuda.synchronize(b.device)
            dist.barrier(group=b.group)
            self._finalizer()
        self._slot_bytes = -(-num_max_tensor_bytes // SLOT_ALIGN) * SLOT_ALIGN
        num_bytes = CONTROL_BYTES + 2 * num_max_inflight_tensors * self._slot_bytes
        self._region = IpcMemory(b.kernels, num_bytes, b.device, b.rank)
        # A buffer dropped without destroy(): the region goes with these primitives (the device synchronized first).
        self._finalizer = weakref.finalize(self, _free, self._region, b.device)
        self._finalizer.atexit = False
        self._region.connect(b.group)
        torch.cuda.synchronize(b.device)  # every region zeroed before a peer signals into it
        dist.barrier(group=b.group)
        self._sent, self._received = {}, {}
        self._wait_params = lay.EpParams(local_base=b.buffer.data_ptr(), error=b._mapped_dev,
                                         timeout_ns=b.timeout_ns, rank=b.rank, num_ranks=b.num_ranks)

    def _check_not_capturing(self, what: str) -> None:
        if torch.cuda.is_current_stream_capturing():
            raise ValueError(f"{what} cannot be captured in a CUDA graph on the CUDA backend (its sequence numbers "
                             f"live on the host)")

    def pp_send(self, t: torch.Tensor, dst: int):
        b, k = self.backend, self.backend.kernels
        self._check_not_capturing("pp_send")
        me, seq = b.rank, self._sent.get(dst, 0) + 1
        stream = current_stream(b.device.index)
        if seq > self.pp_config[1]:
            k.check(k.wait_flag(ctypes.byref(self._wait_params), self._credit(me, dst), seq - self.pp_config[1], dst,
                                _PHASE["pp_send (a free slot)"], stream), "pp_send wait", me)
        k.check(k.copy(self._slot(dst, me, seq), t.data_ptr(), t.nbytes, stream), "pp_send copy", me)
        k.check(k.signal_flag(self._arrived(dst, me), seq, stream), "pp_send signal", me)
        self._sent[dst] = seq
        return (), [], []

    def pp_recv(self, t: torch.Tensor, src: int):
        b, k = self.backend, self.backend.kernels
        self._check_not_capturing("pp_recv")
        me, seq = b.rank, self._received.get(src, 0) + 1
        stream = current_stream(b.device.index)
        k.check(k.wait_flag(ctypes.byref(self._wait_params), self._arrived(me, src), seq, src, _PHASE["pp_recv"],
                            stream), "pp_recv wait", me)
        k.check(k.copy(t.data_ptr(), self._slot(me, src, seq), t.nbytes, stream), "pp_recv copy", me)
        k.check(k.signal_flag(self._credit(src, me), seq, stream), "pp_recv signal", me)
        self._received[src] = seq
        return (), [], []

    def close(self) -> None:
        """Free the pipeline region (the device synchronized first)."""
        super().close()
        if self._region is not None:
            self._finalizer()
            self._region = None


def _free(region: IpcMemory, device: torch.device) -> None:
    if torch.cuda.is_initialized():  # False in a forked child: the memory is the parent's
        torch.cuda.synchronize(device)
        region.free()


__all__ = ["CudaPrimitives"]
