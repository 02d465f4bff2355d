"""scripts/bench.py runs end to end on CPU (reference backend over gloo) and writes its table, JSON and plot;
scripts/plot_results.py draws a PNG from that JSON."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import tarfile

import pytest

from moe_comm.testing.bench import run_metadata

ROOT = pathlib.Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def script_module(name: str):
    """scripts/<name>.py as a module, imported with scripts/ on sys.path (the scripts import each other as they do
    when run)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def microbench_module(name: str):
    """benchmarks/microbench/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "microbench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One CPU bench run shared by the tests below: `(json path, markdown path, stdout)`."""
    out = tmp_path_factory.mktemp("bench")
    out_json, out_md = out / "bench.json", out / "bench.md"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench.py"), "--backend", "torch", "--tokens", "8", "16",
           "--hidden", "128", "--num-experts", "4", "--num-topk", "2", "--sms", "4", "--iters", "2",
           "--json", str(out_json), "--md", str(out_md)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return out_json, out_md, done.stdout


def test_bench_script_smoke(bench_run):
    out_json, out_md, _ = bench_run
    record = json.loads(out_json.read_text())
    ops = {(row["tokens"], row["op"]) for row in record["table"]}
    assert ops == {(t, op) for t in (8, 16)
                   for op in ("dispatch", "cached dispatch", "dispatch fp8", "cached dispatch fp8",
                              "cached dispatch bf16 via fp8", "combine")}
    assert all(row["us"] > 0 for row in record["table"])
    # Back-to-back device times, and the host time derived from them, are CUDA measures: none on CPU.
    assert all(row["back_to_back_us"] is None and row["host_us"] is None for row in record["table"])
    # The baseline comes from the same run, beside every BF16 op.
    assert all(row["baseline_us"] > 0 for row in record["table"] if "fp8" not in row["op"])
    md = out_md.read_text()
    assert "bitwise check passed" in md and "SM sweep at 16 tokens" in md and "backend torch (direct path)" in md
    assert "| host us |" in md


def test_bench_records_its_run(bench_run):
    out_json, out_md, _ = bench_run
    meta = json.loads(out_json.read_text())["meta"]
    assert set(meta) == {"commit", "dirty", "moe_comm", "torch", "cuda", "nccl", "python", "gpu", "num_gpus",
                         "hostname", "date_utc", "command"}
    assert meta["torch"] and meta["python"] and meta["hostname"] and meta["date_utc"].endswith("+00:00")
    assert "scripts/bench.py --backend torch --tokens 8 16" in meta["command"]
    if (ROOT / ".git").exists():  # a clone or a worktree (.git is a file there)
        assert re.fullmatch(r"[0-9a-f]{40}", meta["commit"]) and isinstance(meta["dirty"], bool)
    # The markdown opens with where the numbers came from.
    head = out_md.read_text().splitlines()[:3]
    assert head[0].startswith("commit ") and f"torch {meta['torch']}" in head[0]
    assert meta["command"] in head[2]


def test_run_metadata_outside_a_checkout(tmp_path):
    from moe_comm.testing.bench import run_metadata

    meta = run_metadata(["bench.py", "--x", "a b"], repo_dir=tmp_path)
    assert meta["commit"] is None and meta["dirty"] is None
    assert meta["command"].endswith("bench.py --x 'a b'")


def test_plot_results_writes_png(bench_run, tmp_path):
    pytest.importorskip("matplotlib")
    out_json, _, stdout = bench_run
    # The bench drew its own plot beside the JSON...
    assert out_json.with_suffix(".png").read_bytes().startswith(PNG_SIGNATURE), stdout
    # ...and the plotter draws one from the JSON alone.
    png = tmp_path / "plot.png"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_results.py"), str(out_json), "-o", str(png)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    data = png.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000


