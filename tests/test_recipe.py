"""Smoke runs of the Megatron recipe: `torchrun`, `tiny` preset over gloo, a few steps, wandb offline: 2 processes
(one host), and 4 processes made 2 hosts x 2 by MOE_COMM_RANKS_PER_NODE (the hybrid path). Checks the exit status,
the summary line, the metrics file and the offline wandb run directory."""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'moe_comm[recipe]')")
pytest.importorskip("wandb", reason="wandb is not installed (pip install 'moe_comm[recipe]')")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tiny(tmp_path, num_ranks: int, *args: str, dispatcher: str = "moe_comm", **env_vars: str) -> tuple[str, dict]:
    """`tiny`, 4 steps on `num_ranks` gloo processes with train.py's `args`; (stdout, metrics JSON) after checking the
    log lines."""
    metrics = tmp_path / f"metrics-{dispatcher}.json"
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": ROOT, **env_vars}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(num_ranks),
           os.path.join(ROOT, "recipes", "megatron_moe", "train.py"), "--preset", "tiny", "--steps", "4",
           "--log-interval", "2", "--out", str(tmp_path), "--metrics-json", str(metrics), "--timeout-s", "60",
           "--dispatcher", dispatcher, *args]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"

    assert re.search(rf"^step +4/4 \| loss [0-9.]+ \|.*\| {dispatcher}$", proc.stdout, re.M), proc.stdout
    assert re.search(rf"^SUMMARY preset=tiny dispatcher={dispatcher} steps=4 ", proc.stdout, re.M), proc.stdout
    data = json.loads(metrics.read_text())
    assert "train.py" in data["metadata"]["command"] and data["metadata"]["torch"], data["metadata"]
    assert [h["step"] for h in data["history"]] == [1, 2, 3, 4]
    for h in data["history"]:
        assert math.isfinite(h["loss"]) and h["tokens_per_s"] > 0 and h["dispatch_ms"] > 0 and h["combine_ms"] > 0, h
        assert h["num_sms"] > 0 or dispatcher == "alltoall", h
    return proc.stdout, data


def test_tiny_preset_trains_and_logs_offline(tmp_path):
    stdout, data = run_tiny(tmp_path, 2)
    assert data["summary"]["domains"] == "1x2", data["summary"]
    run_dir = re.search(r"^wandb run directory: (.+)$", stdout, re.M).group(1)
    assert os.path.isdir(run_dir) and os.path.basename(run_dir).startswith("offline-run-"), run_dir
    assert os.path.commonpath([run_dir, str(tmp_path)]) == str(tmp_path), run_dir
    records = [name for name in os.listdir(run_dir) if name.endswith(".wandb")]
    assert records, os.listdir(run_dir)
    # The run config carries the metadata of the metrics file (commit, versions), megatron-core's version with it.
    assert data["metadata"]["megatron_core"], data["metadata"]
    record = (pathlib.Path(run_dir) / records[0]).read_bytes()
    assert b"megatron_core" in record and data["metadata"]["megatron_core"].encode() in record
    assert data["summary"]["wandb_run_dir"] == run_dir


def test_tiny_preset_on_hybrid_path(tmp_path):
    """The recipe unchanged across (forced) hosts: 4 ranks as 2 hosts x 2."""
    stdout, data = run_tiny(tmp_path, 4, MOE_COMM_RANKS_PER_NODE="2")
    assert data["summary"]["domains"] == "2x2", data["summary"]
    assert re.search(r"^SUMMARY .*\| domains 2x2$", stdout, re.M), stdout


def refused(parse_args, argv: list[str], capsys) -> str:
    """train.py's message for `argv` (its parser exits with status 2), without the usage line."""
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


def test_one_rank_with_megatron_experts_is_refused_before_building(monkeypatch, capsys):
    """Megatron's SequentialMLP fails at expert parallelism 1 deep in its own mlp.py (an in-place bias add on a
    view); the recipe says so up front and names the way out, and the grouped MLP's one-rank run is accepted.
    Started without torchrun, it says to use torchrun."""
    monkeypatch.syspath_prepend(ROOT)
    from recipes.megatron_moe.train import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    assert "SequentialMLP experts fail at expert parallelism 1" in refused(parse_args, ["--preset", "tiny"], capsys)
    assert parse_args(["--preset", "tiny", "--grouped-experts"]).grouped_experts
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert parse_args(["--preset", "tiny"]).preset == "tiny"
    monkeypatch.delenv("WORLD_SIZE")
    assert "start the recipe with torchrun" in refused(parse_args, ["--preset", "tiny"], capsys)


