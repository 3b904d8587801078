"""Config validation, presets against the paper's parameter counts and FLOP proxies, and the CLI."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import typing

import pytest
import torch

from looplm.analysis.flops import flops_per_token
from looplm.cli import main
from looplm.config import (RULE_NAMES, BPTTConfig, Config, ConfigError, DataConfig, EndpointConfig, FixedDepthConfig,
                           LearnedDepthConfig, ModelConfig, PLNDepthConfig, SCSELeakOptions, SCSEOptions, TBPTTConfig,
                           TrainConfig, UniformDepthConfig, apply_overrides)
from looplm.model import build_model
from looplm.presets import PRESETS, get_preset


def n_params(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        return build_model(cfg).num_params()


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs, field", [
    (dict(rule="loopy"), "model.rule"),
    (dict(d_model=30, n_heads=4), "model.n_heads"),
    (dict(dropout=1.5), "model.dropout"),
    (dict(options={"anchor": "zero"}), "model.options.anchor"),
    (dict(n_core=0), "model.n_core"),
    (dict(options={"mask": "yes"}), "model.options.mask"),
    (dict(rule="looped", options={"sigma": 0.9}), "model.options.sigma"),
    (dict(rule="scse_leak", options={"leak": 1.5}), "model.options.leak"),
])
def test_model_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as info:
        ModelConfig(**kwargs)
    assert str(info.value).startswith(field)


def _bounded_fields():
    """``(class, field, type, Range)`` of every config field with a range in its annotation."""
    from looplm.config import RULE_OPTIONS, ChoiceSection, OptimConfig, Range
    from looplm.distill.config import DistillConfig
    from looplm.rl.config import RLConfig

    variants = [v for base in ChoiceSection.__subclasses__() for v in base.VARIANTS.values()]
    for cls in {*RULE_OPTIONS.values(), *variants, ModelConfig, DataConfig, OptimConfig, TrainConfig, RLConfig,
                DistillConfig}:
        for name, tp in typing.get_type_hints(cls, include_extras=True).items():
            yield from ((cls, name, tp.__origin__, r) for r in getattr(tp, "__metadata__", ()) if isinstance(r, Range))


@pytest.mark.parametrize("cls, name, tp, bound", sorted(_bounded_fields(), key=lambda c: (c[0].__name__, c[1])),
                         ids=lambda x: x.__name__ if isinstance(x, type) else str(x))
def test_ranges_refuse_the_first_values_outside(cls, name, tp, bound):
    """A ``Range`` annotation refuses the first value below it (its edge too when strict) and its upper edge,
    naming the field and the range."""
    shown = (f"{'>' if bound.strict else '>='} {bound.lo:g}" if bound.below == math.inf else
             f"in {'(' if bound.strict else '['}{bound.lo:g}, {bound.below:g})")
    outside = [tp(bound.lo) if bound.strict else tp(bound.lo) - (1 if tp is int else 0.5)]
    outside += [tp(bound.below)] if bound.below != math.inf else []
    for value in outside:
        with pytest.raises(ConfigError, match=re.escape(f"{cls._prefix}{name}: must be {shown}, got {value}")):
            cls(**{name: value})


def test_error_lists_allowed_values():
    with pytest.raises(ConfigError, match="model.rule: got 'loopy'; allowed: 'looped', 'adapter', .*'scse'"):
        ModelConfig(rule="loopy")
    with pytest.raises(ConfigError, match="depth.hi: must be >= depth.lo=5"):
        UniformDepthConfig(lo=5, hi=2)
    with pytest.raises(ConfigError, match="data.dataset"):
        DataConfig(dataset="pile")
    with pytest.raises(ConfigError, match="data.text_files"):
        DataConfig(dataset="text")
    with pytest.raises(ConfigError, match="train.checkpoint_format: got 'shards'; allowed: 'consolidated', 'sharded'"):
        TrainConfig(checkpoint_format="shards")


def test_json_round_trip_and_format_version():
    cfg = get_preset("scse-22m")
    again = Config.from_json(cfg.to_json())
    assert again == cfg
    d = json.loads(cfg.to_json())
    assert d["format_version"] == 4
    d["format_version"] = 3
    with pytest.raises(ConfigError, match="format_version"):
        Config.from_dict(d)
    d["format_version"] = 4
    d["model"]["widthh"] = 3
    with pytest.raises(ConfigError, match="model.widthh: unknown field"):
        Config.from_dict(d)


def test_overrides_parse_types():
    cfg = apply_overrides(get_preset("cpu"), {"model.rule": "sc_cond", "optim.lr": "1e-3",
                                              "model.options.mask": "false", "train.steps": "7"})
    assert cfg.model.rule == "sc_cond" and cfg.optim.lr == 1e-3 and cfg.model.options.mask is False
    assert cfg.train.steps == 7
    with pytest.raises(ConfigError, match="train.steps: cannot parse"):
        apply_overrides(cfg, {"train.steps": "many"})
    with pytest.raises(ConfigError, match="optimizer: unknown section"):
        apply_overrides(cfg, {"optimizer.lr": "1"})


# ---------------------------------------------------------------- rule options and format 2
def test_format3_round_trip_is_strict(tmp_path, capsys):
    for cfg in [*PRESETS.values(), *(Config(model=ModelConfig(rule=rule)) for rule in RULE_NAMES)]:
        assert Config.from_json(cfg.to_json()) == cfg
    d = Config().to_dict()
    for section, name in (("model", "d_model"), ("optim", "lr"), ("data", "dataset"), ("depth", "hi")):
        broken = json.loads(json.dumps(d))
        del broken[section][name]
        with pytest.raises(ConfigError, match=rf"^{section}\.{name}: missing"):
            Config.from_dict(broken)
    broken = json.loads(json.dumps(d))
    del broken["model"]["options"]["leak"]
    with pytest.raises(ConfigError, match=r"^model\.options\.leak: missing"):
        Config.from_dict(broken)
    broken = json.loads(json.dumps(d))
    broken["model"]["leak"] = 0.0  # an option outside model.options
    with pytest.raises(ConfigError, match=r"^model\.leak: unknown field"):
        Config.from_dict(broken)
    del d["format_version"]
    with pytest.raises(ConfigError, match="^format_version: missing"):
        Config.from_dict(d)
    # --config FILE: a missing field is an error naming it, not the default (d_model 384)
    small = Config(model=ModelConfig(d_model=64, n_heads=2)).to_dict()
    del small["model"]["d_model"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(small))
    assert main(["info", "--config", str(path)]) == 2
    assert "model.d_model: missing" in capsys.readouterr().err
    # --preset with --config: one starting config, not a silently ignored preset
    path.write_text(Config(model=ModelConfig(d_model=64, n_heads=2)).to_json())
    assert main(["info", "--config", str(path), "--preset", "cpu"]) == 2
    assert "--preset and --config: give one starting config" in capsys.readouterr().err
    assert main(["info", "--config", str(path)]) == 0 and '"d_model": 64' in capsys.readouterr().out


@pytest.mark.parametrize("key", ["optim.lr", "optim.weight_decay", "model.dropout", "model.options.eps",
                                 "optim.min_lr_ratio"])
@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_hyper_parameters_are_refused(key, value):
    with pytest.raises(ConfigError, match=rf"^{key.replace('.', chr(92) + '.')}: must be finite"):
        apply_overrides(Config(), {key: value})


def test_out_of_range_values_are_refused():
    for key, value in (("optim.lr", "0"), ("optim.weight_decay", "-0.1"), ("model.options.leak", "1.5"),
                       ("model.options.step_scale", "-1")):
        with pytest.raises(ConfigError, match=rf"^{key.replace('.', chr(92) + '.')}: must be"):
            apply_overrides(Config(), {key: value})


def test_unused_options_are_refused_naming_rule_and_options(capsys):
    with pytest.raises(ConfigError, match=r"^model\.options\.sigma: rule looped does not use it \(an option of "
                                          r"step_film\); options of looped: step_scale$"):
        apply_overrides(Config(), {"model.rule": "looped", "model.options.sigma": "0.9"})
    with pytest.raises(ConfigError, match=r"^model\.options\.sigma: rule looped does not use it"):
        ModelConfig(rule="looped", options={"sigma": 0.9})
    with pytest.raises(ConfigError, match=r"^model\.options: SCSEOptions holds the options of scse; rule looped "
                                          r"takes LoopedOptions"):
        ModelConfig(rule="looped", options=SCSEOptions())
    with pytest.raises(ConfigError, match="the unshared architecture has no rule options"):
        apply_overrides(Config(), {"model.architecture": "unshared", "model.options.leak": "0.1"})
    # the CLI: the example no longer trains silently
    assert main(["info", "--preset", "debug", "--model.rule", "looped", "--model.options.sigma", "0.9"]) == 2
    assert "model.options.sigma: rule looped does not use it" in capsys.readouterr().err


def test_misspelled_names_get_a_suggestion():
    for key, hint in (("model.d_modle", "d_model"), ("modle.d_model", "model"), ("optim.lrr", "lr"),
                      ("model.options.leek", "leak")):
        with pytest.raises(ConfigError, match=rf"unknown .*\(did you mean {hint}\?\)"):
            apply_overrides(Config(), {key: "1"})
    d = Config().to_dict()
    d["trian"] = d.pop("train")
    with pytest.raises(ConfigError, match=r"^trian: unknown section \(did you mean train\?\)"):
        Config.from_dict(d)


def test_rule_change_rebuilds_options():
    base = apply_overrides(Config(), {"model.options.anchor_scale": "0.2", "model.options.mask": "false"})
    assert base.model.options == SCSEOptions(anchor_scale=0.2, mask=False)
    # the new rule's defaults (s = 0.35, not SCSE's 0.5), set options it shares carried, given ones applied
    cfg = apply_overrides(base, {"model.rule": "scse_leak", "model.options.leak": "0.1"})
    assert cfg.model.options == SCSELeakOptions(anchor_scale=0.2, mask=False, leak=0.1)
    with pytest.raises(ConfigError, match=r"^model\.options\.mask: False was set for rule scse, but rule adapter "
                                          r"has no such option"):
        apply_overrides(base, {"model.rule": "adapter"})
    cfg = apply_overrides(Config(), {"model.rule": "adapter"})
    assert cfg.model.options.step_scale == 0.35 and cfg.model.replace(rule="looped").options.step_scale == 1.0
    assert apply_overrides(Config(), {"model.architecture": "unshared"}).model.options is None


def test_info_list_shows_options(capsys):
    assert main(["info", "--list"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["cpu"]["options"]["step_scale"] == 0.5 and listed["huginn-cpu"]["options"]["state_init"] == "gaussian"
    assert listed["unshared-4x320"]["options"] is None


# ---------------------------------------------------------------- paper figures (SPEC §1, §9)
def test_scse_22m_matches_paper_parameter_count():
    p = n_params(get_preset("scse-22m").model)
    assert p == 22_003_200  # 50257·384 + 128·384 + block 2,359,296 + A, I 2·384² + 3 norms
    assert round(p / 1e6) == 22


@pytest.mark.parametrize("preset, millions", [("unshared-4x320", 22.7), ("unshared-6x288", 22.5)])
def test_parameter_matched_controls(preset, millions):
    assert round(n_params(get_preset(preset).model) / 1e6, 1) == millions


def test_transformer8_reference_is_about_77mb_in_16bit():
    p = n_params(get_preset("transformer-8").model)
    assert round(2 * p / 1e6) == 76  # paper: "roughly 77 MB" of 16-bit parameters


@pytest.mark.parametrize("preset, millions", [("scse-95m", 95.6), ("scse-136m", 136.5)])
def test_larger_paper_shapes(preset, millions):
    """The paper's 95.6M / 136.5M equal the shared-block model with three d×d source matrices
    (A, I, W_in: the adapter family at that shape); SCSE's main method uses two (A, I)."""
    cfg = get_preset(preset).model
    d = cfg.d_model
    assert round(n_params(cfg.replace(rule="adapter")) / 1e6, 1) == millions
    assert n_params(cfg) == n_params(cfg.replace(rule="adapter")) - d * d - 1


