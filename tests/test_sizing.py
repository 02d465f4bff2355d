"""Tests of the analytical model (`moe_comm/sizing.py`, DESIGN 2.4). CPU only (torch only for `Buffer`'s hint). (Over 400 lines: hand-
computed values for every branch of the model, and the golden values DESIGN fixes.)"""

import importlib.util
import json
import math
import pathlib
import random
import re
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_comm import Buffer, sizing
from moe_comm.sizing import (
    B200_NUM_SMS,
    B200_NVLINK_LINK_GBS,
    BUFFER_CONTROL_BYTES,
    H100_NUM_SMS,
    H100_NVLINK_LINK_GBS,
    H200_NUM_SMS,
    H200_NVLINK_LINK_GBS,
    SmEstimate,
    TimeEstimate,
    Topology,
    estimate_num_sms,
    estimate_time,
    expected_num_groups,
    get_buffer_size_hint,
    get_bytes_per_row,
    get_num_qps,
    get_num_sms,
    nvlink_gbs_from_links,
    parse_nvidia_smi_nvlink,
    query_nvlink_link_gbs,
    rdma_gbs_from_nic_gbits,
)

NUM_EXPERTS = 256
NUM_TOPK = 8
RDMA_GBS = 50.0


# ---------------------------------------------------------------------------------------------------------------
# Golden values (DESIGN 2.4: 256 experts, top-8, RDMA 50 GB/s)
# ---------------------------------------------------------------------------------------------------------------


def _golden_topologies():
    h100 = nvlink_gbs_from_links(list(H100_NVLINK_LINK_GBS))
    b200 = nvlink_gbs_from_links(list(B200_NVLINK_LINK_GBS))
    h200 = nvlink_gbs_from_links(list(H200_NVLINK_LINK_GBS))
    yield "h100_hybrid_2x8", Topology(16, 8, 2, h100, RDMA_GBS, H100_NUM_SMS), 12
    yield "h100_hybrid_4x8", Topology(32, 8, 4, h100, RDMA_GBS, H100_NUM_SMS), 6
    yield "b200_direct_ep8", Topology(8, 8, 1, b200, RDMA_GBS, B200_NUM_SMS), 24
    yield "h200_direct_ep2", Topology(2, 2, 1, h200, RDMA_GBS, H200_NUM_SMS), 22


@pytest.mark.parametrize(
    "topology, expected", [pytest.param(t, e, id=name) for name, t, e in _golden_topologies()]
)
def test_golden_num_sms(topology, expected):
    assert get_num_sms(topology, NUM_EXPERTS, NUM_TOPK) == expected


def test_golden_from_links_matches():
    topology = Topology.from_links(16, 8, 2, link_gbs=H100_NVLINK_LINK_GBS, nic_gbits=400, num_device_sms=132)
    assert topology.rdma_gbs == RDMA_GBS
    assert topology.nvlink_gbs == pytest.approx(0.9 * 18 * 26.5625)
    assert get_num_sms(topology, NUM_EXPERTS, NUM_TOPK) == 12


def test_estimate_explains_golden_hybrid():
    topology = Topology.from_links(16, 8, 2, link_gbs=H100_NVLINK_LINK_GBS)
    est = estimate_num_sms(topology, NUM_EXPERTS, NUM_TOPK)
    assert isinstance(est, SmEstimate)
    assert est.mode == "hybrid"
    # Hybrid 2x8 on H100: the NIC (50 GB/s) is the limit, not NVLink (~430 GB/s).
    assert est.bottleneck == "rdma"
    assert est.bottleneck_gbs == RDMA_GBS
    assert est.expected_scaleout_groups == pytest.approx(expected_num_groups(NUM_EXPERTS, NUM_TOPK, 2))
    assert est.nvlink == pytest.approx(1 - 1 / 8)
    assert 8 < est.num_sms_needed <= est.num_sms / 1.25
    assert "num_sms=12" in est.describe()


def test_direct_with_rdma_peers_picks_slower_link():
    # 16 ranks, NVLink domain of 8: half the traffic goes over a 50 GB/s NIC, which must be the bottleneck.
    topology = Topology.from_links(16, 8, 1, link_gbs=H100_NVLINK_LINK_GBS)
    est = estimate_num_sms(topology, NUM_EXPERTS, NUM_TOPK)
    assert est.mode == "direct"
    assert est.bottleneck == "rdma"
    assert est.rdma == pytest.approx(0.5)
    et = expected_num_groups(NUM_EXPERTS, NUM_TOPK, 16)
    assert est.sm_write == pytest.approx(0.5 + 1 / et)


def test_direct_nvl_domain_larger_than_group():
    # EP2 on an 8-GPU node behaves as a 2-rank NVLink domain.
    h200 = nvlink_gbs_from_links(list(H200_NVLINK_LINK_GBS))
    wide = Topology(2, 8, 1, h200, RDMA_GBS, H200_NUM_SMS)
    assert get_num_sms(wide, NUM_EXPERTS, NUM_TOPK) == 22