def test_share_gpu_refusals(monkeypatch, capsys):
    """`--share-gpu` (every rank on GPU 0) is refused up front on a machine without CUDA, and with moe_comm's
    reference backend, whose buffers stay on the CPU."""
    monkeypatch.syspath_prepend(ROOT)
    from recipes.megatron_moe.train import parse_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert "needs CUDA" in refused(parse_args, ["--preset", "tiny", "--share-gpu"], capsys)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert "--backend torch keeps its buffers on the CPU" in refused(
        parse_args, ["--preset", "tiny", "--share-gpu", "--backend", "torch"], capsys)
    assert parse_args(["--preset", "tiny", "--share-gpu"]).share_gpu


def test_arguments_refused_before_building(monkeypatch, capsys):
    """FP8 on the wire needs bf16 rows and a moe_comm dispatcher, and the dsv3 preset needs GPUs: refused at the
    command line rather than at the first forward (or by the kernel's out-of-memory killer)."""
    monkeypatch.syspath_prepend(ROOT)
    from recipes.megatron_moe.train import parse_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "casts bf16 rows; --preset tiny runs in torch.float32 (add --dtype bfloat16)" in refused(
        parse_args, ["--preset", "tiny", "--quantize", "mxfp8"], capsys)
    assert "got --dispatcher alltoall" in refused(
        parse_args, ["--preset", "small", "--quantize", "mxfp8", "--dispatcher", "alltoall"], capsys)
    assert parse_args(["--preset", "tiny", "--quantize", "mxfp8", "--dtype", "bfloat16"]).quantize == "mxfp8"
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert "--preset dsv3 is one DeepSeek-V3 layer for GPUs" in refused(parse_args, ["--preset", "dsv3"], capsys)


def test_deterministic_expand_run_reproduces_alltoall_losses(tmp_path):
    """The GPU loss-curve check's runs (`--deterministic`, route A's expand layout against Megatron's alltoall, fp32)
    on CPU, where every kernel is deterministic anyway: the flags run and are recorded, and every step's loss is
    bitwise alltoall's (a token's rows are summed in Megatron's order)."""
    _, ours = run_tiny(tmp_path, 2, "--deterministic", "--do-expand", "--no-wandb")
    _, theirs = run_tiny(tmp_path, 2, "--deterministic", "--no-wandb", dispatcher="alltoall")
    assert ours["summary"]["deterministic"] and theirs["summary"]["deterministic"], (ours["summary"], theirs["summary"])
    assert ours["summary"]["do_expand"] and ours["summary"]["dtype"] == "float32", ours["summary"]
    assert [h["loss"] for h in ours["history"]] == [h["loss"] for h in theirs["history"]]


def test_timeout_is_checked_and_reaches_megatron_and_moe_comm(monkeypatch, capsys):
    """`--timeout-s` is refused up front when it is not a positive number of seconds (nan, 0, negative: they failed
    at init_process_group with an unrelated message), and it becomes the timeout of Megatron's process groups (the
    data-parallel all-reduce of the gradients waited Megatron's default 30 minutes for a stuck rank)."""
    monkeypatch.syspath_prepend(ROOT)
    from recipes.megatron_moe import model
    from recipes.megatron_moe.train import parse_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    for bad in ("nan", "0", "-1", "inf"):
        assert f"--timeout-s={float(bad)} must be a number of seconds" in refused(
            parse_args, ["--timeout-s", bad], capsys)
    from megatron.core import parallel_state, tensor_parallel

    calls = []
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: False)
    monkeypatch.setattr(parallel_state, "initialize_model_parallel", lambda **kw: calls.append(kw))
    monkeypatch.setattr(tensor_parallel, "model_parallel_cuda_manual_seed", lambda seed: None)
    model.initialize_megatron(2, 0, timeout_s=30.0)
    assert calls == [dict(expert_model_parallel_size=2, distributed_timeout_minutes=0.5)], calls


def test_metrics_json_folder_is_checked_before_the_run(monkeypatch, capsys, tmp_path):
    """The metrics file is written after the last step: a path whose folder cannot exist was found only then,
    losing the run; its folder is now made (as --out's) or refused at the command line."""
    monkeypatch.syspath_prepend(ROOT)
    from recipes.megatron_moe.train import parse_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "--metrics-json /proc/nope/m.json: cannot create its folder" in refused(
        parse_args, ["--metrics-json", "/proc/nope/m.json"], capsys)
    path = tmp_path / "new" / "m.json"
    assert parse_args(["--metrics-json", str(path)]).metrics_json == str(path)
    assert path.parent.is_dir()


