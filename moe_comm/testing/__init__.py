"""Test and benchmark helpers shipped with the package: spawn launcher, seeded routing cases and an oracle."""

from .launcher import RankFailure, WorkerPool, parallel_launch

__all__ = ["RankFailure", "WorkerPool", "parallel_launch"]
