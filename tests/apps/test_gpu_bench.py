"""scripts/gpu_bench.py (issue 28 §4) end to end on CPU at toy shapes: it runs and writes valid JSON whose
derived figures agree with an independent count."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from looplm.analysis.flops import flops_per_token
from looplm.config import ModelConfig
from looplm.model import build_model

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_bench_runs_on_cpu_and_writes_valid_json(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_bench.py"), "--device", "cpu", "--tiny",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())  # strict JSON (no NaN)
    assert out.with_suffix(".md").read_text().startswith("# looplm GPU check (cpu, tiny shapes")
    cfg = ModelConfig(**res["config"], dropout=0.0)
    R = res["depth"]
    model = build_model(cfg)
    core = sum(p.numel() for p in model.core.parameters())
    # unrolled: every block application counted as its own block (1 + 4·R + 1 applications)
    assert res["params"] == sum(p.numel() for p in model.parameters())
    assert res["params_unrolled"] == res["params"] + (R - 1) * core
    assert res["train_flops_per_token"] == 3 * flops_per_token(cfg, R)["body_head"]
    for v in ("eager", "compiled"):
        mfu = res[f"train_tokens_per_s_{v}"] * res["train_flops_per_token"] / (res["matmul_peak_bf16_tflops"] * 1e12)
        assert math.isclose(res[f"train_mfu_{v}"], mfu, rel_tol=1e-9)
    assert res["targets"]["train_mfu"]["value"] == max(res["train_mfu_eager"], res["train_mfu_compiled"])
    for b in (1, 4):
        speeds = res[f"decode_b{b}_tokens_per_s"]
        assert set(speeds) == {"kvcache", "static"} and all(v > 0 for v in speeds.values())
    assert res["peak_mem_bytes"] >= res["train_peak_mem_bytes"] > 0
    prof = res["train_profile_eager"]  # shares of one step's summed self time: descending, summing to <= 1
    assert len(prof) == 15 and all(a["self_ms"] >= b["self_ms"] for a, b in zip(prof, prof[1:]))
    assert 0 < sum(e["share"] for e in prof) <= 1 + 1e-9 and all(e["calls"] >= 1 for e in prof)
