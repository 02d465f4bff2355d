"""The hybrid (multi-host) path of the reference backend on the CPU tier: one machine's gloo ranks split into hosts
by `MOE_COMM_RANKS_PER_NODE` (4 ranks as 2 hosts x 2, 8 as 2 x 4), checked against the closed-form oracle and
bitwise against the direct path of the same group (DESIGN 8.3); the domain detection and its override."""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import pytest

import moe_comm
from moe_comm.domains import OVERRIDE, Report, domains_from_reports


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
    gpus = [Report("a", "g0", ("g1",)), Report("a", "g1", ("g0",)), Report("a", "g2", ("g3",)),
            Report("a", "g3", ("g2",)), Report("b", "g4")]
    assert domains_from_reports(gpus).domain_of_rank == (0, 0, 1, 1, 2)
    assert not domains_from_reports(gpus).is_uniform
    # Access one way only is no domain; two ranks on one GPU are.
    one_way = [Report("a", "g0", ("g1",)), Report("a", "g1", ()), Report("a", "g1", ())]
    assert domains_from_reports(one_way).domain_of_rank == (0, 1, 1)
    # Interleaved hosts (rank order a, b, a, b): two domains of two, not consecutive.
    interleaved = domains_from_reports([Report("a"), Report("b"), Report("a"), Report("b")])
    assert interleaved.domain_of_rank == (0, 1, 0, 1) and not interleaved.is_uniform
    assert interleaved.num_ranks_per_domain == 2


def test_override_replaces_detection():
    found = domains_from_reports([Report(f"h{r}", override=4) for r in range(8)])
    assert found.domain_of_rank == (0,) * 4 + (1,) * 4 and found.describe() == f"2 x 4 ranks ({OVERRIDE}=4)"


@pytest.mark.parametrize("value,fragment", [
    ("0", f"{OVERRIDE}=0 must be a positive number of ranks per host"),
    ("-2", f"{OVERRIDE}=-2 must be a positive number of ranks per host"),
    ("3", f"{OVERRIDE}=3 does not divide the group's 4 ranks into hosts"),
    ("two", f"{OVERRIDE}='two' is not an integer (on rank(s) [0, 1, 2, 3])"),
    ("", f"{OVERRIDE}='' is not an integer"),
])
def test_bad_override_is_a_value_error(value, fragment):
    from moe_comm.domains import local_report
    import torch
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
