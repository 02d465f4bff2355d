"""Build a C++ Python extension against the installed torch at first use, cached on disk beside the kernel
libraries (`moe_comm.jit.compiler`), with `torch.utils.cpp_extension` (which knows torch's include paths, libraries
and ABI flags, and builds with ninja).

Cache layout under `default_cache_dir()`:
    <name>-<hash16>/<name>.so    the extension module (and cpp_extension's build files)
    <name>-<hash16>.lock         flock'd by whoever builds that key

The key is a sha256 over the name, the torch and Python versions, `CXX`, the generated headers, and the bytes of every
source and of every header reachable from them through `#include` in `include_dirs` (torch's own headers are
covered by the torch version). As for the kernel libraries, a key folder only ever appears complete: the build
runs in a private temp folder that is renamed into place, under the key's lock.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

from .compiler import _NAME_RE, build_key, build_once, default_cache_dir

# Modules loaded by this process, by full cache key.
_LOADED: dict[str, ModuleType] = {}


def load_extension(name: str, sources: Sequence[Path], *, include_dirs: Sequence[Path] = (),
                   generated: Mapping[str, str] | None = None, timeout_s: float = 600.0) -> ModuleType:
    """Build `sources` into the Python extension module `name` (the sources define it with
    `PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)`), or load the cached build; once per process per key.

    Arguments:
        name: the module's name and its cache folder's; letters, digits, `_`.
        sources: the `.cpp` files.
        include_dirs: our header folders (torch's are added); headers found there are part of the key.
        generated: header path (relative) -> text, written for the build; part of the key.
        timeout_s: the longest wait for another process's build of the same key.

    Raises:
        TimeoutError: the lock stayed held for `timeout_s`.
        RuntimeError: the compiler failed (torch's message, with the compiler's output).
    """
    key, sources, include_dirs, gen = _key(name, sources, include_dirs, generated)
    if key not in _LOADED:
        _LOADED[key] = _build_or_load(name, key, sources, include_dirs, gen, default_cache_dir(), timeout_s)
    return _LOADED[key]


def extension_compile_check(name: str, sources: Sequence[Path], *, include_dirs: Sequence[Path] = (),
                            generated: Mapping[str, str] | None = None) -> float:
    """Build and import `sources` in a throw-away cache (CI, no GPU needed); returns the seconds it took."""
    key, sources, include_dirs, gen = _key(name, sources, include_dirs, generated)
    with tempfile.TemporaryDirectory(prefix="moe_comm-ext-check-") as root:
        start = time.monotonic()
        _build_or_load(name, key, sources, include_dirs, gen, Path(root), timeout_s=600.0)
        return time.monotonic() - start


def extension_key(name: str, sources: Sequence[Path], *, include_dirs: Sequence[Path] = (),
                  generated: Mapping[str, str] | None = None) -> str:
    """The full cache key `load_extension` would use for these arguments (module docstring)."""
    return _key(name, sources, include_dirs, generated)[0]


def _key(name: str, sources: Sequence[Path], include_dirs: Sequence[Path], generated: Mapping[str, str] | None):
    import torch

    if not _NAME_RE.fullmatch(name) or "." in name or "-" in name:
        raise ValueError(f"{name=} must be a Python identifier: it names the module and its cache folder")
    source_paths = tuple(Path(s).absolute() for s in sources)
    for path in source_paths:
        if not path.is_file():
            raise FileNotFoundError(f"source {path} of extension {name!r} does not exist")
    dir_paths = tuple(Path(d).absolute() for d in include_dirs)
    gen = tuple(sorted((generated or {}).items()))
    # The host compiler (cpp_extension takes `CXX`) is part of the build, as nvcc's version is of the kernels'.
    key = build_key([name, torch.__version__, sys.version, f"CXX={os.environ.get('CXX', '')}"], source_paths,
                    dir_paths, gen)
    return key, source_paths, dir_paths, gen


def _build_or_load(name: str, key: str, sources, include_dirs, generated, root: Path, timeout_s: float) -> ModuleType:
    path, built = build_once(root, f"{name}-{key[:16]}", f"{name}.so",
                             lambda tmp: _compile(name, sources, include_dirs, generated, tmp), timeout_s)
    if built is None:
        return _import(name, path)
    built.__file__ = str(path)  # a fresh build was imported from its temp folder, renamed into `path` since
    return built


def _compile(name: str, sources, include_dirs, generated, folder: Path) -> ModuleType:
    """Build `<folder>/<name>.so` and return it loaded (cpp_extension imports what it built)."""
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the pip package's binary (a dependency), when no system ninja is on PATH
        import ninja
        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    for relative, text in generated:
        path = folder / "gen" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    # cpp_extension renames a second build of the same name in one process (`<name>_v1`, keyed by the build folder,
    # which is a fresh temp folder each time): the module would not be found under its name in the cache.
    cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(name, None)
    return cpp_extension.load(name, [str(s) for s in sources], extra_cflags=["-O2"],
                              extra_include_paths=[str(folder / "gen"), *map(str, include_dirs)],
                              build_directory=str(folder), with_cuda=False, verbose=False)


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
