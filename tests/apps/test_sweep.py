"""Sweeps: file parsing and errors, and an end-to-end 2 variants × 2 seeds tiny sweep that is run
again (everything skipped), then partly killed (resumed exactly) and partly un-evaluated."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tomllib
import types
from pathlib import Path

import pytest

from looplm.analysis.store import ResultStore
from looplm.apps.sweep import SweepError, load_sweep, parse_sweep, run_sweep

TOML = """
name = "tiny"
seeds = [0, 1]

[base]
config = "tiny.json"

[variants]
looped = {"model.rule" = "looped"}
scse = {model.rule = "scse"}

[eval]
depths = [1, 2, 4]
splits = ["valid", "test"]
max_tokens = 256
batch_size = 8
device = "cpu"
diagnose = {batches = 1}
lambada = {max_examples = 4}
"""


def _write_sweep(folder: Path, tiny_cfg, text: str = TOML) -> Path:
    (folder / "tiny.json").write_text(tiny_cfg.to_json())
    path = folder / "tiny.toml"
    path.write_text(text)
    return path


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads; on a shared 2-core machine they cost 10–50×."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def hooks(monkeypatch):
    """Stand-ins for looplm.diagnostics.runner and looplm.eval.lambada; counts calls."""
    calls = {"diagnose": 0, "lambada": 0}

    def diagnose_checkpoint(checkpoint, *, out_dir=None, progress=True, batches=1, device="cpu"):
        calls["diagnose"] += 1
        return {"forcing": [{"t": t, "bias_energy": 0.0, "raw_bias_energy": 0.1 * t, "ratio": 0.5 + t,
                             "anchor_energy": 1.0} for t in (0, 3)],
                "gain": [{"t": t, "gain": 1.0 + t} for t in (0, 3)]}

    def evaluate_lambada_checkpoint(checkpoint, *, depths, max_examples=None, progress=True, device="cpu"):
        calls["lambada"] += 1
        return {"depths": {str(T): {"target_ppl": 100.0 / T, "target_acc": 0.01 * T, "exact_acc": 0.0,
                                    "examples": max_examples} for T in depths}}

    for name, fn in (("looplm.diagnostics.runner", diagnose_checkpoint),
                     ("looplm.eval.lambada", evaluate_lambada_checkpoint)):
        mod = types.ModuleType(name)
        setattr(mod, fn.__name__, fn)
        monkeypatch.setitem(sys.modules, name, mod)
    return calls


def test_sweep_file_grid_and_ids(tmp_path, tiny_cfg):
    sweep = load_sweep(_write_sweep(tmp_path, tiny_cfg, TOML + '\n[grid]\n"optim.lr" = [1e-3, 2e-3]\n'))
    runs = sweep.runs()
    assert [r.run_id for r in runs][:4] == ["looped-optim.lr=0.001-s0", "scse-optim.lr=0.001-s0",
                                            "looped-optim.lr=0.002-s0", "scse-optim.lr=0.002-s0"]
    assert len(runs) == 8 and sweep.baseline == "looped"
    r = runs[-1]
    assert (r.config.model.rule, r.config.optim.lr, r.config.train.seed, r.config.name) == (
        "scse", 2e-3, 1, "scse-optim.lr=0.002-s1")
    assert r.config.model.d_model == tiny_cfg.model.d_model
    assert sweep.eval.depths == (1, 2, 4) and sweep.eval.lambada == {"max_examples": 4}


def test_docstring_example_parses():
    import looplm.apps.sweep as sweep_module

    doc = sweep_module.__doc__
    example = "\n".join(line[4:] for line in doc[doc.index("    # scse-vs-looped.toml"):
                                                 doc.index("The grid is")].splitlines())
    sweep = parse_sweep(tomllib.loads(example))
    runs = sweep.runs()
    assert len(runs) == 3 * 3 * 2 and sweep.name == "scse-vs-looped"
    assert runs[2].config.model.architecture == "unshared" and runs[2].config.train.steps == 400
    assert sweep.eval.diagnose == {} and sweep.eval.lambada == {"max_examples": 500}
    assert sweep.eval.datasets == ("brown", "wikitext2") and sweep.eval.max_tokens == 16384


def test_rule_options_in_a_sweep_file():
    """``model.options.FIELD`` keys (dotted or as a nested table) apply to the variant's rule; a variant that
    changes the rule gets that rule's options; an option the rule lacks names the variant."""
    sweep = parse_sweep(tomllib.loads("""
seeds = [0]
[base]
preset = "cpu"
"model.options.anchor_scale" = 0.2
[variants]
scse = {}
leak = {"model.rule" = "scse_leak", "model.options.leak" = 0.05}
film = {model = {rule = "step_film", options = {sigma = 0.3}}}
"""))
    opts = {r.variant: r.config.model.options for r in sweep.runs()}
    assert opts["scse"].anchor_scale == 0.2 and opts["scse"].step_scale == 0.5
    assert opts["leak"].leak == 0.05 and opts["leak"].anchor_scale == 0.2
    assert opts["film"].sigma == 0.3 and opts["film"].step_scale == 0.35 and opts["film"].anchor_scale == 0.2
    with pytest.raises(SweepError, match=r"variants\.a: model\.options\.sigma: rule looped does not use it"):
        parse_sweep({"variants": {"a": {"model.rule": "looped", "model.options.sigma": 0.3}}})


