"""Every bad argument raises TypeError/ValueError naming it and its values, before any communication, on every
rank alike; the buffer keeps working afterwards. Bad topk_idx values are caught by the count exchange."""

from __future__ import annotations

import dataclasses
import os
import time
import unittest.mock as mock

import pytest
import torch

import moe_comm
from moe_comm import quant
from moe_comm.testing.checks import check_case
from moe_comm.testing.disagreement import assert_refusals, run_refusals
from moe_comm.testing.routing import Case, rank_inputs

GOOD = Case(seed=41, num_ranks=2, num_experts=4, num_topk=2, hidden=128, num_tokens=(6, 4),
            num_max_tokens_per_rank=8)


def new_buffer(**kw) -> moe_comm.Buffer:
    args = dict(num_max_tokens_per_rank=8, hidden=128, num_topk=2, backend="torch", num_cpu_timeout_secs=30)
    args.update(kw)
    return moe_comm.Buffer(None, **args)


def argument_errors(buf, rank):
    """(label, exception type, message fragment, call) for every argument check."""
    x, idx, w = rank_inputs(GOOD, rank)
    _, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=4)
    _, _, _, handle_expand, _ = buf.dispatch(x, idx, w, num_experts=4, do_expand=True, expert_alignment=2)
    rows = handle.num_recv_rows
    y = torch.zeros(rows, 128, dtype=torch.bfloat16)
    q, scales = quant.quantize(x, "fp8_block128")
    d = buf.dispatch
    return [
        ("x dtype", TypeError, "x.dtype=torch.int32", lambda: d(x.int(), idx, w, num_experts=4)),
        ("x list", TypeError, "x must be a torch.Tensor or an FP8 (q, scales) tuple, got a list of length 6"
         if rank == 0 else "got a list of length 4", lambda: d(x.tolist(), idx, w, num_experts=4)),
        ("x 1-D", ValueError, "x must be 2-D", lambda: d(x[0], idx, w, num_experts=4)),
        ("x non-contiguous", ValueError, "contiguous", lambda: d(x[:, ::2], idx, w, num_experts=4)),
        ("x row bytes", ValueError, "12 x 2 = 24 bytes", lambda: d(x[:, :12].contiguous(), idx, w, num_experts=4)),
        ("x alignment", ValueError, "x starts at an address that is not 16-byte aligned (data_ptr % 16 = 6)",
         lambda: d(torch.cat([x.new_zeros(3), x.flatten()])[3:].view(x.shape), idx, w, num_experts=4)),
        ("too many tokens", ValueError, "(x rows) exceeds num_max_tokens_per_rank=3",
         lambda: d(x, idx, w, num_experts=4, num_max_tokens_per_rank=3)),
        ("experts per rank", ValueError, "num_experts=5 is not a multiple of the group size 2",
         lambda: d(x, idx, w, num_experts=5)),
        ("topk > experts", ValueError, "num_topk=3 (topk_idx columns) exceeds num_experts=2",
         lambda: d(x, torch.cat([idx, idx[:, :1]], dim=1), None, num_experts=2)),
        ("topk_idx dtype", TypeError, "topk_idx.dtype=torch.int32", lambda: d(x, idx.int(), w, num_experts=4)),
        ("topk_idx rows", ValueError, "rows, x has",
         lambda: d(x, idx[:5].contiguous(), w, num_experts=4) if rank == 0 else d(x, idx[:3].contiguous(), w, num_experts=4)),
        ("weights dtype", TypeError, "topk_weights.dtype=torch.float64", lambda: d(x, idx, w.double(), num_experts=4)),
        ("weights shape", ValueError, "topk_weights shape", lambda: d(x, idx, w[:, :1].contiguous(), num_experts=4)),
        ("buffer too small", ValueError, "buffer too small: this call needs",
         lambda: d(torch.zeros(x.shape[0], 256, dtype=torch.bfloat16), idx, w, num_experts=4)),
        ("buffer too small fp64", ValueError, "element size 8", lambda: d(x.double(), idx, w, num_experts=4)),
        ("buffer too small names its own sizes", ValueError, "(made with num_max_tokens_per_rank=8, hidden=128, "
         "num_topk=2, use_fp8_dispatch=False; its hidden counts bf16 elements: a float32 row takes 2x",
         lambda: d(x.double(), idx, w, num_experts=4)),
        ("no num_experts", ValueError, "num_experts is required", lambda: d(x, idx, w)),
        ("num_experts past memory", ValueError, "per-expert counts of num_experts=1099511627776 would need "
         "8796093022216 bytes, more than the", lambda: d(x, idx, w, num_experts=2**40)),
        ("no-sync worst case past memory", ValueError, "the worst-case outputs of a dispatch without CPU sync "
         "(2000000000000 rows: 2 ranks x num_max_tokens_per_rank=1000000000000) would need 544000000000000 bytes",
         lambda: d(x, idx, w, num_experts=4, num_max_tokens_per_rank=10**12, do_cpu_sync=False)),
        ("no topk_idx", ValueError, "topk_idx is required", lambda: d(x, num_experts=4)),
        ("topk_idx with handle", ValueError, "topk_idx must be None with handle", lambda: d(x, idx, handle=handle)),
        ("weights with handle", ValueError, "topk_weights must be None with handle",
         lambda: d(x, None, w, handle=handle)),
        ("sync with handle", ValueError, "do_cpu_sync=True is not allowed", lambda: d(x, handle=handle, do_cpu_sync=True)),
        ("handle layout", ValueError, "do_expand=False (handle: True)", lambda: d(x, handle=handle_expand,
                                                                              expert_alignment=2)),
        ("handle alignment", ValueError, "expert_alignment=1 (handle: 2)", lambda: d(x, handle=handle_expand,
                                                                                 do_expand=True)),
        ("handle tokens", ValueError, "num_tokens=3", lambda: d(x[:3].contiguous(), handle=handle)),
        ("handle experts", ValueError, "num_experts=8 (handle: 4)", lambda: d(x, handle=handle, num_experts=8)),
        ("handle type", TypeError, "handle must be a moe_comm.EPHandle", lambda: d(x, handle="h")),
        ("quantize name", ValueError, "quantize='fp4'", lambda: d(x, idx, w, num_experts=4, quantize="fp4")),
        ("quantize dtype", TypeError, "casts bf16 rows", lambda: d(x.float(), idx, w, num_experts=4, quantize="mxfp8")),
        ("quantize hidden", ValueError, "hidden=64", lambda: d(x[:, :64].contiguous(), idx, w, num_experts=4,
                                                               quantize="mxfp8")),
        ("quantize tuple", ValueError, "already quantized", lambda: d((q, scales), idx, w, num_experts=4,
                                                                      quantize="mxfp8")),
        ("dequantize", ValueError, "dequantize=True needs FP8", lambda: d(x, idx, w, num_experts=4, dequantize=True)),
        ("fp8 scales shape", ValueError, "x[1] (scales) must have shape",
         lambda: d((q, scales[:, :0].contiguous()), idx, w, num_experts=4)),
        ("fp8 data dtype", TypeError, "x[0]", lambda: d((x, scales), idx, w, num_experts=4)),
        ("alignment", ValueError, "expert_alignment=0 must be >= 1",
         lambda: d(x, idx, w, num_experts=4, expert_alignment=0)),
        ("alignment type", TypeError, "expert_alignment must be an int",
         lambda: d(x, idx, w, num_experts=4, expert_alignment=2.0)),
        ("num_sms", ValueError, "num_sms=-1 must be >= 0", lambda: d(x, idx, w, num_experts=4, num_sms=-1)),
        ("do_expand type", TypeError, "do_expand must be a bool", lambda: d(x, idx, w, num_experts=4, do_expand=1)),
        ("previous_event", TypeError, "previous_event must be a moe_comm.EventOverlap",
         lambda: d(x, idx, w, num_experts=4, previous_event=object())),
        ("combine rows", ValueError, f"x has {rows + 1} rows, the handle's dispatch produced {rows}",
         lambda: buf.combine(torch.zeros(rows + 1, 128, dtype=torch.bfloat16), handle)),
        ("combine dtype", TypeError, "x.dtype=torch.float16", lambda: buf.combine(y.half(), handle)),
        ("combine weights", ValueError, f"topk_weights must have shape ({rows}, 2)",
         lambda: buf.combine(y, handle, topk_weights=torch.zeros(rows, 3))),
        ("combine expand weights", ValueError, "topk_weights must be 1-D",
         lambda: buf.combine(torch.zeros(handle_expand.num_recv_rows, 128, dtype=torch.bfloat16), handle_expand,
                             topk_weights=torch.zeros(handle_expand.num_recv_rows, 2))),
        ("bias shape", ValueError, "bias[0] must have shape", lambda: buf.combine(y, handle, bias=torch.zeros(
            1, 128, dtype=torch.bfloat16))),
        ("bias dtype", TypeError, "bias[1].dtype=torch.float32",
         lambda: buf.combine(y, handle, bias=(torch.zeros(x.shape, dtype=torch.bfloat16), torch.zeros(x.shape)))),
        ("three biases", ValueError, "at most two tensors",
         lambda: buf.combine(y, handle, bias=(x, x, x))),
        ("combine handle", TypeError, "handle must be a moe_comm.EPHandle", lambda: buf.combine(y, None)),
        ("handle of another backend", ValueError, "handle was made by backend 'cuda', this buffer runs 'torch'",
         lambda: buf.combine(y, dataclasses.replace(handle, backend="cuda"))),
        ("cached handle of another backend", ValueError, "handle was made by backend 'cuda'",
         lambda: d(x, handle=dataclasses.replace(handle, backend="cuda"))),
    ]


