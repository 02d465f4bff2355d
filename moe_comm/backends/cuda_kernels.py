"""The C boundary of the CUDA backend: build and load the kernel library (`moe_comm/csrc`, by `moe_comm.jit`),
declare every function's argument and return types, check that the compiler laid out each struct exactly as
`moe_comm.layout` did (size and every field offset), and raise a failed launch as a RuntimeError that names the
failed condition with its values (the launchers' `moe_comm_last_error`).

Two builds: the kernel library has no torch headers, so the CPU CI machine (whose torch has no CUDA parts) compiles
it, a cold build takes seconds, and one library serves every torch version; ctypes opens it for what the host calls
rarely (host-mapped memory, the ABI table). Every launch goes through the host extension (`csrc/torch/ops.cpp`, a
Python module built against the installed torch), which allocates a call's outputs, sets its pointers in the
launch structs the backend built once per shape, and calls the library's launchers at the addresses given to it:
one crossing per launch with no Python in between (`moe_comm.backends.cuda`).
"""

from __future__ import annotations

import ctypes
import hashlib
from pathlib import Path
from types import ModuleType
from typing import Sequence

import torch

from .. import jit, layout
from ..jit.compiler import cache_key, reachable_files
from ..jit.extension import extension_compile_check, extension_key, load_extension

LIBRARY = "moe_comm_kernels"
EXTENSION = "moe_comm_host"
EXTENSION_SOURCES = ("ops.cpp",)
# Launchers over header-only device code: csrc/kernels/<op>.cu includes csrc/include/moe_comm/impls/<op>.cuh
# (layout.cu launches the layout and the notify, runtime.cu holds host-mapped memory, errors and the ABI table,
# signal.cu the flags and copies of the buffer's pipeline, all-gather and reduce-scatter, engram.cu its fetch,
# expert_sum.cu the Megatron integration's per-row sum of expert outputs).
KERNEL_SOURCES = ("runtime.cu", "layout.cu", "dispatch.cu", "combine.cu", "signal.cu", "engram.cu", "expert_sum.cu")
INCLUDE_DIR = jit.CSRC_DIR / "include"

# name -> (restype, argtypes), from moe_comm.layout.FUNCTIONS (whose C declarations the library is compiled against);
# every launcher returns 0 or 1 (then moe_comm_last_error says why).
SIGNATURES = {name: layout.ctypes_signature(name) for name in layout.FUNCTIONS}
# Only in a build with -DMOE_COMM_BLOCK_TIMES (scripts/profile_ops.py --variants times=1).
BLOCK_TIME_SIGNATURES = {name: layout.ctypes_signature(name) for name in layout.BLOCK_TIME_FUNCTIONS}


def kernel_sources() -> list[Path]:
    return [jit.CSRC_DIR / "kernels" / name for name in KERNEL_SOURCES]


def generated_headers() -> dict[str, str]:
    return {"moe_comm/abi.h": layout.render_header()}


def extension_sources() -> list[Path]:
    return [jit.CSRC_DIR / "torch" / name for name in EXTENSION_SOURCES]


def compile_check(flags: Sequence[str] = ()) -> float:
    """Prove that the kernel library compiles for sm_90a (CI, no GPU needed); returns the seconds it took."""
    return jit.compile_check(kernel_sources(), include_dirs=[INCLUDE_DIR], generated=generated_headers(),
                             flags=flags)


def extension_check() -> float:
    """Prove that the host extension builds against this torch and imports; returns the seconds it took."""
    return extension_compile_check(EXTENSION, extension_sources(), include_dirs=[INCLUDE_DIR],
                                   generated=generated_headers())


