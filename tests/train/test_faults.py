"""Faults (issue 16, "nothing silent, nothing lost"): one test per known failure, each against the
behaviour a user sees — a refused second writer, a skipped NaN step, an error exit, a strict JSON file."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from looplm.cli import main
from looplm.data.tokens import sample_batch
from looplm.train import trainer as trainer_mod
from looplm.run.checkpoint import list_checkpoints, load_checkpoint, newest_valid_checkpoint, save_checkpoint
from looplm.train.trainer import train

REPO = Path(__file__).resolve().parents[2]


def _refuse(word):
    raise AssertionError(f"non-JSON constant {word}")


def _strict_lines(path: Path) -> list[dict]:
    """Records of a JSON-lines file, refusing NaN/Infinity (strict JSON, RFC 8259)."""
    return [json.loads(line, parse_constant=_refuse) for line in path.read_text().splitlines()]


def _strict_file(path: Path) -> dict:
    return json.loads(path.read_text(), parse_constant=_refuse)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_cfg, tiny_data):
    """A finished tiny run (checkpoints at steps 4 and 6); copy it before changing anything."""
    run = tmp_path_factory.mktemp("faults") / "run"
    train(tiny_cfg, run, progress=False, data=tiny_data)
    return run


def _poison(monkeypatch, tiny_cfg, tiny_data, steps):
    """Make the training loss NaN on the batches of the given 0-based steps (a pure function of the
    batch, so a resumed run meets the same NaN at the same step)."""
    B, L = tiny_cfg.train.batch_size, tiny_cfg.model.seq_len
    bad = [sample_batch(tiny_data.train, B, L, seed=tiny_cfg.train.seed, step=s)[0] for s in steps]
    real = trainer_mod.training_loss

    def loss(model, x, y, T, tcfg):
        res = real(model, x, y, T, tcfg)
        if any(torch.equal(x, b) for b in bad):
            res = dataclasses.replace(res, loss=res.loss * math.nan, ce=math.nan)
        return res

    monkeypatch.setattr(trainer_mod, "training_loss", loss)


# -- 1. run lock ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_second_trainer_is_refused_naming_the_first_and_a_killed_trainer_frees_the_folder(
        tmp_path, tiny_cfg, tiny_data, capsys):
    run = tmp_path / "run"
    cfg = tiny_cfg.replace(train=tiny_cfg.train.replace(steps=100_000, ckpt_every=1))
    (tmp_path / "cfg.json").write_text(cfg.to_json())
    first = subprocess.Popen([sys.executable, "-m", "looplm", "train", "--config", str(tmp_path / "cfg.json"),
                              "--out", str(run), "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    try:
        deadline = time.monotonic() + 180
        while not list_checkpoints(run):  # the first trainer is under way
            assert first.poll() is None, first.stderr.read()
            assert time.monotonic() < deadline, "the first trainer wrote no checkpoint in 180 s"
            time.sleep(0.2)
        # a second `looplm train --resume` into the same folder: an error exit naming the first
        assert main(["train", "--out", str(run), "--resume", "--stop-after", "1", "--quiet"]) == 2
        err = capsys.readouterr().err
        assert f"in use by another training process (pid {first.pid} on host " in err, err
        with pytest.raises(ValueError, match=rf"pid {first.pid}"):
            train(cfg, run, progress=False, data=tiny_data, resume=True, stop_after=1)
    finally:
        first.kill()  # SIGKILL: no cleanup runs; the kernel drops the lock
        first.wait()
    step = int(json.loads((newest_valid_checkpoint(run) / "manifest.json").read_text())["step"])
    summary = train(cfg, run, progress=False, data=tiny_data, resume=True, stop_after=1)  # no manual cleanup
    assert summary["completed_steps"] == step + 1
    # and a fresh (non-resume) run into a folder that holds checkpoints is refused inside train() too
    with pytest.raises(ValueError, match="already holds a run"):
        train(cfg, run, progress=False, data=tiny_data)


# -- 2. divergence guards -------------------------------------------------------------------------
def test_nonfinite_step_is_skipped_logged_and_resume_stays_exact(tmp_path, tiny_cfg, tiny_data, monkeypatch):
    _poison(monkeypatch, tiny_cfg, tiny_data, steps=[1])  # the second step
    full = tmp_path / "full"
    summary = train(tiny_cfg, full, progress=False, data=tiny_data)
    trace = _strict_lines(full / "metrics.jsonl")
    skipped = [r for r in trace if r.get("skipped")]
    assert [r["step"] for r in skipped] == [2]
    assert skipped[0]["loss"] is None and "loss" in skipped[0]["nonfinite"]
    assert all(math.isfinite(r["loss"]) for r in trace if not r.get("skipped"))  # training went on
    assert [r["skipped_steps"] for r in trace] == [0, 1, 1, 1, 1, 1]
    assert summary["skipped_steps"] == 1 and _strict_file(full / "summary.json")["skipped_steps"] == 1
    model, _, _, _ = load_checkpoint(full)
    assert all(torch.isfinite(p).all() for p in model.state_dict().values())
    # stop right after the skipped step, resume: the same trace and weights as the uninterrupted run
    part = tmp_path / "part"
    train(tiny_cfg, part, progress=False, data=tiny_data, stop_after=2)
    train(tiny_cfg, part, progress=False, data=tiny_data, resume=True)
    resumed = _strict_lines(part / "metrics.jsonl")
    assert [(r["step"], r["loss"], r["depths"], r["skipped_steps"]) for r in resumed] == \
        [(r["step"], r["loss"], r["depths"], r["skipped_steps"]) for r in trace]
    other, _, _, _ = load_checkpoint(part)
    for k, v in model.state_dict().items():
        assert torch.equal(v, other.state_dict()[k]), k  # exact: resume runs the same steps


def test_consecutive_nonfinite_steps_stop_the_run_and_keep_the_good_checkpoint(tmp_path, tiny_cfg, tiny_data,
                                                                              monkeypatch):
    cfg = tiny_cfg.replace(train=tiny_cfg.train.replace(max_nonfinite_steps=2))
    _poison(monkeypatch, cfg, tiny_data, steps=range(2, 6))  # every step from the third on
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=r"diverged: 2 consecutive steps \(3\.\.4\).*step-000002") as err:
        train(cfg, run, progress=False, data=tiny_data)
    assert type(err.value).__name__ == "DivergenceError"
    assert [c.name for c in list_checkpoints(run)] == ["step-000002"]  # nothing written after it
    model, _, _, _ = load_checkpoint(run)
    assert all(torch.isfinite(p).all() for p in model.state_dict().values())
    trace = _strict_lines(run / "metrics.jsonl")
    assert [r["step"] for r in trace] == [1, 2, 3, 4] and not (run / "summary.json").exists()


def test_a_checkpoint_is_never_written_from_nonfinite_weights(tmp_path, tiny_cfg):
    cfg = tiny_cfg.replace(model=tiny_cfg.model.replace(vocab_size=64))
    from looplm.model import build_model

    model = build_model(cfg.model)
    save_checkpoint(tmp_path, 1, model, cfg)
    with torch.no_grad():
        next(model.parameters())[0] = math.nan
    with pytest.raises(ValueError, match="non-finite weights"):
        save_checkpoint(tmp_path, 2, model, cfg)
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step-000001"]
    assert (tmp_path / "latest").read_text().strip() == "step-000001"


# -- 3. strict JSON -------------------------------------------------------------------------------
def test_strict_json_writes_null_and_names_the_nonfinite_fields():
    from looplm.run.finite import dumps

    text = dumps({"loss": math.nan, "x": [1.0, math.inf], "ok": 2.0, "nested": {"ppl": -math.inf}})
    d = json.loads(text, parse_constant=_refuse)
    assert d == {"loss": None, "x": [1.0, None], "ok": 2.0, "nested": {"ppl": None},
                 "nonfinite": ["loss", "nested.ppl", "x.1"]}
    assert json.loads(dumps({"a": 1.0})) == {"a": 1.0}  # nothing to flag: no "nonfinite" key


def test_every_report_pair_is_strict_json_plus_its_markdown(tmp_path):
    """The one JSON + Markdown writer (used by eval, diagnose, bench, kv-sharing, distill and lm-eval
    reports): a NaN becomes null and is named, the .md holds the result's Markdown, folders are made."""
    from looplm.cli.core import Report
    from looplm.run.finite import write_json_markdown

    out = tmp_path / "a" / "b" / "res.json"
    paths = write_json_markdown({"ppl": math.nan, "markdown": "| x |"}, out)
    assert paths == [out, out.with_suffix(".md")]
    assert json.loads(out.read_text(), parse_constant=_refuse) == {"ppl": None, "markdown": "| x |",
                                                                   "nonfinite": ["ppl"]}
    assert out.with_suffix(".md").read_text() == "| x |\n"
    write_json_markdown({"ppl": 1.0}, out, markdown="other")  # a Markdown given apart from the result
    assert json.loads(out.read_text()) == {"ppl": 1.0} and out.with_suffix(".md").read_text() == "other\n"
    Report(out).emit({"loss": math.inf, "markdown": "m"})  # a command's --out goes through the same writer
    assert json.loads(out.read_text(), parse_constant=_refuse)["loss"] is None and out.with_suffix(".md").read_text() == "m\n"