def argument_errors_rank(rank: int, world_size: int) -> list[str]:
    buf = new_buffer()
    checked = []
    for label, exc_type, fragment, call in argument_errors(buf, rank):
        with pytest.raises(exc_type) as info:
            try:
                call()
            except exc_type:
                raise
            except Exception as exc:
                raise AssertionError(f"{label}: raised {exc!r} instead of {exc_type.__name__}") from exc
            else:
                raise AssertionError(f"{label}: did not raise")
        assert fragment in str(info.value), f"{label}: {fragment!r} not in {str(info.value)!r}"
        checked.append(label)
    # Still usable, bitwise right.
    check_case(buf, GOOD, rank)
    return checked


def test_argument_errors(pools):
    results = pools(2).run(argument_errors_rank)
    assert results[0] == results[1] and len(results[0]) >= 40


def constructor_errors_rank(rank: int, world_size: int) -> int:
    bad = [
        (dict(hidden=0), ValueError, "hidden=0 must be >= 1"),
        (dict(backend="nccl2"), ValueError, "backend='nccl2' is not one of"),
        (dict(backend="cuda"), ValueError, "backend='cuda' needs an NCCL group on GPUs"),
        (dict(num_cpu_timeout_secs=0), ValueError, "num_cpu_timeout_secs=0"),
        (dict(num_cpu_timeout_secs=float("inf")), ValueError, "num_cpu_timeout_secs=inf must be a number of seconds in "
                                                              "(0, 604800]"),
        (dict(num_cpu_timeout_secs=1e300), ValueError, "num_cpu_timeout_secs=1e+300 must be"),
        (dict(num_gpu_timeout_secs=float("nan")), ValueError, "num_gpu_timeout_secs=nan must be"),
        (dict(num_max_tokens_per_rank=-1), ValueError, "num_max_tokens_per_rank=-1"),
        (dict(deterministic="yes"), TypeError, "deterministic must be a bool"),
        (dict(hidden=12), ValueError, "not a multiple of 16"),
        (dict(use_fp8_dispatch=True, hidden=200), ValueError, "hidden=200"),
        (dict(sl_idx=16), ValueError, "sl_idx=16 must be an InfiniBand service level in [0, 15]"),
        (dict(sl_idx=-1), ValueError, "sl_idx=-1 must be"),
        (dict(sl_idx=True), TypeError, "sl_idx must be an int or None, got True (bool)"),
    ]
    for kw, exc_type, fragment in bad:
        with pytest.raises(exc_type, match=None) as info:
            new_buffer(**kw)
        assert fragment in str(info.value), f"{kw}: {fragment!r} not in {str(info.value)!r}"
    buf = new_buffer(sl_idx=3)  # gloo has no service level: validated, then ignored
    destroyed = new_buffer()
    destroyed.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        destroyed.dispatch(*rank_inputs(GOOD, rank), num_experts=4)
    check_case(buf, GOOD, rank)
    return len(bad)