def test_expand_counts_the_fan_out_by_hand():
    # EP2 on H200 links, top-8 of 256: Et = 2 * (1 - C(128, 8) / C(256, 8)); a received row is written K / Et ~ 4.01
    # times, so sm_write = 4.01 where the non-expand layout writes it once: n = (430.3 / 0.5) * 4.01 / 50 = 69.1,
    # ceil(1.25 n) = 87 -> 88 SMs (22 without the fan-out).
    topology = Topology.from_links(2, 2, link_gbs=H200_NVLINK_LINK_GBS, num_device_sms=132)
    et = 2 * (1 - math.comb(128, 8) / math.comb(256, 8))
    est = estimate_num_sms(topology, NUM_EXPERTS, NUM_TOPK, do_expand=True)
    assert est.fan_out == pytest.approx(8 / et)
    assert est.sm_write == pytest.approx(8 / et)
    assert est.num_sms_needed == pytest.approx(0.9 * 18 * 26.5625 / 0.5 * (8 / et) / 50)
    assert est.num_sms == get_num_sms(topology, NUM_EXPERTS, NUM_TOPK, do_expand=True) == 88
    assert "expand fan-out 4.01" in est.describe() and "num_sms=88" in est.describe()
    assert estimate_num_sms(topology, NUM_EXPERTS, NUM_TOPK).fan_out == 1.0


@pytest.mark.parametrize("name, topology, golden", [pytest.param(n, t, g, id=n) for n, t, g in _golden_topologies()])
def test_expand_only_adds_the_output_writes(name, topology, golden):
    # The fan-out multiplies the term of the rows written into the outputs (direct: nvl / num_ranks; hybrid: the
    # trailing 1) and nothing else; the golden (non-expand) counts stay.
    plain = estimate_num_sms(topology, NUM_EXPERTS, NUM_TOPK)
    expand = estimate_num_sms(topology, NUM_EXPERTS, NUM_TOPK, do_expand=True)
    assert plain.num_sms == golden
    fan_out = NUM_TOPK / plain.expected_rank_groups
    output_term = 1.0 if topology.is_hybrid else topology.num_direct_nvl_ranks / topology.num_ranks
    assert expand.fan_out == pytest.approx(fan_out)
    assert expand.sm_write == pytest.approx(plain.sm_write + output_term * (fan_out - 1))
    assert (expand.sm_read, expand.nvlink, expand.rdma, expand.bottleneck) == \
        (plain.sm_read, plain.nvlink, plain.rdma, plain.bottleneck)
    assert expand.num_sms >= plain.num_sms


def test_expand_on_one_rank_gets_all_sms():
    topology = Topology(1, 1, num_device_sms=132)
    assert get_num_sms(topology, NUM_EXPERTS, NUM_TOPK, do_expand=True) == 132


# ---------------------------------------------------------------------------------------------------------------
# E(G)
# ---------------------------------------------------------------------------------------------------------------


