"""Property test of the argument space of `Buffer.dispatch` and `Buffer.combine` (reference backend, gloo, 2 ranks).
(Over 400 lines: the catalogue of faults, each with the argument its error must name, reads best in one place.)

Hypothesis draws one `Example` in the parent: a valid dispatch (sizes, dtypes, routing values that may fall out of
range or repeat an expert, expand layout, alignment, CPU sync, FP8, async), up to two faults applied to its
arguments (wrong types, values, shapes, dtypes, devices, layouts: the `FAULTS` catalogue), then optionally a cached
dispatch and a combine with faults of their own. Every rank runs the same example (one `pool.run` per example, on
one long-lived pool and one Buffer per rank), and on every rank each call must either

- be accepted, its outputs equal to the closed forms of `moe_comm.testing.soak` (rows that encode their source,
  DESIGN 2.1 order, combine sums that are exact whatever the order), or
- be refused with a TypeError or ValueError whose message names the faulty argument (README, Errors),

never another exception, never a hang (the pool's timeout), and all ranks alike. Invalid `topk_idx` values raise a
ValueError naming `topk_idx` at the count exchange of a synchronizing dispatch; without a CPU sync the bad slots
are dropped (the outputs are those of the valid routing) and the next synchronizing call raises: every example
ends with one (`barrier()` or a valid dispatch with a CPU sync), which must raise exactly then. An async dispatch's
event is waited on, or handed to the next call as `previous_event`, which must complete it.

Random draws reach most of the catalogue but not all of it (2000 draws: 95 of its 109 faults), so
`test_each_fault_of_the_catalogue` also puts every fault, with each of its parameters, on a fixed valid call (185
calls, ~5 s), and the random draws are 1000 (they were 2000, ~60-180 s of CI).

The `@example`s are calls this test found refused with another exception type (fixed since in `Buffer`'s and
`quant`'s tensor checks). `pytest --hypothesis-show-statistics` shows how often each call was accepted or refused.
"""

from __future__ import annotations

import dataclasses
import re
import traceback
import warnings
from typing import Callable, Optional

import numpy as np
import pytest
import torch
from hypothesis import assume, event, example, given, settings
from hypothesis import strategies as st

import moe_comm
from moe_comm import quant
from moe_comm.event import EventOverlap
from moe_comm.testing.routing import DTYPES
from moe_comm.testing.soak import (Checks, SoakCase, check_layout, check_rows, expected_combine, expected_receive,
                                   expert_rows, own_rows)

WORLD_SIZE = 2
MAX_TOKENS = 8          # the Buffer's num_max_tokens_per_rank
MAX_ROW_BYTES = 1024    # the Buffer's hidden=512 bf16 elements
MAX_TOPK = 4
TOO_WIDE_ROW_BYTES = 65536  # one token of such rows needs more than the whole Buffer (about 1 MB)
TOO_MANY_TOKENS = 10**6
NUM_EXAMPLES = 1000


# ------------------------------------------------------------------------------------------------
# Examples (drawn in the parent)
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Example:
    """One dispatch, optionally followed by a cached dispatch and a combine, identical on every rank.

    `faults`, `cached_faults` and `combine_faults` are `(name, parameter)` pairs of `FAULTS`; `cached_faults` None:
    no cached dispatch; `combine_dtype` None: no combine.
    """

    seed: int
    num_tokens: tuple[int, ...]
    hidden: int
    dtype: str
    num_experts: int
    num_topk: int
    topk_idx: tuple[tuple[tuple[int, ...], ...], ...]   # per rank, per token, per slot (any values)
    weights_dtype: Optional[str]      # None: no topk_weights
    do_expand: bool = False
    expert_alignment: int = 1
    do_cpu_sync: Optional[bool] = None
    num_max_tokens_per_rank: Optional[int] = None
    num_sms: int = 0
    x_form: str = "tensor"            # "tensor", "quantize" (quantize=fp8_format) or "tuple" (pre-quantized)
    fp8_format: str = "fp8_block128"
    dequantize: bool = False
    async_with_compute_stream: bool = False
    allocate_on_comm_stream: bool = False
    previous_event: bool = False
    faults: tuple[tuple[str, object], ...] = ()
    cached_faults: Optional[tuple[tuple[str, object], ...]] = None
    combine_dtype: Optional[str] = None
    combine_weights_dtype: Optional[str] = None
    bias_form: str = "none"           # "none", "tensor", "one", "two" (tuple) or "list"
    combine_async: bool = False
    combine_faults: tuple[tuple[str, object], ...] = ()
    cached_do_cpu_sync: Optional[bool] = None   # None or False (a cached dispatch never syncs)
    chain_event: bool = False         # an async dispatch's event is the next call's previous_event (not waited)
    final_sync: str = "barrier"       # the synchronizing call at the end: "barrier" or "dispatch"

    @property
    def fits_fp8(self) -> bool:
        return self.dtype == "bfloat16" and self.hidden % 128 == 0

    def case(self, num_max_tokens_per_rank: int) -> SoakCase:
        return SoakCase(seed=self.seed, num_ranks=WORLD_SIZE, num_experts=self.num_experts, num_topk=self.num_topk,
                        hidden=self.hidden, num_tokens=self.num_tokens,
                        num_max_tokens_per_rank=num_max_tokens_per_rank, dtype=self.dtype,
                        do_expand=self.do_expand, expert_alignment=self.expert_alignment)


def valid_routing(topk_idx, num_experts: int, num_topk: int) -> torch.Tensor:
    """`[N, K]`: what the library must route: out-of-range slots and repeats of an earlier slot's expert become -1."""
    rows = []
    for row in topk_idx:
        seen, clean = set(), []
        for e in row:
            clean.append(e if 0 <= e < num_experts and e not in seen else -1)
            seen.add(e)
        rows.append(clean)
    return torch.tensor(rows, dtype=torch.int64).view(len(topk_idx), num_topk)


def is_valid(topk_idx, num_experts: int) -> bool:
    return all(e == -1 or (0 <= e < num_experts and row.count(e) == 1) for row in topk_idx for e in row)


def closed_weights(rank: int, num_tokens: int, num_topk: int) -> torch.Tensor:
    """`[N, K]` float64 weights `k / 64`, k in [1, 64] (exact in float32), fixed by (rank, token, slot)."""
    t = torch.arange(num_tokens)[:, None]
    j = torch.arange(num_topk)[None, :]
    return ((rank * 37 + t * 11 + j * 5) % 64 + 1).to(torch.float64) / 64


