"""`Buffer(sl_idx=...)`: the check that NCCL carries the traffic on that InfiniBand service level (NCCL_IB_SL
first, else the group's communicator traffic class), on CPU with stand-ins for an NCCL group, and the
every-rank agreement of its error over gloo."""

from __future__ import annotations

import types
import unittest.mock as mock

import pytest
import torch

import moe_comm
from moe_comm import traffic_class
from moe_comm.traffic_class import NCCL_CONFIG_UNDEF_INT, why_not_applied

CUDA = torch.device("cuda", 0)  # only compared against, never used


def fake_nccl_group(value=None, has_field: bool = True):
    """An object shaped like an NCCL ProcessGroup as far as `group_traffic_class` looks."""
    config = types.SimpleNamespace(traffic_class=value) if has_field else types.SimpleNamespace()
    backend = types.SimpleNamespace(options=types.SimpleNamespace(config=config))
    return types.SimpleNamespace(_get_backend=lambda device: backend)


@pytest.mark.parametrize("env_sl,group_class,fragment", [
    ("3", None, None),                       # the variable wins, whatever the group says
    (" 3 ", 5, None),
    (None, 3, None),
    ("5", 3, "NCCL_IB_SL=5 is set and takes precedence"),
    ("x", 3, "NCCL_IB_SL='x' is not an integer"),
    (None, None, "does not expose NCCL's communicator traffic class"),
    (None, NCCL_CONFIG_UNDEF_INT, "neither NCCL_IB_SL nor the group's traffic class is set"),
    (None, 7, "config.traffic_class=7"),
])
def test_why_not_applied(env_sl, group_class, fragment):
    why = why_not_applied(3, env_sl, group_class)
    if fragment is None:
        assert why is None
    else:
        assert fragment in why, why


def test_group_traffic_class_reads_the_options():
    assert traffic_class.group_traffic_class(fake_nccl_group(4), CUDA) == 4
    assert traffic_class.group_traffic_class(fake_nccl_group(has_field=False), CUDA) is None
    assert traffic_class.group_traffic_class(object(), CUDA) is None


def test_check_applied(monkeypatch):
    monkeypatch.delenv("NCCL_IB_SL", raising=False)
    traffic_class.check_applied(fake_nccl_group(3), CUDA, 3)
    traffic_class.check_applied(fake_nccl_group(5), CUDA, None)              # None: nothing checked
    traffic_class.check_applied(fake_nccl_group(5), torch.device("cpu"), 3)  # gloo: no service level
    with pytest.raises(ValueError, match=r"sl_idx=3 does not reach NCCL: the group's NCCL options set "
                                         r"config.traffic_class=5"):
        traffic_class.check_applied(fake_nccl_group(5), CUDA, 3)
    monkeypatch.setenv("NCCL_IB_SL", "3")
    traffic_class.check_applied(fake_nccl_group(5), CUDA, 3)
    monkeypatch.setenv("NCCL_IB_SL", "2")
    with pytest.raises(ValueError, match="sl_idx=3 does not reach NCCL: NCCL_IB_SL=2"):
        traffic_class.check_applied(fake_nccl_group(3), CUDA, 3)


def traffic_class_error(sl_idx, nccl_ib_sl: str) -> str:
    """This rank's Buffer(sl_idx=...) over gloo, its traffic-class check run as on an NCCL group with NCCL_IB_SL set:
    the error it raises ("no error" if none)."""
    buf = moe_comm.Buffer(None, num_max_tokens_per_rank=8, hidden=128, num_topk=2, backend="torch", sl_idx=sl_idx)
    assert buf.sl_idx == sl_idx
    real = traffic_class.check_applied

    def check(group, device, sl_idx):
        real(group, CUDA, sl_idx)

    with mock.patch.object(traffic_class, "check_applied", check), \
            mock.patch.dict("os.environ", {"NCCL_IB_SL": nccl_ib_sl}):
        try:
            buf._check_traffic_class()
        except ValueError as exc:
            return str(exc)
        finally:
            buf.destroy()
    return "no error"


def one_rank_disagrees_rank(rank: int, world_size: int) -> str:
    """Rank 1's NCCL would use another level: every rank must get the same error (no rank left waiting)."""
    return traffic_class_error(3, "3" if rank == 0 else "6")


def test_disagreement_raises_on_every_rank(pools):
    messages = pools(2).run(one_rank_disagrees_rank)
    assert messages[0] == messages[1], messages
    assert "moe_comm.Buffer(sl_idx=3) failed on rank(s) [1]" in messages[0], messages[0]
    assert "NCCL_IB_SL=6" in messages[0], messages[0]


def sl_idx_on_one_rank_rank(rank: int, world_size: int) -> str:
    """Rank 0 asks for a traffic class, rank 1 does not, on a group taken for an NCCL one: `Buffer(...)` must run the
    check on both (it is collective on every rank of a CUDA group whatever its sl_idx) and raise the same error on
    both, first thing (a rank that skipped it would go on to the device's memory, and fail on a CPU machine)."""
    with mock.patch.object(moe_comm.Buffer, "group_device", staticmethod(lambda group: CUDA)):
        try:
            moe_comm.Buffer(None, num_max_tokens_per_rank=8, hidden=128, num_topk=2, backend="torch",
                            sl_idx=3 if rank == 0 else None)
        except ValueError as exc:
            return str(exc)
    return "no error"


def test_sl_idx_on_one_rank_raises_on_every_rank(pools):
    messages = pools(2).run(sl_idx_on_one_rank_rank)
    assert messages[0] == messages[1], messages
    assert "sl_idx differs between ranks (per rank, None = not set): [3, None]" in messages[0], messages[0]


def test_subgroup_options_only_for_nccl_groups_with_a_class(monkeypatch):
    # A CPU (gloo) group has no NCCL options to carry over: its subgroups are made with the defaults.
    assert traffic_class.subgroup_options(None, torch.device("cpu")) is None
    # An NCCL group: a fresh Options with the group's class, None when the class is unset or not exposed.
    cuda = torch.device("cuda", 0)

    class Options:
        def __init__(self):
            self.config = types.SimpleNamespace(traffic_class=NCCL_CONFIG_UNDEF_INT)

    monkeypatch.setattr(traffic_class.dist, "get_backend", lambda group: "nccl")
    monkeypatch.setattr(traffic_class.dist, "ProcessGroupNCCL", types.SimpleNamespace(Options=Options), raising=False)
    for group_class, expected in ((3, 3), (NCCL_CONFIG_UNDEF_INT, None), (None, None)):
        monkeypatch.setattr(traffic_class, "group_traffic_class", lambda group, device: group_class)
        options = traffic_class.subgroup_options(object(), cuda)
        assert (None if options is None else options.config.traffic_class) == expected, group_class
