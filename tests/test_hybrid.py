"""The hybrid (multi-host) path of the reference backend on the CPU tier: one machine's gloo ranks split into hosts
by `MOE_COMM_RANKS_PER_NODE` (4 ranks as 2 hosts x 2, 8 as 2 x 4), checked against the closed-form oracle and
bitwise against the direct path of the same group (DESIGN 8.3); the domain detection and its override.
(Over 400 lines: every path of DESIGN section 2 against the direct path, with one pool per group size.)"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Optional

import pytest
import torch

import moe_comm
from moe_comm import quant
from moe_comm.domains import OVERRIDE, Report, domains_from_reports
from moe_comm.testing import WorkerPool, parallel_launch
from moe_comm.testing.checks import assert_same, check_case, skip_one_call
from moe_comm.testing.disagreement import run_probes
from moe_comm.testing.gradcheck import run_gradcheck
from moe_comm.testing.routing import Case, draw_cases, rank_bias, rank_inputs


@contextlib.contextmanager
def ranks_per_node(value: Optional[str]):
    """Set (or, with None, unset) MOE_COMM_RANKS_PER_NODE in this process for the block; restore it after."""
    old = os.environ.get(OVERRIDE)
    if value is None:
        os.environ.pop(OVERRIDE, None)
    else:
        os.environ[OVERRIDE] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(OVERRIDE, None)
        else:
            os.environ[OVERRIDE] = old


# ------------------------------------------------------------------------------------------------
# Domains
# ------------------------------------------------------------------------------------------------
def test_domains_from_host_names_and_peer_access():
    cpu = [Report("a"), Report("a"), Report("b"), Report("b")]
    found = domains_from_reports(cpu)
    assert found.domain_of_rank == (0, 0, 1, 1) and found.is_uniform and found.describe() == "2 x 2 ranks (detected)"
    # GPUs: g0-g1 and g2-g3 reach each other (two NVLink islands on host a), g4 is alone on host b.
    seen = ("g0", "g1", "g2", "g3")
    gpus = [Report("a", "g0", ("g1",), seen), Report("a", "g1", ("g0",), seen), Report("a", "g2", ("g3",), seen),
            Report("a", "g3", ("g2",), seen), Report("b", "g4", (), ("g4",))]
    assert domains_from_reports(gpus).domain_of_rank == (0, 0, 1, 1, 2)
    assert not domains_from_reports(gpus).is_uniform
    # Access one way only is no domain; two ranks on one GPU are.
    one_way = [Report("a", "g0", ("g1",), seen), Report("a", "g1", (), seen), Report("a", "g1", (), seen)]
    assert domains_from_reports(one_way).domain_of_rank == (0, 1, 1)
    # One visible GPU per rank (CUDA_VISIBLE_DEVICES per process): the others cannot be asked, so one host is one
    # domain, as on the direct path.
    alone = [Report(host, gpu, (), (gpu,)) for host, gpu in (("a", "g0"), ("a", "g1"), ("b", "g2"), ("b", "g3"))]
    assert domains_from_reports(alone).domain_of_rank == (0, 0, 1, 1)
    # Interleaved hosts (rank order a, b, a, b): two domains of two, not consecutive.
    interleaved = domains_from_reports([Report("a"), Report("b"), Report("a"), Report("b")])
    assert interleaved.domain_of_rank == (0, 1, 0, 1) and not interleaved.is_uniform
    assert interleaved.num_ranks_per_domain == 2


def test_override_replaces_detection():
    found = domains_from_reports([Report(f"h{r}", override=4) for r in range(8)])
    assert found.domain_of_rank == (0,) * 4 + (1,) * 4 and found.describe() == f"2 x 4 ranks ({OVERRIDE}=4)"


def test_override_splits_a_subgroup_by_the_hosts_of_its_job_ranks():
    # 2 hosts x 4 ranks (override 4); an expert-parallel subgroup of job ranks [0, 1, 4, 5] is 2 hosts x 2, and
    # [0, 4] 2 hosts x 1, as the detection by host name finds them.
    ep = domains_from_reports([Report("a", override=4, rank=r, world=8) for r in (0, 1, 4, 5)])
    assert ep.domain_of_rank == (0, 0, 1, 1) and ep.is_uniform
    assert domains_from_reports([Report("a", override=4, rank=r, world=8) for r in (0, 4)]).domain_of_rank == (0, 1)
    assert domains_from_reports([Report("a", override=4, rank=r, world=8) for r in (4, 5)]).num_domains == 1
    with pytest.raises(ValueError, match=rf"{OVERRIDE}=3 does not divide the job's 8 ranks into hosts"):
        domains_from_reports([Report("a", override=3, rank=r, world=8) for r in (0, 1, 4, 5)])


def subgroup_domains_rank(rank: int, world_size: int) -> list:
    import torch.distributed as dist
    out = []
    for ranks in ([[0, 2], [1, 3]], [[0, 1], [2, 3]]):
        groups = [dist.new_group(r) for r in ranks]
        group = next(g for g, r in zip(groups, ranks) if rank in r)
        with ranks_per_node("2"):
            buf = moe_comm.Buffer(group, num_max_tokens_per_rank=8, hidden=128, num_topk=2, backend="torch",
                                  num_cpu_timeout_secs=30)
        out.append((buf.get_physical_domain_size(), buf.get_logical_domain_size()))
        buf.destroy()
    return out


def test_override_on_a_subgroup_spanning_hosts(pools):
    # 4 ranks as 2 hosts x 2: the subgroups [0, 2] / [1, 3] span both hosts (one rank each), [0, 1] / [2, 3] one.
    results = pools(4).run(subgroup_domains_rank)
    assert all(r == [((2, 1), (2, 1)), ((1, 2), (1, 2))] for r in results), results


@pytest.mark.parametrize("value,fragment", [
    ("0", f"{OVERRIDE}=0 must be a positive number of ranks per host"),
    ("-2", f"{OVERRIDE}=-2 must be a positive number of ranks per host"),
    ("3", f"{OVERRIDE}=3 does not divide the group's 4 ranks into hosts"),
    ("two", f"{OVERRIDE}='two' is not an integer (on rank(s) [0, 1, 2, 3])"),
    ("", f"{OVERRIDE}='' is not an integer"),
])
def test_bad_override_is_a_value_error(value, fragment):
    from moe_comm.domains import local_report
    with ranks_per_node(value):
        reports = [local_report(torch.device("cpu"))] * 4
    with pytest.raises(ValueError) as info:
        domains_from_reports(reports)
    assert fragment in str(info.value), str(info.value)


def test_disagreeing_override_is_a_value_error():
    with pytest.raises(ValueError, match=rf"{OVERRIDE} differs between ranks \(per rank, None = unset\): "
                                         r"\[2, 2, None, 2\]"):
        domains_from_reports([Report("a", override=2)] * 2 + [Report("a")] + [Report("a", override=2)])


def topology_rank(rank: int, world_size: int) -> dict:
    """Getters and the sizing topology of buffers made under several overrides; bad overrides raise everywhere."""
    out = {}
    make = dict(num_max_tokens_per_rank=8, hidden=128, num_topk=2, backend="torch", num_cpu_timeout_secs=30)
    for value in (None, "1", "2", "4"):
        for allow in (True, False):
            with ranks_per_node(value):
                buf = moe_comm.Buffer(None, allow_hybrid_mode=allow, **make)
            out[value, allow] = (buf.get_physical_domain_size(), buf.get_logical_domain_size(), buf.is_hybrid,
                                 buf.topology.num_scaleout_groups, buf.topology.num_nvl_ranks)
    for value in ("0", "3", "x"):
        with ranks_per_node(value), pytest.raises(ValueError) as info:
            moe_comm.Buffer(None, **make)
        out[value] = str(info.value)
    # Ranks that disagree get the same error, and no rank is left in a collective.
    with ranks_per_node("2" if rank else None), pytest.raises(ValueError) as info:
        moe_comm.Buffer(None, **make)
    out["disagree"] = str(info.value)
    return out


def dead_leg_groups_rank(rank: int, world_size: int) -> list[bool]:
    """The CUDA hybrid path's leg subgroups are kept per parent group (buffers that grow reuse them); a parent group
    destroyed meanwhile is forgotten with its legs when the next legs are made (the cache kept them for ever)."""
    import torch.distributed as dist

    from moe_comm.backends.hybrid import _LEG_GROUPS, leg_groups

    first, second = dist.new_group(list(range(world_size))), dist.new_group(list(range(world_size)))
    cpu = torch.device("cpu")
    reused = leg_groups(first, cpu, world_size, 1, 30.0) is leg_groups(first, cpu, world_size, 1, 30.0)
    dist.destroy_process_group(first)
    leg_groups(second, cpu, world_size, 1, 30.0)
    return [reused, any(key[0] is first for key in _LEG_GROUPS)]


def test_legs_of_a_destroyed_group_are_forgotten():
    # Processes of its own: after a group is destroyed, torch may give a new subgroup the hashed name of a live one.
    assert parallel_launch(2, dead_leg_groups_rank, timeout_s=120) == [[True, False]] * 2


def test_topology_getters_and_override_errors(pools):
    results = pools(4).run(topology_rank)
    assert all(r == results[0] for r in results), results
    got = results[0]
    assert got[None, True] == got[None, False] == ((1, 4), (1, 4), False, 1, 4)  # one host: direct
    assert got["1", True] == ((4, 1), (4, 1), True, 4, 1)
    assert got["1", False] == ((4, 1), (1, 4), False, 1, 1)
    assert got["2", True] == ((2, 2), (2, 2), True, 2, 2)
    assert got["2", False] == ((2, 2), (1, 4), False, 1, 2)
    assert got["4", True] == got["4", False] == ((1, 4), (1, 4), False, 1, 4)
    assert f"{OVERRIDE}=0 must be a positive number" in got["0"]
    assert f"{OVERRIDE}=3 does not divide the group's 4 ranks" in got["3"]
    assert f"{OVERRIDE}='x' is not an integer" in got["x"]
    assert f"{OVERRIDE} differs between ranks (per rank, None = unset): [None, 2, 2, 2]" in got["disagree"]


# ------------------------------------------------------------------------------------------------
# Random cases: the oracle, and the direct path of the same group
# ------------------------------------------------------------------------------------------------
# (world size, ranks per host) -> cases; eight processes share two cores, so their cases are fewer and smaller.
LAYOUTS = {(4, 2): 16, (4, 1): 6, (8, 4): 10}
MAX_TOKENS = {4: 60, 8: 30}
# Mantissa bits of each output dtype, and the unit roundoff of its accumulator.
MANTISSA_BITS = {torch.bfloat16: 7, torch.float32: 23, torch.float64: 52}
ACC_ROUNDOFF = {torch.bfloat16: 2.0 ** -24, torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}


def make_buffer(case: Case, **kwargs) -> moe_comm.Buffer:
    # `hidden` is counted in bf16 elements for sizing: float32/float64 rows need 2x/4x.
    hidden = case.hidden * case.torch_dtype.itemsize // 2
    return moe_comm.Buffer(None, num_max_tokens_per_rank=case.num_max_tokens_per_rank, hidden=max(hidden, 8),
                           num_topk=case.num_topk, backend="torch", num_cpu_timeout_secs=60, **kwargs)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_outputs(name: str, got, expected) -> None:
    """Bitwise equality of tensors (on any device), FP8 tuples or None."""
    if isinstance(expected, tuple):
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(f"{name}[{i}]", g, e.cpu())
    else:
        assert_same(name, got, None if expected is None else expected.cpu())


def rows_of(t, n: Optional[int]):
    """The first `n` rows of a tensor or of both parts of an FP8 tuple (None: all)."""
    if t is None or n is None:
        return t
    return tuple(part[:n] for part in t) if isinstance(t, tuple) else t[:n]


def true_rows(handle) -> int:
    """Rows of a dispatch's output that hold data (expand: aligned rows of every expert); without a CPU sync the
    rest are unspecified (the reference zeroes them)."""
    return int(handle.psum_num_recv_tokens_per_expert[-1] if handle.do_expand else
               handle.psum_num_recv_tokens_per_rank[-1])


def check_fp8_modes(hybrid, direct, case: Case, rank: int, whole: bool = True) -> int:
    """FP8 on the wire through `hybrid` (any device) and `direct` (the reference, CPU), both formats, as a tuple,
    with `quantize=` and with `dequantize=True`, then a cached dispatch of other rows: bitwise equal. `whole`: rows
    past the true count too (two buffers that zero them). Returns the modes checked."""
    x, idx, w = rank_inputs(case, rank)
    dev = hybrid.device

    def on_dev(t):
        return tuple(p.to(dev) for p in t) if isinstance(t, tuple) else t.to(dev)

    kwargs = dict(num_experts=case.num_experts, do_expand=case.do_expand, expert_alignment=case.expert_alignment,
                  do_cpu_sync=case.do_cpu_sync)
    cached = dict(do_expand=case.do_expand, expert_alignment=case.expert_alignment)
    checked = 0
    for fmt in quant.FP8_FORMATS:
        for mode in ("tuple", "quantize", "dequantize"):
            x_in = quant.quantize(x, fmt) if mode == "tuple" else x
            fp8 = {} if mode == "tuple" else dict(quantize=fmt, dequantize=mode == "dequantize")
            got = hybrid.dispatch(on_dev(x_in), idx.to(dev), None if w is None else w.to(dev), **kwargs, **fp8)
            ref = direct.dispatch(x_in, idx, w, **kwargs, **fp8)
            n = None if whole else true_rows(ref[3])
            for i, what in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights")):
                assert_same_outputs(f"{fmt} {mode} {what}", rows_of(got[i], n), rows_of(ref[i], n))
            x2 = quant.quantize(x * 2, fmt) if mode == "tuple" else x * 2
            assert_same_outputs(f"{fmt} {mode} cached recv_x",
                                rows_of(hybrid.dispatch(on_dev(x2), handle=got[3], **cached, **fp8)[0], n),
                                rows_of(direct.dispatch(x2, handle=ref[3], **cached, **fp8)[0], n))
            checked += 1
    return checked


def assert_same_handles(name: str, got, expected) -> None:
    for field in ("recv_src_idx", "recv_topk_idx", "recv_topk_weights", "psum_num_recv_tokens_per_rank",
                  "psum_num_recv_tokens_per_expert", "topk_idx"):
        assert_same_outputs(f"{name} handle.{field}", getattr(got, field), getattr(expected, field))
    for field in ("num_recv_tokens", "num_recv_tokens_per_expert_list", "num_recv_rows"):  # num_sms: its model
        assert getattr(got, field) == getattr(expected, field), (name, field)


def assert_within_fp32_rounding(name: str, got: torch.Tensor, expected: torch.Tensor, mass: torch.Tensor) -> None:
    """`|got - expected| <= 16 u mass + ulp(expected)`: two summation orders of at most 16 terms (u: the unit
    roundoff of the accumulator; mass: the sum of the terms' absolute values), then one rounding to the output
    dtype each."""
    dtype = got.dtype
    got, expected, mass = got.cpu().double(), expected.cpu().double(), mass.cpu().double()
    bound = 16 * ACC_ROUNDOFF[dtype] * mass + 2.0 ** -MANTISSA_BITS[dtype] * expected.abs()
    excess = (got - expected).abs() - bound
    assert not bool((excess > 0).any()), f"{name}: {int((excess > 0).sum())} elements off by more than FP32 " \
                                         f"rounding; worst excess {excess.max().item():.3g}"


def compare_with_direct(case: Case, rank: int, direct, hybrid, partial) -> int:
    """Dispatch and combine of one case on the direct path and on both hybrid buffers: dispatch outputs and
    handles bitwise (padding rows included), combine bitwise for the unreduced hybrid, within FP32 rounding for
    partial sums. Returns how many combined elements the partial sums changed."""
    x, idx, w = rank_inputs(case, rank, direct.device)
    kwargs = dict(num_experts=case.num_experts, expert_alignment=case.expert_alignment, do_expand=case.do_expand,
                  do_cpu_sync=case.do_cpu_sync, num_max_tokens_per_rank=case.num_max_tokens_per_rank)
    ref = direct.dispatch(x, idx, w, **kwargs)
    runs = {"hybrid": hybrid.dispatch(x, idx, w, **kwargs), "partial": partial.dispatch(x, idx, w, **kwargs)}
    for name, got in runs.items():
        for i, what in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights")):
            assert_same_outputs(f"{name} {what}", got[i], ref[i])
        assert_same_handles(name, got[3], ref[3])

    # Any rows do for combine (the same on every path); weights and biases as check_case gives them.
    y = (ref[0].double() * 0.75 + 0.125).to(ref[0].dtype)
    weights = None if ref[2] is None else ref[2] * 3
    bias = rank_bias(case, rank, direct.device)
    expected, expected_w, _ = direct.combine(y, ref[3], topk_weights=weights, bias=bias or None)
    got, got_w, _ = hybrid.combine(y, runs["hybrid"][3], topk_weights=weights, bias=bias or None)
    assert_same_outputs("hybrid combined_x", got, expected)
    assert_same_outputs("hybrid combined_topk_weights", got_w, expected_w)
    got, got_w, _ = partial.combine(y, runs["partial"][3], topk_weights=weights, bias=bias or None)
    assert_same_outputs("partial combined_topk_weights", got_w, expected_w)
    mass, _, _ = direct.combine(y.abs(), ref[3], bias=tuple(b.abs() for b in bias) or None)
    assert_within_fp32_rounding("partial combined_x", got, expected, mass)
    return int((bits(got) != bits(expected)).sum())  # on the device: .sum() of a bool tensor, then one read


def hybrid_cases_rank(rank: int, world_size: int, ranks_per_host: int, cases: list[Case]) -> list[int]:
    changed = []
    for i, case in enumerate(cases):
        with ranks_per_node(str(ranks_per_host)):
            hybrid = make_buffer(case, deterministic=True)
            partial = make_buffer(case)  # allow_multiple_reduction=True by default
            direct = make_buffer(case, allow_hybrid_mode=False, deterministic=True)  # DESIGN 2.2 order
        assert hybrid.is_hybrid and partial.is_hybrid and not direct.is_hybrid
        assert hybrid.get_logical_domain_size() == (world_size // ranks_per_host, ranks_per_host)
        assert not hybrid._impl.use_partial_reduction and partial._impl.use_partial_reduction
        try:
            check_case(hybrid, case, rank)
            changed.append(compare_with_direct(case, rank, direct, hybrid, partial))
        except AssertionError as exc:
            raise AssertionError(f"case {i}: {case}\n{exc}") from exc
    return changed


@pytest.mark.parametrize("world_size,ranks_per_host", sorted(LAYOUTS))
def test_random_cases(pools, seed, world_size, ranks_per_host):
    cases = draw_cases(seed * 10 + world_size + 1000 * ranks_per_host, LAYOUTS[world_size, ranks_per_host],
                       world_size, max_tokens=MAX_TOKENS[world_size])
    # Few cases: every combination of layout and sync, with and without weights, whatever the draw.
    cases = [dataclasses.replace(c, do_expand=i % 2 == 0, do_cpu_sync=i // 2 % 2 == 0, with_weights=i % 3 != 2)
             for i, c in enumerate(cases)]
    start = time.monotonic()
    changed = pools(world_size).run(hybrid_cases_rank, ranks_per_host, cases)
    for name in ("do_expand", "do_cpu_sync", "with_weights"):
        assert {getattr(c, name) for c in cases} == {True, False}, name
    # The partial sums ran: some element came out of another summation order with other bits.
    assert sum(map(sum, changed)) > 0 or len(cases) < 10
    print(f"{world_size} ranks as {world_size // ranks_per_host} x {ranks_per_host}: {len(cases)} cases in "
          f"{time.monotonic() - start:.1f} s, {sum(map(sum, changed))} elements changed by partial sums")


# ------------------------------------------------------------------------------------------------
# FP8 on the wire, async calls, handles of the other path
# ------------------------------------------------------------------------------------------------
def fp8_async_rank(rank: int, world_size: int, cases: list[Case]) -> int:
    """FP8 dispatch (tuples, `quantize=`, `dequantize=`, cached) and async calls: hybrid bitwise the direct path;
    a handle of one path is refused by the other."""
    checked = 0
    for case in cases:
        make = dict(num_max_tokens_per_rank=case.num_max_tokens_per_rank, hidden=case.hidden, num_topk=case.num_topk,
                    use_fp8_dispatch=True, backend="torch", num_cpu_timeout_secs=60)
        with ranks_per_node("2"):
            hybrid = moe_comm.Buffer(None, deterministic=True, **make)
        direct = moe_comm.Buffer(None, allow_hybrid_mode=False, deterministic=True, **make)
        checked += check_fp8_modes(hybrid, direct, case, rank)
        x, idx, w = rank_inputs(case, rank)
        kwargs = dict(num_experts=case.num_experts, do_expand=case.do_expand, expert_alignment=case.expert_alignment,
                      do_cpu_sync=case.do_cpu_sync)

        # Async: the call returns before the rows arrive; after the wait, the synchronous call's results.
        sync = hybrid.dispatch(x, idx, w, **kwargs)
        early = hybrid.dispatch(x, idx, w, **kwargs, async_with_compute_stream=True)
        assert not early[4].done
        early[4].current_stream_wait()
        assert_same_outputs("async recv_x", early[0], sync[0])
        combined, _, _ = hybrid.combine(sync[0], sync[3])
        later = hybrid.combine(sync[0], sync[3], async_with_compute_stream=True)
        with later[2]:
            pass
        assert_same("async combined_x", later[0], combined)

        with pytest.raises(ValueError, match=r"handle was made by backend 'torch', this buffer runs "
                                             r"'torch hybrid 2x2"):
            hybrid.combine(sync[0], direct.dispatch(x, idx, w, **kwargs)[3])
    return checked


def test_fp8_async_and_foreign_handles(pools, seed):
    cases = draw_cases(seed + 7, 4, 4, max_tokens=30, dtypes=("bfloat16",))
    cases = [dataclasses.replace(c, hidden=128 * (1 + i % 2), do_expand=i % 2 == 0, do_cpu_sync=i // 2 % 2 == 0)
             for i, c in enumerate(cases)]
    assert pools(4).run(fp8_async_rank, cases) == [6 * len(cases)] * 4


# ------------------------------------------------------------------------------------------------
# gradcheck through the hybrid path
# ------------------------------------------------------------------------------------------------
def hybrid_gradcheck_rank(rank: int, world_size: int, cases: list[tuple[Case, bool]]) -> list[bool]:
    results = []
    for case, deterministic in cases:
        with ranks_per_node("2"):
            # float64 rows need 4x the bytes of the bf16 `hidden` the buffer is sized with.
            buf = moe_comm.Buffer(None, num_max_tokens_per_rank=case.num_max_tokens_per_rank, hidden=4 * case.hidden,
                                  num_topk=case.num_topk, backend="torch", deterministic=deterministic,
                                  num_cpu_timeout_secs=60)
        assert buf.is_hybrid
        results.append(run_gradcheck(buf, case, rank))
    return results


def test_gradcheck(pools):
    base = dict(num_ranks=4, num_experts=8, num_topk=3, hidden=2, num_tokens=(3, 0, 2, 1), num_max_tokens_per_rank=4,
                dtype="float64", drop_prob=0.25, num_bias=1)
    # Unreduced with a CPU sync; partial sums, expand, without one.
    cases = [(Case(seed=31, **base), True),
             (Case(seed=32, do_expand=True, expert_alignment=2, do_cpu_sync=False, **base), False)]
    assert pools(4).run(hybrid_gradcheck_rank, cases) == [[True, True]] * 4


# ------------------------------------------------------------------------------------------------
# Value errors and ranks that disagree (DESIGN 2.6) on the hybrid path
# ------------------------------------------------------------------------------------------------
def hybrid_value_errors_rank(rank: int, world_size: int) -> str:
    """A bad expert id on rank 3 (the other host): with a CPU sync every rank raises naming rank 3; without one the
    slot is dropped and the next barrier raises on every rank; then the buffer works."""
    with ranks_per_node("2"):
        buf = moe_comm.Buffer(None, num_max_tokens_per_rank=4, hidden=16, num_topk=2, backend="torch",
                              num_cpu_timeout_secs=30)
    return raise_for_bad_routing(buf, TIMEOUT_CASE, rank)


def raise_for_bad_routing(buf: moe_comm.Buffer, case: Case, rank: int) -> str:
    """Rank 3 routes a token to expert 99: with a CPU sync every rank raises (returns the message); without one the
    slot is dropped and the next barrier raises on every rank; then `case` checks out on the buffer."""
    x, idx, w = rank_inputs(case, rank)
    bad = idx.clone()
    if rank == 3:
        bad[1, 0] = 99
    with pytest.raises(ValueError) as info:
        buf.dispatch(x, bad, w, num_experts=8)
    buf.dispatch(x, bad, w, num_experts=8, do_cpu_sync=False)
    with pytest.raises(ValueError, match=r"earlier dispatch without CPU sync \(slots dropped\): out-of-range "
                                         r"entries on rank\(s\) \[3\]"):
        buf.barrier()
    check_case(buf, case, rank)
    return str(info.value)


def test_value_errors_raise_on_every_rank(pools):
    messages = pools(4).run(hybrid_value_errors_rank)
    assert all("topk_idx is invalid: entries outside [-1, 8) on rank(s) [3]" in m for m in messages), messages


def hybrid_hook_rank(rank: int, world_size: int) -> str:
    """The hybrid path takes no receive hook: a ValueError before anything moves, then the buffer works."""
    with ranks_per_node("1"):
        buf = moe_comm.Buffer(None, num_max_tokens_per_rank=8, hidden=16, num_topk=2, backend="torch",
                              num_cpu_timeout_secs=30)
    case = Case(seed=5, num_ranks=2, num_experts=4, num_topk=2, hidden=16, num_tokens=(5, 3),
                num_max_tokens_per_rank=8)
    x, idx, w = rank_inputs(case, rank)
    with pytest.raises(ValueError) as info:
        buf.dispatch(x, idx, w, num_experts=4, return_recv_hook=True)
    recv_x, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=4)
    with pytest.raises(ValueError, match="return_recv_hook=True is not available on the torch hybrid 2x1"):
        buf.combine(recv_x, handle, return_recv_hook=True)
    check_case(buf, case, rank)
    return str(info.value)


def test_hybrid_path_refuses_recv_hooks(pools):
    messages = pools(2).run(hybrid_hook_rank)
    assert messages[0] == messages[1] and "legs run one after another" in messages[0], messages


def hybrid_probes_rank(rank: int, world_size: int) -> list[str]:
    def make() -> moe_comm.Buffer:
        with ranks_per_node("1"):  # 2 hosts x 1: every exchange but a rank's own crosses on a rail
            buf = moe_comm.Buffer(None, num_max_tokens_per_rank=8, hidden=128, num_topk=2, backend="torch",
                                  num_cpu_timeout_secs=20)
        assert buf.get_logical_domain_size() == (2, 1)
        return buf
    return run_probes(rank, world_size, make)


def test_disagreement_is_an_error_on_every_rank(pools):
    messages = pools(2).run(hybrid_probes_rank)
    assert messages[0] == messages[1] and len(messages[0]) > 10


# ------------------------------------------------------------------------------------------------
# A peer that never arrives, on either leg
# ------------------------------------------------------------------------------------------------
TIMEOUT_CASE = Case(seed=51, num_ranks=4, num_experts=8, num_topk=2, hidden=16, num_tokens=(4, 4, 4, 4),
                    num_max_tokens_per_rank=4)


def missing_peer_rank(rank: int, world_size: int, phase: str):
    """2 hosts x 2; rank 3 skips one call. Its rail peer (rank 1) waits on it in the scale-out leg, its host peer
    (rank 2) in the scale-up leg, rank 0 on rank 1 (stuck) in the scale-up leg: all fail within the timeout."""
    with ranks_per_node("2"):
        buf = moe_comm.Buffer(None, num_max_tokens_per_rank=4, hidden=16, num_topk=2, backend="torch",
                              num_cpu_timeout_secs=2)
    return skip_one_call(buf, TIMEOUT_CASE, rank, 3, phase)


@pytest.mark.parametrize("phase", ["dispatch", "combine"])
def test_missing_peer_times_out_on_both_legs(phase):
    *outcomes, skipped = parallel_launch(4, missing_peer_rank, phase, timeout_s=120)
    assert skipped == "skipped"
    expected = {0: "(scale-up leg): receive from peer 1", 1: "(scale-out leg): receive from peer 3",
                2: "(scale-up leg): receive from peer 3"}
    for rank, (error, message, elapsed) in enumerate(outcomes):
        # Rank 0 waits on rank 1, which times out at about the same moment and closes its connections: rank 0 may
        # see that first (a ConnectionError naming the same phase and peer).
        assert error == "TimeoutError" or (rank == 0 and error == "ConnectionError"), (rank, error, message)
        assert elapsed < 5, (rank, elapsed)
        assert f"rank {rank} {phase} argument agreement {expected[rank]}" in message, message
        assert "num_cpu_timeout_secs=2" in message or "peer 1 closed the connection" in message, message


# ------------------------------------------------------------------------------------------------
# GPU tier: the hybrid reference over NCCL, 2 GPUs as 2 hosts x 1 (scale-out leg between them)
# ------------------------------------------------------------------------------------------------
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def nccl_no_host_sync_rank(rank: int, world_size: int, case: Case) -> bool:
    """A dispatch without CPU sync, its combine (both reductions) and a cached dispatch never sync with the host."""
    with ranks_per_node("1"):
        bufs = [make_buffer(case, deterministic=deterministic) for deterministic in (True, False)]
    x, idx, w = rank_inputs(case, rank, bufs[0].device)
    kwargs = dict(num_experts=case.num_experts, do_expand=case.do_expand, expert_alignment=case.expert_alignment)
    for buf in bufs:
        buf.dispatch(x, idx, w, do_cpu_sync=False, **kwargs)  # warm-up: NCCL communicators, allocator
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            recv_x, _, recv_w, handle, _ = buf.dispatch(x, idx, w, do_cpu_sync=False, **kwargs)
            combined, _, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
            buf.dispatch(combined, handle=handle, do_expand=case.do_expand, expert_alignment=case.expert_alignment)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        buf.destroy()
    return True


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("do_expand", [False, True])
def test_nccl_no_host_sync(do_expand):
    case = Case(seed=71, num_ranks=2, num_experts=16, num_topk=4, hidden=256, num_tokens=(300, 200),
                num_max_tokens_per_rank=512, do_expand=do_expand, expert_alignment=16)
    with WorkerPool(2, backend="nccl", timeout_s=600) as pool:
        assert pool.run(nccl_no_host_sync_rank, case) == [True, True]


@pytest.mark.gpu
@needs_two_gpus
def test_nccl_random_cases(seed):
    cases = draw_cases(seed * 10 + 77, 12, 2, max_tokens=300)
    cases = [dataclasses.replace(c, do_expand=i % 2 == 0, do_cpu_sync=i // 2 % 2 == 0) for i, c in enumerate(cases)]
    with WorkerPool(2, backend="nccl", timeout_s=600) as pool:
        changed = pool.run(hybrid_cases_rank, 1, cases)
    print(f"NCCL 2 ranks as 2 x 1: {len(cases)} cases, {sum(map(sum, changed))} elements changed by partial sums")
