"""`return_recv_hook=True` on the reference backend over gloo: the call sends, its hook receives. Results bitwise the
plain calls' (random cases through the oracle), and the rules of the hook: called once, before the next operation
on the buffer, not with `async_with_compute_stream`. (Autograd through hooks: tests/test_autograd.py; the CUDA
backend's send and receive launches: tests/test_gpu.py.)"""

from __future__ import annotations

import pytest
import torch

import moe_comm
from moe_comm import layout, sizing
from moe_comm.testing.checks import check_case
from moe_comm.testing.routing import Case, draw_cases, rank_inputs

NUM_CASES = {2: 16, 3: 8}


def hook_cases_rank(rank: int, world_size: int, cases: list[Case]) -> int:
    for i, case in enumerate(cases):
        hidden = case.hidden * case.torch_dtype.itemsize // 2
        buf = moe_comm.Buffer(None, num_max_tokens_per_rank=case.num_max_tokens_per_rank, hidden=max(hidden, 8),
                              num_topk=case.num_topk, backend="torch", num_cpu_timeout_secs=60)
        try:
            check_case(buf, case, rank, recv_hook=True)
        except AssertionError as exc:
            raise AssertionError(f"case {i}: {case}\n{exc}") from exc
    return len(cases)


@pytest.mark.parametrize("world_size", sorted(NUM_CASES))
def test_hooked_calls_match_the_oracle(pools, seed, world_size):
    cases = draw_cases(seed * 10 + 40 + world_size, NUM_CASES[world_size], world_size)
    assert pools(world_size).run(hook_cases_rank, cases) == [len(cases)] * world_size


CASE = Case(seed=5, num_ranks=2, num_experts=4, num_topk=2, hidden=16, num_tokens=(5, 3), num_max_tokens_per_rank=8)


def hook_rules_rank(rank: int, world_size: int) -> list[str]:
    buf = moe_comm.Buffer(None, num_max_tokens_per_rank=8, hidden=16, num_topk=2, backend="torch",
                          num_cpu_timeout_secs=30)
    x, idx, w = rank_inputs(CASE, rank)
    messages = []
    # Bad arguments: refused before anything moves, on every rank alike.
    with pytest.raises(TypeError, match="return_recv_hook must be a bool, got 1"):
        buf.dispatch(x, idx, w, num_experts=4, return_recv_hook=1)
    with pytest.raises(ValueError, match="return_recv_hook=True and async_with_compute_stream=True cannot be "
                                         "combined") as info:
        buf.dispatch(x, idx, w, num_experts=4, return_recv_hook=True, async_with_compute_stream=True)
    messages.append(str(info.value))

    recv_x, _, recv_w, handle, event, hook = buf.dispatch(x, idx, w, num_experts=4, return_recv_hook=True)
    assert event.done and not hook.done
    # Nothing may run on the buffer before the hook: its rows would be overwritten.
    for call in (lambda: buf.combine(recv_x, handle), lambda: buf.dispatch(x, idx, w, num_experts=4), buf.barrier):
        with pytest.raises(RuntimeError, match="receive hook of an earlier call with return_recv_hook=True on this "
                                               "buffer had not run") as info:
            call()
        messages.append(str(info.value))
    hook()
    assert hook.done
    with pytest.raises(RuntimeError, match="this receive hook was already called"):
        hook()
    plain_x, _, plain_w, plain_handle, _ = buf.dispatch(x, idx, w, num_experts=4)
    assert torch.equal(recv_x, plain_x) and torch.equal(recv_w, plain_w)
    assert torch.equal(handle.recv_src_idx, plain_handle.recv_src_idx)

    y = recv_x * 2
    combined, combined_w, event, hook = buf.combine(y, handle, topk_weights=recv_w, return_recv_hook=True)
    hook()
    plain, plain_cw, _ = buf.combine(y, handle, topk_weights=recv_w)
    assert torch.equal(combined, plain) and torch.equal(combined_w, plain_cw)
    buf.barrier()
    # A hook of a buffer destroyed since raises (as on the CUDA backend, whose memory is gone; it received before).
    hook = buf.dispatch(x, idx, w, num_experts=4, return_recv_hook=True)[-1]
    buf.destroy()
    with pytest.raises(RuntimeError, match="the buffer of this receive hook was destroyed"):
        hook()
    return messages


def test_hook_rules(pools):
    messages = pools(2).run(hook_rules_rank)
    assert messages[0] == messages[1]
    assert "call that hook first" in messages[0][1] and "this combine would overwrite" in messages[0][1]
    assert "this dispatch would overwrite" in messages[0][2] and "this barrier would overwrite" in messages[0][3]


def test_buffer_sized_for_hooks():
    """`use_recv_hook` sizes the receive region for an expand combine in one round: a row per (peer, token, slot),
    here more than the default two rows per (rank, token); one rank needs no room (its rows stay in x)."""
    plain = sizing.get_buffer_size_hint(2, 4096, 7168, 8)
    hooked = sizing.get_buffer_size_hint(2, 4096, 7168, 8, use_recv_hook=True)
    row = layout.combine_row(2 * 7168, 1, 8).stride
    assert hooked == sizing.BUFFER_CONTROL_BYTES + 4096 * 8 * row > plain
    assert sizing.get_buffer_size_hint(1, 4096, 7168, 8, use_recv_hook=True) == \
        sizing.get_buffer_size_hint(1, 4096, 7168, 8)
    # Beyond the slots a round takes, rounds are forced anyway: the room stops growing.
    assert sizing.get_buffer_size_hint(2, 16, 128, 64, use_recv_hook=True) == \
        sizing.get_buffer_size_hint(2, 16, 128, 32, use_recv_hook=True)
