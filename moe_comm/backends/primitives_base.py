"""What the primitives of every backend share (`torch_primitives`, the reference, and `cuda_primitives`, the copy
engines, are siblings over it): the ranks' agreement on a call's arguments, the pipeline's configuration check and
counts, its streams, and the Engram table's agreement and index check. The semantics of the primitives are in
`torch_primitives`' docstring.
"""

from __future__ import annotations

import collections
from typing import Optional

import torch

from .common import MAX_ROW_DIMS, OPERATIONS, exclusive_cumsum, padded_signature, tensor_words

TABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.int8,
                torch.uint8, torch.int32, torch.int64)


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
    def agree(self, what: str, values: list[int], error: Optional[Exception] = None) -> list[list[int]]:
        """Every rank's `values` (after `what`'s operation word; at most `SIGNATURE_LEN - 1`), by the backend's
        agreement (`Backend.check_agreement`): ValueError on every rank when the ranks called different operations
        or `what` with different values in its `SIGNATURE_FIELDS` (the words past them may differ), and on a
        buffer whose group broke. A rank that refused its arguments (`error`) still takes part, so that every rank
        raises: that rank its own error, the others a ValueError naming it."""
        operation = OPERATIONS.index(what)
        rows = self.backend.check_agreement(padded_signature([operation] if error else [operation, *values]),
                                            refused=error is not None)
        if error is not None:
            raise error
        return [row[1:] for row in rows]

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
        self.agree("pp_set_config", [num_max_tensor_bytes, num_max_inflight_tensors], error)
        counts = [self.num_sent[q] for q in range(R)] + [self.num_received[q] for q in range(R)]
        rows = b.gather_values(torch.tensor(counts, dtype=torch.int64, device=b.device),
                               "pp_set_config in-flight counts").tolist()
        in_flight = []
        for r in range(R):
            for q in range(R):
                sent, received = rows[r][q], rows[q][R + r]
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
        # The row count after the row shape: it may differ between ranks.
        count_at = 2 + MAX_ROW_DIMS
        values = [] if error else [*tensor_words(MAX_ROW_DIMS, storage.dtype, storage.shape[1:]), storage.shape[0]]
        counts = [row[count_at] for row in self.agree("engram_write", values, error)]
        self.table_offsets = exclusive_cumsum(counts) + [sum(counts)]

    def check_fetch(self, indices: torch.Tensor, error: Optional[Exception]) -> None:
        """Refused arguments or bad indices on any rank: an error on every rank before any row moves (one exchange;
        the ranks' exchanges would not match otherwise)."""
        offsets = self.table_offsets
        first_bad, value = -1, 0
        if error is None:
            bad = (indices < 0) | (indices >= offsets[-1])
            if bool(bad.any()):
                first_bad = int(bad.nonzero()[0, 0])
                value = int(indices[first_bad])
        everyone = self.agree("engram_fetch", [first_bad, value], error)
        total = offsets[-1]
        problems = [f"rank {r}: indices[{i}]={v}" for r, (i, v, *_) in enumerate(everyone) if i >= 0]
        if problems:
            raise ValueError(f"engram_fetch indices must be in [0, {total}) (rows of every rank's table): "
                             + ", ".join(problems))


__all__ = ["PrimitivesBase", "TABLE_DTYPES"]