def test_constructor_errors(pools):
    assert pools(2).run(constructor_errors_rank) == [14, 14]


def value_errors_rank(rank: int, world_size: int) -> list[str]:
    """Bad topk_idx values on rank 1 only: every rank raises, naming rank 1; then the buffer works."""
    buf = new_buffer()
    messages = []
    for bad_value, fragment in ((4, "entries outside [-1, 4) on rank(s) [1]"), (-2, "outside [-1, 4)"),
                                (None, "duplicate experts in a row on rank(s) [1]")):
        x, idx, w = rank_inputs(GOOD, rank)
        if rank == 1:
            idx = idx.clone()
            if bad_value is None:
                idx[2] = torch.tensor([3, 3])
            else:
                idx[2, 1] = bad_value
        with pytest.raises(ValueError) as info:
            buf.dispatch(x, idx, w, num_experts=4)
        assert fragment in str(info.value), str(info.value)
        if rank == 1:
            assert "first bad slot: topk_idx[2," in str(info.value), str(info.value)
        messages.append(str(info.value))
        check_case(buf, GOOD, rank)
    return messages


def test_value_errors_raise_on_every_rank(pools):
    results = pools(2).run(value_errors_rank)
    assert len(results[0]) == 3


def deferred_errors_rank(rank: int, world_size: int) -> str:
    """Without a CPU sync a bad slot is dropped and the next synchronizing call raises on every rank."""
    buf = new_buffer()
    x, idx, w = rank_inputs(GOOD, rank)
    bad = idx.clone()
    if rank == 0:
        bad[1, 0] = 99
    recv_x, recv_idx, _, handle, _ = buf.dispatch(x, bad, w, num_experts=4, do_cpu_sync=False)
    # The bad slot is dropped, nothing else: the same as a dispatch with that slot set to -1.
    clean = idx.clone()
    if rank == 0:
        clean[1, 0] = -1
    assert torch.equal(handle.topk_idx, clean)
    ref_x, ref_idx, _, ref_handle, _ = buf.dispatch(x, clean, w, num_experts=4, do_cpu_sync=False)
    n = int(ref_handle.psum_num_recv_tokens_per_rank[-1])
    assert torch.equal(recv_x[:n], ref_x[:n]) and torch.equal(recv_idx[:n], ref_idx[:n])
    with pytest.raises(ValueError) as info:
        buf.dispatch(x, idx, w, num_experts=4)
    assert "earlier dispatch without CPU sync" in str(info.value)
    assert "out-of-range entries on rank(s) [0]" in str(info.value), str(info.value)
    check_case(buf, GOOD, rank)
    # barrier() is a synchronizing call too.
    buf.dispatch(x, bad, w, num_experts=4, do_cpu_sync=False)
    with pytest.raises(ValueError, match="earlier dispatch without CPU sync"):
        buf.barrier()
    buf.barrier()
    return str(info.value)