def _monte_carlo_num_groups(num_experts, num_topk, num_groups, num_samples, seed):
    rng = random.Random(seed)
    num_experts_per_group = num_experts // num_groups
    counts = [
        len({expert_idx // num_experts_per_group for expert_idx in rng.sample(range(num_experts), num_topk)})
        for _ in range(num_samples)
    ]
    return statistics.fmean(counts), statistics.pstdev(counts)


@pytest.mark.parametrize(
    "num_experts, num_topk, num_groups",
    [(256, 8, 8), (256, 8, 2), (256, 8, 64), (64, 1, 8), (32, 32, 4), (128, 6, 128), (60, 7, 5)],
)
def test_expected_num_groups_matches_monte_carlo(num_experts, num_topk, num_groups):
    num_samples = 20000
    mean, std = _monte_carlo_num_groups(num_experts, num_topk, num_groups, num_samples, seed=1234)
    # The sample mean is within 5 standard errors of the truth with probability > 1 - 6e-7 (CLT), so a
    # correct formula essentially never fails, and a wrong one by more than ~0.1 group does. The seed makes
    # the outcome fixed anyway. The sample std underestimates the true one by a relative O(1/sqrt(N)),
    # negligible at N = 20000. K = 1 and K = E have zero variance: the 1e-9 covers float rounding only.
    tolerance = 5 * std / math.sqrt(num_samples) + 1e-9
    assert abs(expected_num_groups(num_experts, num_topk, num_groups) - mean) <= tolerance


@pytest.mark.parametrize("num_experts, num_topk", [(8, 1), (256, 8), (256, 256), (1024, 64)])
def test_expected_num_groups_single_group(num_experts, num_topk):
    assert expected_num_groups(num_experts, num_topk, 1) == 1.0


@pytest.mark.parametrize("num_experts, num_groups", [(8, 2), (256, 8), (256, 256), (1024, 64)])
def test_expected_num_groups_all_experts(num_experts, num_groups):
    assert expected_num_groups(num_experts, num_experts, num_groups) == num_groups


@pytest.mark.parametrize("num_experts, num_topk", [(8, 3), (256, 8), (1024, 64)])
def test_expected_num_groups_one_expert_per_group(num_experts, num_topk):
    # Every expert its own group: each pick is a new group.
    assert expected_num_groups(num_experts, num_topk, num_experts) == pytest.approx(num_topk)


def test_expected_num_groups_topk_one_and_zero():
    assert expected_num_groups(256, 1, 8) == pytest.approx(1.0)
    assert expected_num_groups(256, 0, 8) == 0.0


def test_expected_num_groups_large_no_overflow():
    # C(4096, 512) is far beyond float range; the exact ratio must still give a sane value.
    value = expected_num_groups(4096, 512, 64)
    assert 63.0 < value < 64.0


@given(
    num_groups=st.integers(1, 32),
    num_experts_per_group=st.integers(1, 16),
    data=st.data(),
)
@settings(max_examples=100, deadline=None)
def test_expected_num_groups_bounds(num_groups, num_experts_per_group, data):
    num_experts = num_groups * num_experts_per_group
    num_topk = data.draw(st.integers(1, num_experts))
    value = expected_num_groups(num_experts, num_topk, num_groups)
    assert 1.0 - 1e-12 <= value <= min(num_topk, num_groups) + 1e-12
    # At least ceil(K / experts per group) groups are always hit.
    assert value >= math.ceil(num_topk / num_experts_per_group) - 1e-9


@pytest.mark.parametrize(
    "args, match",
    [
        ((255, 8, 8), "num_experts=255 is not a multiple of num_groups=8"),
        ((8, 9, 2), "num_topk=9 exceeds num_experts=8"),
        ((0, 0, 1), "num_experts=0"),
        ((8, -1, 2), "num_topk=-1"),
        ((8, 2, 0), "num_groups=0"),
        ((8, 2, -2), "num_groups=-2"),
    ],
)
def test_expected_num_groups_validation(args, match):
    with pytest.raises(ValueError, match=match):
        expected_num_groups(*args)


# ---------------------------------------------------------------------------------------------------------------
# get_num_sms
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_device_sms", [132, 148, 7])
def test_single_rank_gets_all_sms(num_device_sms):
    topology = Topology(1, 1, num_device_sms=num_device_sms)
    est = estimate_num_sms(topology, NUM_EXPERTS, NUM_TOPK)
    assert est.bottleneck == "none"
    assert est.num_sms == num_device_sms
    assert get_num_sms(topology, NUM_EXPERTS, NUM_TOPK) == num_device_sms


def test_sms_capped_by_device():
    topology = Topology.from_links(8, 8, link_gbs=B200_NVLINK_LINK_GBS, num_device_sms=10)
    assert get_num_sms(topology, NUM_EXPERTS, NUM_TOPK) == 10


@st.composite
def _topologies(draw):
    num_scaleout_groups = draw(st.sampled_from([1, 1, 2, 3, 4, 8]))
    num_ranks_per_group = draw(st.integers(1, 16))
    num_ranks = num_scaleout_groups * num_ranks_per_group
    if num_scaleout_groups > 1:
        num_nvl_ranks = draw(st.integers(num_ranks_per_group, 72))
    else:
        num_nvl_ranks = draw(st.integers(1, 72))
    topology = Topology(
        num_ranks=num_ranks,
        num_nvl_ranks=num_nvl_ranks,
        num_scaleout_groups=num_scaleout_groups,
        nvlink_gbs=draw(st.floats(1.0, 2000.0)),
        rdma_gbs=draw(st.floats(1.0, 200.0)),
        num_device_sms=draw(st.integers(4, 200).map(lambda n: n - n % 2)),
    )
    num_experts = num_ranks * draw(st.integers(1, 8))
    num_topk = draw(st.integers(1, min(num_experts, 16)))
    return topology, num_experts, num_topk


@given(_topologies())
@settings(max_examples=200, deadline=None)
def test_num_sms_even_bounded(case):
    topology, num_experts, num_topk = case
    est = estimate_num_sms(topology, num_experts, num_topk)
    assert est.num_sms == get_num_sms(topology, num_experts, num_topk)
    # The expand layout's fan-out (K / Et >= 1 rows per received row) never asks for fewer SMs.
    expand = estimate_num_sms(topology, num_experts, num_topk, do_expand=True)
    assert expand.fan_out >= 1.0 - 1e-12 and expand.num_sms >= est.num_sms
    assert est.num_sms % 2 == 0
    assert 4 <= est.num_sms <= topology.num_device_sms
    assert est.bottleneck in ("nvlink", "rdma", "none")
    assert (est.bottleneck == "none") == (est.nvlink == 0 and est.rdma == 0)
    if est.bottleneck != "none":
        padded = max(4, math.ceil(1.25 * est.num_sms_needed))
        assert est.num_sms == min(topology.num_device_sms, padded + padded % 2)


def test_num_sms_needs_topk():
    with pytest.raises(ValueError, match="num_topk=0"):
        get_num_sms(Topology(8, 8), NUM_EXPERTS, 0)


def test_num_sms_needs_divisible_experts():
    with pytest.raises(ValueError, match="num_experts=100 is not a multiple of num_groups=8"):
        get_num_sms(Topology(8, 8), 100, NUM_TOPK)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_ranks=0, num_nvl_ranks=1), "num_ranks=0"),
        (dict(num_ranks=8, num_nvl_ranks=0), "num_nvl_ranks=0"),
        (dict(num_ranks=12, num_nvl_ranks=8, num_scaleout_groups=5), "num_ranks=12 is not a multiple"),
        (dict(num_ranks=32, num_nvl_ranks=8, num_scaleout_groups=2), "do not fit in the NVLink domain"),
        (dict(num_ranks=8, num_nvl_ranks=8, nvlink_gbs=0.0), "nvlink_gbs=0.0"),
        (dict(num_ranks=8, num_nvl_ranks=8, rdma_gbs=float("nan")), "rdma_gbs=nan"),
        (dict(num_ranks=8, num_nvl_ranks=8, num_device_sms=0), "num_device_sms=0"),
        (dict(num_ranks=8, num_nvl_ranks=8, nvlink_gbs=math.inf), "nvlink_gbs=inf must be positive and finite"),
        (dict(num_ranks=8, num_nvl_ranks=8, rdma_gbs=math.inf), "rdma_gbs=inf"),
    ],
)
def test_topology_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Topology(**kwargs)


