"""Can token chunks hide a layer's communication? The expert MLP's forward + backward with its rows in K chunks.

DESIGN 8.1's layer goal (1.03x the compute-only floor) names one way to hide dispatch and combine: split the tokens
into chunks and pipeline them through dispatch, experts and combine, so one chunk's communication runs under
another's experts. The experts then run K grouped GEMMs per projection, each over ~1/K of every expert's rows, and
each reads every local expert's weights again. A grouped GEMM's arithmetic intensity is about the rows per expert
(2 * rows * N * K flops over 2 * N * K weight bytes), and an H200 needs ~200 flops per byte of HBM traffic (bf16
dense ~990 TFLOP/s over 4.8 TB/s) to stay compute-bound; at DeepSeek-V3's shapes each expert gets ~130-260 rows, so
chunks push the GEMMs below that ridge.

This times the grouped SwiGLU expert MLP of one DeepSeek-V3 layer (hidden 7168, moe ffn 2048, 256 experts, top-8,
4096 tokens per rank, bf16, `torch.nn.functional.grouped_mm` as `MoECommGroupedMLP` calls it) forward + backward
on one GPU, as EP1 (256 local experts) and as one rank of EP2 (128 local experts, rows from two ranks' tokens):
- its rows whole (the compute-only floor's expert work: the floor against which the chunks are compared);
- in K token chunks with the weight gradients once over all rows (forward and input gradient per chunk): the least
  any chunked design pays (the regrouping of the rows by expert that one weight-gradient GEMM needs is not timed);
- in K token chunks, each with its own weight gradients, summed into one (what autograd does when K chunks use the
  same weights);
- in K groups of local experts, each with all its rows (a pipeline by experts instead of tokens: the combine of one
  group's rows under the next group's GEMMs).
The max diff columns compare the chunks' (groups') outputs and input gradients with the whole rows' (0: the same
bits).

    python benchmarks/microbench/chunked_experts.py [--json OUT.json] [--md OUT.md] [--chunks 2 4]
"""

from __future__ import annotations

import functools
import pathlib
import sys

import torch
import torch.nn.functional as F

# The repository root: moe_comm without installing it.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from moe_comm.testing.bench import (  # noqa: E402
    candidates_markdown, median_time_us, record_parser, run_metadata, write_record)

HIDDEN, FFN, NUM_EXPERTS, TOPK, TOKENS = 7168, 2048, 256, 8, 4096


