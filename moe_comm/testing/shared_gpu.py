"""Ranks that share one GPU: the CUDA backend's peer paths without a second GPU (tests/test_shared_gpu.py, the
hybrid GPU tests, `scripts/soak.py --share-gpu`).

The world group is gloo (NCCL refuses two ranks on one device; gloo's collectives stage CUDA tensors through host
memory), and the CUDA buffers map their peers with CUDA IPC (`CudaTuning(peer_memory="ipc")`: torch's symmetric
memory does not map between two processes on one GPU). A gloo group is a CPU group to `Buffer`, so these context
managers place its buffers on cuda:0 while they are open. Correctness only: no NVLink, so no timings.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

import moe_comm
from moe_comm.backends.cuda import CudaTuning


@contextlib.contextmanager
def on_gpu0():
    """The gloo world group's buffers on cuda:0, each rank sized for its share of the GPU's SMs (the sizing model's
    `num_sms=0` default would give every rank a whole GPU's worth: the ranks' kernels would then wait for SMs that
    the others hold, which makes the tests slow, not wrong)."""
    torch.cuda.set_device(0)
    original_device = moe_comm.Buffer.__dict__["group_device"]  # the staticmethod itself
    original_topology = moe_comm.Buffer._machine_topology

    def topology(self):
        whole = original_topology(self)
        return dataclasses.replace(whole, num_device_sms=max(2, whole.num_device_sms // dist.get_world_size() // 2 * 2))

    moe_comm.Buffer.group_device = staticmethod(lambda group: torch.device("cuda", 0))
    moe_comm.Buffer._machine_topology = topology
    try:
        yield
    finally:
        moe_comm.Buffer.group_device = original_device
        moe_comm.Buffer._machine_topology = original_topology


@contextlib.contextmanager
def every_buffer_over_ipc():
    """`on_gpu0`, and every CUDA buffer made in the block maps its peers with CUDA IPC (for code that makes its own
    buffers, e.g. tests/test_gpu.py's rank functions or the soak); reference buffers stay on the CPU."""
    original = moe_comm.Buffer.__init__

    def init(self, *args, cuda_tuning=None, backend="auto", **kwargs):
        if backend == "torch":  # the reference stays on the CPU: gloo's point-to-point takes no CUDA tensors
            moe_comm.Buffer.group_device = original_device
            try:
                original(self, *args, backend=backend, **kwargs)
            finally:
                moe_comm.Buffer.group_device = on_gpu
            return
        original(self, *args, backend=backend,
                 cuda_tuning=dataclasses.replace(cuda_tuning or CudaTuning(), peer_memory="ipc"), **kwargs)

    original_device = moe_comm.Buffer.__dict__["group_device"]
    with on_gpu0():
        on_gpu = moe_comm.Buffer.__dict__["group_device"]
        moe_comm.Buffer.__init__ = init
        try:
            yield
        finally:
            moe_comm.Buffer.__init__ = original