@st.composite
def examples(draw) -> Example:
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    elem = DTYPES[dtype].itemsize
    hidden = draw(st.sampled_from([h for h in (2, 4, 8, 24, 128, 256) if h * elem % 16 == 0
                                   and h * elem <= MAX_ROW_BYTES]))
    num_experts = WORLD_SIZE * draw(st.integers(1, 4))
    num_topk = draw(st.integers(1, min(MAX_TOPK, num_experts)))
    num_tokens = tuple(draw(st.integers(0, MAX_TOKENS)) for _ in range(WORLD_SIZE))
    any_values = draw(st.integers(0, 3)) == 0  # then some rows hold any values: out of range, repeated
    routing = []
    for n in num_tokens:
        rows = []
        for _ in range(n):
            if any_values and draw(st.integers(0, 2)) == 0:
                rows.append(tuple(draw(st.lists(st.integers(-3, num_experts + 2), min_size=num_topk,
                                                max_size=num_topk))))
            else:
                experts = draw(st.permutations(range(num_experts)))[:num_topk]
                rows.append(tuple(-1 if draw(st.integers(0, 4)) == 0 else e for e in experts))
        routing.append(tuple(rows))
    fp8 = dtype == "bfloat16" and hidden % 128 == 0
    ex = dict(
        seed=draw(st.integers(0, 2**20)), num_tokens=num_tokens, hidden=hidden, dtype=dtype,
        num_experts=num_experts, num_topk=num_topk, topk_idx=tuple(routing),
        weights_dtype=draw(st.sampled_from([None, "float32"] + (["float64"] if dtype == "float64" else []))),
        do_expand=draw(st.booleans()), expert_alignment=draw(st.sampled_from([1, 1, 2, 3, 16, 1024])),
        do_cpu_sync=draw(st.sampled_from([None, True, False])),
        num_max_tokens_per_rank=draw(st.sampled_from([None, max(num_tokens), MAX_TOKENS])),
        num_sms=draw(st.sampled_from([0, 0, 1, 24, 1000])),
        x_form=draw(st.sampled_from(["tensor", "quantize", "tuple"])) if fp8 else "tensor",
        fp8_format=draw(st.sampled_from(quant.FP8_FORMATS)), async_with_compute_stream=draw(st.booleans()),
        allocate_on_comm_stream=draw(st.booleans()), previous_event=draw(st.booleans()),
        cached_do_cpu_sync=draw(st.sampled_from([None, False])),
        final_sync=draw(st.sampled_from(["barrier", "dispatch"])), chain_event=draw(st.booleans()))
    ex["dequantize"] = ex["x_form"] != "tensor" and draw(st.booleans())
    # Faults go to one call (a refused dispatch leaves nothing to combine): which one is drawn first.
    focus = draw(st.sampled_from(["dispatch", "dispatch", "cached", "combine", "combine"]))
    base = Example(**ex)
    ex["faults"] = draw_faults(draw, "dispatch", base) if focus == "dispatch" else ()
    if focus == "cached" or draw(st.booleans()):
        ex["cached_faults"] = draw_faults(draw, "cached", base) if focus == "cached" else ()
    combine_dtypes = [d for d in sorted(DTYPES) if hidden * DTYPES[d].itemsize % 16 == 0
                      and hidden * DTYPES[d].itemsize <= MAX_ROW_BYTES]
    if focus == "combine" or draw(st.booleans()):
        combine_dtype = draw(st.sampled_from(combine_dtypes))
        ex.update(combine_dtype=combine_dtype,
                  bias_form=draw(st.sampled_from(["none", "tensor", "one", "two", "list"])),
                  combine_weights_dtype=draw(st.sampled_from(
                      [None, "float32"] + (["float64"] if combine_dtype == "float64" else []))),
                  combine_async=draw(st.booleans()))
        if focus == "combine":
            ex["combine_faults"] = draw_faults(draw, "combine", Example(**ex))
    ex = Example(**ex)
    # Some faults only show on a tensor with 2 rows: every rank must see them (a rank refusing alone hangs its peers).
    if any(FAULTS[name].needs_tokens for name, _ in ex.faults + (ex.cached_faults or ()) + ex.combine_faults):
        assume(min(num_tokens) > 1 and min(num_recv_rows(ex)) > 1)
    return ex


def num_recv_rows(ex: Example) -> list[int]:
    """Rows each rank's dispatch returns (the combine's x rows)."""
    case = ex.case(MAX_TOKENS if ex.num_max_tokens_per_rank is None else ex.num_max_tokens_per_rank)
    routing = [(valid_routing(t, ex.num_experts, ex.num_topk), None) for t in ex.topk_idx]
    return [expected_receive(case, rank, routing).output_rows(case, ex.do_expand, ex.do_cpu_sync is not False)
            for rank in range(WORLD_SIZE)]


def draw_faults(draw, stage: str, ex: Example) -> tuple[tuple[str, object], ...]:
    names = [name for name, f in FAULTS.items() if f.stage == stage and f.when(ex)]
    count = draw(st.sampled_from([0, 1, 1, 1, 2]))
    # At most one fault per argument (`words[0]` names the argument a fault changes).
    chosen = draw(st.lists(st.sampled_from(names), min_size=count, max_size=count,
                           unique_by=lambda name: FAULTS[name].words[0]))
    return tuple((name, draw(st.sampled_from(FAULTS[name].params))) for name in chosen)


# ------------------------------------------------------------------------------------------------
# Faults: the catalogue, per call (stage)
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Fault:
    """`apply(kw, ctx, param)` changes the keyword arguments of the call; it returns False when the result is in fact
    a valid call (a variant that must be accepted, or a view that is contiguous after all), else True. A refusal
    must name one of `words` (as a whole identifier); `words[0]` is the argument the fault changes."""

    stage: str                          # "dispatch", "cached" or "combine"
    apply: Callable[[dict, "RankContext", object], bool]
    words: tuple[str, ...]
    params: tuple = (None,)
    when: Callable[[Example], bool] = lambda ex: True
    needs_tokens: bool = False          # shows only with 2 tokens and 2 received rows on every rank (a [1, 1] tensor
                                        # is contiguous whatever its strides)