@pytest.mark.parametrize("call, match", [
    (lambda: Topology(2.0, 2), r"num_ranks must be an int, got 2.0 \(float\)"),
    (lambda: Topology(True, True), r"num_ranks must be an int, got True \(bool\)"),
    (lambda: Topology(2, 2, num_device_sms=2.5), "num_device_sms must be an int"),
    (lambda: get_buffer_size_hint(2, 4096, 7168, 2.5), "num_topk must be an int"),
    (lambda: get_buffer_size_hint(2, 64.5, 256, 4), "num_max_tokens_per_rank must be an int"),
    (lambda: sizing.expected_num_groups(256.0, 8, 2), "num_experts must be an int"),
    (lambda: Buffer.get_buffer_size_hint("world", 64, 256, 4), "group must be a torch.distributed.ProcessGroup"),
    (lambda: Buffer.get_buffer_size_hint(None, 64, 256, 4, use_fp8_dispatch=1), "use_fp8_dispatch must be a bool"),
])
def test_sizes_must_be_ints(call, match):
    """A float or bool count is refused naming the argument (a fractional byte count or SM count is no answer)."""
    with pytest.raises(TypeError, match=match):
        call()


def test_topology_is_frozen():
    topology = Topology(8, 8)
    with pytest.raises(AttributeError):
        topology.num_ranks = 4


def test_link_helpers():
    assert nvlink_gbs_from_links([26.5625] * 18) == pytest.approx(430.3125)
    assert nvlink_gbs_from_links([]) == 0.0
    assert rdma_gbs_from_nic_gbits(400) == 50.0
    with pytest.raises(ValueError, match=r"link_gbs\[1\]=-1"):
        nvlink_gbs_from_links([1.0, -1.0])
    with pytest.raises(ValueError, match="nic_gbits=0"):
        rdma_gbs_from_nic_gbits(0)


# ---------------------------------------------------------------------------------------------------------------
# QPs
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_sms, hybrid, num_allocated_qps, expected",
    [
        (24, False, 129, 9),
        (4, False, 129, 4),
        (9, False, 129, 9),
        (24, False, 6, 6),
        (12, True, 1024, 193),
        (12, True, 100, 100),
        (1, True, 1024, 17),
    ],
)
def test_get_num_qps(num_sms, hybrid, num_allocated_qps, expected):
    assert get_num_qps(num_sms, hybrid, num_allocated_qps) == expected


def test_get_num_qps_validation():
    with pytest.raises(ValueError, match="num_sms=0"):
        get_num_qps(0, False, 8)
    with pytest.raises(ValueError, match="num_allocated_qps=0"):
        get_num_qps(8, True, 0)


# ---------------------------------------------------------------------------------------------------------------
# nvidia-smi parsing
# ---------------------------------------------------------------------------------------------------------------

NVIDIA_SMI_NVLINK_SAMPLE = """\
GPU 0: NVIDIA H200 (UUID: GPU-3b1f8a52-7c1e-2d4f-9a0b-1c2d3e4f5a6b)
\t Link 0: 26.562 GB/s
\t Link 1: 26.562 GB/s
\t Link 2: <inactive>
\t Link 3: 26.562 GB/s
\t Link 4: 25 GB/s
GPU 1: NVIDIA H200 (UUID: GPU-8e7d6c5b-4a39-2817-0f1e-2d3c4b5a6978)
\t Link 0: 50.000 GB/s
\t Link 1: 50.000 GB/s
"""


def test_parse_nvidia_smi_nvlink():
    assert parse_nvidia_smi_nvlink(NVIDIA_SMI_NVLINK_SAMPLE) == [26.562, 26.562, 26.562, 25.0]
    assert parse_nvidia_smi_nvlink(NVIDIA_SMI_NVLINK_SAMPLE, gpu_idx=1) == [50.0, 50.0]
    assert parse_nvidia_smi_nvlink(NVIDIA_SMI_NVLINK_SAMPLE, gpu_idx=2) == []
    assert parse_nvidia_smi_nvlink("") == []
    assert parse_nvidia_smi_nvlink("GPU 0: NVIDIA H200 (UUID: x)\n\t Link 0: <inactive>\n") == []


def test_query_nvlink_link_gbs_without_nvidia_smi(monkeypatch):
    monkeypatch.setattr(sizing.shutil, "which", lambda name: None)
    assert query_nvlink_link_gbs() is None


def test_query_nvlink_link_gbs_failures(monkeypatch):
    monkeypatch.setattr(sizing.shutil, "which", lambda name: "/usr/bin/nvidia-smi")

    def timeout(*args, **kwargs):
        raise sizing.subprocess.TimeoutExpired(cmd=args[0], timeout=kwargs["timeout"])

    monkeypatch.setattr(sizing.subprocess, "run", timeout)
    assert query_nvlink_link_gbs() is None

    def failing(*args, **kwargs):
        return sizing.subprocess.CompletedProcess(args[0], 9, stdout="", stderr="NVML error")

    monkeypatch.setattr(sizing.subprocess, "run", failing)
    assert query_nvlink_link_gbs() is None

    def ok(*args, **kwargs):
        return sizing.subprocess.CompletedProcess(args[0], 0, stdout=NVIDIA_SMI_NVLINK_SAMPLE, stderr="")

    monkeypatch.setattr(sizing.subprocess, "run", ok)
    assert query_nvlink_link_gbs() == [26.562, 26.562, 26.562, 25.0]


def test_query_nvlink_link_gbs_real():
    # Whatever the machine, the call must return and never raise.
    result = query_nvlink_link_gbs()
    assert result is None or (isinstance(result, list) and all(gbs > 0 for gbs in result))


# ---------------------------------------------------------------------------------------------------------------
# Buffer size hint
# ---------------------------------------------------------------------------------------------------------------


