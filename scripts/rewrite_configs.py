"""One-off (issue 26): rewrite every committed config and results identity to config format 2, complete
(every field and option written out), without the older ``train.tbptt`` spelling.

Run it with the looplm that still reads format 1 and the late fields (the commit before the migrations
were deleted), from the repository root:

    PYTHONPATH=<that checkout>/src python scripts/rewrite_configs.py

It rewrites, in place: the sweep files' ``train.tbptt = b`` overrides (as ``train.gradient`` /
``train.gradient_steps``); every config dict in ``experiments/**/sweep.json`` and ``report.json``
(``config_hash`` recomputed beside it); ``train.tbptt`` in ``experiments/demo/results.json``; and in
every ``experiments/**/results.db`` the stored configs, with their runs and evaluations re-keyed to the
new hash. Each config is loaded by ``Config.from_dict`` (which migrates) and written as ``to_dict()``
less ``train.tbptt``, so it describes the same model and training.
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
from pathlib import Path

from looplm.analysis.store import _canonical, config_hash, config_identity
from looplm.config import Config


def rewrite(d: dict) -> dict:
    """A config dict of any stored format as complete format 2 without ``train.tbptt``."""
    new = Config.from_dict(d).to_dict()
    t = new["train"]
    assert t.pop("tbptt") == (t["gradient_steps"] if t["gradient"] == "tbptt" else 0)
    return new


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
        elif p.name in ("sweep.json", "report.json") and '"format_version"' in p.read_text():
            p.write_text(json.dumps(walk(json.loads(p.read_text())), indent=2) + "\n")
        elif p.suffix == ".db":
            rewrite_db(p)
    demo = Path("experiments/demo/results.json")
    demo.write_text(re.sub(r'\n *"tbptt": 0,', "", demo.read_text(), count=1))


if __name__ == "__main__":
    main()