def _set(key: str, make: Callable[[object, "RankContext", object], object]):
    def apply(kw: dict, ctx: "RankContext", param) -> bool:
        kw[key] = make(kw[key], ctx, param)
        return True
    return apply


def _set_if(key: str, make: Callable[[object, "RankContext", object], object], bad: Callable[[object], bool]):
    def apply(kw: dict, ctx: "RankContext", param) -> bool:
        kw[key] = make(kw[key], ctx, param)
        return bad(kw[key])
    return apply


def _value(key: str):
    return _set(key, lambda old, ctx, p: _token(p, old))


def _token(p, old):
    """Parameters that are not plain values are named (hypothesis prints them)."""
    if not isinstance(p, str):
        return p
    number = old if isinstance(old, int) else 1
    return {"object": object(), "numpy int": np.int64(number), "float of it": float(number),
            "numpy array": np.zeros(3)}.get(p, p)


def _noncontiguous(t: torch.Tensor) -> torch.Tensor:
    return torch.stack([t, t], dim=-1)[..., 0]


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.new_zeros(1), t.flatten()])[1:].view(t.shape)


def _other_rank(t: torch.Tensor, how: str) -> torch.Tensor:
    """One dimension fewer or more than `t` has."""
    if how == "more":
        return t[None]
    return t.flatten() if t.dim() > 1 else t.new_zeros(())


def _odd_strides(t: torch.Tensor) -> torch.Tensor:
    """A valid variant: the same values with a stride that does not matter (a dimension of size 1), still contiguous."""
    if t.dim() == 2 and t.shape[1] == 1:
        return t.as_strided(t.shape, (1, 0))
    if t.dim() == 2 and t.shape[0] == 1:
        return t.as_strided(t.shape, (12345, 1))
    return t


def _sparse(t: torch.Tensor, layout: str) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Sparse CSR tensor support is in beta state"
        return t.to_sparse(layout=getattr(torch, layout if t.dim() == 2 else "sparse_coo"))  # CSR is 2-D only


def _not_contiguous(t) -> bool:
    return not t.is_contiguous()


def _misaligned_ptr(t) -> bool:
    return t.data_ptr() % 16 != 0


def _tensor_faults(stage: str, key: str, dtypes: tuple[str, ...], when=lambda ex: True, rows: bool = False,
                   optional: bool = False) -> dict[str, Fault]:
    """The faults every tensor argument gets: dtype, Python list, numpy array, None (unless `optional`), rank,
    layout, device, and strides that do not matter (valid); for `rows` (data moved as 16-byte vectors) also an
    address that is not 16-byte aligned."""
    words = (key,)
    faults = {
        f"{stage} {key} dtype": Fault(stage, _set(key, lambda t, ctx, p: t.to(getattr(torch, p))), words, dtypes, when),
        f"{stage} {key} list": Fault(stage, _set(key, lambda t, ctx, p: t.tolist()), words, when=when),
        f"{stage} {key} numpy": Fault(stage, _set(key, lambda t, ctx, p: t.float().numpy()), words, when=when),
        f"{stage} {key} rank": Fault(stage, _set(key, lambda t, ctx, p: _other_rank(t, p)), words, ("fewer", "more"),
                                     when),
        f"{stage} {key} non-contiguous": Fault(stage, _set_if(key, lambda t, ctx, p: _noncontiguous(t),
                                                              _not_contiguous), words, when=when, needs_tokens=True),
        f"{stage} {key} on meta": Fault(stage, _set(key, lambda t, ctx, p: t.to("meta")), words, when=when),
        f"{stage} {key} sparse": Fault(stage, _set(key, lambda t, ctx, p: _sparse(t, p)), words,
                                       ("sparse_coo", "sparse_csr"), when=when, needs_tokens=True),
        f"{stage} {key} odd strides": Fault(stage, _set_if(key, lambda t, ctx, p: _odd_strides(t), lambda t: False),
                                            words, when=when),
    }
    if not optional:
        faults[f"{stage} {key} None"] = Fault(stage, _set(key, lambda t, ctx, p: None), words, when=when)
    if rows:  # an empty tensor's address may be aligned on one rank only: every rank gets elements
        faults[f"{stage} {key} misaligned"] = Fault(stage, _set_if(key, lambda t, ctx, p: _misaligned(t),
                                                                   _misaligned_ptr), words, when=when,
                                                    needs_tokens=True)
    return faults


def _plain_x(ex: Example) -> bool:
    return ex.x_form != "tuple"


def _with_weights(ex: Example) -> bool:
    return ex.weights_dtype is not None


def _wider_rows(ctx: "RankContext", hidden: int, dtype: torch.dtype) -> torch.Tensor:
    return own_rows(ctx.case, ctx.rank, hidden, dtype)


def _requires_grad(key: str):
    """A valid variant: the tensor is a leaf that requires grad (the call is not differentiable, it must still work)."""
    def apply(kw: dict, ctx: "RankContext", param) -> bool:
        kw[key] = kw[key].detach().requires_grad_()
        return False
    return apply


def _fp8_tuple_fault(make):
    return _set("x", lambda x, ctx, p: make(x, p))


