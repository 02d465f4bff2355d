"""Scale-up domains of a process group: the ranks of one host that reach each other by peer memory (DESIGN 8.3).

`Buffer` finds them once, at construction, which is collective anyway: every rank reports
- its host name;
- on CUDA its GPU's UUID, the UUIDs of the GPUs it sees and of those it reaches by peer access (NVLink or PCIe
  P2P);
- its `MOE_COMM_RANKS_PER_NODE`, parsed (or why it does not parse),
and one `all_gather_object` hands every report to every rank. Every rank then decides from the same reports, so
every rank gets the same domains or the same `ValueError`.

Ranks of one host whose GPUs reach each other both ways (or share a GPU) are one domain; the closure of that
relation, so a host whose GPUs form two NVLink islands is two domains. A GPU that a rank cannot see (one visible GPU
per rank) counts as reached. CPU ranks of one host share its memory: one
domain per host. `MOE_COMM_RANKS_PER_NODE=n` replaces the detection: the ranks `r // n` of the job (r the rank in
torch.distributed's world, as torchrun numbers them) form a host, so a subgroup's ranks are split by the host they
sit on, as the detection splits them (tests of the hybrid path on one machine).

The hybrid path needs uniform domains: equal sizes and consecutive ranks (rank r in domain `r // U`), which is how
`torchrun --nnodes S --nproc-per-node U` numbers its ranks.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from . import env

OVERRIDE = "MOE_COMM_RANKS_PER_NODE"


@dataclass(frozen=True)
class Report:
    """What one rank tells the others about itself (it travels through `all_gather_object`).

    host: host name. gpu: the GPU's UUID, None on CPU. peers: UUIDs of the GPUs it reaches by peer access.
    visible: UUIDs of every GPU it sees (`CUDA_VISIBLE_DEVICES`), its own included.
    override: its `MOE_COMM_RANKS_PER_NODE` (None: unset), or `override_error`: why the value does not parse.
    rank / world: its rank in torch.distributed's world and the world's size (None: the group is the world), which
    the override splits into hosts.
    """

    host: str
    gpu: Optional[str] = None
    peers: tuple[str, ...] = ()
    visible: tuple[str, ...] = ()
    override: Optional[int] = None
    override_error: Optional[str] = None
    rank: Optional[int] = None
    world: Optional[int] = None


@dataclass(frozen=True)
class ScaleUpDomains:
    """The scale-up domains of a group.

    domain_of_rank: domain index of every rank (domains numbered in the order of their first rank).
    source: how they were found: "detected" or "MOE_COMM_RANKS_PER_NODE=n".
    """

    domain_of_rank: tuple[int, ...]
    source: str

    @property
    def num_ranks(self) -> int:
        return len(self.domain_of_rank)

    @property
    def num_domains(self) -> int:
        return max(self.domain_of_rank) + 1

    @property
    def sizes(self) -> list[int]:
        """Ranks per domain, in domain order."""
        return [self.domain_of_rank.count(d) for d in range(self.num_domains)]

    @property
    def num_ranks_per_domain(self) -> int:
        """Ranks of the largest domain (of every domain when uniform)."""
        return max(self.sizes)

    @property
    def is_uniform(self) -> bool:
        """Equal domains of consecutive ranks: rank r is in domain `r // num_ranks_per_domain`."""
        size = self.num_ranks_per_domain
        return all(d == r // size for r, d in enumerate(self.domain_of_rank)) and self.num_ranks % size == 0

    def describe(self) -> str:
        """E.g. `2 x 4 ranks (MOE_COMM_RANKS_PER_NODE=4)` or `3 domains of sizes [2, 2, 4] (detected)`."""
        if self.is_uniform:
            return f"{self.num_domains} x {self.num_ranks_per_domain} ranks ({self.source})"
        return f"{self.num_domains} domains of sizes {self.sizes}, ranks per domain {list(self.domain_of_rank)} " \
               f"({self.source})"


def local_report(device: torch.device) -> Report:
    """This rank's `Report` (no communication)."""
    gpu, peers, visible = None, (), ()
    if device.type == "cuda":
        me = device.index
        gpu = str(torch.cuda.get_device_properties(me).uuid)
        visible = tuple(str(torch.cuda.get_device_properties(d).uuid) for d in range(torch.cuda.device_count()))
        peers = tuple(uuid for d, uuid in enumerate(visible) if d != me and torch.cuda.can_device_access_peer(me, d))
    where = dict(rank=dist.get_rank(), world=dist.get_world_size()) if dist.is_initialized() else {}
    try:
        return Report(socket.gethostname(), gpu, peers, visible, override=env.get_int(OVERRIDE), **where)
    except ValueError as exc:
        return Report(socket.gethostname(), gpu, peers, visible, override_error=str(exc), **where)