def test_buffer_size_hint_hand_computed():
    # DeepSeek-V3 shape, EP8, 4096 tokens, top-8, bf16: a region row is the data 7168 * 2 = 14336, the metadata
    # align16(8 + 8 * (4 + 4 + 8) = 136) = 144 (source index; per slot expert id, rank, weight) and a 16-byte tag:
    # 14496; two rows per (rank, token): 2 * 8 * 4096 * 14496 = 950009856; + 1 MiB = 951058432.
    assert get_buffer_size_hint(8, 4096, 7168, num_topk=8) == 951058432
    # FP8: 7168 + 56 * 4 = 7392 < 14336, so the bf16 row still decides the size.
    assert get_buffer_size_hint(8, 4096, 7168, num_topk=8, use_fp8_dispatch=True) == 951058432
    # 1-byte elements: the fp8 row (128 + 4 -> align16 = 144) beats 128; meta align16(8) = 16; tag 16; row 176.
    assert get_buffer_size_hint(2, 10, 128, use_fp8_dispatch=True, elem_size=1) == 2 * 2 * 10 * 176 + (1 << 20)
    # No tokens: only the control region.
    assert get_buffer_size_hint(4, 0, 4096, num_topk=8) == BUFFER_CONTROL_BYTES


@given(
    num_ranks=st.integers(1, 64),
    num_max_tokens_per_rank=st.integers(0, 8192),
    hidden_blocks=st.integers(1, 64),
    num_topk=st.integers(0, 16),
    use_fp8_dispatch=st.booleans(),
)
@settings(max_examples=200, deadline=None)
def test_buffer_size_hint_monotone(num_ranks, num_max_tokens_per_rank, hidden_blocks, num_topk, use_fp8_dispatch):
    hidden = hidden_blocks * 128
    kwargs = dict(num_topk=num_topk, use_fp8_dispatch=use_fp8_dispatch)
    base = get_buffer_size_hint(num_ranks, num_max_tokens_per_rank, hidden, **kwargs)
    assert base >= BUFFER_CONTROL_BYTES
    assert (base - BUFFER_CONTROL_BYTES) % 16 == 0
    assert get_buffer_size_hint(num_ranks + 1, num_max_tokens_per_rank, hidden, **kwargs) >= base
    assert get_buffer_size_hint(num_ranks, num_max_tokens_per_rank + 1, hidden, **kwargs) >= base
    assert get_buffer_size_hint(num_ranks, num_max_tokens_per_rank, hidden + 128, **kwargs) >= base
    assert get_buffer_size_hint(num_ranks, num_max_tokens_per_rank, hidden, num_topk + 1, use_fp8_dispatch) >= base
    # FP8 never shrinks the buffer: the bf16 row (dispatch or combine) still needs its room.
    assert get_buffer_size_hint(num_ranks, num_max_tokens_per_rank, hidden, num_topk, True) >= get_buffer_size_hint(
        num_ranks, num_max_tokens_per_rank, hidden, num_topk, False
    )
    # Linear in tokens and ranks.
    if num_max_tokens_per_rank > 0:
        double = get_buffer_size_hint(num_ranks, 2 * num_max_tokens_per_rank, hidden, **kwargs)
        assert double - BUFFER_CONTROL_BYTES == 2 * (base - BUFFER_CONTROL_BYTES)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((0, 128, 7168), {}, "num_ranks=0"),
        ((8, -1, 7168), {}, "num_max_tokens_per_rank=-1"),
        ((8, 128, 0), {}, "hidden=0"),
        ((8, 128, 7168), dict(num_topk=-1), "num_topk=-1"),
        ((8, 128, 7168), dict(elem_size=0), "elem_size=0"),
        ((8, 128, 7164), {}, "hidden=7164 \\* elem_size=2 = 14328 bytes is not a multiple of 16"),
        ((8, 128, 7176), dict(use_fp8_dispatch=True), "hidden=7176 is not a multiple of 128"),
    ],
)
def test_buffer_size_hint_validation(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_buffer_size_hint(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Time model
# ---------------------------------------------------------------------------------------------------------------

# Small hand-checkable rates: NVLink 100 GB/s (100e3 bytes/us), NIC 10 GB/s at efficiency 0.5 (5e3 bytes/us).
SMALL_LINKS = dict(nvlink_gbs=100.0, rdma_gbs=10.0)
SMALL_TIMING = dict(rdma_efficiency=0.5, op_latency_us=3.0, rdma_hop_latency_us=2.0)


def test_bytes_per_row():
    assert get_bytes_per_row(7168) == 14336
    # FP8: one byte per element and a 4-byte scale per 128: 7168 + 56 * 4.
    assert get_bytes_per_row(7168, use_fp8=True) == 7392
    # DeepEP V1's FP8 factor on the BF16 row.
    assert get_bytes_per_row(7168, use_fp8=True) == 14336 * (1 + 4 / 128) / 2
    assert get_bytes_per_row(100, elem_size=4) == 400
    with pytest.raises(ValueError, match="hidden=100 is not a multiple of 128"):
        get_bytes_per_row(100, use_fp8=True)
    with pytest.raises(ValueError, match="hidden=0"):
        get_bytes_per_row(0)


def test_time_hybrid_hand_computed():
    # 2 hosts x 2 ranks, 4 experts (one per rank), top-2, hidden 128 bf16 (256-byte rows), 1200 tokens per rank.
    # Et = 2 (every pick is another rank); Es = 2 * (1 - C(2, 2) / C(4, 2)) = 5/3.
    # RDMA: Es * (1 - 1/2) = 5/6 rows a token -> 1000 rows = 256000 bytes at 5e3 bytes/us = 51.2 us.
    # NVLink: Et * (1 - 1/2) = 1 row a token -> 307200 bytes at 100e3 bytes/us = 3.072 us.
    # Total: max(51.2, 3.072) + 3 + 2 = 56.2 us.
    topology = Topology(4, 2, 2, num_device_sms=H100_NUM_SMS, **SMALL_LINKS)
    est = estimate_time(topology, 4, 2, 1200, 128, **SMALL_TIMING)
    assert isinstance(est, TimeEstimate)
    assert (est.op, est.mode, est.bytes_per_row) == ("dispatch", "hybrid", 256)
    assert est.sms.expected_rank_groups == pytest.approx(2.0)
    assert est.sms.expected_scaleout_groups == pytest.approx(5 / 3)
    assert est.rdma_rows == pytest.approx(5 / 6)
    assert est.nvlink_rows == pytest.approx(1.0)
    assert est.rdma_bytes == pytest.approx(256000)
    assert est.nvlink_bytes == pytest.approx(307200)
    assert est.rdma_gbs == 5.0 and est.nvlink_gbs == 100.0
    assert est.rdma_us == pytest.approx(51.2)
    assert est.nvlink_us == pytest.approx(3.072)
    assert est.bottleneck == "rdma"
    assert est.latency_us == 5.0
    assert est.total_us == pytest.approx(56.2)
    # DeepEP's numerators: one row per distinct host, own included (1200 * 5/3 * 256), and every received row.
    assert est.logical_rdma_bytes == pytest.approx(512000)
    assert est.recv_bytes == pytest.approx(614400)
    assert est.logical_rdma_gbs == pytest.approx(512000 / 56200)
    assert est.wire_rdma_gbs == pytest.approx(256000 / 56200)
    assert est.logical_nvlink_gbs == pytest.approx(614400 / 56200)
    assert est.sms == estimate_num_sms(topology, 4, 2)
    assert "-> 56.2 us" in est.describe()

    # FP8 rows: 128 + 4 = 132 bytes: 132000 bytes over RDMA, 26.4 us, + 5.
    fp8 = estimate_time(topology, 4, 2, 1200, 128, use_fp8=True, **SMALL_TIMING)
    assert fp8.bytes_per_row == 132
    assert fp8.total_us == pytest.approx(31.4)

    # Combine with partial sums at the relay: the dispatch's rows, reversed.
    combine = estimate_time(topology, 4, 2, 1200, 128, "combine", **SMALL_TIMING)
    assert combine.op == "combine"
    assert (combine.rdma_bytes, combine.nvlink_bytes, combine.total_us) == pytest.approx((256000, 307200, 56.2))
    # Without: each remote rank's row crosses on its own, Et * (1 - 1/2) = 1 row a token: 307200 bytes, 61.44 us.
    unreduced = estimate_time(topology, 4, 2, 1200, 128, "combine", allow_multiple_reduction=False, **SMALL_TIMING)
    assert unreduced.rdma_rows == pytest.approx(1.0)
    assert unreduced.total_us == pytest.approx(61.44 + 5)
    # DeepEP's metric keeps its numerator (the dispatch's distinct hosts).
    assert unreduced.logical_rdma_bytes == pytest.approx(512000)


def test_time_direct_hand_computed():
    # 4 ranks, one NVLink domain, Et = 2: Et * 3/4 = 1.5 rows a token over NVLink; 1000 tokens of 256 bytes:
    # 384000 bytes, 3.84 us, + 3 us, and no network hop.
    nvlink_only = Topology(4, 4, num_device_sms=H100_NUM_SMS, **SMALL_LINKS)
    est = estimate_time(nvlink_only, 4, 2, 1000, 128, **SMALL_TIMING)
    assert est.mode == "direct" and est.bottleneck == "nvlink"
    assert est.sms.expected_scaleout_groups is None and est.logical_rdma_bytes is None
    assert est.logical_rdma_gbs is None
    assert est.rdma_rows == 0.0 and est.rdma_us == 0.0 and est.wire_rdma_gbs == 0.0
    assert est.nvlink_bytes == pytest.approx(384000)
    assert est.total_us == pytest.approx(3.84 + 3)

    # 4 ranks, NVLink pairs, no hybrid forwarding: 1 NVLink peer and 2 RDMA peers, each reached with p = Et/4 = 1/2.
    # NVLink 0.5 rows a token (128000 bytes, 1.28 us); RDMA 1 row (256000 bytes at 5e3 bytes/us, 51.2 us); + 3 + 2.
    pairs = Topology(4, 2, num_device_sms=H100_NUM_SMS, **SMALL_LINKS)
    est = estimate_time(pairs, 4, 2, 1000, 128, **SMALL_TIMING)
    assert (est.nvlink_rows, est.rdma_rows) == pytest.approx((0.5, 1.0))
    assert (est.nvlink_us, est.rdma_us) == pytest.approx((1.28, 51.2))
    assert est.bottleneck == "rdma"
    assert est.total_us == pytest.approx(56.2)
    # Direct mode has no partial sums: combine moves the same rows either way.
    for allow in (True, False):
        combine = estimate_time(pairs, 4, 2, 1000, 128, "combine", allow_multiple_reduction=allow, **SMALL_TIMING)
        assert combine.total_us == pytest.approx(56.2)


def test_time_single_rank_is_latency_only():
    est = estimate_time(Topology(1, 1), NUM_EXPERTS, NUM_TOPK, 4096, 7168)
    assert est.bottleneck == "none"
    assert est.nvlink_bytes == 0.0 and est.rdma_bytes == 0.0
    assert est.total_us == sizing.OP_LATENCY_US
    # Its own rows are received, without a link.
    assert est.recv_bytes == 4096 * 14336
    zero = estimate_time(Topology(1, 1), NUM_EXPERTS, NUM_TOPK, 0, 7168, op_latency_us=0.0)
    assert zero.total_us == 0.0 and zero.logical_nvlink_gbs == 0.0


def test_time_golden_hybrid_2x8_h100():
    # DeepEP V1's internode setting on H100 links: 4096 tokens, hidden 7168, top-8 of 256, FP8 dispatch.
    # A host is missed with probability C(128, 8) / C(256, 8), computed here as a product, independently of
    # expected_num_groups: Es = 2 * (1 - miss), RDMA rows Es / 2; 7392-byte rows at 0.9 * 50 GB/s, + 30 + 10 us.
    topology = Topology.from_links(16, 8, 2, link_gbs=H100_NVLINK_LINK_GBS, num_device_sms=H100_NUM_SMS)
    est = estimate_time(topology, NUM_EXPERTS, NUM_TOPK, 4096, 7168, use_fp8=True)
    miss = math.prod((128 - i) / (256 - i) for i in range(8))
    rdma_bytes = 4096 * (1 - miss) * 7392
    assert est.rdma_bytes == pytest.approx(rdma_bytes)
    assert est.rdma_us == pytest.approx(rdma_bytes / 45e3)
    assert est.bottleneck == "rdma"
    assert est.total_us == pytest.approx(rdma_bytes / 45e3 + 40)
    # DeepEP's RDMA GB/s counts both hosts' rows, twice the wire's.
    assert est.logical_rdma_gbs == pytest.approx(2 * est.wire_rdma_gbs)
    assert est.sms.num_sms == 12  # the golden SM count, beside the time


@given(_topologies(), st.integers(0, 8192), st.sampled_from([128, 1024, 7168]))
@settings(max_examples=200, deadline=None)
def test_time_properties(case, num_tokens, hidden):
    topology, num_experts, num_topk = case
    est = estimate_time(topology, num_experts, num_topk, num_tokens, hidden)
    sms = estimate_num_sms(topology, num_experts, num_topk)
    et = sms.expected_rank_groups
    assert est.sms == sms
    assert est.rdma_bytes == pytest.approx(num_tokens * est.rdma_rows * 2 * hidden)
    assert est.nvlink_bytes == pytest.approx(num_tokens * est.nvlink_rows * 2 * hidden)
    assert est.total_us == pytest.approx(max(est.nvlink_us, est.rdma_us) + est.latency_us)
    num_ranks = topology.num_ranks
    if topology.is_hybrid:
        # Over the network: the expected distinct remote hosts a token hits, times the row bytes.
        num_groups = topology.num_scaleout_groups
        es = expected_num_groups(num_experts, num_topk, num_groups)
        assert est.rdma_bytes == pytest.approx(num_tokens * (es - es / num_groups) * 2 * hidden)
        assert est.logical_rdma_bytes == pytest.approx(num_tokens * es * 2 * hidden)
        # Over NVLink: every copy but the relay's own.
        assert est.nvlink_rows == pytest.approx(et * (1 - num_groups / num_ranks))
    else:
        # A row per rank reached: NVLink peers but itself, the rest over RDMA.
        nvl = min(topology.num_nvl_ranks, num_ranks)
        assert est.nvlink_rows == pytest.approx(et * (nvl - 1) / num_ranks)
        assert est.rdma_rows == pytest.approx(et * (num_ranks - nvl) / num_ranks)
        if nvl == num_ranks:
            # One NVLink domain: the time is the NVLink leg and the fixed cost.
            assert est.rdma_bytes == 0.0
            assert est.total_us == pytest.approx(est.nvlink_us + sizing.OP_LATENCY_US)

    # More tokens never take less time, and take more once any row leaves the rank.
    more = estimate_time(topology, num_experts, num_topk, num_tokens + 64, hidden)
    if est.bottleneck == "none":
        assert more.total_us == est.total_us
    else:
        assert more.total_us > est.total_us
    # FP8 rows are smaller; partial sums never add network rows; with them, combine is the BF16 dispatch reversed.
    assert estimate_time(topology, num_experts, num_topk, num_tokens, hidden, use_fp8=True).total_us <= (
        est.total_us
    )
    reduced = estimate_time(topology, num_experts, num_topk, num_tokens, hidden, "combine")
    unreduced = estimate_time(topology, num_experts, num_topk, num_tokens, hidden, "combine",
                              allow_multiple_reduction=False)
    assert reduced.total_us == pytest.approx(est.total_us)
    assert reduced.rdma_bytes <= unreduced.rdma_bytes + 1e-6
    assert reduced.total_us <= unreduced.total_us + 1e-9


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_tokens=-1), "num_tokens=-1"),
        (dict(rdma_efficiency=0.0), "rdma_efficiency=0.0 must be in"),
        (dict(rdma_efficiency=1.5), "rdma_efficiency=1.5"),
        (dict(rdma_efficiency=float("nan")), "rdma_efficiency=nan"),
        (dict(op_latency_us=-1.0), "op_latency_us=-1.0"),
        (dict(rdma_hop_latency_us=float("nan")), "rdma_hop_latency_us=nan"),
        (dict(hidden=7100, use_fp8=True), "hidden=7100 is not a multiple of 128"),
        (dict(num_experts=100), "num_experts=100 is not a multiple of num_groups=16"),
        (dict(num_topk=0), "num_topk=0"),
        (dict(op="all_to_all"), "op='all_to_all' must be 'dispatch' or 'combine'"),
        (dict(op="combine", use_fp8=True), "combine is never FP8"),
    ],
)
def test_time_validation(kwargs, match):
    args = dict(topology=Topology(16, 8, 2), num_experts=NUM_EXPERTS, num_topk=NUM_TOPK, num_tokens=128, hidden=7168)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        estimate_time(**args)


