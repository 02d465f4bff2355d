"""moe_comm.jit with the real nvcc on a CPU machine: build, cache hits, key, concurrent ranks, killed builds, errors.

Libraries are built for sm_90a and loaded, never called (no GPU). Every test has its own cache folder; tests
that count nvcc runs point CUDA_HOME at a folder whose bin/nvcc is a shell wrapper around the real nvcc.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from moe_comm import jit
from moe_comm.jit import compiler
from moe_comm.testing import process_context

try:
    REAL_NVCC = jit.find_nvcc()
except RuntimeError:
    REAL_NVCC = None

pytestmark = pytest.mark.skipif(REAL_NVCC is None, reason="needs nvcc")

KERNEL = r"""
#include <cuda_runtime.h>
#include "scale.cuh"

__global__ void scale_impl(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= kScale * kExtra;
}

extern "C" int launch_scale(float* x, int n, cudaStream_t stream) {
    scale_impl<<<(n + 255) / 256, 256, 0, stream>>>(x, n);
    return static_cast<int>(cudaGetLastError());
}
"""

# The wrappers leave `nvcc --version` (run once per process for the cache key) uncounted.
COUNTING_NVCC = """#!/bin/sh
case " $* " in *" --version "*) exec "{real}" "$@";; esac
echo $$ >> "{log}"
exec "{real}" "$@"
"""
# Stands for a build that is still running: records its pid, then never finishes.
HANGING_NVCC = """#!/bin/sh
case " $* " in *" --version "*) exec "{real}" "$@";; esac
echo $$ > "{log}"
exec sleep 300
"""


def _fake_cuda_home(folder: Path, script: str) -> tuple[Path, Path]:
    """A CUDA_HOME whose bin/nvcc runs `script`, and the file the script writes pids to."""
    log = folder / "nvcc.log"
    nvcc = folder / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text(script.format(real=REAL_NVCC, log=log))
    nvcc.chmod(0o755)
    return folder, log


def _logged_pids(log: Path) -> list[int]:
    return [int(line) for line in log.read_text().split()] if log.exists() else []


def _wait_for_pid(log: Path, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log.exists() and log.read_text().endswith("\n"):
            return _logged_pids(log)[0]
        time.sleep(0.05)
    raise AssertionError(f"no nvcc started within {timeout_s} s ({log} not written)")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _build_in_child(name, sources, include_dirs, barrier, results, environ, stderr_path) -> None:
    """Child process with the parent's environment: build (after `barrier`, if any) and report the path or the error
    as a string. Its stderr is appended to `stderr_path` when given (a child of the fork server writes to the server's
    stderr, which pytest's capfd does not capture)."""
    os.environ.clear()
    os.environ.update(environ)
    if stderr_path is not None:
        os.dup2(os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)
    try:
        if barrier is not None:
            barrier.wait(timeout=60)
        results.put(str(jit.build(name, sources, include_dirs=include_dirs)))
    except BaseException as exc:
        results.put(f"{type(exc).__name__}: {exc}")


def _start_child(name, project, barrier=None, results=None, stderr_path=None):
    ctx = process_context()
    results = results if results is not None else ctx.Queue()
    proc = ctx.Process(target=_build_in_child, args=(name, project.sources, project.include_dirs, barrier, results,
                                                     dict(os.environ), stderr_path))
    proc.start()
    return proc, results


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("MOE_COMM_JIT_CACHE_DIR", str(folder))
    monkeypatch.delenv("MOE_COMM_JIT_VERBOSE", raising=False)
    return folder


@pytest.fixture
def project(tmp_path) -> SimpleNamespace:
    """kernel.cu -> "scale.cuh" (next to it) -> <moe_test/extra.cuh> (include dir), plus unrelated files."""
    src = tmp_path / "src"
    include = tmp_path / "include"
    (include / "moe_test").mkdir(parents=True)
    src.mkdir()
    (src / "kernel.cu").write_text(KERNEL)
    (src / "scale.cuh").write_text("#pragma once\n#include <moe_test/extra.cuh>\nconstexpr float kScale = 2.0f;\n")
    (include / "moe_test" / "extra.cuh").write_text("#pragma once\nconstexpr float kExtra = 1.0f;\n")
    (include / "moe_test" / "unrelated.cuh").write_text("constexpr int kUnused = 0;\n")
    (src / "notes.txt").write_text("not a source\n")
    return SimpleNamespace(src=src, include=include, sources=[src / "kernel.cu"], include_dirs=[include])


@pytest.fixture
def nvcc_runs(tmp_path, monkeypatch):
    """Point CUDA_HOME at a counting wrapper; returns a function giving the number of compiles so far."""
    home, log = _fake_cuda_home(tmp_path / "cuda-counting", COUNTING_NVCC)
    monkeypatch.setenv("CUDA_HOME", str(home))
    return lambda: len(_logged_pids(log))


def test_build_and_load(project, cache):
    path = jit.build("scale", project.sources, include_dirs=project.include_dirs)
    assert path.is_file() and path.name == "scale.so"
    assert path.parent.parent == cache and re.fullmatch(r"scale-[0-9a-f]{16}", path.parent.name)
    log = (path.parent / "build.log").read_text()
    assert "-gencode=arch=compute_90a,code=sm_90a" in log and "seconds:" in log

    lib = jit.load("scale", project.sources, include_dirs=project.include_dirs)
    assert lib._name == str(path)
    assert hasattr(lib, "launch_scale")
    assert jit.load("scale", project.sources, include_dirs=project.include_dirs) is lib


def test_second_build_is_a_cache_hit(project, nvcc_runs, monkeypatch, capsys):
    monkeypatch.setenv("MOE_COMM_JIT_VERBOSE", "1")
    first = jit.build("hit", project.sources, include_dirs=project.include_dirs)
    assert nvcc_runs() == 1
    assert jit.build("hit", project.sources, include_dirs=project.include_dirs) == first
    assert nvcc_runs() == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and "built hit-" in lines[0] and "cache hit" in lines[1], lines


def test_key_follows_included_headers_only(project, nvcc_runs):
    first = jit.build("key", project.sources, include_dirs=project.include_dirs)
    (project.include / "moe_test" / "unrelated.cuh").write_text("constexpr int kUnused = 1;\n")
    (project.src / "notes.txt").write_text("edited\n")
    assert jit.build("key", project.sources, include_dirs=project.include_dirs) == first
    assert nvcc_runs() == 1

    # Reached only through scale.cuh's <...> include, resolved in the include dir
    (project.include / "moe_test" / "extra.cuh").write_text("#pragma once\nconstexpr float kExtra = 3.0f;\n")
    second = jit.build("key", project.sources, include_dirs=project.include_dirs)
    assert second != first and second.is_file() and first.is_file()
    assert nvcc_runs() == 2


def test_concurrent_builds_run_nvcc_once(project, nvcc_runs, monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_COMM_JIT_VERBOSE", "1")
    ctx = process_context()
    barrier, results, stderr = ctx.Barrier(4), ctx.Queue(), tmp_path / "stderr.txt"
    procs = [_start_child("concurrent", project, barrier, results, stderr)[0] for _ in range(4)]
    paths = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
    assert len(set(paths)) == 1 and Path(paths[0]).is_file(), paths
    assert nvcc_runs() == 1
    lines = [line for line in stderr.read_text().splitlines() if line.startswith("moe_comm.jit:")]
    assert sorted(line.split()[1] for line in lines) == ["built", "cache", "cache", "cache"], lines


def test_killed_build_leaves_no_trace_and_next_build_proceeds(project, cache, tmp_path, monkeypatch):
    home, log = _fake_cuda_home(tmp_path / "cuda-hanging", HANGING_NVCC)
    monkeypatch.setenv("CUDA_HOME", str(home))
    proc, _ = _start_child("killed", project)
    sleeper = _wait_for_pid(log)
    try:
        assert len(list(cache.glob(".tmp-killed-*"))) == 1
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=30)
    finally:
        _kill(proc.pid)
        _kill(sleeper)
    assert not [p for p in cache.iterdir() if p.is_dir() and p.name.startswith("killed-")]

    # The dead builder's lock went with it: no wait, and its temp folder is cleaned up
    home, log = _fake_cuda_home(tmp_path / "cuda-counting", COUNTING_NVCC)
    monkeypatch.setenv("CUDA_HOME", str(home))
    start = time.monotonic()
    path = jit.build("killed", project.sources, include_dirs=project.include_dirs, timeout_s=30)
    assert path.is_file() and len(_logged_pids(log)) == 1
    assert time.monotonic() - start < 20
    assert not list(cache.glob(".tmp-*"))


def test_lock_timeout_names_lock_and_holder(project, cache, tmp_path, monkeypatch):
    home, log = _fake_cuda_home(tmp_path / "cuda-hanging", HANGING_NVCC)
    monkeypatch.setenv("CUDA_HOME", str(home))
    proc, _ = _start_child("locked", project)
    sleeper = _wait_for_pid(log)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            jit.build("locked", project.sources, include_dirs=project.include_dirs, timeout_s=1)
        assert time.monotonic() - start < 10
    finally:
        _kill(proc.pid)
        proc.join(timeout=30)
        _kill(sleeper)
    [lock] = cache.glob("locked-*.lock")
    assert str(lock) in str(info.value) and f"pid {proc.pid} " in str(info.value)


def test_syntax_error_raises_with_command_and_error_line(tmp_path, cache):
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" int launch_bad() {\n    return 1 +;\n}\n')
    with pytest.raises(RuntimeError) as info:
        jit.build("bad", [bad])
    message = str(info.value)
    assert f"command: {REAL_NVCC} " in message and str(bad) in message
    assert "-gencode=arch=compute_90a,code=sm_90a" in message
    assert re.search(r"bad\.cu\(2\): error", message), message
    assert all(p.suffix == ".lock" for p in cache.iterdir()), list(cache.iterdir())


def test_sources_compile_apart_and_link_into_one_library(project, cache, nvcc_runs):
    """Several sources: one nvcc run compiles each (in parallel), one links them; the library has every source's
    functions and the build log every command. A source that does not compile fails the build with its own command
    and error, whatever the other sources do."""
    second = project.src / "second.cu"
    second.write_text('extern "C" int launch_second() { return 2; }\n')
    path = jit.build("two", [*project.sources, second], include_dirs=project.include_dirs)
    assert nvcc_runs() == 3
    lib = jit.load("two", [*project.sources, second], include_dirs=project.include_dirs)
    assert hasattr(lib, "launch_scale") and lib.launch_second() == 2
    log = (path.parent / "build.log").read_text()
    commands = [line.split() for line in log.splitlines() if line.startswith("command: ")]
    assert [Path(c[c.index("-o") + 1]).name for c in commands] == ["0-kernel.o", "1-second.o", "two.so"]
    assert [c[-1] for c in commands[:2]] == [str(project.sources[0]), str(second)] and "seconds:" in log
    assert not (path.parent / "obj").exists()

    bad = project.src / "bad.cu"
    bad.write_text('extern "C" int launch_bad() {\n    return 1 +;\n}\n')
    with pytest.raises(RuntimeError) as info:
        jit.build("three", [*project.sources, bad, second], include_dirs=project.include_dirs)
    message = str(info.value)
    assert re.search(r"command: \S+ .* -c -o \S+ " + re.escape(str(bad)) + "\n", message), message
    assert re.search(r"bad\.cu\(2\): error", message) and "second.cu" not in message


def test_compile_check_uses_a_throwaway_cache(project, cache):
    seconds = jit.compile_check(project.sources, include_dirs=project.include_dirs)
    assert 0 < seconds < 60
    assert not cache.exists()


def test_invalid_arguments(project, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="arch='sm90'"):
        jit.build("x", project.sources, arch="sm90")
    with pytest.raises(ValueError, match="name='a/b'"):
        jit.build("a/b", project.sources)
    with pytest.raises(TypeError, match="must be a sequence"):
        jit.build("x", project.sources[0])
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", "")
    with pytest.raises(RuntimeError, match=r"searched \$CUDA_HOME/bin/nvcc .* and nvcc on PATH"):
        jit.find_nvcc()


def test_key_follows_the_nvcc_environment(project, monkeypatch):
    """nvcc reads flags and its host compiler from the environment: a library built under them is another build."""
    def key() -> str:
        return compiler.cache_key("env", project.sources, include_dirs=project.include_dirs)

    base = key()
    for var in compiler.NVCC_ENV_VARS:
        monkeypatch.setenv(var, "-DEXTRA=41")
        assert key() != base, var
        monkeypatch.delenv(var)
    assert key() == base


def test_bad_verbose_is_refused_before_building(project, nvcc_runs, monkeypatch, cache):
    monkeypatch.setenv("MOE_COMM_JIT_VERBOSE", "2")
    with pytest.raises(ValueError, match="MOE_COMM_JIT_VERBOSE='2'"):
        jit.build("verbose", project.sources, include_dirs=project.include_dirs)
    assert nvcc_runs() == 0 and not cache.exists()


def test_published_build_is_as_readable_as_the_cache(project, nvcc_runs, cache):
    """A cache made readable for others (an image's, a team's) stays usable: a build is published with the root's
    permissions, not mkdtemp's private 0700."""
    cache.mkdir(parents=True)
    cache.chmod(0o755)
    path = jit.build("mode", project.sources, include_dirs=project.include_dirs)
    assert path.parent.stat().st_mode & 0o777 == 0o755
