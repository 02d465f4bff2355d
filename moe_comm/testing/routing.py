"""Seeded routing cases and an independent oracle for dispatch and combine.

Every rank can build every rank's inputs (`rank_inputs(case, rank)`), so the expected result of any rank is
computed locally with plain per-token loops (`expected_dispatch`, `expected_combine`) that share no code with
the backends. Cases are drawn in the parent process (`draw_cases`) and sent to the ranks, so all ranks run
the same case.

The combine check needs expert outputs that both sides can produce: `expert_output(rows, global_expert)` maps
a received row and the global expert it is for to a row of the same dtype (an elementwise float32 op, hence
bitwise reproducible wherever it runs). Non-expand rows use the receiving rank as "expert" (`rank * L`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class Case:
    """One dispatch/combine configuration, identical on every rank."""

    seed: int
    num_ranks: int
    num_experts: int
    num_topk: int
    hidden: int
    num_tokens: tuple[int, ...]        # per rank
    num_max_tokens_per_rank: int
    dtype: str = "bfloat16"
    drop_prob: float = 0.1             # chance of a -1 slot
    do_expand: bool = False
    expert_alignment: int = 1
    do_cpu_sync: bool = True
    with_weights: bool = True
    num_bias: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks


def draw_cases(seed: int, count: int, num_ranks: int, max_tokens: int = 300, max_experts: int = 64,
               max_topk: int = 9, dtypes: tuple[str, ...] = ("bfloat16", "float32", "float64")) -> list[Case]:
    """`count` random cases for `num_ranks` ranks (drawn in the parent, deterministic in `seed`)."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        dtype = rng.choice(dtypes)
        elem = DTYPES[dtype].itemsize
        num_local = rng.randint(1, max(1, max_experts // num_ranks))
        num_experts = num_local * num_ranks
        num_topk = rng.randint(1, min(max_topk, num_experts))
        # Rows are multiples of 16 bytes; not every hidden is a multiple of 128.
        hidden = rng.choice([16 // elem * k for k in (1, 3, 5, 8, 13)] + [128, 384])
        num_tokens = tuple(rng.choice([0, rng.randint(1, max_tokens)]) if rng.random() < 0.15
                           else rng.randint(1, max_tokens) for _ in range(num_ranks))
        cases.append(Case(seed=seed * 100003 + i, num_ranks=num_ranks, num_experts=num_experts, num_topk=num_topk,
                          hidden=hidden, num_tokens=num_tokens,
                          num_max_tokens_per_rank=max(num_tokens + (1,)) + rng.choice([0, 0, 7]),
                          dtype=dtype, drop_prob=rng.choice([0.0, 0.1, 0.5]), do_expand=rng.random() < 0.5,
                          expert_alignment=rng.choice([1, 1, 2, 16]), do_cpu_sync=rng.random() < 0.6,
                          with_weights=rng.random() < 0.8, num_bias=rng.choice([0, 1, 2])))
    return cases


def rank_inputs(case: Case, rank: int, device: str | torch.device = "cpu"
                ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """`(x [N, H], topk_idx [N, K] int64, topk_weights [N, K] float32|float64 or None)` of `rank`."""
    g = torch.Generator().manual_seed(case.seed * 1009 + rank)
    n, k, e = case.num_tokens[rank], case.num_topk, case.num_experts
    x = torch.randn(n, case.hidden, generator=g, dtype=torch.float64).to(case.torch_dtype)
    # Skewed gate: some experts are popular, so ranks receive uneven counts.
    popularity = torch.rand(e, generator=g, dtype=torch.float64) * 3
    scores = torch.rand(n, e, generator=g, dtype=torch.float64) + popularity
    topk_idx = scores.topk(k, dim=1).indices if n else torch.empty(0, k, dtype=torch.int64)
    topk_idx = topk_idx[:, torch.randperm(k, generator=g)] if n else topk_idx
    dropped = torch.rand(n, k, generator=g) < case.drop_prob
    topk_idx = torch.where(dropped, -1, topk_idx).contiguous()
    weights = None
    if case.with_weights:
        wdtype = torch.float64 if case.torch_dtype == torch.float64 else torch.float32
        weights = torch.rand(n, k, generator=g, dtype=torch.float64).to(wdtype)
    return x.to(device), topk_idx.to(device), None if weights is None else weights.to(device)


def rank_bias(case: Case, rank: int, device: str | torch.device = "cpu") -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(case.seed * 7919 + rank)
    return tuple(torch.randn(case.num_tokens[rank], case.hidden, generator=g, dtype=torch.float64)
                 .to(case.torch_dtype).to(device) for _ in range(case.num_bias))


def expert_output(rows: torch.Tensor, global_expert: torch.Tensor) -> torch.Tensor:
    """A made-up expert: `rows * (1 + e / 8) - e / 16` in float32 (float64 for float64), cast back."""
    acc = torch.float64 if rows.dtype == torch.float64 else torch.float32
    e = global_expert.to(acc)[:, None]
    return (rows.to(acc) * (1 + e / 8) - e / 16).to(rows.dtype)


@dataclass
class ExpectedDispatch:
    """What `rank` must receive (rows in deterministic order)."""

    x: torch.Tensor               # [P, H]
    topk_idx: Optional[torch.Tensor]   # [P, K] local ids (non-expand)
    topk_weights: Optional[torch.Tensor]   # [P, K] or [P]
    src: list[tuple[int, int]]    # (source rank, source token) per non-expand row
    num_recv_tokens_per_rank: list[int]
    num_recv_tokens_per_expert: list[int]  # aligned


def expected_dispatch(case: Case, rank: int) -> ExpectedDispatch:
    """The oracle: loop over source ranks and tokens in order and pick what belongs to `rank`."""
    L, K, H = case.num_local_experts, case.num_topk, case.hidden
    rows, idx_rows, w_rows, src = [], [], [], []
    per_rank = [0] * case.num_ranks
    for s in range(case.num_ranks):
        x, topk_idx, w = rank_inputs(case, s)
        for t in range(case.num_tokens[s]):
            experts = topk_idx[t].tolist()
            local = [e - rank * L if e >= 0 and e // L == rank else -1 for e in experts]
            if all(v < 0 for v in local):
                continue
            per_rank[s] += 1
            rows.append(x[t])
            idx_rows.append(local)
            src.append((s, t))
            if w is not None:
                w_rows.append([float(w[t, j]) if local[j] >= 0 else 0.0 for j in range(K)])
    wdtype = torch.float64 if case.torch_dtype == torch.float64 else torch.float32
    x_all = torch.stack(rows) if rows else torch.empty(0, H, dtype=case.torch_dtype)
    idx_all = torch.tensor(idx_rows, dtype=torch.int64).view(-1, K)
    w_all = torch.tensor(w_rows, dtype=wdtype).view(-1, K) if case.with_weights else None
    counts = [sum(1 for r in idx_rows if l in r) for l in range(L)]
    a = case.expert_alignment
    aligned = [-(-c // a) * a for c in counts]
    if not case.do_expand:
        return ExpectedDispatch(x_all, idx_all, w_all, src, per_rank, aligned)
    ex_rows, ex_w = [], []
    for l in range(L):
        members = [i for i, r in enumerate(idx_rows) if l in r]
        for i in members:
            ex_rows.append(x_all[i])
            ex_w.append(w_all[i, idx_rows[i].index(l)] if w_all is not None else 0.0)
        for _ in range(aligned[l] - len(members)):
            ex_rows.append(torch.zeros(H, dtype=case.torch_dtype))
            ex_w.append(0.0)
    ex_x = torch.stack(ex_rows) if ex_rows else torch.empty(0, H, dtype=case.torch_dtype)
    ex_w_t = torch.tensor([float(v) for v in ex_w], dtype=wdtype) if case.with_weights else None
    return ExpectedDispatch(ex_x, None, ex_w_t, src, per_rank, aligned)


def expected_combine(case: Case, rank: int, partial: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Combined rows and weights of `rank`'s tokens after every receiver applied `expert_output`.

    Non-expand: receiver d's rows are `expert_output(row, d * L)`, scaled weights are `w * 3`; the sum runs
    over destination ranks in ascending order. Expand: each slot's row is `expert_output(row, e)` for its
    global expert e; the sum runs over slots in ascending order, or with `partial` (a Buffer's partial sums) over
    ranks in ascending order, each term the sum from zero of the token's slots on that rank in ascending order.
    Then the biases; accumulation in float32 (float64 for float64), starting from zero.
    """
    L = case.num_local_experts
    x, topk_idx, w = rank_inputs(case, rank)
    acc_dtype = torch.float64 if case.torch_dtype == torch.float64 else torch.float32
    acc = torch.zeros(x.shape, dtype=acc_dtype)
    for t in range(x.shape[0]):
        experts = topk_idx[t].tolist()
        if case.do_expand:
            for d in sorted({e // L for e in experts if e >= 0}) if partial else [None]:
                part = torch.zeros(x.shape[1], dtype=acc_dtype)
                for e in experts:
                    if e >= 0 and d in (None, e // L):
                        part += expert_output(x[t:t + 1], torch.tensor([e]))[0].to(acc_dtype)
                acc[t] += part
        else:
            for d in sorted({e // L for e in experts if e >= 0}):
                acc[t] += expert_output(x[t:t + 1], torch.tensor([d * L]))[0].to(acc_dtype)
    for b in rank_bias(case, rank):
        acc += b.to(acc_dtype)
    combined_w = None
    if w is not None:
        combined_w = torch.where(topk_idx >= 0, w * 3, torch.zeros_like(w))
    return acc.to(case.torch_dtype), combined_w