def domains_from_reports(reports: list[Report]) -> ScaleUpDomains:
    """Every rank's `Report` to the group's domains; ValueError for a bad or disagreeing override."""
    num_ranks = len(reports)
    bad = [r for r, rep in enumerate(reports) if rep.override_error is not None]
    if bad:
        world = reports[0].world or num_ranks
        raise ValueError(f"{reports[bad[0]].override_error} (on rank(s) {bad}); set it to a positive number of "
                         f"ranks per host that divides the job's {world} ranks, or unset it to detect hosts")
    overrides = [rep.override for rep in reports]
    if len(set(overrides)) > 1:
        raise ValueError(f"{OVERRIDE} differs between ranks (per rank, None = unset): {overrides}")
    n = overrides[0]
    if n is not None:
        if n <= 0:
            raise ValueError(f"{OVERRIDE}={n} must be a positive number of ranks per host")
        # Hosts are blocks of n ranks of the job (torchrun's numbering), not of the group: a subgroup (an
        # expert-parallel group beside data parallelism) is split by the host each of its ranks sits on.
        if any(rep.rank is None for rep in reports):
            job_ranks, world = list(range(num_ranks)), num_ranks
        else:
            job_ranks, world = [rep.rank for rep in reports], reports[0].world
        if world % n:
            what = f"the group's {num_ranks} ranks" if world == num_ranks else f"the job's {world} ranks"
            raise ValueError(f"{OVERRIDE}={n} does not divide {what} into hosts")
        hosts: dict[int, int] = {}
        return ScaleUpDomains(tuple(hosts.setdefault(r // n, len(hosts)) for r in job_ranks),
                              f"{OVERRIDE}={n}")

    # Union-find over pairs of ranks that share a host and reach each other's memory.
    parent = list(range(num_ranks))

    def root(r: int) -> int:
        while parent[r] != r:
            r = parent[r]
        return r

    for a in range(num_ranks):
        for b in range(a + 1, num_ranks):
            ra, rb = reports[a], reports[b]
            if ra.host == rb.host and _share_memory(ra, rb):
                parent[max(root(a), root(b))] = min(root(a), root(b))
    numbering: dict[int, int] = {}
    domain_of_rank = tuple(numbering.setdefault(root(r), len(numbering)) for r in range(num_ranks))
    return ScaleUpDomains(domain_of_rank, "detected")


def _share_memory(a: Report, b: Report) -> bool:
    if a.gpu is None or b.gpu is None:
        return a.gpu is None and b.gpu is None  # CPU ranks of one host

    def reaches(x: Report, y: Report) -> bool:
        # A GPU the rank cannot see (launchers that give every rank one visible GPU) cannot be asked about: it is
        # taken as reachable, as on the direct path, where the symmetric buffer's mapping is the test.
        return y.gpu in x.peers or y.gpu not in x.visible

    return a.gpu == b.gpu or (reaches(a, b) and reaches(b, a))


def find_domains(group: dist.ProcessGroup, device: torch.device) -> ScaleUpDomains:
    """Collective over `group`: the domains, the same on every rank (or the same ValueError on every rank)."""
    reports: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, local_report(device), group=group)
    return domains_from_reports(reports)


__all__ = ["Report", "ScaleUpDomains", "domains_from_reports", "find_domains", "local_report"]
