"""EventOverlap: the completion of a dispatch or combine that ran on the buffer's comm stream.

On CUDA it wraps a `torch.cuda.Event` recorded on the comm stream: `current_stream_wait()` makes the current
stream wait for it without blocking the host. On CPU (gloo) there are no streams: it wraps the async `Work`
handles of the reference backend's collectives plus the local steps that must run once the data has arrived
(`finalizers`); `current_stream_wait()` blocks until the collectives are done, then runs those steps once.
A synchronous call returns a completed event (nothing to wait for).
"""

from __future__ import annotations

import datetime
import re
import time
import weakref
from typing import Callable, Optional, Sequence

import torch


class EventOverlap:
    """Completion of one communication call.

    Arguments:
        event: a `torch.cuda.Event` recorded on the comm stream, or None.
        works: `(work, description)` pairs of async `torch.distributed.Work` handles (CPU path), waited in
            order; the description names rank, phase and peer for the timeout error.
        finalizers: callables run once, in order, after the works complete (CPU path).
        extra_tensors: tensors (and handles) kept alive until the event has been waited on: what an async call's
            kernels read. Wait for an async call's event (on the stream that was current at the call, or one
            ordered after it) before dropping it.
        timeout_secs: how long a CPU wait may block before raising (`num_cpu_timeout_secs` of the buffer).
        on_fault: called with the error's text when a wait fails (the backend then refuses later calls).
    """

    def __init__(self, event: "torch.cuda.Event | None" = None, works: Sequence = (),
                 finalizers: Sequence[Callable[[], None]] = (), extra_tensors: Sequence[object] = (),
                 timeout_secs: float = 300.0, on_fault: Optional[Callable[[str], None]] = None) -> None:
        self.event = event
        self._works = list(works)
        self._finalizers = list(finalizers)
        self._extra_tensors = tuple(extra_tensors)
        self._timeout_secs = timeout_secs
        self._on_fault = on_fault

    @property
    def done(self) -> bool:
        """True when the communication has finished (CUDA: the event has completed; CPU: waited on)."""
        if self.event is not None and not self.event.query():
            return False
        return not self._works and not self._finalizers

    @property
    def on_device_only(self) -> bool:
        """True when waiting for it needs no host work (a CUDA event; no CPU works or finalizers left)."""
        return self.event is not None and not self._works and not self._finalizers

    @torch.compiler.disable
    def current_stream_wait(self) -> None:
        """Make the current stream (CUDA) or the caller (CPU) wait for the communication to finish."""
        if self.event is not None:  # the current stream of the event's GPU, which may not be the current device
            torch.cuda.current_stream(self.event.device).wait_event(self.event)
        timeout = datetime.timedelta(seconds=self._timeout_secs)
        while self._works:
            work, description = self._works.pop(0)
            start = time.monotonic()
            try:
                work.wait(timeout=timeout)
            except RuntimeError as exc:
                self._works.clear()
                self._finalizers.clear()
                error = wait_error(description, self._timeout_secs, time.monotonic() - start, exc)
                if self._on_fault is not None:
                    self._on_fault(str(error))
                raise error from exc
        # Outputs may already be autograd outputs (async autograd): filling them is not a differentiable op.
        with torch.no_grad():
            while self._finalizers:
                self._finalizers.pop(0)()
        # A completed event keeps nothing alive (callers hold on to it, e.g. as `_` of an unpacked result).
        self._extra_tensors = ()
        self._on_fault = None

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # Leaving a `with event:` block is where the consumer needs the result.
        if exc_type is None:
            self.current_stream_wait()


class RecvHook:
    """The receive half of a dispatch or combine called with `return_recv_hook=True`. Call it once, before the next
    operation on the buffer: it receives the rows into the call's outputs.

    CUDA: it launches the receivers on the stream that was current at the call (`stream`, a raw handle of device
    `device_index`); when another stream is current, that stream then waits for them and `outputs` are recorded as
    used by it (the caching allocator keeps them until its work is done). The host does not wait. CPU (reference
    backend, `stream` None): it waits for the exchange, then fills the outputs.
    """

    def __init__(self, backend, receive: Callable[[object], None], stream: Optional[int], device_index: int = -1,
                 outputs: Sequence[torch.Tensor] = ()) -> None:
        self._backend = weakref.ref(backend)  # the backend holds the hook while it is pending: no cycle
        self._receive = receive
        self._stream = stream
        self._device_index = device_index
        self._outputs = tuple(outputs)

    @property
    def done(self) -> bool:
        """True once the hook was called."""
        return self._receive is None

    @torch.compiler.disable
    def __call__(self) -> None:
        receive = self._receive
        if receive is None:
            raise RuntimeError("moe_comm: this receive hook was already called")
        backend = self._backend()
        self._receive = None
        if backend is None or backend.pending_hook is not self:  # `Buffer.destroy` let go of it
            raise RuntimeError("moe_comm: the buffer of this receive hook was destroyed")
        backend.pending_hook = None
        backend.after_host_sync()  # a destroyed buffer, or a fault recorded since the call
        # The common case, the call's stream still current, without stream objects (each costs host time).
        if self._stream is None or torch._C._cuda_getCurrentRawStream(self._device_index) == self._stream:
            receive(backend)
            return
        call_stream = torch.cuda.ExternalStream(self._stream, device=self._device_index)
        current = torch.cuda.current_stream(self._device_index)
        with torch.cuda.stream(call_stream):
            receive(backend)
        current.wait_stream(call_stream)
        for t in self._outputs:
            t.record_stream(current)


# What gloo says when the peer's end of the connection went away (its process exited or was killed).
_CLOSED = ("closed by peer", "reset by peer", "broken pipe", "connection refused", "end of file")


def wait_error(description: str, timeout_secs: float, elapsed: float, exc: RuntimeError,
               who: Optional[str] = None) -> Exception:
    """The error for a failed exchange `description` ("rank R phase: receive from peer P"): ConnectionError when
    the peer (`who`, else the one the description names) closed the connection, TimeoutError when it did not
    arrive in time."""
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if any(words in detail.lower() for words in _CLOSED):
        if who is None:
            peer = re.search(r"peer (\d+)", description)
            who = f"peer {peer.group(1)}" if peer else "a peer"
        return ConnectionError(f"moe_comm: {description}: {who} closed the connection after {elapsed:.2f} s (its "
                               f"process ended or failed): {detail}")
    return TimeoutError(f"moe_comm: {description} did not complete within num_cpu_timeout_secs={timeout_secs:g} "
                        f"(the peer did not arrive, or is stuck): {detail}")
