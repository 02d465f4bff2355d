"""Test and benchmark helpers shipped with the package: the multi-rank launcher, seeded routing cases and an oracle."""

from .launcher import RankFailure, WorkerPool, parallel_launch, process_context

__all__ = ["RankFailure", "WorkerPool", "parallel_launch", "process_context"]