@pytest.mark.parametrize("doc, match", [
    ({"variants": {"a": {}}, "colour": 1}, r"colour: unknown key; allowed: name, seeds"),
    ({"variants": {"a": {"model.nope": 1}}}, r"variants\.a: model\.nope: unknown field; known: "),
    ({"variants": {"a": {"model.rule": "nope"}}}, r"variants\.a: model\.rule: got 'nope'; allowed: 'looped'"),
    ({"variants": {"a": {}}, "base": {"preset": "huge"}}, r"base\.preset: unknown preset 'huge'; known: "),
    ({"variants": {"a": {"train.seed": 3}}}, r"variants\.a\.train\.seed: not allowed here"),
    ({"variants": {}}, r"variants: expected a table of at least one variant"),
    ({"variants": {"a": {}}, "eval": {"splits": ["dev"]}}, r"eval\.splits: 'dev' is not allowed; allowed: train"),
    ({"variants": {"a": {}}, "eval": {"depth": [1]}}, r"eval\.depth: unknown key; allowed: depths"),
    ({"variants": {"a": {}}, "eval": {"depths": [1, "x"]}}, r"eval\.depths: expected a non-empty list"),
    ({"variants": {"a": {}}, "seeds": []}, r"seeds: expected a non-empty list of integers"),
    ({"variants": {"a": {}}, "baseline": "b"}, r"baseline: unknown variant 'b'; known: a"),
    ({"variants": {"a": {"optim.lr": 1.0}}, "grid": {"optim.lr": [1, 2]}}, r"grid\.optim\.lr: also set by"),
    ({"variants": {"a": {}}, "eval": {"lambada": "yes"}}, r"eval\.lambada: expected true, false or a table"),
])
def test_sweep_file_errors_name_the_key(doc, match):
    with pytest.raises(SweepError, match=match):
        parse_sweep(doc)


def test_bad_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("seeds = [0,\n")
    with pytest.raises(SweepError, match="not valid TOML"):
        load_sweep(bad)
    with pytest.raises(FileNotFoundError, match="no such sweep file"):
        load_sweep(tmp_path / "none.toml")


def test_cli_help_shows_the_format(capsys):
    from looplm.cli import main

    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    out = capsys.readouterr().out
    assert "[variants]" in out and 'looped = {"model.rule" = "looped"}' in out and "--out" in out


def _mtimes(out: Path) -> dict[str, int]:
    return {str(p.relative_to(out)): p.stat().st_mtime_ns for p in (out / "runs").rglob("*") if p.is_file()}


