"""EventOverlap: the completion of a dispatch or combine that ran on the buffer's comm stream.

On CUDA it wraps a `torch.cuda.Event` recorded on the comm stream: `current_stream_wait()` makes the current
stream wait for it without blocking the host. On CPU (gloo) there are no streams: it wraps the async `Work`
handles of the reference backend's collectives plus the local steps that must run once the data has arrived
(`finalizers`); `current_stream_wait()` blocks until the collectives are done, then runs those steps once.
A synchronous call returns a completed event (nothing to wait for).
"""

from __future__ import annotations

import datetime
from typing import Callable, Sequence

import torch


class EventOverlap:
    """Completion of one communication call.

    Arguments:
        event: a `torch.cuda.Event` recorded on the comm stream, or None.
        works: `(work, description)` pairs of async `torch.distributed.Work` handles (CPU path), waited in
            order; the description names rank, phase and peer for the timeout error.
        finalizers: callables run once, in order, after the works complete (CPU path).
        extra_tensors: tensors kept alive until the event has been waited on.
        timeout_secs: how long a CPU wait may block before raising (`num_cpu_timeout_secs` of the buffer).
    """

    def __init__(self, event: "torch.cuda.Event | None" = None, works: Sequence = (),
                 finalizers: Sequence[Callable[[], None]] = (), extra_tensors: Sequence[torch.Tensor] = (),
                 timeout_secs: float = 300.0) -> None:
        self.event = event
        self._works = list(works)
        self._finalizers = list(finalizers)
        self._extra_tensors = tuple(extra_tensors)
        self._timeout_secs = timeout_secs

    @property
    def done(self) -> bool:
        """True when the communication has finished (CUDA: the event has completed; CPU: waited on)."""
        if self.event is not None and not self.event.query():
            return False
        return not self._works and not self._finalizers

    def current_stream_wait(self) -> None:
        """Make the current stream (CUDA) or the caller (CPU) wait for the communication to finish."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        timeout = datetime.timedelta(seconds=self._timeout_secs)
        while self._works:
            work, description = self._works.pop(0)
            try:
                work.wait(timeout=timeout)
            except RuntimeError as exc:
                self._works.clear()
                self._finalizers.clear()
                raise TimeoutError(f"moe_comm: {description} did not complete within "
                                   f"num_cpu_timeout_secs={self._timeout_secs:g} (the peer did not arrive "
                                   f"or failed): {exc}") from exc
        # Outputs may already be autograd outputs (async autograd): filling them is not a differentiable op.
        with torch.no_grad():
            while self._finalizers:
                self._finalizers.pop(0)()
        self._extra_tensors = ()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # Leaving a `with event:` block is where the consumer needs the result.
        if exc_type is None:
            self.current_stream_wait()
