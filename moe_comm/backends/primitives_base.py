"""What the primitives of every backend share (`torch_primitives`, the reference, and `cuda_primitives`, the copy
engines, are siblings over it): the ranks' agreement on a call's arguments, the pipeline's configuration check and
counts, its streams, and the Engram table's agreement and index check. The semantics of the primitives are in
`torch_primitives`' docstring.
"""

from __future__ import annotations

import collections
from typing import Optional

import torch

from .common import exclusive_cumsum

# Engram tables: rows of at most this many dimensions (their shape travels in a fixed-size agreement check).
MAX_ROW_DIMS = 4
# Every torch dtype by a code the ranks share (agreement checks name them).
DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
TABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.int8,
                 torch.uint8, torch.int32, torch.int64)


def shape_words(prefix: str, max_dims: int, dtype: Optional[torch.dtype] = None,
                shape=()) -> tuple[tuple[str, ...], list[int]]:
    """`(names, values)` by which ranks agree on a tensor's dtype and shape (`PrimitivesBase.agree`): the dtype's
    code in DTYPES, the number of dimensions, the sizes zero-padded to `max_dims`; names start with `prefix`. No
    dtype (this rank refused its arguments): zeros."""
    names = (f"{prefix}dtype", f"{prefix}dims", *(f"{prefix}shape[{i}]" for i in range(max_dims)))
    if dtype is None:
        return names, [0] * len(names)
    return names, [DTYPES.index(dtype), len(shape), *shape, *[0] * (max_dims - len(shape))]


class PrimitivesBase:
    """The state and checks every backend's primitives share.

    Arguments:
        backend: the Buffer's backend (its group, device, stream control and timeouts are used).
    """

    def __init__(self, backend) -> None:
        self.backend = backend
        self.pp_config: Optional[tuple[int, int]] = None
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

        def show(name: str, value: int):  # a dtype by its name (`shape_words` sends its index in DTYPES)
            return str(DTYPES[value]).removeprefix("torch.") if name.endswith("dtype") else value

        differing = [f"{name}: {[show(name, row[i]) for row in rows]}" for i, name in enumerate(names)
                     if len({row[i] for row in rows}) > 1]
        if differing:
            raise ValueError(f"ranks called {what} with different values (per rank): " + "; ".join(differing))
        return rows

    # ------------------------------------------------------------------------------------------------
    # Pipeline configuration and streams
    # ------------------------------------------------------------------------------------------------
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

    # ------------------------------------------------------------------------------------------------
    # Engram
    # ------------------------------------------------------------------------------------------------
    def agree_table(self, storage: torch.Tensor, error: Optional[Exception]) -> None:
        """`engram_write`'s checks and agreement (collective): the ranks' row shapes and dtypes must match (their row
        counts may differ) and set `table_offsets`; `error`: the caller refused the arguments (every rank raises)."""
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


__all__ = ["PrimitivesBase", "MAX_ROW_DIMS", "TABLE_DTYPES", "DTYPES", "shape_words"]
