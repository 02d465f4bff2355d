"""Buffer: the public object. It validates every argument, fills defaults, and hands a `DispatchCall` or
`CombineCall` to a backend. It never touches raw pointers. (Over 400 lines: the API reference lives in its
docstrings, and every argument of dispatch and combine is checked here, before any communication.)

Shape legend: N = this rank's tokens, K = top-k slots, H = hidden, R = ranks, L = local experts
(`num_experts // R`), P = rows of the dispatch output.
"""

from __future__ import annotations

import datetime
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from . import domains, env, layout, quant, sizing, traffic_class
from .args import check_bool, check_group, check_int
from .backends import cuda as cuda_backend
from .backends.cuda_primitives import CudaPrimitives
from .backends.common import ARRIVAL_TAG, DTYPE_CODES, OPERATIONS, buffer_serial, group_is_live, padded_signature
from .backends.hybrid import HybridBackend, leg_groups
from .backends.torch_hybrid import HybridRefBackend
from .backends.torch_primitives import TorchPrimitives
from .backends.torch_ref import TorchRefBackend
from .event import EventOverlap
from .handle import EPHandle
from .primitives import PrimitivesMixin

BACKENDS = ("auto", "torch", "cuda")
DATA_DTYPES = (torch.bfloat16, torch.float32, torch.float64)
MAX_EXPERT_ALIGNMENT = 1024
MAX_TIMEOUT_SECS = 7 * 24 * 3600  # a week: beyond it a timeout is a hang (and timedelta/uint64 ns overflow)

FP8Tuple = tuple[torch.Tensor, torch.Tensor]


# Not frozen: a frozen dataclass sets each field through object.__setattr__, ~1 us per call of host time here.
@dataclass(slots=True)
class DispatchCall:
    """A validated dispatch, as the backends receive it (read-only by convention)."""

    x: Optional[torch.Tensor]          # [N, H] bf16/fp32/fp64, None for a pre-quantized tuple
    fp8_q: Optional[torch.Tensor]      # [N, H] float8_e4m3fn of a pre-quantized tuple
    fp8_scales: Optional[torch.Tensor]  # [N, H/128] float32 or int32 of a pre-quantized tuple
    wire_format: Optional[str]         # FP8 format on the wire, None for unquantized rows
    quantize: Optional[str]
    dequantize: bool
    topk_idx: Optional[torch.Tensor]   # [N, K] int64, None for a cached dispatch
    topk_weights: Optional[torch.Tensor]
    num_experts: int
    num_topk: int
    num_tokens: int
    hidden: int
    num_max_tokens_per_rank: int
    expert_alignment: int
    num_sms: int
    handle: Optional[EPHandle]
    do_cpu_sync: bool
    do_expand: bool
    previous_event: Optional[EventOverlap]
    async_with_compute_stream: bool
    allocate_on_comm_stream: bool
    return_recv_hook: bool = False
    plan: Any = None  # the backend's launch plan, made while validating (`Backend.check_call`)

    def signature(self) -> list[int]:
        """The values every rank must agree on (they size the exchanges): `SIGNATURE_FIELDS["dispatch"]`, padded."""
        w = self.topk_weights
        return padded_signature([
            OPERATIONS.index("dispatch" if self.handle is None else "cached dispatch"),
            0 if self.handle is None else self.handle.epoch, self.num_experts, self.num_topk, self.hidden,
            DTYPE_CODES[self.x.dtype] if self.x is not None else 0,
            0 if self.wire_format is None else layout.FP8_CODES[self.wire_format], int(self.dequantize),
            int(w is not None), DTYPE_CODES[w.dtype] if w is not None else 0, self.num_max_tokens_per_rank,
            int(self.do_expand), self.expert_alignment, int(self.do_cpu_sync)])


@dataclass(slots=True)
class CombineCall:
    """A validated combine, as the backends receive it (read-only by convention)."""

    x: torch.Tensor                    # [P, H]
    handle: EPHandle
    topk_weights: Optional[torch.Tensor]  # [P, K], or [P] in expand mode
    bias: tuple[torch.Tensor, ...]     # zero, one or two [N, H] tensors of x's dtype
    num_sms: int
    previous_event: Optional[EventOverlap]
    async_with_compute_stream: bool
    allocate_on_comm_stream: bool
    # Each token's rows unsummed, `[N, T, H]` (T = ranks, expand: slots; absent terms unspecified) instead of the sum:
    # the hybrid path's deterministic combine asks its inner buffer for them (never set by `Buffer.combine`).
    unreduced: bool = False
    return_recv_hook: bool = False
    # Expand layout: each rank first adds the rows of a token's slots it holds (one partial sum per (token, rank)
    # goes back), then the source adds the partial sums in ascending rank order (`Buffer._expand_partial_sums`).
    partial: bool = False
    plan: Any = None  # as DispatchCall's

    def signature(self) -> list[int]:
        """The values every rank must agree on (they size the exchange): `SIGNATURE_FIELDS["combine"]`, padded
        (the CUDA backend fills "slots per round")."""
        w = self.topk_weights
        return padded_signature([OPERATIONS.index("combine"), self.handle.epoch, self.x.shape[1],
                                 DTYPE_CODES[self.x.dtype], int(w is not None),
                                 DTYPE_CODES[w.dtype] if w is not None else 0, 0, int(self.partial)])


