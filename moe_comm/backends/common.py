"""What the backends share (they are siblings: neither is built on the other): stream control around an operation,
argument agreement across ranks, value checks of `topk_idx` and their error messages, the FP8 cast before rows
travel. The reference backend (`torch_ref`) and the CUDA backend (`cuda`) each implement `dispatch_steps`,
`combine_steps` and `gather_values`. (Over 400 lines: the base class every backend runs its calls through, with the
shared checks and messages that keep the backends' errors identical.)
"""

from __future__ import annotations

import datetime
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .. import layout as lay
from .. import quant, traffic_class
from ..event import EventOverlap, RecvHook, wait_error
from ..handle import EPHandle
from ..layout import SIGNATURE_LEN

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn); 2.11 has only those.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# What a synchronous call returns: nothing to wait for (stateless once complete, so one object serves all).
DONE = EventOverlap()

# What ranks can be running; a call's signature starts with its index (ranks on different operations disagree):
# dispatch and combine, then the primitives (whose agreement runs on the host: `moe_comm.primitives`).
OPERATIONS = ("dispatch", "cached dispatch", "combine", "pp_set_config", "all_gather", "reduce_scatter",
              "engram_write", "engram_fetch")
# The operation word of a rank that refused its arguments, in place of its signature (`Backend.check_agreement`).
REFUSED = -1
# The last word of a signature, in the host agreement: 1 where that rank has no async call left on a side stream.
_QUIET_WORD = SIGNATURE_LEN - 1
# The words of a call's signature per operation (`DispatchCall.signature`, `CombineCall.signature`), the operation
# first and the handle's epoch second (0 for a fresh dispatch); codes of the fields that name a choice. The CUDA
# backend fills a combine's "slots per round" (its receive region's layout, `CudaTuning.max_round_slots`); the
# reference leaves it 0. "partial sums": an expand combine's rows added per rank before they travel (`Buffer`'s
# `deterministic` and `allow_multiple_reduction`).
_DISPATCH_FIELDS = ("operation", "handle epoch", "num_experts", "num_topk", "hidden", "row dtype", "fp8 format",
                    "dequantize", "topk_weights given", "topk_weights dtype", "num_max_tokens_per_rank", "do_expand",
                    "expert_alignment", "do_cpu_sync")
# The primitives' signatures carry a tensor's dtype (its index in TORCH_DTYPES: they take any), number of dimensions
# and sizes, zero-padded (`tensor_words`): MAX_TENSOR_DIMS for an all_gather / reduce_scatter tensor, MAX_ROW_DIMS
# for the rows of an Engram table. Words past a signature's fields may differ (an Engram table's row count, a fetch's
# first bad index).
MAX_ROW_DIMS = 4
MAX_TENSOR_DIMS = MAX_ROW_DIMS + 1
TORCH_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
_TENSOR_FIELDS = ("operation", "dtype", "dims", *(f"shape[{i}]" for i in range(MAX_TENSOR_DIMS)))
SIGNATURE_FIELDS = {"dispatch": _DISPATCH_FIELDS, "cached dispatch": _DISPATCH_FIELDS,
                    "combine": ("operation", "handle epoch", "hidden", "row dtype", "topk_weights given",
                                "topk_weights dtype", "slots per round", "partial sums"),
                    "pp_set_config": ("operation", "num_max_tensor_bytes", "num_max_inflight_tensors"),
                    "all_gather": _TENSOR_FIELDS, "reduce_scatter": _TENSOR_FIELDS,
                    "engram_write": ("operation", "table row dtype", "table row dims",
                                     *(f"table row shape[{i}]" for i in range(MAX_ROW_DIMS))),
                    "engram_fetch": ("operation",)}