FAULTS: dict[str, Fault] = {
    # dispatch: x
    **_tensor_faults("dispatch", "x", ("float16", "int32", "bool", "complex64", "float8_e5m2"), _plain_x, rows=True),
    "dispatch x tuple of tensors": Fault("dispatch", _set("x", lambda x, ctx, p: (x, x)), ("x",), when=_plain_x),
    "dispatch x row bytes": Fault("dispatch", _set("x", lambda x, ctx, p: _wider_rows(ctx, ctx.ex.hidden + 1, x.dtype)),
                                  ("x",), when=_plain_x),
    "dispatch x too wide": Fault("dispatch", _set("x", lambda x, ctx, p: _wider_rows(
        ctx, TOO_WIDE_ROW_BYTES // x.element_size(), x.dtype)), ("x", "buffer too small", "hidden"),
        when=lambda ex: _plain_x(ex) and ex.num_max_tokens_per_rank != 0),  # no rows at all fit any buffer
    "dispatch x requires grad": Fault("dispatch", _requires_grad("x"), ("x",), when=_plain_x),
    "dispatch x no channels": Fault("dispatch", _set("x", lambda x, ctx, p: x[:, :0].contiguous()), ("x", "hidden"),
                                    when=_plain_x),
    "dispatch quantize unfit x": Fault("dispatch", _value("quantize"), ("quantize", "hidden", "x"), quant.FP8_FORMATS,
                                       when=lambda ex: not ex.fits_fp8),
    # dispatch: an FP8 tuple
    "dispatch fp8 scales dtype": Fault("dispatch", _fp8_tuple_fault(lambda x, p: (x[0], x[1].to(getattr(torch, p)))),
                                       ("x",), ("float64", "int64", "float16"), when=lambda ex: ex.x_form == "tuple"),
    "dispatch fp8 scales shape": Fault("dispatch", _fp8_tuple_fault(lambda x, p: (x[0], x[1][:, :0].contiguous())),
                                       ("x",), when=lambda ex: ex.x_form == "tuple"),
    "dispatch fp8 data dtype": Fault("dispatch", _fp8_tuple_fault(lambda x, p: (
        x[0].view(torch.uint8) if p == "uint8" else x[0].float().to(torch.float8_e5m2), x[1])), ("x",),
        ("uint8", "float8_e5m2"), when=lambda ex: ex.x_form == "tuple"),
    "dispatch fp8 data misaligned": Fault("dispatch", _fp8_tuple_fault(lambda x, p: (_misaligned(x[0]), x[1])), ("x",),
                                          when=lambda ex: ex.x_form == "tuple", needs_tokens=True),
    "dispatch fp8 tuple length": Fault("dispatch", _fp8_tuple_fault(lambda x, p: (*x, x[1])), ("x",),
                                       when=lambda ex: ex.x_form == "tuple"),
    "dispatch fp8 scales on meta": Fault("dispatch", _fp8_tuple_fault(lambda x, p: (x[0], x[1].to("meta"))), ("x",),
                                         when=lambda ex: ex.x_form == "tuple"),
    "dispatch fp8 scales sparse": Fault("dispatch", _fp8_tuple_fault(lambda x, p: (x[0], _sparse(x[1], p))), ("x",),
                                        ("sparse_coo", "sparse_csr"), when=lambda ex: ex.x_form == "tuple",
                                        needs_tokens=True),
    "dispatch fp8 scales non-contiguous": Fault("dispatch", _fp8_tuple_fault(lambda x, p: (x[0], _noncontiguous(x[1]))),
                                                ("x",), when=lambda ex: ex.x_form == "tuple", needs_tokens=True),
    "dispatch fp8 tuple and quantize": Fault("dispatch", _value("quantize"), ("quantize",), quant.FP8_FORMATS,
                                             when=lambda ex: ex.x_form == "tuple"),
    # dispatch: topk_idx and topk_weights
    **_tensor_faults("dispatch", "topk_idx", ("int32", "float32", "int16", "uint8")),
    "dispatch topk_idx extra row": Fault("dispatch", _set("topk_idx", lambda t, ctx, p: torch.cat(
        [t, torch.full_like(t[:1], -1) if t.shape[0] else torch.full((1, t.shape[1]), -1)])), ("topk_idx",)),
    "dispatch topk_idx no columns": Fault("dispatch", _set("topk_idx", lambda t, ctx, p: t[:, :0].contiguous()),
                                          ("topk_idx",)),
    "dispatch topk_idx more columns than experts": Fault("dispatch", _set("topk_idx", lambda t, ctx, p: torch.cat(
        [t, torch.full((t.shape[0], ctx.ex.num_experts + 1 - t.shape[1]), -1)], dim=1)),
        ("topk_idx", "num_topk", "topk_weights", "num_experts")),
    **_tensor_faults("dispatch", "topk_weights", ("float16", "bfloat16", "int64"), _with_weights, optional=True),
    "dispatch topk_weights float64 with other x": Fault("dispatch", _set("topk_weights", lambda t, ctx, p: t.double()),
                                                        ("topk_weights",),
                                                        when=lambda ex: _with_weights(ex) and ex.dtype != "float64"),
    "dispatch topk_weights shape": Fault("dispatch", _set("topk_weights", lambda t, ctx, p: torch.cat(
        [t, t[:, :1]], dim=1)), ("topk_weights",), when=_with_weights),
    "dispatch topk_weights requires grad": Fault("dispatch", _requires_grad("topk_weights"), ("topk_weights",),
                                                 when=_with_weights),
    # dispatch: the other arguments
    "dispatch num_experts": Fault("dispatch", _value("num_experts"), ("num_experts",),
                                  (0, -2, 7, None, "float of it", True, "numpy int", "8", 2**40)),
    "dispatch num_max_tokens_per_rank": Fault("dispatch", _value("num_max_tokens_per_rank"),
                                              ("num_max_tokens_per_rank",), (-1, 1.5, "8", True, TOO_MANY_TOKENS)),
    "dispatch num_max_tokens_per_rank below tokens": Fault(
        "dispatch", _set("num_max_tokens_per_rank", lambda v, ctx, p: min(ctx.ex.num_tokens) - 1),
        ("num_max_tokens_per_rank",), needs_tokens=True),
    "dispatch expert_alignment": Fault("dispatch", _value("expert_alignment"), ("expert_alignment",),
                                       (0, -1, 1025, 2.0, True, None)),
    "dispatch num_sms": Fault("dispatch", _value("num_sms"), ("num_sms",), (-1, 1.5, None, "0")),
    "dispatch do_cpu_sync": Fault("dispatch", _value("do_cpu_sync"), ("do_cpu_sync",), (1, 0, "yes", 1.0)),
    "dispatch do_expand": Fault("dispatch", _value("do_expand"), ("do_expand",), (1, 0, None, "no")),
    "dispatch quantize name": Fault("dispatch", _value("quantize"), ("quantize",), ("fp4", "FP8_BLOCK128", "", 1)),
    "dispatch dequantize": Fault("dispatch", _value("dequantize"), ("dequantize",), (1, "yes", None)),
    "dispatch dequantize without fp8": Fault("dispatch", _value("dequantize"), ("dequantize",), (True,),
                                             when=lambda ex: ex.x_form == "tensor"),
    "dispatch previous_event": Fault("dispatch", _value("previous_event"), ("previous_event",), ("object", 1)),
    "dispatch async_with_compute_stream": Fault("dispatch", _value("async_with_compute_stream"),
                                                ("async_with_compute_stream",), (1, None, "yes")),
    "dispatch allocate_on_comm_stream": Fault("dispatch", _value("allocate_on_comm_stream"),
                                              ("allocate_on_comm_stream",), (1, None)),
    "dispatch handle": Fault("dispatch", _value("handle"), ("handle",), ("h", "object")),
    # cached dispatch (handle=): what must repeat the handle's, and what it must not be given
    "cached topk_idx": Fault("cached", lambda kw, ctx, p: kw.update(topk_idx=ctx.topk_idx) or True, ("topk_idx",)),
    "cached topk_weights": Fault("cached", lambda kw, ctx, p: kw.update(topk_weights=closed_weights(
        ctx.rank, ctx.num_tokens, ctx.ex.num_topk).float()) or True, ("topk_weights",)),
    "cached do_cpu_sync": Fault("cached", _value("do_cpu_sync"), ("do_cpu_sync",), (True,)),
    "cached do_expand": Fault("cached", _set("do_expand", lambda v, ctx, p: not v), ("do_expand",)),
    # A non-expand handle's alignment only rounded its counts list: its cached dispatch takes the handle's.
    "cached expert_alignment": Fault("cached", _set("expert_alignment", lambda v, ctx, p: v + 1),
                                     ("expert_alignment",), when=lambda ex: ex.do_expand),
    "cached num_tokens": Fault("cached", _set("x", lambda x, ctx, p: torch.cat([x, x[:1] if x.shape[0] else torch.zeros(
        1, *x.shape[1:], dtype=x.dtype)])), ("x", "num_tokens"), when=_plain_x),
    "cached num_experts": Fault("cached", lambda kw, ctx, p: kw.update(num_experts=ctx.ex.num_experts + 2) or True,
                                ("num_experts",)),
    "cached num_max_tokens_per_rank": Fault("cached", lambda kw, ctx, p: kw.update(
        num_max_tokens_per_rank=ctx.num_max_tokens_per_rank - 1 or 2) or True, ("num_max_tokens_per_rank",)),
    "cached handle": Fault("cached", _value("handle"), ("handle", "topk_idx"), (None, "h", "object")),
    "cached x dtype": Fault("cached", _set("x", lambda x, ctx, p: x.to(torch.float16)), ("x",), when=_plain_x),
    # combine
    **_tensor_faults("combine", "x", ("float16", "int32", "float8_e4m3fn"), rows=True),
    "combine x extra row": Fault("combine", _set("x", lambda x, ctx, p: torch.cat([x, x.new_zeros(1, x.shape[1])])),
                                 ("x",)),
    "combine x row bytes": Fault("combine", _set("x", lambda x, ctx, p: torch.cat([x, x[:, :1]], dim=1)), ("x",)),
    "combine x no channels": Fault("combine", lambda kw, ctx, p: kw.update(
        x=kw["x"][:, :0].contiguous(), bias=ctx.bias_like(kw["bias"], 0)) or True, ("x", "hidden")),
    "combine x requires grad": Fault("combine", _requires_grad("x"), ("x",)),
    "combine x too wide": Fault("combine", lambda kw, ctx, p: kw.update(
        x=kw["x"].new_zeros(kw["x"].shape[0], TOO_WIDE_ROW_BYTES // kw["x"].element_size()),
        bias=ctx.bias_like(kw["bias"], TOO_WIDE_ROW_BYTES // kw["x"].element_size())) or True,
        ("x", "buffer too small", "hidden"), when=lambda ex: ex.num_max_tokens_per_rank != 0),
    **_tensor_faults("combine", "topk_weights", ("float16", "bfloat16", "int64"),
                     lambda ex: ex.combine_weights_dtype is not None, optional=True),
    "combine topk_weights shape": Fault("combine", _set("topk_weights", lambda t, ctx, p: (
        t[:, None] if t.dim() == 1 else torch.cat([t, t[:, :1]], dim=1)).contiguous()), ("topk_weights",),
        when=lambda ex: ex.combine_weights_dtype is not None),
    "combine topk_weights requires grad": Fault("combine", _requires_grad("topk_weights"), ("topk_weights",),
                                                when=lambda ex: ex.combine_weights_dtype is not None),
    "combine bias requires grad": Fault("combine", _set_if("bias", lambda b, ctx, p: b.detach().requires_grad_()
                                                          if isinstance(b, torch.Tensor) else
                                                          type(b)(t.detach().requires_grad_() for t in b),
                                                          lambda b: False), ("bias",),
                                        when=lambda ex: ex.bias_form != "none"),
    "combine topk_weights float64 with other x": Fault(
        "combine", _set("topk_weights", lambda t, ctx, p: t.double()), ("topk_weights",),
        when=lambda ex: ex.combine_weights_dtype is not None and ex.combine_dtype != "float64"),
    "combine bias shape": Fault("combine", _set("bias", lambda b, ctx, p: ctx.bias_like(b, ctx.ex.hidden,
                                                                                        extra_rows=1)),
                                ("bias",), when=lambda ex: ex.bias_form != "none"),
    "combine bias dtype": Fault("combine", _set("bias", lambda b, ctx, p: ctx.bias_like(b, ctx.ex.hidden,
                                                                                         dtype=torch.float16)),
                                ("bias",), when=lambda ex: ex.bias_form != "none"),
    "combine bias non-contiguous": Fault("combine", _set_if("bias", lambda b, ctx, p: _noncontiguous(torch.zeros(
        ctx.num_tokens, ctx.ex.hidden, dtype=DTYPES[ctx.ex.combine_dtype])), _not_contiguous), ("bias",),
        needs_tokens=True),
    "combine bias misaligned": Fault("combine", _set_if("bias", lambda b, ctx, p: _misaligned(torch.zeros(
        ctx.num_tokens, ctx.ex.hidden, dtype=DTYPES[ctx.ex.combine_dtype])), _misaligned_ptr), ("bias",),
        needs_tokens=True),
    "combine bias value": Fault("combine", _value("bias"), ("bias",), ("object", 1.0, (None,), "numpy array")),
    "combine three biases": Fault("combine", lambda kw, ctx, p: kw.update(bias=(kw["x"],) * 3) or True, ("bias",)),
    "combine handle": Fault("combine", _value("handle"), ("handle",), (None, "h", "object")),
    "combine num_sms": Fault("combine", _value("num_sms"), ("num_sms",), (-1, 1.5, None)),
    "combine previous_event": Fault("combine", _value("previous_event"), ("previous_event",), ("object",)),
    "combine async_with_compute_stream": Fault("combine", _value("async_with_compute_stream"),
                                               ("async_with_compute_stream",), (1, None)),
}


# ------------------------------------------------------------------------------------------------
# Rank side
# ------------------------------------------------------------------------------------------------
_BUFFERS: dict[int, moe_comm.Buffer] = {}


def example_buffer(world_size: int) -> moe_comm.Buffer:
    """One Buffer per rank for every example: state left behind by one call is the next call's problem."""
    if world_size not in _BUFFERS:
        _BUFFERS[world_size] = moe_comm.Buffer(
            None, num_max_tokens_per_rank=MAX_TOKENS, hidden=MAX_ROW_BYTES // 2, num_topk=MAX_TOPK,
            use_fp8_dispatch=True, backend="torch", deterministic=True, num_cpu_timeout_secs=5)
    return _BUFFERS[world_size]


class RankContext:
    """An example's tensors on one rank."""

    def __init__(self, ex: Example, rank: int) -> None:
        self.ex, self.rank = ex, rank
        self.num_tokens = ex.num_tokens[rank]
        self.num_max_tokens_per_rank = MAX_TOKENS if ex.num_max_tokens_per_rank is None else ex.num_max_tokens_per_rank
        self.case = ex.case(self.num_max_tokens_per_rank)
        self.topk_idx = torch.tensor(ex.topk_idx[rank], dtype=torch.int64).view(self.num_tokens, ex.num_topk)
        self.routing = []   # what every rank's dispatch must route: (valid topk_idx, float64 weights)
        for s in range(WORLD_SIZE):
            valid = valid_routing(ex.topk_idx[s], ex.num_experts, ex.num_topk)
            self.routing.append((valid, closed_weights(s, ex.num_tokens[s], ex.num_topk)))
        self.values_valid = all(is_valid(t, ex.num_experts) for t in ex.topk_idx)
        self.fp8 = None if ex.x_form == "tensor" else ex.fp8_format

    def x(self, salt: int = 0):
        """x as the example passes it: rows, rows to quantize, or a pre-quantized tuple."""
        ex = self.ex
        rows = own_rows(self.case, self.rank, ex.hidden, DTYPES[ex.dtype], salt)
        return quant.quantize(rows, ex.fp8_format) if ex.x_form == "tuple" else rows

    def bias(self) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(self.ex.seed * 31 + self.rank)
        num_bias = {"none": 0, "tensor": 1, "one": 1, "two": 2, "list": 2}[self.ex.bias_form]
        return tuple(torch.randn(self.num_tokens, self.ex.hidden, generator=g, dtype=torch.float64)
                     .to(DTYPES[self.ex.combine_dtype]) for _ in range(num_bias))

    def bias_like(self, bias, hidden: int, extra_rows: int = 0, dtype: Optional[torch.dtype] = None):
        """Zero biases in the example's form with another width, row count or dtype (None stays None)."""
        if bias is None:
            return None
        dtype = dtype or DTYPES[self.ex.combine_dtype]
        b = [torch.zeros(self.num_tokens + extra_rows, hidden, dtype=dtype)] * max(1, len(self.bias()))
        form = self.ex.bias_form
        return b[0] if form == "tensor" else list(b) if form == "list" else tuple(b)


def apply_faults(kw: dict, ctx: RankContext, faults) -> tuple[tuple[str, ...], bool]:
    """Apply `faults` to `kw`; returns the words a refusal must name and whether one of them must cause it."""
    words, must_refuse = (), False
    for name, param in faults:
        fault = FAULTS[name]
        if fault.apply(kw, ctx, param):  # (a fault that turned out valid excuses no refusal)
            words, must_refuse = words + fault.words, True
    return words, must_refuse


class Outcomes:
    """Each call's outcome on this rank, and what was wrong about it."""

    def __init__(self) -> None:
        self.outcomes: list[str] = []
        self.problems: list[str] = []
        self.broken = False   # an unexpected exception: peers may be stuck, stop here

    def call(self, stage: str, fn: Callable[[], object], words: tuple[str, ...], must_refuse: bool):
        """Run `fn`; returns its result, or None when it raised (recorded)."""
        try:
            result = fn()
        except (TypeError, ValueError) as exc:
            message = f"{type(exc).__name__}: {exc}"
            self.outcomes.append(f"{stage} refused: {type(exc).__name__}")
            if not words:
                self.problems.append(f"{stage}: a valid call was refused: {message}")
            elif not any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(w)}(?![A-Za-z0-9_])", str(exc)) for w in words):
                self.problems.append(f"{stage}: the message names none of {words}: {message}")
            return None
        except Exception as exc:  # noqa: BLE001 - any other type is the finding
            self.outcomes.append(f"{stage} raised {type(exc).__name__}")
            self.problems.append(f"{stage}: raised {type(exc).__name__}, not TypeError/ValueError: {exc}\n"
                                 f"{traceback.format_exc()}")
            self.broken = True
            return None
        self.outcomes.append(f"{stage} accepted")
        if must_refuse:
            self.problems.append(f"{stage}: accepted although an argument is wrong (expected a message naming one "
                                 f"of {words})")
        return result

    def check(self, stage: str, checks: Checks) -> None:
        self.problems += [f"{stage}: {failure}" for failure in checks.failures]


class Pending:
    """The event of an async dispatch that is handed to the next call as `previous_event` instead of being waited on:
    an accepted call must have completed it; the dispatch's outputs are checked once it is."""

    def __init__(self, event: Optional[EventOverlap], check: Callable[[], None]) -> None:
        self.event, self.check = event, check
        if event is None:
            check()

    def take(self) -> Optional[EventOverlap]:
        return self.event

    def settle(self, out: Outcomes, stage: str) -> None:
        if self.event is None:
            return
        if out.outcomes[-1] == f"{stage} accepted" and not self.event.done:
            out.problems.append(f"{stage}: accepted with the dispatch's event as previous_event, which is not complete")
        self.event.current_stream_wait()
        self.event = None
        self.check()


def run_example(rank: int, world_size: int, ex: Example) -> dict:
    """One example on this rank: `{"outcomes": [...], "problems": [...]}` (problems empty when all is right)."""
    buf = example_buffer(world_size)
    ctx = RankContext(ex, rank)
    out = Outcomes()
    do_cpu_sync = ex.do_cpu_sync is not False
    dispatched = dispatch_stage(buf, ctx, out, do_cpu_sync)
    if dispatched is not None:
        handle, expected, pending = dispatched
        if ex.cached_faults is not None and not out.broken:
            cached_stage(buf, ctx, out, handle, expected, pending)
        if ex.combine_dtype is not None and not out.broken:
            combine_stage(buf, ctx, out, handle, expected, pending, do_cpu_sync)
    if not out.broken:
        final_sync(buf, ctx, out, dispatched is not None and not ctx.values_valid and not do_cpu_sync,
                   None if dispatched is None else dispatched[2])
    return {"outcomes": out.outcomes, "problems": out.problems}


def dispatch_stage(buf: moe_comm.Buffer, ctx: RankContext, out: Outcomes, do_cpu_sync: bool):
    """The example's dispatch; when accepted, `(handle, expected receive, Pending)`."""
    ex, rank, case = ctx.ex, ctx.rank, ctx.case
    weights_dtype = getattr(torch, ex.weights_dtype) if ex.weights_dtype else None
    kw = dict(x=ctx.x(), topk_idx=ctx.topk_idx.clone(),
              topk_weights=ctx.routing[rank][1].to(weights_dtype) if weights_dtype else None,
              num_experts=ex.num_experts, num_max_tokens_per_rank=ex.num_max_tokens_per_rank,
              expert_alignment=ex.expert_alignment, num_sms=ex.num_sms, handle=None, do_cpu_sync=ex.do_cpu_sync,
              do_expand=ex.do_expand, quantize=ex.fp8_format if ex.x_form == "quantize" else None,
              dequantize=ex.dequantize, previous_event=EventOverlap() if ex.previous_event else None,
              async_with_compute_stream=ex.async_with_compute_stream,
              allocate_on_comm_stream=ex.allocate_on_comm_stream)
    words, must_refuse = apply_faults(kw, ctx, ex.faults)
    if not ctx.values_valid and do_cpu_sync and not must_refuse:
        # Bad topk_idx values (on any rank) raise at the count exchange of a synchronizing dispatch.
        words, must_refuse = words + ("topk_idx",), True
    result = out.call("dispatch", lambda: buf.dispatch(**kw), words, must_refuse)
    if result is None:
        return None
    expected = expected_receive(case, rank, ctx.routing)

    def check() -> None:
        checks = Checks()
        check_layout(checks, case, expected, result[:4], ex.do_expand, do_cpu_sync, weights_dtype)
        check_rows(checks, "recv_x", case, expected, result[0], ex.do_expand, ex.hidden, DTYPES[ex.dtype],
                   fp8=ctx.fp8, dequantize=ex.dequantize)
        out.check("dispatch", checks)

    event = result[4] if ex.async_with_compute_stream else None
    if event is not None and not ex.chain_event:
        event.current_stream_wait()
        event = None
    return result[3], expected, Pending(event, check)


def call_with_faults(out: Outcomes, ctx: RankContext, stage: str, method: Callable, kw: dict, faults,
                     pending: Pending):
    """`method(**kw)` after `faults`; the dispatch's pending event settled after it. None when refused or broken."""
    words, must_refuse = apply_faults(kw, ctx, faults)
    result = out.call(stage, lambda: method(**kw), words, must_refuse)
    if out.broken:
        return None
    pending.settle(out, stage)
    return result


def cached_stage(buf: moe_comm.Buffer, ctx: RankContext, out: Outcomes, handle, expected, pending: Pending) -> None:
    ex = ctx.ex
    kw = dict(x=ctx.x(salt=1), handle=handle, do_expand=ex.do_expand, expert_alignment=ex.expert_alignment,
              quantize=ex.fp8_format if ex.x_form == "quantize" else None, dequantize=ex.dequantize,
              do_cpu_sync=ex.cached_do_cpu_sync, num_experts=None, num_max_tokens_per_rank=None, topk_idx=None,
              topk_weights=None, previous_event=pending.take())
    cached = call_with_faults(out, ctx, "cached dispatch", buf.dispatch, kw, ex.cached_faults, pending)
    if cached is not None:
        checks = Checks()
        checks.equal("cached dispatch returns its handle", cached[3] is handle, True)
        check_rows(checks, "cached recv_x", ctx.case, expected, cached[0], ex.do_expand, ex.hidden, DTYPES[ex.dtype],
                   salt=1, fp8=ctx.fp8, dequantize=ex.dequantize)
        out.check("cached dispatch", checks)


def combine_stage(buf: moe_comm.Buffer, ctx: RankContext, out: Outcomes, handle, expected, pending: Pending,
                  do_cpu_sync: bool) -> None:
    """Combine rows built from the closed form (rows past the valid ones NaN, and they must not matter)."""
    ex, rank, case = ctx.ex, ctx.rank, ctx.case
    dtype = DTYPES[ex.combine_dtype]
    num_rows = expected.num_rows(ex.do_expand)
    num_recv_rows = expected.output_rows(case, ex.do_expand, do_cpu_sync)
    rows = torch.zeros(num_recv_rows, ex.hidden, dtype=torch.float64)
    rows[:num_rows] = expected.rows(case, ex.hidden, torch.float64, ex.do_expand)
    y = expert_rows(case, expected, rank, rows, ex.do_expand, dtype)
    cw_dtype = getattr(torch, ex.combine_weights_dtype) if ex.combine_weights_dtype else None
    cw = None
    if cw_dtype is not None:
        recv_w = expected.expand_weights if ex.do_expand else expected.topk_weights
        cw = torch.full((num_recv_rows, *recv_w.shape[1:]), float("nan"), dtype=cw_dtype)
        cw[:num_rows] = recv_w.to(cw_dtype) * 2
    bias = ctx.bias()
    bias_arg = {"none": None, "tensor": bias[0] if bias else None, "one": bias, "two": bias,
                "list": list(bias)}[ex.bias_form]
    kw = dict(x=y, handle=handle, topk_weights=cw, bias=bias_arg, num_sms=0, previous_event=pending.take(),
              async_with_compute_stream=ex.combine_async, allocate_on_comm_stream=False)
    combined = call_with_faults(out, ctx, "combine", buf.combine, kw, ex.combine_faults, pending)
    if combined is not None:
        if ex.combine_async:
            combined[2].current_stream_wait()
        valid_idx, weights = ctx.routing[rank]
        want_x, want_w = expected_combine(case, rank, valid_idx, None if cw is None else weights.to(cw_dtype),
                                          ex.hidden, dtype, bias)
        checks = Checks()
        checks.rows("combined_x", combined[0], want_x)
        checks.same("combined_topk_weights", combined[1], want_w)
        out.check("combine", checks)


def final_sync(buf: moe_comm.Buffer, ctx: RankContext, out: Outcomes, deferred: bool,
               pending: Optional[Pending]) -> None:
    """The next synchronizing call raises the slots a dispatch without CPU sync dropped (`deferred`), and only then:
    `barrier()`, or a valid dispatch with a CPU sync (given a still pending event as `previous_event`)."""
    words = ("topk_idx",) if deferred else ()
    if ctx.ex.final_sync == "barrier":
        if pending is not None:
            pending.settle(out, "nothing")
        out.call("barrier", buf.barrier, words, deferred)
        return
    x = own_rows(ctx.case, ctx.rank, 8, torch.float32)
    event = None if pending is None else pending.take()
    out.call("synchronizing dispatch", lambda: buf.dispatch(x, ctx.routing[ctx.rank][0], num_experts=ctx.ex.num_experts,
                                                            previous_event=event), words, deferred)
    if pending is not None:
        pending.settle(out, "synchronizing dispatch")


# ------------------------------------------------------------------------------------------------
# The property
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pool(pools):
    return pools(WORLD_SIZE)


# ------------------------------------------------------------------------------------------------
# Every fault of the catalogue, each parameter once, on a fixed valid call
# ------------------------------------------------------------------------------------------------
# Two tokens per rank, each rank receiving four rows (so the faults that need two rows show), weights, a cached
# dispatch and a combine with weights and two biases; as BF16 rows, as an FP8 tuple, as float32 rows that do not
# fit the FP8 formats, and in the expand layout. A fault goes on the first of these its `when` accepts.
_SWEEP_BASE = Example(seed=1, num_tokens=(2, 2), hidden=128, dtype="bfloat16", num_experts=4, num_topk=2,
                      topk_idx=(((0, 2), (1, 3)), ((0, 3), (2, 1))), weights_dtype="float32", cached_faults=(),
                      combine_dtype="bfloat16", combine_weights_dtype="float32", bias_form="two")
SWEEP_TEMPLATES = (_SWEEP_BASE, dataclasses.replace(_SWEEP_BASE, x_form="tuple"),
                   dataclasses.replace(_SWEEP_BASE, dtype="float32", hidden=8, combine_dtype="float32"),
                   dataclasses.replace(_SWEEP_BASE, do_expand=True))


def sweep_examples() -> list:
    """One `pytest.param` per fault and parameter, the fault on the first template that admits it; first the
    templates without a fault (each must be accepted, or a refusal of one would pass for its faults' refusals)."""
    params = [pytest.param(template, id=f"template {i}") for i, template in enumerate(SWEEP_TEMPLATES)]
    for name, fault in FAULTS.items():
        template = next((t for t in SWEEP_TEMPLATES if fault.when(t)), None)
        assert template is not None, f"no sweep template admits the fault {name!r}"
        stage = {"dispatch": "faults", "cached": "cached_faults", "combine": "combine_faults"}[fault.stage]
        for param in fault.params:
            params.append(pytest.param(dataclasses.replace(template, **{stage: ((name, param),)}),
                                       id=f"{name}-{param}"))
    return params


def test_sweep_templates_receive_two_rows_everywhere():
    for template in SWEEP_TEMPLATES:
        assert min(template.num_tokens) > 1 and min(num_recv_rows(template)) > 1, template


@pytest.mark.parametrize("ex", sweep_examples())
def test_each_fault_of_the_catalogue(pool, ex):
    outcomes = check_example(pool, ex)
    if not (ex.faults or ex.cached_faults or ex.combine_faults):
        assert outcomes == ["dispatch accepted", "cached dispatch accepted", "combine accepted", "barrier accepted"]


def _regression(*faults, stage: str = "dispatch", x_form: str = "tensor") -> Example:
    """A small valid call with `faults` (found by this test, fixed since)."""
    ex = Example(seed=0, num_tokens=(2, 2), hidden=128, dtype="bfloat16", num_experts=2, num_topk=1,
                 topk_idx=(((0,), (1,)), ((1,), (-1,))), weights_dtype="float32", x_form=x_form)
    if stage == "combine":
        return dataclasses.replace(ex, combine_dtype="bfloat16", combine_faults=faults)
    return dataclasses.replace(ex, faults=faults)


@settings(max_examples=NUM_EXAMPLES, deadline=None, derandomize=True, database=None)
@given(ex=examples())
# A meta tensor passed the device check on the CPU (get_device() is -1 for both): RuntimeError inside the dispatch.
@example(ex=_regression(("dispatch x on meta", None)))
@example(ex=_regression(("dispatch topk_idx on meta", None)))
@example(ex=_regression(("combine x on meta", None), stage="combine"))
# A sparse CSR tensor made the contiguity check itself raise RuntimeError ("do not have is_contiguous").
@example(ex=_regression(("dispatch x sparse", "sparse_csr")))
@example(ex=_regression(("dispatch topk_weights sparse", "sparse_csr")))
@example(ex=_regression(("combine x sparse", "sparse_csr"), stage="combine"))
@example(ex=_regression(("dispatch fp8 scales sparse", "sparse_csr"), x_form="tuple"))  # (in quant.check_fp8_tuple)
def test_dispatch_and_combine_arguments(pool, ex):
    for outcome in check_example(pool, ex):
        event(outcome)  # pytest --hypothesis-show-statistics: how often each call was accepted or refused


def check_example(pool, ex: Example) -> list[str]:
    """Run `ex` on every rank; assert no problems and the same outcomes everywhere; return rank 0's outcomes."""
    results = pool.run(run_example, ex, timeout_s=90)
    problems = [f"rank {r}: {p}" for r, result in enumerate(results) for p in result["problems"]]
    if any("not TypeError/ValueError" in p for p in problems):
        pool.close()  # peers of a rank that raised may be stuck in a collective: start a fresh group
    assert not problems, "\n".join(problems)
    assert results[0]["outcomes"] == results[1]["outcomes"], results
    return results[0]["outcomes"]