def test_bench_expand_counts_tokens_on_the_wire(tmp_path):
    """`--expand`: the dispatches use the expand layout; its rows outnumber the received tokens, and the wire
    bandwidth counts tokens (they cross once per rank), the logical one rows; the combine by partial sums and the
    one in slot order (a deterministic buffer's) both run."""
    out_json = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench.py"), "--backend", "torch", "--tokens", "16", "--hidden",
           "128", "--num-experts", "8", "--num-topk", "4", "--sms", "--iters", "2", "--expand", "--json",
           str(out_json)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out_json.read_text())
    assert record["config"]["expand"] and "expand layout" in done.stdout
    row = record["per_rank"][0]["rows"][0]
    # In the slot order an expand combine sends back a row per (token, local slot): more rows than the dispatch's
    # tokens; by partial sums one per (token, rank), two rows' bytes (FP32) where it sums several slots.
    assert row["recv_rows"] > row["wire_rows"]["dispatch"] > 0
    assert row["wire_rows"]["combine slot order"] > row["wire_rows"]["dispatch"]
    assert row["wire_rows"]["dispatch"] < row["wire_rows"]["combine"] <= row["wire_rows"]["combine slot order"]
    ops = {r["op"]: r for r in record["table"]}
    assert ops["cached dispatch"]["logical_gbs"] > ops["cached dispatch"]["wire_gbs"] > 0
    assert ops["combine"]["wire_gbs"] > 0 and ops["combine slot order"]["wire_gbs"] > 0


def test_bench_layer_runs_and_report():
    """Route A once per SM count; the table gives both timings against the floor, the slowest rank's."""
    module = script_module("bench_layer")
    report, runs = module.report, module.runs
    assert runs(["alltoall + grouped", "route A (CPU sync)", "floor"], [0, 32]) == [
        ("alltoall + grouped", "alltoall + grouped", 0), ("route A (CPU sync)", "route A (CPU sync)", 0),
        ("route A (CPU sync), 32 SMs", "route A (CPU sync)", 32), ("floor", "floor", 0)]
    config = {"num_ranks": 2, "hidden": 8, "num_experts": 4, "topk": 2, "ffn": 8, "tokens": 16, "iters": 3,
              "variants": ["route A (CPU sync)", "floor"], "num_sms": [0]}
    rank = lambda a, b, f: {"route A (CPU sync)": {"ms": a, "b2b_ms": b, "max_memory_gib": 1.0},  # noqa: E731
                            "floor": {"ms": f, "b2b_ms": f, "max_memory_gib": 1.0}}
    text, record = report(config, [rank(11.0, 10.5, 10.0), rank(12.0, 10.0, 8.0)], {"command": "x"})
    assert record["ms"] == {"route A (CPU sync)": 12.0, "floor": 10.0}
    assert record["b2b_ms"] == {"route A (CPU sync)": 10.5, "floor": 10.0}
    assert "| route A (CPU sync) | 12.00 | 1.200 | - | 10.50 | 1.050 | 1.0 |" in text


def test_bench_overlap_report_and_plot(tmp_path):
    """The overlap table: the slowest rank's GEMM times and their ratios to the GEMM alone; the plotter draws the
    record's bars from the JSON alone."""
    report = script_module("bench_overlap").report
    config = {"num_ranks": 2, "tokens": 4096, "hidden": 7168, "num_experts": 256, "num_topk": 8, "num_sms": 0,
              "expand": False, "iters": 20}
    row = lambda op, alone, hook: {"op": op, "op_us": 300.0, "op_hooked_us": 310.0, "gemm_rows": 1024,  # noqa: E731
                                   "gemm_alone_us": alone, "gemm_after_us": alone, "gemm_async_us": 2 * alone,
                                   "gemm_hook_us": hook, "gemm_nccl_us": 1.5 * alone,
                                   **{f"step_{m}_us": 400.0 for m in ("after", "async", "hook", "nccl")}}
    per_rank = [{"rows": [row("cached dispatch", 100.0, 101.0), row("combine", 100.0, 102.0)], "num_sms": 24,
                 "device": "H200"},
                {"rows": [row("cached dispatch", 110.0, 111.0), row("combine", 100.0, 100.0)], "num_sms": 24,
                 "device": "H200"}]
    text, record = report(config, per_rank, run_metadata(["bench_overlap.py"]))
    first = record["table"][0]
    assert (first["gemm_alone_us"], first["gemm_hook_us"], first["gemm_async_ratio"]) == (110.0, 111.0, 2.0)
    assert ("| cached dispatch | 300.0 | 310.0 | 1024 | 110.0 | 110.0 (1.000) | 220.0 (2.000) | 111.0 (1.009) | "
            "165.0 (1.500) |") in text
    assert "| cached dispatch | 400.0 | 400.0 | 400.0 | 400.0 |" in text
    plots_from_json(record, tmp_path)


