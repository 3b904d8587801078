"""Training tests: exact resume, atomic checkpoints with clear errors on damage, samplers, schedule."""

from __future__ import annotations

import json
import math
import os
import stat
import time

import pytest
import torch

from looplm.config import ConfigError, FixedDepthConfig, OptimConfig, UniformDepthConfig
from looplm.model import build_model
from looplm.run.checkpoint import (CheckpointError, list_checkpoints, load_checkpoint,
                                   newest_valid_checkpoint, save_checkpoint)
from looplm.train.optim import build_optimizer, lr_factor
from looplm.train.samplers import FixedDepth, UniformDepth, build_sampler
from looplm.train.trainer import train


def _trace(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_reproduces_the_uninterrupted_loss_trace(tmp_path, tiny_cfg, tiny_data):
    full = tmp_path / "full"
    train(tiny_cfg, full, progress=False, data=tiny_data)
    part = tmp_path / "part"
    train(tiny_cfg, part, progress=False, data=tiny_data, stop_after=3)
    assert not (part / "summary.json").exists()
    assert [r["step"] for r in _trace(part)] == [1, 2, 3]
    train(tiny_cfg, part, progress=False, data=tiny_data, resume=True)
    a, b = _trace(full), _trace(part)
    assert [r["step"] for r in b] == list(range(1, 7))
    for ra, rb in zip(a, b):
        print(ra["step"], ra["loss"], rb["loss"], ra["depths"], rb["depths"])
        assert ra["depths"] == rb["depths"]
        assert ra["loss"] == rb["loss"]  # exact: resume runs the same steps
        assert ra.get("val_loss") == rb.get("val_loss")
    ma, _, _, _ = load_checkpoint(full)
    mb, _, _, _ = load_checkpoint(part)
    for (na, pa), (nb, pb) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)  # exact: resume runs the same steps


@pytest.mark.parametrize("fmt", ["consolidated", "sharded"])
def test_resume_is_exact_when_a_parameter_never_gets_a_gradient(tmp_path, tiny_cfg, tiny_data, fmt):
    """readout = "raw" leaves the final norm out of the loss, so AdamW holds no state for norm_f.weight; a
    resume must restore exactly that (found when a 600-step readout sweep run failed to resume)."""
    cfg = tiny_cfg.replace(model=tiny_cfg.model.replace(readout="raw"),
                           train=tiny_cfg.train.replace(checkpoint_format=fmt))
    full, part = tmp_path / "full", tmp_path / "part"
    train(cfg, full, progress=False, data=tiny_data)
    train(cfg, part, progress=False, data=tiny_data, stop_after=3)
    train(cfg, part, progress=False, data=tiny_data, resume=True)
    assert [r["loss"] for r in _trace(full)] == [r["loss"] for r in _trace(part)]  # exact: resume runs the same steps
    ma, mb = load_checkpoint(full)[0], load_checkpoint(part)[0]
    assert torch.equal(ma.norm_f.weight, torch.ones_like(ma.norm_f.weight))  # exact: never trained
    for (na, pa), (nb, pb) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)  # exact: resume runs the same steps


def test_resume_refuses_an_optimizer_state_from_another_model(tiny_cfg):
    from looplm.run.dist import DistEnv, full_state, load_optimizer_state

    model = build_model(tiny_cfg.model)
    opt = build_optimizer(model, tiny_cfg.optim)
    saved = full_state(model, opt, "ddp", DistEnv())[1]
    for group in saved["param_groups"]:
        group["params"] = [n for n in group["params"] if n != "norm_f.weight"]
    with pytest.raises(ValueError, match=r"norm_f\.weight"):
        load_optimizer_state(model, opt, saved, "ddp", DistEnv())


