"""Autograd pair: gradcheck in float64 across ranks over gloo (DESIGN section 3), bias and FP8 gradients,
and the async pattern."""

from __future__ import annotations

import pytest
import torch

import moe_comm
from moe_comm import autograd as moe_autograd
from moe_comm.testing.checks import compile_recording
from moe_comm.testing.gradcheck import run_gradcheck
from moe_comm.testing.routing import Case, rank_inputs


def gradcheck_cases(world_size: int) -> list[Case]:
    tokens = {2: (3, 0), 4: (3, 0, 2, 1)}[world_size]
    base = dict(num_ranks=world_size, num_experts=2 * world_size, num_topk=3, hidden=2, num_tokens=tokens,
                num_max_tokens_per_rank=4, dtype="float64", drop_prob=0.25, num_bias=1)
    return [
        Case(seed=11, **base),
        Case(seed=12, do_cpu_sync=False, **base),
        Case(seed=13, do_expand=True, expert_alignment=3, **base),
        Case(seed=14, do_expand=True, expert_alignment=2, do_cpu_sync=False, **base),
    ]


def gradcheck_rank(rank: int, world_size: int, cases: list[Case], recv_hook: bool = False) -> list[bool]:
    results = []
    for case in cases:
        # float64 rows need 4x the bytes of the bf16 `hidden` the buffer is sized with.
        buf = moe_comm.Buffer(None, num_max_tokens_per_rank=case.num_max_tokens_per_rank, hidden=4 * case.hidden,
                              num_topk=case.num_topk, backend="torch", num_cpu_timeout_secs=60)
        results.append(run_gradcheck(buf, case, rank, recv_hook))
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_gradcheck(pools, world_size):
    cases = gradcheck_cases(world_size)
    # Each case must have -1 slots and a rank without tokens, as DESIGN section 3 asks.
    for case in cases:
        assert 0 in case.num_tokens
        assert any((rank_inputs(case, r)[1] == -1).any() for r in range(world_size))
    results = pools(world_size).run(gradcheck_rank, cases)
    assert all(all(r) for r in results)


def test_gradcheck_through_recv_hooks(pools):
    """Dispatch and combine that receive in their hooks (`return_recv_hook=True`) differentiate as the plain calls."""
    results = pools(2).run(gradcheck_rank, gradcheck_cases(2), True)
    assert all(all(r) for r in results)


def grads_rank(rank: int, world_size: int, mode: str, do_expand: bool, compiled: bool = False) -> dict:
    """Gradients of a small bf16 pipeline; `mode` "async": every call returns early and waits on its event, "hook":
    every call receives in its hook (called before the outputs are used), "sync": neither. `compiled`: the pipeline
    under `torch.compile`, checked to have run moe_comm's calls outside Dynamo's graphs (`compile_recording`)."""
    use_async = mode == "async"
    hook = {"return_recv_hook": True} if mode == "hook" else {}
    case = Case(seed=21, num_ranks=world_size, num_experts=4, num_topk=2, hidden=16, num_tokens=(5, 3),
                num_max_tokens_per_rank=8, do_expand=do_expand, expert_alignment=2)
    buf = moe_comm.Buffer(None, num_max_tokens_per_rank=8, hidden=16, num_topk=2, backend="torch",
                          num_cpu_timeout_secs=60)
    x, idx, w = rank_inputs(case, rank)
    x.requires_grad_()
    w.requires_grad_()
    bias = torch.randn(x.shape, generator=torch.Generator().manual_seed(rank), dtype=torch.float32)
    bias = bias.to(torch.bfloat16).requires_grad_()

    def pipeline(x, idx, w, bias):
        recv_x, _, recv_w, handle, event, *receive = moe_autograd.dispatch(
            buf, x, idx, w, num_experts=4, do_expand=do_expand, expert_alignment=2,
            async_with_compute_stream=use_async, **hook)
        assert len(receive) == len(hook)
        if receive:  # not a loop: Dynamo cannot resume a frame after a graph break inside one (it runs it all eagerly)
            receive[0]()
        if use_async:
            assert not event.done
            event.current_stream_wait()
        gate = recv_w if do_expand else recv_w.sum(1)
        y = (recv_x.float() * (1 + gate)[:, None]).to(torch.bfloat16)
        combined, event, *receive = moe_autograd.combine(buf, y, handle, bias=bias,
                                                         async_with_compute_stream=use_async, **hook)
        if receive:
            receive[0]()
        with event:
            pass
        return combined

    if compiled:
        pipeline, check_compiled = compile_recording(pipeline)
    combined = pipeline(x, idx, w, bias)
    grad_out = torch.randn(combined.shape, generator=torch.Generator().manual_seed(100 + rank)).to(torch.bfloat16)
    combined.backward(grad_out)
    if compiled:
        check_compiled()
    return {"x": x.grad.float().tolist(), "w": w.grad.tolist(), "bias": bias.grad.float().tolist(),
            "bias_is_grad_out": torch.equal(bias.grad, grad_out), "out": combined.float().tolist()}