def test_bench_primitives_report_and_plot(tmp_path):
    """The primitives table: the slowest rank's times, GB/s from the bytes per rank, the GEMM ratios; the plotter
    draws the record from the JSON alone."""
    report = script_module("bench_primitives").report
    config = {"num_ranks": 2, "sizes_mb": [1, 4], "iters": 3}

    def rank(scale):
        return {"device": "H200", "rows": [
            {"op": op, "mb": mb, "bytes": mb << 20, "moe_us": 100.0 * mb * scale, "nccl_us": 90.0 * mb,
             "gemm_rows": 512, "gemm_alone_us": 200.0, "gemm_moe_us": 210.0 * scale, "gemm_nccl_us": 230.0}
            for op in ("all_gather", "pipeline send/recv") for mb in (1, 4)]}

    text, record = report(config, [rank(1.0), rank(1.5)], run_metadata(["bench_primitives.py"]))
    first = record["table"][0]
    assert (first["moe_us"], first["nccl_us"], first["gemm_moe_ratio"]) == (150.0, 90.0, 1.575)
    assert abs(first["moe_gbs"] - (1 << 20) / 150.0 / 1e3) < 1e-9
    assert "| all_gather | 1 | 150.0 | 90.0 | 7.0 | 11.7 | 512 | 200.0 | 315.0 (1.575) | 230.0 (1.150) |" in text
    plots_from_json(record, tmp_path)


def plots_from_json(record: dict, tmp_path) -> None:
    """plot_results.py draws a PNG from the record's JSON alone (skips without matplotlib)."""
    pytest.importorskip("matplotlib")
    out_json, png = tmp_path / "record.json", tmp_path / "record.png"
    out_json.write_text(json.dumps(record))
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_results.py"), str(out_json), "-o", str(png)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert png.stat().st_size > 10_000


def test_floor_record_plot(tmp_path):
    """A microbenchmark's floor record (benchmarks/fanout-floor_*.json) plots from the JSON alone; the committed
    one holds a row per (method, fan-out, blocks) of its run."""
    committed = json.loads((ROOT / "benchmarks" / "fanout-floor_h200x1_2026-12-02.json").read_text())
    assert len(committed["floor"]) == 12 * 3 * 7 and committed["meta"]["commit"]
    record = {"date": "2026-12-02", "title": "a floor", "meta": {"commit": "0123456789ab", "hardware": "H200"},
              "floor": [{"method": m, "case": f"F={f}", "blocks": b, "gbs_per_sm": 60.0 - b / 10}
                        for m in ("tma", "ldst") for f in (1, 8) for b in (4, 8, 16)]}
    plots_from_json(record, tmp_path)


def test_candidates_record(tmp_path):
    """The expert-sum microbenchmark's record (benchmarks/expert-sum_*.json) plots from the JSON alone and prints as
    a table: a row per timing, per case its us, multiple of the floor and difference (blank where not compared or
    not timed); each committed record has both cases with the kernel bitwise the fp32 loop."""
    committed = [json.loads(path.read_text()) for path in sorted((ROOT / "benchmarks").glob("expert-sum_*.json"))]
    assert committed
    for each in committed:
        assert [c["case"] for c in each["cases"]] == ["EP1", "EP2 rank 0"] and each["meta"]["commit"]
        assert all(c["max_diff"]["moe_comm expert_sum kernel"] == 0 for c in each["cases"])
    module = microbench_module("expert_sum")
    meta = {"commit": "0123456789ab", "gpu": "H200", "torch": "2.11", "cuda": "13.0", "python": "3.12",
            "date_utc": "2026-12-02T00:00:00+00:00", "command": "python3 expert_sum.py"}
    record = {"title": "sums", "meta": meta, "cases": [
        {"case": "EP1", "rows": 4, "pairs": 8, "J": 2, "hidden": 16, "floor_us": 10.0, "floor": "a copy",
         "us": {"a": 20.0, "b": 5.0}, "max_diff": {"a": 0.0}},
        {"case": "EP2", "rows": 8, "pairs": 9, "J": 2, "hidden": 16, "floor_us": 20.0, "floor": "a copy",
         "us": {"a": 30.0}, "max_diff": {"a": 0.5}}]}
    table = module.to_markdown(record).splitlines()
    assert "| a | 20 | 2.00 | 0 | 30 | 1.50 | 0.5 |" in table
    assert "| b | 5 | 0.50 |  |  |  |  |" in table
    assert "| floor | 10 | 1.00 |  | 20 | 1.00 |  |" in table
    assert all(len(line) <= 120 for line in table if not line.startswith(("|", "command")))
    plots_from_json(record, tmp_path)
    for each in committed:
        plots_from_json(each, tmp_path)