def test_deferred_value_errors(pools):
    results = pools(2).run(deferred_errors_rank)
    assert results[0] == results[1]


def check_inputs_env_rank(rank: int, world_size: int) -> str:
    # The pool's ranks outlive this test: the variable gets back its previous value (or absence), not "0".
    x, idx, w = rank_inputs(GOOD, rank)
    if rank == 1:
        idx = idx.clone()
        idx[0, 0] = 7
    with mock.patch.dict(os.environ, {"MOE_COMM_CHECK_INPUTS": "1"}):
        buf = new_buffer()
        with pytest.raises(ValueError, match=r"entries outside \[-1, 4\) on rank\(s\) \[1\]"):
            buf.dispatch(x, idx, w, num_experts=4, do_cpu_sync=False)
    # Read when the buffer was made: it still checks up front once the variable is gone.
    with pytest.raises(ValueError, match=r"entries outside \[-1, 4\) on rank\(s\) \[1\]"):
        buf.dispatch(x, idx, w, num_experts=4, do_cpu_sync=False)
    x, idx, w = rank_inputs(GOOD, rank)
    buf.dispatch(x, idx, w, num_experts=4, do_cpu_sync=False)
    buf.barrier()
    return "ok"


def test_check_inputs_env_raises_up_front(pools):
    assert pools(2).run(check_inputs_env_rank) == ["ok", "ok"]


def check_inputs_env_disagrees_rank(rank: int, world_size: int) -> list[str]:
    """MOE_COMM_CHECK_INPUTS set on one rank only, then malformed on one rank: making the Buffer raises the same
    ValueError on every rank (the variable adds exchanges to calls, which ranks set differently would not meet in)."""
    messages = []
    for value in ("1", "maybe"):
        with mock.patch.dict(os.environ, {"MOE_COMM_CHECK_INPUTS": value} if rank == 1 else {}):
            if rank == 0:
                os.environ.pop("MOE_COMM_CHECK_INPUTS", None)
            with pytest.raises(ValueError) as info:
                new_buffer()
        messages.append(str(info.value))
    new_buffer().barrier()  # the group works afterwards
    return messages


