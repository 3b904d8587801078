"""The papers' depth claims retested on the depth testbed (issue 24 §3): claims.md from the four sweeps' results DBs.

Reads ``<sweep folder>/results.db`` of ``scse.toml``, ``lmdr.toml``, ``deeploop.toml`` and ``readout.toml`` (protocols
``tasks``, ``tasks_halting`` and ``diagnose``) and, for the diagnostics the DB does not hold (convergence, norm
drift, κ̂_R), each run's ``diagnose/diagnose.json``, kept in ``<sweep folder>/diagnose_<section>.json`` so the
summary still has them once the run folders (not committed) are gone. Each TOML's header states its claims and
how they are read; this script writes one row per claim: the depth-use column first (accuracy at T = 1, at the
model's training depth and at the best T, seed means, k ≤ k_train), the paired delta and its verdict
(:func:`looplm.analysis.claims.paired_claim`, 95% t interval over the seeds): **reproduces**, does not,
**opposite**, incomplete (fewer than 3 seeds) or not run yet. Nothing is typed in: every number is read.

    python experiments/depth-testbed/claims.py                      # the committed sweeps → claims.md
    python experiments/depth-testbed/claims.py --root '/tmp/tb3-smoke-{name}' --out /tmp/claims.md
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Callable

from looplm.analysis.claims import depth_use_cell, diagnose_sections, mean_std_cell, paired_claim, validation_curves
from looplm.analysis.store import ResultStore
from looplm.config import Config

HERE = Path(__file__).resolve().parent
SWEEPS = {"scse": "depth-testbed-scse", "lmdr": "depth-testbed-lmdr", "deeploop": "depth-testbed-deeploop",
          "readout": "depth-testbed-readout"}
DEEP = 64  # the deepest evaluated T of every sweep file
IN_DIST = (1, 2, 3)  # k ≤ k_train
BEYOND = (4, 5, 6)


class Sweep:
    """One sweep's stored evaluations: ``cells[variant][(protocol, k or "", metric, depth)][seed]`` (accuracy in
    %), the training depth of each variant and its diagnose.json sections."""

    def __init__(self, name: str, folder: Path):
        self.name, self.folder = name, folder
        self.cells: dict = {}
        self.train_depth: dict[str, int] = {}
        db = folder / "results.db"
        if not db.is_file():
            return
        with ResultStore(db, readonly=True) as store:
            for run in store.runs(SWEEPS[name]):
                self.train_depth[run.variant] = Config.from_dict(run.config).depth.nominal_depth()
                cell = self.cells.setdefault(run.variant, {})
                for r in store.evaluations(config_hash=run.config_hash, seed=run.seed):
                    k = int(r["dataset"].rsplit("-k", 1)[1]) if "-k" in r["dataset"] else ""
                    scale = 100 if r["metric"] in ("acc", "acc_matched") else 1
                    cell.setdefault((r["protocol"], k, r["metric"], r["depth"]), {})[run.seed] = scale * r["value"]

    def section(self, section: str, pick: Callable) -> dict[str, dict[int, float]]:
        """``{variant: {seed: pick(diagnose.json[section])}}`` (run folders, cached in the sweep folder)."""
        recs = diagnose_sections(self.folder / "runs", self.folder / f"diagnose_{section}.json", section, pick)
        out: dict = {}
        for run_id, v in recs.items():
            variant, seed = run_id.rsplit("-s", 1)
            out.setdefault(variant, {})[int(seed)] = v
        return out

    def acc(self, variant: str, T: int, ks=IN_DIST) -> dict[int, float]:
        """``{seed: mean exact match (%) over ks at depth T}`` (seeds with every k)."""
        c = self.cells.get(variant, {})
        per_k = [c.get(("tasks", k, "acc", T), {}) for k in ks]
        return {s: statistics.mean(d[s] for d in per_k) for s in set.intersection(*map(set, per_k))}

    def by_depth(self, variant: str, ks=IN_DIST) -> dict[int, dict[int, float]]:
        Ts = {key[3] for key in self.cells.get(variant, {}) if key[0] == "tasks"}
        return {T: self.acc(variant, T, ks) for T in sorted(Ts)}

    def best(self, variant: str, ks) -> dict[int, float]:
        """``{seed: the best accuracy over T}`` (each seed its own best T)."""
        by_T = self.by_depth(variant, ks)
        seeds = set.union(set(), *map(set, by_T.values()))
        return {s: max(v[s] for v in by_T.values() if s in v) for s in seeds}

    def metric(self, variant: str, protocol: str, metric: str, depth: int, ks=("",)) -> dict[int, float]:
        """``{seed: mean over ks of a stored metric}`` (e.g. tasks_halting mean_depth, diagnose gain)."""
        c = self.cells.get(variant, {})
        per_k = [c.get((protocol, k, metric, depth), {}) for k in ks]
        return {s: statistics.mean(d[s] for d in per_k) for s in set.intersection(*map(set, per_k))}

    def depth_use(self, variant: str) -> str:
        return depth_use_cell(self.by_depth(variant), self.train_depth.get(variant, 0), higher_is_better=True)


def verdict(a: dict[int, float], b: dict[int, float], kind: str) -> tuple[str, str]:
    """The Δ cell and verdict of "a − b is ``kind``": positive, negative, not_negative (no loss) or zero."""
    cell, v = paired_claim(a, b, expect="negative" if kind == "negative" else "positive")
    v = v.strip("*")
    n = len(set(a) & set(b))
    if v == "no data":
        return cell, "not run yet"
    if v.startswith("provisional"):
        return cell, f"incomplete ({n} of 3 seeds)"
    if kind == "not_negative":
        v = {"reproduces": "reproduces", "opposite": "opposite", "not resolved": "reproduces (no loss resolved)"}[v]
    elif kind == "zero":
        v = "reproduces (no difference resolved)" if v == "not resolved" else "does not"
    else:
        v = {"not resolved": "does not (interval spans 0)"}.get(v, v)
    return cell, f"**{v}**" if v in ("reproduces", "opposite") else v


def claim_rows(sw: Sweep) -> list[tuple[str, str, str, str, dict, dict, str]]:
    """``(id, claim, variant a, variant b, a, b, kind)`` per row of one sweep's claims: the claim is a − b."""
    acc, m = sw.acc, sw.metric
    if sw.name == "scse":
        halt = lambda v, metric, ks: m(v, "tasks_halting", metric, DEEP, ks)  # noqa: E731
        return [
            ("S1", "stable deep loops: scse − looped, acc at T = 64, k ≤ 3", "scse", "looped", acc("scse", DEEP), acc("looped", DEEP), "positive"),
            ("S2", "norm reset collapses: norm_reset acc at T = 64 − at T = 8, k ≤ 3", "norm_reset", "norm_reset",
             acc("norm_reset", DEEP), acc("norm_reset", 8), "negative"),
            ("S3", "SCSE beats the tuned adapter: scse − adapter, acc at T = 8, k ≤ 3", "scse", "adapter", acc("scse", 8), acc("adapter", 8), "positive"),
            ("S4", "SCSE beats the unshared control: scse (T = 8) − unshared (T = 1), k ≤ 3", "scse", "unshared",
             acc("scse", 8), acc("unshared", 1), "positive"),
            ("S5", "lower gain at t = 0: scse − looped, random-direction gain", "scse", "looped", m("scse", "diagnose", "gain", 0),
             m("looped", "diagnose", "gain", 0), "negative"),
            ("S5", f"gain at t = {DEEP - 1}: scse − looped", "scse", "looped", m("scse", "diagnose", "gain", DEEP - 1),
             m("looped", "diagnose", "gain", DEEP - 1), "negative"),
            ("S6", "halting depth grows with k: scse mean halting depth k = 3 − k = 1", "scse", "scse", halt("scse", "mean_depth", (3,)),
             halt("scse", "mean_depth", (1,)), "positive"),
            ("S6", "halting beats matched fixed depth: scse acc at halting − at matched depth, k ≤ 3", "scse", "scse",
             halt("scse", "acc", IN_DIST), halt("scse", "acc_matched", IN_DIST), "positive"),
        ]
    if sw.name == "lmdr":
        base = "fixed5_bptt"
        rows = [("L1", "truncation costs little: fixed5_tbptt2 − fixed5_bptt, acc at T = 5, k ≤ 3", "fixed5_tbptt2",
                 base, acc("fixed5_tbptt2", 5), acc(base, 5), "not_negative")]
        for v in ("pln5_tbptt10", "learned_tbptt10"):
            rows += [("L2", f"loop extrapolation: {v} − {base}, acc at T = 64, k ≤ 3", v, base, acc(v, DEEP), acc(base, DEEP), "positive"),
                     ("L3", f"difficulty extrapolation: {v} − {base}, best acc over T, k = 4 … 6", v, base,
                      sw.best(v, BEYOND), sw.best(base, BEYOND), "positive")]
        return rows
    if sw.name == "deeploop":
        rows = [("D1", f"trains at N = 24: {v} − post_ln, acc at T = 12, k ≤ 3", v, "post_ln", acc(v, 12), acc("post_ln", 12),
                 "positive") for v in ("p0.25", "p0.4", "p0.45", "p0.5", "p0.75", "p1", "pre_ln")]
        return rows + [("D2", "DeepLoop vs Pre-LN: p0.5 − pre_ln, acc at T = 12, k ≤ 3", "p0.5", "pre_ln", acc("p0.5", 12),
                        acc("pre_ln", 12), "not_negative")]
    rows = [("R1", f"per-loop CE answers early: per_loop-{r} − terminal-{r}, acc at T = 1, k ≤ 3", f"per_loop-{r}",
             f"terminal-{r}", acc(f"per_loop-{r}", 1), acc(f"terminal-{r}", 1), "positive") for r in ("rmsnorm", "raw", "penalty")]
    halt = lambda v, k: m(v, "tasks_halting", "mean_depth", DEEP, (k,))  # noqa: E731
    return rows + [("R3", f"margin halting ignores k: {v} mean halting depth k = 3 − k = 1", v, v, halt(v, 3), halt(v, 1),
                    "zero") for v in sw.cells if (("tasks_halting", 1, "mean_depth", DEEP) in sw.cells[v])]