def chunk_counts(num_ranks: int, num_local: int, num_chunks: int, seed: int = 0) -> torch.Tensor:
    """`[K, L]` rows per (token chunk, local expert) of rank 0: the top-8 of random scores for every source rank's
    4096 tokens, a chunk being the same quarter (half, ...) of every source rank's tokens."""
    g = torch.Generator().manual_seed(seed)
    experts = torch.rand(num_ranks, TOKENS, NUM_EXPERTS, generator=g).topk(TOPK, dim=-1).indices
    chunk = (torch.arange(TOKENS) * num_chunks // TOKENS).expand(num_ranks, TOPK, TOKENS).transpose(1, 2)
    local = experts < num_local
    counts = torch.zeros(num_chunks, num_local, dtype=torch.int64)
    return counts.index_put_((chunk[local], experts[local]), torch.ones((), dtype=torch.int64), accumulate=True)


def offsets(counts: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.cumsum(counts, 0).to(device=device, dtype=torch.int32)


class Experts:
    """The local experts' SwiGLU MLP on grouped GEMMs, its three passes apart: `forward`, `input_grad`,
    `weight_grads` (`MoECommGroupedMLP`'s products: fc1 `[L, 2F, H]`, fc2 `[L, H, F]`)."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        self.w1, self.w2 = w1, w2

    @classmethod
    def random(cls, num_local: int, device: torch.device) -> "Experts":
        g = torch.Generator(device).manual_seed(1)
        return cls(torch.randn(num_local, 2 * FFN, HIDDEN, device=device, dtype=torch.bfloat16, generator=g) * 0.02,
                   torch.randn(num_local, HIDDEN, FFN, device=device, dtype=torch.bfloat16, generator=g) * 0.02)

    def group(self, first: int, end: int) -> "Experts":
        """Local experts first..end-1 (views of the weights)."""
        return Experts(self.w1[first:end], self.w2[first:end])

    def forward(self, x: torch.Tensor, offs: torch.Tensor):
        h = F.grouped_mm(x, self.w1.transpose(1, 2), offs=offs)
        gate, up = h.chunk(2, dim=1)
        a = F.silu(gate) * up
        return h, a, F.grouped_mm(a, self.w2.transpose(1, 2), offs=offs)

    def input_grad(self, grad_y: torch.Tensor, h: torch.Tensor, offs: torch.Tensor):
        grad_a = F.grouped_mm(grad_y, self.w2, offs=offs)
        gate, up = h.chunk(2, dim=1)
        sig = torch.sigmoid(gate)
        grad_h = torch.cat([grad_a * up * sig * (1 + gate * (1 - sig)), grad_a * gate * sig], dim=1)
        return grad_h, F.grouped_mm(grad_h, self.w1, offs=offs)

    @staticmethod
    def weight_grads(x, a, grad_y, grad_h, offs):
        return F.grouped_mm(grad_h.t(), x, offs=offs), F.grouped_mm(grad_y.t(), a, offs=offs)


def time_case(name: str, num_ranks: int, num_local: int, chunk_sizes, device: torch.device) -> dict:
    timed_us = functools.partial(median_time_us, device=device, num_warmups=2, num_iters=10)
    experts = Experts.random(num_local, device)
    whole = chunk_counts(num_ranks, num_local, 1)[0]
    rows = int(whole.sum())
    x = torch.randn(rows, HIDDEN, device=device, dtype=torch.bfloat16)
    grad_y = torch.randn_like(x)
    offs = offsets(whole, device)

    h_ref, a_ref, y_ref = experts.forward(x, offs)
    grad_h_ref, grad_x_ref = experts.input_grad(grad_y, h_ref, offs)

    def run_whole():
        h, a, _ = experts.forward(x, offs)
        grad_h, _ = experts.input_grad(grad_y, h, offs)
        return experts.weight_grads(x, a, grad_y, grad_h, offs)

    def max_diff(outs, rows=slice(None)):
        """The largest difference of the parts' outputs and input gradients (each part's first two results, its
        rows in order) from the whole rows'; `rows`: which whole row each of them is."""
        y, grad_x = (torch.cat([o[i] for o in outs]) for i in (0, 1))
        return max((y - y_ref[rows]).abs().max().item(), (grad_x - grad_x_ref[rows]).abs().max().item())

    flops = 2 * rows * HIDDEN * 3 * FFN * 3  # three products of 2F + F columns: forward, input grad, weight grads
    weight_bytes = experts.w1.nbytes + experts.w2.nbytes
    case = dict(case=name, rows=rows, local_experts=num_local, weight_gb=weight_bytes / 1e9, us={}, max_diff={},
                floor="the expert work on whole rows (the compute-only floor's)")
    case["floor_us"] = case["us"]["whole rows"] = timed_us(run_whole)
    case["tflops_whole"] = flops / case["floor_us"] / 1e6
    for k in chunk_sizes:
        counts = chunk_counts(num_ranks, num_local, k)
        assert torch.equal(counts.sum(0), whole)
        # Chunk c's rows: its slice of the rows renumbered chunk-major (each chunk grouped by expert); row r of them
        # is whole row order[r].
        order = chunk_major_order(counts, device)
        x_cm, grad_y_cm = x[order], grad_y[order]
        bounds = [0] + torch.cumsum(counts.sum(1), 0).tolist()
        parts = [(slice(bounds[c], bounds[c + 1]), offsets(counts[c], device)) for c in range(k)]

        def chunks_then_weight_grads_once():
            outs = []
            for part, offs_c in parts:
                h, _, y = experts.forward(x_cm[part], offs_c)
                outs.append((y, experts.input_grad(grad_y_cm[part], h, offs_c)[1]))
            # The weight gradients once over whole rows, grouped by expert (their regrouping not timed).
            experts.weight_grads(x, a_ref, grad_y, grad_h_ref, offs)
            return outs

        def chunks_each_with_weight_grads():
            grad_w1 = grad_w2 = None
            for part, offs_c in parts:
                h, a, _ = experts.forward(x_cm[part], offs_c)
                grad_h, _ = experts.input_grad(grad_y_cm[part], h, offs_c)
                g1, g2 = experts.weight_grads(x_cm[part], a, grad_y_cm[part], grad_h, offs_c)
                grad_w1, grad_w2 = (g1, g2) if grad_w1 is None else (grad_w1.add_(g1), grad_w2.add_(g2))
            return grad_w1, grad_w2

        label = f"{k} chunks, weight grads once"
        case["max_diff"][label] = max_diff(chunks_then_weight_grads_once(), order)
        case["us"][label] = timed_us(chunks_then_weight_grads_once)
        case["us"][f"{k} chunks, weight grads per chunk, summed"] = timed_us(chunks_each_with_weight_grads)

        # K groups of local experts instead: every expert keeps all its rows (rows are grouped by expert already).
        ends = [g * num_local // k for g in range(k + 1)]
        row_ends = [0] + torch.cumsum(whole, 0).tolist()
        groups = [(experts.group(ends[g], ends[g + 1]), slice(row_ends[ends[g]], row_ends[ends[g + 1]]),
                   offsets(whole[ends[g]:ends[g + 1]], device)) for g in range(k)]

        def expert_groups():
            outs = []
            for group, part, offs_g in groups:
                h, a, y = group.forward(x[part], offs_g)
                grad_h, grad_x = group.input_grad(grad_y[part], h, offs_g)
                outs.append((y, grad_x, group.weight_grads(x[part], a, grad_y[part], grad_h, offs_g)))
            return outs

        label = f"{k} expert groups"
        case["max_diff"][label] = max_diff(expert_groups())
        case["us"][label] = timed_us(expert_groups)
    return case


def chunk_major_order(counts: torch.Tensor, device: torch.device) -> torch.Tensor:
    """For rows numbered chunk-major (chunk, then expert), each one's index among the whole rows grouped by expert
    (expert, then chunk): which of the whole rows' results a chunk's row has to equal."""
    k, num_local = counts.shape
    start = torch.cumsum(counts.sum(0), 0) - counts.sum(0)  # each expert's first whole row
    before = torch.cumsum(counts, 0) - counts  # the expert's rows in earlier chunks
    return torch.cat([start[e] + before[c, e] + torch.arange(counts[c, e]) for c in range(k)
                      for e in range(num_local)]).to(device)


def to_markdown(record: dict) -> str:
    about = ("Median of 10 calls between two events. Cases: " + "; ".join(
        f"{c['case']}: {c['rows']} rows over {c['local_experts']} local experts (~{c['rows'] / c['local_experts']:.0f}"
        f" each), {c['weight_gb']:.1f} GB of weights, whole rows at {c['tflops_whole']:.0f} TFLOP/s"
        for c in record["cases"]) + ". Max diff: the chunks' outputs and input gradients against the whole rows'.")
    return candidates_markdown(record, about)


def main() -> None:
    p = record_parser(__doc__)
    p.add_argument("--chunks", type=int, nargs="+", default=[2, 4], help="the chunk counts K to time")
    args = p.parse_args()
    dev = torch.device("cuda")
    cases = []
    for name, num_ranks, num_local in (("EP1", 1, 256), ("EP2 rank 0", 2, 128)):
        cases.append(time_case(name, num_ranks, num_local, args.chunks, dev))
        torch.cuda.empty_cache()
    record = dict(title="A DeepSeek-V3 layer's expert MLP, forward + backward: its rows whole, in token chunks or in "
                        "expert groups, one GPU", meta=run_metadata(sys.argv), cases=cases)
    write_record(record, to_markdown(record), args)


if __name__ == "__main__":
    main()