def test_do_expand_with_the_flex_route_and_huge_seeds_are_refused(monkeypatch, capsys):
    """Route B keeps Megatron's non-expand permutation: `--do-expand` was accepted, ignored and recorded as on. A
    seed past the generators' range failed after the process group's start (an overflow naming no flag)."""
    monkeypatch.syspath_prepend(ROOT)
    from recipes.megatron_moe.train import parse_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "--do-expand is route A's layout" in refused(
        parse_args, ["--dispatcher", "moe_comm_flex", "--do-expand"], capsys)
    assert "--seed=99999999999999999999 must be in [0, 2**32)" in refused(
        parse_args, ["--seed", "99999999999999999999"], capsys)


def test_sync_free_bytes_count_received_rows_not_the_worst_case(monkeypatch):
    """Without a CPU sync the dispatch's output is sized for the worst case; dispatch_gbps / combine_gbps count
    the rows received (`psum_num_recv_tokens_per_expert[-1]`), as with a CPU sync."""
    import types

    import torch

    monkeypatch.syspath_prepend(ROOT)
    from moe_comm.integrations.megatron import MoECommConfig
    from recipes.megatron_moe.train import CommTimer

    rows = torch.zeros(512, 64)  # worst case; 100 rows received
    handle = types.SimpleNamespace(psum_num_recv_tokens_per_expert=torch.tensor([30, 60, 80, 100]))
    sync_free = types.SimpleNamespace(options=MoECommConfig(do_expand=True, do_cpu_sync=False), handle=handle)
    assert int(CommTimer.received_bytes(sync_free, rows)) == 100 * 64 * 4
    synced = types.SimpleNamespace(options=MoECommConfig(do_expand=True), handle=handle)
    assert CommTimer.received_bytes(synced, rows) == 512 * 64 * 4
    assert CommTimer.received_bytes(types.SimpleNamespace(), rows) == 512 * 64 * 4  # Megatron's dispatchers

    # Route A is asynchronous: the counts are written when the dispatch is waited for (on GPUs the comm stream's
    # layout kernel writes them; read before the wait, the recipe counted stale memory). A stand-in whose counts
    # exist only after wait_dispatch, through the timer's wrappers.
    class RouteA:
        options = MoECommConfig(do_expand=True, do_cpu_sync=False)
        handle = types.SimpleNamespace(psum_num_recv_tokens_per_expert=torch.tensor([-1]))

        def token_dispatch(self, hidden, probs):
            return rows, probs

        def wait_dispatch(self):
            self.handle.psum_num_recv_tokens_per_expert = torch.tensor([30, 60, 80, 100])

        def token_combine(self, hidden):
            return hidden

        def wait_combine(self):
            pass

    route_a, timer = RouteA(), CommTimer(use_cuda=False)
    timer.instrument(route_a)
    route_a.token_dispatch(None, None)
    route_a.wait_dispatch()
    route_a.wait_dispatch()  # a second wait is a no-op
    route_a.token_combine(rows)
    route_a.wait_combine()
    assert int(timer.bytes["dispatch"]) == int(timer.bytes["combine"]) == 100 * 64 * 4, timer.bytes


def compare_metrics(tmp_path, loss_a, loss_b, **summary_b) -> int:
    """compare.py's exit status for two made-up metrics files."""
    from recipes.megatron_moe import compare

    base = dict(preset="tiny", seed=1, steps=len(loss_a), world_size=2, dtype="float32", dispatcher="moe_comm",
                mean_tokens_per_s=1.0, wandb_run_dir="-")
    paths = []
    for name, losses, extra in (("a", loss_a, {}), ("b", loss_b, summary_b)):
        summary = {**base, **extra, "final_loss": losses[-1]}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(dict(summary=summary, history=[dict(step=i + 1, loss=x)
                                                                  for i, x in enumerate(losses)])))
        paths.append(str(path))
    return compare.main([*paths, "--max-loss-diff", "0"])


def test_compare_is_honest(monkeypatch, tmp_path, capsys):
    """A run whose loss became NaN or inf is not "equal at every step" to another run, and runs of other dtypes or
    rank counts (other arithmetic, other batches) are refused like other presets or seeds."""
    monkeypatch.syspath_prepend(ROOT)
    assert compare_metrics(tmp_path, [5.0, 4.0, 3.0], [5.0, 4.0, 3.0]) == 0
    assert compare_metrics(tmp_path, [5.0, 4.0, 3.0], [5.0, math.nan, math.nan]) == 1
    assert "max |loss diff| inf (step 2)" in capsys.readouterr().out
    assert compare_metrics(tmp_path, [5.0, math.inf], [5.0, math.inf]) == 1  # both diverged: not "equal"
    assert compare_metrics(tmp_path, [5.0], [5.0], dtype="bfloat16") == 2
    assert compare_metrics(tmp_path, [5.0], [5.0], world_size=4) == 2
    assert "the runs differ in world_size: 2 vs 4" in capsys.readouterr().err
