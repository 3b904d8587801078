"""Helpers for the reproduction summaries (experiments/*/): a paper's claim checked against paired seeds
(SPEC §9), and validation curves and diagnostics collected from a sweep's run folders into committed JSON
caches, so a summary still has them when the run folders (not committed) are gone.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from looplm.analysis.stats import claim_verdict, summarize_paired
from looplm.analysis.store import ResultStore
from looplm.run.finite import md_table


def mean_std_cell(values: Iterable[float], digits: int = 1, *, notation: str = "f") -> str:
    """``"m ± s"`` (sample std) of ``values`` with ``digits`` decimals in ``notation`` "f" or "e"; one value
    alone; ``"–"`` for none."""
    v = [float(x) for x in values]
    if not v:
        return "–"
    if len(v) == 1:
        return f"{v[0]:.{digits}{notation}}"
    return f"{statistics.mean(v):.{digits}{notation}} ± {statistics.stdev(v):.{digits}{notation}}"


def depth_use_cell(by_depth: Mapping[int, Mapping[int, float]], train_depth: int, *, digits: int = 1,
                   higher_is_better: bool = False, signed: bool = False) -> str:
    """``"T=1 a · T=train b · best c (T=k)"`` of the seed means of ``{depth: {seed: value}}`` (issue 24's
    depth-use column); ``"–"`` when T = 1 or ``train_depth`` was not evaluated."""
    means = {d: statistics.mean(v.values()) for d, v in by_depth.items() if v}
    if 1 not in means or train_depth not in means:
        return "–"
    best = (max if higher_is_better else min)(sorted(means), key=means.__getitem__)
    f = f"{'+' if signed else ''}.{digits}f"
    return f"T=1 {means[1]:{f}} · T={train_depth} {means[train_depth]:{f}} · best {means[best]:{f}} (T={best})"


def paired_claim(variant: Mapping[int, float], baseline: Mapping[int, float], *, digits: int = 1,
                 expect: str = "negative") -> tuple[str, str]:
    """``(cell, verdict)`` of the claim "variant − baseline is ``expect``" over the common seeds: ``"+m [t lo,
    t hi] (boot. lo, hi)"`` and :func:`~looplm.analysis.stats.claim_verdict` (bold when decided)."""
    s = summarize_paired(variant, baseline)
    judged = claim_verdict(s, expect=expect)
    judged = f"**{judged}**" if judged in ("reproduces", "opposite") else judged
    if s is None:
        return "–", judged
    if s.n < 2:
        return f"{s.mean:+.{digits}f} (1 seed)", judged
    lo, hi = s.t_interval
    return (f"{s.mean:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}] "
            f"(boot. {s.bootstrap[0]:+.{digits}f}, {s.bootstrap[1]:+.{digits}f})", judged)


def validation_curves(runs_dir: str | Path, cache: str | Path, extra: Iterable[str] = ()) -> dict[str, dict]:
    """``{run_id: {"steps_done", "finished", "val": {str(step): val_ppl}, <extra metric>: {...}}}`` from
    ``runs_dir/<variant>-s<seed>/metrics.jsonl``, merged into (and written back to) ``cache``."""
    curves: dict[str, dict] = {}
    for run in sorted(Path(runs_dir).glob("*-s*")):  # none when runs_dir is missing
        m = run / "metrics.jsonl"
        if not m.exists():
            continue
        series: dict[str, dict[str, float]] = {"val": {}, **{k: {} for k in extra}}
        last = 0
        for line in m.read_text().splitlines():
            rec = json.loads(line)
            last = max(last, int(rec.get("step", 0)))
            for key, name in (("val", "val_ppl"), *((k, k) for k in extra)):
                if rec.get(name) is not None:
                    series[key][str(rec["step"])] = rec[name]
        curves[run.name] = {"steps_done": last, "finished": (run / "summary.json").exists(), **series}
    return _merge_cache(cache, curves)


def diagnose_sections(runs_dir: str | Path, cache: str | Path, section: str,
                      pick: Callable[[Any], Any]) -> dict[str, Any]:
    """``{run_id: pick(section)}`` of each ``runs_dir/<run>/diagnose/diagnose.json`` holding ``section``,
    merged into (and written back to) ``cache``."""
    records = {}
    for f in sorted(Path(runs_dir).glob("*-s*/diagnose/diagnose.json")):
        if sec := json.loads(f.read_text()).get(section):
            records[f.parent.parent.name] = pick(sec)
    return _merge_cache(cache, records)


def _merge_cache(cache: str | Path, new: dict[str, Any]) -> dict[str, Any]:
    """The JSON ``cache`` updated with ``new`` (entries present now replace theirs), written when non-empty."""
    cache = Path(cache)
    merged = {**(json.loads(cache.read_text()) if cache.exists() else {}), **new}
    if merged:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    return merged


def curves_by_variant(curves: Mapping[str, Mapping], key: str = "val") -> dict[str, dict[int, list[float]]]:
    """``{variant: {step: [value per seed]}}`` of one series of :func:`validation_curves` (``key``: ``"val"``
    for val_ppl, or an ``extra`` metric; run id ``<variant>-s<seed>``)."""
    out: dict[str, dict[int, list[float]]] = {}
    for run_id, c in sorted(curves.items()):
        variant = run_id.rsplit("-s", 1)[0]
        for step, v in c.get(key, {}).items():
            out.setdefault(variant, {}).setdefault(int(step), []).append(float(v))
    return out


