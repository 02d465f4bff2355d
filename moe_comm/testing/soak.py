"""Soak: many iterations of random routing over every dispatch and combine path of one long-lived Buffer, each
result checked against a closed form, with host RSS and CUDA memory read before and after each path. (Over 400
lines: eight paths, each with its closed form written out next to the call it checks.)

Rows encode where they come from. Token t of rank s is `encode_rows(case, s, t)`: channel 0 holds s (so s < 16),
channels 1-3 hold t in base 16 (so t < 4096), every other channel `(k - 15) / 8` for a k in [0, 31) fixed by the
seed, s, t, the channel and a salt. Every value has at most 4 significant bits, so a row times an integer up to 16
is exact in bf16, and sums of such products are exact in float32. The receiver therefore knows what each of its
rows must hold from the routing alone (DESIGN 2.1: source rank ascending, then token index ascending, with
`deterministic=True`), and a wrong row names the (source rank, token) it holds instead.

Combine is checked the same way: every receiver multiplies each row by the sum of `expert_factor(e)` (1 or 2)
over the row's local experts e (non-expand) or by its block's factor (expand), so the combined token t is
`x_t * F_t` (F_t <= 16: the sum of the factors of t's valid slots) whatever the order of the terms; then
`bias[0]` and `bias[1]` are added in FP32 (FP64 for float64) in that order (DESIGN 2.2). FP8 rows must equal
`moe_comm.quant.quantize` (and `dequantize`) of the expected bf16 rows, bit for bit; expand padding rows are zero.

Paths (`PATHS`), each a loop over the same drawn cases on one Buffer per rank:
    dispatch          fresh non-expand dispatch with a CPU sync
    dispatch no-sync  `do_cpu_sync=False`: worst-case sized outputs, the true counts only in the handle's psums
    expand            `do_expand=True` with the case's `expert_alignment` and CPU sync choice
    cached            a fresh dispatch, then `dispatch(handle=...)` of new rows along its layout
    fp8_block128      `quantize="fp8_block128"` (`dequantize` per case), then a cached dispatch of a pre-quantized
    mxfp8             tuple; likewise with `quantize="mxfp8"`
    combine           `combine` with `topk_weights` and zero, one or two biases, after a dispatch of either layout
    combine partial   the same in the expand layout on a second Buffer without `deterministic`: its combine adds a
                      token's rows per rank first (partial sums; the closed form holds in any order of the terms)

Cases are drawn in the parent (`draw_soak_cases`) and sent to the ranks: every rank runs the same case. A rank
counts a wrong iteration and keeps going; an exception ends the run (the launcher reports its traceback).
Used by `scripts/soak.py` and `tests/test_soak.py`.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import random
import time
from typing import Callable, Optional

import torch

import moe_comm
from .. import quant
from .checks import assert_same
from .memory import host_rss_bytes
from .routing import DTYPES, Case, rank_bias, rank_inputs
from .shared_gpu import every_buffer_over_ipc

PATHS = ("dispatch", "dispatch no-sync", "expand", "cached", "fp8_block128", "mxfp8", "combine", "combine partial")
MAX_RANKS = 16      # channel 0 holds the source rank
MAX_TOKENS = 4095   # channels 1-3 hold the token index in base 16
MAX_TOPK = 8        # keeps x * F within 4 + 4 significant bits (exact in bf16)
HIDDEN_CHOICES = (8, 24, 56, 128, 136, 256, 384)


@dataclasses.dataclass(frozen=True)
class SoakCase(Case):
    """One iteration's routing and switches, identical on every rank (`Case` plus the FP8 read-back choice).

    `do_cpu_sync`, `do_expand` and `expert_alignment` apply to the paths that take them from the case (expand,
    cached, FP8, combine); the dispatch paths fix them.
    """

    dequantize: bool = False

    @property
    def fp8_hidden(self) -> int:
        """Hidden size of the FP8 paths: the case's, rounded up to a multiple of 128."""
        return -(-self.hidden // 128) * 128


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    """What every rank needs beside the cases: the Buffer's maxima and backend, the paths to run."""

    backend: str = "torch"
    num_max_tokens_per_rank: int = 64
    max_hidden: int = 384
    max_topk: int = MAX_TOPK
    paths: tuple[str, ...] = PATHS
    num_cpu_timeout_secs: float = 120.0
    share_gpu: bool = False    # the ranks share cuda:0 over a gloo group, peers mapped with CUDA IPC (shared_gpu.py)

    @property
    def buffer_hidden(self) -> int:
        """`Buffer(hidden=...)` counts bf16 elements: float64 rows need 4x; FP8 needs a multiple of 128."""
        return -(-self.max_hidden * 4 // 128) * 128


def draw_soak_cases(seed: int, count: int, num_ranks: int, max_tokens: int = 64, max_hidden: int = 384,
                    max_experts: int = 32, max_topk: int = MAX_TOPK) -> list[SoakCase]:
    """`count` random cases for `num_ranks` ranks, deterministic in `seed` (drawn in the parent)."""
    if not 0 < num_ranks <= MAX_RANKS:
        raise ValueError(f"num_ranks={num_ranks} must be in [1, {MAX_RANKS}] (rows encode the source rank)")
    if not 0 < max_tokens <= MAX_TOKENS:
        raise ValueError(f"max_tokens={max_tokens} must be in [1, {MAX_TOKENS}] (rows encode the token index)")
    if max_experts < num_ranks:
        raise ValueError(f"max_experts={max_experts} must be >= num_ranks={num_ranks} (at least an expert per rank)")
    if not 1 <= max_topk <= MAX_TOPK:
        raise ValueError(f"max_topk={max_topk} must be in [1, {MAX_TOPK}] (combined rows must stay exact)")
    hiddens = [h for h in HIDDEN_CHOICES if h <= max_hidden]
    if not hiddens:
        raise ValueError(f"max_hidden={max_hidden} is below the smallest hidden size {HIDDEN_CHOICES[0]}")
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        num_experts = rng.randint(1, max(1, max_experts // num_ranks)) * num_ranks
        num_tokens = tuple(0 if rng.random() < 0.1 else rng.randint(1, max_tokens) for _ in range(num_ranks))
        cases.append(SoakCase(
            seed=seed * 100003 + i, num_ranks=num_ranks, num_experts=num_experts,
            num_topk=rng.randint(1, min(max_topk, num_experts)), hidden=rng.choice(hiddens), num_tokens=num_tokens,
            num_max_tokens_per_rank=min(max(num_tokens + (1,)) + rng.choice([0, 0, 7]), max_tokens),
            dtype=rng.choice(list(DTYPES)), drop_prob=rng.choice([0.0, 0.1, 0.5]), do_expand=rng.random() < 0.5,
            expert_alignment=rng.choice([1, 1, 2, 16]), do_cpu_sync=rng.random() < 0.5,
            with_weights=rng.random() < 0.85, num_bias=rng.choice([0, 1, 2]), dequantize=rng.random() < 0.5))
    return cases


def warmup_cases(config: SoakConfig, num_ranks: int, max_experts: int) -> list[SoakCase]:
    """The warm-up cases: every size at its maximum, once per row dtype (each dtype has kernels of its own, which the
    CUDA driver loads at their first launch: ~17 MiB of host memory for the combine's, measured on one H200), so
    the memory read after them is the steady state."""
    num_experts = max(1, max_experts // num_ranks) * num_ranks
    hidden = max(h for h in HIDDEN_CHOICES if h <= config.max_hidden)
    return [SoakCase(seed=1, num_ranks=num_ranks, num_experts=num_experts,
                     num_topk=min(config.max_topk, num_experts), hidden=hidden,
                     num_tokens=(config.num_max_tokens_per_rank,) * num_ranks,
                     num_max_tokens_per_rank=config.num_max_tokens_per_rank, dtype=dtype, drop_prob=0.0,
                     do_expand=True, expert_alignment=16, do_cpu_sync=False, num_bias=2, dequantize=True)
            for dtype in ("float64", "float32", "bfloat16")]


# ------------------------------------------------------------------------------------------------
# Closed forms
# ------------------------------------------------------------------------------------------------
def encode_rows(case: Case, src_rank: torch.Tensor, token: torch.Tensor, hidden: int, salt: int = 0) -> torch.Tensor:
    """`[M, hidden]` float64 rows of the tokens `(src_rank[i], token[i])` (see the module docstring)."""
    t = token.to(torch.int64)[:, None]
    s = src_rank.to(torch.int64)[:, None]
    channel = torch.arange(hidden, dtype=torch.int64)[None, :]
    k = (case.seed * 13 + s * 5 + t * 7 + channel * 3 + salt * 11) % 31
    rows = (k - 15).to(torch.float64) / 8
    source = torch.cat([s, t // 256, t // 16 % 16, t % 16], dim=1).to(torch.float64)
    rows[:, :4] = source[:, :hidden]  # fewer than 4 channels (float64 rows of 16 bytes) hold what fits
    return rows


def decode_row(row: torch.Tensor) -> tuple[int, int]:
    """(source rank, token index) a row of `encode_rows` holds."""
    s, hi, mid, lo = (int(v) for v in row[:4].double().tolist())
    return s, hi * 256 + mid * 16 + lo


def own_rows(case: Case, rank: int, hidden: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """`[N, hidden]` rows this rank dispatches."""
    n = case.num_tokens[rank]
    return encode_rows(case, torch.full((n,), rank), torch.arange(n), hidden, salt).to(dtype)


def expert_factor(global_expert: torch.Tensor) -> torch.Tensor:
    """The made-up expert multiplies its rows by 1 or 2 (exact in every dtype)."""
    return 1 + global_expert % 2


@dataclasses.dataclass
class Expected:
    """What one rank must receive, from the routing alone."""

    src: torch.Tensor                    # [M, 2] (source rank, token) of each non-expand row
    topk_idx: torch.Tensor               # [M, K] local expert ids, -1 elsewhere
    topk_weights: Optional[torch.Tensor]  # [M, K], 0 on other ranks' slots
    num_recv_tokens_per_rank: list[int]
    num_recv_tokens_per_expert: list[int]   # aligned
    expand_row: torch.Tensor             # [P] non-expand row of each expand row, -1 for padding
    expand_weights: Optional[torch.Tensor]  # [P]

    def num_rows(self, do_expand: bool) -> int:
        """Valid rows of the dispatch output (expand: padding included)."""
        return self.expand_row.numel() if do_expand else self.src.shape[0]

    def output_rows(self, case: Case, do_expand: bool, do_cpu_sync: bool) -> int:
        """Rows of the dispatch output: the valid ones with a CPU sync, else the worst case (DESIGN 2.1), sized by
        `case.num_max_tokens_per_rank` (the call's)."""
        if do_cpu_sync:
            return self.num_rows(do_expand)
        L, cap = case.num_local_experts, case.num_max_tokens_per_rank * case.num_ranks
        return cap * min(case.num_topk, L) + L * (case.expert_alignment - 1) if do_expand else cap

    def rows(self, case: Case, hidden: int, dtype: torch.dtype, do_expand: bool, salt: int = 0) -> torch.Tensor:
        """The expected `recv_x` (the valid rows) of a dispatch of `own_rows(..., salt)`."""
        rows = encode_rows(case, self.src[:, 0], self.src[:, 1], hidden, salt)
        if do_expand:
            rows = torch.cat([rows, rows.new_zeros(1, hidden)])[self.expand_row]  # row -1: the zero row
        return rows.to(dtype)


def expected_receive(case: Case, rank: int, routing: list) -> Expected:
    """The closed form of DESIGN 2.1 for receiver `rank`; `routing[s]` is `(topk_idx, topk_weights)` of rank s."""
    L = case.num_local_experts
    src, idx, weights, per_rank = [], [], [], []
    for s, (topk_idx, topk_weights) in enumerate(routing):
        local = (topk_idx >= rank * L) & (topk_idx < (rank + 1) * L)
        tokens = local.any(dim=1).nonzero().flatten()
        per_rank.append(tokens.numel())
        src.append(torch.stack([torch.full_like(tokens, s), tokens], dim=1))
        idx.append(torch.where(local, topk_idx - rank * L, -1)[tokens])
        if topk_weights is not None:
            weights.append(torch.where(local, topk_weights, 0)[tokens])
    src, idx = torch.cat(src), torch.cat(idx)
    w = torch.cat(weights) if weights else None
    # Expand: per local expert, its rows in receive order, then zero rows up to the alignment.
    expand_row, expand_w, aligned = [], [], []
    for expert in range(L):
        members = (idx == expert).any(dim=1).nonzero().flatten()
        num_rows = -(-members.numel() // case.expert_alignment) * case.expert_alignment
        padding = num_rows - members.numel()
        aligned.append(num_rows)
        expand_row.append(torch.cat([members, torch.full((padding,), -1)]))
        if w is not None:
            slot_w = (w[members] * (idx[members] == expert)).sum(dim=1)  # one nonzero term per row
            expand_w.append(torch.cat([slot_w, slot_w.new_zeros(padding)]))
    return Expected(src=src, topk_idx=idx, topk_weights=w, num_recv_tokens_per_rank=per_rank,
                    num_recv_tokens_per_expert=aligned, expand_row=torch.cat(expand_row).to(torch.int64),
                    expand_weights=torch.cat(expand_w) if w is not None else None)


def expected_fp8(rows: torch.Tensor, padding: torch.Tensor, fmt: str, dequantize: bool):
    """`quant.quantize` (and `dequantize`) of the expected bf16 rows; padding rows zero bytes and scales."""
    q, scales = quant.quantize(rows, fmt)
    q = torch.where(padding[:, None], 0, q.view(torch.uint8)).view(torch.float8_e4m3fn)
    scales = torch.where(padding[:, None], 0, scales)
    if dequantize:
        return torch.where(padding[:, None], 0, quant.dequantize(q, scales))
    return q, scales


def expert_rows(case: Case, expected: Expected, rank: int, rows: torch.Tensor, do_expand: bool,
                dtype: torch.dtype) -> torch.Tensor:
    """What the made-up experts return for received `rows` (`[P, H]`, the valid rows first): each valid row times
    its factor (non-expand: the sum over the row's local experts; expand: its block's expert), as `dtype`. Rows
    past the valid ones are NaN: a combine must not read them."""
    L = case.num_local_experts
    num_rows = expected.num_rows(do_expand)
    if do_expand:
        local = torch.repeat_interleave(torch.arange(L), torch.tensor(expected.num_recv_tokens_per_expert))
        factor = expert_factor(rank * L + local)
    else:
        idx = expected.topk_idx
        factor = torch.where(idx >= 0, expert_factor(rank * L + idx), 0).sum(dim=1)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.full((rows.shape[0], rows.shape[1]), float("nan"), dtype=dtype, device=rows.device)
    out[:num_rows] = (rows[:num_rows].to(acc) * factor.to(rows.device, acc)[:, None]).to(dtype)
    return out


def expected_combine(case: Case, rank: int, topk_idx: torch.Tensor, weights: Optional[torch.Tensor], hidden: int,
                     dtype: torch.dtype, bias: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Combine of `expert_rows` for this rank's tokens (`topk_idx`: its valid routing, invalid slots -1): `x_t * F_t`,
    then each bias in order, in FP32 (FP64 for float64), as `dtype`; and the selected `weights` (the combine's
    `topk_weights` are the received ones times 2), 0 for -1 slots."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    factor = torch.where(topk_idx >= 0, expert_factor(topk_idx), 0).sum(dim=1)
    x = own_rows(case, rank, hidden, torch.float64)
    out = torch.zeros(x.shape, dtype=acc) + (x * factor[:, None]).to(acc)  # exact; +0 turns -0.0 into 0.0
    for b in bias:
        out = out + b.cpu().to(acc)
    w = None if weights is None else torch.where(topk_idx >= 0, weights * 2, 0)
    return out.to(dtype), w


# ------------------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------------------
class Checks:
    """Collects failed comparisons instead of raising (a soak counts them and keeps going)."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def same(self, name: str, got, expected) -> None:
        try:
            assert_same(name, got, expected)
        except AssertionError as exc:
            self.failures.append(str(exc))

    def rows(self, name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
        """Bitwise, and for a wrong row the (source rank, token) it holds instead of the expected one."""
        before = len(self.failures)
        self.same(name, got, expected)
        if len(self.failures) > before and got.shape == expected.shape and got.shape[1] >= 4:
            got_c = got.detach().cpu()
            bad = (got_c.double() != expected.double()).any(dim=1).nonzero().flatten()
            if bad.numel():
                r = int(bad[0])
                self.failures[-1] += (f" (row {r} holds (rank, token) {decode_row(got_c[r])}, expected "
                                      f"{decode_row(expected[r])})")

    def equal(self, name: str, got, expected) -> None:
        if got != expected:
            self.failures.append(f"{name}: got {got!r}, expected {expected!r}")


def check_rows(chk: Checks, name: str, case: Case, expected: Expected, recv_x, do_expand: bool, hidden: int,
               dtype: torch.dtype, salt: int = 0, fp8: Optional[str] = None, dequantize: bool = False) -> None:
    """The valid rows of a dispatch of `own_rows(..., salt)` (as `dtype`, or cast to `fp8` on the wire)."""
    num_rows = expected.num_rows(do_expand)
    if fp8 is None:
        chk.rows(name, recv_x[:num_rows], expected.rows(case, hidden, dtype, do_expand, salt))
        return
    padding = expected.expand_row < 0 if do_expand else torch.zeros(num_rows, dtype=torch.bool)
    want = expected_fp8(expected.rows(case, hidden, torch.bfloat16, do_expand, salt), padding, fp8, dequantize)
    if dequantize:
        chk.same(name, recv_x[:num_rows], want)
    elif not isinstance(recv_x, tuple):
        chk.failures.append(f"{name}: a {type(recv_x).__name__}, expected an FP8 (data, scales) tuple")
    else:
        chk.same(f"{name} data", recv_x[0][:num_rows], want[0])
        chk.same(f"{name} scales", recv_x[1][:num_rows], want[1])


def check_layout(chk: Checks, case: Case, expected: Expected, outputs: tuple, do_expand: bool, do_cpu_sync: bool,
                 weights_dtype: Optional[torch.dtype]) -> None:
    """Everything of a fresh dispatch's `(recv_x, recv_topk_idx, recv_topk_weights, handle)` but the rows.

    `case.num_max_tokens_per_rank` must be the call's (the worst case without a CPU sync is sized by it);
    `weights_dtype`: the dtype of the `topk_weights` passed, None without.
    """
    recv_x, recv_idx, recv_w, handle = outputs
    num_rows, num_tokens = expected.num_rows(do_expand), expected.src.shape[0]
    got_rows = (recv_x[0] if isinstance(recv_x, tuple) else recv_x).shape[0]
    chk.equal("recv_x rows" if do_cpu_sync else "recv_x rows (worst case)", got_rows,
              expected.output_rows(case, do_expand, do_cpu_sync))
    if do_cpu_sync:
        chk.equal("handle.num_recv_tokens", handle.num_recv_tokens, num_rows)
        chk.equal("handle.num_recv_tokens_per_expert_list", handle.num_recv_tokens_per_expert_list,
                  expected.num_recv_tokens_per_expert)
    else:
        chk.equal("handle host counts", (handle.num_recv_tokens, handle.num_recv_tokens_per_expert_list), (None, None))
    chk.equal("handle.num_recv_rows", handle.num_recv_rows, got_rows)
    chk.same("psum_num_recv_tokens_per_rank", handle.psum_num_recv_tokens_per_rank,
             torch.tensor(expected.num_recv_tokens_per_rank, dtype=torch.int64).cumsum(0))
    chk.same("psum_num_recv_tokens_per_expert", handle.psum_num_recv_tokens_per_expert,
             torch.tensor(expected.num_recv_tokens_per_expert, dtype=torch.int64).cumsum(0))
    chk.same("handle.recv_src_idx", handle.recv_src_idx[:num_tokens], expected.src[:, 1].contiguous())
    if do_expand:
        chk.equal("recv_topk_idx (expand)", recv_idx, None)
        want_w = expected.expand_weights
    else:
        chk.same("recv_topk_idx", None if recv_idx is None else recv_idx[:num_rows], expected.topk_idx)
        want_w = expected.topk_weights
    if weights_dtype is None:
        chk.equal("recv_topk_weights", recv_w, None)
    else:
        chk.same("recv_topk_weights", None if recv_w is None else recv_w[:num_rows], want_w.to(weights_dtype))


# ------------------------------------------------------------------------------------------------
# Paths
# ------------------------------------------------------------------------------------------------
class _Iteration:
    """One case on one rank: its inputs, every rank's routing and this rank's expected receive."""

    def __init__(self, buf: moe_comm.Buffer, case: SoakCase, rank: int) -> None:
        self.buf, self.case, self.rank = buf, case, rank
        self.routing = [rank_inputs(case, s)[1:] for s in range(case.num_ranks)]
        self.expected = expected_receive(case, rank, self.routing)
        self.checks = Checks()

    def x(self, hidden: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
        return own_rows(self.case, self.rank, hidden, dtype, salt).to(self.buf.device)

    def dispatch(self, x, do_expand: bool, do_cpu_sync: bool, **kwargs) -> tuple:
        """A fresh dispatch of this rank's routing, its layout checked; returns its first four outputs.
        float64 weights go as float32 unless x is float64."""
        c = self.case
        topk_idx, w = self.routing[self.rank]
        if w is not None and x.dtype != torch.float64:
            w = w.float()
        outputs = self.buf.dispatch(
            x, topk_idx.to(self.buf.device), None if w is None else w.to(self.buf.device),
            num_experts=c.num_experts, num_max_tokens_per_rank=c.num_max_tokens_per_rank, do_expand=do_expand,
            expert_alignment=c.expert_alignment, do_cpu_sync=do_cpu_sync, **kwargs)[:4]
        check_layout(self.checks, c, self.expected, outputs, do_expand, do_cpu_sync, None if w is None else w.dtype)
        return outputs

    def cached(self, x, handle, **kwargs) -> tuple:
        c = self.case
        outputs = self.buf.dispatch(x, handle=handle, do_expand=handle.do_expand,
                                    expert_alignment=c.expert_alignment, **kwargs)[:4]
        self.checks.equal("cached dispatch returns its handle", outputs[3] is handle, True)
        self.checks.equal("cached recv_topk_weights are the handle's", outputs[2] is handle.recv_topk_weights, True)
        return outputs


def _path_dispatch(it: _Iteration, do_expand: bool, do_cpu_sync: bool) -> None:
    c = it.case
    recv_x = it.dispatch(it.x(c.hidden, c.torch_dtype), do_expand, do_cpu_sync)[0]
    check_rows(it.checks, "recv_x", c, it.expected, recv_x, do_expand, c.hidden, c.torch_dtype)


def _path_cached(it: _Iteration) -> None:
    c = it.case
    recv_x, recv_idx, _, handle = it.dispatch(it.x(c.hidden, c.torch_dtype), c.do_expand, c.do_cpu_sync)
    recv_x2, recv_idx2, _, _ = it.cached(it.x(c.hidden, c.torch_dtype, salt=1), handle)
    it.checks.equal("cached recv_x shape", tuple(recv_x2.shape), tuple(recv_x.shape))
    it.checks.equal("cached recv_topk_idx is the handle's", recv_idx2 is recv_idx or recv_idx2 is handle.recv_topk_idx,
                    True)
    check_rows(it.checks, "cached recv_x", c, it.expected, recv_x2, c.do_expand, c.hidden, c.torch_dtype, salt=1)


def _path_fp8(it: _Iteration, fmt: str) -> None:
    c = it.case
    hidden = c.fp8_hidden
    recv_x, _, _, handle = it.dispatch(it.x(hidden, torch.bfloat16), c.do_expand, c.do_cpu_sync, quantize=fmt,
                                       dequantize=c.dequantize)
    check_rows(it.checks, f"{fmt} recv_x", c, it.expected, recv_x, c.do_expand, hidden, torch.bfloat16, fp8=fmt,
               dequantize=c.dequantize)
    x2 = quant.quantize(it.x(hidden, torch.bfloat16, salt=1), fmt)
    recv_x2 = it.cached(x2, handle, dequantize=c.dequantize)[0]
    check_rows(it.checks, f"cached {fmt} recv_x", c, it.expected, recv_x2, c.do_expand, hidden, torch.bfloat16,
               salt=1, fp8=fmt, dequantize=c.dequantize)


def _path_combine(it: _Iteration, do_expand: bool) -> None:
    c, dev = it.case, it.buf.device
    recv_x, _, recv_w, handle = it.dispatch(it.x(c.hidden, c.torch_dtype), do_expand, c.do_cpu_sync)
    y = expert_rows(c, it.expected, it.rank, recv_x, do_expand, c.torch_dtype)
    bias = tuple(b.to(dev) for b in rank_bias(c, it.rank))
    combined, combined_w, _ = it.buf.combine(y, handle, topk_weights=None if recv_w is None else recv_w * 2,
                                             bias=bias or None)
    topk_idx, weights = it.routing[it.rank]
    if weights is not None and recv_w is not None:
        weights = weights.to(recv_w.dtype)
    expected_x, expected_w = expected_combine(c, it.rank, topk_idx, weights, c.hidden, c.torch_dtype, bias)
    it.checks.rows("combined_x", combined, expected_x)
    it.checks.same("combined_topk_weights", combined_w, expected_w)


_PATH_FNS: dict[str, Callable[[_Iteration], None]] = {
    "dispatch": lambda it: _path_dispatch(it, False, True),
    "dispatch no-sync": lambda it: _path_dispatch(it, False, False),
    "expand": lambda it: _path_dispatch(it, True, it.case.do_cpu_sync),
    "cached": _path_cached,
    "fp8_block128": lambda it: _path_fp8(it, "fp8_block128"),
    "mxfp8": lambda it: _path_fp8(it, "mxfp8"),
    "combine": lambda it: _path_combine(it, it.case.do_expand),
    "combine partial": lambda it: _path_combine(it, True),
}


# ------------------------------------------------------------------------------------------------
# Rank side
# ------------------------------------------------------------------------------------------------
def _trim_host_heap() -> None:
    """Give free heap pages back to the OS (glibc), so RSS follows live memory rather than the allocator's high-water
    mark; a no-op where there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def memory_now(device: torch.device) -> tuple[int, Optional[int]]:
    """(host RSS in bytes, `torch.cuda.memory_allocated` or None on the CPU), after a garbage collection and a heap
    trim."""
    gc.collect()
    _trim_host_heap()
    rss = host_rss_bytes()
    if device.type != "cuda":
        return rss, None
    torch.cuda.synchronize(device)
    return rss, torch.cuda.memory_allocated(device)


def run_path(buf: moe_comm.Buffer, path: str, case: SoakCase, rank: int) -> list[str]:
    """One iteration of `path`; returns the failed comparisons (empty when right)."""
    it = _Iteration(buf, case, rank)
    _PATH_FNS[path](it)
    return it.checks.failures


def _record(result: dict, label: str, case: SoakCase, rank: int, failures: list[str]) -> None:
    if not failures:
        return
    result["wrong"] += 1
    if result["first_wrong"] is None:
        more = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
        result["first_wrong"] = f"{label} on rank {rank}, {case}: {failures[0]}{more}"


def soak_rank(rank: int, world_size: int, cases: list[SoakCase], warmups: list[SoakCase],
              config: SoakConfig) -> dict:
    """Every path of `config` over `cases` on one Buffer, "combine partial" on a second (the `WorkerPool` function).

    Returns `{"backend": ..., "paths": {path: result}}`, a result holding `iterations`, `wrong` (iterations with
    a failed comparison), `first_wrong` (its message), `seconds` (wall time of the iterations, checks included),
    `rss_start`/`rss_end` and `cuda_start`/`cuda_end` (bytes, after the warm-up iterations and after the last;
    CUDA None on the CPU). The warm-up iterations (`warmups`, e.g. `warmup_cases`) are checked too (a wrong one
    counts) but not timed.
    """
    def make(deterministic: bool) -> moe_comm.Buffer:
        with every_buffer_over_ipc() if config.share_gpu else contextlib.nullcontext():
            return moe_comm.Buffer(None, num_max_tokens_per_rank=config.num_max_tokens_per_rank,
                                   hidden=config.buffer_hidden, num_topk=config.max_topk, use_fp8_dispatch=True,
                                   backend=config.backend, deterministic=deterministic,
                                   num_cpu_timeout_secs=config.num_cpu_timeout_secs)

    # "combine partial" on a buffer of its own (partial sums), every other path on the deterministic one.
    bufs = {partial: make(not partial) for partial in {path == "combine partial" for path in config.paths}}
    results = {path: _soak_path(bufs[path == "combine partial"], path, cases, warmups, rank) for path in config.paths}
    backend = next(iter(bufs.values())).backend
    for buf in bufs.values():
        buf.destroy()
    return {"backend": backend, "paths": results}


def _soak_path(buf: moe_comm.Buffer, path: str, cases: list[SoakCase], warmups: list[SoakCase],
               rank: int) -> dict:
    r = {"iterations": 0, "wrong": 0, "first_wrong": None, "seconds": 0.0}
    for warmup in warmups:
        _record(r, "warm-up", warmup, rank, run_path(buf, path, warmup, rank))
    r["rss_start"], r["cuda_start"] = memory_now(buf.device)
    for i, case in enumerate(cases):
        start = time.perf_counter()
        failures = run_path(buf, path, case, rank)
        if buf.device.type == "cuda":
            torch.cuda.synchronize(buf.device)
        r["seconds"] += time.perf_counter() - start
        r["iterations"] += 1
        _record(r, f"iteration {i}", case, rank, failures)
    buf.barrier()  # raises what a dispatch without CPU sync deferred (nothing: the routing is valid)
    r["rss_end"], r["cuda_end"] = memory_now(buf.device)
    return r


# ------------------------------------------------------------------------------------------------
# Parent side
# ------------------------------------------------------------------------------------------------
def summarize(per_rank: list[dict], rss_tolerance: int, cuda_tolerance: int) -> dict:
    """Merge the ranks' results: per path the iterations, wrong iterations summed over ranks, the first wrong
    example, the slowest rank's seconds, and the largest memory growth over ranks; `ok` is False on any wrong
    result or a growth beyond the tolerances (bytes), with the reasons in `problems`."""
    paths, problems = {}, []
    for path in per_rank[0]["paths"]:
        ranks = [r["paths"][path] for r in per_rank]
        first = next((p["first_wrong"] for p in ranks if p["first_wrong"]), None)
        rss_growth = max(p["rss_end"] - p["rss_start"] for p in ranks)
        cuda = [p for p in ranks if p["cuda_start"] is not None]
        cuda_growth = max((p["cuda_end"] - p["cuda_start"] for p in cuda), default=None)
        entry = {"iterations": ranks[0]["iterations"], "wrong": sum(p["wrong"] for p in ranks), "first_wrong": first,
                 "seconds": max(p["seconds"] for p in ranks), "rss_start": [p["rss_start"] for p in ranks],
                 "rss_end": [p["rss_end"] for p in ranks], "rss_growth": rss_growth,
                 "cuda_start": [p["cuda_start"] for p in cuda] or None,
                 "cuda_end": [p["cuda_end"] for p in cuda] or None,
                 "cuda_growth": cuda_growth}
        if entry["wrong"]:
            problems.append(f"WRONG {path}: {entry['wrong']} wrong iteration(s); first: {first}")
        if rss_growth > rss_tolerance:
            problems.append(f"GROWTH {path}: host RSS grew by {rss_growth / 2**20:.1f} MiB on some rank "
                            f"(tolerance {rss_tolerance / 2**20:.1f} MiB)")
        if cuda_growth is not None and cuda_growth > cuda_tolerance:
            problems.append(f"GROWTH {path}: torch.cuda.memory_allocated grew by {cuda_growth} bytes on some rank "
                            f"(tolerance {cuda_tolerance})")
        paths[path] = entry
    return {"backend": per_rank[0]["backend"], "paths": paths, "ok": not problems, "problems": problems}


def format_summary(summary: dict) -> str:
    """The human table of `summarize`'s result."""
    mib = lambda v: f"{v / 2**20:.1f}"  # noqa: E731
    lines = [f"{'path':<18} {'iters':>6} {'wrong':>6} {'wall s':>8}  {'host RSS MiB start -> end (growth)':<36}"
             f" cuda allocated MiB start -> end"]
    for path, e in summary["paths"].items():
        rss = f"{mib(max(e['rss_start']))} -> {mib(max(e['rss_end']))} ({e['rss_growth'] / 2**20:+.1f})"
        cuda = "-" if e["cuda_growth"] is None else \
            f"{mib(max(e['cuda_start']))} -> {mib(max(e['cuda_end']))} ({e['cuda_growth'] / 2**20:+.2f})"
        lines.append(f"{path:<18} {e['iterations']:>6} {e['wrong']:>6} {e['seconds']:>8.2f}  {rss:<36} {cuda}")
    lines.append("memory: largest rank shown; growth is the largest over ranks, from after the warm-up to the end")
    lines += summary["problems"]
    lines.append("OK: every result matched its closed form" if summary["ok"] else "FAILED")
    return "\n".join(lines)


__all__ = ["PATHS", "SoakCase", "SoakConfig", "draw_soak_cases", "warmup_cases", "encode_rows", "decode_row",
           "own_rows", "expert_factor", "Expected", "expected_receive", "expected_fp8", "expert_rows",
           "expected_combine", "Checks", "check_rows", "check_layout", "run_path", "soak_rank", "summarize",
           "format_summary", "memory_now"]
