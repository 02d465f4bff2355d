"""Every `MOE_COMM_*` environment variable, in one registry with typed getters.

The README mirrors `VARIABLES` as a table (`python -c "import moe_comm.env as e; print(e.describe())"`).
Booleans accept `1/true/yes/on` and `0/false/no/off` (case-insensitive);
anything else raises, so `MOE_COMM_CHECK_INPUTS=0` means false rather than "set, hence true".
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class Variable:
    name: str
    kind: str  # "bool" | "int" | "float" | "str"
    default: object
    doc: str


VARIABLES = {
    v.name: v
    for v in (
        Variable("MOE_COMM_CHECK_INPUTS", "bool", False,
                 "Check topk_idx values (range, duplicates) and the ranks' agreement on the host before any "
                 "communication, on every call, including calls without a CPU sync (costs a host sync). Read when "
                 "a `Buffer` is made: set it the same on every rank before then."),
        Variable("MOE_COMM_TEST_SEED", "int", 0,
                 "Seed of the randomized property tests (the cases are drawn in the parent process)."),
        Variable("MOE_COMM_GPU_RANKS", "int", 0,
                 "Ranks of the GPU test tier (one GPU each); 0 = every GPU of the machine, at most 8."),
        Variable("MOE_COMM_TEST_TIMEOUT", "float", 60.0,
                 "Collective timeout in seconds for the test launcher's process groups."),
        Variable("MOE_COMM_JIT_CACHE_DIR", "str", "~/.cache/moe_comm",
                 "Root of the on-disk cache of JIT-built kernel libraries and the host extension (one "
                 "`<name>-<hash16>/` folder per build, plus its `.lock` file); `~` is expanded, a relative path is "
                 "taken from each process's working directory. Ranks that share it need `flock` on it (a local "
                 "disk, or a shared one mounted with locks)."),
        Variable("MOE_COMM_JIT_VERBOSE", "bool", False,
                 "Print one line to stderr per JIT build (with its seconds) or cache hit."),
        Variable("MOE_COMM_RANKS_PER_NODE", "int", None,
                 "Ranks per host, in place of the detection at `Buffer` construction (host names and peer access): "
                 "the job's ranks `r // n` (torch.distributed's world ranks, as torchrun numbers them) form one host, "
                 "and a group's ranks are split by that, so one machine can run the hybrid (multi-host) path in "
                 "tests. Must be positive, divide the world size and be the same on every rank; unset: detected."),
        Variable("MOE_COMM_COMMIT", "str", "",
                 "The commit benchmark results record when the run's copy of the tree has no or a stale git history "
                 "(a device machine's copy); empty: read it from git."),
    )
}


def _raw(name: str) -> str | None:
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a registered moe_comm variable; known: {sorted(VARIABLES)}")
    return os.environ.get(name)


def get_bool(name: str) -> bool:
    raw = _raw(name)
    if raw is None:
        return bool(VARIABLES[name].default)
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean; use one of {_TRUE + _FALSE[:-1]}")


def _get_number(name: str, convert, what: str):
    raw = _raw(name)
    if raw is None:
        default = VARIABLES[name].default
        return None if default is None else convert(default)
    try:
        return convert(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not {what}") from None


def get_int(name: str) -> int | None:
    """The variable as an int; its default when unset (None for a variable whose default is "unset")."""
    return _get_number(name, int, "an integer")


def get_float(name: str) -> float:
    return _get_number(name, float, "a number")


def get_str(name: str) -> str:
    raw = _raw(name)
    return str(VARIABLES[name].default) if raw is None else raw


def describe() -> str:
    """The registry as a markdown table (the README's copy is generated from this)."""
    lines = ["| variable | type | default | meaning |", "| --- | --- | --- | --- |"]
    for v in VARIABLES.values():
        default = "unset" if v.default is None else f"`{v.default}`"
        lines.append(f"| `{v.name}` | {v.kind} | {default} | {v.doc} |")
    return "\n".join(lines)