class Buffer(PrimitivesMixin):
    """Expert-parallel dispatch and combine over one process group.

    Making one is collective: every rank of the group makes its buffer at the same point (a rank that cannot, for
    lack of memory say, makes every rank raise the same error).

    Arguments:
        group: the expert-parallel process group (None: the default group). gloo runs on CPU tensors,
            NCCL on the current CUDA device.
        num_max_tokens_per_rank: most tokens any rank dispatches in one call (sizing maximum).
        hidden: largest hidden size of a call, counted in bf16 elements (sizing maximum; a float32 or float64
            call needs 2x or 4x the bytes).
        num_topk: largest top-k of a call (sizing maximum).
        use_fp8_dispatch: reserve room for FP8 rows with scales.
        backend: "torch" (reference, any group), "cuda" (NVLink kernels; across hosts the hybrid path of
            `moe_comm.backends.hybrid`: the kernels inside each host, NCCL between hosts) or "auto" (cuda where the
            ranks of each host reach each other by peer access and the kernels can be built or loaded, else torch
            with one warning saying why; every rank takes the same choice).
        deterministic: receive order and combine reduction order exactly as DESIGN 2.1/2.2 specify.
        num_gpu_timeout_secs: how long a GPU wait for a peer may spin before failing (CUDA backend kernels; also
            NCCL's timeout on the CUDA hybrid path's subgroups; the reference backend on NCCL relies on the process
            group's own timeout).
        num_cpu_timeout_secs: how long a host wait for a peer may block before failing.
        allow_hybrid_mode: with more than one scale-up domain (hosts, see `get_physical_domain_size`), run the
            hybrid path: a token crosses between hosts once per destination host, to the rank of the same local
            index there, and fans out inside the host. False: the direct path (every rank to every rank), which
            only the reference backend can run across hosts.
        allow_multiple_reduction: without `deterministic`, let a combine add a token's rows in groups before they
            travel, in FP32 (FP64 for float64 rows), so the result is within FP32 rounding of DESIGN 2.2's order:
            an expand combine on the direct path (top-k at most 32) adds the rows of a token's slots on each rank
            (ascending slot, from zero; one partial sum per (token, rank) goes back, in FP32, or the row itself when
            the rank holds one slot: half the bytes of a token's bf16 rows once it holds 4 slots, and always one
            round), then the source adds the partial sums in ascending rank order from zero; this order is fixed,
            so results are still bitwise the same run to run and on both backends. A hybrid combine adds a token's
            rows inside each host before they cross (one row per host crosses). With `deterministic=True` or False
            here, rows travel unreduced and the source adds them in the order of DESIGN 2.2 (bitwise the direct
            path's).
        sl_idx: the InfiniBand service level (0 to 15) for the traffic between hosts, as DeepEP V2's; None (the
            default) leaves NCCL's setting alone. moe_comm does not choose it (the reference sends over the caller's
            group; the CUDA hybrid path's subgroups copy that group's traffic class), so on NCCL the buffer checks
            that NCCL will use this level (`NCCL_IB_SL`, else the group's
            `ProcessGroupNCCL.Options().config.traffic_class`) and raises ValueError on every rank if not
            (`moe_comm/traffic_class.py`). gloo has no service level: there it is only validated.
        use_recv_hook: reserve room for an expand combine in DESIGN 2.2's slot order in one round (with
            `deterministic=True` or `allow_multiple_reduction=False`), which `combine(..., return_recv_hook=True)`
            needs (its rounds cannot be split at the hook): a row per (peer, token, slot). Dispatches, non-expand
            combines and expand combines with partial sums (one round always) take the hook with any buffer.
        cuda_tuning: `moe_comm.backends.cuda.CudaTuning`, kernel build variants and block splits for experiments
            (`scripts/profile_ops.py`); None: the defaults.
    """

    @torch.compiler.disable
    def __init__(self, group: Optional[dist.ProcessGroup] = None, num_max_tokens_per_rank: int = 4096,
                 hidden: int = 7168, num_topk: int = 8, use_fp8_dispatch: bool = False, backend: str = "auto",
                 deterministic: bool = False, num_gpu_timeout_secs: float = 100,
                 num_cpu_timeout_secs: float = 300, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, sl_idx: Optional[int] = None, *, use_recv_hook: bool = False,
                 cuda_tuning: Optional[cuda_backend.CudaTuning] = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("moe_comm.Buffer needs torch.distributed to be initialized "
                               "(torch.distributed.init_process_group)")
        group = dist.group.WORLD if group is None else group
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
        check_int(0, num_max_tokens_per_rank=num_max_tokens_per_rank, num_topk=num_topk)
        check_int(1, hidden=hidden)
        check_bool(use_fp8_dispatch=use_fp8_dispatch, use_recv_hook=use_recv_hook, deterministic=deterministic,
                    allow_hybrid_mode=allow_hybrid_mode, allow_multiple_reduction=allow_multiple_reduction)
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
        traffic_class.check_sl_idx(sl_idx)
        for name, value in (("num_gpu_timeout_secs", num_gpu_timeout_secs),
                            ("num_cpu_timeout_secs", num_cpu_timeout_secs)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT_SECS:
                raise ValueError(f"{name}={value!r} must be a number of seconds in (0, {MAX_TIMEOUT_SECS}] "
                                 f"(a finite timeout: a wait past it is an error, not a hang)")
        if cuda_tuning is not None and not isinstance(cuda_tuning, cuda_backend.CudaTuning):
            raise TypeError(f"cuda_tuning must be a moe_comm.backends.cuda.CudaTuning or None, "
                            f"got {type(cuda_tuning).__name__}")

        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.hidden = hidden
        self.num_topk = num_topk
        self.use_fp8_dispatch = use_fp8_dispatch
        self.deterministic = deterministic
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.num_gpu_timeout_secs = float(num_gpu_timeout_secs)
        self.num_cpu_timeout_secs = float(num_cpu_timeout_secs)
        self.num_bytes = sizing.get_buffer_size_hint(self.num_ranks, num_max_tokens_per_rank, hidden, num_topk,
                                                     use_fp8_dispatch, use_recv_hook=use_recv_hook)
        self.sl_idx = sl_idx
        self.device = self.group_device(group)
        self._arrive()
        if self.device.type == "cuda":  # collective on every rank, whatever its sl_idx (ranks may differ in it)
            self._check_traffic_class()
        self._device_index = -1 if self.device.type == "cpu" else self.device.index
        self._memory_bytes = _memory_bytes(self.device)
        self.domains = domains.find_domains(group, self.device)  # collective; the same on every rank
        self.is_hybrid = self._use_hybrid()
        self._cuda_tuning = cuda_tuning
        self.backend = self._resolve_backend(backend, cuda_tuning)
        self.topology = self._machine_topology()
        self._num_sms_cache: dict[tuple[int, int, bool], int] = {}
        self._fitting: set[tuple] = set()  # call shapes that fit the buffer
        self._impl = self._make_backend(cuda_tuning)
        # Pipeline, all-gather / reduce-scatter, Engram (`primitives`): the CUDA backend's pipeline by copy engines.
        self._prims = CudaPrimitives(self._impl) if isinstance(self._impl, cuda_backend.CudaBackend) \
            else TorchPrimitives(self._impl)
        self._destroyed = False

    def _make_backend(self, cuda_tuning):
        """This rank's backend, made once every rank has allocated its memory.

        A rank whose memory check or allocation failed alone would leave its peers waiting in the next collective
        (the CUDA backend's rendezvous, or the first call) until a timeout; instead every rank learns every rank's
        outcome and raises the same error, naming each rank that failed and what it could not get.
        """
        impl, failure = None, None
        try:
            # Read once (~3 us per call on the host path), here: a malformed value raises on every rank.
            self._check_inputs = env.get_bool("MOE_COMM_CHECK_INPUTS")
            if self.backend == "cuda" and self.is_hybrid:
                impl = HybridBackend(self.group, self.device, self.num_cpu_timeout_secs,
                                     *self.get_logical_domain_size(), self._partial_sums(), self.num_gpu_timeout_secs,
                                     lambda g: self._inner_buffer(g, "cuda"))
            elif self.backend == "cuda":
                if self.num_bytes > self._memory_bytes:
                    raise self._too_large("the symmetric buffer of this Buffer(num_max_tokens_per_rank=..., "
                                          "hidden=..., num_topk=...)", self.num_bytes)
                impl = cuda_backend.CudaBackend(self.group, self.device, self.num_bytes, self.num_cpu_timeout_secs,
                                                self.num_gpu_timeout_secs, cuda_tuning)
            elif self.is_hybrid:
                impl = HybridRefBackend(self.group, self.device, self.num_cpu_timeout_secs,
                                        *self.get_logical_domain_size(), use_partial_reduction=self._partial_sums())
            else:
                impl = TorchRefBackend(self.group, self.device, self.num_cpu_timeout_secs)
        except Exception as exc:  # of any kind: the peers must hear of it either way
            failure = exc
        error = _error_on_every_rank(self.group, failure, f"moe_comm.Buffer(backend={self.backend!r})")
        if error is None:
            # MOE_COMM_CHECK_INPUTS adds exchanges to calls: ranks set differently would not meet in them. The same
            # exchange agrees on the buffer's serial on its group (each rank's count of the buffers made there).
            values = [None] * self.num_ranks
            dist.all_gather_object(values, (self._check_inputs, buffer_serial(self.group)), group=self.group)
            checks = [check for check, _ in values]
            if len(set(checks)) > 1:
                error = ValueError(f"moe_comm.Buffer: MOE_COMM_CHECK_INPUTS differs between ranks (per rank, as read): "
                                   f"{checks}; set it the same on every rank")
            else:
                impl.start_epochs(max(serial for _, serial in values))
        if error is None and self.backend == "cuda":
            try:
                impl.connect()
            except Exception as exc:  # mapping a peer failed here: every rank raises (this also is their barrier)
                failure = exc
            error = _error_on_every_rank(self.group, failure, f"moe_comm.Buffer(backend={self.backend!r}) mapping "
                                                              f"the peers' memory")
        if error is not None:
            if impl is not None:
                impl.close()  # now, not when the caller lets go of the exception (whose frames hold `impl`)
            raise error from failure
        return impl

    # ------------------------------------------------------------------------------------------------
    # Set-up helpers
    # ------------------------------------------------------------------------------------------------
    def _check_traffic_class(self) -> None:
        """Collective: the same ValueError on every rank unless every rank asked for the same `sl_idx` and NCCL
        carries every rank's traffic on it (the launch environment can differ between hosts)."""
        values = [None] * self.num_ranks
        dist.all_gather_object(values, self.sl_idx, group=self.group)
        if len(set(values)) > 1:
            raise ValueError(f"moe_comm.Buffer: sl_idx differs between ranks (per rank, None = not set): {values}; "
                             f"give every rank the same")
        if self.sl_idx is None:
            return
        failure = None
        try:
            traffic_class.check_applied(self.group, self.device, self.sl_idx)
        except ValueError as exc:
            failure = exc
        error = _error_on_every_rank(self.group, failure, f"moe_comm.Buffer(sl_idx={self.sl_idx})")
        if error is not None:
            raise error from failure

    def _arrive(self) -> None:
        """gloo: every rank of the group reaches `Buffer(...)` within `num_cpu_timeout_secs`, else a TimeoutError on
        each rank that did, naming the peers it did not hear from (the construction's exchanges have no timeout of
        their own: they would wait for the process group's, 30 minutes by default on gloo). Every rank sends a word
        to every other and waits for theirs, all within one deadline. An NCCL group waits in its first exchange
        within the group's own timeout."""
        backend = str(dist.get_backend(self.group))  # "gloo", "cpu:gloo"; "cpu:gloo,cuda:nccl" runs on NCCL
        if "gloo" not in backend or "nccl" in backend or self.num_ranks == 1:
            return
        peers = [p for p in range(self.num_ranks) if p != self.rank]
        token, inbox = torch.zeros(1), torch.zeros(len(peers))
        ops = []
        for i, p in enumerate(peers):
            peer = dist.get_global_rank(self.group, p)
            ops += [dist.P2POp(dist.irecv, inbox[i:i + 1], peer, self.group, tag=ARRIVAL_TAG),
                    dist.P2POp(dist.isend, token, peer, self.group, tag=ARRIVAL_TAG)]
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as exc:  # gloo: a peer gave up before this rank came, and closed its connections
            raise ConnectionError(f"moe_comm: rank {self.rank} Buffer(...): a peer closed the connection before this "
                                  f"rank arrived (it gave up waiting: the ranks reached Buffer(...) more than "
                                  f"num_cpu_timeout_secs={self.num_cpu_timeout_secs:g} apart); the group cannot be "
                                  f"used further: create a new process group ({exc})") from exc
        deadline = time.monotonic() + self.num_cpu_timeout_secs
        missing = []
        for p, work in zip(peers * 2, works[::2] + works[1::2]):  # the receives, then the sends (done by then)
            try:
                work.wait(timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except RuntimeError:
                missing.append(p)
        if missing:
            raise TimeoutError(f"moe_comm: rank {self.rank} Buffer(...): peer(s) {sorted(set(missing))} did not "
                               f"answer at the construction within num_cpu_timeout_secs="
                               f"{self.num_cpu_timeout_secs:g} (absent, or gave up); the group cannot be used "
                               f"further: create a new process group")

    @staticmethod
    def group_device(group: dist.ProcessGroup) -> torch.device:
        """The device a group's tensors live on: the current CUDA device for NCCL, else the CPU."""
        if "nccl" in str(dist.get_backend(group)).lower():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _use_hybrid(self) -> bool:
        if not self.allow_hybrid_mode or self.domains.num_domains == 1:
            return False
        if not self.domains.is_uniform:
            warnings.warn(f"moe_comm: the group's scale-up domains are not uniform ({self.domains.describe()}): "
                          f"the hybrid path needs equal domains of consecutive ranks; this buffer runs the direct "
                          f"path", stacklevel=4)
            return False
        return True

    def _resolve_backend(self, backend: str, cuda_tuning) -> str:
        if backend == "torch":
            return "torch"
        if self.device.type != "cuda":
            if backend == "cuda":
                raise ValueError(f"backend='cuda' needs an NCCL group on GPUs, this group works on {self.device}; "
                                 f"use backend='torch' or 'auto'")
            return "torch"  # gloo: the reference backend is the only one, no warning
        if self.domains.num_domains > 1:
            # The domains are the same on every rank: so are these collectives and this choice.
            why_not = self._why_not_cuda_hybrid(cuda_tuning) if self.is_hybrid else (
                f"the group spans {self.domains.num_domains} scale-up domains ({self.domains.describe()}): the "
                f"kernels reach peers by peer memory only, and allow_hybrid_mode=False (or non-uniform domains) rules "
                f"out forwarding between hosts")
            if why_not is None:
                return "cuda"
            if backend == "cuda":
                raise ValueError(f"backend='cuda' cannot run on this group: {why_not}; use backend='torch' or 'auto'")
            warnings.warn(f"moe_comm: backend='auto' uses the reference backend ('torch'): {why_not}", stacklevel=3)
            return "torch"
        why_not = cuda_backend.why_not_usable(self.group, cuda_tuning)  # collective: every rank gets the same
        if why_not is None:
            return "cuda"
        if backend == "cuda":
            raise ValueError(f"backend='cuda' cannot run on this group: {why_not}; use backend='torch' or 'auto'")
        warnings.warn(f"moe_comm: backend='auto' uses the reference backend ('torch'): {why_not}", stacklevel=3)
        return "torch"

    def _why_not_cuda_hybrid(self, cuda_tuning) -> Optional[str]:
        """None when the CUDA backend's hybrid path (`moe_comm.backends.hybrid`) can run here, else why not, the same
        on every rank. Collective: makes the legs' subgroups and asks every host whether its kernels can run."""
        S, U = self.get_physical_domain_size()
        host_group, _ = leg_groups(self.group, self.device, S, U, self.num_gpu_timeout_secs)
        mine = cuda_backend.why_not_usable(host_group, cuda_tuning)  # collective over the host
        everyone = [None] * self.num_ranks
        dist.all_gather_object(everyone, mine, group=self.group)
        problems = [f"host {h}: {everyone[h * U]}" for h in range(S) if everyone[h * U]]
        if problems:
            return f"the group spans {S} hosts ({self.domains.describe()}): " + "; ".join(problems)
        return None

    def _partial_sums(self) -> bool:
        """Whether a combine may add a token's rows in groups before they travel: inside each rank (expand layout,
        direct path) or inside each host (hybrid path)."""
        return self.allow_multiple_reduction and not self.deterministic

    def _expand_partial_sums(self, handle: EPHandle) -> bool:
        """Whether a combine of `handle`'s dispatch adds a token's rows per rank first (`allow_multiple_reduction`):
        expand layout, direct path, at most `MAX_ROUND_SLOTS` slots (a warp's lanes hold a token's slots; wider
        tokens take the slot order, in rounds)."""
        return (handle.do_expand and not self.is_hybrid and self._partial_sums()
                and handle.num_topk <= layout.MAX_ROUND_SLOTS)

    def _inner_buffer(self, host_group: dist.ProcessGroup, backend: str) -> "Buffer":
        """The scale-up leg of the hybrid path: a direct Buffer on this rank's host, sized for a forwarder's space
        (`S * num_max_tokens_per_rank` tokens) and, with partial sums, for FP32 combine rows (twice a bf16 row; each
        term unsummed travels in the rows' own dtype), deterministic order."""
        S, _ = self.get_logical_domain_size()
        hidden = (2 if self._partial_sums() else 1) * self.hidden
        return Buffer(host_group, num_max_tokens_per_rank=S * self.num_max_tokens_per_rank, hidden=hidden,
                      num_topk=self.num_topk, use_fp8_dispatch=self.use_fp8_dispatch, backend=backend,
                      deterministic=True, num_gpu_timeout_secs=self.num_gpu_timeout_secs,
                      num_cpu_timeout_secs=self.num_cpu_timeout_secs, allow_hybrid_mode=False,
                      cuda_tuning=self._cuda_tuning)

    def _machine_topology(self) -> sizing.Topology:
        """The sizing model's inputs, read off this machine where possible.

        NVLink link rates come from `nvidia-smi nvlink -s` when it answers; SMs from the CUDA device.
        Without a GPU (CPU/gloo runs) the model assumes an H200 (132 SMs, 18 x 26.5625 GB/s links), so a CPU
        run reports the numbers the same job would use on the GPUs this project targets.
        The NVLink domain is a scale-up domain (`self.domains`); hybrid buffers have one scale-out group per domain.
        """
        link_gbs = sizing.query_nvlink_link_gbs() if self.device.type == "cuda" else None
        num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                   if self.device.type == "cuda" else sizing.H200_NUM_SMS)
        num_scaleout_ranks, _ = self.get_logical_domain_size()
        return sizing.Topology.from_links(num_ranks=self.num_ranks,
                                          num_nvl_ranks=self.domains.num_ranks_per_domain,
                                          num_scaleout_groups=num_scaleout_ranks,
                                          link_gbs=link_gbs or sizing.H200_NVLINK_LINK_GBS,
                                          num_device_sms=num_sms)

    @staticmethod
    def get_buffer_size_hint(group: Optional[dist.ProcessGroup], num_max_tokens_per_rank: int, hidden: int,
                             num_topk: int = 0, use_fp8_dispatch: bool = False, *,
                             use_recv_hook: bool = False) -> int:
        """Bytes of the per-rank buffer for these maxima (`moe_comm.sizing.get_buffer_size_hint`) on the direct
        path; `num_topk=0` sizes no dispatch: pass the calls' top-k. A CUDA buffer on the hybrid path allocates its
        host's buffer instead: `get_buffer_size_hint(host_group, S * num_max_tokens_per_rank, hidden', num_topk)`
        with S hosts, `use_fp8_dispatch` as given and hidden' twice `hidden` when combines may add partial sums
        (`allow_multiple_reduction` without `deterministic`; FP32 rows: about twice this hint), else `hidden`."""
        check_group(group)
        check_bool(use_fp8_dispatch=use_fp8_dispatch, use_recv_hook=use_recv_hook)
        num_ranks = dist.get_world_size(dist.group.WORLD if group is None else group)
        return sizing.get_buffer_size_hint(num_ranks, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                                           use_recv_hook=use_recv_hook)

    def get_physical_domain_size(self) -> tuple[int, int]:
        """`(num_hosts, num_ranks_per_host)`: scale-up domains (hosts, or NVLink islands of a host) and the ranks of
        one (of the largest when they differ), as detected at construction or set by `MOE_COMM_RANKS_PER_NODE`."""
        return self.domains.num_domains, self.domains.num_ranks_per_domain

    def get_logical_domain_size(self) -> tuple[int, int]:
        """`(num_scaleout_ranks, num_scaleup_ranks)` the operations use: the physical domains when the buffer runs
        hybrid, else `(1, num_ranks)` (every rank reaches every rank directly)."""
        return self.get_physical_domain_size() if self.is_hybrid else (1, self.num_ranks)

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, do_expand: bool = False) -> int:
        """SMs that saturate the bottleneck link for this routing (`moe_comm.sizing`, DESIGN 2.4); with `do_expand`,
        for the expand layout, whose receivers write a row per (token, local expert) (`sizing.estimate_num_sms`)."""
        check_int(1, num_experts=num_experts, num_topk=num_topk)
        check_bool(do_expand=do_expand)
        return self._num_sms(num_experts, num_topk, do_expand)

    def _num_sms(self, num_experts: int, num_topk: int, do_expand: bool) -> int:
        """`get_theoretical_num_sms` of checked arguments (a dispatch checked them already)."""
        key = (num_experts, num_topk, do_expand)
        if key not in self._num_sms_cache:  # the model costs tens of us: once per routing shape
            self._num_sms_cache[key] = sizing.get_num_sms(self.topology, num_experts, num_topk, do_expand)
        return self._num_sms_cache[key]

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """RDMA queue pairs an RDMA transport would use with `num_sms`; informational for NVLink-only groups."""
        check_int(1, num_sms=num_sms)
        hybrid = self.topology.is_hybrid
        # NVLink-only: no QPs are allocated, so the cap is the rule's own value.
        return sizing.get_num_qps(num_sms, hybrid, num_sms * 16 + 1 if hybrid else sizing.MAX_DIRECT_NUM_QPS)

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this moe_comm.Buffer was destroyed")
        if not group_is_live(self.group):  # destroyed, or gone with the default group (~0.3 us a call)
            raise RuntimeError("moe_comm: this Buffer's process group was destroyed "
                               "(torch.distributed.destroy_process_group): make a new Buffer on a new process group")

    def _check_ready(self, what: str) -> None:
        """Alive, and no receive hook pending: an operation before it would overwrite the rows it has to read (or,
        for a barrier, realign the counters its receivers wait on)."""
        self._check_alive()
        self._impl.check_no_pending_hook(what)

    def _check_tensor(self, name: str, t, dtypes: Optional[Sequence[torch.dtype]] = None, ndim: Optional[int] = None,
                      contiguous: bool = True) -> torch.Tensor:
        """A tensor on the buffer's device, dense, contiguous (unless not asked), of `dtypes` and `ndim` (if given)."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if dtypes is not None and t.dtype not in dtypes:
            raise TypeError(f"{name}.dtype={t.dtype} is not one of {list(dtypes)}")
        if ndim is not None and t.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
        # get_device() is -1 on the CPU but also on "meta": the device type is checked too (cheaper than t.device).
        if t.get_device() != self._device_index or not (t.is_cuda if self._device_index >= 0 else t.is_cpu):
            raise ValueError(f"{name} is on {t.device}, the buffer's group works on {self.device}")
        if t.layout != torch.strided:  # a sparse tensor cannot even answer is_contiguous()
            raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
        if contiguous and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})")
        return t

    def _check_fits(self, num_max_tokens_per_rank: int, hidden: int, num_topk: int, elem_size: int,
                    fp8: bool) -> None:
        key = (num_max_tokens_per_rank, hidden, num_topk, elem_size, fp8)
        if key in self._fitting:  # the check runs on every call: once per shape is enough
            return
        needed = sizing.get_buffer_size_hint(self.num_ranks, num_max_tokens_per_rank, hidden, num_topk, fp8,
                                             elem_size)
        if needed > self.num_bytes:
            raise ValueError(
                f"buffer too small: this call needs {needed} bytes ({num_max_tokens_per_rank=}, {hidden=}, "
                f"{num_topk=}, element size {elem_size}, fp8={fp8}), the buffer has {self.num_bytes} (made with "
                f"num_max_tokens_per_rank={self.num_max_tokens_per_rank}, hidden={self.hidden}, "
                f"num_topk={self.num_topk}, use_fp8_dispatch={self.use_fp8_dispatch}; its hidden counts bf16 "
                f"elements: a float32 row takes 2x, a float64 row 4x); create the Buffer with larger maxima "
                f"(Buffer.get_buffer_size_hint)")
        self._fitting.add(key)

    def _too_large(self, what: str, num_bytes: int) -> ValueError:
        """The error for `what` needing more bytes than the device has at all (callers compare first: the message
        is built only when it is raised)."""
        return ValueError(f"{what} would need {num_bytes} bytes, more than the {self._memory_bytes} bytes of memory "
                          f"on {self.device}")

    @staticmethod
    def _check_rows(name: str, t: torch.Tensor) -> None:
        """Rows move as 16-byte vectors: their size and the tensor's address must be multiples of 16 bytes."""
        hidden, elem_size = t.shape[1], t.element_size()
        if hidden * elem_size % 16:
            raise ValueError(f"{name} rows are {hidden} x {elem_size} = {hidden * elem_size} bytes, "
                             f"not a multiple of 16")
        if t.data_ptr() % 16:
            raise ValueError(f"{name} starts at an address that is not 16-byte aligned (data_ptr % 16 = "
                             f"{t.data_ptr() % 16}); pass a fresh or cloned tensor")

    def _check_recv_hook(self, return_recv_hook: bool, async_with_compute_stream: bool) -> None:
        """The hook's rules (the caller checked both are bools)."""
        if return_recv_hook and async_with_compute_stream:
            raise ValueError("return_recv_hook=True and async_with_compute_stream=True cannot be combined: with a "
                             "hook the receive runs when the hook is called, on the caller's stream")
        if return_recv_hook and not self._impl.supports_recv_hook:
            raise ValueError(f"return_recv_hook=True is not available on the {self._impl.name} path (a group of "
                             f"several scale-up domains, whose legs run one after another: nothing is left to "
                             f"receive later); use async_with_compute_stream=True to overlap it")

    def _check_event(self, previous_event) -> None:
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise TypeError(f"previous_event must be a moe_comm.EventOverlap or None, "
                            f"got {type(previous_event).__name__}")

    # ------------------------------------------------------------------------------------------------
    # Dispatch
    # ------------------------------------------------------------------------------------------------
    @torch.compiler.disable
    def dispatch(self, x: Union[torch.Tensor, FP8Tuple], topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, num_experts: Optional[int] = None,
                 num_max_tokens_per_rank: Optional[int] = None, expert_alignment: int = 1, num_sms: int = 0,
                 handle: Optional[EPHandle] = None, do_cpu_sync: Optional[bool] = None, do_expand: bool = False,
                 quantize: Optional[str] = None, dequantize: bool = False,
                 previous_event: Optional[EventOverlap] = None, async_with_compute_stream: bool = False,
                 allocate_on_comm_stream: bool = False, return_recv_hook: bool = False):
        """Send every token to the ranks that own its experts (once per rank).

        Arguments:
            x: `[N, H]`, `torch.bfloat16` (float32/float64 allowed for verification), or a pre-quantized tuple
                (`[N, H]` `torch.float8_e4m3fn`, scales `[N, H/128]` `torch.float32` for fp8_block128 or
                `torch.int32` for mxfp8).
            topk_idx: `[N, K]`, `torch.int64`, global expert ids in `[-1, num_experts)`, distinct per row except
                -1. None exactly when `handle` is given.
            topk_weights: `[N, K]`, `torch.float32` (`torch.float64` allowed with float64 x), or None.
            num_experts: global expert count, a multiple of the group size (from the handle when cached).
            num_max_tokens_per_rank: worst-case tokens per rank (default: the buffer's).
            expert_alignment: expand mode pads each expert block to a multiple of this many rows (1 to 1024);
                without expand only the handle's `num_recv_tokens_per_expert_list` is rounded up to it (as DeepEP),
                so a cached dispatch along a non-expand handle takes the handle's (the value given is not used).
            num_sms: SMs to run on; 0 = `get_theoretical_num_sms(num_experts, K, do_expand)`.
            handle: an `EPHandle` to reuse (cached dispatch: no layout work, no CPU sync).
            do_cpu_sync: None = True unless `handle`. False: worst-case sized outputs, true counts on the device.
            do_expand: one row per (token, local expert), grouped by expert.
            quantize: None, "fp8_block128" or "mxfp8": cast bf16 `x` to FP8 before it travels.
            dequantize: with FP8 on the wire, return bf16 rows (cast back on the receiver).
            previous_event: an `EventOverlap` the communication must wait for. With `async_with_compute_stream` on
                CUDA the comm stream waits for it, and the current stream does not (as DeepEP's; unlike DeepEP the
                comm stream also waits for the work already queued on the current stream); elsewhere the current
                stream (CUDA) or the host (CPU) waits.
            async_with_compute_stream: return at once; wait on the returned event before using the outputs.
            allocate_on_comm_stream: allocate outputs on the comm stream (CUDA). Accepted for DeepEP
                compatibility: a synchronous call runs and allocates on the current stream, an async one on the
                comm stream with its outputs recorded for the current stream, so both values are safe.
            return_recv_hook: only send now and return a hook as a sixth output that receives the rows when it
                is called (on the stream current at this call). Between the two no kernel of moe_comm runs: the
                CUDA backend's send launch (the barrier, then the rows pushed into the peers' regions) has ended,
                and the copy out of the region waits for the hook, so peers' rows land while other work runs
                (e.g. two micro-batches on two buffers). The outputs and the handle are valid only after the hook
                ran; the hook must run, once, before the next operation on this buffer (dispatch, combine,
                barrier). Not with `async_with_compute_stream`, nor on the hybrid path.

        Returns:
            `(recv_x, recv_topk_idx, recv_topk_weights, handle, event)`, and the hook with `return_recv_hook`:
            recv_x: `[P, H]` rows (x's dtype; bf16 with `dequantize`; an FP8 tuple when FP8 travels without it).
                Non-expand: rows grouped by source rank ascending. Expand: grouped by local expert, each block
                zero-padded to `expert_alignment`.
            recv_topk_idx: `[P, K]`, `torch.int64` local expert ids or -1; None in expand mode.
            recv_topk_weights: `[P, K]` (expand: `[P]`) weights of local slots, 0 elsewhere; None without
                `topk_weights` (cached: the handle's).
            handle: `EPHandle` for combine and cached dispatch.
            event: `EventOverlap` (already complete unless `async_with_compute_stream`).
            hook: with `return_recv_hook`, a callable that receives the rows (`moe_comm.RecvHook`).
        """
        self._check_ready("dispatch")
        call = self._validated("dispatch", lambda: self._validate_dispatch(
            x, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank, expert_alignment, num_sms, handle,
            do_cpu_sync, do_expand, quantize, dequantize, previous_event, async_with_compute_stream,
            allocate_on_comm_stream, return_recv_hook), previous_event)
        if call.handle is None and self._check_inputs:
            if previous_event is not None:  # topk_idx may be what it waits for; this debug mode syncs anyway
                previous_event.current_stream_wait()
            self._impl.check_inputs_up_front(call.topk_idx, call.num_experts)
        return self._impl.dispatch(call, agreed=self._agrees_on_host)

    @property
    def _agrees_on_host(self) -> bool:
        """Whether every call's agreement is checked on the host before it (the reference backend and the hybrid
        path on the CPU, where exchanges block the host anyway; MOE_COMM_CHECK_INPUTS=1)."""
        return self._impl.checks_every_call or self._check_inputs

    def _validated(self, what: str, validate: Callable[[], Any], previous_event):
        """`validate()`'s call with the backend's own checks (`Backend.check_call`), and with `_agrees_on_host` the
        ranks' agreement on its sizes, before anything else moves. A rank that refused its arguments (TypeError/
        ValueError) takes part in the agreement with a refusal before it raises: with `_agrees_on_host` every other
        rank raises a ValueError naming it at once; on the CUDA backend the refusal goes through the operation's
        barrier on the device (`Backend.refuse`), and every rank raises that ValueError at its next synchronizing
        call. Both leave the buffer usable. (The reference backend on GPUs and the hybrid path on GPUs take no
        part: their peers end in the timeout of a rank that did not call.)"""
        try:
            call = validate()
            call.plan = self._impl.check_call(what, call)
        except (TypeError, ValueError):
            if self._agrees_on_host:
                self._impl.check_agreement([OPERATIONS.index(what)], refused=True)
            else:
                self._impl.refuse(what, previous_event if isinstance(previous_event, EventOverlap) else None)
            raise
        if self._agrees_on_host:
            self._impl.check_agreement(call.signature())
        return call

    def _validate_dispatch(self, x, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank,
                           expert_alignment, num_sms, handle, do_cpu_sync, do_expand, quantize, dequantize,
                           previous_event, async_with_compute_stream, allocate_on_comm_stream,
                           return_recv_hook) -> DispatchCall:
        check_bool(do_expand=do_expand, dequantize=dequantize,
                    async_with_compute_stream=async_with_compute_stream,
                    allocate_on_comm_stream=allocate_on_comm_stream, return_recv_hook=return_recv_hook)
        self._check_recv_hook(return_recv_hook, async_with_compute_stream)
        check_int(1, expert_alignment=expert_alignment)
        if expert_alignment > MAX_EXPERT_ALIGNMENT:
            raise ValueError(f"expert_alignment={expert_alignment} exceeds {MAX_EXPERT_ALIGNMENT} (every expert "
                             f"block is padded up to it; grouped GEMMs ask for 16 to 256)")
        check_int(0, num_sms=num_sms)
        self._check_event(previous_event)
        if do_cpu_sync is not None:
            check_bool(do_cpu_sync=do_cpu_sync)
        if quantize is not None and quantize not in quant.FP8_FORMATS:
            raise ValueError(f"quantize={quantize!r} is not one of {(None, *quant.FP8_FORMATS)}")

        # The rows: a tensor, or a pre-quantized FP8 tuple.
        fp8_q = fp8_scales = None
        if isinstance(x, list):
            raise TypeError(f"x must be a torch.Tensor or an FP8 (q, scales) tuple, got a list of length {len(x)}")
        if isinstance(x, tuple):
            if quantize is not None:
                raise ValueError(f"quantize={quantize!r} given with an already quantized x tuple")
            fp8_q, fp8_scales, wire_format = quant.check_fp8_tuple(x, "x")
            for name, t in (("x[0]", fp8_q), ("x[1]", fp8_scales)):
                if t.device != self.device:
                    raise ValueError(f"{name} is on {t.device}, the buffer's group works on {self.device}")
            self._check_rows("x[0]", fp8_q)
            x = None
            num_tokens, hidden = fp8_q.shape
            elem_size = 2
        else:
            self._check_tensor("x", x, DATA_DTYPES, 2)
            num_tokens, hidden = x.shape
            elem_size = x.dtype.itemsize
            self._check_rows("x", x)
            wire_format = quantize
            if quantize is not None:
                if x.dtype != torch.bfloat16:
                    raise TypeError(f"quantize={quantize!r} casts bf16 rows; x.dtype={x.dtype}")
                if hidden % 128:
                    raise ValueError(f"FP8 dispatch needs hidden % 128 == 0, got hidden={hidden}")
        if dequantize and wire_format is None:
            raise ValueError("dequantize=True needs FP8 on the wire (an FP8 tuple x or quantize=)")

        if handle is not None:
            if not isinstance(handle, EPHandle):
                raise TypeError(f"handle must be a moe_comm.EPHandle, got {type(handle).__name__}")
            if topk_idx is not None:
                raise ValueError("topk_idx must be None with handle (a cached dispatch reuses the handle's layout)")
            if topk_weights is not None:
                raise ValueError("topk_weights must be None with handle (the weights come from the handle)")
            if do_cpu_sync:
                raise ValueError("do_cpu_sync=True is not allowed with handle: a cached dispatch never syncs")
            handle.check_reuse(self.group, self._impl.name, num_experts, num_tokens, do_expand, expert_alignment,
                               num_max_tokens_per_rank)
            num_experts, num_topk = handle.num_experts, handle.num_topk
            num_max_tokens_per_rank = handle.num_max_tokens_per_rank
            expert_alignment = handle.expert_alignment  # a non-expand call may leave it at its default
            do_cpu_sync = handle.do_cpu_sync
        else:
            if topk_idx is None:
                raise ValueError("topk_idx is required unless handle is given")
            self._check_tensor("topk_idx", topk_idx, (torch.int64,), 2)
            if topk_idx.shape[0] != num_tokens:
                raise ValueError(f"topk_idx has {topk_idx.shape[0]} rows, x has {num_tokens}")
            num_topk = topk_idx.shape[1]
            if num_topk < 1:
                raise ValueError(f"topk_idx must have at least one column, got shape {tuple(topk_idx.shape)}")
            if topk_weights is not None:
                allowed = (torch.float32, torch.float64) if x is not None and x.dtype == torch.float64 \
                    else (torch.float32,)
                self._check_tensor("topk_weights", topk_weights, allowed, 2)
                if topk_weights.shape != topk_idx.shape:
                    raise ValueError(f"topk_weights shape {tuple(topk_weights.shape)} != topk_idx shape "
                                     f"{tuple(topk_idx.shape)}")
            if num_experts is None:
                raise ValueError("num_experts is required unless handle is given")
            check_int(1, num_experts=num_experts)
            if num_experts % self.num_ranks:
                raise ValueError(f"num_experts={num_experts} is not a multiple of the group size {self.num_ranks}")
            if num_topk > num_experts:
                raise ValueError(f"num_topk={num_topk} (topk_idx columns) exceeds num_experts={num_experts}")
            if num_max_tokens_per_rank is None:
                num_max_tokens_per_rank = self.num_max_tokens_per_rank
            check_int(0, num_max_tokens_per_rank=num_max_tokens_per_rank)
            do_cpu_sync = True if do_cpu_sync is None else do_cpu_sync
            if 8 * (num_experts + 1) > self._memory_bytes:
                raise self._too_large(f"per-expert counts of num_experts={num_experts}", 8 * (num_experts + 1))
            if not do_cpu_sync:
                L = num_experts // self.num_ranks
                rows = self.num_ranks * num_max_tokens_per_rank
                if do_expand:
                    rows = rows * min(num_topk, L) + L * (expert_alignment - 1)
                if rows * (hidden * elem_size + 8 * num_topk) > self._memory_bytes:
                    raise self._too_large(f"the worst-case outputs of a dispatch without CPU sync ({rows} rows: "
                                          f"{self.num_ranks} ranks x {num_max_tokens_per_rank=})",
                                          rows * (hidden * elem_size + 8 * num_topk))
        if num_tokens > num_max_tokens_per_rank:
            raise ValueError(f"num_tokens={num_tokens} (x rows) exceeds {num_max_tokens_per_rank=} (make the Buffer "
                             f"for the largest call; the Megatron integration: MoECommConfig(num_max_tokens_per_rank"
                             f"=...), route B: install_flex_dispatcher(num_max_tokens_per_rank=...))")
        self._check_fits(num_max_tokens_per_rank, hidden, num_topk, elem_size, wire_format is not None)
        if num_sms == 0:
            num_sms = handle.num_sms if handle is not None else self._num_sms(num_experts, num_topk, do_expand)
        return DispatchCall(
            x=x, fp8_q=fp8_q, fp8_scales=fp8_scales, wire_format=wire_format, quantize=quantize,
            dequantize=dequantize, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts,
            num_topk=num_topk, num_tokens=num_tokens, hidden=hidden, num_max_tokens_per_rank=num_max_tokens_per_rank,
            expert_alignment=expert_alignment, num_sms=num_sms, handle=handle, do_cpu_sync=do_cpu_sync,
            do_expand=do_expand, previous_event=previous_event, async_with_compute_stream=async_with_compute_stream,
            allocate_on_comm_stream=allocate_on_comm_stream, return_recv_hook=return_recv_hook)

    # ------------------------------------------------------------------------------------------------
    # Combine
    # ------------------------------------------------------------------------------------------------
    @torch.compiler.disable
    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[None, torch.Tensor, Sequence[torch.Tensor]] = None, num_sms: int = 0,
                previous_event: Optional[EventOverlap] = None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False, return_recv_hook: bool = False):
        """Sum every token's rows back on its source rank.

        Arguments:
            x: `[P, H]`, `torch.bfloat16` (float32/float64 for verification), in the layout `handle`'s
                dispatch produced.
            handle: the `EPHandle` of that dispatch.
            topk_weights: non-expand `[P, K]`, expand `[P]`; `torch.float32` (`torch.float64` with float64 x).
            bias: None, a tensor, or a tuple of two tensors, each `[N, H]` of x's dtype, added after the rows.
            num_sms: SMs to run on; 0 = the handle's.
            previous_event, async_with_compute_stream, allocate_on_comm_stream: as in `dispatch`.
            return_recv_hook: as in `dispatch` (the reducers run in the hook). The CUDA reducers read this rank's
                own rows, weights and the bias when the hook runs: leave `x`, `topk_weights` and `bias` unchanged
                until then. An expand combine must fit the receive region in one round: partial sums always do; in
                the slot order, on the CUDA backend, that takes `Buffer(use_recv_hook=True)` once a token's slots
                outnumber what the default region holds (ValueError says so).

        Returns:
            `(combined_x, combined_topk_weights, event)`, and the hook with `return_recv_hook`:
            combined_x: `[N, H]`, x's dtype: per token, the sum (FP32 accumulation, FP64 for float64) of its
                rows, non-expand one per destination rank in ascending rank order, expand one per valid slot
                in ascending slot order (with partial sums, the Buffer's default: each rank's slots first, see
                `allow_multiple_reduction`), then `bias[0]`, then `bias[1]`. No gate weights are applied.
            combined_topk_weights: `[N, K]`: slot j's value on the rank that owns slot j's expert (a select),
                0 for -1 slots; None without `topk_weights`.
            event: `EventOverlap`.
            hook: with `return_recv_hook`, a callable that runs the reducers (`moe_comm.RecvHook`).
        """
        self._check_ready("combine")
        call = self._validated("combine", lambda: self._validate_combine(
            x, handle, topk_weights, bias, num_sms, previous_event, async_with_compute_stream,
            allocate_on_comm_stream, return_recv_hook), previous_event)
        return self._impl.combine(call)

    def _validate_combine(self, x, handle, topk_weights, bias, num_sms, previous_event, async_with_compute_stream,
                          allocate_on_comm_stream, return_recv_hook) -> CombineCall:
        check_bool(async_with_compute_stream=async_with_compute_stream,
                    allocate_on_comm_stream=allocate_on_comm_stream, return_recv_hook=return_recv_hook)
        self._check_recv_hook(return_recv_hook, async_with_compute_stream)
        check_int(0, num_sms=num_sms)
        self._check_event(previous_event)
        if not isinstance(handle, EPHandle):
            raise TypeError(f"handle must be a moe_comm.EPHandle, got {type(handle).__name__}")
        handle.check_owner(self.group, self._impl.name)
        self._check_tensor("x", x, DATA_DTYPES, 2)
        num_rows, hidden = x.shape
        self._check_rows("x", x)
        if num_rows != handle.num_recv_rows:
            raise ValueError(f"x has {num_rows} rows, the handle's dispatch produced {handle.num_recv_rows}")
        if topk_weights is not None:
            allowed = (torch.float32, torch.float64) if x.dtype == torch.float64 else (torch.float32,)
            expected = (num_rows,) if handle.do_expand else (num_rows, handle.num_topk)
            self._check_tensor("topk_weights", topk_weights, allowed, len(expected))
            if tuple(topk_weights.shape) != expected:
                raise ValueError(f"topk_weights must have shape {expected}, got {tuple(topk_weights.shape)}")
        if bias is None:
            bias = ()
        elif isinstance(bias, torch.Tensor):
            bias = (bias,)
        elif isinstance(bias, (tuple, list)):
            if len(bias) > 2:
                raise ValueError(f"bias takes at most two tensors, got {len(bias)}")
            bias = tuple(bias)
        else:
            raise TypeError(f"bias must be None, a tensor or a tuple of two tensors, got {type(bias).__name__}")
        for i, b in enumerate(bias):
            self._check_tensor(f"bias[{i}]", b, (x.dtype,), 2)
            self._check_rows(f"bias[{i}]", b)
            if tuple(b.shape) != (handle.num_tokens, hidden):
                raise ValueError(f"bias[{i}] must have shape {(handle.num_tokens, hidden)}, got {tuple(b.shape)}")
        self._check_fits(handle.num_max_tokens_per_rank, hidden, handle.num_topk, x.dtype.itemsize, False)
        return CombineCall(x=x, handle=handle, topk_weights=topk_weights, bias=bias,
                           num_sms=num_sms or handle.num_sms, previous_event=previous_event,
                           async_with_compute_stream=async_with_compute_stream,
                           allocate_on_comm_stream=allocate_on_comm_stream, return_recv_hook=return_recv_hook,
                           partial=self._expand_partial_sums(handle))

    # ------------------------------------------------------------------------------------------------
    # Lifetime
    # ------------------------------------------------------------------------------------------------
    @torch.compiler.disable
    def barrier(self) -> None:
        """Wait for every rank of the group; raise errors that calls without a CPU sync deferred (invalid routing,
        ranks that disagreed in a call the CUDA kernels checked)."""
        self._check_ready("barrier")
        self._impl.after_host_sync()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        work = dist.barrier(group=self.group, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.num_cpu_timeout_secs))
        except RuntimeError as exc:
            why = (f"rank {self.rank} barrier did not complete within "
                   f"num_cpu_timeout_secs={self.num_cpu_timeout_secs:g}: {exc}")
            self._impl.mark_broken(why)
            raise TimeoutError(f"moe_comm: {why}") from exc
        self._impl.after_host_sync(synchronized=True)
        self._impl.check_pending_errors()

    @torch.compiler.disable
    def destroy(self) -> None:
        """Release the buffer once its communication has finished; later calls raise. On the CPU, tensors this rank
        sent with `pp_send` are received first (the receivers' `pp_recv`; a receiver that never comes: the
        TimeoutError naming it, the buffer released all the same).

        A buffer dropped without `destroy()` is released as well once nothing refers to it (the CUDA backend's
        finalizer frees its memory); `destroy()` frees the memory now, whatever still refers to the buffer.
        """
        try:
            if self._impl is not None:
                self._impl.pending_hook = None  # its hook raises (on the CPU it could still receive)
                self._prims.close()
        finally:
            if self._impl is not None:
                self._impl.close()
            self._impl = None
            self._destroyed = True

    def __copy__(self) -> "Buffer":
        return self

    def __deepcopy__(self, memo) -> "Buffer":
        # A communication resource is shared, as its process group is: a deep copy of a model that holds one (an
        # EMA copy, a checkpointing helper) holds the same buffer.
        return self

    def __reduce__(self):
        raise TypeError("a moe_comm.Buffer is bound to its live process group and device memory: it cannot be "
                        "pickled or saved (save the model's state_dict; make a new Buffer after loading)")

    def __repr__(self) -> str:
        return (f"moe_comm.Buffer(backend={self.backend!r}, num_ranks={self.num_ranks}, device={self.device}, "
                f"num_max_tokens_per_rank={self.num_max_tokens_per_rank}, hidden={self.hidden}, "
                f"num_topk={self.num_topk}, num_bytes={self.num_bytes})")


