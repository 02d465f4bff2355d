"""Build CUDA C++ sources into a shared library at first use, cached on disk (DESIGN 5).

Kernels are plain CUDA C++ with an `extern "C"` launcher API and no torch headers, so one build is nvcc compiling
each source (in parallel) and linking `<name>.so`, which Python opens with ctypes and calls with raw pointers and
streams.

Cache layout under `default_cache_dir()`:
    <name>-<hash16>/<name>.so    the library
    <name>-<hash16>/build.log    each nvcc command line and its output, seconds
    <name>-<hash16>.lock         flock'd by whoever builds that key; holds the builder's pid and host
    .tmp-<name>-<hash16>-*/      a build in progress (or one killed mid-way: the next builder removes it)

The key (`<hash16>` is its first 16 hex digits) is a sha256 over the name, the full `nvcc --version` text, the
environment variables nvcc reads flags and its host compiler from (`NVCC_ENV_VARS`), the arch, the flag list, the
generated headers (path and text), and the bytes of every source and of every header reachable from them through
`#include` (`_reachable_files`). Include-dir paths are not hashed: the headers found
there are. Generated headers (`generated=`, e.g. `moe_comm/abi.h` from `moe_comm.layout`) are written into
`<key folder>/gen/`, which is on the include path of the build.

A key folder only ever appears complete (it is renamed into place), so a caller that sees `<name>.so` uses it
without locking. Otherwise it takes the key's lock, checks again (another rank may have just built it),
compiles into a private temp folder on the same filesystem and renames it into place. The lock is an
`fcntl.flock`, which the kernel drops when its holder dies, so a build killed half-way never blocks the next.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import fcntl
import functools
import hashlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .. import env

# The kernel sources, shipped inside the package.
CSRC_DIR = Path(__file__).resolve().parents[1] / "csrc"

DEFAULT_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo", "--expt-relaxed-constexpr")
# How often a rank waiting for another rank's build retries the lock.
LOCK_POLL_S = 0.05
# A failed build's RuntimeError carries this much of the end of nvcc's output (its temp folder, with the full
# build.log, is removed); a failed kernel build rarely prints more.
ERROR_TAIL_CHARS = 4000
NVCC_VERSION_TIMEOUT_S = 60.0

# Names become folder names; the character set also keeps them safe inside a glob pattern.
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_ARCH_RE = re.compile(r"sm_\d+[af]?")
# Environment variables nvcc reads its own flags and host compiler from (part of the cache key).
NVCC_ENV_VARS = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN")
_INCLUDE_RE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"\n]+)[>"]', re.MULTILINE)

# Libraries loaded by this process, by full cache key.
_LOADED: dict[str, ctypes.CDLL] = {}


def default_cache_dir() -> Path:
    """The cache root: `$MOE_COMM_JIT_CACHE_DIR` (default `~/.cache/moe_comm`), user-expanded and absolute.

    Returns:
        The root folder; builds go to `<root>/<name>-<hash16>/`. It is created on the first build, not here.
    """
    raw = env.get_str("MOE_COMM_JIT_CACHE_DIR")
    if not raw.strip():
        raise ValueError("MOE_COMM_JIT_CACHE_DIR is set but empty; unset it or name a folder")
    return Path(raw).expanduser().absolute()


def find_nvcc() -> Path:
    """The nvcc to build with: `$CUDA_HOME/bin/nvcc` if it exists, else `nvcc` on `PATH`.

    Returns:
        The path of the nvcc executable.

    Raises:
        RuntimeError: neither exists; the message names both places searched.
    """
    searched = []
    cuda_home = os.environ.get("CUDA_HOME")
    if cuda_home:
        candidate = Path(cuda_home) / "bin" / "nvcc"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
        searched.append(f"$CUDA_HOME/bin/nvcc ({candidate}: not an executable file)")
    else:
        searched.append("$CUDA_HOME/bin/nvcc (CUDA_HOME is unset)")
    on_path = shutil.which("nvcc")
    if on_path is not None:
        return Path(on_path)
    searched.append(f"nvcc on PATH={os.environ.get('PATH', '')!r}")
    raise RuntimeError(f"nvcc not found; searched {' and '.join(searched)}. Install the CUDA toolkit or set "
                       "CUDA_HOME to it.")


@functools.lru_cache(maxsize=None)
def _nvcc_version_of(nvcc: Path) -> str:
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, errors="replace",
                         timeout=NVCC_VERSION_TIMEOUT_S)
    if out.returncode != 0:
        raise RuntimeError(f"`{nvcc} --version` failed with exit {out.returncode}: {out.stderr.strip()}")
    return out.stdout


def build(name: str, sources: Sequence[Path], *, include_dirs: Sequence[Path] = (), flags: Sequence[str] = (),
          generated: Mapping[str, str] | None = None, arch: str = "sm_90a", timeout_s: float = 600.0) -> Path:
    """Compile `sources` into `<name>.so` (each source by its own nvcc run, in parallel, then linked), or return
    the cached library.

    Safe to call from every rank at once: exactly one process per machine (per cache folder) runs nvcc,
    the others wait for it and return the same path.

    Arguments:
        name: names the library and its cache folder; letters, digits, `_`, `.`, `-`.
        sources: the `.cu`/`.cpp` files, compiled and linked together.
        include_dirs: passed as `-I`; headers found there through `#include` are part of the cache key.
        flags: extra nvcc flags, appended after `DEFAULT_FLAGS` and the `-gencode` for `arch`.
        generated: header path (relative, e.g. `moe_comm/abi.h`) -> text, written for the build and included
            like any other header; part of the cache key.
        arch: the target, `sm_<digits>` with an optional `a`/`f` suffix; `sm_90a` builds
            `-gencode=arch=compute_90a,code=sm_90a`.
        timeout_s: the longest wait for another process's build (the lock) and, separately, for each nvcc run.

    Returns:
        The path of the built library, `<cache>/<name>-<hash16>/<name>.so`.

    Raises:
        TimeoutError: the lock stayed held for `timeout_s`; the message names the lock file and its holder.
        RuntimeError: nvcc failed or ran past `timeout_s`; the message has the command and nvcc's output.
    """
    return _build(_plan(name, sources, include_dirs, flags, generated, arch), default_cache_dir(), timeout_s)


def load(name: str, sources: Sequence[Path], *, include_dirs: Sequence[Path] = (), flags: Sequence[str] = (),
         generated: Mapping[str, str] | None = None, arch: str = "sm_90a", timeout_s: float = 600.0) -> ctypes.CDLL:
    """`build`, then open the library with ctypes; once per process per cache key.

    Arguments:
        Those of `build`.

    Returns:
        The loaded library; set `restype`/`argtypes` on its launchers before calling them.
    """
    plan = _plan(name, sources, include_dirs, flags, generated, arch)
    if plan.key not in _LOADED:
        _LOADED[plan.key] = ctypes.CDLL(str(_build(plan, default_cache_dir(), timeout_s)))
    return _LOADED[plan.key]


def compile_check(sources: Sequence[Path], include_dirs: Sequence[Path] = (), generated: Mapping[str, str] | None = None,
                  flags: Sequence[str] = (), arch: str = "sm_90a") -> float:
    """Prove that `sources` compile, in a throw-away cache (CI runs this on a machine without a GPU).

    Arguments:
        sources, include_dirs, generated, flags, arch: as for `build`.

    Returns:
        The seconds the build took.

    Raises:
        RuntimeError: nvcc failed; the message has the command and nvcc's output.
    """
    plan = _plan("compile_check", sources, include_dirs, flags, generated, arch)
    with tempfile.TemporaryDirectory(prefix="moe_comm-jit-check-") as root:
        start = time.monotonic()
        _build(plan, Path(root), timeout_s=600.0)
        return time.monotonic() - start


def cache_key(name: str, sources: Sequence[Path], include_dirs: Sequence[Path] = (),
              generated: Mapping[str, str] | None = None, flags: Sequence[str] = (), arch: str = "sm_90a") -> str:
    """The full cache key `build` would use for these arguments (module docstring): two copies of the sources with
    equal keys compile the same bytes with the same nvcc and flags."""
    return _plan(name, sources, include_dirs, flags, generated, arch).key


def reachable_files(sources: Sequence[Path], include_dirs: Sequence[Path] = ()) -> list[Path]:
    """The files a build of `sources` reads and hashes: the sources and every header they reach (`_reachable_files`)."""
    return [path for path, _ in _reachable_files(tuple(Path(s).absolute() for s in sources),
                                                 tuple(Path(d).absolute() for d in include_dirs))]


@dataclass(frozen=True)
class _Plan:
    """One build: its inputs resolved to absolute paths and its cache key."""

    name: str
    key: str
    nvcc: Path
    flags: tuple[str, ...]
    include_dirs: tuple[Path, ...]
    sources: tuple[Path, ...]
    generated: tuple[tuple[str, str], ...]

    @property
    def folder_name(self) -> str:
        return f"{self.name}-{self.key[:16]}"

    def commands(self, library: Path) -> tuple[list[list[str]], list[str]]:
        """The nvcc runs that make `library`: one compile per source into `obj/` (run in parallel; none for a single
        source), then the one that makes the library (from the objects, or straight from the single source)."""
        nvcc, includes = str(self.nvcc), [f"-I{d}" for d in (library.parent / "gen", *self.include_dirs)]
        if len(self.sources) == 1:
            return [], [nvcc, *self.flags, *includes, "-o", str(library), str(self.sources[0])]
        objects = [library.parent / "obj" / f"{i}-{source.stem}.o" for i, source in enumerate(self.sources)]
        compiles = [[nvcc, *self.flags, *includes, "-c", "-o", str(obj), str(source)]
                    for obj, source in zip(objects, self.sources)]
        return compiles, [nvcc, *self.flags, "-o", str(library), *map(str, objects)]


def _plan(name: str, sources: Sequence[Path], include_dirs: Sequence[Path], flags: Sequence[str],
          generated: Mapping[str, str] | None, arch: str) -> _Plan:
    if not _NAME_RE.fullmatch(name):
        raise ValueError(f"{name=} must match {_NAME_RE.pattern}: it names the cache folder")
    if not _ARCH_RE.fullmatch(arch):
        raise ValueError(f"{arch=} is not of the form sm_<digits>[a|f], e.g. 'sm_90a'")
    for what, value in (("sources", sources), ("include_dirs", include_dirs), ("flags", flags)):
        if isinstance(value, (str, bytes, os.PathLike)):
            raise TypeError(f"{what} must be a sequence, got the single {type(value).__name__} {value!r}")
    source_paths = tuple(Path(s).absolute() for s in sources)
    if not source_paths:
        raise ValueError(f"build {name!r} has no sources")
    for path in source_paths:
        if not path.is_file():
            raise FileNotFoundError(f"source {path} of build {name!r} does not exist")
    dir_paths = tuple(Path(d).absolute() for d in include_dirs)
    gen_files = tuple(sorted((generated or {}).items()))
    for relative, _ in gen_files:
        if Path(relative).is_absolute() or ".." in Path(relative).parts:
            raise ValueError(f"generated header {relative!r} must be a relative path inside the build")
    final_flags = (*DEFAULT_FLAGS, f"-gencode=arch=compute_{arch[3:]},code={arch}", *flags)
    nvcc = find_nvcc()

    # nvcc also reads flags and the host compiler from these: a build made under them is another build.
    nvcc_env = "\0".join(f"{var}={os.environ.get(var, '')}" for var in NVCC_ENV_VARS)
    key = build_key([name, _nvcc_version_of(nvcc), nvcc_env, arch, "\0".join(final_flags)], source_paths, dir_paths,
                    gen_files)
    return _Plan(name, key, nvcc, final_flags, dir_paths, source_paths, gen_files)


def build_key(fields: Sequence[str], sources: tuple[Path, ...], include_dirs: tuple[Path, ...],
              generated: tuple[tuple[str, str], ...]) -> str:
    """sha256 hex digest over `fields`, the source names, the generated headers and the bytes of every file
    reachable from the sources (`_reachable_files`), each length-prefixed so that no two different inputs hash the
    same byte stream."""
    digest = hashlib.sha256()
    data = [*(f.encode() for f in fields), "\0".join(p.name for p in sources).encode()]
    data += [f"{relative}\0{text}".encode() for relative, text in generated]
    data += [content for _, content in _reachable_files(sources, include_dirs)]
    for field in data:
        digest.update(len(field).to_bytes(8, "little"))
        digest.update(field)
    return digest.hexdigest()


def _reachable_files(sources: tuple[Path, ...], include_dirs: tuple[Path, ...]) -> list[tuple[Path, bytes]]:
    """The sources, then every header they reach through `#include`, each once, in first-seen order.

    `"x"` resolves against the including file's folder, then `include_dirs`; `<x>` against `include_dirs`
    only. What does not resolve is a system or toolkit header and is not hashed (the nvcc version stands in
    for the toolkit's). Includes are found textually, so one under a false `#if` is hashed too: harmless.
    """
    files = [(path, path.read_bytes()) for path in sources]
    seen = {path.resolve() for path in sources}
    for including, data in files:  # grows while iterated: a breadth-first walk
        for quote, spelled in _INCLUDE_RE.findall(data):
            folders = ((including.parent,) if quote == b'"' else ()) + include_dirs
            for folder in folders:
                candidate = folder / os.fsdecode(spelled.strip())
                if candidate.is_file():
                    # Dedup by real path, but walk on from the path as spelled, as the preprocessor does
                    if candidate.resolve() not in seen:
                        seen.add(candidate.resolve())
                        files.append((candidate, candidate.read_bytes()))
                    break
    return files


def _build(plan: _Plan, root: Path, timeout_s: float) -> Path:
    if not timeout_s > 0:
        raise ValueError(f"{timeout_s=} must be positive")
    library, _ = build_once(root, plan.folder_name, f"{plan.name}.so", lambda tmp: _compile(plan, tmp, timeout_s),
                            timeout_s)
    return library


def build_once(root: Path, folder_name: str, product: str, compile_into, timeout_s: float) -> tuple[Path, object]:
    """`root/folder_name/product`, built by `compile_into(temp folder)` unless it exists: under the key's lock, in
    a private temp folder renamed into place, so the key folder only ever appears complete. Returns the path and
    what `compile_into` returned (None on a cache hit)."""
    verbose = env.get_bool("MOE_COMM_JIT_VERBOSE")  # read first: a bad value raises before a build, not after it
    final = root / folder_name
    path = final / product
    if path.is_file():
        _say(verbose, f"cache hit {path}")
        return path, None

    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f"{folder_name}.lock", timeout_s):
        # Another rank may have finished while this one waited
        if path.is_file():
            _say(verbose, f"cache hit {path} (built by another process)")
            return path, None
        # Holding the lock, nothing else builds this key: leftovers are from killed builds
        if final.exists():
            shutil.rmtree(final)
        for stale in root.glob(f".tmp-{folder_name}-*"):
            shutil.rmtree(stale, ignore_errors=True)

        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{folder_name}-", dir=root))
        start = time.monotonic()
        try:
            result = compile_into(tmp)
            if not (tmp / product).is_file():
                raise RuntimeError(f"the build of {folder_name} finished without {product} in {tmp}")
            # On disk before it is published (a crash after the rename must not leave a truncated library, which
            # loads as a bus error), and readable where the cache root is (mkdtemp makes the folder private).
            fd = os.open(tmp / product, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.chmod(tmp, root.stat().st_mode & 0o755)  # readable, never writable, by others
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    _say(verbose, f"built {folder_name} in {time.monotonic() - start:.1f} s -> {path}")
    return path, result


def _compile(plan: _Plan, folder: Path, timeout_s: float) -> float:
    """Run nvcc into `folder` (the sources compiled in parallel, as many at once as this process may use CPUs, then
    linked), write `folder/build.log`; the seconds it took, or RuntimeError naming the run that failed."""
    library = folder / f"{plan.name}.so"
    for relative, text in plan.generated:
        path = folder / "gen" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    compiles, link = plan.commands(library)
    (folder / "obj").mkdir()
    start = time.monotonic()
    log = []

    def run(commands: list[list[str]]) -> None:
        jobs = max(1, min(len(commands), len(os.sched_getaffinity(0))))
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            results = list(pool.map(lambda command: _run(command, timeout_s), commands))
        for command, (returncode, output) in zip(commands, results):
            log.append(f"command: {shlex.join(command)}\nexit: {returncode}\n--- nvcc output ---\n{output}")
        for command, (returncode, output) in zip(commands, results):
            if returncode != 0:
                status = f"ran past {timeout_s=} s" if returncode is None else f"failed with exit {returncode}"
                raise RuntimeError(f"nvcc {status} building {plan.name!r} after {time.monotonic() - start:.1f} s\n"
                                   f"command: {shlex.join(command)}\n"
                                   f"--- nvcc output (last {ERROR_TAIL_CHARS} characters) ---\n"
                                   f"{output[-ERROR_TAIL_CHARS:]}")

    try:
        run(compiles)
        run([link])
        if not library.is_file():
            raise RuntimeError(f"nvcc exited 0 building {plan.name!r} without writing {library}\n"
                               f"command: {shlex.join(link)}")
    finally:
        seconds = time.monotonic() - start
        (folder / "build.log").write_text("\n".join(log) + f"\nseconds: {seconds:.2f}\n")
    shutil.rmtree(folder / "obj")
    return seconds


def _run(command: list[str], timeout_s: float) -> tuple[int | None, str]:
    """Exit status (None past the timeout) and combined output of `command`.

    nvcc runs in its own process group so that a timeout or an exception here also stops cicc and ptxas.
    """
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None, proc.communicate()[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def _locked(path: Path, timeout_s: float) -> Iterator[None]:
    """Hold an exclusive `flock` on `path`, polling for up to `timeout_s`.

    NOTES: the lock file is never deleted. Unlinking it while others wait on the old inode would let two
    processes hold "the" lock at once; a leftover file costs nothing and holds no lock once its holder exits.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = path.read_text(errors="replace").strip() or "unknown (not written yet)"
                    raise TimeoutError(f"waited {timeout_s} s for the JIT build lock {path}, held by pid {holder}; "
                                       "if that process is not building, it is stuck: kill it") from None
                time.sleep(LOCK_POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _say(verbose: bool, message: str) -> None:
    if verbose:
        print(f"moe_comm.jit: {message}", file=sys.stderr, flush=True)