def test_chunked_experts_smoke(tmp_path, monkeypatch):
    """The chunked-experts microbenchmark at small shapes on CPU: the chunks' (expert groups') outputs and input
    gradients are the whole rows' own (each chunk row compared with its whole row), every timing is there, the
    record prints and plots; the chunk counts add up to the whole rows' per expert.

    Within one bf16 rounding, not bitwise as on the GPU (the record): the CPU's bf16 GEMM picks its kernel by row
    count, and over 60 random draws 5-8% of the cases differed, by at most 7.6e-6, one bf16 ulp of the largest
    values (2.5e-3 and 3.9e-3 at these shapes). A chunk row paired with the wrong whole row is off by the values' own
    size (median ~3e-4). The data is seeded, so a run is reproducible."""
    import torch

    module = microbench_module("chunked_experts")
    for name, value in dict(HIDDEN=32, FFN=16, NUM_EXPERTS=8, TOPK=2, TOKENS=32).items():
        monkeypatch.setattr(module, name, value)
    counts = module.chunk_counts(num_ranks=2, num_local=4, num_chunks=4)
    assert counts.shape == (4, 4) and int(counts.sum()) <= 2 * 32 * 2
    assert torch.equal(counts.sum(0), module.chunk_counts(num_ranks=2, num_local=4, num_chunks=1)[0])
    order = module.chunk_major_order(counts, torch.device("cpu"))
    assert sorted(order.tolist()) == list(range(int(counts.sum())))
    torch.manual_seed(0)
    cases = [module.time_case(name, ranks, local, [2, 3], torch.device("cpu")) for name, ranks, local in
             (("EP1", 1, 8), ("EP2 rank 0", 2, 4))]
    for case in cases:
        assert set(case["max_diff"]) == {f"{k} {what}" for k in (2, 3)
                                         for what in ("chunks, weight grads once", "expert groups")}
        one_bf16_ulp = 2.0 ** -15  # of values up to 2^-7 = 7.8e-3
        assert max(case["max_diff"].values()) <= one_bf16_ulp, case["max_diff"]
        assert set(case["us"]) == {"whole rows"} | {f"{k} {what}" for k in (2, 3) for what in (
            "chunks, weight grads once", "chunks, weight grads per chunk, summed", "expert groups")}
    record = dict(title="chunks", meta=run_metadata(["chunked_experts.py"]), cases=cases)
    table = module.to_markdown(record)
    assert "| whole rows |" in table and "| floor |" in table
    plots_from_json(record, tmp_path)


def test_recipe_runs_plot(tmp_path):
    """Recipe runs gathered under `runs` (benchmarks/loss-curves_*.json) plot from the JSON alone, with a panel of
    each run's loss difference from the first run's (a run equal to it bit for bit stays on the axis at 0)."""
    def run(label, losses):
        history = [{"step": i + 1, "loss": loss, "tokens_per_s": 1e4 + i} for i, loss in enumerate(losses)]
        return {"label": label, "summary": {"dispatcher": label.split()[0], "preset": "small", "steps": len(losses),
                                            "seed": 1234, "world_size": 2, "share_gpu": True,
                                            "mean_tokens_per_s": 1e4},
                "history": history}
    record = {"runs": [run("alltoall", [10.0, 9.5, 9.2]), run("alltoall again", [10.0, 9.5, 9.2]),
                       run("moe_comm expand", [10.0, 9.5000001, 9.1])]}
    plots_from_json(record, tmp_path)