def _weights(out: Path, run_id: str) -> bytes:
    from looplm.run.checkpoint import resolve_checkpoint

    return (resolve_checkpoint(out / "runs" / run_id) / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_end_to_end_sweep_skips_and_resumes(tmp_path, tiny_cfg, hooks, capsys):
    from looplm.cli import main
    from looplm.eval.runner import evaluate_checkpoint

    path = _write_sweep(tmp_path, tiny_cfg)
    out = tmp_path / "out"
    cache: dict = {}
    first = run_sweep(path, out, progress=False, data=cache)
    ids = ["looped-s0", "scse-s0", "looped-s1", "scse-s1"]
    assert [r["run_id"] for r in first.runs] == ids
    assert [r["status"] for r in first.runs] == ["trained"] * 4
    assert len(cache) == 1  # tokenized data prepared once for the four runs
    assert hooks == {"diagnose": 4, "lambada": 4}
    with ResultStore(first.db) as store:
        n_rows = store.count()
        # ppl: 4 runs × 2 splits × 3 depths × (ppl, nll, tokens); lambada: 4 × 3 depths × 4 metrics;
        # diagnose: 4 runs × 2 loop steps × (4 forcing metrics + gain)
        assert store.count(protocol="ppl") == 4 * 2 * 3 * 3
        assert store.count(protocol="lambada") == 4 * 3 * 4
        assert store.count(protocol="diagnose") == 4 * 2 * 5
        assert n_rows == 72 + 48 + 40
        runs = store.runs("tiny")
        assert [r.run_id for r in runs] == ["looped-s0", "looped-s1", "scse-s0", "scse-s1"]
        assert all(r.params and r.flops[4]["body_head"] > r.flops[1]["body_head"] for r in runs)
        stored = {r["depth"]: r["value"] for r in store.evaluations(protocol="ppl", split="test", seed=1,
                                                                    metric="ppl", config_hash=runs[3].config_hash)}
        updated = {tuple(r.values()) for r in store.evaluations()}
    direct = evaluate_checkpoint(out / "runs" / "scse-s1", depths=[1, 2, 4], split="test", max_tokens=256,
                                 progress=False)
    assert stored == {T: direct["depths"][str(T)]["ppl"] for T in (1, 2, 4)}
    md = (out / "report" / "report.md").read_text()
    assert "## PPL — brown test" in md and "### Paired deltas vs looped: PPL — brown test" in md
    assert "| scse | 2 |" in md and (out / "report" / "ppl_brown_valid.png").is_file()

    # second run through the CLI: everything skipped, nothing retrained or re-evaluated
    before = _mtimes(out)
    assert main(["sweep", str(path), "--out", str(out), "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["skipped"], summary["trained"], summary["resumed"], summary["evaluated"]) == (4, 0, 0, 0)
    assert _mtimes(out) == before
    assert hooks == {"diagnose": 4, "lambada": 4}
    with ResultStore(first.db) as store:
        assert {tuple(r.values()) for r in store.evaluations()} == updated

    # scse-s1 killed midway through training: newest checkpoint gone, a half-written one left behind;
    # looped-s1 killed after training, during its evaluations
    weights = _weights(out, "scse-s1")
    run = out / "runs" / "scse-s1"
    shutil.rmtree(run / "checkpoints" / "step-000006")
    (run / "summary.json").unlink()
    (run / "latest").write_text("step-000004\n")
    (run / "checkpoints" / ".tmp-step-000006-999").mkdir()
    with ResultStore(first.db) as store:
        scse1 = store.run("tiny", "scse-s1")
        store.delete(config_hash=scse1.config_hash, seed=1)
        looped1 = store.run("tiny", "looped-s1")
        store.delete(config_hash=looped1.config_hash, seed=1, protocol="ppl", split="test")
    looped_ckpts = {k: v for k, v in _mtimes(out).items() if k.startswith("looped-s1/checkpoints")}
    third = run_sweep(path, out, progress=False, data=cache)
    assert [r["status"] for r in third.runs] == ["skipped", "skipped", "evaluated", "resumed"]
    assert _weights(out, "scse-s1") == weights  # exact resume: bit-identical final weights
    assert {k: v for k, v in _mtimes(out).items() if k.startswith("looped-s1/checkpoints")} == looped_ckpts
    assert hooks == {"diagnose": 5, "lambada": 5}  # only the resumed run ran its hooks again
    with ResultStore(first.db) as store:
        assert store.count() == n_rows  # replaced, never double-counted
        again = {r["depth"]: r["value"] for r in store.evaluations(protocol="ppl", split="test", seed=1,
                                                                   metric="ppl", config_hash=scse1.config_hash)}
    assert again == stored

    # a changed sweep file does not silently mix configs into existing run directories
    changed = _write_sweep(tmp_path, tiny_cfg.replace(optim=tiny_cfg.optim.replace(lr=1e-2)))
    with pytest.raises(SweepError, match=r"looped-s0: holds a run with a different config \(optim.lr"):
        run_sweep(changed, out, progress=False, data=cache)


def test_missing_hook_fails_before_training(tmp_path, tiny_cfg, monkeypatch):
    monkeypatch.setitem(sys.modules, "looplm.eval.lambada", None)  # import fails
    path = _write_sweep(tmp_path, tiny_cfg, TOML.replace("diagnose = {batches = 1}\n", ""))
    with pytest.raises(SweepError, match="eval.lambada: needs looplm.eval.lambada.evaluate_lambada_checkpoint"):
        run_sweep(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "runs").exists()


def test_missing_eval_corpus_fails_before_training(tmp_path, tiny_cfg, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # no hub fallback: the local file decides
    monkeypatch.setenv("LOOPLM_DATA", str(tmp_path / "empty"))
    (tmp_path / "empty").mkdir()
    text = TOML.replace("[eval]\n", '[eval]\ndatasets = ["wikitext2"]\n').replace('"valid", "test"', '"test"')
    path = _write_sweep(tmp_path, tiny_cfg, text)
    with pytest.raises(SweepError, match=r"eval.datasets: wikitext2 \(test split\) of run looped-s0 cannot be "
                                         r"evaluated: .*wiki.test.raw not found"):
        run_sweep(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "runs").exists()


@pytest.mark.parametrize("plan", [True, False], ids=["plan", "run"])
def test_a_damaged_results_db_is_a_clear_error_before_training(tmp_path, tiny_cfg, plan, capsys):
    """A results.db in --out that opens but is damaged in its middle: the command names it and trains nothing."""
    from helpers import damaged_results_db

    from looplm.cli import main

    path, out = _write_sweep(tmp_path, tiny_cfg), tmp_path / "out"
    db = damaged_results_db(out / "results.db")
    assert main(["sweep", str(path), "--out", str(out), "--quiet", *(["--plan"] if plan else [])]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [f"looplm sweep: error: {db}: not a usable looplm results database (database disk "
                                "image is malformed); give the path of a results.db written by `looplm sweep`, or "
                                "move the damaged file aside"]
    assert not (out / "runs").exists()


def test_shard_and_only_selection(tmp_path, tiny_cfg):
    from looplm.apps.sweep import parse_shard, select_runs

    specs = load_sweep(_write_sweep(tmp_path, tiny_cfg)).runs()
    ids = [s.run_id for s in specs]
    assert ids == ["looped-s0", "scse-s0", "looped-s1", "scse-s1"]
    assert parse_shard("1/3") == (1, 3) and parse_shard(" 0 / 1 ") == (0, 1)
    for bad in ("3/3", "1", "-1/2", "a/b", "0/0"):
        with pytest.raises(SweepError, match="--shard: expected i/n"):
            parse_shard(bad)
    shards = [[s.run_id for s in select_runs(specs, shard=(i, 3))] for i in range(3)]
    assert shards == [["looped-s0", "scse-s1"], ["scse-s0"], ["looped-s1"]]
    assert [s.run_id for s in select_runs(specs, only=["scse-s1", "looped-s0"])] == ["looped-s0", "scse-s1"]
    with pytest.raises(SweepError, match=r"--only: no run 'scse-s2' in this sweep \(did you mean scse-s"):
        select_runs(specs, only=["scse-s2"])


SHARD_TOML = """
name = "par"
seeds = [0, 1]

[base]
config = "tiny.json"
"train.steps" = 2
"train.eval_every" = 2
"train.ckpt_every" = 2

[variants]
looped = {"model.rule" = "looped"}
scse = {model.rule = "scse"}

[eval]
depths = [1, 2]
splits = ["test"]
max_tokens = 64
batch_size = 4
device = "cpu"
"""


@pytest.mark.slow
def test_plan_and_concurrent_shards_fill_one_db(tmp_path, tiny_cfg, capsys):
    """--plan lists only pending runs after a partial run; two shards running at the same time in
    separate processes leave every run's results in the one DB exactly once."""
    import os
    import subprocess

    from looplm.cli import main
    from looplm.apps.sweep import plan_sweep

    path = _write_sweep(tmp_path, tiny_cfg, SHARD_TOML)
    out = tmp_path / "out"
    ids = ["looped-s0", "scse-s0", "looped-s1", "scse-s1"]
    assert [p["run_id"] for p in plan_sweep(path, out)] == ids and not out.exists()  # plans write nothing
    first = run_sweep(path, out, progress=False, only=["looped-s0"], report=False)
    assert [r["status"] for r in first.runs] == ["trained"] and not (out / "report").exists()
    plan = plan_sweep(path, out)
    assert [(p["index"], p["run_id"], p["todo"]) for p in plan] == [
        (1, "scse-s0", ["train"]), (2, "looped-s1", ["train"]), (3, "scse-s1", ["train"])]
    assert [p["run_id"] for p in plan_sweep(path, out, shard=(0, 2))] == ["looped-s1"]
    assert main(["sweep", str(path), "--out", str(out), "--plan"]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [f"looplm sweep {path} --out {out} --only {r}" for r in ids[1:]]
    assert "3 pending of 4 runs" in captured.err

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"),
                                                        os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "looplm", "sweep", str(path), "--out", str(out),
                               "--shard", f"{i}/2", "--quiet"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    summaries = [json.loads(o[0]) for o in outs]
    assert [(s["runs"], s["trained"], s["skipped"]) for s in summaries] == [(2, 1, 1), (2, 2, 0)]
    assert all("no report written" in o[1] for o in outs)
    assert plan_sweep(path, out) == []
    with ResultStore(out / "results.db") as store:
        assert sorted(r.run_id for r in store.runs("par")) == sorted(ids)
        assert store.count(protocol="ppl") == 4 * 1 * 2 * 3  # runs × splits × depths × (ppl, nll, tokens)
        rows = store.evaluations(protocol="ppl", metric="ppl")
        assert len({(r["config_hash"], r["seed"], r["depth"]) for r in rows}) == len(rows) == 8
    assert main(["sweep", str(path), "--out", str(out), "--plan"]) == 0
    assert capsys.readouterr().out == ""


def test_kv_sharing_hook_stores_what_the_command_computes(tmp_path, tiny_cfg):
    """``eval.kv_sharing`` runs terminal KV sharing at its own recurrences R (LMDR's continuation
    protocol) and stores exactly what ``evaluate_kv_sharing_checkpoint`` returns for that checkpoint;
    a second run skips it."""
    from looplm.eval.kvsharing import evaluate_kv_sharing_checkpoint
    from looplm.run.checkpoint import resolve_checkpoint

    text = TOML.replace('scse = {model.rule = "scse"}\n', "").replace("seeds = [0, 1]", "seeds = [0]")
    text = text.replace("lambada = {max_examples = 4}", "kv_sharing = {depths = [2, 3], max_tokens = 256}")
    text = text.replace("diagnose = {batches = 1}\n", "")
    path = _write_sweep(tmp_path, tiny_cfg, text)
    assert load_sweep(path).eval.kv_sharing == {"depths": [2, 3], "max_tokens": 256}
    out = tmp_path / "out"
    first = run_sweep(path, out, progress=False)
    ckpt = resolve_checkpoint(out / "runs" / "looped-s0")
    ref = evaluate_kv_sharing_checkpoint(ckpt, [2, 3], max_tokens=256, progress=False)
    with ResultStore(first.db) as store:
        rows = store.evaluations(protocol="kv_sharing")
        got = {(r["depth"], r["metric"]): r["value"] for r in rows}
        n = store.count(protocol="kv_sharing")
    for R in (2, 3):
        for metric in ("ppl_full", "ppl_terminal", "sharing_penalty_pct", "kv_bytes_terminal"):
            assert got[(R, metric)] == pytest.approx(ref["depths"][str(R)][metric], rel=1e-9)
    with ResultStore(first.db) as store:  # every row traces to the weights and tokens it measured
        from looplm.analysis.store import IDENTITY_COLUMNS, EvalIdentity

        provs = [store.provenance(EvalIdentity(**{c: r[c] for c in IDENTITY_COLUMNS})) for r in rows]
    weights = hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest()
    assert all(p["weights_sha256"] == weights and p["tokens_sha256"] == ref["provenance"]["tokens_sha256"]
               for p in provs)
    second = run_sweep(path, out, progress=False)
    assert [r["status"] for r in second.runs] == ["skipped"]
    with ResultStore(first.db) as store:
        assert store.count(protocol="kv_sharing") == n


@pytest.mark.parametrize("value, match", [
    ({"depths": [0]}, r"eval\.kv_sharing\.depths: expected a non-empty list of integers >= 1"),
    ({"checkpoint": "x"}, r"eval\.kv_sharing\.checkpoint: set by the sweep"),
    ("yes", r"eval\.kv_sharing: expected true, false or a table"),
])
def test_kv_sharing_hook_errors(value, match):
    with pytest.raises(SweepError, match=match):
        parse_sweep({"variants": {"a": {}}, "eval": {"kv_sharing": value}})


TASK_TOML = """
name = "tasks"
seeds = [0]

[base]
config = "task.json"

[variants]
looped = {}
unshared = {"model.architecture" = "unshared", "model.n_layers" = 2, "depth.sampler" = "fixed", "depth.depth" = 2}

[eval]
depths = [1, 2, 3]
device = "cpu"
tasks = {ks = [1, 2, 4], max_examples = 6}
"""


def test_tasks_protocol_sweep_shards_store_what_eval_tasks_computes(tmp_path):
    """``eval.tasks``: two shards of a task sweep fill one DB with one row set per (k, T), equal to what
    ``evaluate_task_checkpoint`` (``looplm eval tasks``) computes; no ppl rows; a re-run skips everything."""
    from looplm.analysis.store import IDENTITY_COLUMNS, EvalIdentity
    from looplm.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig, UniformDepthConfig
    from looplm.eval.tasks import evaluate_task_checkpoint

    cfg = Config(name="task", model=ModelConfig(rule="looped", d_model=32, n_heads=2, d_ff=64, seq_len=12,
                                                 dropout=0.0, position=dict(kind="rope")),
                 data=DataConfig(dataset="task", task="modsum", task_k=2, task_heldout=8),
                 depth=UniformDepthConfig(lo=1, hi=2), optim=OptimConfig(lr=3e-3, warmup_steps=1),
                 train=TrainConfig(steps=4, batch_size=8, eval_every=2, eval_batches=1, eval_depth=2, ckpt_every=2,
                                   device="cpu"))
    (tmp_path / "task.json").write_text(cfg.to_json())
    path = tmp_path / "tasks.toml"
    path.write_text(TASK_TOML)
    out = tmp_path / "out"
    for i in (0, 1):
        res = run_sweep(path, out, progress=False, shard=(i, 2), report=False)
        assert [r["status"] for r in res.runs] == ["trained"]
    with ResultStore(out / "results.db") as store:
        assert store.count(protocol="ppl") == 0
        assert store.count(protocol="tasks") == 2 * 3 * 3 * 4  # runs × k × T × (acc, correct, n, nll)
        for run in store.runs("tasks"):
            got = {(r["dataset"], r["depth"], r["metric"]): r["value"]
                   for r in store.evaluations(protocol="tasks", config_hash=run.config_hash)}
            full = evaluate_task_checkpoint(run.run_dir, depths=[1, 2, 3], ks=[1, 2, 4], max_examples=6,
                                            progress=False)
            ref = full["accuracy"]
            # the same function on the same weights and instances: exact
            assert got == {(f"modsum-k{k}", int(T), m): float(v) for k, by_T in ref.items()
                           for T, r in by_T.items() for m, v in r.items()}
            assert got[("modsum-k1", 1, "n")] == 2 and got[("modsum-k4", 3, "n")] == 6  # k=1: 10 // 4 held out
            one = store.evaluations(protocol="tasks", config_hash=run.config_hash)[0]
            prov = store.provenance(EvalIdentity(**{c: one[c] for c in IDENTITY_COLUMNS}))
            assert prov["weights_sha256"] and prov["weights_sha256"] == full["provenance"]["weights_sha256"]
            assert prov["task"] == "modsum"
    again = run_sweep(path, out, progress=False)
    assert [r["status"] for r in again.runs] == ["skipped", "skipped"]
    md = (out / "report" / "report.md").read_text()
    assert "## acc — modsum-k4 test" in md and "nll" not in md  # the report tabulates acc only

    # eval.tasks.halting added later: only its rows are new (protocol tasks_halting, one per k, shared variants
    # only), equal to what evaluate_task_checkpoint(halting=...) computes; the tasks rows keep their identities
    halting = {"criterion": "hidden_update", "target_depth": 2}
    path.write_text(TASK_TOML.replace("max_examples = 6}", "max_examples = 6, halting = "
                                      "{criterion = \"hidden_update\", target_depth = 2}}"))
    run_sweep(path, out, progress=False, report=False)
    with ResultStore(out / "results.db") as store:
        assert store.count(protocol="tasks") == 2 * 3 * 3 * 4
        assert store.count(protocol="tasks_halting") == 1 * 3 * 5  # looped × k × (mean_depth, acc, acc_matched, n, tau)
        for run in store.runs("tasks")[:1]:
            assert run.variant == "looped"
            got = {(r["dataset"], r["depth"], r["metric"]): r["value"]
                   for r in store.evaluations(protocol="tasks_halting", config_hash=run.config_hash)}
            ref = evaluate_task_checkpoint(run.run_dir, depths=[1, 2, 3], ks=[1, 2, 4], max_examples=6,
                                           progress=False, halting=halting)["halting"]
            assert ref["ceiling"] == 3
            assert got == {(f"modsum-k{k}", 3, m): float(v) for k, r in ref["by_k"].items()
                           for m, v in {**r, "tau": ref["tau"]}.items()}
    with pytest.raises(SweepError, match=r"eval\.tasks\.halting\.criterion: got 'nope'"):
        parse_sweep({"variants": {"a": {}}, "eval": {"tasks": {"halting": {"criterion": "nope", "tau": 0}}}})


def test_tasks_hook_errors():
    with pytest.raises(SweepError, match=r"eval\.tasks\.depths: set by the sweep"):
        parse_sweep({"variants": {"a": {}}, "eval": {"tasks": {"depths": [1]}}})