def build_inputs() -> dict:
    """What the two default builds read, for comparing two copies of the package: `keys` (the kernel library's and
    the host extension's cache keys, which hash every byte the compilers read from the package, the flags, the
    compilers' environment variables and nvcc's and torch's versions) and `files` (each file a build reads, relative to csrc/, and its sha256). Two
    copies with equal keys build the same library and extension."""
    sources = [*kernel_sources(), *extension_sources()]
    return {"keys": {LIBRARY: cache_key(LIBRARY, kernel_sources(), [INCLUDE_DIR], generated_headers()),
                     EXTENSION: extension_key(EXTENSION, extension_sources(), include_dirs=[INCLUDE_DIR],
                                              generated=generated_headers())},
            "files": {path.resolve().relative_to(jit.CSRC_DIR).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
                      for path in reachable_files(sources, [INCLUDE_DIR])}}


def host_extension() -> ModuleType:
    """The host extension (csrc/torch/ops.cpp), built at first use and loaded once per process: its `Launcher`
    takes the addresses of the kernel library's moe_comm_layout, moe_comm_dispatch, moe_comm_combine,
    moe_comm_wait_notify and moe_comm_last_error."""
    return load_extension(EXTENSION, extension_sources(), include_dirs=[INCLUDE_DIR], generated=generated_headers())


class Kernels:
    """The loaded kernel library with typed functions, and `launcher`, the host extension bound to its launchers.

    Arguments:
        flags: extra nvcc flags (build variants, e.g. `-DMOE_COMM_COPY_UNROLL=4`); each set is its own build.

    Raises:
        RuntimeError: nvcc, ninja or the C++ compiler is missing or failed, or a struct's layout differs between
            ctypes and the compiler.
        ImportError: the host extension built but does not load.
    """

    def __init__(self, flags: Sequence[str] = ()) -> None:
        self.flags = tuple(flags)
        lib = jit.load(LIBRARY, kernel_sources(), include_dirs=[INCLUDE_DIR], generated=generated_headers(),
                       flags=self.flags)
        signatures = dict(SIGNATURES)
        if "-DMOE_COMM_BLOCK_TIMES" in self.flags:
            signatures.update(BLOCK_TIME_SIGNATURES)
        for name, (restype, argtypes) in signatures.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
            setattr(self, name[len("moe_comm_"):], fn)
        self._check_abi()
        # Launches: `launcher.layout_dispatch(...)` (a fresh dispatch), `.cached_dispatch`, `.combine`, and the
        # receivers of a call with a hook, `.receive_dispatch`, `.receive_combine` (csrc/torch/ops.cpp).
        self.launcher = host_extension().Launcher(*(
            ctypes.cast(fn, ctypes.c_void_p).value
            for fn in (self.layout, self.dispatch, self.combine, self.wait_notify, self.last_error)))

    def _check_abi(self) -> None:
        expected = layout.abi_table()
        values = (ctypes.c_int64 * len(expected))()
        count = self.abi(values, len(expected))
        if count != len(expected):
            raise RuntimeError(f"moe_comm kernel library has {count} ABI entries, moe_comm.layout {len(expected)}: "
                               f"the library was built from other sources")
        wrong = [f"{what}: C {got}, ctypes {want}" for (what, want), got in zip(expected, values) if got != want]
        if wrong:
            raise RuntimeError("moe_comm kernel structs differ between the compiler and ctypes: " + "; ".join(wrong))

    def check(self, result: int, what: str, rank: int) -> None:
        """Raise RuntimeError for a launcher's non-zero result, with the launcher's own message."""
        if result:
            raise RuntimeError(f"moe_comm: {what} failed on rank {rank}: {self.last_error().decode()}")


_LOADED: dict[tuple[str, ...], Kernels] = {}


def load_kernels(flags: Sequence[str] = ()) -> Kernels:
    """The kernel library built with `flags`, built at first use and loaded once per process."""
    key = tuple(flags)
    if key not in _LOADED:
        _LOADED[key] = Kernels(key)
    return _LOADED[key]


def current_stream(device_index: int) -> int:
    """The raw handle of the current CUDA stream of a device (torch's own accessor, without a Stream object)."""
    return torch._C._cuda_getCurrentRawStream(device_index)


__all__ = ["Kernels", "load_kernels", "compile_check", "extension_check", "host_extension", "kernel_sources",
           "extension_sources", "generated_headers", "current_stream"]