def read_only(sw: Sweep) -> list[str]:
    """The diagnostics read without a verdict (per variant: mean ± std over seeds)."""
    spec = {"lmdr": ("L4", "token-convergence depth (mean over tokens, ρ < τ)", "convergence", lambda s: s["depth_mean"]),
            "deeploop": ("D3", "visit alignment κ̂_R", "visit_alignment", lambda s: s["kappa_hat"]),
            "readout": ("R2", "norm drift: hidden-state RMS at the last loop / at loop 1", "scale",
                        lambda s: s["loops"][-1]["rms_mean"] / s["loops"][1]["rms_mean"])}.get(sw.name)
    if spec is None:
        return []
    cid, what, section, pick = spec
    vals = sw.section(section, pick)
    lines = ["", f"{cid} ({what}; read, no verdict):", "", "| depth use | variant | value | seeds |", "|---|---|---:|---:|"]
    lines += [f"| {sw.depth_use(v)} | `{v}` | {mean_std_cell(vals[v].values(), 2)} | {len(vals[v])} |"
              for v in sw.cells if v in vals]
    lines = lines if vals else ["", f"{cid} ({what}): not run yet (no diagnose.json and no cache)."]
    if sw.name == "lmdr":  # the learned prior over training (metrics.jsonl, cached in lmdr/curves.json)
        series = ("prior_mean_depth", "prior_entropy")
        curves = validation_curves(sw.folder / "runs", sw.folder / "curves.json", extra=series)
        lines += ["", "L5 (the learned prior over training: E_p[R] and H(p) in nats at its first and last logged "
                  "step; read, no verdict):", ""]
        for run_id, c in sorted(curves.items()):
            if c.get("prior_mean_depth"):
                ends = {k: sorted(((int(st), v) for st, v in c[k].items())) for k in series}
                lines.append(f"- `{run_id}`: " + "; ".join(
                    f"{k} {e[0][1]:.2f} (step {e[0][0]}) → {e[-1][1]:.2f} (step {e[-1][0]})" for k, e in ends.items()))
        if not lines[-1].startswith("- "):
            lines.append("not run yet (no learned-prior run folder and no cache).")
    if sw.name == "deeploop":  # which leave the loss plateau, and when (metrics.jsonl, cached in deeploop/curves.json)
        lines += learning_table(sw, validation_curves(sw.folder / "runs", sw.folder / "curves.json"))
    return lines