# -- 4. evaluation of a non-finite model ----------------------------------------------------------
def test_eval_of_a_nonfinite_model_is_an_error_exit(tmp_path, trained_run, capsys, monkeypatch):
    from safetensors.torch import save_model

    model, cfg, _, ckpt = load_checkpoint(trained_run)
    export = tmp_path / "export"  # a plain export: config.json + model.safetensors + tokenizer.json
    export.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(ckpt / name, export / name)
    with torch.no_grad():
        next(model.parameters())[0] = math.nan
    save_model(model, str(export / "model.safetensors"))
    args = ["eval", "ppl", "--checkpoint", str(export), "--depths", "1,2", "--max-tokens", "64", "--quiet"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "NaN" in err and str(export) in err
    # finite weights whose NLL is NaN (e.g. activations overflowing at depth): also an error exit
    import looplm.eval.runner as runner

    real = runner.evaluate_depths
    monkeypatch.setattr(runner, "evaluate_depths", lambda *a, **k: {
        T: {**r, "nll": math.nan, "ppl": math.nan} if T == 2 else r for T, r in real(*a, **k).items()})
    assert main(["eval", "ppl", "--checkpoint", str(trained_run), "--depths", "1,2", "--max-tokens", "64",
                 "--quiet"]) == 2
    assert "not finite at loop depth(s) 2" in capsys.readouterr().err


# -- 5. results store -----------------------------------------------------------------------------
def test_report_on_a_file_that_is_not_a_database_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "notadb.txt"
    bad.write_text("this is not a database\n" * 100)
    assert main(["report", "--db", str(bad), "--out", str(tmp_path / "report")]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "not a usable looplm results database" in err and "Traceback" not in err


def test_a_store_write_that_fails_midway_leaves_the_database_as_it_was(tmp_path):
    """(Already true before issue 16 — every write is one transaction; kept as a regression test.)"""
    from looplm.analysis.store import EvalIdentity, ResultStore
    from looplm.config import Config

    def ident(depth):
        return EvalIdentity.make(Config(), "ppl", dataset="brown", split="test", depth=depth)

    class Broken:
        def __float__(self):
            raise RuntimeError("disk went away")

    with ResultStore(tmp_path / "r.db") as store:
        store.put_many([(ident(1), {"ppl": 10.0})])
        before = store.evaluations()
        with pytest.raises(RuntimeError, match="disk went away"):  # the second identity's write fails
            store.put_many([(ident(1), {"ppl": 99.0, "nll": 1.0}), (ident(2), {"ppl": 5.0, "nll": Broken()})])
        assert store.evaluations() == before
    with ResultStore(tmp_path / "r.db") as store:  # and on disk, seen by a new connection
        assert store.evaluations() == before


# -- 6. checkpoint manifest mismatch --------------------------------------------------------------
def test_an_edited_config_json_is_reported_field_by_field(tmp_path, trained_run):
    from looplm.run.checkpoint import CheckpointError

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    ckpt = list_checkpoints(run)[-1]
    text = (ckpt / "config.json").read_text()
    assert '"lr": 0.003' in text
    (ckpt / "config.json").write_text(text.replace('"lr": 0.003', '"lr": 0.004'))  # same size
    with pytest.raises(CheckpointError, match=r"config.json: differs from manifest.json: same size.*sha256 "
                                              r"[0-9a-f]{16}… on disk.*edited fields: optim.lr 0.003 → 0.004"):
        load_checkpoint(run)
    (ckpt / "config.json").write_text(text.replace('"lr": 0.003', '"lr": 0.1').replace('"steps": 6', '"steps": 60'))
    with pytest.raises(CheckpointError, match=r"bytes on disk, \d+ in the manifest.*optim.lr 0.003 → 0.1, "
                                              r"train.steps 6 → 60"):
        load_checkpoint(run)
    (ckpt / "config.json").write_text(text[:100])  # cut short: says so instead of listing fields
    with pytest.raises(CheckpointError, match=r"config.json: differs .*no longer parses as JSON"):
        load_checkpoint(run)


# -- 7. bench -------------------------------------------------------------------------------------
def test_bench_flags_an_impossible_mfu_and_an_unstable_machine():
    from looplm.apps.bench import judge_targets

    targets = {"mfu": (">=", 0.6), "loop_overhead_ratio": (">=", 0.97), "tbptt_peak_mem_ratio": ("<=", 1.3)}
    res = {"mfu": 1.4, "loop_overhead_ratio": 1.0, "tbptt_peak_mem_ratio": 1.0, "stability": {"stable": True}}
    status = {k: t["status"] for k, t in judge_targets(res, targets).items()}
    assert status == {"mfu": "invalid", "loop_overhead_ratio": "met", "tbptt_peak_mem_ratio": "met"}
    res = {**res, "mfu": 0.7, "loop_overhead_ratio": 0.5, "stability": {"stable": False}}
    judged = judge_targets(res, targets)
    # timed targets of an unstable run are neither met nor missed; memory is not timed
    assert {k: t["status"] for k, t in judged.items()} == {"mfu": "unstable", "loop_overhead_ratio": "unstable",
                                                           "tbptt_peak_mem_ratio": "met"}
    assert not judged["mfu"]["met"]
    res = {**res, "loop_overhead_ratio": 0.5, "stability": {"stable": True}}
    assert judge_targets(res, targets)["loop_overhead_ratio"]["status"] == "not met"
    # an interval (interleaved rounds) decides: met / not met only when every round agrees
    for rounds, status in (([0.98, 1.0, 0.99], "met"), ([0.96, 0.98, 0.99], "undecided"), ([0.9, 0.95], "not met")):
        res = {**res, "loop_overhead_ratio": sorted(rounds)[len(rounds) // 2],
               "intervals": {"loop_overhead_ratio": {"rounds": rounds, "min": min(rounds), "max": max(rounds)}}}
        assert judge_targets(res, targets)["loop_overhead_ratio"]["status"] == status


def test_interleaved_rounds_ratio_of_known_sleeps():
    import time

    from looplm.apps.bench import interleaved

    iv = interleaved(lambda: time.sleep(0.002), lambda: 0.004, rounds=3, repeat=2, device=torch.device("cpu"),
                     scale=0.5)
    # B reports its own 4 ms; A sleeps ≥ 2 ms (a loaded machine only lengthens it): 0.5 × 4 / t_A ≤ 1
    assert len(iv["rounds"]) == 3 and iv["min"] <= iv["median"] <= iv["max"] <= 1.0
    assert iv["b_s"] == pytest.approx(0.004)


# -- 8. demo --------------------------------------------------------------------------------------
def test_readme_demo_table_is_the_rendering_of_the_committed_results():
    from looplm.apps.demo import readme_table, results_markdown

    readme = (REPO / "README.md").read_text()
    begin, end = "<!-- demo-results:begin -->\n", "\n<!-- demo-results:end -->"
    assert begin in readme and end in readme, "README.md: demo table markers missing"
    table = readme[readme.index(begin) + len(begin): readme.index(end)]
    committed = json.loads((REPO / "experiments/demo/results.json").read_text())
    assert table == readme_table(committed), "regenerate with: python experiments/demo/readme_table.py --write"
    assert (REPO / "experiments/demo/results.md").read_text() == results_markdown(committed), \
        "regenerate with: python experiments/demo/readme_table.py --write"
    # the depth-use cell against the stored PPLs read directly (training depth: uniform 1..8 -> 8)
    ppl = {int(T): r["ppl"] for T, r in committed["models"]["looped"]["eval"]["Brown test"].items()}
    best = min(ppl, key=ppl.get)
    assert f"| `looped` | T=1 {ppl[1]:.1f} · T=8 {ppl[8]:.1f} · best {ppl[best]:.1f} (T={best}) |" in table


def _shape(obj):
    """Key structure of a nested dict, leaves as type names (int and float both "number")."""
    if isinstance(obj, dict):
        return {k: _shape(v) for k, v in obj.items()}
    return "number" if isinstance(obj, (int, float)) and not isinstance(obj, bool) else type(obj).__name__


@pytest.mark.slow
def test_a_short_demo_run_has_the_committed_results_structure_and_a_title_from_its_rules(tmp_path, capsys):
    from looplm.apps.demo import run_demo

    kwargs = dict(steps=2, eval_tokens=64, depths=[1, 2], rules="looped", progress=False, preset="debug")
    run_demo(tmp_path, **kwargs)
    res = run_demo(tmp_path, **kwargs)  # a rerun skips the finished training
    assert "looped: already trained" in capsys.readouterr().out
    assert (tmp_path / "results.md").read_text().splitlines()[0] == "# looplm demo: looped baseline across loop depths"
    fresh = _strict_file(tmp_path / "results.json")
    assert fresh == json.loads(json.dumps(res))
    committed = json.loads((REPO / "experiments/demo/results.json").read_text())
    assert fresh.keys() == committed.keys()
    assert fresh["preset"].keys() == committed["preset"].keys()
    assert fresh["unigram_ppl"].keys() == committed["unigram_ppl"].keys()
    model, ref = fresh["models"]["looped"], committed["models"]["looped"]
    assert model.keys() == ref.keys() and model["train"].keys() == ref["train"].keys()
    assert model["eval"].keys() == ref["eval"].keys()
    for title in ref["eval"]:
        assert list(model["eval"][title]) == ["1", "2"]
        assert {repr(_shape(r)) for r in model["eval"][title].values()} == \
            {repr(_shape(r)) for r in ref["eval"][title].values()}
    from looplm.apps.demo import readme_table

    assert "| `looped` |" in readme_table(fresh)  # the README renderer reads a fresh results.json
    # an unknown rule is refused before any work: no output folder, no data preparation
    from looplm.config import ConfigError

    with pytest.raises(ConfigError, match="model.rule: got 'nosuch'"):
        run_demo(tmp_path / "never", **{**kwargs, "rules": "looped,nosuch"})
    assert not (tmp_path / "never").exists()