def test_truncated_checkpoint_gives_clear_error_and_previous_still_loads(tmp_path, tiny_cfg, tiny_data):
    run = tmp_path / "run"
    train(tiny_cfg, run, progress=False, data=tiny_data)
    ckpts = list_checkpoints(run)
    assert [c.name for c in ckpts] == ["step-000004", "step-000006"]
    newest, previous = ckpts[-1], ckpts[-2]
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="model.safetensors.*truncated"):
        load_checkpoint(run)
    model, cfg, state, path = load_checkpoint(previous, with_state=True)
    assert path == previous and state["step"] == 4
    assert newest_valid_checkpoint(run) == previous
    # resume falls back to the newest valid checkpoint and finishes the run
    train(tiny_cfg, run, progress=False, data=tiny_data, resume=True)
    assert load_checkpoint(run)[3].name == "step-000006"


def test_interrupted_save_leaves_previous_checkpoint(tmp_path, tiny_cfg):
    torch.manual_seed(0)
    cfg = tiny_cfg.replace(model=tiny_cfg.model.replace(vocab_size=64))
    model = build_model(cfg.model)
    save_checkpoint(tmp_path, 1, model, cfg)
    # a save killed midway leaves only a hidden temp dir; 'latest' still names step 1
    (tmp_path / "checkpoints" / ".tmp-step-000002-999").mkdir()
    (tmp_path / "checkpoints" / ".tmp-step-000002-999" / "model.safetensors").write_bytes(b"partial")
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step-000001"]
    loaded, _, _, path = load_checkpoint(tmp_path)
    assert path.name == "step-000001"
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k])  # exact: the saved weights


def test_missing_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path)


def test_uniform_sampler_is_a_function_of_seed_and_step():
    s = UniformDepth(UniformDepthConfig(lo=1, hi=8))
    draws = [s.sample(0, step) for step in range(4000)]
    assert draws == [s.sample(0, step) for step in range(4000)]
    assert draws != [s.sample(1, step) for step in range(4000)]
    counts = torch.bincount(torch.tensor(draws), minlength=9)[1:]
    assert counts.min() > 400 and counts.max() < 600  # 500 expected per depth
    assert abs(sum(draws) / len(draws) - 4.5) < 0.1
    assert FixedDepth(FixedDepthConfig(depth=5)).sample(3, 7) == 5
    assert build_sampler(FixedDepthConfig(depth=3)).sample(0, 0) == 3


def test_lr_schedule_warmup_then_cosine():
    cfg = OptimConfig(warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, cfg, 100) == pytest.approx(0.1)
    assert lr_factor(9, cfg, 100) == pytest.approx(1.0)
    assert lr_factor(10, cfg, 100) == pytest.approx(1.0)
    assert lr_factor(55, cfg, 100) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(100, cfg, 100) == pytest.approx(0.1)


def test_lr_schedule_wsd_by_hand():
    """Warm-up–stable–decay (LMDR §5.1): 5 warm-up steps of 100, flat, cosine to 0.1 over the last 10."""
    cfg = OptimConfig(warmup_steps=5, min_lr_ratio=0.1, schedule="wsd")
    want = {0: 0.2, 4: 1.0, 5: 1.0, 50: 1.0, 89: 1.0, 90: 1.0, 95: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)),
            99: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.9)), 100: 0.1, 120: 0.1}
    for step, f in want.items():
        assert lr_factor(step, cfg, 100) == pytest.approx(f, abs=1e-15), step
    # decay longer than what the warm-up leaves: the decay starts at the end of the warm-up
    short = OptimConfig(warmup_steps=9, min_lr_ratio=0.1, schedule="wsd")
    assert lr_factor(9, short, 10) == pytest.approx(1.0) and lr_factor(10, short, 10) == pytest.approx(0.1)
    with pytest.raises(ConfigError, match=r"optim.schedule: got 'linear'; allowed: 'cosine', 'wsd'"):
        OptimConfig(schedule="linear")


def test_huginn_cpu_preset_has_lmdr_optimization():
    """LMDR §5.1 / App. B.3 in the Huginn-family presets (huginn-cpu, lmdr); every other preset keeps
    cosine, (0.9, 0.95); lmdr's learned prior has the inverse-perplexity reward with the advantage scale."""
    from looplm.presets import PRESETS

    for name in ("huginn-cpu", "lmdr"):
        o, steps = PRESETS[name].optim, PRESETS[name].train.steps
        assert (o.schedule, o.warmup_steps / steps, o.beta1, o.beta2) == ("wsd", 0.05, 0.9, 0.98), name
    assert (PRESETS["lmdr"].depth.reward, PRESETS["lmdr"].depth.scale) == ("inv_ppl", True)
    for name, cfg in PRESETS.items():
        if name not in ("huginn-cpu", "lmdr"):
            assert (cfg.optim.schedule, cfg.optim.beta2) == ("cosine", 0.95), name


