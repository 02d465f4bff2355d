"""`Buffer`'s primitives beside dispatch and combine (DESIGN 8.4): pipeline send/recv between ring neighbours, an
all-gather and a reduce-scatter, Engram fetches. This mixin checks the arguments (TypeError/ValueError naming them,
before anything moves) and runs each call through the buffer's backend (its stream control: the current stream,
or with `async_with_compute_stream=True` the comm stream (the pipeline: a stream per neighbour and direction) and
an `EventOverlap` to wait on). The transfers are `moe_comm.backends.torch_primitives` (their semantics are
documented there) and, on the CUDA backend, `moe_comm.backends.cuda_primitives`.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from .args import check_bool, check_group, check_int
from .backends import cuda_primitives
from .backends.common import MAX_TENSOR_DIMS, tensor_words
from .event import EventOverlap

_REDUCE_DTYPES = (torch.bfloat16, torch.float32, torch.float64)


class PrimitivesMixin:
    """The primitives' methods of `moe_comm.Buffer` (which provides `_impl`, `_prims`, the checks it uses here)."""

    # ------------------------------------------------------------------------------------------------
    # Size hints: device memory each rank's primitives ask for beside the buffer (the CUDA backend allocates each
    # region at its first use, cudaMalloc may round it up; the reference sends through the group into the callers'
    # tensors)
    # ------------------------------------------------------------------------------------------------
    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
        """Bytes each rank's `pp_set_config(num_max_tensor_bytes, num_max_inflight_tensors)` allocates on the CUDA
        backend: flags, then a slot per (neighbour direction, tensor in flight), each `num_max_tensor_bytes` rounded
        up to 256 bytes. The reference backend allocates none."""
        check_int(1, num_max_tensor_bytes=num_max_tensor_bytes, num_max_inflight_tensors=num_max_inflight_tensors)
        return cuda_primitives.pp_region_bytes(num_max_tensor_bytes, num_max_inflight_tensors)

    @staticmethod
    def get_agrs_buffer_size_hint(group: Optional[dist.ProcessGroup], num_max_bytes: int) -> int:
        """Bytes each rank's all-gather / reduce-scatter region takes on the CUDA backend (allocated at the first
        `all_gather` or `reduce_scatter`, again when a later call needs larger slots) for calls whose block per rank
        is at most `num_max_bytes`: an `all_gather`'s `t.nbytes`, a `reduce_scatter`'s output (`t.nbytes / R`). Two
        slots per rank of the group (calls alternate between them), each rounded up to 256 bytes, and flags. The
        reference backend allocates none beyond the call's output."""
        check_int(1, num_max_bytes=num_max_bytes)
        check_group(group)
        num_ranks = dist.get_world_size(dist.group.WORLD if group is None else group)
        return cuda_primitives.agrs_region_bytes(num_ranks, num_max_bytes)

    @staticmethod
    def get_engram_storage_size_hint(num_rows: int, row_bytes: int) -> int:
        """Bytes each rank's `engram_write(storage)` takes on the CUDA backend for a table of `num_rows` rows of
        `row_bytes` bytes each (`storage[0].nbytes`): the region every rank maps, `num_rows * row_bytes` and at
        least 256. The reference backend keeps a copy of the table (`num_rows * row_bytes`)."""
        check_int(0, num_rows=num_rows)
        check_int(1, row_bytes=row_bytes)
        return cuda_primitives.engram_region_bytes(num_rows * row_bytes)

    # ------------------------------------------------------------------------------------------------
    # Pipeline send/recv
    # ------------------------------------------------------------------------------------------------
    @torch.compiler.disable
    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        """Configure pipeline send/recv (collective: every rank calls it with the same values; ValueError on every
        rank when they differ, or while a tensor sent has not been received: receive it first, the configuration
        stays as it was). The CUDA backend makes new slots.

        Arguments:
            num_max_tensor_bytes: the largest tensor `pp_send` takes, in bytes.
            num_max_inflight_tensors: sends to one peer that may wait for their receive before a further send
                waits for the oldest to be received (the slots per peer).
        """
        self._check_alive()
        error = None
        try:
            check_int(1, num_max_tensor_bytes=num_max_tensor_bytes,
                      num_max_inflight_tensors=num_max_inflight_tensors)
            slots = 2 * num_max_tensor_bytes * num_max_inflight_tensors  # a slot per (neighbour, tensor in flight)
            if slots > self._memory_bytes:
                raise self._too_large(f"pipeline slots (2 neighbours x {num_max_inflight_tensors} x "
                                      f"{num_max_tensor_bytes} bytes)", slots)
        except (TypeError, ValueError) as exc:  # raised on every rank by the agreement (the others wait in it)
            error = exc
        self._prims.pp_set_config(num_max_tensor_bytes, num_max_inflight_tensors, error)

    @torch.compiler.disable
    def pp_send(self, t: torch.Tensor, dst: int, previous_event: Optional[EventOverlap] = None,
                async_with_compute_stream: bool = False) -> EventOverlap:
        """Send `t` to ring neighbour `dst` (`(rank + 1) % R` or `(rank - 1) % R`); the call copies `t` into a slot,
        so `t` may be reused when it returns (async: once its event completed). With all of `dst`'s slots taken it
        first waits until `dst` received the oldest. `dst` receives with `pp_recv` in the same order.

        Arguments:
            t: a contiguous tensor on the buffer's device, at most `num_max_tensor_bytes` bytes.
            dst: the receiving rank of the buffer's group.
            previous_event, async_with_compute_stream: as in `dispatch`.

        Returns:
            `EventOverlap` (complete unless `async_with_compute_stream`).
        """
        self._check_pp(t, dst, "dst", previous_event, async_with_compute_stream)
        return self._run_primitive("pp_send", lambda: self._prims.pp_send(t, dst), previous_event,
                                   async_with_compute_stream, [t], self._prims.pp_stream(dst, True))[1]

    @torch.compiler.disable
    def pp_recv(self, t: torch.Tensor, src: int, previous_event: Optional[EventOverlap] = None,
                async_with_compute_stream: bool = False) -> EventOverlap:
        """Receive into `t` the oldest tensor ring neighbour `src` sent that this rank has not received yet. Async,
        it may be posted before the send it waits for (on GPUs each neighbour and direction has a stream of its
        own); synchronous, it is ordered on the current stream like a blocking receive.

        Arguments:
            t: a contiguous tensor on the buffer's device of the sent tensor's size and dtype.
            src: the sending rank of the buffer's group.
            previous_event, async_with_compute_stream: as in `dispatch`.

        Returns:
            `EventOverlap`: `t` holds the tensor once it is complete.
        """
        self._check_pp(t, src, "src", previous_event, async_with_compute_stream)
        return self._run_primitive("pp_recv", lambda: self._prims.pp_recv(t, src), previous_event,
                                   async_with_compute_stream, [t], self._prims.pp_stream(src, False))[1]

    def _check_pp(self, t, peer, name: str, previous_event, async_with_compute_stream) -> None:
        self._check_alive()
        if self._prims.pp_config is None:
            raise RuntimeError("moe_comm: call pp_set_config(num_max_tensor_bytes, num_max_inflight_tensors) on "
                               "every rank before pp_send/pp_recv")
        self._check_tensor("t", t)
        limit = self._prims.pp_config[0]
        if t.nbytes > limit:
            raise ValueError(f"t has {t.nbytes} bytes, more than num_max_tensor_bytes={limit} (pp_set_config)")
        check_int(0, **{name: peer})
        R = self.num_ranks
        neighbours = sorted({(self.rank + 1) % R, (self.rank - 1) % R} - {self.rank})
        if peer not in neighbours:
            raise ValueError(f"{name}={peer} is not a ring neighbour of rank {self.rank} of {R} "
                             f"(neighbours: {neighbours})")
        self._check_stream_args(previous_event, async_with_compute_stream)

    # ------------------------------------------------------------------------------------------------
    # All-gather, reduce-scatter
    # ------------------------------------------------------------------------------------------------
    @torch.compiler.disable
    def all_gather(self, t: torch.Tensor, previous_event: Optional[EventOverlap] = None,
                   async_with_compute_stream: bool = False) -> tuple[torch.Tensor, EventOverlap]:
        """Every rank's `t`, stacked (collective).

        Arguments:
            t: a contiguous tensor on the buffer's device, the same shape and dtype on every rank.
            previous_event, async_with_compute_stream: as in `dispatch`.

        Returns:
            `(out, event)`: `out` is `[R, *t.shape]`, row r rank r's `t`.
        """
        self._check_collective("all_gather", t, previous_event, async_with_compute_stream)
        outputs, event = self._run_primitive("all_gather", lambda: self._prims.all_gather(t), previous_event,
                                             async_with_compute_stream, [t])
        return outputs[0], event

    @torch.compiler.disable
    def reduce_scatter(self, t: torch.Tensor, previous_event: Optional[EventOverlap] = None,
                       async_with_compute_stream: bool = False) -> tuple[torch.Tensor, EventOverlap]:
        """Block `rank` of the sum of every rank's `t` (collective): `t` is R blocks of `t.shape[0] // R` rows; the
        sum is taken in rank order in FP32 (FP64 for float64) and cast back to `t`'s dtype.

        Arguments:
            t: `[R * n, ...]`, `torch.bfloat16`, `torch.float32` or `torch.float64`, contiguous, on the buffer's
                device, the same shape and dtype on every rank.
            previous_event, async_with_compute_stream: as in `dispatch`.

        Returns:
            `(out, event)`: `out` is `[n, ...]` in `t`'s dtype.
        """
        def check(t):
            if t.dtype not in _REDUCE_DTYPES:
                raise TypeError(f"t must be one of {_REDUCE_DTYPES} for reduce_scatter, got {t.dtype}")
            if t.dim() == 0 or t.shape[0] % self.num_ranks:
                raise ValueError(f"t's first dimension must be a multiple of the {self.num_ranks} ranks, got shape "
                                 f"{tuple(t.shape)}")

        self._check_collective("reduce_scatter", t, previous_event, async_with_compute_stream, check)
        outputs, event = self._run_primitive("reduce_scatter", lambda: self._prims.reduce_scatter(t), previous_event,
                                             async_with_compute_stream, [t])
        return outputs[0], event

    def _check_collective(self, what: str, t, previous_event, async_with_compute_stream, check=None) -> None:
        """Arguments of a collective (`check(t)`: the caller's own, run after the common ones), then (reference on
        CPU, or MOE_COMM_CHECK_INPUTS=1) that every rank called `what` with the same shape and dtype, the exchange
        being sized by them: a rank whose arguments were refused raises there and every other rank with it. Without
        the agreement a refused rank raises alone (as with torch.distributed's collectives; the CUDA backend's
        ranks agree when its region is made or grows)."""
        self._check_alive()
        agree = self._agrees_on_host
        error = None
        try:
            self._check_tensor("t", t)
            if t.dim() > MAX_TENSOR_DIMS:
                raise ValueError(f"t must have at most {MAX_TENSOR_DIMS} dimensions, got shape {tuple(t.shape)}")
            if check is not None:
                check(t)
            self._check_stream_args(previous_event, async_with_compute_stream)
        except (TypeError, ValueError) as exc:
            if not agree:
                raise
            error = exc
        if agree:
            self._prims.agree(what, [] if error else tensor_words(MAX_TENSOR_DIMS, t.dtype, t.shape), error)

    # ------------------------------------------------------------------------------------------------
    # Engram
    # ------------------------------------------------------------------------------------------------
    @torch.compiler.disable
    def engram_write(self, storage: torch.Tensor) -> None:
        """Keep this rank's part of a table (collective): global row g is row `g - offset_r` of the rank r whose
        rows hold it, ranks in order (`offset_r` = rows of the ranks before r). Replaces the previous table.

        Arguments:
            storage: `[n_r, *row]` on the buffer's device (1 to 4 row dimensions, non-empty rows), the same row
                shape and dtype on every rank; `n_r` may differ (0 too). The buffer keeps a copy.
        """
        self._check_alive()
        error = None
        try:
            self._check_tensor("storage", storage, contiguous=False)
        except (TypeError, ValueError) as exc:  # raised on every rank by the agreement (the others wait in it)
            error = exc
        self._prims.engram_write(storage, error)

    @torch.compiler.disable
    def engram_fetch(self, indices: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Fetch rows of the table by global index (collective: every rank calls it, with its own indices, possibly
        none). Bad indices on any rank raise the same ValueError on every rank before any row moves.

        Arguments:
            indices: `[n]`, `torch.int64`, on the buffer's device, each in `[0, total rows)`.

        Returns:
            A callable that waits for the rows and returns them, `[n, *row]` in `indices`' order.
        """
        self._check_alive()
        error = None
        try:
            if self._prims.table is None:
                raise RuntimeError("moe_comm: call engram_write(storage) on every rank before engram_fetch")
            self._check_tensor("indices", indices)
            if indices.dtype != torch.int64 or indices.dim() != 1:
                raise TypeError(f"indices must be a 1-D torch.int64 tensor, got {indices.dtype} of shape "
                                f"{tuple(indices.shape)}")
        except (RuntimeError, TypeError, ValueError) as exc:  # raised on every rank by the fetch's first exchange
            error = exc
        if error is None:
            self._prims.before_call("engram_fetch")
        # The callable waits for the rows (the reference backend: for the exchange), eager under torch.compile too.
        return torch.compiler.disable(self._prims.engram_fetch(indices, error))

    # ------------------------------------------------------------------------------------------------
    # Shared
    # ------------------------------------------------------------------------------------------------
    def _check_stream_args(self, previous_event, async_with_compute_stream) -> None:
        check_bool(async_with_compute_stream=async_with_compute_stream)
        self._check_event(previous_event)

    def _run_primitive(self, what: str, steps, previous_event, async_with_compute_stream, inputs,
                       side_stream=None) -> tuple:
        """`(outputs, event)` of a primitive's steps (arguments checked) run by the backend (`Backend.run`, async
        on `side_stream` when given, else the comm stream)."""
        self._impl.after_host_sync()
        self._prims.before_call(what)
        outputs, event, _ = self._impl.run(steps, previous_event, async_with_compute_stream,
                                           inputs if async_with_compute_stream else (), side_stream=side_stream)
        return outputs, event


__all__ = ["PrimitivesMixin"]
