"""The env registry, the public API names of DESIGN section 2, and imports without GPU or compiler."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import moe_comm
from moe_comm import env


def test_bool_zero_means_false(monkeypatch):
    monkeypatch.setenv("MOE_COMM_CHECK_INPUTS", "0")
    assert env.get_bool("MOE_COMM_CHECK_INPUTS") is False
    monkeypatch.setenv("MOE_COMM_CHECK_INPUTS", "on")
    assert env.get_bool("MOE_COMM_CHECK_INPUTS") is True
    monkeypatch.setenv("MOE_COMM_CHECK_INPUTS", "maybe")
    with pytest.raises(ValueError, match="MOE_COMM_CHECK_INPUTS='maybe' is not a boolean"):
        env.get_bool("MOE_COMM_CHECK_INPUTS")


def test_typed_getters(monkeypatch):
    monkeypatch.delenv("MOE_COMM_TEST_SEED", raising=False)
    assert env.get_int("MOE_COMM_TEST_SEED") == 0
    monkeypatch.setenv("MOE_COMM_TEST_SEED", "x")
    with pytest.raises(ValueError, match="is not an integer"):
        env.get_int("MOE_COMM_TEST_SEED")
    with pytest.raises(KeyError, match="not a registered"):
        env.get_str("MOE_COMM_NOPE")


def test_readme_lists_every_variable():
    """The README's table is `env.describe()` itself (names, types, defaults and meanings)."""
    import pathlib
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    assert env.describe() in readme, env.describe()


def test_import_needs_no_gpu_or_compiler():
    code = ("import os, sys; os.environ['PATH'] = ''; import moe_comm, moe_comm.autograd, moe_comm.testing; "
            "assert 'torch.utils.cpp_extension' not in sys.modules; print(moe_comm.__version__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == moe_comm.__version__


def test_public_api_names():
    params = inspect.signature(moe_comm.Buffer.__init__).parameters
    assert list(params)[1:] == ["group", "num_max_tokens_per_rank", "hidden", "num_topk", "use_fp8_dispatch",
                                "backend", "deterministic", "num_gpu_timeout_secs", "num_cpu_timeout_secs",
                                "allow_hybrid_mode", "allow_multiple_reduction", "sl_idx", "use_recv_hook",
                                "cuda_tuning"]
    assert list(inspect.signature(moe_comm.Buffer.dispatch).parameters)[1:] == [
        "x", "topk_idx", "topk_weights", "num_experts", "num_max_tokens_per_rank", "expert_alignment", "num_sms",
        "handle", "do_cpu_sync", "do_expand", "quantize", "dequantize", "previous_event",
        "async_with_compute_stream", "allocate_on_comm_stream", "return_recv_hook"]
    assert list(inspect.signature(moe_comm.Buffer.combine).parameters)[1:] == [
        "x", "handle", "topk_weights", "bias", "num_sms", "previous_event", "async_with_compute_stream",
        "allocate_on_comm_stream", "return_recv_hook"]
    assert list(inspect.signature(moe_comm.Buffer.get_buffer_size_hint).parameters) == [
        "group", "num_max_tokens_per_rank", "hidden", "num_topk", "use_fp8_dispatch", "use_recv_hook"]
    for name in ("get_theoretical_num_sms", "get_theoretical_num_qps", "get_physical_domain_size",
                 "get_logical_domain_size", "barrier", "destroy"):
        assert callable(getattr(moe_comm.Buffer, name))
    for field in ("do_expand", "num_experts", "expert_alignment", "num_max_tokens_per_rank", "num_sms",
                  "psum_num_recv_tokens_per_rank", "psum_num_recv_tokens_per_expert", "num_recv_tokens",
                  "num_recv_tokens_per_expert_list"):
        assert field in moe_comm.EPHandle.__dataclass_fields__, field
    assert callable(moe_comm.EventOverlap.current_stream_wait)
    assert callable(moe_comm.RecvHook) and isinstance(moe_comm.RecvHook.done, property)


def test_handle_made_fast_is_the_same_frozen_handle():
    """EPHandle.make (the backends' constructor, without the frozen dataclass's per-field setattr) gives what the
    dataclass's own constructor gives, frozen, and refuses a missing or unknown field."""
    import dataclasses

    from moe_comm.handle import EPHandle

    values = {f.name: i for i, f in enumerate(dataclasses.fields(EPHandle))}
    made, built = EPHandle.make(**values), EPHandle(**values)
    assert dataclasses.asdict(made) == dataclasses.asdict(built) == values
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.num_recv_rows = 1
    with pytest.raises(TypeError, match=r"missing \['layout'\], unknown \['extra'\]"):
        EPHandle.make(**{**{k: v for k, v in values.items() if k != "layout"}, "extra": 1})