def test_weight_decay_on_matrices_only(tiny_cfg):
    model = build_model(tiny_cfg.model.replace(vocab_size=64, rule="adapter"))
    opt = build_optimizer(model, OptimConfig())
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    n = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert n == model.num_params()


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_model_safetensors_gets_the_umask_mode_like_the_other_files(tmp_path, tiny_cfg, umask):
    from looplm.run.checkpoint import save_checkpoint

    old = os.umask(umask)
    try:
        ckpt = save_checkpoint(tmp_path, 1, build_model(tiny_cfg.model.replace(vocab_size=64)), tiny_cfg)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in ckpt.iterdir()}
    assert modes["model.safetensors"] == 0o666 & ~umask == modes["config.json"], modes


def test_wall_s_sums_every_invocation_after_resume(tmp_path, tiny_cfg, tiny_data):
    from looplm.run.checkpoint import load_train_state

    run = tmp_path / "run"
    train(tiny_cfg, run, progress=False, data=tiny_data, stop_after=3)
    first = load_train_state(list_checkpoints(run)[-1])["wall_s"]  # the first invocation, up to step 3
    t0 = time.time()
    summary = train(tiny_cfg, run, progress=False, data=tiny_data, resume=True)
    second = time.time() - t0  # an upper bound of the training time of the second invocation
    assert 0 < first < summary["wall_s"] <= first + second
    assert json.loads((run / "summary.json").read_text())["wall_s"] == summary["wall_s"]


