"""The buffer's primitives beside dispatch and combine (DESIGN 8.4, the seed's sections 5-6), written with
torch.distributed point-to-point exchanges on the buffer's group: pipeline send/recv between ring neighbours, an
all-gather and a reduce-scatter, and Engram (rows of a table spread over the ranks, fetched by global index).

This is the reference and the path of every backend but the CUDA one (`cuda_primitives`: copy engines): it runs
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

from .common import exclusive_cumsum, subgroup_of

# Engram tables: rows of at most this many dimensions (their shape travels in a fixed-size agreement check).
MAX_ROW_DIMS = 4
# Every torch dtype by a code the ranks share (agreement checks name them).
DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
TABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.int8,
                 torch.uint8, torch.int32, torch.int64)


def shape_words(prefix: str, max_dims: int, dtype: Optional[torch.dtype] = None,
                shape=()) -> tuple[tuple[str, ...], list[int]]:
    """`(names, values)` by which ranks agree on a tensor's dtype and shape (`TorchPrimitives.agree`): the dtype's
    code in DTYPES, the number of dimensions, the sizes zero-padded to `max_dims`; names start with `prefix`. No
    dtype (this rank refused its arguments): zeros."""
    names = (f"{prefix}dtype", f"{prefix}dims", *(f"{prefix}shape[{i}]" for i in range(max_dims)))
    if dtype is None:
        return names, [0] * len(names)
    return names, [DTYPES.index(dtype), len(shape), *shape, *[0] * (max_dims - len(shape))]


class TorchPrimitives:
    """The primitives of one Buffer over its backend's group (module docstring).

    Arguments:
        backend: the Buffer's backend (its group, device, stream control and timeouts are used).
    """

    def __init__(self, backend) -> None:
        self.backend = backend
        self.pp_config: Optional[tuple[int, int]] = None
        # The pipeline's own groups, the buffer's ranks twice: data toward a higher rank, toward a lower one. A send
        # and a receive between two ranks then never share a communicator (NCCL: a send may wait for its receive,
        # so two ranks sending to each other first would wait for ever) nor gloo's channel, which the buffer's
        # other exchanges use.
        self._pp_groups: Optional[tuple[dist.ProcessGroup, dist.ProcessGroup]] = None
        # Per destination: sends posted and not yet known complete, as (work, description, staged copy).
        self._sends: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        # Per peer: tensors sent to it / receives from it posted since `pp_set_config` (the CUDA backend's sequence
        # numbers).
        self.num_sent: collections.Counter[int] = collections.Counter()
        self.num_received: collections.Counter[int] = collections.Counter()
        self._pp_streams: dict[tuple[int, bool], torch.cuda.Stream] = {}
        self.table: Optional[torch.Tensor] = None
        self.table_offsets: list[int] = []

    def before_call(self, what: str) -> None:
        """Refuse a call this path cannot take before anything moves (the reference takes every one)."""

    def close(self) -> None:
        """Drop what the primitives hold (`Buffer.destroy`)."""
        self._sends.clear()
        self.table = None

    # ------------------------------------------------------------------------------------------------
    # Agreement
    # ------------------------------------------------------------------------------------------------
    def agree(self, values: list[int], names: tuple[str, ...], what: str,
              error: Optional[Exception] = None) -> list[list[int]]:
        """Every rank's `values`; ValueError on every rank when one of the `names` differs (values past them may),
        naming each field with every rank's value (the exchanges below are sized by them). A rank that refused its
        arguments (`error`; its `values` any of the right length) still takes part, so that every rank raises: that
        rank its own error, the others a ValueError naming it."""
        b = self.backend
        mine = torch.tensor([int(error is not None), *values], dtype=torch.int64, device=b.device)
        rows = b.gather_values(mine, f"{what} agreement").tolist()
        if error is not None:
            raise error
        refused = [r for r, row in enumerate(rows) if row[0]]
        if refused:
            raise ValueError(f"{what}: rank(s) {refused} refused their arguments (their error says why)")
        rows = [row[1:] for row in rows]
        differing = [f"{name}: {[row[i] for row in rows]}" for i, name in enumerate(names)
                     if len({row[i] for row in rows}) > 1]
        if differing:
            raise ValueError(f"ranks called {what} with different values (per rank): " + "; ".join(differing))
        return rows

    # ------------------------------------------------------------------------------------------------
    # Pipeline send/recv
    # ------------------------------------------------------------------------------------------------
    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int,
                      error: Optional[Exception] = None) -> None:
        self.agree_pp_config(num_max_tensor_bytes, num_max_inflight_tensors, error)
        if self._pp_groups is None:
            b = self.backend
            everyone = [list(range(b.num_ranks))]
            self._pp_groups = tuple(subgroup_of(b.group, b.device, everyone, b.timeout_secs) for _ in range(2))
            self._connect_neighbours()
        self.pp_config = (num_max_tensor_bytes, num_max_inflight_tensors)

    def agree_pp_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int,
                        error: Optional[Exception]) -> None:
        """The ranks agree on a new pipeline configuration and that nothing is in flight: as many receives posted
        as tensors sent, per pair (a ValueError on every rank naming the pairs otherwise; the old configuration
        stays, so the missing receives or sends can still be made). The counts then start again.

        Arguments:
            num_max_tensor_bytes, num_max_inflight_tensors: as in `Buffer.pp_set_config` (checked by the caller).
            error: the caller refused the arguments (every rank raises).
        """
        b = self.backend
        R = b.num_ranks
        values = [0, 0] if error is not None else [num_max_tensor_bytes, num_max_inflight_tensors]
        counts = [self.num_sent[q] for q in range(R)] + [self.num_received[q] for q in range(R)]
        rows = self.agree(values + counts, ("num_max_tensor_bytes", "num_max_inflight_tensors"), "pp_set_config",
                          error)
        in_flight = []
        for r in range(R):
            for q in range(R):
                sent, received = rows[r][2 + q], rows[q][2 + R + r]
                if sent > received:
                    in_flight.append(f"rank {r} sent {sent} to rank {q}, which posted {received} receives from it "
                                     f"(receive the rest)")
                elif received > sent:
                    in_flight.append(f"rank {q} posted {received} receives from rank {r}, which sent {sent} to it "
                                     f"(send the rest)")
        if in_flight:
            raise ValueError("pp_set_config while tensors are in flight (the configuration is unchanged): "
                             + "; ".join(in_flight))
        self.num_sent.clear()
        self.num_received.clear()

    def pp_stream(self, peer: int, sending: bool) -> Optional[torch.cuda.Stream]:
        """The stream of this rank's async pipeline calls with one peer and direction (`Backend.run`'s side stream:
        a receive that waits for its data never holds back a send, nor the comm stream); made at first use.

        Arguments:
            peer: the ring neighbour.
            sending: True for sends to `peer`, False for receives from it.

        Returns:
            The stream, or None on the CPU (no streams).
        """
        b = self.backend
        if b.device.type != "cuda":
            return None
        key = (peer, sending)
        if key not in self._pp_streams:
            self._pp_streams[key] = torch.cuda.Stream(b.device)
        return self._pp_streams[key]

    def _pp_group(self, src: int, dst: int) -> dist.ProcessGroup:
        return self._pp_groups[0 if src < dst else 1]

    def _connect_neighbours(self) -> None:
        """One message each way between every pair of ring neighbours on the pipeline's groups, pairs in one global
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
                work = post(token, dist.get_global_rank(b.group, other), group=self._pp_group(src, dst))
                b._wait([(work, f"rank {me} pp_set_config: connecting with peer {other}")])

    def pp_send(self, t: torch.Tensor, dst: int):
        """`Backend.run` steps of a send: wait for a free slot, stage `t` there, post the send."""
        b = self.backend
        sends = self._sends[dst]
        while sends and sends[0][0].is_completed():
            sends.popleft()
        while len(sends) >= self.pp_config[1]:  # every slot taken: the oldest must have been received
            work, description, _ = sends.popleft()
            b._wait([(work, description)])
        staged = t.clone()
        work = dist.isend(staged, dist.get_global_rank(b.group, dst), group=self._pp_group(b.rank, dst))
        sends.append((work, f"rank {b.rank} pp_send: send to peer {dst}", staged))
        self.num_sent[dst] += 1
        return (), [], []

    def pp_recv(self, t: torch.Tensor, src: int):
        """`Backend.run` steps of a receive into `t`."""
        b = self.backend
        work = dist.irecv(t, dist.get_global_rank(b.group, src), group=self._pp_group(src, b.rank))
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
    def engram_write(self, storage: torch.Tensor, error: Optional[Exception] = None) -> None:
        """Keep this rank's table (collective); `error`: the caller refused the arguments (every rank raises)."""
        if error is None and storage.dtype not in TABLE_DTYPES:
            error = TypeError(f"storage dtype must be one of {TABLE_DTYPES}, got {storage.dtype}")
        if error is None and (not 1 <= storage.dim() <= MAX_ROW_DIMS + 1 or 0 in storage.shape[1:]):
            error = ValueError(f"storage must have 1 to {MAX_ROW_DIMS + 1} dimensions (rows first) and non-empty "
                               f"rows, got shape {tuple(storage.shape)}")
        if error is None:
            names, values = shape_words("row ", MAX_ROW_DIMS, storage.dtype, storage.shape[1:])
        else:
            names, values = shape_words("row ", MAX_ROW_DIMS)
        values.append(storage.shape[0] if error is None else 0)  # the row count: it may differ between ranks
        rows = self.agree(values, names, "engram_write", error)
        self.table = storage.detach().contiguous().clone()
        self.table_offsets = exclusive_cumsum([r[-1] for r in rows]) + [sum(r[-1] for r in rows)]

    def check_fetch(self, indices: torch.Tensor, error: Optional[Exception]) -> None:
        """Refused arguments or bad indices on any rank: an error on every rank before any row moves (one exchange;
        the ranks' exchanges would not match otherwise)."""
        b = self.backend
        offsets = self.table_offsets
        i64 = dict(dtype=torch.int64, device=b.device)
        first_bad, value = -1, 0
        if error is None:
            bad = (indices < 0) | (indices >= offsets[-1])
            if bool(bad.any()):
                first_bad = int(bad.nonzero()[0, 0])
                value = int(indices[first_bad])
        everyone = b.gather_values(torch.tensor([int(error is not None), first_bad, value], **i64),
                                   "engram_fetch index check").tolist()
        if error is not None:
            raise error
        refused = [r for r, row in enumerate(everyone) if row[0]]
        if refused:
            raise ValueError(f"engram_fetch: rank(s) {refused} refused their arguments (their error says why)")
        total = offsets[-1]
        problems = [f"rank {r}: indices[{i}]={v}" for r, (_, i, v) in enumerate(everyone) if i >= 0]
        if problems:
            raise ValueError(f"engram_fetch indices must be in [0, {total}) (rows of every rank's table): "
                             + ", ".join(problems))

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
        out = table.new_empty(indices.shape[0], *row_shape)
        done = []

        def fetch() -> torch.Tensor:
            if not done:
                b._wait(works)
                out.view(indices.shape[0], width).view(torch.uint8).index_copy_(0, order, got)
                done.append(True)
            return out

        return fetch


__all__ = ["TorchPrimitives", "MAX_ROW_DIMS", "TABLE_DTYPES", "DTYPES", "shape_words"]
