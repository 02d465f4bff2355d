"""The network traffic class of a buffer (`Buffer(sl_idx=...)`, DeepEP V2's name): the InfiniBand
service level (SL) that the traffic between hosts travels on, so a cluster's QoS can keep expert-parallel
traffic apart from data-parallel traffic.

Where NCCL takes it from (NCCL's IB transport; see the README's "Traffic class" for sources):
1. `NCCL_IB_SL` (and `NCCL_IB_TC` for the RoCE traffic class) when set: it wins over everything else;
2. else the communicator's traffic class (`ncclConfig_t.trafficClass`), which PyTorch built with NCCL >= 2.26
   exposes as `torch.distributed.ProcessGroupNCCL.Options().config.traffic_class` (read when the group's
   communicators are made, so it is fixed by whoever creates the group);
3. else NCCL's default.

The reference backend sends over the caller's process group (one communicator, point-to-point); the CUDA backend's
hybrid path makes two subgroups of it per rank (its host, its rail) with the caller's group's traffic class
(`subgroup_options`: a `new_group` does not inherit it). So a `Buffer` cannot choose the level; it checks, on every
rank, that NCCL will use `sl_idx`, and otherwise raises a `ValueError` that says which setting disagrees and how to
set it. Setting the
variable from Python would not help: NCCL reads it once per process, usually before the buffer exists.
gloo (the CPU tier) sends over TCP, which has no service level: there `sl_idx` is only validated.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

ENV_SL = "NCCL_IB_SL"
MAX_SL_IDX = 15          # the SL field of an InfiniBand packet is 4 bits wide
NCCL_CONFIG_UNDEF_INT = -2 ** 31  # ncclConfig_t's "unset" value (INT_MIN)


def check_sl_idx(sl_idx) -> None:
    """TypeError/ValueError unless `sl_idx` is None or an int in `[0, MAX_SL_IDX]`."""
    if sl_idx is None:
        return
    if isinstance(sl_idx, bool) or not isinstance(sl_idx, int):
        raise TypeError(f"sl_idx must be an int or None, got {sl_idx!r} ({type(sl_idx).__name__})")
    if not 0 <= sl_idx <= MAX_SL_IDX:
        raise ValueError(f"sl_idx={sl_idx} must be an InfiniBand service level in [0, {MAX_SL_IDX}] (or None: "
                         f"leave NCCL's setting alone)")


def group_traffic_class(group: dist.ProcessGroup, device: torch.device) -> Optional[int]:
    """The traffic class in the NCCL options of `group`: an int (`NCCL_CONFIG_UNDEF_INT` when unset), or None
    when this PyTorch build does not expose the field (built with NCCL older than 2.26, or without NCCL)."""
    try:
        return int(group._get_backend(device).options.config.traffic_class)
    except (AttributeError, RuntimeError, TypeError):
        return None


def why_not_applied(sl_idx: int, env_sl: Optional[str], group_class: Optional[int]) -> Optional[str]:
    """Why NCCL would not put the traffic on `sl_idx`, or None when it will.

    Arguments:
        sl_idx: the requested service level.
        env_sl: the raw value of `NCCL_IB_SL` (None: unset).
        group_class: `group_traffic_class` of the group.
    """
    if env_sl is not None:
        try:
            value = int(env_sl.strip())
        except ValueError:
            return f"{ENV_SL}={env_sl!r} is not an integer"
        if value != sl_idx:
            return f"{ENV_SL}={value} is set and takes precedence over any communicator setting"
        return None
    if group_class is None:
        return (f"{ENV_SL} is unset and this PyTorch build does not expose NCCL's communicator traffic class "
                f"(ProcessGroupNCCL.Options().config.traffic_class, PyTorch built with NCCL >= 2.26); export "
                f"{ENV_SL}={sl_idx} in every rank's launch environment")
    if group_class == NCCL_CONFIG_UNDEF_INT:
        return (f"neither {ENV_SL} nor the group's traffic class is set, so NCCL uses its default; create the "
                f"group with pg_options whose config.traffic_class = {sl_idx}, or export {ENV_SL}={sl_idx} in "
                f"every rank's launch environment")
    if group_class != sl_idx:
        return (f"the group's NCCL options set config.traffic_class={group_class}; create the group with "
                f"config.traffic_class = {sl_idx}, or pass sl_idx={group_class}")
    return None


def subgroup_options(group: dist.ProcessGroup, device: torch.device):
    """NCCL options for a subgroup of `group` that keep its traffic class (a fresh `Options`, not the group's own,
    which `new_group` would overwrite with the subgroup's ranks), or None: not NCCL, or no class set."""
    if device.type != "cuda" or "nccl" not in str(dist.get_backend(group)).lower():
        return None
    traffic_class = group_traffic_class(group, device)
    if traffic_class is None or traffic_class == NCCL_CONFIG_UNDEF_INT:
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.config.traffic_class = traffic_class
    return options


def check_applied(group: dist.ProcessGroup, device: torch.device, sl_idx: Optional[int]) -> None:
    """ValueError unless NCCL will carry `group`'s traffic on `sl_idx` (this rank's view; no communication).
    Nothing to check for None or a non-NCCL group."""
    if sl_idx is None or device.type != "cuda":
        return
    why = why_not_applied(sl_idx, os.environ.get(ENV_SL), group_traffic_class(group, device))
    if why is not None:
        raise ValueError(f"sl_idx={sl_idx} does not reach NCCL: {why}")


__all__ = ["ENV_SL", "MAX_SL_IDX", "NCCL_CONFIG_UNDEF_INT", "check_applied", "check_sl_idx", "group_traffic_class",
           "subgroup_options", "why_not_applied"]