def test_a_run_without_checkpoint_is_not_silently_replaced(tmp_path, tiny_cfg, tiny_data):
    """A run that diverged (or was stopped) before its first checkpoint leaves only metrics.jsonl."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": null, "skipped": true}\n')
    with pytest.raises(ValueError, match=rf"--out {run} already holds metrics.jsonl, which a new run writes "
                                         r"\(the folder is not a looplm run, or its run wrote no checkpoint\); "
                                         r"pass --overwrite"):
        train(tiny_cfg, run, progress=False, data=tiny_data)
    assert (run / "metrics.jsonl").read_text() == '{"step": 1, "loss": null, "skipped": true}\n'
    train(tiny_cfg, run, progress=False, data=tiny_data, overwrite=True)
    assert [r["step"] for r in _trace(run)] == list(range(1, 7))


def test_train_cli_refuses_a_folder_with_files_it_would_replace(tmp_path, capsys):
    """`looplm train --out DIR` into a folder of the user's (not a looplm run) changes none of its files; with
    --overwrite it replaces them."""
    from looplm.cli import main

    out = tmp_path / "mine"
    out.mkdir()
    user = {"config.json": '{"mine": 1}', "tokenizer.json": "mine", "summary.json": "[]", "notes.txt": "keep"}
    for name, text in user.items():
        (out / name).write_text(text)
    argv = ["train", "--preset", "debug", "--out", str(out), "--quiet", "--train.steps", "1", "--train.eval_every", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--out {out} already holds summary.json, config.json, tokenizer.json" in err and "--overwrite" in err
    assert {p.name: p.read_text() for p in out.iterdir()} == user  # unchanged, and no .lock left
    assert main([*argv, "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "keep" and json.loads((out / "config.json").read_text())["name"]


def test_resume_with_more_steps_trains_a_finished_run_on(tmp_path, tiny_cfg, tiny_data):
    run = tmp_path / "run"
    train(tiny_cfg, run, progress=False, data=tiny_data)
    before = _trace(run)
    with pytest.raises(ValueError, match="--train.steps 4: the run in .* is at step 6 already"):
        train(tiny_cfg, run, progress=False, data=tiny_data, resume=True, steps=4)
    summary = train(tiny_cfg, run, progress=False, data=tiny_data, resume=True, steps=10)
    after = _trace(run)
    assert after[:6] == before and [r["step"] for r in after] == list(range(1, 11))
    assert summary["steps"] == summary["completed_steps"] == 10
    # the schedule follows the new total (10) from step 6 on
    for r in after[6:]:
        assert r["lr"] == pytest.approx(tiny_cfg.optim.lr * lr_factor(r["step"] - 1, tiny_cfg.optim, 10), rel=1e-12)
    assert load_checkpoint(run)[1].train.steps == 10


def _first_step_weights(monkeypatch):
    """Capture the weights the first training step sees (a copy of the state dict)."""
    import looplm.train.trainer as trainer

    seen, real = [], trainer.training_loss

    def spy(model, *args, **kwargs):
        if not seen:
            seen.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return real(model, *args, **kwargs)

    monkeypatch.setattr(trainer, "training_loss", spy)
    return seen


@pytest.mark.parametrize("source", ["run", "hf_export"])
def test_init_from_starts_from_the_source_weights_with_a_fresh_optimizer(tmp_path, tiny_cfg, tiny_data,
                                                                           monkeypatch, source):
    src = tmp_path / "src"
    train(tiny_cfg, src, progress=False, data=tiny_data)
    if source == "hf_export":
        from looplm.hf.export import export_checkpoint

        src = export_checkpoint(src, tmp_path / "hf")
    want = load_checkpoint(src)[0].state_dict()
    seen = _first_step_weights(monkeypatch)
    other = tiny_cfg.replace(model=tiny_cfg.model.replace(d_model=48), name="ft")  # replaced by the source's
    train(other, tmp_path / "ft", progress=False, data=tiny_data, init_from=src)
    assert seen[0].keys() == want.keys()
    for k, v in want.items():  # a copy of the same tensors: exact
        assert torch.equal(seen[0][k], v), k
    trace = _trace(tmp_path / "ft")
    assert trace[0]["lr"] == pytest.approx(tiny_cfg.optim.lr * lr_factor(0, tiny_cfg.optim, tiny_cfg.train.steps), rel=1e-12)  # fresh
    assert load_checkpoint(tmp_path / "ft")[1].model == load_checkpoint(src)[1].model
    with pytest.raises(ValueError, match="--init-from .* not with --resume"):
        train(tiny_cfg, tmp_path / "ft", progress=False, data=tiny_data, resume=True, init_from=src)


def test_train_cli_continues_initializes_and_overwrites(tmp_path, tiny_cfg, tiny_data, capsys):
    """The CLI forms: --resume --train.steps N (no 'ignoring' warning for it), --init-from, --overwrite."""
    from looplm.cli import main

    cfg = tmp_path / "tiny.json"
    cfg.write_text(tiny_cfg.replace(train=tiny_cfg.train.replace(steps=2, eval_every=0)).to_json())
    run = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--out", str(run), "--quiet"]) == 0
    assert main(["train", "--out", str(run), "--resume", "--train.steps", "3", "--quiet"]) == 0
    assert "ignoring" not in capsys.readouterr().err
    assert [r["step"] for r in _trace(run)] == [1, 2, 3]
    assert main(["train", "--preset", "debug", "--out", str(run), "--resume", "--train.steps", "4", "--quiet"]) == 0
    assert "ignoring --preset" in capsys.readouterr().err  # the saved config wins, and says so
    assert [r["step"] for r in _trace(run)] == [1, 2, 3, 4]
    ft = tmp_path / "ft"
    assert main(["train", "--config", str(cfg), "--out", str(ft), "--init-from", str(run), "--quiet"]) == 0
    assert [r["step"] for r in _trace(ft)] == [1, 2]
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "metrics.jsonl").write_text("{}\n")
    capsys.readouterr()
    assert main(["train", "--config", str(cfg), "--out", str(bare), "--quiet"]) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert main(["train", "--config", str(cfg), "--out", str(bare), "--overwrite", "--quiet"]) == 0
    assert [r["step"] for r in _trace(bare)] == [1, 2]
