"""Shared fixtures: one long-lived spawned process group per world size for the whole session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moe_comm import env, jit
from moe_comm.testing import WorkerPool


@pytest.fixture(scope="session")
def pools():
    """`pools(world_size)` returns a gloo WorkerPool of that size, spawned on first use, killed at the end."""
    created: dict[int, WorkerPool] = {}

    def get(world_size: int) -> WorkerPool:
        if world_size not in created:
            created[world_size] = WorkerPool(world_size, backend="gloo", timeout_s=600)
        return created[world_size]

    yield get
    for pool in created.values():
        pool.close()


@pytest.fixture(scope="session")
def seed() -> int:
    return env.get_int("MOE_COMM_TEST_SEED")


@pytest.fixture(scope="session")
def nvcc() -> Path:
    """The nvcc the JIT would use; skips the test without one, except on CI machines, which have nvcc: there its
    absence is a failure, not a skip."""
    try:
        return jit.find_nvcc()
    except RuntimeError:
        if os.environ.get("CI"):
            raise
        pytest.skip("nvcc not found")