def test_flop_proxy_matches_paper():
    cfg = get_preset("scse-22m").model
    f8, f48 = flops_per_token(cfg, 8), flops_per_token(cfg, 48)
    assert round(f8["body"] / 1e6, 1) == 39.3 and round(f8["body_head"] / 1e6, 1) == 77.9
    assert round(f48["body"] / 1e6, 1) == 235.9 and round(f48["body_head"] / 1e6, 1) == 274.5
    unshared = get_preset("transformer-8").model
    assert flops_per_token(unshared, 48) == flops_per_token(unshared, 8)  # min(T, n_layers)


def test_flop_proxy_counts_grouped_query_attention():
    """k and v project to d_kv = n_kv_heads·head_dim: the attention projections cost 4d² + 4·d·d_kv."""
    from looplm.analysis.flops import block_flops_per_token

    mha = ModelConfig(d_model=384, n_heads=6, d_ff=1024, seq_len=256)
    gqa = mha.replace(n_kv_heads=2)  # d_kv = 128
    assert block_flops_per_token(mha) == 8 * 384 ** 2 + 6 * 384 * 1024 + 4 * 256 * 384
    assert block_flops_per_token(gqa) == block_flops_per_token(mha) - 4 * 384 * (384 - 128)
    assert block_flops_per_token(mha.replace(n_kv_heads=6)) == block_flops_per_token(mha)


