"""Analytical model of DeepEP V2 for expert-parallel dispatch/combine (DESIGN 2.4). (Over 400 lines: one model
whose every intermediate number is exposed and documented, for tests and explanation.)

Pure functions: no GPU, no torch, no imports from the rest of `moe_comm` but `moe_comm.layout` (the buffer's
layout, itself pure), so the model can be used from a launcher script, a config validator or a notebook before
any process group exists.

The model assumes a balanced gate: every token picks `num_topk` distinct experts uniformly at random, and
experts are laid out contiguously, `num_experts / num_ranks` per rank. Traffic is counted per token as a
fraction of one token's bytes; a link that moves `T` token-fractions per token at `B` GB/s sustains `B / T`
token-GB/s, and the SM count is what it takes to read and write at that rate.

Pieces:
- `expected_num_groups`: expected distinct groups (of equal, contiguous expert groups) one token hits.
- `Topology`: ranks, NVLink domain, scale-out groups and link rates; `nvlink_gbs_from_links`,
  `parse_nvidia_smi_nvlink`, `query_nvlink_link_gbs` fill the NVLink rate from `nvidia-smi nvlink -s`.
- `estimate_num_sms` / `get_num_sms`: the SM count (and, for explanation, every intermediate number).
- `get_num_qps`: DeepEP V2's RDMA queue-pair rule.
- `get_buffer_size_hint`: bytes of the symmetric buffer (layout documented on the function).
"""

import math
import re
import shutil
import subprocess
from dataclasses import dataclass
from fractions import Fraction

from . import layout

# Hardware defaults, per direction. NVLink 4 (H100/H200) runs 18 links at 26.5625 GB/s, NVLink 5 (B200)
# 18 links at 50 GB/s; `nvidia-smi nvlink -s` reports the same per-link numbers.
H100_NVLINK_LINK_GBS: tuple[float, ...] = (26.5625,) * 18
H200_NVLINK_LINK_GBS: tuple[float, ...] = H100_NVLINK_LINK_GBS
B200_NVLINK_LINK_GBS: tuple[float, ...] = (50.0,) * 18
# Protocol and packet overheads keep NVLink payload throughput at about 90 % of the link rate.
NVLINK_EFFICIENCY = 0.9

H100_NUM_SMS = 132
H200_NUM_SMS = 132
B200_NUM_SMS = 148

# What one SM can move: reads are cheap (many loads in flight), writes to remote memory are the limit.
SM_READ_GBS = 200.0
SM_WRITE_GBS = 50.0

# One 400 Gb/s NIC per GPU is the common scale-out build (ConnectX-7).
DEFAULT_NIC_GBITS = 400.0
DEFAULT_RDMA_GBS = DEFAULT_NIC_GBITS / 8

# Never launch fewer SMs than this: below it, per-SM issue latency rather than bandwidth dominates.
MIN_NUM_SMS = 4
# Headroom over the bandwidth-derived count, for imbalance and the notify/control work.
NUM_SMS_HEADROOM = 1.25
# DeepEP V2's direct-mode QP cap: past this, more QPs only add doorbell ringing.
MAX_DIRECT_NUM_QPS = 9

NVIDIA_SMI_TIMEOUT_S = 5.0

# Bytes of the control region (counters, flags, control slots) at the start of the buffer.
BUFFER_CONTROL_BYTES = layout.CONTROL_BYTES
# FP8 dispatch carries one fp32 scale per block of this many hidden elements.
FP8_SCALE_BLOCK = 128


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name}={value} must be positive")


