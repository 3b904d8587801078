"""The command line's structure: one eval subcommand per protocol with only its own options, output
paths checked before any work, no abbreviations, "did you mean" on misspellings, Markdown by default."""

from __future__ import annotations

import json
import re

import pytest

from looplm.cli import build_parser, main
from looplm.cli.core import CliError, build_all, doc_args, split_config_overrides


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny trained run (debug preset, 2 steps) shared by the tests of this module."""
    run = tmp_path_factory.mktemp("cli") / "run"
    assert main(["train", "--preset", "debug", "--out", str(run), "--quiet", "--train.steps", "2",
                 "--train.eval_every", "0"]) == 0
    return run


@pytest.fixture
def afile(tmp_path):
    """A regular file: ``afile/x.json`` cannot be written."""
    f = tmp_path / "afile"
    f.write_text("not a folder\n")
    return f


# ---------------------------------------------------------------- output paths before any work
@pytest.mark.parametrize("argv", [
    ["eval", "ppl", "--depths", "1", "--max-tokens", "200"],
    ["eval", "kv-sharing", "--depths", "1", "--max-tokens", "200"],
    ["eval", "lambada", "--depths", "1", "--max-examples", "2"],
    ["eval", "adaptive", "--targets", "2", "--ceiling", "3", "--max-tokens", "300"],
    ["eval", "halting", "--k-max", "2", "--n-calib", "2", "--n-timed", "2"],
    ["diagnose", "--depth", "3", "--batches", "1", "--batch-size", "1"],
    ["generate", "--prompt", "The jury", "--max-new-tokens", "2", "--depth", "1"],
], ids=["eval-ppl", "eval-kv-sharing", "eval-lambada", "eval-adaptive", "eval-halting",
        "diagnose", "generate"])
def test_unwritable_out_is_refused_before_the_work(ckpt, afile, argv, capsys):
    out = afile / "x.json"
    rc = main([*argv, "--checkpoint", str(ckpt), "--out", str(out)] + (["--quiet"] if argv[0] != "generate" else []))
    err = capsys.readouterr().err
    assert rc == 2
    assert str(out) in err and "afile is a file, not a folder" in err and "Traceback" not in err


def _sweep_file(tmp_path):
    sweep = tmp_path / "s.toml"
    sweep.write_text('[base]\npreset = "debug"\n"train.steps" = 2\n\n[variants]\nlooped = {"model.rule" = "looped"}\n')
    return str(sweep)


def _results_db(tmp_path):
    from looplm.analysis.store import ResultStore

    ResultStore(tmp_path / "results.db").close()
    return str(tmp_path / "results.db")


@pytest.mark.parametrize("make_argv", [
    lambda tmp, out: ["bench", "--preset", "debug", "--steps", "1", "--matmul-n", "64", "--batch-size", "1",
                      "--depth", "1", "--quiet", "--out", str(out)],
    lambda tmp, out: ["sweep", _sweep_file(tmp), "--out", str(out), "--quiet"],
    lambda tmp, out: ["report", "--db", _results_db(tmp), "--out", str(out)],
    lambda tmp, out: ["train", "--preset", "debug", "--quiet", "--train.steps", "2", "--out", str(out)],
    lambda tmp, out: ["demo", "--steps", "1", "--eval-tokens", "100", "--depths", "1", "--rules", "looped",
                      "--quiet", "--out", str(out)],
    lambda tmp, out: ["export", "--checkpoint", str(tmp / "missing"), "--out", str(out)],
], ids=["bench", "sweep", "report", "train", "demo", "export"])
def test_unwritable_out_folder_is_refused_before_the_work(make_argv, afile, tmp_path, capsys):
    out = afile / "sub"
    assert main(make_argv(tmp_path, out)) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: cannot be written: {afile} is a file, not a folder" in err and "Traceback" not in err


def _tree(root):
    """Every path under ``root`` (folders too) → its bytes (None for a folder)."""
    return {p.relative_to(root): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("case", ["is", "holds", "lies inside", "inside-checkpoint", "link"])
def test_export_out_apart_from_its_checkpoint_is_refused_before_the_work(tiny_ckpt, tmp_path, case, capsys):
    """`looplm export --out` that is the source checkpoint, its run folder, lies inside or holds it: refused
    (even with --overwrite) before anything is written, so the checkpoint still loads."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_ckpt, run)
    step = run / "checkpoints" / "step-000001"
    (tmp_path / "link").symlink_to(run)  # the run folder under another name: compared resolved
    src, out, how = {"is": (step, step, "is"), "holds": (step, run, "holds"), "lies inside": (run, run / "hf", case),
                     "inside-checkpoint": (step, step / "hf", "lies inside"),
                     "link": (step, tmp_path / "link", "holds")}[case]
    before = _tree(run)
    assert main(["export", "--checkpoint", str(src), "--out", str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: {how} --checkpoint {src}" in err and "Traceback" not in err
    assert _tree(run) == before  # not a file changed, no folder created


def test_check_apart_compares_path_components_not_strings(tmp_path):
    from looplm.cli.core import check_apart

    run = tmp_path / "run"
    for out in (tmp_path / "run2", tmp_path / "run-hf", tmp_path / "hf"):  # siblings: a prefix is not a parent
        check_apart(out, "--out", [("--checkpoint", run / "checkpoints" / "step-000001")])
    with pytest.raises(CliError, match=r"--out .*/run/\.\./run: is --checkpoint"):
        check_apart(run / ".." / "run", "--out", [("--checkpoint", run)])


def test_lm_eval_out_and_db_are_checked_before_the_work(afile, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    for flag in ("--out", "--db"):
        bad = afile / "x.json"
        assert main(["lm-eval", "--checkpoint", str(tmp_path / "missing"), "--tasks", "t", flag, str(bad)]) == 2
        err = capsys.readouterr().err
        assert f"looplm lm-eval: error: {flag} {bad}: cannot be written" in err and "Traceback" not in err


def test_out_parents_are_created_first(ckpt, tmp_path, capsys):
    out = tmp_path / "deep" / "er" / "ppl.json"
    assert main(["eval", "ppl", "--checkpoint", str(ckpt), "--depths", "1,2", "--max-tokens", "200", "--quiet",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["depths"].keys() == {"1", "2"}
    assert out.with_suffix(".md").read_text().startswith("| model |")


# ---------------------------------------------------------------- human vs machine output
def test_eval_prints_markdown_by_default_and_json_on_request(ckpt, capsys):
    base = ["eval", "ppl", "--checkpoint", str(ckpt), "--depths", "1", "--max-tokens", "200", "--quiet"]
    assert main(base) == 0
    out, err = capsys.readouterr()
    assert out.startswith("| model |") and '"markdown"' not in out
    assert err == ""  # --quiet: no progress bars
    assert main([*base, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["depths"]["1"]["tokens"] == 200


# ---------------------------------------------------------------- abbreviations and misspellings
def test_abbreviations_are_refused(capsys):
    assert main(["info", "--preset", "debug", "--train.step", "5", "--print_config"]) == 2
    assert re.search(r"train\.step\b.*did you mean (--train\.)?steps\?", capsys.readouterr().err)
    with pytest.raises(SystemExit) as exc:
        main(["info", "--preset", "debug", "--dep", "8"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --dep 8; did you mean --depths?" in capsys.readouterr().err


def test_misspelled_config_field_and_option_get_a_suggestion(capsys):
    # the suggestion for a config field may come from the config (apply_overrides' ConfigError)
    assert main(["train", "--preset", "debug", "--out", "unused", "--model.d_modle", "5"]) == 2
    assert re.search(r"model\.d_modle\b.*did you mean (--model\.)?d_model\?", capsys.readouterr().err)
    with pytest.raises(SystemExit):
        main(["eval", "ppl", "--checkpoint", "x", "--max-tokes", "5"])
    assert "did you mean --max-tokens?" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # config overrides belong to train and info
        main(["eval", "ppl", "--checkpoint", "x", "--model.rule", "looped"])
    assert "takes no config overrides" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a valueless override is reported by the command it was given to
        main(["train", "--preset", "debug", "--train.steps"])
    err = capsys.readouterr().err
    assert "usage: looplm train" in err and "looplm train: error: --train.steps: expected a value" in err


def test_print_config_applies_overrides(capsys):
    assert main(["train", "--preset", "debug", "--train.steps=7", "--model.rule", "looped", "--print_config"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["train"]["steps"] == 7 and cfg["model"]["rule"] == "looped"
    # a per-rule option (three dotted parts) goes through the same generic path
    assert main(["info", "--preset", "debug", "--model.options.anchor_scale", "0.25", "--print_config"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["options"]["anchor_scale"] == 0.25
    # a task difficulty outside the family's range is refused here, as `train` refuses it, not printed
    assert main(["train", "--preset", "task-pointer_pairs", "--data.task_k", "9", "--print_config"]) == 2
    assert "data.task_k: task pointer_pairs needs 1 <= k <= 7, got 9" in capsys.readouterr().err


# ---------------------------------------------------------------- eval protocols
@pytest.mark.parametrize("protocol, foreign", [
    ("lambada", ["--stride", "4"]), ("lambada", ["--max-tokens", "4"]), ("adaptive", ["--stride", "4"]),
    ("halting", ["--targets", "2"]), ("kv-sharing", ["--scale-clamp"]), ("ppl", ["--tolerance", "0.1"]),
    ("ppl", ["--max-examples", "3"]),
])
def test_eval_protocols_refuse_each_others_options(protocol, foreign, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["eval", protocol, "--checkpoint", "x", *foreign])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"looplm eval {protocol}: error: unrecognized arguments: {foreign[0]}" in err
    assert f"{foreign[0]} is an option of looplm eval" in err


def test_eval_options_come_from_the_driven_functions():
    """Defaults are the functions' own (lambada batches 32 windows, halting 160 calibration windows),
    and every generated option is a parameter with a default of the function its command calls."""
    import inspect

    import argparse

    parser = build_all(build_parser())

    def walk(p: argparse.ArgumentParser):  # every (sub)parser once (aliases share a parser)
        yield p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in {id(c): c for c in action.choices.values()}.values():
                    yield from walk(sub)

    driven = [(p.prog, func, names) for p in walk(parser) for func, names in p.get_default("_driven") or ()]
    assert {prog for prog, _, _ in driven} >= {"looplm eval ppl", "looplm eval kv-sharing", "looplm eval lambada",
                                                "looplm eval adaptive", "looplm eval halting", "looplm diagnose", "looplm gradcheck",
                                                "looplm bench", "looplm demo", "looplm report"}
    for prog, func, names in driven:
        params = inspect.signature(func).parameters
        for name in names:
            assert name in params, f"{prog}: {func.__name__} has no parameter {name}"
    lam = parser.parse_args(["eval", "lambada", "--checkpoint", "c"])
    assert lam.batch_size == 32 and lam._params == ("depths", "max_examples", "batch_size", "device")
    halt = parser.parse_args(["eval", "halting", "--checkpoint", "c", "--k-max", "5", "--split-timed", "valid"])
    assert (halt.k_max, halt.split_timed, halt.n_calib, halt.tolerance) == (5, "valid", 160, 0.01)


def test_every_option_has_help_text():
    """``--help`` explains each option: a text beyond its default (config fields, listed as --SECTION.FIELD, too)."""
    import argparse

    def walk(p: argparse.ArgumentParser):
        yield p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in {id(c): c for c in action.choices.values()}.values():
                    yield from walk(sub)

    def text(help_: str | None) -> str:  # the help without "(default X)" or a config field's "[X]"
        return re.sub(r"\(default[^)]*\)|\[[^]]*\]$", "", help_ or "").strip()

    bare = [f"{p.prog} {a.option_strings[-1]}" for p in walk(build_all(build_parser())) for a in p._actions
            if a.option_strings and a.help is not argparse.SUPPRESS and not text(a.help)]
    assert not bare, bare


# ---------------------------------------------------------------- helpers
def test_split_config_overrides():
    rest, ov = split_config_overrides(["--out", "d", "--optim.lr", "-1e-3", "--model.rule=scse", "--quiet",
                                       "--model.options.kappa", "0.1", "--", "--x.y", "1"])
    assert rest == ["--out", "d", "--quiet", "--", "--x.y", "1"]
    assert ov == {"optim.lr": "-1e-3", "model.rule": "scse", "model.options.kappa": "0.1"}
    with pytest.raises(CliError, match="--train.steps: expected a value"):
        split_config_overrides(["--train.steps", "--quiet"])


def test_doc_args_reads_google_style_args():
    def f(a, b, c):
        """Do it.

        Args:
            a: the first
                continued.
            b, c: both.

        Returns:
            nothing: really.
        """
    assert doc_args(f) == {"a": "the first continued.", "b": "both.", "c": "both."}


def test_top_level_help_imports_no_torch():
    """`looplm --help` builds only the command list (README: it starts at once): no torch, numpy or
    tokenizers import, in a fresh interpreter."""
    import subprocess
    import sys

    code = ("import sys\nfrom looplm.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'numpy', 'tokenizers', 'safetensors', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_mapping_parameter_takes_a_json_object(capsys):
    """A ``Mapping`` parameter (eval tasks' ``halting``) is one JSON-object option; anything else is refused."""
    parser = build_parser()
    args = parser.parse_args(["eval", "tasks", "--checkpoint", "c", "--halting",
                              '{"criterion": "margin", "tau": 0.5}'])
    assert args.halting == {"criterion": "margin", "tau": 0.5}
    with pytest.raises(SystemExit):
        parser.parse_args(["eval", "tasks", "--checkpoint", "c", "--halting", "[1]"])
    assert "expected a JSON object" in capsys.readouterr().err


def _main_interrupted(argv):
    """``main(argv)``; a KeyboardInterrupt that leaves it fails the test instead of stopping pytest."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt left looplm.cli.main (a traceback for the user)")


def test_ctrl_c_during_train_is_one_line_exit_130_and_no_checkpoint(tmp_path, monkeypatch, capsys):
    """Ctrl-C in step 4 of 6 (checkpoints every 2): exit 130, one stderr line pointing at --resume, no
    checkpoint written on the way out; --resume then finishes the run."""
    from looplm.train.trainer import _Run

    real = _Run.step

    def step(self, step):
        if step == 3:
            raise KeyboardInterrupt
        return real(self, step)

    monkeypatch.setattr(_Run, "step", step)
    run = tmp_path / "run"
    assert _main_interrupted(["train", "--preset", "debug", "--out", str(run), "--quiet", "--train.steps", "6",
                              "--train.ckpt_every", "2", "--train.eval_every", "0"]) == 130
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"looplm train: interrupted; --resume continues from the newest checkpoint "
                                         f"in {run}"]
    assert captured.out == ""
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-000002"]
    monkeypatch.setattr(_Run, "step", real)
    assert main(["train", "--out", str(run), "--quiet", "--resume"]) == 0
    assert json.loads((run / "summary.json").read_text())["completed_steps"] == 6


def test_ctrl_c_in_a_command_without_resume_is_one_line_exit_130(monkeypatch, capsys):
    import looplm.analysis.flops

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(looplm.analysis.flops, "config_info", interrupted)
    assert _main_interrupted(["info", "--preset", "debug"]) == 130
    assert capsys.readouterr().err.splitlines() == ["looplm info: interrupted"]
