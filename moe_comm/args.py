"""Argument checks shared by `Buffer` and its primitives: TypeError for a wrong type, ValueError for a value out of
range, each naming the argument and its value."""

from __future__ import annotations


def check_bool(**values) -> None:
    for name, value in values.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")


def check_int(minimum: int, **values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
        if value < minimum:
            raise ValueError(f"{name}={value} must be >= {minimum}")


def check_group(group) -> None:
    """`group` of a static size hint: a process group, or None for the default one."""
    import torch.distributed as dist  # here: `moe_comm.sizing` imports this module and no torch

    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