def test_bench_deepep_report_and_plot(tmp_path):
    """moe_comm beside DeepEP: the slowest rank's times per op, their ratio, the row and combine checks; the plotter
    draws the record from the JSON alone."""
    module = script_module("bench_deepep")
    OPS, report = module.OPS, module.report
    config = {"num_ranks": 2, "tokens": [128, 4096], "hidden": 7168, "num_experts": 256, "num_topk": 8,
              "num_sms": 24, "iters": 20, "share_gpu": False}

    def rank(scale, same):
        rows = []
        for tokens in (128, 4096):
            row = {"tokens": tokens, "recv_rows": tokens, "max_combine_diff": 0.5 * scale,
                   "same": {"bf16 rows": same, "fp8 rows": True, "topk_idx": same}}
            for op in OPS:
                row.update({f"moe {op} us": 10.0 * scale, f"moe {op} b2b": 8.0 * scale,
                            f"deepep {op} us": 12.0, f"deepep {op} b2b": 10.0})
            rows.append(row)
        return {"rows": rows, "deepep": "1.2.1", "device": "H200"}

    text, record = report(config, [rank(1.0, True), rank(1.5, False)], run_metadata(["bench_deepep.py"]))
    first = record["table"][0]
    assert (first["moe_us"], first["moe_b2b_us"], first["deepep_b2b_us"], first["b2b_ratio"]) == (15.0, 12.0, 10.0,
                                                                                                   1.2)
    assert "| 128 | cached dispatch fp8 | 15.0 | 12.0 | 12.0 | 10.0 | 1.20 |" in text
    assert ("- 4096 tokens: bitwise the same on every rank: fp8 rows; bf16 rows DIFFER on ranks [1]; topk_idx DIFFER "
            "on ranks [1]; combined rows differ by at most 0.75 (each") in text
    plots_from_json(record, tmp_path)


def refusals(monkeypatch, capsys, script: str, argv: list[str], num_gpus: int = 0) -> str:
    """scripts/<script>.py's main with `argv` on a machine with `num_gpus` GPUs of 132 SMs (none by default; in this
    process): what it printed on stderr as it exited with status 2 (argparse's usage error)."""
    import types

    import torch

    main = script_module(script).main
    monkeypatch.setattr(torch.cuda, "device_count", lambda: num_gpus)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        multi_processor_count=132))
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 2, argv
    return capsys.readouterr().err


def test_bench_deepep_refuses_what_it_cannot_run(monkeypatch, capsys):
    """Checked before any rank starts: a rank count DeepEP's intranode kernels lack, an odd SM count, GPUs that are
    not there."""
    for argv, message in ((["--num-ranks", "3"], "2, 4 or 8 ranks"), (["--num-sms", "23"], "must be even"),
                          ([], "needs 2 GPU(s)"), (["--share-gpu"], "--share-gpu needs 1 GPU(s)")):
        assert message in refusals(monkeypatch, capsys, "bench_deepep", argv), argv


def test_bench_layer_refuses_missing_gpus(monkeypatch, capsys):
    """Checked before any rank starts: one GPU per rank, or at least one for `--share-gpu`."""
    for argv, message in ((["--num-ranks", "2"], "--num-ranks=2 needs as many GPUs"),
                          (["--share-gpu"], "--share-gpu puts every rank on GPU 0 and needs CUDA")):
        assert message in refusals(monkeypatch, capsys, "bench_layer", argv), argv


def test_bench_refuses_what_it_cannot_run(monkeypatch, capsys):
    """Checked before any rank starts (a rank raised them after the spawn, as a RankFailure ~30 s later)."""
    for argv, message in ((["--iters", "0"], "--iters=0"), (["--tokens", "-1", "16"], "--tokens=[-1, 16] >= 0"),
                          (["--num-experts", "7"], "--num-experts=7 must be a positive multiple of --num-ranks=2"),
                          (["--num-topk", "0"], "--num-topk=0 in [1, num_experts]"),
                          (["--hidden", "100"], "--hidden=100"), (["--sms", "-1", "8"], "--sms=[-1, 8]: each >= 0"),
                          (["--backend", "cuda"], "--backend cuda needs 2 GPUs")):
        assert message in refusals(monkeypatch, capsys, "bench", argv), argv
    # Where the CUDA backend can run: 0 (analytical) or 2 to the device's SMs.
    for sms in ("1", "133"):
        assert "the CUDA backend takes 0 (the analytical count) or 2" in refusals(
            monkeypatch, capsys, "bench", ["--sms", "0", sms], num_gpus=2), sms


