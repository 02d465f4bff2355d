"""Analytical model of DeepEP V2 for expert-parallel dispatch/combine (DESIGN 2.4), and a time model on the same
expectations. (Over 400 lines: one model whose every intermediate number is exposed and documented, for tests and
explanation.)

Pure functions: no GPU, no torch, no imports from the rest of `moe_comm` but `moe_comm.layout` (the buffer's
layout, itself pure) and `moe_comm.args` (argument checks), so the model can be used from a launcher script, a
config validator or a notebook before any process group exists.

The model assumes a balanced gate: every token picks `num_topk` distinct experts uniformly at random, and
experts are laid out contiguously, `num_experts / num_ranks` per rank. Traffic is counted per token as a
fraction of one token's bytes; a link that moves `T` token-fractions per token at `B` GB/s sustains `B / T`
token-GB/s, and the SM count is what it takes to read and write at that rate.

Pieces:
- `expected_num_groups`: expected distinct groups (of equal, contiguous expert groups) one token hits.
- `Topology`: ranks, NVLink domain, scale-out groups and link rates; `nvlink_gbs_from_links`,
  `parse_nvidia_smi_nvlink`, `query_nvlink_link_gbs` fill the NVLink rate from `nvidia-smi nvlink -s`.
- `estimate_num_sms` / `get_num_sms`: the SM count (and, for explanation, every intermediate number).
- `estimate_time`: bytes per GPU on NVLink and RDMA, the time of each leg at the link rates and of a dispatch or
  combine (`TimeEstimate`), from the same expectations; `get_bytes_per_row`.
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
from .args import check_int

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

# Time model (`estimate_time`). Share of the NIC's line rate that carries rows: DeepEP V2's README reports
# 90 GB/s (EP 8x2) and 61 GB/s (EP 8x4) of "logical" RDMA bandwidth per GPU on 400 Gb/s CX7, counting the rows for
# the sender's own host; (1 - 1/S) of those cross the NIC: 45 and 45.75 GB/s of a 50 GB/s line.
RDMA_EFFICIENCY = 0.9
# Fixed cost of one dispatch or combine inside a host (launch, count exchange, completion): moe_comm's cached dispatch
# and combine took 33 and 37 us back to back at 128 tokens on 2x H200, of which about 4 us is their rows at NVLink
# speed (benchmarks/dispatch-combine_h200x2_2026-11-30-run2.md).
OP_LATENCY_US = 30.0
# Added when rows cross the network; an assumption, not measured (no second host here): the NVLink leg waits for the
# first chunk (16 BF16 rows of 7168, DeepEP V1's RDMA chunk, take 5.1 us at 45 GB/s), plus a few us of NIC latency and
# completion signalling.
RDMA_HOP_LATENCY_US = 10.0

# Bytes of the control region (counters, flags, control slots) at the start of the buffer.
BUFFER_CONTROL_BYTES = layout.CONTROL_BYTES
# FP8 dispatch carries one fp32 scale per block of this many hidden elements.
FP8_SCALE_BLOCK = 128


def _check_positive(**values: int) -> None:
    check_int(1, **values)


def _check_non_negative(**values: int) -> None:
    check_int(0, **values)


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
        # `not 0 < x < inf` also rejects NaN.
        if not 0 < self.nvlink_gbs < math.inf:
            raise ValueError(f"nvlink_gbs={self.nvlink_gbs} must be positive and finite")
        if not 0 < self.rdma_gbs < math.inf:
            raise ValueError(f"rdma_gbs={self.rdma_gbs} must be positive and finite")
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
        fan_out: rows written into the outputs per received row: `K / Et` for the expand layout (a row per (token,
            local expert)), 1 otherwise.
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
    fan_out: float
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
            f"{self.mode}: sm_read={self.sm_read:.3f} sm_write={self.sm_write:.3f} "
            + (f"(expand fan-out {self.fan_out:.2f}) " if self.fan_out != 1.0 else "")
            + f"nvlink={self.nvlink:.3f} "
            f"rdma={self.rdma:.3f} bottleneck={self.bottleneck} ({self.bottleneck_gbs:.1f} GB/s) "
            f"n={self.num_sms_needed:.2f} -> num_sms={self.num_sms}"
        )


def estimate_num_sms(topology: Topology, num_experts: int, num_topk: int, do_expand: bool = False) -> SmEstimate:
    """DeepEP V2's SM count for dispatch/combine, with the intermediate numbers (DESIGN 2.4), and the expand
    layout's fan-out.

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

    Expand layout (not in DeepEP's model): a received row is written once per local expert it goes to, `K / Et` on
    average, so the term of the rows written into the outputs (`nvl/num_ranks` direct, the trailing `1` hybrid)
    counts `K / Et` times. Without it the model sizes an expand dispatch for its link and the receivers' stores
    become the limit: at EP2, top-8 of 256 the fan-out is ~4 rows per received row, 22 SMs -> 88; measured per SM,
    a fan-out stores 53-61 GB/s on an H200, the model's 50 with its 1.25 headroom
    (benchmarks/fanout-floor_h200x1_2026-12-02.md). Left out: the hop of a remote row into the receive region
    before its fan-out (one store more per row, within the headroom) and, in direct mode with RDMA peers, the
    fan-out of the rows that arrive over the network (the term counts the NVLink ranks' rows, as without expand).

    Arguments:
        topology: the ranks and link rates.
        num_experts: total experts, a multiple of `topology.num_ranks`.
        num_topk: experts per token, `1 <= num_topk <= num_experts`.
        do_expand: size for the expand layout's dispatch (and its combine, which reads what it wrote).

    Returns:
        An `SmEstimate`; its `num_sms` is what `get_num_sms` returns.
    """
    _check_positive(num_topk=num_topk)
    num_ranks = topology.num_ranks
    # Validates num_experts against num_ranks (and so against S, which divides num_ranks).
    expected_rank_groups = expected_num_groups(num_experts, num_topk, num_ranks)
    inv_et = 1.0 / expected_rank_groups
    fan_out = num_topk * inv_et if do_expand else 1.0

    expected_scaleout_groups: float | None
    if topology.is_hybrid:
        mode = "hybrid"
        num_groups = topology.num_scaleout_groups
        expected_scaleout_groups = expected_num_groups(num_experts, num_topk, num_groups)
        sm_read = inv_et + expected_scaleout_groups * inv_et
        sm_write = inv_et + inv_et * (expected_scaleout_groups / num_groups) + fan_out
        rdma = inv_et * expected_scaleout_groups * (1.0 - 1.0 / num_groups)
        nvlink = 1.0 - 1.0 / topology.num_ranks_per_scaleout_group
    else:
        mode = "direct"
        expected_scaleout_groups = None
        nvl = topology.num_direct_nvl_ranks
        has_rdma_peer = nvl < num_ranks
        sm_read = inv_et
        sm_write = nvl / num_ranks * fan_out + (inv_et if has_rdma_peer else 0.0)
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
        fan_out=fan_out,
        nvlink=nvlink,
        rdma=rdma,
        bottleneck=bottleneck,
        bottleneck_gbs=bottleneck_gbs,
        bottleneck_traffic=bottleneck_traffic,
        num_sms_needed=num_sms_needed,
        num_sms=num_sms,
    )


def get_num_sms(topology: Topology, num_experts: int, num_topk: int, do_expand: bool = False) -> int:
    """SMs to give dispatch/combine so the bottleneck link stays saturated (see `estimate_num_sms`).

    Arguments:
        topology: the ranks and link rates.
        num_experts: total experts, a multiple of `topology.num_ranks`.
        num_topk: experts per token, `1 <= num_topk <= num_experts`.
        do_expand: for the expand layout (its receivers' fan-out counted).

    Returns:
        The SM count: even, at least 4 and at most `topology.num_device_sms`, or all device SMs when no
        traffic leaves the rank (or the device has fewer than 4).
    """
    return estimate_num_sms(topology, num_experts, num_topk, do_expand).num_sms


# ---------------------------------------------------------------------------------------------------------------
# Time model: bytes per link class and the time of one dispatch or combine
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimeEstimate:
    """Every number behind one modeled dispatch or combine time (see `estimate_time`).

    Rows are per token of the sending rank; bytes are per GPU for the whole operation and per direction: with a
    balanced gate and every rank sending `num_tokens`, each GPU receives on a link class what it sends on it
    (derivation on `estimate_time`), so one number covers out and in. Times are in microseconds; 1 GB/s moves
    1e3 bytes per microsecond. The fields are the model's inputs and expectations; the properties derive the rest.

    Arguments:
        op: `"dispatch"` or `"combine"`.
        num_tokens: `N`, tokens each rank dispatches (combine: gets back).
        bytes_per_row: `b`, payload bytes of one row (`get_bytes_per_row`).
        nvlink_rows: rows one token puts on NVLink.
        rdma_rows: rows one token puts on the network.
        nvlink_gbs: rate of the NVLink leg (`topology.nvlink_gbs`, its efficiency already applied).
        rdma_gbs: rate of the network leg, `topology.rdma_gbs * rdma_efficiency`.
        bottleneck: the leg with the larger time per token (`"nvlink"` on a tie), `"none"` when no row leaves the rank.
        latency_us: the fixed term: `op_latency_us`, plus `rdma_hop_latency_us` when rows cross the network.
        sms: the SM model's estimate for the topology (`estimate_num_sms`): the mode, `Et = E(num_ranks)`
            distinct ranks and, in hybrid mode, `Es = E(S)` distinct hosts a token reaches, and the SM count.
    """

    op: str
    num_tokens: int
    bytes_per_row: int
    nvlink_rows: float
    rdma_rows: float
    nvlink_gbs: float
    rdma_gbs: float
    bottleneck: str
    latency_us: float
    sms: SmEstimate

    @property
    def mode(self) -> str:
        """`"direct"` or `"hybrid"`, as the topology."""
        return self.sms.mode

    @property
    def nvlink_bytes(self) -> float:
        """`N * nvlink_rows * b`, sent (and received) over NVLink by each GPU."""
        return self.num_tokens * self.nvlink_rows * self.bytes_per_row

    @property
    def rdma_bytes(self) -> float:
        """`N * rdma_rows * b`, sent (and received) over the network by each GPU."""
        return self.num_tokens * self.rdma_rows * self.bytes_per_row

    @property
    def nvlink_us(self) -> float:
        """The NVLink leg: `nvlink_bytes / nvlink_gbs`."""
        return self.nvlink_bytes / (self.nvlink_gbs * 1e3)

    @property
    def rdma_us(self) -> float:
        """The network leg: `rdma_bytes / rdma_gbs`."""
        return self.rdma_bytes / (self.rdma_gbs * 1e3)

    @property
    def total_us(self) -> float:
        """The legs overlap, so the slower one counts: `max(nvlink_us, rdma_us) + latency_us`."""
        return max(self.nvlink_us, self.rdma_us) + self.latency_us

    @property
    def recv_bytes(self) -> float:
        """`N * Et * b`, rows each rank receives in a dispatch and sends back in a combine (its own rows included):
        the numerator of DeepEP's NVLink GB/s (`recv_x` bytes)."""
        return self.num_tokens * self.sms.expected_rank_groups * self.bytes_per_row

    @property
    def logical_rdma_bytes(self) -> float | None:
        """`N * Es * b` in hybrid mode, one row per distinct destination host with the sender's own host included:
        the numerator of DeepEP's RDMA GB/s (V1 `tests/test_internode.py`; V2's README calls it "logical
        bandwidth"); `None` in direct mode."""
        if self.sms.expected_scaleout_groups is None:
            return None
        return self.num_tokens * self.sms.expected_scaleout_groups * self.bytes_per_row

    def _gbs(self, num_bytes: float) -> float:
        # A zero time (no latency and no link bytes) gives 0 GB/s for nothing moved, else an unbounded rate.
        if self.total_us > 0.0:
            return num_bytes / (self.total_us * 1e3)
        return 0.0 if num_bytes == 0.0 else math.inf

    @property
    def logical_rdma_gbs(self) -> float | None:
        """DeepEP's RDMA GB/s: `logical_rdma_bytes / total_us` (`None` in direct mode)."""
        return None if self.logical_rdma_bytes is None else self._gbs(self.logical_rdma_bytes)

    @property
    def wire_rdma_gbs(self) -> float:
        """Bytes that cross this GPU's NIC per second: `rdma_bytes / total_us`."""
        return self._gbs(self.rdma_bytes)

    @property
    def wire_nvlink_gbs(self) -> float:
        """Bytes that cross this GPU's NVLink per second: `nvlink_bytes / total_us`."""
        return self._gbs(self.nvlink_bytes)

    @property
    def logical_nvlink_gbs(self) -> float:
        """DeepEP's NVLink GB/s: `recv_bytes / total_us`."""
        return self._gbs(self.recv_bytes)

    def describe(self) -> str:
        """One line for logs: op, bytes per leg, leg times, bottleneck and the total."""
        return (
            f"{self.mode} {self.op}: N={self.num_tokens} b={self.bytes_per_row} "
            f"nvlink={self.nvlink_bytes / 1e6:.2f} MB ({self.nvlink_us:.1f} us) "
            f"rdma={self.rdma_bytes / 1e6:.2f} MB ({self.rdma_us:.1f} us) "
            f"bottleneck={self.bottleneck} + {self.latency_us:.1f} us -> {self.total_us:.1f} us"
        )


def get_bytes_per_row(hidden: int, use_fp8: bool = False, elem_size: int = 2) -> int:
    """Payload bytes of one token's row on a link.

    The metadata that travels with a row (source index, top-k ids and weights: about 100 bytes at top-8, under 1 %
    of a 7168-wide row) is not counted, as DeepEP's bandwidth figures do not count it.

    Arguments:
        hidden: hidden size; a multiple of 128 with `use_fp8`.
        use_fp8: FP8 rows: one byte per element and one 4-byte scale per 128 elements (fp8_block128 and mxfp8 alike,
            DESIGN 2.3), i.e. DeepEP V1's `(1 + 4 / 128) / 2` of the BF16 row.
        elem_size: bytes per element of an unquantized row (2 for BF16).

    Returns:
        `hidden * elem_size`, or `hidden + 4 * hidden / 128` with `use_fp8`.
    """
    _check_positive(hidden=hidden, elem_size=elem_size)
    if not use_fp8:
        return hidden * elem_size
    if hidden % FP8_SCALE_BLOCK != 0:
        raise ValueError(f"{hidden=} is not a multiple of {FP8_SCALE_BLOCK} as FP8 rows require")
    return hidden + 4 * (hidden // FP8_SCALE_BLOCK)


def estimate_time(
    topology: Topology,
    num_experts: int,
    num_topk: int,
    num_tokens: int,
    hidden: int,
    op: str = "dispatch",
    *,
    use_fp8: bool = False,
    allow_multiple_reduction: bool = True,
    rdma_efficiency: float = RDMA_EFFICIENCY,
    op_latency_us: float = OP_LATENCY_US,
    rdma_hop_latency_us: float = RDMA_HOP_LATENCY_US,
) -> TimeEstimate:
    """Modeled time of one dispatch or (non-expand) combine, with the bytes on each link class and every
    intermediate number.

    Dispatch. Assumptions (the SM model's balanced gate, plus what a time needs):
    - every rank dispatches `N = num_tokens` tokens, each to `num_topk` distinct experts drawn uniformly, experts
      laid out contiguously; so a token reaches `Et = E(num_ranks)` distinct ranks and, in hybrid mode,
      `Es = E(S)` distinct hosts (`expected_num_groups`), every rank (host) equally likely;
    - direct mode: a token's row goes straight to each rank it reaches: `Et * (nvl - 1) / num_ranks` rows per token
      over NVLink, `Et * (num_ranks - nvl) / num_ranks` over RDMA (`nvl` = `topology.num_direct_nvl_ranks`);
    - hybrid mode (`S` hosts of `U` ranks): a row crosses the network once per remote host it needs, to the rank of
      the same local index there (its rail), which forwards it over NVLink to the ranks of its host that need it:
      `Es * (1 - 1/S)` rows per token over RDMA, `Et * (1 - 1/U)` over NVLink (every copy but the relay's own);
    - each GPU receives what it sends, per link class: in hybrid mode the `S - 1` same-index GPUs of the other
      hosts each send a row with probability `Es / S`, `(S - 1) * Es / S` in all; rows for a rank cross NVLink
      unless their source shares the rank's local index (probability `1/U`); direct mode likewise per peer;
    - links: NVLink at `topology.nvlink_gbs` per direction, one NIC per GPU at `topology.rdma_gbs * rdma_efficiency`
      (rail-optimized fabric, no congestion, no other traffic); NVLink and the NIC are separate, so the legs overlap
      (chunks pipelined through them) and the slower one sets the time;
    - the SMs (`estimate_num_sms`, sized to keep the bottleneck busy) and HBM never limit, the copy into the
      receive buffer and the relay's own row included;
    - a fixed `op_latency_us` per operation (launch, count exchange, completion), and `rdma_hop_latency_us` more when
      rows cross the network (the NIC's latency and the pipeline's fill before the NVLink leg can start).
    Not modeled: gate imbalance and group-limited routing, the count exchange's size, metadata bytes, congestion
    and adaptive routing, NCCL's proxy and chunking, the host's issue time.

    Combine: the dispatch's rows sent back, BF16 (never FP8, DESIGN 2.3), and summed at the source; the same
    assumptions in reverse. Hybrid mode with `allow_multiple_reduction` (DESIGN 8.3): the rows of a token's expert
    ranks on one host are summed at that host's relay (the rank of the source's local index), which sends one
    partial row back over the network: the dispatch's rows on every link. Without it (what keeps the result bitwise
    the direct path's, DESIGN 8.3): no partial sums, each remote expert rank's row crosses on its own,
    `Et * (1 - 1/S)` rows per token over RDMA. Direct mode has no partial sums. The reductions (at the relay and the
    final one at the source) are HBM work and not modeled.

    Then `total_us = max(nvlink_bytes / nvlink_gbs, rdma_bytes / rdma_gbs) + latency_us`.

    Arguments:
        topology: the ranks and link rates.
        num_experts: total experts, a multiple of `topology.num_ranks`.
        num_topk: experts per token, `1 <= num_topk <= num_experts`.
        num_tokens: tokens each rank dispatches (combine: gets back), `>= 0`.
        hidden: hidden size (a multiple of 128 with `use_fp8`).
        op: `"dispatch"` or `"combine"`.
        use_fp8: dispatch FP8 rows with fp32 block scales (`get_bytes_per_row`), else BF16; dispatch only.
        allow_multiple_reduction: whether relays send partial sums (combine in hybrid mode; else no effect).
        rdma_efficiency: share of `topology.rdma_gbs` that carries rows, in `(0, 1]`.
        op_latency_us: fixed cost of one operation, `>= 0`.
        rdma_hop_latency_us: added when rows cross the network, `>= 0`.

    Returns:
        A `TimeEstimate`.
    """
    if op not in ("dispatch", "combine"):
        raise ValueError(f"{op=} must be 'dispatch' or 'combine'")
    if op == "combine" and use_fp8:
        raise ValueError("use_fp8=True: combine is never FP8 (its sums need BF16 rows)")
    bytes_per_row = get_bytes_per_row(hidden, use_fp8)
    _check_non_negative(num_tokens=num_tokens)
    # `not 0 < x <= 1` also rejects NaN.
    if not 0.0 < rdma_efficiency <= 1.0:
        raise ValueError(f"{rdma_efficiency=} must be in (0, 1]")
    for name, value in (("op_latency_us", op_latency_us), ("rdma_hop_latency_us", rdma_hop_latency_us)):
        if not value >= 0.0:
            raise ValueError(f"{name}={value} must be a non-negative number")
    # The SM model's per-copy traffic, times Et copies a token, gives the rows on each link (see above); it also
    # validates num_experts and num_topk against the topology.
    sms = estimate_num_sms(topology, num_experts, num_topk)
    nvlink_rows = sms.nvlink * sms.expected_rank_groups
    rdma_rows = sms.rdma * sms.expected_rank_groups
    if op == "combine" and topology.is_hybrid and not allow_multiple_reduction:
        # No partial sum at the relay: each remote expert rank's row crosses on its own.
        rdma_rows = sms.expected_rank_groups * (1.0 - 1.0 / topology.num_scaleout_groups)

    rdma_gbs = topology.rdma_gbs * rdma_efficiency
    if rdma_rows / rdma_gbs > nvlink_rows / topology.nvlink_gbs:
        bottleneck = "rdma"
    else:
        bottleneck = "nvlink" if nvlink_rows > 0.0 else "none"
    return TimeEstimate(
        op=op,
        num_tokens=num_tokens,
        bytes_per_row=bytes_per_row,
        nvlink_rows=nvlink_rows,
        rdma_rows=rdma_rows,
        nvlink_gbs=topology.nvlink_gbs,
        rdma_gbs=rdma_gbs,
        bottleneck=bottleneck,
        latency_us=op_latency_us + (rdma_hop_latency_us if rdma_rows > 0.0 else 0.0),
        sms=sms,
    )


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
    use_recv_hook: bool = False,
) -> int:
    """Bytes of the per-rank symmetric buffer for dispatch and combine.

    What the layout holds (`moe_comm.layout`): the control region (`BUFFER_CONTROL_BYTES`), then a receive region
    of two rows per (rank, token): a dispatch fills one (a block of `num_max_tokens_per_rank` rows per source rank);
    an expand combine with partial sums (the Buffer's default) returns one row per (token, peer), an FP32 sum with
    the token's weights, which the two rows always hold; in DESIGN 2.2's slot order (`deterministic=True`) it
    returns a token's rows, one per slot, into a block per peer (a rank's own rows stay in its x),
    in rounds of as many slots as the region holds, so the second row at least halves its rounds (each round is a
    kernel with its barrier, and the FP32 accumulator of every token goes through memory between rounds): with
    DeepSeek-V3's rows, 4 slots per round at EP2 (top-8: 2 rounds), 3 at EP3, 2 from EP4 on (4 rounds). A row is
    laid out by
    `layout.dispatch_row`: the row data
    (`hidden * elem_size` bytes, or with `use_fp8_dispatch` FP8 data plus one fp32 scale per 128 elements,
    whichever is wider), padded to 16; the metadata (int64 source index, per slot an int32 local expert id, an
    int32 rank and a weight of up to 8 bytes), padded to 16; a 16-byte tag. A combine row of the rows' dtype is
    never wider; a partial-sum row (FP32 data, K weights) may be, up to twice, which two rows per (rank, token) hold;
    an expand combine in the slot order moves in rounds of as many slots as the region holds.

    Arguments:
        num_ranks: ranks in the expert-parallel group.
        num_max_tokens_per_rank: the most tokens any rank dispatches in one call.
        hidden: hidden size; `hidden * elem_size` must be a multiple of 16, and `hidden` a multiple of 128
            with `use_fp8_dispatch`.
        num_topk: experts per token (0 for a buffer that carries no routing metadata).
        use_fp8_dispatch: whether dispatch sends fp8 data with fp32 block scales.
        elem_size: bytes per element of the unquantized activations (2 for bf16).
        use_recv_hook: room for an expand combine of one round, a row per (peer, token, slot) (`combine(...,
            return_recv_hook=True)` cannot split rounds): with DeepSeek-V3's rows at EP2, top-8, twice the default.

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
    region = 2 * num_ranks * num_max_tokens_per_rank * row_bytes
    if use_recv_hook:
        one_round = layout.combine_row(hidden * elem_size, 1, 8).stride * min(num_topk, layout.MAX_ROUND_SLOTS)
        region = max(region, (num_ranks - 1) * num_max_tokens_per_rank * one_round)
    return region + BUFFER_CONTROL_BYTES
