"""Peer memory over CUDA IPC, the CUDA backend's alternative to torch's symmetric memory
(`CudaTuning.peer_memory="ipc"`): each rank allocates its buffer with cudaMalloc, the ranks exchange the buffers'
IPC handles over the group and open each other's. The kernels see the same thing either way: a device array of
every rank's buffer base. Unlike the symmetric-memory rendezvous, IPC maps memory between two processes on one GPU,
so two ranks can share a GPU (the GPU tier's peer paths on a one-GPU machine; no NVLink then, so the timings mean
nothing). Every rank must be on this machine.
"""

from __future__ import annotations

import ctypes

import torch
import torch.distributed as dist

IPC_HANDLE_BYTES = 64  # CUDA_IPC_HANDLE_SIZE


class _DeviceBytes:
    """`__cuda_array_interface__` of raw device memory, for a torch tensor over it (torch.as_tensor copies nothing)."""

    def __init__(self, address: int, num_bytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (num_bytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


class IpcMemory:
    """This rank's buffer and the peers' mappings of theirs.

    Arguments:
        kernels: the loaded kernel library (`cuda_kernels.Kernels`).
        num_bytes: the buffer's size (zeroed).
        device: this rank's GPU.
        rank: for error messages.
    """

    def __init__(self, kernels, num_bytes: int, device: torch.device, rank: int) -> None:
        self.kernels, self.device, self.rank = kernels, device, rank
        address, handle = ctypes.c_void_p(), ctypes.create_string_buffer(IPC_HANDLE_BYTES)
        with torch.cuda.device(device):
            if kernels.ipc_alloc(num_bytes, ctypes.byref(address), handle):
                why = kernels.last_error().decode()
                error = torch.OutOfMemoryError if "out of memory" in why else RuntimeError  # as torch's allocator
                raise error(f"moe_comm: the IPC buffer ({num_bytes} bytes on {device}) failed on rank {rank}: {why}")
        self.address, self.handle = address.value, handle.raw
        self.tensor = torch.as_tensor(_DeviceBytes(self.address, num_bytes), device=device)
        self.peers: list[int] = []  # addresses of the peers' buffers opened here
        self.addresses: list[int] = []  # every rank's buffer as mapped here (`connect()`)
        self.bases: torch.Tensor | None = None

    def connect(self, group: dist.ProcessGroup) -> int:
        """Collective: exchange handles, open every peer's buffer; returns the device address of the bases array."""
        handles = [None] * dist.get_world_size(group)
        dist.all_gather_object(handles, self.handle, group=group)
        bases = []
        with torch.cuda.device(self.device):
            for r, handle in enumerate(handles):
                if r == dist.get_rank(group):
                    bases.append(self.address)
                    continue
                address = ctypes.c_void_p()
                self.kernels.check(self.kernels.ipc_open(handle, ctypes.byref(address)),
                                   f"opening rank {r}'s IPC buffer", self.rank)
                self.peers.append(address.value)
                bases.append(address.value)
        self.addresses = bases
        self.bases = torch.tensor(bases, dtype=torch.int64, device=self.device)
        return self.bases.data_ptr()

    def close_peers(self) -> None:
        """Close the peers' mappings (this rank writes into them no more once its device is synchronized)."""
        with torch.cuda.device(self.device):
            while self.peers:
                self.kernels.check(self.kernels.ipc_close(self.peers.pop()), "closing a peer's IPC buffer", self.rank)

    def free(self) -> None:
        """Close the peers' mappings, then free this rank's buffer (the device synchronized by the caller). Legacy IPC
        does not keep the memory for peers that still map it: a peer writes into this buffer only inside an operation
        this rank waits through (its rows, flags and counts are awaited here), so none writes any more, unless a
        wait timed out (then the group is broken anyway)."""
        self.close_peers()
        with torch.cuda.device(self.device):
            if self.address:
                address, self.address = self.address, 0
                self.kernels.check(self.kernels.ipc_free(address), "freeing the IPC buffer", self.rank)


__all__ = ["IpcMemory"]
