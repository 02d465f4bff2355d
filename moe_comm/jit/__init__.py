"""JIT build of the CUDA kernels in `csrc/` at first use, never at import (DESIGN 5).

`build` compiles sources into a cached shared library, `load` opens it with ctypes, `compile_check` proves that
sources compile (CI, no GPU needed). Cache layout, key and locking protocol: `moe_comm.jit.compiler`.
"""

from .compiler import CSRC_DIR, build, compile_check, default_cache_dir, find_nvcc, load

__all__ = ["CSRC_DIR", "build", "compile_check", "default_cache_dir", "find_nvcc", "load"]