def test_every_preset_builds():
    for name, cfg in PRESETS.items():
        assert n_params(cfg.model) > 0, name


# ---------------------------------------------------------------- CLI
def test_info_json(capsys):
    assert main(["info", "--preset", "scse-22m", "--depths", "8,48"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["params"] == 22_003_200
    assert info["flops_per_token"]["8"] == {"body": 39_321_600, "body_head": 77_918_976}
    assert info["flops_per_token"]["48"]["body_head"] == 274_526_976


def test_cli_bad_values_give_clear_errors(capsys):
    assert main(["info", "--preset", "scse-22m", "--model.rule", "loopy"]) == 2
    assert "model.rule" in capsys.readouterr().err
    assert main(["info", "--preset", "nope"]) == 2
    assert "known:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "ppl", "--checkpoint", "x", "--depths", "1,a"])


def test_python_dash_m_help():
    out = subprocess.run([sys.executable, "-m", "looplm", "train", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "--model.rule" in out and "recurrence rule" in out and "--resume" in out


@pytest.mark.slow
def test_debug_train_then_eval_end_to_end(tmp_path, capsys):
    """`looplm train --preset debug` on real Brown text, then `looplm eval` writes per-depth JSON."""
    run = tmp_path / "run"
    assert main(["train", "--preset", "debug", "--out", str(run), "--quiet", "--train.steps", "30"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed_steps"] == 30
    trace = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert trace[-1]["loss"] < trace[0]["loss"] - 0.5  # it learns
    out = tmp_path / "eval.json"
    assert main(["eval", "ppl", "--checkpoint", str(run), "--depths", "1,8,48", "--out", str(out), "--quiet",
                 "--max-tokens", "2000"]) == 0
    res = json.loads(out.read_text())
    assert set(res["depths"]) == {"1", "8", "48"}
    for r in res["depths"].values():
        assert r["tokens"] == 2000 and r["ppl"] == pytest.approx(torch.tensor(r["nll"]).exp().item())
    assert out.with_suffix(".md").read_text().startswith("| model |")
    # held-out corpus with the checkpoint's own tokenizer
    capsys.readouterr()
    assert main(["eval", "ppl", "--checkpoint", str(run), "--dataset", "wikitext2", "--depths", "4", "--quiet",
                 "--max-tokens", "500", "--json"]) == 0
    held_out = json.loads(capsys.readouterr().out)
    assert held_out["dataset"] == "wikitext2" and held_out["depths"]["4"]["tokens"] == 500


def test_eval_tasks_lambada_and_adaptive(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--preset", "debug", "--out", str(run), "--quiet", "--train.steps", "10"]) == 0
    out = tmp_path / "lambada.json"
    assert main(["eval", "lambada", "--checkpoint", str(run), "--depths", "1,4", "--max-examples", "20",
                 "--quiet", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["depths"]) == {"1", "4"}
    for r in res["depths"].values():
        assert r["examples"] == 20 and 0.0 <= r["exact_acc"] <= 1.0 and 0.0 <= r["target_acc"] <= 1.0
        assert r["target_ppl"] > 1
    out = tmp_path / "adaptive.json"
    assert main(["eval", "adaptive", "--checkpoint", str(run), "--targets", "2,3", "--ceiling", "4",
                 "--max-tokens", "2000", "--quiet", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["targets"]) == {"2", "3"}
    assert abs(res["targets"]["3"]["valid_mean_depth"] - 3) <= 0.5


def test_cli_argument_and_run_dir_errors(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--preset", "debug", "--out", str(run), "--quiet", "--train.steps", "4"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    # training into a finished run without --resume is refused; --resume with more steps continues it
    assert main(["train", "--preset", "debug", "--out", str(run), "--quiet"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert main(["train", "--out", str(run), "--quiet", "--resume", "--train.steps", "9"]) == 0
    longer = json.loads((run / "summary.json").read_text())
    assert (summary["completed_steps"], longer["completed_steps"]) == (4, 9)
    # a damaged newest checkpoint: resume warns and names it
    r2 = tmp_path / "r2"
    assert main(["train", "--preset", "debug", "--out", str(r2), "--quiet", "--train.steps", "6",
                 "--train.ckpt_every", "2", "--stop-after", "4"]) == 0
    weights = r2 / "checkpoints" / "step-000004" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    capsys.readouterr()
    assert main(["train", "--out", str(r2), "--quiet", "--resume"]) == 0
    err = capsys.readouterr().err
    assert "skipping damaged checkpoint step-000004" in err and "resuming from step-000002" in err
    for bad in (["eval", "ppl", "--checkpoint", str(run), "--batch-size", "0"],
                ["eval", "ppl", "--checkpoint", str(run), "--max-tokens", "-5"],
                ["eval", "ppl", "--checkpoint", str(run), "--depths", ""],
                ["train", "--preset", "debug", "--out", str(tmp_path / "x"), "--stop-after", "-3"]):
        with pytest.raises(SystemExit):
            main(bad)
    assert main(["eval", "ppl", "--checkpoint", str(run), "--device", "tpu", "--quiet"]) == 2
    assert "--device" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["train", "--preset", "debug", "--out", str(tmp_path / "y"), "--train.device", "cuda"]) == 2
        assert "train.device=cuda but no CUDA device" in capsys.readouterr().err
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{nope")
    assert main(["info", "--config", str(bad_json)]) == 2
    assert str(bad_json) in capsys.readouterr().err


@pytest.mark.parametrize("overrides, field", [
    (dict(model=dict(architecture="unshared"), train=dict(supervision="exit_weighted")), "train.supervision"),
    (dict(model=dict(architecture="unshared", scale_control=dict(kind="inter_loop_norm"))), "model.scale_control"),
    (dict(model=dict(architecture="unshared", exit_gate=True)), "model.exit_gate"),
    (dict(model=dict(architecture="unshared", options={"leak": 0.0})), "model.options"),
])
def test_unshared_rejects_loop_only_options(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        Config(model=ModelConfig(**overrides["model"]), train=TrainConfig(**overrides.get("train", {})))


@pytest.mark.parametrize("depth, nominal, largest", [
    (FixedDepthConfig(depth=5), 5, 5), (UniformDepthConfig(lo=1, hi=8), 8, 8),
    (PLNDepthConfig(mean=5.0, cap=64), 5, 64), (LearnedDepthConfig(mean=4.5, cap=32), 5, 32),
])
def test_nominal_and_max_depth(depth, nominal, largest):
    assert (depth.nominal_depth(), depth.max_depth()) == (nominal, largest)


def test_depth_section_holds_only_the_samplers_fields():
    """``depth.sampler`` picks the class; a new sampler carries the same-named fields over (learned → pln keeps
    mean, sigma, cap; the learned-only fields go); a field the sampler does not read is an error naming the
    sampler and its fields; the section round-trips through JSON with only those fields."""
    cfg = apply_overrides(Config(), {"depth.sampler": "learned", "depth.mean": "4", "depth.cap": "16",
                                     "depth.reward": "inv_ppl"})
    assert cfg.depth == LearnedDepthConfig(mean=4.0, cap=16, reward="inv_ppl")
    assert apply_overrides(cfg, {"depth.sampler": "pln"}).depth == PLNDepthConfig(mean=4.0, cap=16)
    assert cfg.to_dict()["depth"]["sampler"] == "learned" and Config.from_json(cfg.to_json()) == cfg
    fixed = apply_overrides(Config(), {"depth.sampler": "fixed", "depth.depth": "3"})
    assert fixed.to_dict()["depth"] == {"sampler": "fixed", "depth": 3}
    with pytest.raises(ConfigError, match=r"^depth\.lo: sampler fixed does not read it \(a field of uniform\); "
                                          r"fields of fixed: depth$"):
        apply_overrides(fixed, {"depth.lo": "2"})
    with pytest.raises(ConfigError, match=r"^depth\.sampler: got 'poisson'; allowed: 'fixed', 'uniform'"):
        apply_overrides(Config(), {"depth.sampler": "poisson"})
    d = fixed.to_dict()
    d["depth"]["hi"] = 8  # a stored field the sampler does not read
    with pytest.raises(ConfigError, match=r"^depth\.hi: sampler fixed does not read it"):
        Config.from_dict(d)


def test_gradient_is_one_value_mapping_onto_the_cursor_estimator():
    """``train.gradient`` (kind, steps): bptt has no steps, tbptt / endpoint need steps >= 1; a new kind
    carries steps over where it has them; the value maps 1:1 onto :class:`looplm.model.cursor.Gradient`."""
    from looplm.model.cursor import Gradient

    cfg = apply_overrides(Config(), {"train.gradient.kind": "tbptt", "train.gradient.steps": "4"})
    assert cfg.train.gradient == TBPTTConfig(steps=4) and cfg.to_dict()["train"]["gradient"] == {"kind": "tbptt",
                                                                                                "steps": 4}
    assert apply_overrides(cfg, {"train.gradient.kind": "endpoint"}).train.gradient == EndpointConfig(steps=4)
    assert apply_overrides(cfg, {"train.gradient.kind": "bptt"}).train.gradient == BPTTConfig()
    for g in (BPTTConfig(), TBPTTConfig(steps=2), EndpointConfig(steps=3)):
        assert Gradient(g.NAME, g.steps) == Gradient(*{"bptt": ("bptt", 0), "tbptt": ("tbptt", 2),
                                                      "endpoint": ("endpoint", 3)}[g.NAME])
    with pytest.raises(ConfigError, match=r"^train\.gradient\.steps: kind bptt does not read it"):
        apply_overrides(Config(), {"train.gradient.steps": "2"})
    with pytest.raises(ConfigError, match=r"^train\.gradient\.steps: tbptt needs b >= 1, got 0"):
        apply_overrides(cfg, {"train.gradient.steps": "0"})


def test_no_section_rewrites_another():
    """The config holds what it was given: exit_weighted needs model.exit_gate stated (an error otherwise),
    and a post-LN model's residual_depth = 0 stays 0 in the config; the model builder resolves N = K·R from the
    depth sampler's maximum (SPEC §3), which a bare ModelConfig cannot."""
    from looplm.model import build_model

    with pytest.raises(ConfigError, match=r"^train\.supervision: exit_weighted needs model\.exit_gate=true"):
        Config(train=TrainConfig(supervision="exit_weighted"))
    assert Config(model=ModelConfig(exit_gate=True), train=TrainConfig(supervision="exit_weighted")).model.exit_gate
    small = ModelConfig(rule="plain", d_model=16, n_heads=2, d_ff=32, seq_len=8, vocab_size=32, residual="deeploop")
    cfg = Config(model=small, depth=FixedDepthConfig(depth=3))
    assert cfg.model.residual_depth == 0
    assert build_model(cfg).cfg.residual_alpha_beta == small.replace(residual_depth=3).residual_alpha_beta
    with pytest.raises(ConfigError, match="model.residual_depth: must be >= 1"):
        build_model(cfg.model)


@pytest.mark.slow
def test_closed_stdout_is_not_an_error():
    """stdout whose reader has gone (as in `looplm info --list | head`): the first write fails with
    EPIPE; looplm ends quietly with status 0 instead of a BrokenPipeError traceback."""
    import os

    r, w = os.pipe()
    os.close(r)  # the reader is gone before looplm writes anything
    try:
        proc = subprocess.run([sys.executable, "-m", "looplm", "info", "--list"], stdout=w, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(w)
    assert proc.returncode == 0, proc.stderr
    assert "Error" not in proc.stderr


def test_lmdr_preset_is_the_papers_recipe():
    """The ``lmdr`` preset against LMDR's appendix (arXiv:2610.06833) as the issue lists it: Parcae w/o norm
    (App. C.1), untied embeddings (B.1), b_max = 10 (B.3), Huginn-0125's initial-state σ (the importer's
    constant, a second source), RoPE with seq_len >= 512 at huginn-cpu's tokens per step, so the KV-sharing
    evaluation (prefix = seq_len // 2) prefills >= 256 tokens; WSD with 5% warm-up and betas (0.9, 0.98)."""
    from looplm.importers.huginn import STATE_STD

    cfg, ref = get_preset("lmdr"), get_preset("huginn-cpu")
    m, t, p, o = cfg.model, cfg.train, cfg.depth, cfg.optim
    assert (m.rule, m.tie_embeddings, m.position.NAME, m.exit_norm) == ("parcae", False, "rope", "none")
    assert (m.n_prelude, m.n_core, m.n_coda, m.head_dim) == (1, 2, 1, 64)
    assert (m.options.state_init, m.options.state_init_std) == ("truncated_normal", STATE_STD)
    assert t.gradient == TBPTTConfig(steps=10) and p.NAME == "learned"
    assert (p.mean, p.cap) == (5.0, 64)
    assert (p.reward, p.entropy, p.lr, p.warmup) == ("inv_ppl", 0.01, 1e-3, 32)
    assert m.seq_len >= 512 and m.seq_len // 2 >= 256
    assert m.seq_len * t.batch_size * t.grad_accum == ref.model.seq_len * ref.train.batch_size * ref.train.grad_accum
    assert (o.schedule, o.warmup_steps / t.steps, o.beta1, o.beta2, o.min_lr_ratio) == ("wsd", 0.05, 0.9, 0.98, 0.1)
    assert n_params(m) == 5_544_000  # the module docstring's 5.54M


@pytest.mark.parametrize("argv, size, source", [
    (["--preset", "debug"], 1024, "data.bpe_vocab_size"),
    (["--preset", "debug", "--data.tokenizer", "gpt2"], 50257, "data.tokenizer=gpt2"),
    (["--preset", "task-addition"], 42, "data.task=addition"),
], ids=["bpe", "gpt2", "task"])
def test_train_vocab_size_override_that_the_tokenizer_replaces_is_an_error(tmp_path, capsys, argv, size, source):
    """Training sets model.vocab_size from the tokenizer: a --model.vocab_size that differs is refused before
    training (and before any file is written), naming the field, the tokenizer's size and what sets it."""
    out = tmp_path / "x"
    assert main(["train", *argv, "--model.vocab_size", "10", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"looplm train: error: --model.vocab_size 10: the tokenizer has {size} entries (set "
                                f"by {source}) and training sets model.vocab_size from it; leave --model.vocab_size "
                                "out" + (" (to change it, set --data.bpe_vocab_size)" if "bpe" in source else "")]
    assert not out.exists()


def test_train_vocab_size_override_that_agrees_with_the_tokenizer_trains(tmp_path):
    out = tmp_path / "x"
    assert main(["train", "--preset", "debug", "--model.vocab_size", "1024", "--out", str(out), "--quiet",
                 "--train.steps", "1", "--train.eval_every", "0"]) == 0
    assert json.loads((out / "config.json").read_text())["model"]["vocab_size"] == 1024