DTYPE_CODES = {getattr(torch, name): code for name, code in lay.DTYPE_CODES.items()}
_DTYPE_NAMES = ("none", *lay.DTYPE_CODES)  # a signature's dtype code names itself by its index
_TORCH_DTYPE_NAMES = tuple(str(dtype).removeprefix("torch.") for dtype in TORCH_DTYPES)
_CHOICES = {"operation": OPERATIONS, "row dtype": _DTYPE_NAMES, "topk_weights dtype": _DTYPE_NAMES,
            "fp8 format": ("none", *quant.FP8_FORMATS), "dtype": _TORCH_DTYPE_NAMES,
            "table row dtype": _TORCH_DTYPE_NAMES}


class Backend:
    """Base of the backends behind `moe_comm.Buffer`: stream control, agreement and value checks.

    Arguments:
        group: the process group.
        device: the group's device (CPU for gloo, the current CUDA device for NCCL).
        num_cpu_timeout_secs: how long a host wait for a peer may block before raising.
    """

    name = "base"
    # Check that all ranks agree on every call's signature on the host (where calls are host-synchronous anyway);
    # otherwise only when the Buffer asks (a synchronizing call, MOE_COMM_CHECK_INPUTS=1) or on the device.
    checks_every_call = False
    # Whether calls take `return_recv_hook=True` (not the hybrid paths: their legs run one after another).
    supports_recv_hook = True
    # Steps written with torch ops (the reference, the hybrid paths) run with autograd off: their outputs would carry
    # history otherwise, of the rows this rank kept only. The CUDA backend's outputs come from its kernels.
    steps_use_torch_ops = True

    def __init__(self, group: dist.ProcessGroup, device: torch.device, num_cpu_timeout_secs: float) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.device = device
        self.timeout_secs = num_cpu_timeout_secs
        self.comm_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # Side streams (the comm stream; the pipeline's per neighbour and direction) on which an async call ran since
        # the last synchronous call that uses that stream's resources.
        self._busy_streams: set[torch.cuda.Stream] = set()
        # Fresh dispatches counted alike on every rank (those the ranks agreed on; on the CUDA backend also those that
        # raised after their kernels ran everywhere): the epoch of the next handle is one more. Ranks that call alike
        # hold handles of the same epoch, so a combine or cached dispatch checks the handle across ranks. The count
        # starts at this buffer's own base (`start_epochs`).
        self.epoch_base = self.epoch = self.serial = 0
        # Why the group can no longer be used (a wait that failed: peers gone or out of step), else None.
        self.broken: Optional[str] = None
        # Error flags seen by dispatches without a CPU sync, per source rank; raised by the next sync.
        self.pending_flags = torch.zeros(self.num_ranks, dtype=torch.int64, device=device)
        # The hook of a call with `return_recv_hook=True` until it is called: no dispatch, combine or barrier may
        # run before it (`Buffer._check_ready`; the primitives do not touch the receive region).
        self.pending_hook: Optional[RecvHook] = None

    # ------------------------------------------------------------------------------------------------
    # Entry points (Buffer calls these with validated calls)
    # ------------------------------------------------------------------------------------------------
    def dispatch(self, c, agreed: bool) -> tuple:
        """Run a validated `DispatchCall` (see `moe_comm.buffer`). `agreed`: the ranks' agreement on its sizes was
        checked on the host before (`Buffer._validated`); otherwise a backend checks where it can (the reference
        backend's dispatch with a CPU sync; the CUDA backend's barrier, on the device)."""
        self.after_host_sync()
        inputs = [t for t in (c.x, c.fp8_q, c.fp8_scales, c.topk_idx, c.topk_weights) if t is not None] \
            if c.async_with_compute_stream else ()
        outputs, event, hook = self.run(lambda: self.dispatch_steps(c, agreed), c.previous_event,
                                        c.async_with_compute_stream, inputs, c.return_recv_hook, handle=c.handle)
        recv_x, recv_topk_idx, recv_topk_weights, handle = outputs
        return (recv_x, recv_topk_idx, recv_topk_weights, handle, event) + (() if hook is None else (hook,))

    def dispatch_steps(self, c, agreed: bool):
        """The dispatch itself, inside the stream scope of `run`: `(outputs, works, finalizers)`; `agreed` as in
        `dispatch`."""
        raise NotImplementedError

    def combine_steps(self, c):
        """The combine itself, inside the stream scope of `run`: `(outputs, works, finalizers)`."""
        raise NotImplementedError

    def combine(self, c) -> tuple:
        """Run a validated `CombineCall` (see `moe_comm.buffer`; the ranks' agreement on its sizes is checked on the
        host before it where every call's is, else by the CUDA backend's barrier on the device)."""
        self.after_host_sync()
        inputs = [t for t in (c.x, c.topk_weights, *c.bias) if t is not None] if c.async_with_compute_stream else ()
        outputs, event, hook = self.run(lambda: self.combine_steps(c), c.previous_event, c.async_with_compute_stream,
                                        inputs, c.return_recv_hook, handle=c.handle)
        combined_x, combined_w = outputs
        return (combined_x, combined_w, event) + (() if hook is None else (hook,))

    # ------------------------------------------------------------------------------------------------
    # Streams, checks
    # ------------------------------------------------------------------------------------------------
    def start_epochs(self, serial: int) -> None:
        """Number handles from the base of this buffer's `serial` on its group (agreed by every rank at
        construction): a rank using one buffer's handle where its peer uses another buffer's differs in the epoch.
        The serial also keeps the buffer's gloo messages apart from other buffers' (`PP_TAG`)."""
        _BUFFERS_MADE[_group_name(self.group)] = serial + 1
        self.serial = serial % NUM_BUFFER_SERIALS
        self.epoch_base = self.epoch = self.serial << EPOCH_BASE_SHIFT

    def close(self) -> None:
        """Release what the backend holds."""

    def after_host_sync(self, synchronized: bool = False) -> None:
        """Called at the start of every call and after host reads of device values (`synchronized`: at a point
        where every earlier operation of this rank is complete and every rank reaches the same point). Refuses
        work once a wait has failed; a transport that records errors on the device raises them here too."""
        if self.broken is not None:
            raise RuntimeError(f"moe_comm: this buffer's process group is broken since an earlier error ({self.broken})"
                               f"; its peers are gone or out of step: create a new process group and Buffer")

    def mark_broken(self, why: str) -> None:
        """Remember the first failed wait: every later call raises with it (`after_host_sync`)."""
        if self.broken is None:
            self.broken = why

    def check_no_pending_hook(self, what: str) -> None:
        if self.pending_hook is not None:
            raise RuntimeError(f"moe_comm: a {what} was called while the receive hook of an earlier call with "
                               f"return_recv_hook=True on this buffer had not run: call that hook first (its rows "
                               f"are still in the receive region, which this {what} would overwrite or realign)")

    def _wait(self, works: list[tuple[object, str]]) -> None:
        """Block until `works` are done (CPU), or make the current stream wait for them (CUDA)."""
        if self.comm_stream is None:
            EventOverlap(works=works, timeout_secs=self.timeout_secs, on_fault=self.mark_broken).current_stream_wait()
            return
        for work, _ in works:
            work.wait()

    def run(self, body: Callable[[], tuple], previous_event: Optional[EventOverlap],
            async_with_compute_stream: bool, inputs: Sequence[torch.Tensor], return_recv_hook: bool = False,
            side_stream: Optional[torch.cuda.Stream] = None, handle: Optional[EPHandle] = None):
        """Stream control around one operation.

        `body` returns `(outputs, works, finalizers)`: outputs are allocated, works are the data exchange in
        flight, finalizers fill the outputs once the works are done (the CUDA backend's: the receivers' launch
        of a call with a hook). Returns `(outputs, event, hook)`, hook None unless `return_recv_hook`: then the
        works and finalizers are left to it.
        On CUDA a synchronous call runs on the current stream (stream-ordered, nothing to hand over between
        streams); an async call runs on the comm stream, ordered after the current stream, and the outputs are
        recorded for the current stream. The host never waits for the device here.
        `side_stream` (CUDA): the stream of an async call instead of the comm stream, for operations whose memory
        and flags no other operation uses (the pipeline's transfers per neighbour and direction, which would
        otherwise queue behind each other: a receive posted first would hold back the send it waits for; their
        waits share only the error record and end only on a timeout).
        `handle`: the handle a combine or cached dispatch reads. An async call's event keeps it alive until waited:
        its tensors were made on another stream and the kernels read them through raw pointers (recording each of
        them for the comm stream would cost host time on every call).
        """
        if self.steps_use_torch_ops and torch.is_grad_enabled():  # no autograd history (`moe_comm.autograd` has it)
            with torch.no_grad():
                return self.run(body, previous_event, async_with_compute_stream, inputs, return_recv_hook,
                                side_stream, handle)
        side = self.comm_stream if side_stream is None else side_stream
        # An async call's stream waits for `previous_event` on the device, the current stream goes on (as DeepEP's
        # comm stream does); elsewhere (a call on the current stream, or the CPU path's works) the caller waits.
        event_on_side = async_with_compute_stream and self.comm_stream is not None and previous_event is not None \
            and previous_event.on_device_only
        if previous_event is not None and not event_on_side:
            previous_event.current_stream_wait()
        if side in self._busy_streams and not async_with_compute_stream:
            # An async call may still be using this stream's resources.
            torch.cuda.current_stream(self.device).wait_stream(side)
            self._busy_streams.discard(side)
        if return_recv_hook:
            outputs, works, finalizers = body()
            if self.comm_stream is None:
                keep_until_done(self.group, [work for work, _ in works])

            def receive(backend: "Backend") -> None:  # not `self`: the hook holds the backend weakly
                backend._wait(works)
                with torch.no_grad():  # outputs may already be autograd outputs
                    for finalize in finalizers:
                        finalize()

            if self.comm_stream is None:
                self.pending_hook = RecvHook(self, receive, None)
            else:
                index = self.device.index
                self.pending_hook = RecvHook(self, receive, torch._C._cuda_getCurrentRawStream(index), index,
                                             _flatten_tensors(outputs))
            return outputs, DONE, self.pending_hook
        if self.comm_stream is None:
            keep_until_done(self.group, [])  # let go of what completed since
            outputs, works, finalizers = body()
            event = EventOverlap(works=works, finalizers=finalizers, timeout_secs=self.timeout_secs,
                                 on_fault=self.mark_broken)
            if not async_with_compute_stream:
                event.current_stream_wait()
            else:
                keep_until_done(self.group, [work for work, _ in works])
            return outputs, event, None
        if not async_with_compute_stream:
            outputs, works, finalizers = body()
            self._wait(works)
            for finalize in finalizers:
                finalize()
            return outputs, DONE, None
        compute_stream = torch.cuda.current_stream(self.device)
        side.wait_stream(compute_stream)
        keep_alive = tuple(inputs) if handle is None else (*inputs, handle)
        if event_on_side:
            side.wait_event(previous_event.event)
            # A caller that hands an event on as previous_event may drop it unwaited: what it kept alive (a handle
            # the earlier call's kernels read) must outlive this call's work, which the new event orders after it
            # (unless done already: a chain of calls then holds only what is still in flight).
            if not previous_event.event.query():
                keep_alive += previous_event._extra_tensors
        # Before the body: a body that raises after its kernels were queued (an allocation failure) still leaves the
        # inputs held for the comm stream and the stream marked busy for the next synchronous call.
        self._busy_streams.add(side)
        for t in inputs:
            t.record_stream(side)
        with torch.cuda.stream(side):
            outputs, works, finalizers = body()
            self._wait(works)
            for finalize in finalizers:
                finalize()
        for t in _flatten_tensors(outputs):
            t.record_stream(compute_stream)
        cuda_event = torch.cuda.Event()
        cuda_event.record(side)
        return outputs, EventOverlap(event=cuda_event, extra_tensors=keep_alive), None

    # ------------------------------------------------------------------------------------------------
    # Value checks
    # ------------------------------------------------------------------------------------------------
    @staticmethod
    def sanitize_topk_idx(topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Drop invalid slots to -1 and return `(clean_idx, flags)`; flags is a 0-d int64 tensor."""
        out_of_range = (topk_idx < -1) | (topk_idx >= num_experts)
        valid = (topk_idx >= 0) & ~out_of_range
        # A slot repeating an expert of an earlier slot of its row is a duplicate.
        same = (topk_idx.unsqueeze(2) == topk_idx.unsqueeze(1)) & valid.unsqueeze(2) & valid.unsqueeze(1)
        duplicate = torch.tril(same, diagonal=-1).any(dim=2)
        clean = torch.where(out_of_range | duplicate, torch.full_like(topk_idx, -1), topk_idx)
        flags = out_of_range.any().to(torch.int64) * lay.ROUTING_OUT_OF_RANGE + \
            duplicate.any().to(torch.int64) * lay.ROUTING_DUPLICATE
        return clean, flags

    @staticmethod
    def describe_bad_topk(topk_idx: torch.Tensor, num_experts: int) -> str:
        """Host-side detail of this rank's first invalid slot (error path only)."""
        clean, _ = Backend.sanitize_topk_idx(topk_idx, num_experts)
        bad = (clean != topk_idx).nonzero()
        if bad.numel() == 0:
            return ""
        t, j = bad[0].tolist()
        row = topk_idx[t].tolist()
        return f"first bad slot: topk_idx[{t}, {j}]={row[j]} in row {row}"

    def raise_for_flags(self, flags_per_rank: list[int], topk_idx: Optional[torch.Tensor], num_experts: int,
                        what: str) -> None:
        """Raise a ValueError naming each problem and the ranks that have it (`num_experts` -1: not known, for
        slots dropped by an earlier dispatch)."""
        if not any(flags_per_rank):
            return
        problems = []
        out_of_range = f"entries outside [-1, {num_experts})" if num_experts > 0 else "out-of-range entries"
        for bit, text in ((lay.ROUTING_OUT_OF_RANGE, out_of_range),
                          (lay.ROUTING_DUPLICATE, "duplicate experts in a row")):
            ranks = [r for r, f in enumerate(flags_per_rank) if f & bit]
            if ranks:
                problems.append(f"{text} on rank(s) {ranks}")
        detail = ""
        if topk_idx is not None and flags_per_rank[self.rank]:
            detail = "; " + self.describe_bad_topk(topk_idx, num_experts)
        raise ValueError(f"topk_idx is invalid{what}: " + ", ".join(problems) + detail)

    def check_inputs_up_front(self, topk_idx: torch.Tensor, num_experts: int) -> None:
        """MOE_COMM_CHECK_INPUTS=1: agree on every rank's flags before any data moves, then raise everywhere."""
        _, flags = self.sanitize_topk_idx(topk_idx, num_experts)
        flags_per_rank = torch.zeros(self.num_ranks, dtype=torch.int64, device=self.device)
        flags_per_rank[self.rank] = flags
        work = dist.all_reduce(flags_per_rank, group=self.group, async_op=True)
        self._wait([(work, f"rank {self.rank} input check all-reduce")])
        flags = flags_per_rank.tolist()
        # Not a synchronizing point for recorded disagreements: an async call may still run on the comm stream.
        self.after_host_sync()
        self.raise_for_flags(flags, topk_idx, num_experts, "")

    def check_call(self, what: str, c):
        """This backend's own checks of a validated call of `what` ("dispatch", "combine") that need no device values
        (ValueError), run by `Buffer` while validating; returns what the call's steps may reuse (`c.plan`), here
        None."""
        return None

    def refuse(self, what: str, previous_event: Optional[EventOverlap]) -> None:
        """This rank refused its arguments to `what` ("dispatch" or "combine") where the ranks' agreement is not
        checked on the host (`Buffer._validated`), and raises next; its peers called it (after `previous_event`, if
        the call named a valid one). A backend that checks agreement on the device takes part there with a refusal
        (the CUDA backend); elsewhere nothing: the peers end in the timeout of a rank that did not call."""

    def check_agreement(self, signature: list[int], refused: bool = False) -> list[list[int]]:
        """Raise ValueError on every rank if the ranks called different operations or one with different values
        (`SIGNATURE_FIELDS`); else return every rank's signature.

        Exchange sizes follow these values, so ranks that disagree would otherwise crash or corrupt rows. Every
        signature has `SIGNATURE_LEN` words, so this exchange itself always matches, whatever each rank called (the
        first exchange of every call that exchanges on the host). Costs one small exchange and a host sync. A rank
        that refused its arguments (`refused`; `signature` then holds the operation alone) takes part with a
        refusal and returns (to raise its own error); the others raise a ValueError naming it.
        """
        self.after_host_sync()  # first of all: a buffer whose group broke refuses work
        phase = f"{OPERATIONS[signature[0]]} argument agreement"
        words = padded_signature([REFUSED]) if refused else list(signature)
        # Once the exchange is done every earlier operation of this rank is complete, unless an async one may still
        # run on a side stream: a synchronizing point (where ranks raise what their kernels recorded) only if it is
        # one on every rank, else one rank would raise alone while its peers go on to their next exchange.
        words[_QUIET_WORD] = int(not self._busy_streams)
        rows = self.gather_values(torch.tensor(words, dtype=torch.int64, device=self.device), phase).tolist()
        self.after_host_sync(synchronized=all(row[_QUIET_WORD] for row in rows))
        if refused:
            return rows
        problem = disagreement(rows)
        if problem:
            raise ValueError(problem)
        return rows

    # ------------------------------------------------------------------------------------------------
    # Transport (the reference backend's, and the primitives of `torch_primitives`)
    # ------------------------------------------------------------------------------------------------
    def _exchange(self, send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], phase: str,
                  peers: Optional[Sequence[int]] = None) -> tuple[torch.Tensor, list[tuple[object, str]]]:
        """All-to-all-v of row blocks: `send`'s block p (rows from `exclusive_cumsum(send_splits)[p]`) goes to
        rank `peers[p]`; that rank's block lands at `exclusive_cumsum(recv_splits)[p]` of the returned `recv`.

        `peers` are ranks of the group, this rank among them (default: every rank, in order). `send` may have
        trailing rows past its blocks.
        Returns `(recv, works)`: the works in flight, described by rank, phase and peer for timeout errors.
        Zero-row blocks are skipped on both sides (both know the size).
        """
        peers = range(self.num_ranks) if peers is None else peers
        recv = send.new_empty(sum(recv_splits), *send.shape[1:])
        send_offsets, recv_offsets = exclusive_cumsum(send_splits), exclusive_cumsum(recv_splits)
        me = self.rank
        ops, descriptions = [], []
        for p, peer in enumerate(peers):
            if peer == me:
                recv[recv_offsets[p]:recv_offsets[p] + recv_splits[p]] = \
                    send[send_offsets[p]:send_offsets[p] + send_splits[p]]
                continue
            global_peer = dist.get_global_rank(self.group, peer)
            if recv_splits[p]:
                block = recv[recv_offsets[p]:recv_offsets[p] + recv_splits[p]]
                ops.append(dist.P2POp(dist.irecv, block, global_peer, self.group))
                descriptions.append(f"rank {me} {phase}: receive from peer {peer}")
            if send_splits[p]:
                block = send[send_offsets[p]:send_offsets[p] + send_splits[p]]
                ops.append(dist.P2POp(dist.isend, block, global_peer, self.group))
                descriptions.append(f"rank {me} {phase}: send to peer {peer}")
        try:
            works = dist.batch_isend_irecv(ops) if ops else []
        except RuntimeError as exc:  # gloo: a peer's connection closed before the exchange was posted
            others = [p for p in peers if p != me]
            who = f"peer {others[0]}" if len(others) == 1 else f"one of peers {others}"
            error = wait_error(f"rank {me} {phase}: posting the exchange", self.timeout_secs, 0.0, exc, who)
            self.mark_broken(str(error))
            raise error from exc
        return recv, list(zip(works, descriptions))

    def gather_values(self, mine: torch.Tensor, phase: str) -> torch.Tensor:
        """Every rank's `mine` (1-D int64, same length everywhere) as `[R, n]`, stream-ordered; a peer that does
        not arrive ends in a TimeoutError naming rank, phase and peer where the backend can."""
        raise NotImplementedError

    def check_pending_errors(self) -> None:
        """Raise (on every rank alike) for invalid slots that an earlier dispatch without CPU sync dropped."""
        flags = self.pending_flags.tolist()
        if any(flags):
            self.pending_flags.zero_()
            self.raise_for_flags(flags, None, -1, " in an earlier dispatch without CPU sync (slots dropped)")

    @staticmethod
    def _wire(c) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """`(rows, scales or None)` as they travel: x, or FP8 rows (`torch.float8_e4m3fn`) and their scales (cast here
        for `quantize=`)."""
        if c.wire_format is None:
            return c.x, None
        return quant.quantize(c.x, c.quantize) if c.quantize is not None else (c.fp8_q, c.fp8_scales)

    def _wire_tensors(self, c) -> dict[str, torch.Tensor]:
        """The per-token data as it travels, by field: x, or FP8 bytes and scales."""
        rows, scales = self._wire(c)
        return {"x": rows} if scales is None else {"q": rows.view(torch.uint8), "scales": scales}


