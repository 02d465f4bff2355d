"""Route A's non-expand receiver: ways to sum each received row's local expert outputs, timed on one GPU.

The non-expand layout receives one row per (token, rank); Megatron's experts want one row per (token, local expert),
grouped by expert. So the receiver gathers (`index_select` by `src_rows`, P rows out of M) and, after the experts,
sums each received row's outputs back (`index_add` by `src_rows` until a983b80, bf16 atomics on CUDA;
`embedding_bag`, then moe_comm's kernel since: the last candidates here); the backward of each is the other's shape.
This times the sum's candidates and the gather, at DeepSeek-V3's hidden 7168 in bf16, at EP1 (4096 rows, all 8 of
each row's experts local: P = 32768) and as rank 0 of EP2 (8192 rows from two ranks' 4096 tokens, 128 of 256 experts
local: ~4 each), against a floor timed in the same run (a device-to-device copy moving as many bytes), and reports
each one's largest difference from the fp32 loop (0: the same bits). The bag candidates
time their set-up in every call (the receiver: once per layer forward, for both sums); the set-up and the kernel are
also timed alone, and the set-up as it was up to 1161b96 (an argsort of the expert rows by received row). The bag
candidates are `moe_comm.integrations.expert_rows.ExpertRows`, the receiver itself.

    python benchmarks/microbench/expert_sum.py [--json OUT.json] [--md OUT.md] [--only TEXT]
"""

from __future__ import annotations

import functools
import pathlib
import sys
import types

import torch

# The repository root: moe_comm without installing it.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from moe_comm.backends.cuda_kernels import load_kernels  # noqa: E402
from moe_comm.integrations.expert_rows import ExpertRows  # noqa: E402
from moe_comm.testing.bench import (  # noqa: E402
    candidates_markdown, median_time_us, record_parser, run_metadata, write_record)


def routing(num_rows: int, num_local: int, num_experts: int = 256, topk: int = 8, seed: int = 0):
    """Rows with at least one local expert: `(src_rows [P], inv [M, J], dest [M, L])`, as the dispatcher builds
    them (experts ascending, rows ascending inside an expert; `inv` lists a row's positions, ascending, padded with
    P, which reads a zero row; `dest` each (row, local expert)'s position, P where there is none)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(num_rows * 2, num_experts, generator=g).topk(topk, dim=1).indices
    idx = torch.where(idx < num_local, idx, -1)
    idx = idx[(idx >= 0).any(1)][:num_rows]
    m = idx.shape[0]
    is_local = (idx.unsqueeze(-1) == torch.arange(num_local)).any(1)  # [M, L]
    counts = is_local.sum(0)
    start = torch.cumsum(counts, 0) - counts
    pos = start + torch.cumsum(is_local.long(), 0) - 1
    num_out = int(counts.sum())
    dest = torch.where(is_local, pos, num_out)
    src_rows = torch.full((num_out + 1,), m, dtype=torch.int64).scatter(
        0, dest.flatten(), torch.arange(m * num_local) // num_local)[:num_out]
    j = min(topk, num_local)
    inv = dest.sort(dim=1).values[:, :j]
    return src_rows, inv, dest


def with_zero_row(y):
    return torch.cat([y, y.new_zeros(1, y.shape[1])])


# Each candidate: (expert rows y [P, H], routing r) -> [M, H].
CANDIDATES = {
    "index_add (before a983b80)": lambda y, r: y.new_zeros(r.m, y.shape[1]).index_add(0, r.src, y),
    "gather [M,J,H] + sum(1)": lambda y, r: with_zero_row(y).index_select(0, r.inv.flatten())
        .view(r.m, r.inv.shape[1], -1).sum(1),
    "J gathers, fp32 accumulator": lambda y, r: _loop(y, r.inv, torch.float32),
    "J gathers, bf16 accumulator": lambda y, r: _loop(y, r.inv, y.dtype),
    "embedding_bag": lambda y, r: ExpertRows(r.dest, y.shape[0], padded=False).sum(y),
    "moe_comm expert_sum kernel": lambda y, r: ExpertRows(r.dest, y.shape[0], padded=False, kernels=r.kernels).sum(y),
}


def _bags_by_argsort(src, m):
    """The bags as `ExpertRows` built them up to 1161b96: a stable argsort of the expert rows by received row."""
    order = torch.argsort(src, stable=True)
    lengths = torch.zeros(m + 1, dtype=torch.int64, device=src.device).scatter_add_(0, src, torch.ones_like(src))
    return order, torch.cat([lengths.new_zeros(1), torch.cumsum(lengths[:m], 0)])


def _loop(y, inv, acc_dtype):
    y = with_zero_row(y)
    acc = y.index_select(0, inv[:, 0]).to(acc_dtype)
    for j in range(1, inv.shape[1]):
        acc += y.index_select(0, inv[:, j])
    return acc.to(y.dtype)


def to_markdown(record: dict) -> str:
    """The record as a table (`candidates_markdown`), its cases' shapes and floors in the preamble."""
    about = ("Median of 20 calls, each from an idle GPU between two events on the stream (a call that takes the host "
             "longer to issue than the GPU to run shows the host's time). Cases: "
             + "; ".join(f"{c['case']}: {c['rows']} received rows, {c['pairs']} expert rows (up to {c['J']} per "
                         f"row) of {c['hidden']} bf16 values, floor {c['floor_us']:.0f} us ({c['floor']})"
                         for c in record["cases"]) + ".")
    return candidates_markdown(record, about)


