"""Shared fixtures: the launcher's fork server started first, one long-lived process group per world size for the
whole session."""

from __future__ import annotations

import multiprocessing.forkserver
import os
from pathlib import Path

import pytest

from moe_comm import env, jit
from moe_comm.testing import WorkerPool, process_context


@pytest.fixture(scope="session", autouse=True)
def fork_server():
    """Start the launcher's fork server before any test: its children write to the stdout/stderr it starts with, which
    must be the session's, not one test's capture (a test with capfd that started it would take every later rank's
    output, tracebacks included, into a closed capture)."""
    process_context()
    multiprocessing.forkserver.ensure_running()


@pytest.fixture(scope="session")
def pools():
    """`pools(world_size)` returns a gloo WorkerPool of that size, started on first use, killed at the end."""
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