def exclusive_cumsum(values: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for v in values:
        out.append(acc)
        acc += v
    return out


def subgroup_of(group: dist.ProcessGroup, device: torch.device, partition: Sequence[Sequence[int]],
                timeout_secs: float) -> dist.ProcessGroup:
    """This rank's part of `partition` (lists of ranks of `group` covering it) as a new process group, with `group`'s
    backend, its NCCL traffic class and `timeout_secs`. Collective over `group`. Where the default group's
    communicators are made eagerly (`init_process_group(device_id=...)`) NCCL splits them, which every rank of the
    parent must join: `split_group` over `group`; else each rank makes its subgroup with its members only."""
    timeout = datetime.timedelta(seconds=timeout_secs)
    options = traffic_class.subgroup_options(group, device)
    if device.type == "cuda" and dist.group.WORLD.bound_device_id is not None:
        return dist.split_group(group, [list(part) for part in partition], timeout=timeout, pg_options=options)
    me = dist.get_rank(group)
    (members,) = [part for part in partition if me in part]
    return dist.new_group([dist.get_global_rank(group, r) for r in members], timeout=timeout,
                          backend=dist.get_backend(group), pg_options=options, use_local_synchronization=True)


# Per gloo process group: point-to-point works handed out unwaited (async events, receive hooks, Engram fetches,
# pipeline sends) and not yet seen complete. A receive whose work is freed before its data came stalls gloo's
# connection with that peer (its data has nowhere to go), and every later message between the two ranks waits behind
# it: dropping one of those must not free them. (Waited works are not held: a held work keeps the group's connections
# open after `destroy_process_group`, where a peer should see them close.)
_IN_FLIGHT: dict[dist.ProcessGroup, list] = {}


def keep_until_done(group: dist.ProcessGroup, works: Sequence) -> None:
    """Hold `works` until they complete (checked whenever more are posted on `group`)."""
    pending = [work for work in (*_IN_FLIGHT.pop(group, ()), *works) if not work.is_completed()]
    if pending:
        _IN_FLIGHT[group] = pending


def group_is_live(group: dist.ProcessGroup) -> bool:
    """Whether `group` is still registered with torch.distributed (not destroyed by `destroy_process_group`)."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):  # KeyError: not registered any more
        return False
    return True


def forget_dead_groups(cache: dict) -> list:
    """Remove from `cache` the entries whose key is, or starts with, a process group that was destroyed, so that a
    process that makes its groups anew does not keep them through the cache; returns their values. (Subgroups made
    from such a group stay registered with torch until the default group is destroyed.)"""
    dead = [key for key in cache if not group_is_live(key[0] if isinstance(key, tuple) else key)]
    return [cache.pop(key) for key in dead]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What sums of rows of `dtype` accumulate in (DESIGN 2.2): float64 for float64 rows, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# Buffers made per process group (keyed by its name), and where a buffer's serial sits in its handles' epochs:
# above any count of one buffer (the CUDA backend's realigned counts stay below 2**48); serials wrap at 2**14.
_BUFFERS_MADE: dict[str, int] = {}
EPOCH_BASE_SHIFT = 49
NUM_BUFFER_SERIALS = 1 << 14
# Tags of gloo point-to-point messages beside the exchanges' (tag 0; gloo's collectives have slots of their own): a
# construction's arrival words (`Buffer._arrive`: a peer that calls an existing buffer instead of constructing cannot
# pair its rows with one), and from PP_TAG on, a buffer's pipeline, two tags per serial.
ARRIVAL_TAG = 0x6D6F65
PP_TAG = 0x6D7000


def _group_name(group: Optional[dist.ProcessGroup]) -> str:
    return (group if group is not None else dist.group.WORLD).group_name


def buffer_serial(group: Optional[dist.ProcessGroup]) -> int:
    """This rank's serial for the next buffer on `group` (its count of those made there); `Buffer` agrees on the
    largest of the ranks' (counts can differ after a group name is reused, or in a restarted process)."""
    return _BUFFERS_MADE.get(_group_name(group), 0)


def padded_signature(values: list[int]) -> list[int]:
    """A call's signature as the `SIGNATURE_LEN` words that travel (zero-padded; the last is the host agreement's)."""
    assert len(values) <= _QUIET_WORD, values
    return values + [0] * (SIGNATURE_LEN - len(values))


def tensor_words(max_dims: int, dtype: torch.dtype, shape: Sequence[int]) -> list[int]:
    """A tensor's dtype (its index in TORCH_DTYPES), number of dimensions and sizes zero-padded to `max_dims`: how
    the primitives' signatures carry a tensor that sizes their exchanges."""
    return [TORCH_DTYPES.index(dtype), len(shape), *shape, *[0] * (max_dims - len(shape))]


def disagreement(rows: Sequence[Sequence[int]]) -> Optional[str]:
    """What differs between every rank's signature (`rows`, one per rank), or None when all agree. The message
    names each field with every rank's value."""

    def show(name: str, value: int):
        choices = _CHOICES.get(name)
        return choices[value] if choices is not None and 0 <= value < len(choices) else value

    refused = [r for r, row in enumerate(rows) if row[0] == REFUSED]
    if refused and len(refused) < len(rows):
        what = show("operation", next(row[0] for row in rows if row[0] != REFUSED))
        return f"{what}: rank(s) {refused} refused their arguments (their error says why)"
    if len({row[0] for row in rows}) > 1:
        return f"ranks called different operations (per rank): {[show('operation', row[0]) for row in rows]}"
    if not 0 <= rows[0][0] < len(OPERATIONS):
        return f"ranks' signatures name no known operation (per rank): {[list(row) for row in rows]}"
    what = OPERATIONS[rows[0][0]]
    differing = [f"{name}: {[show(name, row[i]) for row in rows]}" for i, name in enumerate(SIGNATURE_FIELDS[what])
                 if len({row[i] for row in rows}) > 1]
    if not differing:
        return None
    return f"ranks called {what} with different arguments (per rank): " + "; ".join(differing)


def _flatten_tensors(outputs) -> list[torch.Tensor]:
    """Every tensor in `outputs`, including those inside tuples and a handle (they cross streams too)."""
    flat = []
    for o in outputs:
        if isinstance(o, torch.Tensor):
            flat.append(o)
        elif isinstance(o, (tuple, list)):
            flat.extend(_flatten_tensors(o))
        elif isinstance(o, EPHandle):
            flat.extend(_flatten_tensors([getattr(o, f) for f in o.__dataclass_fields__ if f != "layout"]))
            flat.extend(_flatten_tensors([getattr(o.layout, f) for f in o.layout.__dataclass_fields__]))
    return flat
