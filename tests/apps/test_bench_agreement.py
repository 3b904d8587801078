"""benchmarks/bench_agreement.py (issue 28 §3): two bench results compared ratio by ratio."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("bench_agreement", Path(__file__).resolve().parents[2] / "benchmarks"
                                              / "bench_agreement.py")
mod = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(mod)


def test_agreement_over_shared_ratios(tmp_path):
    a = {"mfu": 0.60, "loop_overhead_ratio": 0.965, "decode_compile_speedup": 1.02, "only_a": 3.0,
         "targets": {"mfu": {}, "loop_overhead_ratio": {}, "only_a": {}}, "intervals": {"decode_compile_speedup": {}}}
    b = {"mfu": 0.63, "loop_overhead_ratio": 0.965, "decode_compile_speedup": 1.10,
         "targets": {"mfu": {}, "loop_overhead_ratio": {}}, "intervals": {"decode_compile_speedup": {}}}
    res = mod.agreement(a, b)
    rows = {r["key"]: r for r in res["rows"]}
    assert set(rows) == {"mfu", "loop_overhead_ratio", "decode_compile_speedup"}  # only_a is not in b
    assert abs(rows["mfu"]["rel_diff"] - 0.03 / 0.615) < 1e-12 and rows["mfu"]["agree"]  # 4.9%
    assert rows["loop_overhead_ratio"]["rel_diff"] == 0.0
    assert not rows["decode_compile_speedup"]["agree"] and not res["agree"]  # 0.08 / 1.06 = 7.5%
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert mod.main([str(pa), str(pb), "--out", str(tmp_path / "cmp")]) == 1
    assert json.loads((tmp_path / "cmp.json").read_text())["rows"] == res["rows"]
    assert "2 of 3 ratios agree within 5%" in (tmp_path / "cmp.md").read_text()


def test_no_shared_ratio_a_null_value_or_another_shape_never_agree():
    assert not mod.agreement({"targets": {"mfu": {}}, "mfu": 0.6}, {"targets": {"x": {}}, "x": 1.0})["agree"]
    res = mod.agreement({"targets": {"mfu": {}}, "mfu": None}, {"targets": {"mfu": {}}, "mfu": 0.6})
    assert res["rows"] == [{"key": "mfu", "a": None, "b": 0.6, "rel_diff": None, "agree": False}]
    with pytest.raises(ValueError, match="different things: depth 8 vs 4"):
        mod.agreement({"depth": 8}, {"depth": 4})
