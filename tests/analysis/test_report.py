"""Statistics against hand-computed values, and the report of a synthetic results DB (no training)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from looplm.analysis.report import build_report, format_delta, write_report
from looplm.analysis.stats import bootstrap_interval, mean_std, summarize_paired, t_half_width
from looplm.analysis.store import EvalIdentity, ResultStore, RunRecord
from looplm.config import Config, ModelConfig

T_975_2 = 4.302652729911275  # t_{0.975, 2} from tables


def test_mean_std_and_t_half_width_by_hand():
    assert mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0)
    m, s = mean_std([5.0])
    assert m == 5.0 and math.isnan(s)
    hw = t_half_width([1.0, 2.0, 3.0])
    print("t half-width", hw, "expected", T_975_2 / math.sqrt(3))
    assert hw == pytest.approx(T_975_2 / math.sqrt(3), abs=1e-9)
    assert round(hw, 5) == 2.48414
    assert t_half_width([4.0, 4.0, 4.0]) == 0.0
    assert math.isnan(t_half_width([1.0]))
    # n = 2: t_{0.975,1} = 12.7062047; values [0, 2] → sd √2, hw = 12.7062047·√2/√2
    assert t_half_width([0.0, 2.0]) == pytest.approx(12.706204736174698, rel=1e-9)
    with pytest.raises(ValueError, match="values"):
        mean_std([])


def test_bootstrap_is_deterministic_and_degenerates_correctly():
    assert bootstrap_interval([3.5, 3.5, 3.5, 3.5]) == (3.5, 3.5)  # constant deltas: zero width
    assert bootstrap_interval([7.0]) == (7.0, 7.0)
    x = [1.0, 2.0, 3.0, 10.0]
    a, b = bootstrap_interval(x), bootstrap_interval(x)
    assert a == b  # same call, same interval
    y = list(np.random.default_rng(5).normal(size=7))
    assert bootstrap_interval(y, seed=1) != bootstrap_interval(y)  # the seed is what fixes it
    assert min(x) <= a[0] < np.mean(x) < a[1] <= max(x)
    # two values: resample means are 0, 0.5, 1 with prob 1/4, 1/2, 1/4 → the 2.5/97.5 percentiles are 0 and 1
    assert bootstrap_interval([0.0, 1.0]) == (0.0, 1.0)
    # by hand with the same Generator: percentile of resample means
    rng = np.random.default_rng(0)
    means = np.asarray(x)[rng.integers(0, 4, size=(10_000, 4))].mean(axis=1)
    assert a == tuple(np.percentile(means, [2.5, 97.5]))


def test_summarize_paired_matches_keys():
    s = summarize_paired({0: 11.0, 1: 22.0, 2: 33.0, 9: 5.0}, {0: 10.0, 1: 20.0, 2: 30.0, 7: 1.0})
    assert s.n == 3 and s.keys == (0, 1, 2) and s.deltas == (1.0, 2.0, 3.0)
    assert s.mean == 2.0 and s.sd == 1.0
    assert s.t_half_width == pytest.approx(2.48414, abs=1e-5)
    assert s.t_interval == pytest.approx((2.0 - 2.48414, 2.0 + 2.48414), abs=1e-5)
    assert s.bootstrap == bootstrap_interval([1.0, 2.0, 3.0])
    assert summarize_paired({0: 1.0}, {1: 1.0}) is None


def test_claim_verdict_reads_the_t_interval_on_the_claimed_side():
    from looplm.analysis.stats import claim_verdict

    # deltas [1, 2, 3]: t interval (−0.484, 4.484) contains 0
    assert claim_verdict(summarize_paired({0: 11.0, 1: 22.0, 2: 33.0}, {0: 10.0, 1: 20.0, 2: 30.0})) == "not resolved"
    # deltas [−3, −2, −4]: mean −3, sd 1, interval −3 ± 2.484 → (−5.48, −0.52): below 0
    lower = summarize_paired({0: 7.0, 1: 8.0, 2: 6.0}, {0: 10.0, 1: 10.0, 2: 10.0})
    assert claim_verdict(lower) == "reproduces" and claim_verdict(lower, expect="positive") == "opposite"
    higher = summarize_paired({0: 10.0, 1: 10.0, 2: 10.0}, {0: 7.0, 1: 8.0, 2: 6.0})
    assert claim_verdict(higher) == "opposite" and claim_verdict(higher, expect="positive") == "reproduces"
    # fewer pairs than min_pairs: the sign of the mean only
    two = summarize_paired({0: 1.0, 1: 2.0}, {0: 3.0, 1: 3.0})
    assert claim_verdict(two) == "provisional (2 pairs): claimed side"
    assert claim_verdict(two, min_pairs=2) == "not resolved"  # deltas [−2, −1]: −1.5 ± 6.35
    assert claim_verdict(summarize_paired({0: 5.0}, {0: 4.0})) == "provisional (1 pair): other side"
    assert claim_verdict(summarize_paired({0: 4.0}, {0: 4.0})) == "provisional (1 pair): tie"
    assert claim_verdict(None) == "no data"
    with pytest.raises(ValueError, match="expect"):
        claim_verdict(lower, expect="lower")
    with pytest.raises(ValueError, match="min_pairs"):
        claim_verdict(lower, min_pairs=1)


# -- a synthetic results DB -------------------------------------------------------------------------

LOOPED = {0: 100.0, 1: 102.0, 2: 104.0}  # T=8: mean 102, sd 2
SCSE = {s: v + d for (s, v), d in zip(LOOPED.items(), (1.0, 2.0, 3.0))}  # deltas [1, 2, 3]


def _cfg(**model) -> Config:
    return Config(model=ModelConfig(vocab_size=512, d_model=32, n_heads=2, d_ff=64, seq_len=32, **model))


def _fill(store: ResultStore) -> None:
    from looplm.analysis.flops import flops_per_token

    variants = [("looped", _cfg(rule="looped"), LOOPED), ("scse", _cfg(rule="scse"), SCSE),
                ("unshared", _cfg(architecture="unshared", n_layers=2), {0: 150.0})]
    for order, (name, cfg, t8) in enumerate(variants):
        for seed, v8 in t8.items():
            c = cfg.replace(train=cfg.train.replace(seed=seed))
            store.put_run(RunRecord(sweep="syn", run_id=f"{name}-s{seed}", variant=name, variant_order=order,
                                    seed=seed, config=c.to_dict(), run_dir=f"/runs/{name}-s{seed}",
                                    params=1_000_000 * (order + 1),
                                    flops={T: flops_per_token(c.model, T) for T in (1, 8)}))
            settings = {"max_tokens": 4096, "stride": None}
            items = [(EvalIdentity.make(c, "ppl", dataset="brown", split="test", depth=T, settings=settings),
                      {"ppl": v, "nll": math.log(v), "tokens": 4096.0}) for T, v in ((1, v8 + 50.0), (8, v8))]
            store.put_many(items, config=c, settings=settings)
            # a stale duplicate of the same identity must not add a seed: put replaces
            store.put_many(items, config=c, settings=settings)
            if name != "unshared":
                store.put_many([(EvalIdentity.make(c, "diagnose", dataset="brown", split="valid", depth=47),
                                 {"forcing.ratio": 0.0 if name == "scse" else 1.5 + seed, "gain": 1.1})])


def test_report_cells_on_a_synthetic_db(tmp_path):
    db = tmp_path / "results.db"
    with ResultStore(db) as store:
        _fill(store)
        rep = build_report(store)
    assert rep["baseline"] == "looped" and rep["variants"] == ["looped", "scse", "unshared"]
    ppl = next(s for s in rep["sections"] if s["protocol"] == "ppl")
    assert ppl["depths"] == [1, 8]
    assert ppl["cells"]["looped"]["8"]["n"] == 3
    assert ppl["deltas"]["scse"]["8"]["deltas"] == [1.0, 2.0, 3.0]
    assert "looped" not in ppl["deltas"]

    res = write_report(db, tmp_path / "report")
    md = res["markdown"].read_text()
    print(md)
    boot = bootstrap_interval([1.0, 2.0, 3.0])
    assert "| variant | n | T=1 | T=8 |" in md
    assert "| looped | 3 | 152.00 ± 2.00 | 102.00 ± 2.00 |" in md
    assert "| scse | 3 | 154.00 ± 3.00 | 104.00 ± 3.00 |" in md
    assert "| unshared | 1 | 200.00 | 150.00 |" in md  # one seed: the mean alone
    cell = f"2.00 ± 2.48 [{boot[0]:.2f}, {boot[1]:.2f}]"
    assert cell == "2.00 ± 2.48 [1.00, 3.00]"  # P(all three resampled deltas = 1) = 1/27 > 2.5%
    assert f"| scse | 3 | {cell} | {cell} |" in md
    assert "| unshared | 1 | 50.00 (n=1) | 50.00 (n=1) |" in md
    assert "### Paired deltas vs looped: PPL — brown test" in md
    # parameter + FLOP proxy table: the unshared model's body saturates at n_layers
    from looplm.analysis.flops import flops_per_token

    f8 = flops_per_token(_cfg(rule="scse").model, 8)["body_head"] / 1e6
    assert "| scse | shared | scse | 2,000,000 |" in md and f"{f8:.2f} |" in md
    assert "| unshared | unshared | – | 3,000,000 |" in md
    # diagnostics: loop-step columns, mean ± std
    assert "| variant | n | t=47 |" in md
    assert "| looped | 3 | 2.50 ± 1.00 |" in md and "| scse | 3 | 0.00 ± 0.00 |" in md
    # outputs
    assert [p.name for p in res["plots"]] == ["ppl_brown_test.png"] and res["plots"][0].stat().st_size > 0
    assert "![PPL — brown test](ppl_brown_test.png)" in md
    data = json.loads(res["json"].read_text())
    assert data["sections"][0]["cells"]["unshared"]["8"]["std"] is None  # NaN → null (strict JSON)
    assert data["models"][1]["params"] == 2_000_000


def test_report_baseline_choice_and_errors(tmp_path):
    db = tmp_path / "results.db"
    with ResultStore(db) as store:
        _fill(store)
        rep = build_report(store, baseline="scse")
        ppl = rep["sections"][0]
        assert ppl["deltas"]["looped"]["8"]["mean"] == -2.0
        with pytest.raises(ValueError, match="--baseline: unknown variant 'nope'; known: looped, scse, unshared"):
            build_report(store, baseline="nope")
    with ResultStore(tmp_path / "empty.db") as store, pytest.raises(ValueError, match="no runs"):
        build_report(store)


def test_report_cli(tmp_path, capsys):
    from looplm.cli import main

    db = tmp_path / "results.db"
    with ResultStore(db) as store:
        _fill(store)
    assert main(["report", "--db", str(db), "--out", str(tmp_path / "rep"), "--baseline", "looped"]) == 0
    out = capsys.readouterr().out
    assert "| looped | 3 | 152.00 ± 2.00 | 102.00 ± 2.00 |" in out
    assert (tmp_path / "rep" / "report.json").is_file()
    assert main(["report", "--db", str(tmp_path / "missing.db")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_format_delta():
    s = summarize_paired({0: 3.0, 1: 5.0}, {0: 1.0, 1: 1.0}).to_dict()
    assert format_delta(s).startswith("3.00 ± 12.71 [")


def test_claim_helpers_cells_curves_and_settled_ranking(tmp_path):
    from looplm.analysis.claims import (curves_by_variant, depth_use_cell, mean_std_cell, paired_claim,
                                        settled_ranking, validation_curves)

    assert mean_std_cell([]) == "–" and mean_std_cell([2.0]) == "2.0" and mean_std_cell([1.0, 3.0], 2) == "2.00 ± 1.41"
    assert mean_std_cell([1e-10, 3e-10], 2, notation="e") == "2.00e-10 ± 1.41e-10"
    # deltas [−3, −2, −4]: −3 ± 2.484 (t, n = 3), bootstrap as summarize_paired's
    cell, verdict = paired_claim({0: 7.0, 1: 8.0, 2: 6.0}, {0: 10.0, 1: 10.0, 2: 10.0})
    lo, hi = bootstrap_interval([-3.0, -2.0, -4.0])
    assert cell == f"-3.0 [-5.5, -0.5] (boot. {lo:+.1f}, {hi:+.1f})" and verdict == "**reproduces**"
    assert paired_claim({0: 7.0, 1: 8.0, 2: 6.0}, {0: 10.0, 1: 10.0, 2: 10.0}, expect="positive")[1] == "**opposite**"
    assert paired_claim({0: 1.0}, {0: 3.0}) == ("-2.0 (1 seed)", "provisional (1 pair): claimed side")
    assert paired_claim({0: 1.0}, {1: 3.0}) == ("–", "no data")
    # depth use: means T=1 (10+20)/2 = 15, T=4 (8+6)/2 = 7, T=8 (9+9)/2 = 9 (best: T=4, lowest)
    by_depth = {1: {0: 10.0, 1: 20.0}, 4: {0: 8.0, 1: 6.0}, 8: {0: 9.0, 1: 9.0}}
    assert depth_use_cell(by_depth, 8) == "T=1 15.0 · T=8 9.0 · best 7.0 (T=4)"
    assert depth_use_cell(by_depth, 8, higher_is_better=True, digits=0) == "T=1 15 · T=8 9 · best 15 (T=1)"
    assert depth_use_cell(by_depth, 8, signed=True) == "T=1 +15.0 · T=8 +9.0 · best +7.0 (T=4)"
    assert depth_use_cell(by_depth, 5) == "–" and depth_use_cell({}, 1) == "–"

    runs = tmp_path / "runs"
    for run_id, rows in {"a-s0": [(100, 50.0), (200, 30.0), (300, 20.0)], "a-s1": [(100, 50.0), (200, 30.0)],
                         "b-s0": [(100, 40.0), (200, 40.0), (300, 30.0)]}.items():
        (runs / run_id).mkdir(parents=True)
        lines = []
        for step, ppl in rows:
            lines += [json.dumps({"step": step - 1, "loss": 1.0}),
                      json.dumps({"step": step, "val_ppl": ppl, "val_state_rms": ppl / 10})]
        (runs / run_id / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (runs / "a-s0" / "summary.json").write_text("{}")
    cache = tmp_path / "curves.json"
    curves = validation_curves(runs, cache)
    assert curves["a-s0"] == {"steps_done": 300, "finished": True, "val": {"100": 50.0, "200": 30.0, "300": 20.0}}
    assert curves["a-s1"]["finished"] is False and curves["a-s1"]["steps_done"] == 200
    rms = validation_curves(runs, tmp_path / "rms.json", extra=["val_state_rms"])
    assert rms["a-s0"]["val_state_rms"] == {"100": 5.0, "200": 3.0, "300": 2.0} and rms["a-s0"]["val"] == curves["a-s0"]["val"]
    assert curves_by_variant(rms, "val_state_rms")["b"] == {100: [4.0], 200: [4.0], 300: [3.0]}
    # the cache keeps the curves when the run folders are gone
    import shutil

    shutil.rmtree(runs)
    assert validation_curves(runs, cache) == curves
    by = curves_by_variant(curves)
    assert by["a"] == {100: [50.0, 50.0], 200: [30.0, 30.0], 300: [20.0]} and by["b"][300] == [30.0]
    # means a 50, 30, 20 and b 40, 40, 30: b < a at 100, a < b from 200 on
    assert settled_ranking(by) == (["a", "b"], 200, 300)
    assert settled_ranking({"a": {100: [1.0]}, "b": {200: [1.0]}}) is None


def test_diagnose_sections_cache_survives_run_folders(tmp_path):
    from looplm.analysis.claims import diagnose_sections

    runs = tmp_path / "runs"
    docs = {"a-s0": {"scale": {"d": 8, "loops": [{"k": 1, "rms": 2.0}, {"k": 4, "rms": 3.5}]}},
            "a-s1": {"scale": {}}, "b-s0": {"convergence": {"tau": 0.5}}}
    for run_id, doc in docs.items():
        (runs / run_id / "diagnose").mkdir(parents=True)
        (runs / run_id / "diagnose" / "diagnose.json").write_text(json.dumps(doc))
    cache = tmp_path / "scale.json"
    pick = lambda sc: {"d": sc["d"], "k": {str(x["k"]): x["rms"] for x in sc["loops"]}}  # noqa: E731
    want = {"a-s0": {"d": 8, "k": {"1": 2.0, "4": 3.5}}}  # empty and absent sections are skipped
    assert diagnose_sections(runs, cache, "scale", pick) == want
    assert json.loads(cache.read_text()) == want
    import shutil

    shutil.rmtree(runs)
    assert diagnose_sections(runs, cache, "scale", pick) == want
    assert diagnose_sections(runs, tmp_path / "none.json", "scale", pick) == {}
    assert not (tmp_path / "none.json").exists()


def test_claim_tables_and_plot(tmp_path):
    from looplm.analysis.claims import curves_table, plot_mean_curves, status_table

    curves = {"a-s0": {"steps_done": 300, "finished": True, "val": {}},
              "a-s1": {"steps_done": 170, "finished": False, "val": {}}}
    rows = status_table(["a", "b"], {"a": 1234}, {"a": [0]}, curves)
    assert rows[2:] == ["| `a` | 1,234 | 0 | seed 1 (170) |", "| `b` | – | – | – |"]
    assert status_table(["a"], {}, {}, {})[0].startswith("**Not run yet:**")
    rows = status_table(["a", "b"], {"a": 1234}, {"a": [0]}, curves, depth_use=("depth use", {"a": "x"}))
    assert rows[:3] == ["| variant | depth use | params | seeds evaluated | runs in progress (step) |",
                        "|---|---|---:|---|---|", "| `a` | x | 1,234 | 0 | seed 1 (170) |"] and rows[3].startswith("| `b` | – |")
    by = {"a": {100: [50.0, 52.0], 200: [30.0]}, "b": {100: [40.0], 200: [40.0]}}
    table = curves_table(by, ["a", "b"])
    assert table[:4] == ["| variant | 100 | 200 |", "|---|---:|---:|", "| `a` | 51 | 30 [1] |", "| `b` | 40 | 40 |"]
    assert table[-1].startswith("Ranking of the means at step 200") and "a < b; unchanged since step 200" in table[-1]
    png = plot_mean_curves({"a": {1: [2.0, 4.0], 4: [3.0]}, "empty": {}}, tmp_path / "c.png", xlabel="x", ylabel="y",
                           log2x=True, vline=2)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