def settled_ranking(by_variant: Mapping[str, Mapping[int, list[float]]]) -> tuple[list[str], int, int] | None:
    """(ranking, lowest mean first, at the last step all variants reached; the step since which it is unchanged;
    that last step), None without a common step. E.g. A 5, 3, 2 and B 4, 4, 3 → (["A", "B"], 200, 300)."""
    common = sorted(set.intersection(*(set(d) for d in by_variant.values()))) if by_variant else []
    if not common:
        return None
    ranks = [sorted(by_variant, key=lambda v: (statistics.mean(by_variant[v][s]), v)) for s in common]
    i = len(ranks) - 1
    while i > 0 and ranks[i - 1] == ranks[-1]:
        i -= 1
    return ranks[-1], common[i], common[-1]


def status_table(order: list[str], params: Mapping[str, int], evaluated: Mapping[str, Iterable[int]],
                 curves: Mapping[str, Mapping], depth_use: tuple[str, Mapping[str, str]] | None = None) -> list[str]:
    """Markdown rows of a sweep's progress per variant: params, seeds evaluated, runs still training (step);
    ``depth_use``: ``(header, {variant: cell})`` of a first column."""
    lines = []
    if not params and not curves:
        lines = ["**Not run yet:** the results database holds no run of this sweep and no run folder exists.", ""]
    head, cells = depth_use if depth_use else (None, {})
    first = ["variant", head] if head else ["variant"]
    rows = []
    for v in order:
        prog = [f"seed {rid.rsplit('-s', 1)[1]} ({c['steps_done']})" for rid, c in sorted(curves.items())
                if rid.rsplit("-s", 1)[0] == v and not c.get("finished")]
        rows.append([f"`{v}`", *([cells.get(v, "–")] if head else []), f"{params[v]:,}" if params.get(v) else "–",
                     ", ".join(map(str, sorted(evaluated.get(v, [])))) or "–", ", ".join(prog) or "–"])
    return lines + md_table([*first, "params", "seeds evaluated", "runs in progress (step)"], rows,
                            align="l" * len(first) + "r")


def curves_table(by_variant: Mapping[str, Mapping[int, list[float]]], order: list[str], digits: int = 0) -> list[str]:
    """Markdown table of :func:`curves_by_variant` (seed means; [seeds] where fewer than the variant's most) and
    the :func:`settled_ranking` sentence."""
    steps = sorted({s for d in by_variant.values() for s in d})
    lines = ["| variant | " + " | ".join(map(str, steps)) + " |", "|---|" + "---:|" * len(steps)]
    for v in [v for v in order if v in by_variant]:
        most = max(len(x) for x in by_variant[v].values())
        cells = ["–" if not vals
                 else f"{statistics.mean(vals):.{digits}f}" + (f" [{len(vals)}]" if len(vals) != most else "")
                 for vals in (by_variant[v].get(s, []) for s in steps)]
        lines.append(f"| `{v}` | " + " | ".join(cells) + " |")
    if settled := settled_ranking({v: d for v, d in by_variant.items() if v in order}):
        ranking, since, last = settled
        lines += ["", f"Ranking of the means at step {last} (the last step every variant has reached): "
                  f"{' < '.join(ranking)}; unchanged since step {since}."]
    return lines


def plot_mean_curves(series: Mapping[str, Mapping[int, list[float]]], path: str | Path, *, xlabel: str,
                     ylabel: str, title: str = "", log2x: bool = False, vline: float | None = None) -> Path:
    """Line plot PNG of the seed means of ``{label: {x: [values]}}`` (log y; log2 x; a dotted line at ``vline``)."""
    from looplm.analysis.plots import plt, save_figure

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, pts in series.items():
        if xs := sorted(x for x, v in pts.items() if v):
            ax.plot(xs, [statistics.mean(pts[x]) for x in xs], marker="o" if log2x else ".", label=label)
    if log2x:
        ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    if vline is not None:
        ax.axvline(vline, color="grey", ls=":", lw=1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.legend()
    return save_figure(fig, path)


def sweep_cells(db: str | Path, sweep: str) -> tuple[dict[str, dict[tuple, dict[int, float]]], dict[str, int]]:
    """``({variant: {(protocol, dataset, metric, depth): {seed: value}}}, {variant: params})`` of a sweep, read
    only (null values left out; ``({}, {})`` for a missing or empty database; ResultStoreError for a damaged one
    or another SQLite file)."""
    cells: dict = {}
    params: dict = {}
    if not Path(db).is_file() or Path(db).stat().st_size == 0:  # missing, or created empty
        return cells, params
    with ResultStore(db, readonly=True) as store:
        runs = {}
        for r in sorted(store.runs(sweep), key=lambda r: r.run_id):  # the order the table holds them in
            runs[(r.config_hash, r.seed)] = r.variant
            params[r.variant] = r.params
        for e in store.evaluations():
            variant = runs.get((e["config_hash"], e["seed"]))
            if variant is not None and not math.isnan(e["value"]):
                cells.setdefault(variant, {}).setdefault((e["protocol"], e["dataset"], e["metric"], e["depth"]),
                                                         {})[e["seed"]] = e["value"]
    return cells, params


def sweep_results(exp: str | Path, sweep: str, extra: Iterable[str] = ()) -> tuple[dict, dict, dict] | None:
    """``(cells, params, curves)`` of the sweep in folder ``exp`` (``results.db``, ``runs/``, ``curves.json``);
    None, said on stdout, when it has not run yet."""
    exp = Path(exp)
    cells, params = sweep_cells(exp / "results.db", sweep)
    curves = validation_curves(exp / "runs", exp / "curves.json", extra=extra)
    if not params and not curves:
        print(f"{sweep}: not run yet (no run in {exp / 'results.db'} and no run folder); nothing written.")
        return None
    return cells, params, curves