def main() -> None:
    p = record_parser(__doc__)
    p.add_argument("--only", default=None, metavar="TEXT",
                   help="time only the candidates whose name contains TEXT (the kernel's variants: --only kernel)")
    args = p.parse_args()
    dev, hidden = torch.device("cuda"), 7168
    timed_us = functools.partial(median_time_us, device=dev)
    cases = []
    for name, num_rows, num_local in (("EP1", 4096, 256), ("EP2 rank 0", 8192, 128)):
        src, inv, dest = (t.to(dev) for t in routing(num_rows, num_local))
        m, num_out = inv.shape[0], src.shape[0]
        r = types.SimpleNamespace(src=src, inv=inv, dest=dest, m=m, kernels=load_kernels())
        x = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16)
        y = torch.randn(num_out, hidden, device=dev, dtype=torch.bfloat16)
        gbytes = (num_out + m) * hidden * 2 / 1e9  # read every expert row once, write every received row once
        ref = CANDIDATES["J gathers, fp32 accumulator"](y, r)
        copy_from = torch.empty(round(gbytes * 1e9) // 2, dtype=torch.uint8, device=dev)
        copy_to = torch.empty_like(copy_from)
        case = dict(case=name, rows=m, pairs=num_out, J=inv.shape[1], hidden=hidden,
                    floor_us=timed_us(lambda: copy_to.copy_(copy_from)),
                    floor="a device-to-device copy moving as many bytes: every expert row read, every received row "
                          "written once", us={}, max_diff={})
        if args.only is None:
            case["us"]["gather index_select (P rows)"] = timed_us(lambda: x.index_select(0, src))
        for cname, fn in CANDIDATES.items():
            if args.only is not None and args.only not in cname:
                continue
            out = fn(y, r)
            case["us"][cname] = timed_us(lambda: fn(y, r))
            case["max_diff"][cname] = (out.float() - ref.float()).abs().max().item()
        plan = ExpertRows(dest, num_out, padded=False, kernels=r.kernels)
        assert all(torch.equal(a, b) for a, b in zip((plan.bag_rows, plan.bag_offsets), _bags_by_argsort(src, m)))
        case["us"]["plan set-up alone (ExpertRows)"] = timed_us(lambda: ExpertRows(dest, num_out, padded=False))
        case["us"]["bag set-up by argsort (up to 1161b96)"] = timed_us(lambda: _bags_by_argsort(src, m))
        case["us"]["moe_comm expert_sum kernel alone (set-up done)"] = timed_us(lambda: plan.sum(y))
        if args.only is None:
            torch.use_deterministic_algorithms(True)
            case["us"]["index_add deterministic"] = timed_us(lambda: y.new_zeros(m, hidden).index_add(0, src, y))
            torch.use_deterministic_algorithms(False)

            def before_fwd_bwd():  # the receiver's gather and sum before a983b80 in autograd, experts identity
                xx = x.detach().requires_grad_()
                yy = with_zero_row(xx).index_select(0, src)
                out = yy.new_zeros(m, hidden).index_add(0, src, yy)
                out.backward(x)
            case["us"]["index_select + index_add fwd+bwd (before a983b80)"] = timed_us(before_fwd_bwd)
        torch.cuda.set_sync_debug_mode("error")  # raises if the plan's set-up waits for the host
        ExpertRows(dest, num_out, padded=False)
        torch.cuda.set_sync_debug_mode(0)
        cases.append(case)
    record = dict(title="The non-expand receiver's per-row sum of expert outputs, one GPU",
                  meta=run_metadata(sys.argv), cases=cases)
    write_record(record, to_markdown(record), args)


if __name__ == "__main__":
    main()
