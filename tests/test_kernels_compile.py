"""The kernel library compiles for sm_90a with this machine's nvcc (no GPU needed), in its default build and in the
build variants scripts/profile_ops.py uses; it loads, its structs match `moe_comm.layout` field by field, and a
launcher refuses bad parameters with a message naming the condition and its values. The host extension
(csrc/torch/ops.cpp) builds against this torch, and through fake launchers that record what they are given, its
allocations and per-call pointers are checked here on CPU tensors. CI runs this on its CPU machine, so a kernel or
host path that does not build never lands. (Over 400 lines: the whole C boundary, library and host extension,
checked from one module-scoped build of each.)"""

from __future__ import annotations

import ctypes
import os
import unittest.mock as mock
from pathlib import Path

import pytest
import torch

from moe_comm import jit, layout
from moe_comm.backends import cuda_kernels

# The variants that change code paths (profiling timers, copy depth, receiver stages); the default build is the
# library the `kernels` fixture below builds and loads.
VARIANTS = {
    "block-times": ("-DMOE_COMM_BLOCK_TIMES",),
    "unroll4-stages3": ("-DMOE_COMM_COPY_UNROLL=4", "-DMOE_COMM_RECV_STAGES=3", "-DMOE_COMM_SEND_BATCH=1"),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_kernel_library_compiles_for_sm90a(variant, nvcc):
    seconds = cuda_kernels.compile_check(VARIANTS[variant])
    print(f"{variant}: {seconds:.1f} s")


def test_a_definition_that_differs_from_its_table_row_does_not_compile(nvcc, monkeypatch):
    """abi.h declares every function of `layout.FUNCTIONS`, the table ctypes and the host extension take their types
    from: a definition in csrc/kernels that differs from its row (here `bytes` declared as int) fails to compile."""
    result, params = layout.FUNCTIONS["moe_comm_copy"]
    assert params[2] == ("int64_t", "bytes")
    monkeypatch.setitem(layout.FUNCTIONS, "moe_comm_copy", (result, [*params[:2], ("int", "bytes"), params[3]]))
    with pytest.raises(RuntimeError, match=r'overloaded function "moe_comm_copy" has "C" linkage'):
        jit.compile_check([jit.CSRC_DIR / "kernels" / "signal.cu"], include_dirs=[cuda_kernels.INCLUDE_DIR],
                          generated=cuda_kernels.generated_headers())


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


def test_layout_shared_memory_limit_agrees_with_the_launcher(kernels):
    """The layout kernel's shared memory (moe_comm.layout.layout_smem_bytes) fits exactly where the launcher's own
    check says it does: at the most experts that fit, the launcher gets past its check (then fails: without a GPU,
    or on one because so many blocks of that size cannot be co-resident, so nothing launches with these fake
    pointers); one rank's worth more, both refuse it, the backend with a ValueError naming num_experts before any
    launch."""
    import types

    from moe_comm.backends.cuda import CudaBackend

    R = 8
    fits = max(E for E in range(R, 8192, R) if layout.layout_smem_bytes(R, E) <= layout.MAX_DYNAMIC_SMEM)
    for E in (fits, fits + R):
        params = layout.EpParams(num_ranks=R, num_experts=E, num_local_experts=E // R)
        notify = layout.NotifyArgs(pending_flags=8)
        args = layout.LayoutArgs(num_blocks=layout.LAYOUT_MAX_BLOCKS, scratch=8)
        assert kernels.layout(ctypes.byref(params), ctypes.byref(args), ctypes.byref(notify), None) == 1  # no GPU
        refused = f"num_experts={E} needs {layout.layout_smem_bytes(R, E)} bytes of shared memory" in \
            kernels.last_error().decode()
        assert refused == (E > fits), kernels.last_error()
    call = types.SimpleNamespace(num_topk=8, num_tokens=1, num_experts=fits + R, num_max_tokens_per_rank=1)
    with pytest.raises(ValueError, match=f"num_experts={fits + R} over {R} ranks needs .* bytes of shared memory in "
                                         f"the layout kernel .*use backend='torch'"):
        CudaBackend._fresh_plan(types.SimpleNamespace(num_ranks=R), call, [])


def test_launcher_failure_names_the_condition_and_values(kernels):
    """Checks run before any launch, so they answer on a machine without a GPU."""
    params = layout.EpParams(num_ranks=0, num_experts=8)
    notify = layout.NotifyArgs(pending_flags=8)
    assert kernels.layout(ctypes.byref(params), ctypes.byref(layout.LayoutArgs()), ctypes.byref(notify), None) == 1
    message = kernels.last_error().decode()
    assert "layout.cu" in message and "num_ranks=0, kMaxRanks=32" in message, message
    with pytest.raises(RuntimeError, match="dispatch failed on rank 3: .*num_ranks=0"):
        kernels.check(kernels.dispatch(ctypes.byref(params), ctypes.byref(layout.DispatchInputs()),
                                       ctypes.byref(layout.RecvOutputs()), 4, 0, 0, None), "dispatch", 3)
    params = layout.EpParams(num_ranks=2, num_experts=8, data_bytes=14336, row_stride=14416, num_send_blocks=4)
    assert kernels.combine(ctypes.byref(params), ctypes.byref(layout.CombineArgs()), 1, 4, 0, None) == 1
    assert "part=0, num_send_blocks=4, num_blocks=4" in kernels.last_error().decode()
    # A send or receive launch of a combine in rounds (the next round's senders would overwrite unread rows).
    rounds = layout.CombineArgs(slot_begin=0, slot_end=2, first_round=1, last_round=0)
    assert kernels.combine(ctypes.byref(params), ctypes.byref(rounds), 1, 4, layout.PART_SEND, None) == 1
    assert "part=1, first_round=1, last_round=0" in kernels.last_error().decode()
    assert kernels.dispatch(ctypes.byref(params), ctypes.byref(layout.DispatchInputs()),
                            ctypes.byref(layout.RecvOutputs()), 4, 0, 3, None) == 1
    assert "`part == kPartWhole || part == kPartSend || part == kPartReceive` failed (part=3)" in \
        kernels.last_error().decode()


def test_generated_header_is_in_the_cache_key(nvcc):
    """A layout change rebuilds the library: the generated header's text is hashed like any source."""
    sources = cuda_kernels.kernel_sources()
    a = jit.compiler._plan("k", sources, [cuda_kernels.INCLUDE_DIR], (), {"moe_comm/abi.h": "// a"}, "sm_90a")
    b = jit.compiler._plan("k", sources, [cuda_kernels.INCLUDE_DIR], (), {"moe_comm/abi.h": "// b"}, "sm_90a")
    assert a.key != b.key


MICROBENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "microbench"


@pytest.mark.parametrize("name", sorted(path.stem for path in MICROBENCH.glob("*.cu")))
def test_microbenchmark_compiles_for_sm90a(name, nvcc):
    """Every benchmarks/microbench/*.cu (the per-SM copy and fan-out floors the kernels are measured against) still
    builds."""
    source = MICROBENCH / f"{name}.cu"
    seconds = jit.compile_check([source], include_dirs=[cuda_kernels.INCLUDE_DIR], arch="sm_90a")
    print(f"{name}: {seconds:.1f} s")


# --- The host extension (csrc/torch/ops.cpp): allocations and per-call pointers, checked through fake launchers ---
def _fn_type(name: str):
    """The C function type of a launcher, from its row in `layout.FUNCTIONS`."""
    result, params = layout.ctypes_signature(name)
    return ctypes.CFUNCTYPE(result, *params)


_LAYOUT_FN, _DISPATCH_FN, _COMBINE_FN, _WAIT_NOTIFY_FN = (
    _fn_type(f"moe_comm_{name}") for name in ("layout", "dispatch", "combine", "wait_notify"))
_LAST_ERROR_FN = ctypes.CFUNCTYPE(ctypes.c_void_p)  # the message's address: a callback cannot return a char* it keeps


class FakeLaunchers:
    """Launchers that record a copy of every struct they are given (and the ints), returning `result` (settable;
    with `fail_only` set to a launcher's name, only that one returns it, the others 0). The wait for the notify
    writes the call's number into the done word, as a notify that wrote its summary would, unless `notify_done` is
    False."""

    def __init__(self, result: int = 0) -> None:
        self.calls, self.result, self.fail_only, self.notify_done = [], result, None, True
        self.message = ctypes.create_string_buffer(b"fake launcher failed (values)")
        # Kept on self: the C function pointers live as long as these objects.
        record = self._record
        self.fns = (_LAYOUT_FN(lambda p, a, n, s: record("layout", p, a, n, s)),
                    _DISPATCH_FN(lambda p, i, o, b, w, part, s: record("dispatch", p, i, o, b, w, part, s)),
                    _COMBINE_FN(lambda p, a, d, b, part, s: record("combine", p, a, d, b, part, s)),
                    _WAIT_NOTIFY_FN(self._wait_notify),
                    _LAST_ERROR_FN(lambda: ctypes.addressof(self.message)))

    def _record(self, name, *args) -> int:
        copy = lambda p: type(p.contents).from_buffer_copy(p.contents)  # noqa: E731
        self.calls.append((name, *(copy(a) if isinstance(a, ctypes._Pointer) else a for a in args)))
        return self.result if self.fail_only in (None, name) else 0

    def _wait_notify(self, done: int, value: int, stream: int) -> int:
        if self.notify_done:
            ctypes.c_int64.from_address(done).value = value
        return self._record("wait_notify", done, value, stream)

    def launcher(self):
        return cuda_kernels.host_extension().Launcher(*(ctypes.cast(f, ctypes.c_void_p).value for f in self.fns))


def _params(**fields) -> layout.EpParams:
    return layout.EpParams(**{"rank": 1, "num_ranks": 2, "num_experts": 8, "num_local_experts": 4, "num_tokens": 5,
                              "num_topk": 3, **fields})


def test_host_extension_fresh_dispatch_allocates_and_points_into_one_workspace(kernels):
    """A fresh dispatch is one crossing: the layout launch gets the workspace pieces at `workspace_offsets`; the
    dispatch launch gets outputs of the right shapes and dtypes (FP8 rows stay FP8, routing outputs are views of one
    int64 allocation). With a CPU sync the crossing waits for the notify between the launches and sizes the outputs
    by its summary; without one, the outputs are the worst case's and the routing outputs lie at the end of the
    workspace."""
    fake = FakeLaunchers()
    launcher = fake.launcher()
    N, K, R, E, L, H, cap = 5, 3, 2, 8, 4, 256, 6
    params = _params()
    offsets = layout.workspace_offsets(N, K, R, E, cap, True, 3)
    words = (ctypes.c_int64 * len(offsets))(*offsets)
    args, notify = layout.LayoutArgs(), layout.NotifyArgs(pending_flags=64, summary=128)
    inputs, outputs = layout.DispatchInputs(), layout.RecvOutputs()
    topk_idx = torch.zeros(N, K, dtype=torch.int64)
    q = torch.zeros(N, H, dtype=torch.float8_e4m3fn)
    scales = torch.ones(N, H // 128)
    weights = torch.rand(N, K)
    bf16 = torch.zeros(N, H, dtype=torch.bfloat16)
    # The host-mapped words: the error code at 0, the notify's done word at NOTIFY_DONE_OFFSET, its summary (per source
    # [rows, flags], pending flags per source, rows in all, rows per local expert) at SUMMARY_OFFSET.
    mapped = ctypes.create_string_buffer(layout.SUMMARY_OFFSET + 8 * layout.summary_len(R, L))
    summary = (ctypes.c_int64 * layout.summary_len(R, L)).from_address(ctypes.addressof(mapped) +
                                                                        layout.SUMMARY_OFFSET)

    def crossing(data, scales, weights, do_expand, codes=(0, 0), sync=True, rows=0, expand_rows=0, alignment=1,
                 p=params, w=words, topk=topk_idx, part=0):
        return launcher.layout_dispatch(
            ctypes.addressof(p), ctypes.addressof(args), ctypes.addressof(notify), ctypes.addressof(inputs),
            ctypes.addressof(outputs), topk, data, scales, weights, w if isinstance(w, int) else ctypes.addressof(w),
            ctypes.addressof(mapped) if sync else 0, alignment, rows, expand_rows, do_expand, *codes, 20, part, 99)

    def synced(data, scales, weights, M, counts, do_expand, codes=(0, 0), flags=(0, 0), pending=(0, 0), **kwargs):
        summary[:] = [M - M // 2, flags[0], M // 2, flags[1], *pending, M, *counts]
        return crossing(data, scales, weights, do_expand, codes, **kwargs)

    def check_layout_launch(call, base):
        name, p, a, n, stream = call
        at = lambda i: base + 8 * offsets[i]  # noqa: E731
        assert (name, stream, p.rank) == ("layout", 99, 1)
        assert (a.topk_idx, a.clean_idx, a.send_pos, a.expert_rank) == (topk_idx.data_ptr(), base, at(0), at(3))
        assert (a.num_tokens_per_rank, a.num_tokens_per_expert, a.flags) == (at(1), at(1) + 8 * R,
                                                                             at(1) + 8 * (R + E))
        assert a.scratch == at(5) and offsets[6] - offsets[5] == -(-3 * (R + E + 1) // 2)
        assert (n.num_tokens_per_rank, n.num_tokens_per_expert, n.flags, n.recv_slots) == (
            a.num_tokens_per_rank, a.num_tokens_per_expert, a.flags, at(2))
        assert (n.pending_flags, n.summary) == (64, 128)  # the plan's, untouched

    def check_dispatch(results, clean, M, P, do_expand, with_data=q):
        x, out_scales, idx, src, psum_rank, psum_expert, w = results
        base = clean.data_ptr()
        at = lambda i: base + 8 * offsets[i]  # noqa: E731
        assert clean.shape == (N, K) and clean.dtype == torch.int64 and clean.storage_offset() == 0
        assert (x.shape, x.dtype, out_scales.shape, out_scales.dtype) == ((P, H), q.dtype, (P, 2), torch.float32)
        assert (idx.shape, src.shape, psum_rank.shape, psum_expert.shape) == ((M, K), (M,), (R,), (L,))
        assert w.shape == ((P,) if do_expand else (M, K)) and w.dtype == weights.dtype
        routing = idx.data_ptr()
        assert [t.data_ptr() for t in (src, psum_rank, psum_expert)] == [routing + 8 * M * K, routing + 8 * (M * K + M),
                                                                        routing + 8 * (M * K + M + R)]
        check_layout_launch(fake.calls[0], base)
        name, p, i, o, blocks, with_barrier, part, stream = fake.calls[-1]
        assert (name, blocks, with_barrier, part, stream) == ("dispatch", 20, 0, 0, 99)
        assert (i.x, i.scales, i.clean_idx, i.weights, i.send_pos, i.expert_rank) == (
            with_data.data_ptr(), scales.data_ptr(), base, weights.data_ptr(), at(0), at(3))
        assert (o.counts, o.x, o.scales, o.topk_idx, o.weights, o.src_idx) == (
            at(2), x.data_ptr(), out_scales.data_ptr(), routing, w.data_ptr(), src.data_ptr())
        assert (o.expand_row or 0) == (at(4) if do_expand else 0)
        assert (o.psum_rank, o.psum_expert, o.num_rows, o.num_expand_rows, o.do_expand) == (
            psum_rank.data_ptr(), psum_expert.data_ptr(), M, P, int(do_expand))
        return routing

    # With a CPU sync: layout, the wait, then the dispatch; P rows spread over the experts, no alignment.
    values = []
    for do_expand, M, P in ((True, 7, 11), (False, 7, 7)):
        fake.calls.clear()
        results, clean, P_out, aligned = synced(q, scales, weights, M, [P // L + (e < P % L) for e in range(L)],
                                                do_expand)
        (_, _, _, n, _), (_, done, value, stream), _ = fake.calls
        assert [c[0] for c in fake.calls] == ["layout", "wait_notify", "dispatch"]
        # The wait is for this call's number, which the notify writes: never one an earlier call waited for.
        assert (done, stream) == (ctypes.addressof(mapped) + layout.NOTIFY_DONE_OFFSET, 99)
        assert n.done_value == value and value not in values
        values.append(value)
        assert P_out == P and sum(aligned) == P
        assert clean.untyped_storage().nbytes() == 8 * offsets[-1]
        routing = check_dispatch(results, clean, M, P, do_expand)
        assert routing != clean.data_ptr() + 8 * offsets[-1]  # its own allocation: M was read after the layout

    # Without a CPU sync: no wait, the sizes given reach the struct, the routing after the workspace.
    for do_expand, M, P in ((True, 7, 11), (False, 7, 7)):
        fake.calls.clear()
        results, clean, P_out, aligned = crossing(q, scales, weights, do_expand, sync=False, rows=M, expand_rows=P)
        assert [c[0] for c in fake.calls] == ["layout", "dispatch"] and (P_out, aligned) == (P, None)
        assert clean.untyped_storage().nbytes() == 8 * (offsets[-1] + M * K + M + R + L)
        assert check_dispatch(results, clean, M, P, do_expand) == clean.data_ptr() + 8 * offsets[-1]

    # A dispatch of no tokens: its clean [0, K] view has a null data_ptr(); the pointers still come from the
    # workspace's storage, with and without a CPU sync.
    no_tokens, no_offsets = _params(num_tokens=0), layout.workspace_offsets(0, K, R, E, cap, False, 1)
    no_words = (ctypes.c_int64 * len(no_offsets))(*no_offsets)
    for sync in (True, False):
        fake.calls.clear()
        _, empty, *_ = synced(torch.zeros(0, H, dtype=torch.bfloat16), None, None, 7, [7, 0, 0, 0], False, rows=7,
                              expand_rows=7, p=no_tokens, w=no_words, topk=torch.zeros(0, K, dtype=torch.int64),
                              sync=sync)
        storage = empty.untyped_storage().data_ptr()
        (_, _, a, _, _), *_, (_, _, i, o, *_) = fake.calls
        assert empty.shape == (0, K) and storage and (a.clean_idx, i.clean_idx, o.counts) == (
            storage, storage, storage + 8 * no_offsets[2])
        assert (o.topk_idx == storage + 8 * no_offsets[-1]) == (not sync)

    # Outputs that cannot be allocated (rows of 2**50 bytes) without a CPU sync: both launches still run, the dispatch
    # with no outputs (the peers wait for this rank's notify and rows; its receivers skip every row), then the
    # allocator's error.
    fake.calls.clear()
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        crossing(q, scales, weights, False, sync=False, rows=2**42, expand_rows=2**42)
    check_without_outputs(fake.calls, ["layout", "dispatch"], q)
    # The rows fit (none: zero-width), the workspace with the routing words does not: the layout runs on a workspace
    # without them.
    fake.calls.clear()
    no_width = torch.zeros(N, 0, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        crossing(no_width, None, None, False, sync=False, rows=2**42, expand_rows=2**42)
    check_without_outputs(fake.calls, ["layout", "dispatch"], no_width)
    assert fake.calls[-1][3].counts == fake.calls[0][2].clean_idx + 8 * offsets[2]
    # With a CPU sync, outputs that cannot be allocated after the notify: the dispatch runs without outputs (whole,
    # even when asked to send only: no hook will run), then the allocator's error.
    fake.calls.clear()
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        synced(bf16, None, weights, 2**42, [2**40] * L, True, part=1)
    check_without_outputs(fake.calls, ["layout", "wait_notify", "dispatch"], bf16)

    # Arguments refused, or offsets missing or out of order: nothing launched (the layout kernel is collective), with
    # and without a CPU sync.
    fake.calls.clear()
    backwards = (ctypes.c_int64 * len(offsets))(*reversed(offsets))
    for sync in (True, False):
        with pytest.raises(ValueError, match="quantize and dequantize must be 0, 1"):
            crossing(q, scales, weights, False, (3, 3), sync=sync, rows=7, expand_rows=7)
        with pytest.raises(ValueError, match="workspace offsets: the address is 0"):
            crossing(q, scales, weights, False, sync=sync, rows=7, expand_rows=7, w=0)
        with pytest.raises(ValueError, match="workspace offsets must be non-negative and non-decreasing"):
            crossing(q, scales, weights, False, sync=sync, rows=7, expand_rows=7, w=backwards)
        with pytest.raises(ValueError, match=r"alignment=0 \(at least 1\)"):
            crossing(bf16, None, None, False, sync=sync, rows=7, expand_rows=7, alignment=0)
        with pytest.raises(ValueError, match="topk_idx must be contiguous int64 of num_tokens x num_topk = 15"):
            crossing(bf16, None, None, False, sync=sync, rows=7, expand_rows=7, topk=topk_idx[:4])
        with pytest.raises(ValueError, match="data must be 2-D rows and num_rows, num_expand_rows >= 0; got 2-D data, "
                                             "num_rows=-1"):
            crossing(bf16, None, None, False, sync=sync, rows=-1, expand_rows=7)
        with pytest.raises(ValueError, match="got 1-D data"):
            crossing(bf16[0], None, None, False, sync=sync, rows=7, expand_rows=7)
        for data, scales_in, codes in ((bf16, None, (0, 1)), (q, torch.ones(N, H // 128), (0, 2)),
                                       (bf16, None, (2, 1))):
            with pytest.raises(ValueError, match="dequantize must be 0 or the format of FP8 rows on the wire"):
                crossing(data, scales_in, None, False, codes, sync=sync, rows=7, expand_rows=7)
        with pytest.raises(ValueError, match="quantize casts bf16 rows of a multiple of 128 channels"):
            crossing(torch.zeros(N, H, dtype=torch.float32), None, None, False, (1, 0), sync=sync, rows=7,
                     expand_rows=7)
    assert not fake.calls

    # Without weights and FP8: no weight or scale outputs, null pointers.
    (x, out_scales, *_, w), *_ = synced(bf16, None, None, 7, [7, 0, 0, 0], False)
    assert x.dtype == torch.bfloat16 and out_scales is None and w is None
    assert not (fake.calls[-1][3].scales or fake.calls[-1][3].weights or fake.calls[-1][2].weights)
    # `quantize=`: bf16 rows in, FP8 rows and the format's scales out (the senders cast), no input scales.
    for code, scale_dtype in ((1, torch.float32), (2, torch.int32)):
        (x, out_scales, *_), *_ = synced(bf16, None, None, 7, [3, 2, 2, 2], True, (code, 0))
        assert (x.shape, x.dtype, out_scales.shape, out_scales.dtype) == ((9, H), torch.float8_e4m3fn, (9, H // 128),
                                                                          scale_dtype)
        _, _, i, o, *_ = fake.calls[-1]
        assert (i.quantize, i.x, i.scales, o.scales) == (code, bf16.data_ptr(), None, out_scales.data_ptr())
        # `dequantize`: bf16 outputs and no scales, whether the senders cast (quantize) or the rows came as FP8.
        fp8_scales = torch.ones(N, H // 128, dtype=torch.float32 if code == 1 else torch.int32)
        for data, scales_in in ((bf16, None), (q, fp8_scales)):
            (x, out_scales, *_), *_ = synced(data, scales_in, None, 7, [3, 2, 2, 2], True,
                                             (code if scales_in is None else 0, code))
            assert (x.shape, x.dtype, out_scales, fake.calls[-1][3].dequantize) == ((9, H), torch.bfloat16, None,
                                                                                    code)

    # The per-expert counts aligned up to the alignment on the host side of the launch; P their sum (expand).
    for do_expand, P in ((True, 16), (False, 7)):
        (x, *_, w), _, P_out, aligned = synced(bf16, None, weights, 7, [1, 0, 5, 2], do_expand, alignment=4)
        assert (aligned, P_out, x.shape[0], fake.calls[-1][3].num_expand_rows) == ([4, 0, 8, 4], P, P, P)
    # A problem recorded: nothing launched after the layout, None (the backend raises it): an error code, a rank's
    # flags of this call, a rank's pending flags of an earlier call without CPU sync.
    error_code = ctypes.c_int64.from_address(ctypes.addressof(mapped))
    for code, flags, pending in ((1, (0, 0), (0, 0)), (2, (0, 0), (0, 0)), (0, (0, 2), (0, 0)), (0, (1, 0), (0, 0)),
                                 (0, (0, 0), (4, 0)), (0, (0, 0), (0, 1))):
        fake.calls.clear()
        error_code.value = code
        assert synced(bf16, None, None, 7, [7, 0, 0, 0], False, flags=flags, pending=pending) is None
        assert [c[0] for c in fake.calls] == ["layout", "wait_notify"]
    error_code.value = 0
    # The kernel stopped before its summary (the wait returned when the stream ran dry; the done word holds an
    # earlier call's number, the summary is that call's): nothing launched either; the backend raises what the kernel
    # recorded, and a kernel that recorded nothing is named a bug.
    fake.notify_done = False
    for code in (1, 0):
        fake.calls.clear()
        error_code.value = code
        if code:
            assert synced(bf16, None, None, 7, [7, 0, 0, 0], False) is None
        else:
            with pytest.raises(RuntimeError, match="dispatch notify on rank 1 ended before its summary and recorded "
                                                   "no error: a bug"):
                synced(bf16, None, None, 7, [7, 0, 0, 0], False)
        assert [c[0] for c in fake.calls] == ["layout", "wait_notify"]
    fake.notify_done = True
    # The wait failed: the library's message, nothing launched after the layout.
    fake.calls.clear()
    fake.result = 1
    fake.fail_only = "wait_notify"
    with pytest.raises(RuntimeError, match=r"wait for the dispatch notify failed on rank 1: fake launcher failed"):
        synced(bf16, None, None, 7, [7, 0, 0, 0], False)
    assert [c[0] for c in fake.calls] == ["layout", "wait_notify"]


def check_without_outputs(calls, names, data):
    """The last launch was a dispatch that sends `data` and writes nothing (no output pointers, no rows), whole."""
    assert [c[0] for c in calls] == names
    _, _, i, o, _, _, part, _ = calls[-1]
    assert (i.x or 0, part) == (data.data_ptr(), 0) and i.clean_idx and i.send_pos and o.counts
    assert (o.num_rows, o.num_expand_rows) == (0, 0)
    assert not any((o.x, o.scales, o.weights, o.topk_idx, o.src_idx, o.psum_rank, o.psum_expert))


def test_workspace_pointers_of_a_dispatch_of_no_tokens():
    """A handle's routing state (CudaLayout) addresses the workspace through its storage: the clean [0, K] view of a
    dispatch of no tokens has a null data_ptr(), which made the cached dispatch's and the combine's pointers start
    from address 0 (found on a GPU: wrong rows received)."""
    from moe_comm.backends.cuda import CudaLayout

    offsets = layout.workspace_offsets(0, 8, 2, 16, 4, True, 1)
    workspace = torch.zeros(offsets[-1], dtype=torch.int64)
    clean = workspace.as_strided((0, 8), (8, 1), 0)  # as the host extension returns it
    base = workspace.data_ptr()
    assert clean.data_ptr() == 0 and base
    state = CudaLayout(clean, offsets, True)
    assert [state.pointer(piece) for piece in ("clean_idx", *layout.WORKSPACE_PIECES)] == [
        base, *(base + 8 * offset for offset in offsets[:-1])]
    assert CudaLayout(clean, offsets, False).pointer("expand_row") == 0


def test_host_extension_cached_dispatch_and_combine_rounds(kernels):
    """A cached dispatch launches with the barrier; a combine in rounds sets each round's slots and an fp32 (fp64
    for fp64 rows) accumulator, a single round leaves the plan's slots alone and has no accumulator."""
    fake = FakeLaunchers()
    launcher = fake.launcher()
    params, inputs, outputs = _params(), layout.DispatchInputs(clean_idx=8), layout.RecvOutputs(counts=16)
    data = torch.zeros(5, 128, dtype=torch.bfloat16)
    x, scales = launcher.cached_dispatch(ctypes.addressof(params), ctypes.addressof(inputs), ctypes.addressof(outputs),
                                         data, None, 0, 0, 9, 6, 0, 7)
    assert x.shape == (9, 128) and scales is None
    name, p, i, o, blocks, with_barrier, part, stream = fake.calls[-1]
    assert (name, blocks, with_barrier, part, stream, i.x, o.x, i.clean_idx, o.counts, i.quantize) == (
        "dispatch", 6, 1, 0, 7, data.data_ptr(), x.data_ptr(), 8, 16, 0)
    x, scales = launcher.cached_dispatch(ctypes.addressof(params), ctypes.addressof(inputs), ctypes.addressof(outputs),
                                         data, None, 2, 0, 9, 6, 0, 7)
    assert (x.dtype, scales.shape, scales.dtype, fake.calls[-1][2].quantize) == (torch.float8_e4m3fn, (9, 1),
                                                                                  torch.int32, 2)
    x, scales = launcher.cached_dispatch(ctypes.addressof(params), ctypes.addressof(inputs), ctypes.addressof(outputs),
                                         data, None, 2, 2, 9, 6, 0, 7)
    assert (x.dtype, scales, fake.calls[-1][3].dequantize) == (torch.bfloat16, None, 2)

    args = layout.CombineArgs(slot_begin=0, slot_end=3, first_round=1, last_round=1)
    for dtype, code in ((torch.bfloat16, 1), (torch.float64, 3)):
        fake.calls.clear()
        rows, weights, bias = torch.zeros(9, 64, dtype=dtype), torch.rand(9, 3), torch.zeros(5, 64, dtype=dtype)
        combined, combined_w = launcher.combine(ctypes.addressof(params), ctypes.addressof(args), rows, weights, bias,
                                                None, 5, code, 2, 2, False, 4, 0, 3)
        assert (combined.shape, combined.dtype, combined_w.shape) == ((5, 64), dtype, (5, 3))
        assert [(c[2].slot_begin, c[2].slot_end, c[2].first_round, c[2].last_round) for c in fake.calls] == [
            (0, 2, 1, 0), (2, 3, 0, 1)]
        assert {(c[3], c[4], c[5], c[6]) for c in fake.calls} == {(code, 4, 0, 3)}
        a = fake.calls[0][2]
        assert (a.x, a.weights, a.bias0, a.bias1, a.out, a.out_weights) == (
            rows.data_ptr(), weights.data_ptr(), bias.data_ptr(), None, combined.data_ptr(), combined_w.data_ptr())
        assert a.acc  # fp32 / fp64 accumulator between rounds
    fake.calls.clear()
    args = layout.CombineArgs(slot_begin=0, slot_end=3, first_round=1, last_round=1)
    launcher.combine(ctypes.addressof(params), ctypes.addressof(args), torch.zeros(9, 64), None, None, None, 5, 2, 3, 1,
                     False, 4, 0, 3)
    (_, _, a, *_), = fake.calls
    assert (a.slot_begin, a.slot_end, a.first_round, a.last_round, a.acc, a.weights) == (0, 3, 1, 1, None, None)
    # Unreduced (the hybrid path's terms): [N, T, H] terms instead of the sums, T = ranks, or slots in expand mode;
    # the rounds still set their slots, and there is no accumulator.
    for do_expand, num_terms in ((0, params.num_ranks), (1, params.num_topk)):
        fake.calls.clear()
        args = layout.CombineArgs(do_expand=do_expand)
        terms, _ = launcher.combine(ctypes.addressof(params), ctypes.addressof(args), torch.zeros(9, 64), None, None,
                                    None, 5, 2, 2, 2, True, 4, 0, 3)
        assert terms.shape == (5, num_terms, 64)
        assert [(c[2].slot_begin, c[2].slot_end) for c in fake.calls] == [(0, 2), (2, 3)]
        a = fake.calls[0][2]
        assert (a.terms, a.out, a.acc) == (terms.data_ptr(), None, None)


def test_host_extension_receive_hook_parts(kernels):
    """A call with a hook launches its senders alone (part 1); its hook launches the receivers alone (part 2) along
    the structs as the call set them; a combine in rounds cannot be split (ValueError before any launch)."""
    fake = FakeLaunchers()
    launcher = fake.launcher()
    params, inputs, outputs = _params(), layout.DispatchInputs(clean_idx=8), layout.RecvOutputs(counts=16)
    data = torch.zeros(5, 128, dtype=torch.bfloat16)
    x, _ = launcher.cached_dispatch(ctypes.addressof(params), ctypes.addressof(inputs), ctypes.addressof(outputs),
                                    data, None, 0, 0, 9, 6, layout.PART_SEND, 7)
    launcher.receive_dispatch(ctypes.addressof(params), ctypes.addressof(inputs), ctypes.addressof(outputs), 6, 8)
    (_, _, i1, o1, b1, w1, part1, s1), (_, _, i2, o2, b2, w2, part2, s2) = fake.calls
    assert (b1, w1, part1, s1, b2, part2, s2) == (6, 1, layout.PART_SEND, 7, 6, layout.PART_RECEIVE, 8)
    assert (bytes(i1), bytes(o1)) == (bytes(i2), bytes(o2)) and o2.x == x.data_ptr()

    fake.calls.clear()
    args = layout.CombineArgs(slot_begin=0, slot_end=3, first_round=1, last_round=1)
    rows = torch.zeros(9, 64, dtype=torch.bfloat16)
    combined, _ = launcher.combine(ctypes.addressof(params), ctypes.addressof(args), rows, None, None, None, 5, 1, 3,
                                   1, False, 4, layout.PART_SEND, 3)
    launcher.receive_combine(ctypes.addressof(params), ctypes.addressof(args), 1, 4, 5)
    (_, _, a1, d1, b1, part1, s1), (_, _, a2, d2, b2, part2, s2) = fake.calls
    assert (d1, b1, part1, s1, d2, b2, part2, s2) == (1, 4, layout.PART_SEND, 3, 1, 4, layout.PART_RECEIVE, 5)
    assert bytes(a1) == bytes(a2) and a2.out == combined.data_ptr()
    fake.calls.clear()
    for part, rounds in ((layout.PART_SEND, 2), (layout.PART_RECEIVE, 1)):
        with pytest.raises(ValueError, match=f"part must be 0 .whole., or 1 .send. for a combine of one round; got "
                                             f"part={part}, num_rounds={rounds}"):
            launcher.combine(ctypes.addressof(params), ctypes.addressof(args), rows, None, None, None, 5, 1, 2,
                             rounds, False, 4, part, 3)
    assert not fake.calls


def test_host_extension_raises_the_launchers_message(kernels):
    """A launcher's failure is a RuntimeError with the rank and the launcher's own message; through the real
    library (no GPU here) its checks answer before any launch."""
    fake = FakeLaunchers(result=1)
    # The extension writes into the structs: they must outlive the call (no temporaries).
    params, inputs, outputs = _params(), layout.DispatchInputs(), layout.RecvOutputs()
    with pytest.raises(RuntimeError, match=r"moe_comm: dispatch failed on rank 1: fake launcher failed \(values\)"):
        fake.launcher().cached_dispatch(ctypes.addressof(params), ctypes.addressof(inputs), ctypes.addressof(outputs),
                                        torch.zeros(2, 16), None, 0, 0, 2, 4, 0, 0)
    bad, args, notify = _params(num_ranks=0), layout.LayoutArgs(), layout.NotifyArgs(pending_flags=8)
    offsets = (ctypes.c_int64 * 7)(15, 25, 36, 100, 108, 108, 120)
    with pytest.raises(RuntimeError, match=r"dispatch layout and notify failed on rank 1: layout.cu:\d+: .*"
                                           r"num_ranks=0, kMaxRanks=32"):
        kernels.launcher.layout_dispatch(
            ctypes.addressof(bad), ctypes.addressof(args), ctypes.addressof(notify), ctypes.addressof(inputs),
            ctypes.addressof(outputs), torch.zeros(5, 3, dtype=torch.int64), torch.zeros(5, 16), None, None,
            ctypes.addressof(offsets), 0, 1, 0, 0, False, 0, 0, 4, 0, 0)
    with pytest.raises(ValueError, match="a launcher address is 0"):
        cuda_kernels.host_extension().Launcher(0, 0, 0, 0, 0)


def test_host_extension_file_is_its_cache_file(kernels):
    """A fresh build is imported from its temp folder, then renamed into the cache: `__file__` names the cache file
    (it named the temp folder, gone)."""
    path = Path(cuda_kernels.host_extension().__file__)
    assert path.is_file() and not path.parent.name.startswith(".tmp-"), path


def test_host_extension_builds_with_the_ninja_package(kernels, monkeypatch):
    """Without a ninja on PATH the build takes the pip package's binary (a dependency of moe_comm). It is this
    process's second build (the fixture built one): it still produces `moe_comm_host.so` in its cache folder (torch's
    extension versioner would name it `moe_comm_host_v1`, which no later process looks for; the build raises if its
    product is missing)."""
    import ninja

    from moe_comm.jit import extension

    monkeypatch.setattr(extension.shutil, "which", lambda name: None)
    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))  # restored afterwards: the build prepends to it
    assert cuda_kernels.extension_check() > 0
    assert os.environ["PATH"].split(os.pathsep)[0] == ninja.BIN_DIR


def synchronized_dispatch_rank(rank: int, world_size: int) -> list[str]:
    """The CUDA backend's synchronized dispatch on this CPU (scripts/host_path_cpu.py: no-op launchers, the
    host-mapped words in host memory, written here as a notify would): outputs sized by the summary (counts aligned
    in the extension), and each problem the summary can report raised by the backend with its own error."""
    import importlib.util
    import tempfile

    from moe_comm.backends.cuda import PHASES

    spec = importlib.util.spec_from_file_location(
        "host_path_cpu", Path(__file__).resolve().parents[1] / "scripts" / "host_path_cpu.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    E, N = script.EXPERTS, 128
    seen = []
    with tempfile.TemporaryDirectory() as folder:
        buf = script.cpu_cuda_buffer(folder)
        impl = buf._impl
        x = torch.zeros(N, script.HIDDEN, dtype=torch.bfloat16)
        idx = torch.arange(N * script.TOPK, dtype=torch.int64).view(N, script.TOPK) % E
        words = (ctypes.c_int64 * layout.summary_len(1, E)).from_address(impl._mapped_host + layout.SUMMARY_OFFSET)

        def dispatch(rows=N, counts=(4,) * E, flags=0, pending=0, topk_idx=idx, **kwargs):
            words[:] = [rows, flags, pending, rows, *counts]
            return buf.dispatch(x, topk_idx, num_experts=E, **kwargs)

        epoch = impl.epoch
        recv_x, recv_idx, _, handle, _ = dispatch()
        assert (recv_x.shape[0], recv_idx.shape[0], handle.num_recv_tokens) == (N, N, N)
        assert handle.num_recv_tokens_per_expert_list == [4] * E and impl.epoch == epoch + 1
        recv_x, _, _, handle, _ = dispatch(counts=(1, 0, 5) + (4,) * (E - 3), do_expand=True, expert_alignment=4)
        aligned = [4, 0, 8] + [4] * (E - 3)
        assert handle.num_recv_tokens_per_expert_list == aligned and recv_x.shape[0] == sum(aligned)

        bad = idx.clone()
        bad[5, 2] = E + 7
        with pytest.raises(ValueError, match=rf"topk_idx is invalid: entries outside \[-1, {E}\) on rank\(s\) \[0\]; "
                                             rf"first bad slot: topk_idx\[5, 2\]={E + 7}"):
            dispatch(flags=1, topk_idx=bad)
        seen.append("flags")
        impl.pending_flags[0] = 2  # what an earlier dispatch without CPU sync left (the summary copies it)
        with pytest.raises(ValueError, match=r"in an earlier dispatch without CPU sync \(slots dropped\): "
                                             r"duplicate experts in a row on rank\(s\) \[0\]"):
            dispatch(pending=2)
        assert impl.pending_flags.tolist() == [0]
        seen.append("pending")
        with pytest.raises(RuntimeError, match="reported a problem that nothing names"):
            dispatch(pending=2)  # the summary says so, the flags do not: a bug, named as one
        seen.append("unnamed")
        error = impl._error

        def notify_times_out(done, value, stream):  # the notify times out (no summary) while the host waits for it
            error.code, error.phase = layout.ERROR_TIMEOUT, PHASES.index("barrier before dispatch")
            error.rank, error.peer = 0, 3
            return 0

        wait = _WAIT_NOTIFY_FN(notify_times_out)
        os.mkdir(os.path.join(folder, "again"))
        lib = script.no_op_library(os.path.join(folder, "again"))
        address = lambda name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value  # noqa: E731
        impl.launcher = cuda_kernels.host_extension().Launcher(
            address("layout"), address("dispatch"), address("combine"), ctypes.cast(wait, ctypes.c_void_p).value,
            address("last_error"))
        with pytest.raises(TimeoutError, match="rank 0 timed out in barrier before dispatch waiting for peer 3"):
            dispatch()
        with pytest.raises(RuntimeError, match="broken since an earlier error"):
            dispatch()
        seen.append("timeout")
        assert impl.epoch == epoch + 6  # every call that reached the kernels counted alike on every rank
    return seen


def test_synchronized_dispatch_reads_the_summary(kernels):
    from moe_comm.testing import WorkerPool

    with WorkerPool(1, backend="gloo", timeout_s=240) as pool:
        assert pool.run(synchronized_dispatch_rank) == [["flags", "pending", "unnamed", "timeout"]]


def test_host_path_cpu_script_runs(kernels):
    """scripts/host_path_cpu.py (the CUDA backend's host path timed on this CPU, no-op launchers) still assembles a
    backend without its constructor and runs every op: it breaks when CudaBackend gains state the script does not
    set, or the host extension's arguments change."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:  # a free port for its one-rank gloo group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).resolve().parents[1] / "scripts" / "host_path_cpu.py"
    run = subprocess.run([sys.executable, str(script), "--iters", "10", "--profile", "cached"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "MASTER_PORT": str(port)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert all(f"  {op}\n" in run.stdout for op in ("fresh no-sync", "fresh sync", "cached", "combine")), run.stdout
    assert "function calls" in run.stdout  # the cProfile of "cached"