def test_check_inputs_env_must_agree(pools):
    (differs, malformed), others = pools(2).run(check_inputs_env_disagrees_rank)
    assert others[0] == differs and "MOE_COMM_CHECK_INPUTS differs between ranks (per rank, as read): [False, True]" \
        in differs, differs
    assert others[1] == malformed and "failed on rank(s) [1]: rank 1: ValueError: MOE_COMM_CHECK_INPUTS='maybe' is " \
        "not a boolean" in malformed, malformed


def refusals_rank(rank: int, world_size: int) -> list[str]:
    return run_refusals(rank, world_size, lambda: new_buffer(num_max_tokens_per_rank=16), deferred=False)


def test_arguments_refused_on_one_rank_raise_on_every_rank(pools):
    """Arguments refused on rank 0 only (fresh dispatch with and without CPU sync, cached dispatch, combine): rank 0
    raises its own error, the others a ValueError naming rank 0, at once (the refusal travels in the call's
    agreement: no rank waits for the 30 s timeout), and the buffer works afterwards."""
    start = time.monotonic()
    refused, ok = pools(2).run(refusals_rank)
    assert time.monotonic() - start < 20
    assert_refusals(refused, ok, cuda=False)


def disagreement_rank(rank: int, world_size: int) -> str:
    """Ranks that size a synchronizing dispatch differently all get a ValueError naming the values."""
    buf = new_buffer()
    x, idx, w = rank_inputs(GOOD, rank)
    with pytest.raises(ValueError) as info:
        buf.dispatch(x, idx, w, num_experts=4, num_max_tokens_per_rank=6 + rank)
    check_case(buf, GOOD, rank)
    return str(info.value)


def test_ranks_must_agree_on_sizes(pools):
    messages = pools(2).run(disagreement_rank)
    assert messages[0] == messages[1]
    assert "num_max_tokens_per_rank: [6, 7]" in messages[0], messages[0]


def backend_choice_rank(rank: int, world_size: int, broken: dict) -> object:
    """`why_not_usable` on a CPU pool with torch.cuda faked per rank: what each rank can do differs, the verdict
    must not (every rank must take the same backend). The fakes are undone before returning (the pool is shared)."""
    import torch.distributed as dist

    from moe_comm.backends import cuda as cuda_backend

    def load_kernels(flags=()):
        if broken.get("kernels") == rank:
            raise RuntimeError("nvcc not found; searched $CUDA_HOME/bin/nvcc\nmore lines")
        if broken.get("extension") == rank:  # the host extension built but does not import
            raise ImportError("moe_comm_host.so: undefined symbol: _ZN3c10")

    peer = lambda a, b: broken.get("peer") != rank  # noqa: E731
    capability = lambda d: (8, 0) if broken.get("ampere") == rank else (9, 0)  # noqa: E731
    with mock.patch("torch.cuda.is_available", lambda: True), mock.patch("torch.cuda.current_device", lambda: 0), \
            mock.patch("torch.cuda.device_count", lambda: 2), mock.patch("torch.cuda.can_device_access_peer", peer), \
            mock.patch("torch.cuda.get_device_capability", capability), \
            mock.patch.object(cuda_backend, "load_kernels", load_kernels):
        return cuda_backend.why_not_usable(dist.group.WORLD)


def test_backend_choice_is_the_same_on_every_rank(pools):
    assert pools(2).run(backend_choice_rank, {}) == [None, None]
    verdicts = pools(2).run(backend_choice_rank, {"kernels": 1})
    assert verdicts[0] == verdicts[1], verdicts
    assert verdicts[0] == "rank 1: the kernels cannot be built or loaded (nvcc not found; searched $CUDA_HOME/bin/nvcc)"
    verdicts = pools(2).run(backend_choice_rank, {"extension": 0})
    assert verdicts == ["rank 0: the kernels cannot be built or loaded (moe_comm_host.so: undefined symbol: _ZN3c10)"] * 2
    verdicts = pools(2).run(backend_choice_rank, {"peer": 0, "kernels": 0})
    assert verdicts[0] == verdicts[1] == "rank 0: GPU 0 has no peer access to GPU(s) [1]", verdicts
    verdicts = pools(2).run(backend_choice_rank, {"ampere": 1})  # sm_90a code only: `auto` takes the reference
    assert verdicts == ["rank 1: GPU 0 is of compute capability 8.0; the kernels are built for sm_90a (Hopper: H100, "
                        "H200) only"] * 2, verdicts


def disagreement_probes_rank(rank: int, world_size: int) -> list[str]:
    from moe_comm.testing.disagreement import run_probes
    return run_probes(rank, world_size, lambda: new_buffer(num_cpu_timeout_secs=20))