# ---------------------------------------------------------------------------------------------------------------
# scripts/multinode_model.py: its tables are the model's numbers
# ---------------------------------------------------------------------------------------------------------------

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEEPEP_V1_CONFIG = dict(tokens=4096, hidden=7168, num_experts=NUM_EXPERTS, num_topk=NUM_TOPK)


@pytest.fixture(scope="module")
def multinode_model():
    spec = importlib.util.spec_from_file_location("multinode_model", ROOT / "scripts" / "multinode_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_multinode_model_tables(multinode_model):
    tables = multinode_model.build_tables(DEEPEP_V1_CONFIG)
    model = tables["model"]
    # Every GPU x scale x op, but "no partial sums" only where there is a relay to sum at (hybrid).
    expected = {(gpu, ep, op) for gpu in ("H100", "H200") for ep in ("EP8", "EP16", "EP32")
                for op in ("dispatch BF16", "dispatch FP8", "combine", "combine, no partial sums")
                if not (ep == "EP8" and op == "combine, no partial sums")}
    assert {(r["gpu"], r["ep"], r["op"]) for r in model} == expected
    num_hosts = {"EP8": 1, "EP16": 2, "EP32": 4}
    for r in model:
        topology = Topology.from_links(8 * num_hosts[r["ep"]], 8, num_hosts[r["ep"]], link_gbs=H100_NVLINK_LINK_GBS)
        args = (topology, NUM_EXPERTS, NUM_TOPK, 4096, 7168)
        if r["op"].startswith("dispatch"):
            est = estimate_time(*args, use_fp8=r["op"] == "dispatch FP8")
        else:
            est = estimate_time(*args, "combine", allow_multiple_reduction=r["op"] == "combine")
        assert (r["rdma_bytes"], r["nvlink_bytes"], r["total_us"]) == (est.rdma_bytes, est.nvlink_bytes, est.total_us)
        assert (r["rdma_us"], r["nvlink_us"], r["latency_us"]) == (est.rdma_us, est.nvlink_us, est.latency_us)
        assert r["logical_rdma_gbs"] == est.logical_rdma_gbs and r["wire_rdma_gbs"] == est.wire_rdma_gbs
        assert r["num_sms"] == get_num_sms(topology, NUM_EXPERTS, NUM_TOPK)
    # The golden SM counts, and DeepEP V1's published figures beside the rows DeepEP measured.
    by_key = {(r["gpu"], r["ep"], r["op"]): r for r in model}
    assert by_key[("H100", "EP16", "combine")]["num_sms"] == 12
    assert by_key[("H100", "EP32", "combine")]["num_sms"] == 6
    assert by_key[("H200", "EP16", "dispatch FP8")]["deepep_v1_gbs"] == 43
    assert by_key[("H200", "EP32", "dispatch FP8")]["deepep_v1_gbs"] == 58
    assert by_key[("H200", "EP32", "combine")]["deepep_v1_gbs"] == 57
    assert by_key[("H200", "EP16", "dispatch BF16")]["deepep_v1_gbs"] is None
    # H100 and H200 share NVLink 4 and 132 SMs: the same numbers.
    for (gpu, ep, op), r in by_key.items():
        if gpu == "H100":
            assert {k: v for k, v in r.items() if k != "gpu"} == {
                k: v for k, v in by_key[("H200", ep, op)].items() if k != "gpu"}

    # On DeepEP V1's H800 (NVLink 160 GB/s as its README states), EP16 is NVLink-bound, EP32 RDMA-bound.
    v1 = {(r["gpu"], r["ep"], r["op"]): r for r in tables["deepep_v1"]}
    assert v1[("H800", "EP16", "dispatch FP8")]["bottleneck"] == "nvlink"
    assert v1[("H800", "EP32", "dispatch FP8")]["bottleneck"] == "rdma"
    # The published logical figure on the wire: the remote share of the hosts, 1 - 1/S.
    assert v1[("H800", "EP32", "dispatch FP8")]["published_wire_gbs"] == pytest.approx(58 * 3 / 4)
    # Direct mode across hosts: a row per remote rank reached instead of one per remote host.
    direct, hybrid = tables["direct_over_rdma"][:2]
    assert (direct["mode"], hybrid["mode"]) == ("direct", "hybrid")
    assert direct["rdma_bytes"] == pytest.approx(4096 * expected_num_groups(NUM_EXPERTS, NUM_TOPK, 16) / 2 * 14336)
    assert direct["total_us"] > 3 * hybrid["total_us"]

    meta = dict(commit="0" * 40, dirty=False, date_utc="2026-12-01T00:00:00+00:00", python="3.11", hostname="h",
                command="python scripts/multinode_model.py")
    text = multinode_model.render_markdown(DEEPEP_V1_CONFIG, tables, meta, "multinode-model_analytical_x.png")
    assert "no multi-host run was possible" in text
    assert "| H200 | EP16 | dispatch FP8 |" in text and "| H100 | EP32 | combine, no partial sums |" in text
    assert "python scripts/multinode_model.py" in text and "commit 000000000000;" in text


def test_multinode_model_committed_record_is_current(multinode_model):
    # benchmarks/multinode-model_analytical_<date>.json holds what the model gives today for its config: regenerate
    # it (`python scripts/multinode_model.py`, then delete the older files) whenever the model changes.
    [path] = sorted((ROOT / "benchmarks").glob("multinode-model_analytical_*.json"))
    record = json.loads(path.read_text())
    tables = multinode_model.build_tables(record["config"])
    for name, rows in tables.items():
        assert record[name] == rows, name
    assert record["meta"]["command"].endswith("scripts/multinode_model.py")
    assert re.fullmatch(r"[0-9a-f]{40}", record["meta"]["commit"])
