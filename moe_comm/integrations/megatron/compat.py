"""What the integration needs from megatron-core, checked once at import, and one fix of a 0.16.1 bug.

`check_megatron_core()` finds every Megatron symbol the integration imports (`REQUIRED_SYMBOLS`; a test keeps
the table in step with the import statements) and raises an ImportError naming the first one missing and the
installed megatron-core version, or saying megatron-core is not installed and how to install it.

`define_missing_te_names()` works around megatron-core 0.16.1 without Transformer Engine: the failed TE import
in `transformer/moe/moe_utils.py` leaves `te_general_gemm` and the `fused_*` names undefined, so the router's
`RouterGatingLinearFunction.forward` (`if te_general_gemm is not None`) raises NameError, on GPUs as on CPU.
0.17+ sets those names to None itself; this does the same where they are missing.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from packaging.version import Version

MIN_VERSION = "0.16"
CHECKED_VERSIONS = ("0.16.1", "0.19.2")
INSTALL_HINT = "pip install 'moe_comm[megatron]'"

# Module -> names the integration imports from it (or reads from it at run time: route B's patched functions).
REQUIRED_SYMBOLS: dict[str, tuple[str, ...]] = {
    "megatron.core.utils": ("get_pg_rank",),
    "megatron.core.process_groups_config": ("ProcessGroupCollection",),
    "megatron.core.tensor_parallel": ("get_cuda_rng_tracker", "get_expert_parallel_rng_tracker_name",
                                      "set_tensor_model_parallel_attributes"),
    "megatron.core.transformer.module": ("MegatronModule",),
    "megatron.core.transformer.spec_utils": ("ModuleSpec",),
    "megatron.core.transformer.moe.moe_layer": ("MoELayer",),
    "megatron.core.transformer.moe.moe_utils": ("get_align_size_for_quantization", "get_default_pg_collection"),
    "megatron.core.transformer.moe.token_dispatcher": ("MoETokenDispatcher", "fused_dispatch", "fused_combine",
                                                       "set_deepep_num_sms"),
}

# Names 0.16.1's `moe_utils` imports from Transformer Engine and leaves undefined when that import fails.
TE_NAMES = ("te_general_gemm", "fused_permute", "fused_permute_with_probs", "fused_unpermute",
            "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function",
            "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss")


def megatron_core_version() -> Optional[Version]:
    """The installed megatron-core's version from its package metadata.

    Returns:
        A `packaging.version.Version`, or None when no megatron-core distribution is installed (megatron on
        `PYTHONPATH` only) or its version does not parse.
    """
    try:
        version = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None
    # packaging is a dependency of megatron-core, so it is there whenever a version is.
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version)
    except InvalidVersion:
        return None


def _missing_symbol_message(symbol: str, version: Optional[Version]) -> str:
    from packaging.version import Version

    if version is None:
        return (f"moe_comm.integrations.megatron needs {symbol}, which the megatron-core on the path does not have "
                f"(its version is unknown: no package metadata; needs >= {MIN_VERSION}): {INSTALL_HINT}")
    if version < Version(MIN_VERSION):
        hint = f"needs >= {MIN_VERSION}: pip install -U 'megatron-core>={MIN_VERSION}'"
    else:
        hint = f"checked with {' and '.join(CHECKED_VERSIONS)}; install one of those"
    return f"moe_comm.integrations.megatron needs {symbol}, which megatron-core {version} does not have ({hint})"


def check_megatron_core() -> None:
    """Raise an ImportError that says what to do unless every symbol in `REQUIRED_SYMBOLS` can be imported."""
    version = megatron_core_version()
    try:
        importlib.import_module("megatron.core")
    except ImportError as exc:
        if version is None:
            raise ImportError(f"moe_comm.integrations.megatron needs megatron-core >= {MIN_VERSION}, which is not "
                              f"installed: {INSTALL_HINT}") from exc
        raise ImportError(f"moe_comm.integrations.megatron needs megatron-core >= {MIN_VERSION}; megatron-core "
                          f"{version} is installed but importing megatron.core failed: {exc}") from exc
    for module_name, names in REQUIRED_SYMBOLS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ImportError(_missing_symbol_message(module_name, version)) from exc
        for name in names:
            if not hasattr(module, name):
                raise ImportError(_missing_symbol_message(f"{module_name}.{name}", version))


def define_missing_te_names() -> None:
    """Set each of `TE_NAMES` that `megatron.core.transformer.moe.moe_utils` lacks to None (as 0.17+ does);
    names that exist, with Transformer Engine or on 0.17+, are left alone. Idempotent."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    for name in TE_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


__all__ = ["MIN_VERSION", "REQUIRED_SYMBOLS", "TE_NAMES", "check_megatron_core", "define_missing_te_names",
           "megatron_core_version"]