def learning_table(sw: Sweep, curves: dict[str, dict], steps=(100, 200, 300, 400, 500, 600, 700, 800),
                   below: float = 8.0) -> list[str]:
    """D4: answer-token validation perplexity over training per variant (mean over the seeds logged at each step),
    and how many seeds end below ``below`` (off the plateau of ≈ 8.5 that every run starts on)."""
    by_variant: dict[str, dict[int, list[float]]] = {}
    for run_id, c in curves.items():
        for st, ppl in c["val"].items():
            by_variant.setdefault(run_id.rsplit("-s", 1)[0], {}).setdefault(int(st), []).append(ppl)
    lines = ["", "D4 (answer-token validation perplexity over training, mean over seeds [seeds]; read, no verdict; "
             f"a digit guessed uniformly: 10; last column: seeds below {below:g} at step {steps[-1]}):", "",
             "| variant | " + " | ".join(f"step {s}" for s in steps) + " | off the plateau |",
             "|---|" + "---:|" * (len(steps) + 1)]
    for v in sw.cells:
        row = by_variant.get(v, {})
        off = f"{sum(p < below for p in row[steps[-1]])} of {len(row[steps[-1]])}" if steps[-1] in row else "–"
        lines.append(f"| `{v}` | " + " | ".join(f"{statistics.mean(row[s]):.2f} [{len(row[s])}]" if s in row else "–"
                                                  for s in steps) + f" | {off} |")
    return lines