def test_disagreement_is_an_error_on_every_rank_on_every_path(pools):
    """Ranks that disagree on what sizes an exchange (combine, dispatch without CPU sync, cached against fresh,
    different operations) get the same ValueError naming the field and each rank's value, and the buffer works
    afterwards (before: gloo aborted one process and the other returned wrong data)."""
    messages = pools(2).run(disagreement_probes_rank)
    assert messages[0] == messages[1]


def partial_sums_probe_rank(rank: int, world_size: int) -> str:
    from moe_comm.testing.disagreement import partial_sums_probe
    return partial_sums_probe(rank, world_size, lambda det: new_buffer(num_cpu_timeout_secs=20, deterministic=det))


def test_ranks_must_agree_on_partial_sums(pools):
    """An expand combine between a deterministic buffer (slot order) and one with partial sums per rank would send
    rows of two formats: every rank raises the same ValueError instead."""
    messages = pools(2).run(partial_sums_probe_rank)
    assert messages[0] == messages[1]


@pytest.mark.parametrize("value", [0, 33, 2.0, True])
def test_cuda_tuning_round_slots_bounded(value):
    from moe_comm.backends.cuda import CudaTuning

    with pytest.raises(ValueError, match=f"max_round_slots={value!r} must be None or an int in \\[1, 32\\]"):
        CudaTuning(max_round_slots=value)


def cached_non_expand_alignment_rank(rank: int, world_size: int) -> bool:
    """DeepEP's `dispatch(x, handle=handle)` along a non-expand handle made with `expert_alignment > 1`: the
    alignment only rounded the handle's counts, so the cached call need not repeat it (an expand one must)."""
    buf = new_buffer()
    x, idx, w = rank_inputs(GOOD, rank)
    recv_x, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=4, expert_alignment=4)
    assert all(n % 4 == 0 for n in handle.num_recv_tokens_per_expert_list)
    again, _, _, same, _ = buf.dispatch(x, handle=handle)
    assert torch.equal(again, recv_x) and same is handle
    assert torch.equal(buf.dispatch(x, handle=handle, expert_alignment=4)[0], recv_x)
    _, _, _, handle_expand, _ = buf.dispatch(x, idx, w, num_experts=4, do_expand=True, expert_alignment=4)
    with pytest.raises(ValueError, match=r"expert_alignment=1 \(handle: 4\)"):
        buf.dispatch(x, handle=handle_expand, do_expand=True)
    return True


def test_cached_non_expand_dispatch_need_not_repeat_alignment(pools):
    assert pools(2).run(cached_non_expand_alignment_rank) == [True, True]


def two_buffers_rank(rank: int, world_size: int) -> list[str]:
    """Two buffers on one group: a rank combining with one buffer's handle while its peer holds the other's gets the
    same ValueError on every rank (each buffer's handle epochs start at a base of their own; both used to be 1, and
    gloo aborted one process while the other returned a wrong sum), and the buffers work afterwards; a handle used
    alike on every rank works on either buffer (no buffer-private state in the reference's handles). The buffers'
    serials are agreed at construction: a rank whose count ran ahead gives its handles the same epochs as its peer."""
    import torch.distributed as dist

    from moe_comm.backends import common

    if rank == 1:  # a rank whose count of the group's buffers ran ahead (a reused group name, a restarted process)
        common._BUFFERS_MADE[dist.group.WORLD.group_name] = common.buffer_serial(None) + 5
    a, b = new_buffer(), new_buffer()
    x, idx, w = rank_inputs(GOOD, rank)
    recv_a, _, _, handle_a, _ = a.dispatch(x, idx, w, num_experts=GOOD.num_experts)
    recv_b, _, _, handle_b, _ = b.dispatch(x, idx, w, num_experts=GOOD.num_experts)
    assert handle_a.epoch != handle_b.epoch
    with pytest.raises(ValueError, match="handle epoch") as info:
        a.combine(recv_a if rank == 0 else recv_b, handle_a if rank == 0 else handle_b)
    want = a.combine(recv_a, handle_a)[0]
    assert torch.equal(b.combine(recv_b, handle_b)[0], want)
    assert torch.equal(b.combine(recv_a, handle_a)[0], want)
    return [str(info.value), handle_a.epoch, handle_b.epoch]


def test_handles_of_two_buffers_are_told_apart(pools):
    messages = pools(2).run(two_buffers_rank)
    assert messages[0] == messages[1]