def _check_non_negative(**values: int) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name}={value} must be non-negative")


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def expected_num_groups(num_experts: int, num_topk: int, num_groups: int) -> float:
    """Expected number of distinct expert groups one token's top-k selection hits.

    The experts are split into `num_groups` equal contiguous groups (a group is a rank, or a scale-out
    group of ranks). With a uniformly random set of `num_topk` distinct experts, a given group is missed
    with probability `C(E - E/G, K) / C(E, K)`, so the expectation is `G * (1 - C(E - E/G, K) / C(E, K))`.

    Arguments:
        num_experts: total number of experts `E`, a multiple of `num_groups`.
        num_topk: experts selected per token `K`, `0 <= K <= E`.
        num_groups: number of equal groups `G`.

    Returns:
        The expectation, in `[min(K, 1), min(K, G)]`; `0.0` when `num_topk == 0`.
    """
    _check_positive(num_experts=num_experts, num_groups=num_groups)
    _check_non_negative(num_topk=num_topk)
    if num_topk > num_experts:
        raise ValueError(f"{num_topk=} exceeds {num_experts=}")
    if num_experts % num_groups != 0:
        raise ValueError(f"{num_experts=} is not a multiple of {num_groups=}")
    if num_topk == 0:
        return 0.0

    # The binomials overflow float for realistic E (C(256, 8) is ~4e14, C(1024, 64) far past 1e308),
    # so keep the ratio exact and round once.
    num_experts_per_group = num_experts // num_groups
    miss = Fraction(math.comb(num_experts - num_experts_per_group, num_topk), math.comb(num_experts, num_topk))
    return float(num_groups * (1 - miss))


def nvlink_gbs_from_links(link_gbs: list[float]) -> float:
    """Usable per-direction NVLink bandwidth of one GPU from its per-link rates.

    Arguments:
        link_gbs: per-link GB/s of the active links (as `nvidia-smi nvlink -s` prints them).

    Returns:
        `NVLINK_EFFICIENCY` (0.9) times the sum, in GB/s.
    """
    for link_idx, gbs in enumerate(link_gbs):
        if not gbs >= 0:
            raise ValueError(f"link_gbs[{link_idx}]={gbs} must be a non-negative number")
    return NVLINK_EFFICIENCY * sum(link_gbs)


def rdma_gbs_from_nic_gbits(nic_gbits: float) -> float:
    """Usable per-rank RDMA bandwidth from the NIC line rate.

    Arguments:
        nic_gbits: NIC rate in Gb/s (bits), one NIC per rank.

    Returns:
        The rate in GB/s (`nic_gbits / 8`).
    """
    if not nic_gbits > 0:
        raise ValueError(f"{nic_gbits=} must be positive")
    return nic_gbits / 8


_GPU_HEADER_RE = re.compile(r"^\s*GPU\s+(\d+)\s*:")
_LINK_RATE_RE = re.compile(r"^\s*Link\s+\d+\s*:\s*([0-9]+(?:\.[0-9]*)?)\s*GB/s", re.IGNORECASE)


def parse_nvidia_smi_nvlink(text: str, gpu_idx: int = 0) -> list[float]:
    """Per-link rates of one GPU from the output of `nvidia-smi nvlink -s`.

    The output is a `GPU <idx>: <name> (UUID: ...)` header per GPU followed by one `Link <i>: <rate> GB/s`
    line per link; links that are down print `<inactive>` and are skipped.

    Arguments:
        text: the command's stdout.
        gpu_idx: which GPU's block to read (GPU 0: every GPU of a node is wired the same way).

    Returns:
        GB/s of each active link of that GPU, in link order; empty if the GPU or its active links are absent.
    """
    link_gbs: list[float] = []
    in_block = False
    for line in text.splitlines():
        header = _GPU_HEADER_RE.match(line)
        if header is not None:
            if in_block:
                break
            in_block = int(header.group(1)) == gpu_idx
            continue
        if in_block:
            rate = _LINK_RATE_RE.match(line)
            if rate is not None:
                link_gbs.append(float(rate.group(1)))
    return link_gbs