def halting_table(sw: Sweep) -> list[str]:
    """Per model and k: mean halting depth, exact match at halting and at the matched fixed depth (seed means)."""
    have = [v for v in sw.cells if any(key[0] == "tasks_halting" for key in sw.cells[v])]
    if not have:
        return []
    ks = sorted({key[1] for v in have for key in sw.cells[v] if key[0] == "tasks_halting"})
    cell = lambda v, metric, k: mean_std_cell(sw.metric(v, "tasks_halting", metric, DEEP, (k,)).values(), 1)  # noqa: E731
    lines = ["", "Halting per k (mean halting depth · acc at halting · acc at the matched fixed depth; mean ± std "
             "over seeds; * beyond training):", "", "| variant | " + " | ".join(f"k={k}{'' if k in IN_DIST else '*'}" for k in ks)
             + " |", "|---|" + "---|" * len(ks)]
    lines += [f"| `{v}` | " + " | ".join(f"{cell(v, 'mean_depth', k)} · {cell(v, 'acc', k)} · {cell(v, 'acc_matched', k)}"
                                          for k in ks) + " |" for v in have]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=str(HERE / "{name}"), help="sweep folder pattern ({name}: scse, lmdr, ...)")
    ap.add_argument("--out", default=str(HERE / "claims.md"))
    args = ap.parse_args()
    lines = ["# Depth testbed: the papers' depth claims", "",
             "Generated by `python experiments/depth-testbed/claims.py` from each sweep's results DB (claims and "
             "readings: the TOML headers). Task `addition`, trained on k ≤ 3; exact match (%) on the held-out test "
             "instances. Depth use: accuracy at T = 1 · at the training depth · at the best T (seed means, k ≤ 3). "
             "Δ: paired over seeds, mean [95% t interval] (bootstrap)."]
    for name in SWEEPS:
        sw = Sweep(name, Path(args.root.format(name=name)))
        lines += ["", f"## {name} (`{name}.toml`, sweep `{SWEEPS[name]}`)", ""]
        if not sw.cells:
            lines.append(f"Not run yet: no run of sweep `{SWEEPS[name]}` in `{sw.folder.name}/results.db`.")
            continue
        seeds = {v: len({s for d in c.values() for s in d}) for v, c in sw.cells.items()}
        lines += ["Runs evaluated: " + ", ".join(f"`{v}` {n}" for v, n in seeds.items()) + " (seeds).", "",
                  "| depth use: variant | depth use: compared with | claim | Δ | verdict |", "|---|---|---|---|---|"]
        for cid, text, va, vb, a, b, kind in claim_rows(sw):
            cell, v = verdict(a, b, kind)
            other = "(same model)" if vb == va else f"`{vb}` {sw.depth_use(vb)}"
            lines.append(f"| `{va}` {sw.depth_use(va)} | {other} | {cid}: {text} | {cell} | {v} |")
        lines += halting_table(sw) + read_only(sw)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