@pytest.mark.parametrize("do_expand", [False, True])
def test_async_and_hook_patterns_match_sync(pools, do_expand):
    sync = pools(2).run(grads_rank, "sync", do_expand)
    assert pools(2).run(grads_rank, "async", do_expand) == sync
    assert pools(2).run(grads_rank, "hook", do_expand) == sync
    assert all(r["bias_is_grad_out"] for r in sync)


def test_torch_compile_runs_each_call_eagerly(pools):
    """Under torch.compile every moe_comm call runs as in eager mode, the graph broken around it (the entry points
    are `torch.compiler.disable`d): Dynamo captures the pipeline's own ops and none of moe_comm's code (it traced
    the validation, the backends and the launchers before, breaking this pipeline's graph 17 times); the outputs
    and gradients equal the eager ones bitwise."""
    expected = pools(2).run(grads_rank, "sync", False)
    for mode in ("sync", "async", "hook"):
        assert pools(2).run(grads_rank, mode, False, True) == expected, mode


def fp8_straight_through_rank(rank: int, world_size: int, fmt: str) -> bool:
    case = Case(seed=31, num_ranks=world_size, num_experts=4, num_topk=2, hidden=128, num_tokens=(6, 2),
                num_max_tokens_per_rank=8)
    buf = moe_comm.Buffer(None, num_max_tokens_per_rank=8, hidden=128, num_topk=2, backend="torch",
                          use_fp8_dispatch=True, num_cpu_timeout_secs=60)
    x, idx, w = rank_inputs(case, rank)
    x.requires_grad_()
    recv_x, _, _, handle, _ = moe_autograd.dispatch(buf, x, idx, w, num_experts=4, quantize=fmt, dequantize=True)
    assert recv_x.dtype == torch.bfloat16
    # Row gradient = a function of (source token, this rank), so the source can predict the sum.
    src_rank = torch.bucketize(torch.arange(recv_x.shape[0]), handle.psum_num_recv_tokens_per_rank, right=True)
    code = (handle.recv_src_idx + 1) * 8 + rank * 2 + src_rank
    grad_recv = (code.float()[:, None] / 64).expand(-1, 128).to(torch.bfloat16)
    recv_x.backward(grad_recv)
    # Straight-through: grad_x[t] = sum over the ranks t went to (ascending) of their row gradient, FP32 sum.
    L = case.num_local_experts
    expected = torch.zeros(x.shape[0], 128)
    for t in range(x.shape[0]):
        for d in sorted({e // L for e in idx[t].tolist() if e >= 0}):
            expected[t] += ((t + 1) * 8 + d * 2 + rank) / 64
    return torch.equal(x.grad, expected.to(torch.bfloat16))


@pytest.mark.parametrize("fmt", ["fp8_block128", "mxfp8"])
def test_fp8_straight_through(pools, fmt):
    assert all(pools(2).run(fp8_straight_through_rank, fmt))


def cached_keeps_weight_grad_rank(rank: int, world_size: int) -> bool:
    """A cached autograd dispatch must not steal the first dispatch's weight gradient path."""
    case = Case(seed=33, num_ranks=world_size, num_experts=4, num_topk=2, hidden=16, num_tokens=(5, 3),
                num_max_tokens_per_rank=8)
    buf = moe_comm.Buffer(None, num_max_tokens_per_rank=8, hidden=16, num_topk=2, backend="torch",
                          num_cpu_timeout_secs=60)
    x, idx, w = rank_inputs(case, rank)
    w.requires_grad_()
    _, _, recv_w, handle, _ = moe_autograd.dispatch(buf, x, idx, w, num_experts=4)
    _, _, cached_w, _, _ = moe_autograd.dispatch(buf, x * 2, handle=handle)
    assert not cached_w.requires_grad
    recv_w.sum().backward()
    # d(sum of received weights)/dw = 1 for every valid slot (each lands on exactly one rank).
    return torch.equal(w.grad, (idx >= 0).float())


def test_cached_dispatch_keeps_weight_gradient(pools):
    assert pools(2).run(cached_keeps_weight_grad_rank) == [True, True]


def double_backward_rank(rank: int, world_size: int) -> list[str]:
    """A gradient penalty through dispatch and combine (`create_graph=True`, then a backward of the gradient): the
    backward passes are differentiable once, so the second backward raises on every rank (it used to treat moe_comm
    as a constant and return wrong gradients); a plain backward afterwards still works."""
    case = Case(seed=34, num_ranks=world_size, num_experts=4, num_topk=2, hidden=8, num_tokens=(5, 3),
                num_max_tokens_per_rank=8, dtype="float64")
    buf = moe_comm.Buffer(None, num_max_tokens_per_rank=8, hidden=32, num_topk=2, backend="torch",
                          num_cpu_timeout_secs=60)
    x, idx, w = rank_inputs(case, rank)
    messages = []
    for which in ("dispatch", "combine"):
        x_in = x.clone().requires_grad_()
        recv_x, _, _, handle, _ = moe_autograd.dispatch(buf, x_in, idx, w, num_experts=4)
        y = recv_x.square() if which == "dispatch" else recv_x.detach().requires_grad_()
        out, _ = moe_autograd.combine(buf, y, handle)
        inner = x_in if which == "dispatch" else y
        (grad,) = torch.autograd.grad(out.square().sum(), inner, create_graph=True)
        with pytest.raises(RuntimeError) as info:
            grad.square().sum().backward()
        messages.append(str(info.value))
    x_in = x.clone().requires_grad_()
    recv_x, _, _, handle, _ = moe_autograd.dispatch(buf, x_in, idx, w, num_experts=4)
    moe_autograd.combine(buf, recv_x, handle)[0].sum().backward()
    messages.append(str(x_in.grad is not None))
    return messages


def mixed_requires_grad_rank(rank: int, world_size: int) -> list[str]:
    """Ranks whose x differ in requires_grad (rank 1 differentiates its weights only): the dispatch's backward is
    the same combine on both (the weights-only rank sends zero rows of the rows' width; it sent narrower ones, and
    every rank raised a disagreement on a combine the user never called), and each rank gets its gradients. A list
    as x is the Buffer's TypeError, on that rank, with its peer told (was a bare unpacking error)."""
    case = Case(seed=35, num_ranks=world_size, num_experts=4, num_topk=2, hidden=16, num_tokens=(5, 3),
                num_max_tokens_per_rank=8)
    buf = moe_comm.Buffer(None, num_max_tokens_per_rank=8, hidden=16, num_topk=2, backend="torch",
                          num_cpu_timeout_secs=60)
    x, idx, w = rank_inputs(case, rank)
    x.requires_grad_(rank == 0)
    w.requires_grad_()
    recv_x, _, recv_w, handle, _ = moe_autograd.dispatch(buf, x, idx, w, num_experts=4)
    (recv_x.float().sum() + recv_w.sum()).backward()
    # Every valid slot's weight lands once; each token's row once per destination rank.
    results = [str(torch.equal(w.grad, (idx >= 0).float()))]
    if rank == 0:
        ranks = torch.stack([(idx >= 0) & (idx // 2 == r) for r in range(2)]).any(-1).sum(0)
        results.append(str(torch.equal(x.grad, ranks[:, None].to(x.dtype).expand_as(x))))
    with pytest.raises((TypeError, ValueError)) as info:
        moe_autograd.dispatch(buf, [x, x, x] if rank == 0 else x.detach(), idx, w.detach(), num_experts=4)
    return results + [str(info.value)]


def test_x_requires_grad_on_one_rank(pools):
    first, second = pools(2).run(mixed_requires_grad_rank)
    assert first[:2] == ["True", "True"] and first[2].startswith("x must be a torch.Tensor"), first
    assert second == ["True", "dispatch: rank(s) [0] refused their arguments (their error says why)"], second


def test_double_backward_raises(pools):
    twice = "trying to differentiate twice a function that was marked with @once_differentiable"
    assert pools(2).run(double_backward_rank) == [[twice, twice, "True"]] * 2


def test_wrappers_take_the_buffer_first():
    """The wrappers' first argument is the Buffer (unlike `Buffer.dispatch`, a method): a tensor there is a
    TypeError that says so, before anything runs."""
    x = torch.zeros(2, 8)
    with pytest.raises(TypeError, match=r"moe_comm.autograd.dispatch takes the moe_comm.Buffer first, got Tensor"):
        moe_autograd.dispatch(x, torch.zeros(2, 1, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"moe_comm.autograd.combine takes the moe_comm.Buffer first, got Tensor"):
        moe_autograd.combine(x, x, None)
