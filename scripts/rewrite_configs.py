"""Rewrite every committed config and results identity as a complete config of today's format: fields and
rule options added since a file was written get their defaults (the values that rebuild the older
models), and the older ``train.tbptt`` spelling is dropped (it must agree with ``train.gradient``). Run it
from the repository root after adding a config field: ``python scripts/rewrite_configs.py``. Idempotent.

It rewrites, in place: the sweep files' ``train.tbptt = b`` overrides (as ``train.gradient`` /
``train.gradient_steps``); every config dict in ``experiments/**/*.json`` (``config_hash`` recomputed
beside it); and in every ``experiments/**/results.db`` the stored configs, with their runs and evaluations
re-keyed to the new hash (unchanged while :data:`looplm.analysis.store.LATE_IDENTITY_FIELDS` lists the
new fields at their defaults).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import sqlite3
import subprocess
from pathlib import Path

from looplm.analysis.store import _canonical, config_hash, config_identity
from looplm.config import RULE_OPTIONS, Config, DataConfig, ModelConfig, TrainConfig


def _defaults(cls) -> dict:
    return {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls) if f.name != "options"}


def rewrite(d: dict) -> dict:
    """A stored config dict as a complete one of today's format (missing fields at their defaults)."""
    d = copy.deepcopy(d)
    t = d["train"]
    if "tbptt" in t:
        assert t.pop("tbptt") == (t.get("gradient_steps", 0) if t.get("gradient") == "tbptt" else 0)
    for section, cls in (("model", ModelConfig), ("data", DataConfig), ("train", TrainConfig)):
        d[section] = {**_defaults(cls), **d[section]}
    m = d["model"]
    if m["architecture"] == "shared" and m["rule"] in RULE_OPTIONS:
        m["options"] = {**_defaults(RULE_OPTIONS[m["rule"]]), **m["options"]}
    return Config.from_dict(d).to_dict()


def walk(obj):
    """Rewrite every config dict inside ``obj`` (and the ``config_hash`` next to it)."""
    if isinstance(obj, dict):
        if "format_version" in obj and "model" in obj:
            return rewrite(obj)
        out = {k: walk(v) for k, v in obj.items()}
        if isinstance(out.get("config"), dict) and "config_hash" in out:
            out["config_hash"] = config_hash(out["config"])
        return out
    if isinstance(obj, list):
        return [walk(v) for v in obj]
    return obj


def rewrite_db(path: Path) -> None:
    con = sqlite3.connect(path)
    with con:
        moves: dict[str, str] = {}
        for sweep, run_id, old_hash, text in con.execute("SELECT sweep, run_id, config_hash, config_json FROM runs").fetchall():
            cfg = rewrite(json.loads(text))
            new_hash = config_hash(cfg)
            assert moves.setdefault(old_hash, new_hash) == new_hash, (path, run_id)
            con.execute("UPDATE runs SET config_hash = ?, config_json = ? WHERE sweep = ? AND run_id = ?",
                        (new_hash, _canonical(cfg), sweep, run_id))
            con.execute("INSERT OR REPLACE INTO configs VALUES (?, ?)", (new_hash, _canonical(config_identity(cfg))))
        stored = {h for (h,) in con.execute("SELECT config_hash FROM configs")}
        assert stored >= set(moves), path
        assert stored - set(moves) - set(moves.values()) == set(), f"{path}: a stored config without a run"
        for old, new in moves.items():
            if old != new:
                con.execute("UPDATE evaluations SET config_hash = ? WHERE config_hash = ?", (new, old))
                con.execute("DELETE FROM configs WHERE config_hash = ?", (old,))
    con.execute("VACUUM")
    con.close()


def main() -> None:
    files = subprocess.run(["git", "ls-files", "experiments"], capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        p = Path(f)
        if p.suffix == ".toml":
            text = p.read_text()
            new = re.sub(r'"train\.tbptt" = 0\b', '"train.gradient" = "bptt"', text)
            new = re.sub(r'"train\.tbptt" = (\d+)', r'"train.gradient" = "tbptt", "train.gradient_steps" = \1', new)
            if new != text:
                p.write_text(new)
        elif p.suffix == ".json" and '"format_version"' in p.read_text():
            text = p.read_text()
            new = json.dumps(walk(json.loads(text)), indent=2 if text.startswith("{\n  ") else None, ensure_ascii=False)
            p.write_text(new + "\n" * text.endswith("\n"))
        elif p.suffix == ".db":
            rewrite_db(p)


if __name__ == "__main__":
    main()
