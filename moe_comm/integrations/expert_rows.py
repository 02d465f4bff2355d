"""The non-expand layout's receiver, free of any framework: where each received row's copies sit among the experts'
rows, and the two moves between the layouts (a gather and a deterministic per-row sum, each the other's adjoint).
The Megatron dispatcher (`moe_comm.integrations.megatron.spec_route`) uses it; `benchmarks/microbench/expert_sum.py`
times it.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..backends.common import DTYPE_CODES
from ..backends.cuda_kernels import current_stream

__all__ = ["ExpertRows", "MoveExpertRows"]


class ExpertRows:
    """The non-expand layout's receiver: where the copies of each received row sit in the experts' input (a row
    per (received row, local expert), experts ascending, rows ascending inside an expert, each expert's block
    padded to the alignment), and the two moves between the layouts, each the other's adjoint:
    `gather` (received rows -> the experts' rows) and `sum` (the experts' rows -> each received row's sum).

    The sum adds each received row's expert rows in fp32 (fp64 for float64 rows), experts ascending, from zero,
    rounded once to the rows' dtype: no atomics, the same bits every run. On CUDA with the kernel library
    (`kernels`) it is moe_comm's kernel (bf16, float32, float64 rows); otherwise `embedding_bag` over the expert rows
    grouped by received row, whose bits CUDA's kernel matches and the CPU's, after its 16-bit rows are widened, too.
    Both read the bags built here once per plan from `dest`, without a sort. (Per sum at DeepSeek-V3's EP1 shapes,
    `benchmarks/microbench/expert_sum.py`: `index_add`, which this replaced, ~1.9 ms with bf16 atomics; the kernel
    ~0.15 ms, one pass over the rows at ~1.2x a device copy of as many bytes.)

    Arguments:
        dest: `[M, L]` `torch.int64`, the expert row (of P) of each (received row, local expert) pair; P where the
            row has no copy for that expert.
        num_out: P, expert rows (those no pair names are padding).
        padded: whether any expert row may be padding.
        kernels: the CUDA backend's kernel library (`moe_comm.backends.cuda_kernels.load_kernels()`), or None.
        rank: this rank, for a failed launch's message.

    Attributes `src_pairs` / `src_rows` (`[P]`): each expert row's pair (`m * L + l`; `M * L` for padding) and
    received row (M for padding).
    """

    def __init__(self, dest: torch.Tensor, num_out: int, padded: bool, kernels=None, rank: int = 0) -> None:
        if dest.dim() != 2 or dest.dtype != torch.int64:
            raise ValueError(f"ExpertRows: dest must be [rows, local experts] torch.int64, got {tuple(dest.shape)} "
                             f"{dest.dtype}")
        self.num_rows, num_local = dest.shape
        self.padded, self.kernels, self.rank = padded, kernels, rank
        dest = dest.flatten()
        pairs = torch.arange(dest.shape[0], device=dest.device)
        self.src_pairs = torch.full((num_out + 1,), dest.shape[0], dtype=torch.int64, device=dest.device).scatter(
            0, dest, pairs)[:num_out]
        self.src_rows = self.src_pairs // max(num_local, 1)
        # Bag m (m < M) holds received row m's expert rows, experts ascending: pair (m, l)'s place among the pairs
        # taken row by row. Places past the last pair (as many as padding rows) stay 0, in a last bag cut off.
        is_pair = dest < num_out
        bag_sizes = is_pair.view(self.num_rows, num_local).sum(1)
        self.bag_offsets = torch.cat([bag_sizes.new_zeros(1), torch.cumsum(bag_sizes, 0)])
        place = torch.where(is_pair, torch.cumsum(is_pair, 0) - 1, num_out)
        self.bag_rows = dest.new_zeros(num_out + 1).scatter(0, place, dest)[:num_out]

    def _check(self, rows: torch.Tensor, num_rows: int, what: str) -> None:
        if rows.dim() != 2 or rows.shape[0] != num_rows:
            raise ValueError(f"ExpertRows.{what}: rows must be [{num_rows}, hidden], got {tuple(rows.shape)}")

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """`[M, H]` received rows -> `[P, H]` expert rows (padding rows zero)."""
        self._check(rows, self.num_rows, "gather")
        if self.padded:
            rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
        return rows.index_select(0, self.src_rows)

    def sum(self, rows: torch.Tensor) -> torch.Tensor:
        """`[P, H]` expert rows -> `[M, H]`: each received row's expert rows summed (padding rows left out)."""
        self._check(rows, self.src_rows.shape[0], "sum")
        if rows.shape[0] == 0:  # no expert rows: every bag empty (and no empty weight for embedding_bag)
            return rows.new_zeros(self.num_rows, rows.shape[1])
        if self.kernels is not None and rows.is_cuda and rows.dtype in DTYPE_CODES:
            rows = rows.contiguous()
            out = rows.new_empty(self.num_rows, rows.shape[1])
            num_blocks = min(max(1, -(-self.num_rows // 8)), 1 << 16)  # a warp per received row, 8 per block
            with torch.cuda.device(rows.device):
                self.kernels.check(self.kernels.expert_sum(
                    rows.data_ptr(), self.bag_rows.data_ptr(), self.bag_offsets.data_ptr(), self.num_rows,
                    rows.shape[1], out.data_ptr(), DTYPE_CODES[rows.dtype], num_blocks,
                    current_stream(rows.device.index)), "the non-expand receiver's sum of expert rows", self.rank)
            return out
        if rows.device.type == "cpu" and rows.element_size() < 4:
            # The CPU's embedding_bag rounds 16-bit sums its own way (ties away from zero): summed in fp32 here
            # and rounded by torch (to nearest even), the bits are CUDA's.
            return self.sum(rows.float()).to(rows.dtype)
        return torch.nn.functional.embedding_bag(self.bag_rows, rows, self.bag_offsets, mode="sum")[:-1]


class MoveExpertRows(torch.autograd.Function):
    """`plan.gather(rows)` (`gather=True`) or `plan.sum(rows)`, with the other move as its backward."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, plan: ExpertRows, gather: bool) -> torch.Tensor:
        ctx.plan, ctx.gather = plan, gather
        return plan.gather(rows) if gather else plan.sum(rows)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        return ctx.plan.sum(grad) if ctx.gather else ctx.plan.gather(grad), None, None
