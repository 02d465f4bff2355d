"""The buffer's primitives beside dispatch and combine (DESIGN 8.4, the seed's sections 5-6), written with
torch.distributed point-to-point exchanges on the buffer's group: pipeline send/recv between ring neighbours, an
all-gather and a reduce-scatter, and Engram (rows of a table spread over the ranks, fetched by global index).

This is the reference of every backend for now: it runs wherever the group runs (gloo on CPU, NCCL on GPUs, across
hosts) with the backend's stream control (`Backend.run`: the current stream, or the comm stream and an
`EventOverlap` with `async_with_compute_stream`) and its timeouts (a peer that does not arrive is a TimeoutError
naming rank, phase and peer). On GPUs the exchanges are NCCL's kernels, not yet copy engines: the 0-SM path of the
CUDA backend is the next step (benchmarks/NOTES.md).

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

from .common import exclusive_cumsum

# Engram tables: rows of at most this many dimensions (their shape travels in a fixed-size agreement check).
MAX_ROW_DIMS = 4
TABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.int8,
                 torch.uint8, torch.int32, torch.int64)


class TorchPrimitives:
    """The primitives of one Buffer over its backend's group (module docstring).

    Arguments:
        backend: the Buffer's backend (its group, device, stream control and timeouts are used).
    """

    def __init__(self, backend) -> None:
        self.backend = backend
        self.pp_config: Optional[tuple[int, int]] = None
        # Per destination: sends posted and not yet known complete, as (work, description, staged copy).
        self._sends: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self.table: Optional[torch.Tensor] = None
        self.table_offsets: list[int] = []

    # ------------------------------------------------------------------------------------------------
    # Agreement
    # ------------------------------------------------------------------------------------------------
    def agree(self, values: list[int], names: tuple[str, ...], what: str) -> list[list[int]]:
        """Every rank's `values`; ValueError on every rank when one of the `names` differs (values past them may),
        naming each field with every rank's value (the exchanges below are sized by them)."""
        b = self.backend
        rows = b.gather_values(torch.tensor(values, dtype=torch.int64, device=b.device), f"{what} agreement").tolist()
        differing = [f"{name}: {[row[i] for row in rows]}" for i, name in enumerate(names)
                     if len({row[i] for row in rows}) > 1]
        if differing:
            raise ValueError(f"ranks called {what} with different values (per rank): " + "; ".join(differing))
        return rows

    # ------------------------------------------------------------------------------------------------
    # Pipeline send/recv
    # ------------------------------------------------------------------------------------------------
    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        self.agree([num_max_tensor_bytes, num_max_inflight_tensors],
                    ("num_max_tensor_bytes", "num_max_inflight_tensors"), "pp_set_config")
        self.pp_config = (num_max_tensor_bytes, num_max_inflight_tensors)

    def pp_send(self, t: torch.Tensor, dst: int):
        """`Backend.run` steps of a send: wait for a free slot, stage `t` there, post the send."""
        b = self.backend
        sends = self._sends[dst]
        while sends and sends[0][0].is_completed():
            sends.popleft()
        if len(sends) >= self.pp_config[1]:  # every slot taken: the oldest must have been received
            work, description, _ = sends.popleft()
            b._wait([(work, description)])
        staged = t.clone()
        work = dist.isend(staged, dist.get_global_rank(b.group, dst), group=b.group)
        sends.append((work, f"rank {b.rank} pp_send: send to peer {dst}", staged))
        return (), [], []

    def pp_recv(self, t: torch.Tensor, src: int):
        """`Backend.run` steps of a receive into `t`."""
        b = self.backend
        work = dist.irecv(t, dist.get_global_rank(b.group, src), group=b.group)
        return (), [(work, f"rank {b.rank} pp_recv: receive from peer {src}")], []

    # ------------------------------------------------------------------------------------------------
    # All-gather, reduce-scatter
    # ------------------------------------------------------------------------------------------------
    def all_gather(self, t: torch.Tensor):
        """`Backend.run` steps: every rank's `t` as the rows of `[R, *t.shape]`."""
        b = self.backend
        R = b.num_ranks
        flat = t.reshape(1, -1)
        recv, works = b._exchange(flat.expand(R, -1), [1] * R, [1] * R, "all_gather")
        return (recv.view(R, *t.shape),), works, []

    def reduce_scatter(self, t: torch.Tensor):
        """`Backend.run` steps: block `rank` of every rank's `t`, summed in rank order in the accumulation dtype."""
        b = self.backend
        R = b.num_ranks
        n = t.shape[0] // R
        recv, works = b._exchange(t, [n] * R, [n] * R, "reduce_scatter")
        out = t.new_empty(n, *t.shape[1:])
        acc_dtype = torch.float64 if t.dtype == torch.float64 else torch.float32

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
    def engram_write(self, storage: torch.Tensor) -> None:
        if storage.dtype not in TABLE_DTYPES:
            raise TypeError(f"storage dtype must be one of {TABLE_DTYPES}, got {storage.dtype}")
        if not 1 <= storage.dim() <= MAX_ROW_DIMS + 1 or 0 in storage.shape[1:]:
            raise ValueError(f"storage must have 1 to {MAX_ROW_DIMS + 1} dimensions (rows first) and non-empty "
                             f"rows, got shape {tuple(storage.shape)}")
        row = list(storage.shape[1:])
        names = ("row dtype", "row dims", *(f"row shape[{i}]" for i in range(MAX_ROW_DIMS)))
        codes = {dtype: i for i, dtype in enumerate(TABLE_DTYPES)}
        rows = self.agree([codes[storage.dtype], len(row), *row, *[0] * (MAX_ROW_DIMS - len(row)),
                            storage.shape[0]], names, "engram_write")  # the row count (last) may differ
        self.table = storage.detach().contiguous().clone()
        self.table_offsets = exclusive_cumsum([r[-1] for r in rows]) + [sum(r[-1] for r in rows)]

    def engram_fetch(self, indices: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Post the exchanges of a fetch; the callable waits for the rows and returns them."""
        b = self.backend
        R, table, offsets = b.num_ranks, self.table, self.table_offsets
        total = offsets[-1]
        dev = b.device
        i64 = dict(dtype=torch.int64, device=dev)
        # Bad indices on any rank: the same ValueError everywhere before any row moves (the ranks' exchanges
        # would not match otherwise).
        bad = (indices < 0) | (indices >= total)
        first_bad = int(bad.nonzero()[0, 0]) if bool(bad.any()) else -1
        everyone = b.gather_values(torch.tensor([first_bad, int(indices[first_bad]) if first_bad >= 0 else 0],
                                                **i64), "engram_fetch index check").tolist()
        problems = [f"rank {r}: indices[{i}]={v}" for r, (i, v) in enumerate(everyone) if i >= 0]
        if problems:
            raise ValueError(f"engram_fetch indices must be in [0, {total}) (rows of every rank's table): "
                             + ", ".join(problems))
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
        out = table.new_empty(indices.shape[0], *row_shape)
        done = []

        def fetch() -> torch.Tensor:
            if not done:
                b._wait(works)
                out.view(indices.shape[0], width).view(torch.uint8).index_copy_(0, order, got)
                done.append(True)
            return out

        return fetch


__all__ = ["TorchPrimitives", "MAX_ROW_DIMS", "TABLE_DTYPES"]