def test_profile_ops_refuses_what_it_cannot_run(monkeypatch, capsys):
    """Checked before any rank starts: --json with --variants (which makes no op rows), GPUs that are not there."""
    for argv, message in (([], "--num-ranks=2 needs as many GPUs"), (["--num-ranks", "0"], "--num-ranks=0 needs"),
                          (["--variants", "unroll=4", "--json", "x.json"], "--json records the op rows")):
        assert message in refusals(monkeypatch, capsys, "profile_ops", argv), argv


def test_multinode_model_refuses_bad_shapes(capsys, tmp_path):
    """A usage error naming the value (a ZeroDivisionError or the model's traceback before), nothing written."""
    main = script_module("multinode_model").main
    for argv, message in ((["--tokens", "0"], "--tokens=0 must be >= 1"),
                          (["--num-experts", "100"], "num_experts=100 is not a multiple"),
                          (["--num-topk", "0"], "num_topk=0 must be >= 1")):
        with pytest.raises(SystemExit) as info:
            main([*argv, "--out", str(tmp_path / "m"), "--no-plot"])
        assert info.value.code == 2 and message in capsys.readouterr().err, argv
    assert not list(tmp_path.iterdir())


def test_plot_results_on_committed_records(tmp_path):
    """The 2x H200 records' `meta` was stated afterwards (no `dirty`, `cuda`): they plot; a host-path record (a
    `table` of other columns) is refused with a usage error, not a KeyError."""
    def plot(name: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_results.py"),
                               str(ROOT / "benchmarks" / name), "-o", str(tmp_path / "p.png")],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)

    refused = plot("host-path_h200x1_2026-12-01.json")
    assert refused.returncode == 2 and "not a bench record" in refused.stderr, refused.stderr[-2000:]
    pytest.importorskip("matplotlib")
    done = plot("dispatch-combine_h200x2_2026-11-30.json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "p.png").read_bytes().startswith(PNG_SIGNATURE)


def test_gpu_check_runs_every_step_and_bundles(tmp_path):
    """scripts/gpu_check.sh: an unknown step is refused before anything runs; known steps all run, the script exits
    with the failure's status, and BUNDLE (inside OUT here) packs OUT after each step without packing itself."""
    script = str(ROOT / "scripts" / "gpu_check.sh")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OUT": str(tmp_path / "o"),
           "BUNDLE": str(tmp_path / "o" / "all.tgz"),
           "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # python3 = this one
    refused = subprocess.run(["bash", script, "deepep", "tests bench"], capture_output=True, text=True, env=env,
                             timeout=60)
    assert refused.returncode == 2 and "usage: scripts/gpu_check.sh STEP" in refused.stderr
    assert not (tmp_path / "o" / "all.tgz").exists()
    # No GPU: every step stops at once with status 2 (the GPU tier would otherwise skip everything and pass).
    done = subprocess.run(["bash", script, "deepep", "tests"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.count("== gpu_check.sh") == 2
    assert "gpu_check.sh deepep: needs a GPU" in done.stderr and "gpu_check.sh tests: needs a GPU" in done.stderr
    with tarfile.open(tmp_path / "o" / "all.tgz") as bundle:
        assert not any("all.tgz" in name for name in bundle.getnames())
    assert not (tmp_path / "o" / "all.tgz.part").exists()


def test_host_path_report_renders_a_committed_record_again(tmp_path):
    """scripts/host_path_report.py on the profile_ops runs a committed record holds gives the same table, one line
    per distinct command with its count, and the PNG (matplotlib is a dev dependency)."""
    committed = json.loads((ROOT / "benchmarks" / "host-path-rerun_h200x1_2026-12-03.json").read_text())
    files = {}
    for side, runs in committed["runs"].items():
        files[side] = []
        for i, run in enumerate(runs):
            path = tmp_path / f"{side}_{i}.json"
            path.write_text(json.dumps(run))
            files[side].append(str(path))
    out = tmp_path / "report"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "host_path_report.py"), "--before", *files["before"],
                           "--after", *files["after"], "--out", str(out), "--note", "a note"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(out.with_suffix(".json").read_text())["table"] == committed["table"]
    text = out.with_suffix(".md").read_text()
    assert "--tokens 128 --iters 1000 --host-loops 50 --ops-only --json RUN.json  # x6" in text, text
    assert "--tokens 4096 --iters 1000 --host-loops 50 --ops-only --json RUN.json  # x4" in text, text
    assert out.with_suffix(".png").read_bytes().startswith(PNG_SIGNATURE)
