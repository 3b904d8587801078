"""Rewrite every committed config, sweep file and results identity from config format 2 (a flat ``train``
section) or 3 (the typed sections ``depth``, ``optim`` and ``train.gradient``; flat position and scale-control
fields in ``model``) into format 4 (also the typed sections ``model.position`` and ``model.scale_control``), and
the distill and RL configs into their ``optim`` sections (a student record of format 1: :func:`rewrite_student`;
the options of an RL run: :func:`rewrite_rl`). Run it from the repository root: ``python
scripts/rewrite_configs.py``. Idempotent: it transforms only what is in an old shape (a config dict with
``format_version`` 2 or 3, an override key of :data:`KEYS`, a student record of format 1, RL options without
``optim``).

It rewrites, in place: the sweep files' override keys (``"train.depth_sampler"`` → ``"depth.sampler"``,
``"model.rope_theta"`` → ``"model.position.theta"``, …);
every config dict in ``experiments/**/*.json`` (with the ``config_hash`` beside it, and the override keys of
a ``grid``); every ``experiments/**/results.db`` (stored configs, run grids, and the runs, evaluations and
provenance re-keyed to the new hash); and the ``config.json`` of every run folder under ``experiments``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import sqlite3
import subprocess
from pathlib import Path

from looplm.analysis.store import canonical_json, config_hash, config_identity
from looplm.config import (FORMAT_VERSION, RULE_OPTIONS, Config, DataConfig, DepthConfig, ModelConfig, OptimConfig,
                           PositionConfig, RopeConfig, ScaleControlConfig, SpectralDampingConfig, TrainConfig,
                           build_choice)
from looplm.distill.config import STUDENT_KIND, DistillConfig
from looplm.rl.config import RLConfig

#: format-2 ``train`` field → its format-3 place (a ``depth`` field names the sampler's own)
DEPTH = {"depth": "depth", "depth_lo": "lo", "depth_hi": "hi", "depth_mean": "mean", "pln_sigma": "sigma",
         "depth_cap": "cap", "prior_lr": "lr", "prior_entropy": "entropy", "prior_budget": "budget",
         "prior_warmup": "warmup", "prior_init": "init", "prior_reward": "reward", "prior_scale": "scale",
         "prior_scale_window": "scale_window"}
OPTIM = ("lr", "min_lr_ratio", "warmup_steps", "schedule", "weight_decay", "beta1", "beta2", "grad_clip")
#: format-3 ``model`` field → its format-4 field of ``model.position`` / ``model.scale_control``
POSITION = {"position_embedding": "kind", "rope_theta": "theta", "rope_layout": "layout", "rope_scaling": "scaling",
            "rope_scaling_factor": "scaling_factor", "rope_table_dtype": "table_dtype"}
SCALE = {"scale_control": "kind", "damping_init": "init"}
#: old override key → new override key (sweep files and run grids)
KEYS = {"train.depth_sampler": "depth.sampler", **{f"train.{k}": f"depth.{v}" for k, v in DEPTH.items()},
        **{f"train.{k}": f"optim.{k}" for k in OPTIM}, "train.gradient": "train.gradient.kind",
        "train.gradient_steps": "train.gradient.steps",
        **{f"model.{k}": f"model.position.{v}" for k, v in POSITION.items()},
        **{f"model.{k}": f"model.scale_control.{v}" for k, v in SCALE.items()}}


def _defaults(cls) -> dict:
    return {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls) if f.name != "options"}


def _format3(d: dict) -> dict:
    """A format-2 config dict in the format-3 shape (sections ``depth``, ``optim``, ``train.gradient``)."""
    t = dict(d["train"])
    sampler = t.pop("depth_sampler")
    own = DepthConfig.VARIANTS[sampler].field_names()
    depth = {"sampler": sampler, **{new: t[old] for old, new in DEPTH.items() if new in own and old in t}}
    for old in DEPTH:
        t.pop(old, None)  # prior_init: absent from the files written before it (its default [])
    optim = {k: t.pop(k) for k in OPTIM}
    kind, steps = t.pop("gradient"), t.pop("gradient_steps")
    grad_at = list(t).index("supervision")
    items = list(t.items())
    items.insert(grad_at, ("gradient", {"kind": kind} if kind == "bptt" else {"kind": kind, "steps": steps}))
    return {**d, "format_version": 3, "depth": depth, "optim": optim, "train": dict(items)}


def _choice(base, variants: dict, flat: dict, defaults: dict) -> dict:
    """The choice section (complete dict) of the variant ``flat["kind"]`` with its fields from ``flat``; a
    field it does not read must hold its old default (``defaults``), as the format-3 config checked."""
    own = variants[flat["kind"]].field_names()
    for name, value in flat.items():
        assert name == "kind" or name in own or value == defaults[name], (base.__name__, name, value)
    return build_choice(base, {k: v for k, v in flat.items() if k == "kind" or k in own}).to_dict()


def _model(m: dict) -> ModelConfig:
    """A format-2 or -3 ``model`` dict (flat position and scale-control fields) as a format-4 ModelConfig."""
    m = dict(m)
    position = {new: m.pop(old) for old, new in POSITION.items() if old in m}  # rope fields: absent in old files
    scale = {new: m.pop(old) for old, new in SCALE.items()}
    model = {**_defaults(ModelConfig), **m,  # fields added since: the values that rebuild the model
             "position": _choice(PositionConfig, PositionConfig.VARIANTS, position, _defaults(RopeConfig)),
             "scale_control": _choice(ScaleControlConfig, ScaleControlConfig.VARIANTS, scale,
                                      _defaults(SpectralDampingConfig))}
    if model["architecture"] == "shared" and model["rule"] in RULE_OPTIONS:
        model["options"] = {**_defaults(RULE_OPTIONS[model["rule"]]), **model["options"]}
    return ModelConfig.from_dict(model)


def rewrite(d: dict) -> dict:
    """A format-2 or -3 config dict as format 4 (a format-4 one comes back unchanged)."""
    if d["format_version"] == FORMAT_VERSION:
        return d
    if d["format_version"] == 2:
        d = _format3(d)
    assert d["format_version"] == 3, d["format_version"]
    return Config(model=_model(d["model"]), data=DataConfig.from_dict({**_defaults(DataConfig), **d["data"]}),
                  depth=build_choice(DepthConfig, d["depth"]), optim=OptimConfig.from_dict(d["optim"]),
                  train=TrainConfig.from_dict(d["train"]), name=d["name"]).to_dict()


#: RL options (``rl_options()``) → their ``optim`` field; the rest kept RL's defaults (no weight decay, β2 0.98)
RL_OPTIM = {"lr": "lr", "warmup": "warmup_steps", "grad_clip": "grad_clip"}


def rewrite_rl(d: dict) -> dict:
    """The flat options of an RL run (``rl_config.json`` adds ``source``) as an :class:`RLConfig` dict."""
    if "optim" in d:
        return d
    d = dict(d)
    assert d.pop("optimizer", "adamw") == "adamw", "the SGD option is gone"
    optim = RLConfig().optim.replace(**{new: d.pop(old) for old, new in RL_OPTIM.items()})
    source = {"source": d.pop("source")} if "source" in d else {}
    d.update(task=d["task"] or "", digits=d["digits"] or 0, optim=optim.to_dict())
    return {**RLConfig.from_dict(d).to_dict(), **source}


def rewrite_student(d: dict) -> dict:
    """A student record of format 1 (flat optimizer fields in ``distill``) as format 2 (an ``optim`` section)."""
    if d["format_version"] == 2:
        return d
    distill = dict(d["distill"])
    optim = {k: distill.pop(k) for k in OPTIM}
    return {**d, "format_version": 2, "distill": DistillConfig.from_dict({**distill, "optim": optim}).to_dict()}


def rekey(grid: dict) -> dict:
    """An override dict with the old keys renamed (``train.gradient_steps = 0`` of bptt dropped)."""
    if grid.get("train.gradient") == "bptt" and grid.get("train.gradient_steps", 0) == 0:
        grid = {k: v for k, v in grid.items() if k != "train.gradient_steps"}
    return {KEYS.get(k, k): v for k, v in grid.items()}


def walk(obj, moves: dict[str, str]):
    """Rewrite every config dict inside ``obj``, the ``config_hash`` next to it (recomputed, or mapped by
    ``moves`` where no config is beside it) and the keys of every ``grid``."""
    if isinstance(obj, dict):
        if obj.get("kind") == STUDENT_KIND:
            return rewrite_student(obj)
        if "neumann_steps" in obj and "method" in obj:
            return rewrite_rl(obj)
        if "format_version" in obj and "model" in obj:
            return rewrite(obj)
        out = {k: walk(v, moves) for k, v in obj.items()}
        if isinstance(out.get("grid"), dict):
            out["grid"] = rekey(out["grid"])
        if isinstance(out.get("config"), dict) and "config_hash" in out:
            out["config_hash"] = config_hash(out["config"])
        elif isinstance(out.get("config_hash"), str):
            out["config_hash"] = moves.get(out["config_hash"], out["config_hash"])
        return out
    if isinstance(obj, list):
        return [walk(v, moves) for v in obj]
    return obj


def rewrite_db(path: Path, moves: dict[str, str]) -> None:
    """Rewrite the stored configs of a results database and re-key what hangs on their hashes (``moves``
    collects old → new hash)."""
    con = sqlite3.connect(path)
    if all(json.loads(text)["format_version"] == FORMAT_VERSION for (text,) in con.execute("SELECT config_json FROM runs")):
        con.close()
        return  # rewritten already
    with con:
        local: dict[str, str] = {}
        rows = con.execute("SELECT sweep, run_id, config_hash, config_json, grid_json FROM runs").fetchall()
        for sweep, run_id, old_hash, text, grid in rows:
            cfg = rewrite(json.loads(text))
            new_hash = config_hash(cfg)
            assert local.setdefault(old_hash, new_hash) == new_hash, (path, run_id)
            con.execute("UPDATE runs SET config_hash = ?, config_json = ?, grid_json = ? WHERE sweep = ? AND run_id = ?",
                        (new_hash, canonical_json(cfg), canonical_json(rekey(json.loads(grid))), sweep, run_id))
            con.execute("INSERT OR REPLACE INTO configs VALUES (?, ?)",
                        (new_hash, canonical_json(config_identity(cfg))))
        stored = {h for (h,) in con.execute("SELECT config_hash FROM configs")}
        assert stored - set(local) - set(local.values()) == set(), f"{path}: a stored config without a run"
        assert len(set(local.values())) == len(local), f"{path}: two configs now share one identity"
        tables = [t for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for old, new in local.items():
            if old != new:
                for table in ("evaluations", "provenance"):
                    if table in tables:
                        con.execute(f"UPDATE {table} SET config_hash = ? WHERE config_hash = ?", (new, old))
                con.execute("DELETE FROM configs WHERE config_hash = ?", (old,))
        moves.update(local)
    con.execute("VACUUM")
    con.close()


def rewrite_toml(text: str) -> str:
    """Rename the old override keys of a sweep file (quoted ``train.`` and ``model.`` keys;
    ``train.gradient_steps = 0`` of bptt dropped)."""
    text = re.sub(r'(\{[^{}\n]*"train\.gradient" = "bptt"[^{}\n]*?), "train\.gradient_steps" = 0\b', r"\1", text)
    return re.sub(r'"((?:train|model)\.[a-z_0-9]+)"', lambda m: f'"{KEYS.get(m.group(1), m.group(1))}"', text)


def main() -> None:
    files = [Path(f) for f in subprocess.run(["git", "ls-files", "experiments"], capture_output=True, text=True,
                                             check=True).stdout.split()]
    moves: dict[str, str] = {}
    for p in files:
        if p.suffix == ".db":
            rewrite_db(p, moves)
    for p in files:
        if p.suffix == ".toml":
            text = p.read_text()
            new = rewrite_toml(text)
            if new != text:
                p.write_text(new)
        elif p.suffix == ".json" and any(k in (text := p.read_text()) for k in ('"format_version"', '"config_hash"',
                                                                                 '"neumann_steps"')):
            data = walk(json.loads(text), moves)
            new = json.dumps(data, indent=2 if text.startswith("{\n  ") else None, ensure_ascii=False)
            new += "\n" * text.endswith("\n")
            if new != text:
                p.write_text(new)


def rewrite_run_folders() -> None:
    """The (git-ignored) run folders under experiments/: every ``config.json``, and the checkpoint manifest's
    size and sha256 of it, so the checkpoint stays valid and a sweep resumes or skips it."""
    for p in Path("experiments").glob("**/runs/**/config.json"):
        text = p.read_text()
        new = json.dumps(walk(json.loads(text), {}), indent=2 if text.startswith("{\n  ") else None,
                         ensure_ascii=False) + "\n" * text.endswith("\n")
        manifest = p.parent / "manifest.json"
        if manifest.is_file():
            old = json.loads(manifest.read_text())
            m = walk(old, {})  # its "config" copy too
            entry = m.get("files", {}).get("config.json")
            if entry is not None:
                entry.update(bytes=len(new.encode()), sha256=hashlib.sha256(new.encode()).hexdigest())
            if m != old:
                manifest.write_text(json.dumps(m, indent=2))
        if new != text:
            p.write_text(new)


if __name__ == "__main__":
    main()
    rewrite_run_folders()