def query_nvlink_link_gbs() -> list[float] | None:
    """Per-link NVLink rates of GPU 0 on this machine, if `nvidia-smi` can tell.

    Optional by design: the model takes rates as parameters, so a missing or hung `nvidia-smi` (containers,
    CPU machines, a wedged driver) must never fail the caller.

    Returns:
        GB/s of each active link of GPU 0, or `None` if `nvidia-smi` is absent, fails, times out, or reports
        no active link.
    """
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return None
    try:
        result = subprocess.run(
            [executable, "nvlink", "-s"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    if result.returncode != 0:
        return None
    link_gbs = parse_nvidia_smi_nvlink(result.stdout)
    return link_gbs or None


@dataclass(frozen=True)
class Topology:
    """Where an expert-parallel group's ranks sit and how fast they can talk.

    Two modes, as in DeepEP V2:
    - direct (`num_scaleout_groups == 1`): every rank writes straight to every peer; the first
      `min(num_nvl_ranks, num_ranks)` ranks (itself included) are reached over NVLink, the rest over RDMA;
    - hybrid (`num_scaleout_groups > 1`): `S` scale-out groups of `U = num_ranks / S` NVLink-connected ranks;
      a token crosses RDMA once per remote group it needs and is forwarded inside the group over NVLink.

    Arguments:
        num_ranks: ranks in the expert-parallel group.
        num_nvl_ranks: NVLink domain size, counting the rank itself (8 on an HGX node, 72 on NVL72).
        num_scaleout_groups: `S`; 1 means no hybrid forwarding.
        nvlink_gbs: usable per-direction NVLink GB/s of one GPU, efficiency factor already applied
            (see `nvlink_gbs_from_links`).
        rdma_gbs: usable per-rank RDMA GB/s (see `rdma_gbs_from_nic_gbits`).
        num_device_sms: SMs on one GPU.
    """

    num_ranks: int
    num_nvl_ranks: int
    num_scaleout_groups: int = 1
    nvlink_gbs: float = NVLINK_EFFICIENCY * sum(H200_NVLINK_LINK_GBS)
    rdma_gbs: float = DEFAULT_RDMA_GBS
    num_device_sms: int = H200_NUM_SMS

    def __post_init__(self) -> None:
        _check_positive(
            num_ranks=self.num_ranks,
            num_nvl_ranks=self.num_nvl_ranks,
            num_scaleout_groups=self.num_scaleout_groups,
            num_device_sms=self.num_device_sms,
        )
        # `not x > 0` also rejects NaN.
        if not self.nvlink_gbs > 0:
            raise ValueError(f"nvlink_gbs={self.nvlink_gbs} must be positive")
        if not self.rdma_gbs > 0:
            raise ValueError(f"rdma_gbs={self.rdma_gbs} must be positive")
        if self.num_ranks % self.num_scaleout_groups != 0:
            raise ValueError(
                f"num_ranks={self.num_ranks} is not a multiple of num_scaleout_groups={self.num_scaleout_groups}"
            )
        if self.is_hybrid and self.num_ranks_per_scaleout_group > self.num_nvl_ranks:
            raise ValueError(
                f"hybrid scale-out groups of {self.num_ranks_per_scaleout_group} ranks "
                f"(num_ranks={self.num_ranks} / num_scaleout_groups={self.num_scaleout_groups}) "
                f"do not fit in the NVLink domain of num_nvl_ranks={self.num_nvl_ranks}"
            )

    @classmethod
    def from_links(
        cls,
        num_ranks: int,
        num_nvl_ranks: int,
        num_scaleout_groups: int = 1,
        link_gbs: list[float] | tuple[float, ...] = H200_NVLINK_LINK_GBS,
        nic_gbits: float = DEFAULT_NIC_GBITS,
        num_device_sms: int = H200_NUM_SMS,
    ) -> "Topology":
        """Build a topology from raw per-link NVLink rates and the NIC line rate.

        Arguments:
            num_ranks, num_nvl_ranks, num_scaleout_groups, num_device_sms: as on the class.
            link_gbs: per-link NVLink GB/s (e.g. `query_nvlink_link_gbs()` or `B200_NVLINK_LINK_GBS`).
            nic_gbits: NIC rate in Gb/s.

        Returns:
            The `Topology`.
        """
        return cls(
            num_ranks=num_ranks,
            num_nvl_ranks=num_nvl_ranks,
            num_scaleout_groups=num_scaleout_groups,
            nvlink_gbs=nvlink_gbs_from_links(list(link_gbs)),
            rdma_gbs=rdma_gbs_from_nic_gbits(nic_gbits),
            num_device_sms=num_device_sms,
        )

    @property
    def is_hybrid(self) -> bool:
        return self.num_scaleout_groups > 1

    @property
    def num_ranks_per_scaleout_group(self) -> int:
        """`U`: ranks per scale-out group (all ranks in direct mode)."""
        return self.num_ranks // self.num_scaleout_groups

    @property
    def num_direct_nvl_ranks(self) -> int:
        """`nvl` of the direct-mode model: ranks of this group reachable over NVLink, itself included.

        An NVLink domain larger than the group (EP2 on an 8-GPU node) only offers the group's own ranks.
        """
        return min(self.num_nvl_ranks, self.num_ranks)


@dataclass(frozen=True)
class SmEstimate:
    """Every number behind `get_num_sms`, so a log line or a benchmark table can explain the choice.

    Traffic fields are per dispatched token, as fractions of one token's bytes.

    Arguments:
        mode: `"direct"` or `"hybrid"`.
        expected_rank_groups: `Et = E(num_ranks)`, distinct ranks a token reaches.
        expected_scaleout_groups: `Es = E(S)` in hybrid mode, else `None`.
        sm_read: bytes the SMs read.
        sm_write: bytes the SMs write.
        nvlink: bytes crossing this rank's NVLink.
        rdma: bytes crossing this rank's NIC.
        bottleneck: `"nvlink"`, `"rdma"`, or `"none"` when nothing leaves the rank.
        bottleneck_gbs: `B`, GB/s of the bottleneck link (0 when none).
        bottleneck_traffic: `T`, traffic fraction on it (0 when none).
        num_sms_needed: `n`, the bandwidth-derived SM count before headroom and rounding (0 when none).
        num_sms: the SM count to launch with.
    """

    mode: str
    expected_rank_groups: float
    expected_scaleout_groups: float | None
    sm_read: float
    sm_write: float
    nvlink: float
    rdma: float
    bottleneck: str
    bottleneck_gbs: float
    bottleneck_traffic: float
    num_sms_needed: float
    num_sms: int

    def describe(self) -> str:
        """One line for logs: mode, traffic, bottleneck and the resulting SM count."""
        return (
            f"{self.mode}: sm_read={self.sm_read:.3f} sm_write={self.sm_write:.3f} nvlink={self.nvlink:.3f} "
            f"rdma={self.rdma:.3f} bottleneck={self.bottleneck} ({self.bottleneck_gbs:.1f} GB/s) "
            f"n={self.num_sms_needed:.2f} -> num_sms={self.num_sms}"
        )


def estimate_num_sms(topology: Topology, num_experts: int, num_topk: int) -> SmEstimate:
    """DeepEP V2's SM count for dispatch/combine, with the intermediate numbers (DESIGN 2.4).

    Traffic per token, as fractions of one token's bytes, with `Et = E(num_ranks)`:
    - direct, `nvl` NVLink-reachable ranks: `sm_read = 1/Et`; `sm_write = nvl/num_ranks (+ 1/Et if any RDMA
      peer)`; `nvlink = nvl/num_ranks * (1 - 1/nvl)`; `rdma = (num_ranks - nvl)/num_ranks`;
    - hybrid, `Es = E(S)`: `sm_read = 1/Et + Es/Et`; `sm_write = 1/Et + (1/Et)(Es/S) + 1`;
      `rdma = (1/Et) * Es * (1 - 1/S)`; `nvlink = 1 - 1/U`.
    The bottleneck is the link with the larger time `traffic / GB/s`, ties going to NVLink. DESIGN states
    the RDMA check for hybrid mode only; we apply the same comparison in direct mode with RDMA peers too,
    because there the NIC is just as real a limit (and usually the tighter one: 50 GB/s against ~430).
    Then `n = max(B/T * sm_read / 200, B/T * sm_write / 50)` and
    `num_sms = min(num_device_sms, align2(max(4, ceil(1.25 n))))`. A rank that sends nothing over any link
    (one rank, or one NVLink rank with nothing remote) gets all SMs: there is no bandwidth to size for.

    Arguments:
        topology: the ranks and link rates.
        num_experts: total experts, a multiple of `topology.num_ranks`.
        num_topk: experts per token, `1 <= num_topk <= num_experts`.

    Returns:
        An `SmEstimate`; its `num_sms` is what `get_num_sms` returns.
    """
    _check_positive(num_topk=num_topk)
    num_ranks = topology.num_ranks
    # Validates num_experts against num_ranks (and so against S, which divides num_ranks).
    expected_rank_groups = expected_num_groups(num_experts, num_topk, num_ranks)
    inv_et = 1.0 / expected_rank_groups

    expected_scaleout_groups: float | None
    if topology.is_hybrid:
        mode = "hybrid"
        num_groups = topology.num_scaleout_groups
        expected_scaleout_groups = expected_num_groups(num_experts, num_topk, num_groups)
        sm_read = inv_et + expected_scaleout_groups * inv_et
        sm_write = inv_et + inv_et * (expected_scaleout_groups / num_groups) + 1.0
        rdma = inv_et * expected_scaleout_groups * (1.0 - 1.0 / num_groups)
        nvlink = 1.0 - 1.0 / topology.num_ranks_per_scaleout_group
    else:
        mode = "direct"
        expected_scaleout_groups = None
        nvl = topology.num_direct_nvl_ranks
        has_rdma_peer = nvl < num_ranks
        sm_read = inv_et
        sm_write = nvl / num_ranks + (inv_et if has_rdma_peer else 0.0)
        nvlink = nvl / num_ranks * (1.0 - 1.0 / nvl)
        rdma = (num_ranks - nvl) / num_ranks

    # Pick the link that takes longer per token; everything else is sized to keep it busy.
    if rdma / topology.rdma_gbs > nvlink / topology.nvlink_gbs:
        bottleneck, bottleneck_gbs, bottleneck_traffic = "rdma", topology.rdma_gbs, rdma
    else:
        bottleneck, bottleneck_gbs, bottleneck_traffic = "nvlink", topology.nvlink_gbs, nvlink

    if bottleneck_traffic <= 0.0:
        # The larger of two non-negative times is zero, so neither link carries anything: use every SM.
        bottleneck, bottleneck_gbs, bottleneck_traffic = "none", 0.0, 0.0
        num_sms_needed, num_sms = 0.0, topology.num_device_sms
    else:
        # At full link speed the rank moves B/T token-GB/s; the SMs must read and write at that rate.
        token_gbs = bottleneck_gbs / bottleneck_traffic
        num_sms_needed = max(token_gbs * sm_read / SM_READ_GBS, token_gbs * sm_write / SM_WRITE_GBS)
        num_sms = _align(max(MIN_NUM_SMS, math.ceil(NUM_SMS_HEADROOM * num_sms_needed)), 2)
        num_sms = min(topology.num_device_sms, num_sms)
    return SmEstimate(
        mode=mode,
        expected_rank_groups=expected_rank_groups,
        expected_scaleout_groups=expected_scaleout_groups,
        sm_read=sm_read,
        sm_write=sm_write,
        nvlink=nvlink,
        rdma=rdma,
        bottleneck=bottleneck,
        bottleneck_gbs=bottleneck_gbs,
        bottleneck_traffic=bottleneck_traffic,
        num_sms_needed=num_sms_needed,
        num_sms=num_sms,
    )


def get_num_sms(topology: Topology, num_experts: int, num_topk: int) -> int:
    """SMs to give dispatch/combine so the bottleneck link stays saturated (see `estimate_num_sms`).

    Arguments:
        topology: the ranks and link rates.
        num_experts: total experts, a multiple of `topology.num_ranks`.
        num_topk: experts per token, `1 <= num_topk <= num_experts`.

    Returns:
        The SM count: even, at least 4 and at most `topology.num_device_sms`, or all device SMs when no
        traffic leaves the rank (or the device has fewer than 4).
    """
    return estimate_num_sms(topology, num_experts, num_topk).num_sms


def get_num_qps(num_sms: int, hybrid: bool, num_allocated_qps: int) -> int:
    """RDMA queue pairs to use per peer, DeepEP V2's rule. Informational when every peer is on NVLink.

    Arguments:
        num_sms: SMs the kernel runs on.
        hybrid: whether the topology uses hybrid (scale-out group) forwarding.
        num_allocated_qps: QPs the transport created; the result never exceeds it.

    Returns:
        Direct mode: `min(num_sms, 9)`, since past a few QPs more only adds doorbell ringing.
        Hybrid mode: `num_sms * 16 + 1`, one QP per channel (16 per SM) plus one for the notify phase.
        Either way capped at `num_allocated_qps`.
    """
    _check_positive(num_sms=num_sms, num_allocated_qps=num_allocated_qps)
    num_qps = num_sms * 16 + 1 if hybrid else min(num_sms, MAX_DIRECT_NUM_QPS)
    return min(num_qps, num_allocated_qps)


def get_buffer_size_hint(
    num_ranks: int,
    num_max_tokens_per_rank: int,
    hidden: int,
    num_topk: int = 0,
    use_fp8_dispatch: bool = False,
    elem_size: int = 2,
) -> int:
    """Bytes of the per-rank symmetric buffer for dispatch and combine.

    What the layout holds (`moe_comm.layout`): the control region (`BUFFER_CONTROL_BYTES`), then a receive region
    of two rows per (rank, token): a dispatch fills one (a block of `num_max_tokens_per_rank` rows per source rank);
    an expand combine returns a token's rows, one per slot, in rounds of as many slots as the region holds, so the
    second row halves its rounds (each round is a kernel with its barrier). A row is laid out by
    `layout.dispatch_row`: the row data
    (`hidden * elem_size` bytes, or with `use_fp8_dispatch` FP8 data plus one fp32 scale per 128 elements,
    whichever is wider), padded to 16; the metadata (int64 source index, per slot an int32 local expert id, an
    int32 rank and a weight of up to 8 bytes), padded to 16; a 16-byte tag. A combine row (data and weights) is
    never wider; an expand combine moves in rounds of as many slots as the region holds.

    Arguments:
        num_ranks: ranks in the expert-parallel group.
        num_max_tokens_per_rank: the most tokens any rank dispatches in one call.
        hidden: hidden size; `hidden * elem_size` must be a multiple of 16, and `hidden` a multiple of 128
            with `use_fp8_dispatch`.
        num_topk: experts per token (0 for a buffer that carries no routing metadata).
        use_fp8_dispatch: whether dispatch sends fp8 data with fp32 block scales.
        elem_size: bytes per element of the unquantized activations (2 for bf16).

    Returns:
        The size in bytes.
    """
    _check_positive(num_ranks=num_ranks, hidden=hidden, elem_size=elem_size)
    _check_non_negative(num_max_tokens_per_rank=num_max_tokens_per_rank, num_topk=num_topk)
    # Rows are copied with 16-byte vector loads/stores; an unaligned row would need a scalar tail.
    if hidden * elem_size % 16 != 0:
        raise ValueError(f"{hidden=} * {elem_size=} = {hidden * elem_size} bytes is not a multiple of 16")
    if use_fp8_dispatch and hidden % FP8_SCALE_BLOCK != 0:
        raise ValueError(f"{hidden=} is not a multiple of {FP8_SCALE_BLOCK} as FP8 dispatch requires")

    row_bytes = layout.dispatch_row(hidden * elem_size, 0, num_topk, 8).stride
    if use_fp8_dispatch:
        row_bytes = max(row_bytes, layout.dispatch_row(hidden, (hidden // FP8_SCALE_BLOCK) * 4, num_topk, 8).stride)
    return 2 * num_ranks * num_max_tokens_per_rank * row_bytes + BUFFER_CONTROL_BYTES
