"""The kernel library compiles for sm_90a with this machine's nvcc (no GPU needed), in its default build and in the
build variants scripts/profile_ops.py uses; it loads, its structs match `moe_comm.layout` field by field, and a
launcher refuses bad parameters with a message naming the condition and its values. CI runs this on its CPU
machine, so a kernel that does not build never lands."""

from __future__ import annotations

import ctypes
import os
import unittest.mock as mock
from pathlib import Path

import pytest

from moe_comm import jit, layout
from moe_comm.backends import cuda_kernels

# The default build and the variants that change code paths (profiling timers, copy depth, receiver stages).
VARIANTS = {
    "default": (),
    "block-times": ("-DMOE_COMM_BLOCK_TIMES",),
    "unroll4-stages3": ("-DMOE_COMM_COPY_UNROLL=4", "-DMOE_COMM_RECV_STAGES=3", "-DMOE_COMM_SEND_BATCH=1"),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_kernel_library_compiles_for_sm90a(variant, nvcc):
    seconds = cuda_kernels.compile_check(VARIANTS[variant])
    print(f"{variant}: {seconds:.1f} s")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory, nvcc):
    # Restores the variable's previous value (or absence) afterwards.
    with mock.patch.dict(os.environ, {"MOE_COMM_JIT_CACHE_DIR": str(tmp_path_factory.mktemp("jit"))}):
        yield cuda_kernels.Kernels()


def test_library_loads_with_typed_functions_and_matching_structs(kernels):
    """The library opens without a GPU (static CUDA runtime); the constructor compared every struct's size and
    field offsets with ctypes (moe_comm.layout), and every function has its argument types."""
    for name, (restype, argtypes) in cuda_kernels.SIGNATURES.items():
        fn = getattr(kernels, name[len("moe_comm_"):])
        assert fn.restype is restype and list(fn.argtypes) == argtypes, name
    values = (ctypes.c_int64 * 1000)()
    count = kernels.abi(values, 1000)
    assert [v for _, v in layout.abi_table()] == list(values[:count])


def test_abi_mismatch_is_a_runtime_error_naming_the_field(kernels, monkeypatch):
    real = layout.abi_table()
    monkeypatch.setattr(layout, "abi_table", lambda: real[:5] + [(real[5][0], real[5][1] + 8)] + real[6:])
    with pytest.raises(RuntimeError, match=r"offsetof\(ErrorRecord, observed\): C 32, ctypes 40"):
        kernels._check_abi()


def test_launcher_failure_names_the_condition_and_values(kernels):
    """Checks run before any launch, so they answer on a machine without a GPU."""
    params = layout.EpParams(num_ranks=0, num_experts=8)
    notify = layout.NotifyArgs(pending_flags=8)
    assert kernels.layout(ctypes.byref(params), ctypes.byref(layout.LayoutArgs()), ctypes.byref(notify), None) == 1
    message = kernels.last_error().decode()
    assert "layout.cu" in message and "num_ranks=0, kMaxRanks=32" in message, message
    with pytest.raises(RuntimeError, match="dispatch failed on rank 3: .*num_ranks=0"):
        kernels.check(kernels.dispatch(ctypes.byref(params), ctypes.byref(layout.DispatchInputs()),
                                       ctypes.byref(layout.RecvOutputs()), 4, 0, None), "dispatch", 3)
    params = layout.EpParams(num_ranks=2, num_experts=8, data_bytes=14336, row_stride=14416, num_send_blocks=4)
    assert kernels.combine(ctypes.byref(params), ctypes.byref(layout.CombineArgs()), 1, 4, None) == 1
    assert "num_send_blocks=4, num_blocks=4" in kernels.last_error().decode()


def test_generated_header_is_in_the_cache_key(nvcc):
    """A layout change rebuilds the library: the generated header's text is hashed like any source."""
    sources = cuda_kernels.kernel_sources()
    a = jit.compiler._plan("k", sources, [cuda_kernels.INCLUDE_DIR], (), {"moe_comm/abi.h": "// a"}, "sm_90a")
    b = jit.compiler._plan("k", sources, [cuda_kernels.INCLUDE_DIR], (), {"moe_comm/abi.h": "// b"}, "sm_90a")
    assert a.key != b.key


def test_copy_microbenchmark_compiles_for_sm90a(nvcc):
    """benchmarks/microbench/copy_bench.cu (the per-SM copy floor the kernels are measured against) still builds."""
    source = Path(__file__).resolve().parents[1] / "benchmarks" / "microbench" / "copy_bench.cu"
    seconds = jit.compile_check([source], include_dirs=[cuda_kernels.INCLUDE_DIR], arch="sm_90a")
    print(f"copy_bench: {seconds:.1f} s")
