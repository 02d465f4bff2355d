"""The buffer's primitives beside dispatch and combine (DESIGN 8.4, the seed's sections 5-6), written with
torch.distributed point-to-point exchanges on the buffer's group: pipeline send/recv between ring neighbours, an
all-gather and a reduce-scatter, and Engram (rows of a table spread over the ranks, fetched by global index).

This is the reference and the path of every backend but the CUDA one (`cuda_primitives`: copy engines; the two are
siblings over `primitives_base`, which holds the agreement checks they share): it runs
wherever the group runs (gloo on CPU, NCCL on GPUs, across hosts) with the backend's stream control (`Backend.run`:
the current stream, or with `async_with_compute_stream` the comm stream, the pipeline's own stream per neighbour and
direction, and an `EventOverlap`) and its timeouts (a peer that does not arrive is a TimeoutError naming rank, phase
and peer). On GPUs the exchanges are NCCL's kernels.

Semantics (the contract the copy-engine path keeps):
- Pipeline: `pp_send(t, dst)` copies `t` into one of `num_max_inflight_tensors` slots for `dst` and returns (the
  caller may reuse `t` at once); with every slot taken it first waits for `dst` to receive the oldest.
  `pp_recv(t, src)` fills `t` with the oldest tensor `src` sent that this rank has not received (per pair, first
  in first out); sizes and dtypes must match the send's, as with `torch.distributed.recv`.
- `all_gather(t)`: `[R, *t.shape]`, row r = rank r's `t`. `reduce_scatter(t)`: `t` is R blocks of rows; this rank
  gets the sum of block `rank` over the ranks, in rank order, in FP32 (FP64 for float64), cast back.
- Engram: `engram_write(storage)` keeps each rank's table `[n_r, *row]`; global row g is row `g - offset_r` of the
  rank r whose range holds it (ranks in order). `engram_fetch(indices)` is collective (every rank calls it, with
  its own indices, possibly none) and returns a callable that waits for the rows and returns them in the order of
  `indices`.
"""

from __future__ import annotations

import collections
import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .common import PP_TAG, accumulation_dtype, group_is_live, keep_until_done, subgroup_of
from .primitives_base import PrimitivesBase


