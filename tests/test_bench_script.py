"""scripts/bench.py runs end to end on CPU (reference backend over gloo) and writes its table and JSON."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_bench_script_smoke(tmp_path):
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench.py"), "--backend", "torch", "--tokens", "8", "16",
           "--hidden", "128", "--num-experts", "4", "--num-topk", "2", "--sms", "4", "--iters", "2",
           "--json", str(out_json), "--md", str(out_md)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out_json.read_text())
    ops = {(row["tokens"], row["op"]) for row in record["table"]}
    assert ops == {(t, op) for t in (8, 16)
                   for op in ("dispatch", "cached dispatch", "dispatch fp8", "cached dispatch fp8", "combine")}
    assert all(row["us"] > 0 for row in record["table"])
    # Back-to-back device times are a CUDA measure: none on CPU.
    assert all(row["back_to_back_us"] is None for row in record["table"])
    # The baseline comes from the same run, beside every BF16 op.
    assert all(row["baseline_us"] > 0 for row in record["table"] if "fp8" not in row["op"])
    assert "bitwise check passed" in out_md.read_text() and "SM sweep at 16 tokens" in out_md.read_text()
