"""A short soak in the CPU tier (`moe_comm.testing.soak`, the core of `scripts/soak.py`): every path over a few
random cases on one Buffer per rank, with 2 and 3 ranks, no wrong result; and the soak's checks do catch wrong
rows and wrong sums. Memory growth is reported but not asserted here (a few iterations are allocator noise)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_comm.testing.soak import (PATHS, SoakCase, SoakConfig, decode_row, draw_soak_cases, encode_rows,
                                   format_summary, run_path, soak_rank, summarize)

NUM_ITERS = {2: 10, 3: 6}
CONFIG = SoakConfig(num_max_tokens_per_rank=24, max_hidden=136)


@pytest.mark.parametrize("world_size", sorted(NUM_ITERS))
def test_soak_has_no_wrong_result(pools, seed, world_size):
    cases = draw_soak_cases(seed * 10 + world_size, NUM_ITERS[world_size], world_size, max_tokens=24, max_hidden=136,
                            max_experts=12)
    per_rank = pools(world_size).run(soak_rank, cases, [], CONFIG)
    summary = summarize(per_rank, rss_tolerance=2**40, cuda_tolerance=2**40)
    print(format_summary(summary))
    assert list(summary["paths"]) == list(PATHS)
    assert all(e["iterations"] == len(cases) for e in summary["paths"].values())
    assert summary["ok"], "\n".join(summary["problems"])


def test_rows_encode_their_source():
    case = SoakCase(seed=5, num_ranks=2, num_experts=2, num_topk=1, hidden=8, num_tokens=(4095, 1),
                    num_max_tokens_per_rank=4095)
    rows = encode_rows(case, torch.tensor([0, 1, 7]), torch.tensor([4094, 0, 300]), 136)
    assert [decode_row(r) for r in rows] == [(0, 4094), (1, 0), (7, 300)]
    # At most 4 significant bits each: times any factor sum up to 16, still exact in bf16.
    for factor in range(17):
        scaled = rows * factor
        assert torch.equal(scaled.to(torch.bfloat16).double(), scaled)


class _Faulty:
    """A Buffer stand-in that breaks one thing: `fault="swap"` swaps the first two received rows of a dispatch,
    `fault="sum"` adds one to the first combined element."""

    def __init__(self, buf, fault: str) -> None:
        self.buf, self.fault, self.device = buf, fault, buf.device

    def dispatch(self, *args, **kwargs):
        recv_x, *rest = self.buf.dispatch(*args, **kwargs)
        if self.fault == "swap":
            recv_x = recv_x[[1, 0, *range(2, recv_x.shape[0])]]
        return (recv_x, *rest)

    def combine(self, *args, **kwargs):
        combined, *rest = self.buf.combine(*args, **kwargs)
        if self.fault == "sum":
            combined = combined.clone()
            combined.view(-1)[0] += 1
        return (combined, *rest)

    def barrier(self):
        self.buf.barrier()


def faulty_rank(rank: int, world_size: int) -> dict[str, list[str]]:
    import moe_comm
    buf = moe_comm.Buffer(None, num_max_tokens_per_rank=8, hidden=128, num_topk=2, backend="torch",
                          deterministic=True, num_cpu_timeout_secs=60)
    # Every token goes to both ranks: each receives 8 rows from distinct tokens.
    case = SoakCase(seed=3, num_ranks=2, num_experts=2, num_topk=2, hidden=8, num_tokens=(4, 4),
                    num_max_tokens_per_rank=8, drop_prob=0.0, num_bias=1)
    found = {"right": run_path(buf, "dispatch", case, rank) + run_path(buf, "combine", case, rank),
             "swap": run_path(_Faulty(buf, "swap"), "dispatch", case, rank),
             "sum": run_path(_Faulty(buf, "sum"), "combine", case, rank)}
    buf.destroy()
    return found


def test_soak_catches_wrong_results(pools):
    for found in pools(2).run(faulty_rank):
        assert found["right"] == []
        assert len(found["swap"]) == 1 and "row 0 holds (rank, token) (0, 1), expected (0, 0)" in found["swap"][0], \
            found["swap"]
        assert len(found["sum"]) == 1 and found["sum"][0].startswith("combined_x: 1 of"), found["sum"]


def test_summary_fails_on_wrong_results_and_growth():
    def rank(wrong: int, rss_end: int) -> dict:
        path = {"iterations": 3, "wrong": wrong, "first_wrong": "iteration 1 on rank 0: recv_x: ..." if wrong else None,
                "seconds": 0.5, "rss_start": 100 * 2**20, "rss_end": rss_end, "cuda_start": None, "cuda_end": None}
        return {"backend": "torch", "paths": {"dispatch": path}}

    fine = summarize([rank(0, 101 * 2**20), rank(0, 100 * 2**20)], rss_tolerance=2 * 2**20, cuda_tolerance=0)
    assert fine["ok"] and fine["paths"]["dispatch"]["rss_growth"] == 2**20
    wrong = summarize([rank(0, 100 * 2**20), rank(2, 100 * 2**20)], rss_tolerance=2 * 2**20, cuda_tolerance=0)
    assert not wrong["ok"] and wrong["problems"] == [
        "WRONG dispatch: 2 wrong iteration(s); first: iteration 1 on rank 0: recv_x: ..."]
    grown = summarize([rank(0, 103 * 2**20), rank(0, 100 * 2**20)], rss_tolerance=2 * 2**20, cuda_tolerance=0)
    assert not grown["ok"] and grown["problems"][0].startswith("GROWTH dispatch: host RSS grew by 3.0 MiB")
    assert "FAILED" in format_summary(grown)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("args, message", [(["--share-gpu"], "--share-gpu needs a GPU, found none"),
                                           (["--share-gpu", "--backend", "torch"], "leave out --backend torch"),
                                           (["--backend", "cuda"], "--share-gpu puts every rank on one")])
def test_soak_script_refuses_what_this_machine_cannot_run(args, message):
    """scripts/soak.py stops with a usage error naming the option before it spawns a rank."""
    assert_soak_refuses(args, message)


@pytest.mark.parametrize("args, message", [(["--iters", "0"], "--iters=0 must be >= 1"),
                                           (["--max-experts", "1"], "max_experts=1 must be >= num_ranks=2")])
def test_soak_script_refuses_what_no_machine_can_run(args, message):
    """A soak of no iteration checks nothing; fewer experts than ranks leaves a rank none (it was raised silently)."""
    assert_soak_refuses(args, message)


def assert_soak_refuses(args: list[str], message: str) -> None:
    script = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"
    run = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and message in run.stderr, run.stderr