class TorchPrimitives(PrimitivesBase):
    """The primitives of one Buffer over its backend's group (module docstring).

    Arguments:
        backend: the Buffer's backend (its group, device, stream control and timeouts are used).
    """

    def __init__(self, backend) -> None:
        super().__init__(backend)
        # The pipeline's channels, one per direction (toward a higher rank, toward a lower one) as (group, tag): a
        # send and a receive between two ranks never share one. On gloo, tags of this buffer's own on its group
        # (apart from the other exchanges' and other buffers'); on NCCL, which has no tags and where a send may wait
        # for its receive (two ranks sending to each other first would wait for ever), two groups of their own.
        self._pp_channels: Optional[tuple[tuple[dist.ProcessGroup, int], tuple[dist.ProcessGroup, int]]] = None
        # Per destination: sends posted and not yet known complete, as (work, description, staged copy).
        self._sends: dict[int, collections.deque] = collections.defaultdict(collections.deque)

    def close(self) -> None:
        """Wait until every tensor sent was received (a send dropped here would be lost: its receiver would time
        out; on the CPU a receiver that never comes is the TimeoutError naming it), then drop the table. Not on a
        destroyed group: its sends went with it."""
        sends = [send for queue in self._sends.values() for send in queue]  # the staged copies live until the end
        self._sends.clear()
        self._pp_channels = None
        super().close()
        if sends and self.backend.broken is None and group_is_live(self.backend.group):
            self.backend._wait([(work, description) for work, description, _ in sends])

    # ------------------------------------------------------------------------------------------------
    # Pipeline send/recv
    # ------------------------------------------------------------------------------------------------
    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int,
                      error: Optional[Exception] = None) -> None:
        self.agree_pp_config(num_max_tensor_bytes, num_max_inflight_tensors, error)
        if self._pp_channels is None:
            b = self.backend
            if b.device.type == "cpu":
                tag = PP_TAG + 2 * b.serial
                self._pp_channels = ((b.group, tag), (b.group, tag + 1))
            else:
                self._pp_channels = tuple((group, 0) for group in self._nccl_pp_groups())
                self._connect_neighbours()
        self.pp_config = (num_max_tensor_bytes, num_max_inflight_tensors)

    def _nccl_pp_groups(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """Two new groups of the buffer's ranks. They stay until the process ends: torch cannot destroy and remake such
        a group (the next one's hashed name is the destroyed one's, whose rendezvous keys it finds in the store), and
        lending them to later buffers would need every rank to agree on which pair is free and empty (a destroyed
        buffer's unreceived send would pair with the next buffer's first receive)."""
        b = self.backend
        return tuple(subgroup_of(b.group, b.device, [list(range(b.num_ranks))], b.timeout_secs) for _ in range(2))

    def _pp_channel(self, src: int, dst: int) -> dict:
        group, tag = self._pp_channels[0 if src < dst else 1]
        return {"group": group, "tag": tag}

    def _connect_neighbours(self) -> None:
        """One message each way between every pair of ring neighbours on new pipeline groups, pairs in one global
        order (pair (r, r + 1) is number r, pair (0, R - 1) number R - 1): NCCL makes a pair's communicator at its
        first message, which blocks until both ranks are there, so ranks that first sent along the ring would wait
        on each other in a circle."""
        b = self.backend
        R, me = b.num_ranks, b.rank
        pairs = {tuple(sorted((me, (me + d) % R))) for d in (1, -1)} - {(me, me)}
        for lo, hi in sorted(pairs, key=lambda pair: pair[0] if pair[1] == pair[0] + 1 else R - 1):
            other = hi if me == lo else lo
            for src, dst in ((lo, hi), (hi, lo)):
                token = torch.zeros(1, device=b.device)
                post = dist.isend if me == src else dist.irecv
                work = post(token, dist.get_global_rank(b.group, other), **self._pp_channel(src, dst))
                b._wait([(work, f"rank {me} pp_set_config: connecting with peer {other}")])

    def pp_send(self, t: torch.Tensor, dst: int):
        """`Backend.run` steps of a send: wait for a free slot, stage `t` there, post the send."""
        b = self.backend
        sends = self._sends[dst]
        while sends and sends[0][0].is_completed():
            sends.popleft()
        while len(sends) >= self.pp_config[1]:  # every slot taken: the oldest must have been received
            work, description, staged = sends.popleft()
            b._wait([(work, description)])
            if staged.is_cuda:  # made on another stream perhaps: reusable once this stream, which waited, gets here
                staged.record_stream(torch.cuda.current_stream(b.device))
        staged = t.clone()
        work = dist.isend(staged, dist.get_global_rank(b.group, dst), **self._pp_channel(b.rank, dst))
        if b.device.type == "cpu":
            keep_until_done(b.group, [work])
        sends.append((work, f"rank {b.rank} pp_send: send to peer {dst}", staged))
        self.num_sent[dst] += 1
        return (), [], []

    def pp_recv(self, t: torch.Tensor, src: int):
        """`Backend.run` steps of a receive into `t`."""
        b = self.backend
        work = dist.irecv(t, dist.get_global_rank(b.group, src), **self._pp_channel(src, b.rank))
        self.num_received[src] += 1
        return (), [(work, f"rank {b.rank} pp_recv: receive from peer {src}")], []

    # ------------------------------------------------------------------------------------------------
    # All-gather, reduce-scatter
    # ------------------------------------------------------------------------------------------------
    def all_gather(self, t: torch.Tensor):
        """`Backend.run` steps: every rank's `t` as the rows of `[R, *t.shape]`."""
        b = self.backend
        R = b.num_ranks
        flat = t.reshape(1, t.numel())
        recv, works = b._exchange(flat.expand(R, -1), [1] * R, [1] * R, "all_gather")
        return (recv.view(R, *t.shape),), works, []

    def reduce_scatter(self, t: torch.Tensor):
        """`Backend.run` steps: block `rank` of every rank's `t`, summed in rank order in the accumulation dtype."""
        b = self.backend
        R = b.num_ranks
        n = t.shape[0] // R
        recv, works = b._exchange(t, [n] * R, [n] * R, "reduce_scatter")
        out = t.new_empty(n, *t.shape[1:])
        acc_dtype = accumulation_dtype(t.dtype)

        def finalize() -> None:
            blocks = recv.view(R, n, *t.shape[1:])
            acc = blocks[0].to(acc_dtype)
            for r in range(1, R):
                acc += blocks[r].to(acc_dtype)
            out.copy_(acc)

        return (out,), works, [finalize]

    # ------------------------------------------------------------------------------------------------
    # Engram
    # ------------------------------------------------------------------------------------------------
    def engram_write(self, storage: torch.Tensor, error: Optional[Exception] = None) -> None:
        """Keep this rank's table (collective); `error`: the caller refused the arguments (every rank raises)."""
        self.agree_table(storage, error)
        self.table = storage.detach().contiguous().clone()

    def engram_fetch(self, indices: torch.Tensor, error: Optional[Exception] = None) -> Callable[[], torch.Tensor]:
        """Post the exchanges of a fetch; the callable waits for the rows and returns them. `error`: the caller
        refused the arguments (every rank raises)."""
        b = self.backend
        R, table, offsets = b.num_ranks, self.table, self.table_offsets
        i64 = dict(dtype=torch.int64, device=b.device)
        self.check_fetch(indices, error)
        # Requests per owner, in owner order (stable: each owner answers in request order).
        bounds = torch.tensor(offsets[1:-1], **i64)
        owner = torch.bucketize(indices, bounds, right=True)
        order = torch.sort(owner, stable=True).indices
        counts = torch.bincount(owner, minlength=R)
        asked = b.gather_values(counts, "engram_fetch count exchange")  # [R, R]: row r = what rank r asks
        send_counts = asked[:, b.rank].tolist()  # what every rank asks of us
        recv_counts = counts.tolist()
        local = (indices - torch.tensor(offsets[:-1], **i64)[owner]).index_select(0, order)
        requests, works = b._exchange(local.view(-1, 1), recv_counts, send_counts, "engram_fetch request exchange")
        b._wait(works)
        row_shape = table.shape[1:]
        width = math.prod(row_shape)  # elements per row
        answer = table.index_select(0, requests.view(-1)).view(requests.shape[0], width).view(torch.uint8)
        got, works = b._exchange(answer, send_counts, recv_counts, "engram_fetch row exchange")
        if b.device.type == "cpu":
            keep_until_done(b.group, [work for work, _ in works])
        out = table.new_empty(indices.shape[0], *row_shape)
        done = []

        def fetch() -> torch.Tensor:
            if not done:
                b._wait(works)
                out.view(indices.shape[0], width).view(torch.uint8).index_copy_(0, order, got)
                done.append(True)
            return out

        return fetch


__all__ = ["TorchPrimitives"]