# Failures that keep their type when every failed rank raised the same one of them (callers catch these by type).
_AGREED_ERRORS = {error.__name__: error for error in (ValueError, MemoryError, torch.OutOfMemoryError)}


def _error_on_every_rank(group: dist.ProcessGroup, failure: Optional[Exception], what: str) -> Optional[Exception]:
    """Collective: None if no rank of `group` had a `failure`, else the same error on every rank, naming each rank
    that failed and its message. Its type is that of the failures if all are the same one of `_AGREED_ERRORS`,
    else RuntimeError."""
    mine = None if failure is None else (type(failure).__name__, str(failure))
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    failed = [r for r, outcome in enumerate(everyone) if outcome is not None]
    if not failed:
        return None
    kinds = {everyone[r][0] for r in failed}
    error_type = _AGREED_ERRORS.get(kinds.pop(), RuntimeError) if len(kinds) == 1 else RuntimeError
    return error_type(f"{what} failed on rank(s) {failed}: " +
                      "; ".join(f"rank {r}: {everyone[r][0]}: {everyone[r][1]}" for r in failed))


def _memory_bytes(device: torch.device) -> int:
    """All the memory of `device` (a GPU's, or the host's physical memory for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


__all__ = ["Buffer", "DispatchCall", "CombineCall"]
