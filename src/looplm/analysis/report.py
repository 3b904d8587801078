"""Seed-aggregated report of a results database (``looplm report``), in the SCSE paper's layouts.

Per evaluation set (protocol, dataset, split, tag) and metric: variant × depth ``mean ± std`` over seeds (SCSE
Tables 1/5); for PPL-like metrics paired deltas ``variant − baseline`` (same grid point) matched by (seed, depth),
``mean ± t half-width [bootstrap lo, hi]`` (SCSE "Seed Protocol and Aggregation"), and a depth plot; a params
+ FLOP proxy table (SCSE eq. 20–21). A variant's label is its name and grid fields (``scse (optim.lr=0.001)``).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from looplm.analysis.stats import DEFAULT_BOOTSTRAP_SEED, DEFAULT_RESAMPLES, mean_std, summarize_paired
from looplm.analysis.store import ResultStore, RunRecord
from looplm.config import DepthConfig, build_choice
from looplm.run.finite import md_table, strict


#: metrics tabulated per protocol, in this order (None: every metric found); other protocols: every
#: metric. report.json holds the same selection.
TABLE_METRICS: dict[str, tuple[str, ...] | None] = {
    "ppl": ("ppl",), "lambada": ("target_ppl", "target_acc", "exact_acc"),
    "diagnose": ("forcing.ratio", "gain", "forcing.bias_energy", "forcing.raw_bias_energy",
                 "forcing.anchor_energy"), "tasks": ("acc",)}
#: (protocol, metric) pairs that get a paired-delta table and a depth plot.
PAIRED_METRICS: frozenset[tuple[str, str]] = frozenset({("ppl", "ppl"), ("lambada", "target_ppl")})
METRIC_TITLES: dict[str, str] = {
    "ppl": "PPL", "target_ppl": "LAMBADA target-token completion PPL", "target_acc": "LAMBADA target-token "
    "accuracy", "exact_acc": "LAMBADA exact last-word accuracy"}
_PROTOCOL_ORDER = {"ppl": 0, "lambada": 1, "diagnose": 2}


@dataclass
class _Group:
    """One variant at one grid point: its runs (one per seed)."""

    variant: str
    grid: dict[str, Any]
    order: int
    runs: list[RunRecord] = field(default_factory=list)

    @property
    def label(self) -> str:
        if not self.grid:
            return self.variant
        return f"{self.variant} (" + ", ".join(f"{k}={v}" for k, v in sorted(self.grid.items())) + ")"

    @property
    def grid_key(self) -> str:
        return json.dumps(self.grid, sort_keys=True)


def _fmt(x: float, ref: float | None = None) -> str:
    """2 decimals when the magnitude of ``ref`` (default ``x``; shared by a cell) is 0 or in [0.1, 1e7), else 3
    significant digits."""
    if not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    r = abs(x if ref is None or not math.isfinite(ref) else ref)
    if r == 0 or 0.1 <= r < 1e7:
        return f"{x:.2f}"
    return f"{x:.3g}"


def format_mean_std(mean: float, std: float) -> str:
    """Markdown cell ``"mean ± std"``; just ``"mean"`` when std is NaN (a single seed)."""
    if math.isnan(std):
        return _fmt(mean)
    ref = mean if mean != 0 else std
    return f"{_fmt(mean, ref)} ± {_fmt(std, ref)}"


def format_delta(s: dict[str, Any]) -> str:
    """Markdown cell ``"mean ± t-half-width [bootstrap lo, hi]"`` of a paired summary dict (one pair: ``"mean (n=1)"``)."""
    if s["n"] < 2:
        return f"{_fmt(s['mean'])} (n=1)"
    lo, hi = s["bootstrap"]
    ref = max(abs(s["mean"]), abs(s["t_half_width"]))
    return (f"{_fmt(s['mean'], ref)} ± {_fmt(s['t_half_width'], ref)} "
            f"[{_fmt(lo, ref)}, {_fmt(hi, ref)}]")


def _groups(runs: list[RunRecord]) -> list[_Group]:
    groups: dict[tuple[str, str], _Group] = {}
    for r in runs:
        key = (r.variant, json.dumps(r.grid, sort_keys=True))
        g = groups.setdefault(key, _Group(variant=r.variant, grid=dict(r.grid), order=r.variant_order))
        g.order = min(g.order, r.variant_order)
        g.runs.append(r)
    out = sorted(groups.values(), key=lambda g: (g.order, g.variant, g.grid_key))
    for g in out:
        if len({r.config_hash for r in g.runs}) > 1:
            raise ValueError(f"variant {g.label!r}: runs {', '.join(sorted(r.sweep + '/' + r.run_id for r in g.runs))} "
                             "have different configs; report one sweep at a time (--sweep NAME)")
    return out


def _train_range(runs: list[RunRecord]) -> tuple[int, int] | None:
    ranges = set()
    for r in runs:
        if r.config["model"].get("architecture") == "unshared":
            continue
        depth = build_choice(DepthConfig, r.config["depth"])  # the depths the sampler draws from
        ranges.add((depth.depth, depth.depth) if depth.NAME == "fixed" else (getattr(depth, "lo", 1), depth.max_depth()))
    return ranges.pop() if len(ranges) == 1 else None


def build_report(store: ResultStore, *, baseline: str | None = None, sweep: str | None = None,
                 confidence: float = 0.95, n_resamples: int = DEFAULT_RESAMPLES,
                 bootstrap_seed: int = DEFAULT_BOOTSTRAP_SEED) -> dict[str, Any]:
    """The JSON-ready report of the store (of one ``sweep``; ``baseline`` default: the first variant): ``models``
    and ``sections``, each with ``cells`` (label → depth → {n, mean, std, seeds, values}) and ``deltas``.

    ValueError: no runs stored, an unknown ``baseline``, or one variant with different configs.
    """
    runs = store.runs(sweep)
    if not runs:
        where = f" of sweep {sweep!r}" if sweep else ""
        raise ValueError(f"--db: no runs{where} stored in {store.path}; run `looplm sweep` first")
    groups = _groups(runs)
    variants = list(dict.fromkeys(g.variant for g in groups))
    if baseline is None:
        baseline = variants[0]
    elif baseline not in variants:
        raise ValueError(f"--baseline: unknown variant {baseline!r}; known: {', '.join(variants)}")

    table = _eval_table(store, groups)
    hashes_per_set = defaultdict(set)
    for (proto, phash, tag, ds, split, _m) in table:
        hashes_per_set[(proto, tag, ds, split)].add(phash)
    base_of = {g.grid_key: g.label for g in groups if g.variant == baseline}
    paired = dict(confidence=confidence, n_resamples=n_resamples, seed=bootstrap_seed)

    def metric_order(m: str, proto: str) -> tuple:
        wanted = TABLE_METRICS.get(proto)
        return (wanted.index(m) if wanted else 0, m)

    sections = []
    for key in sorted(table, key=lambda k: (_PROTOCOL_ORDER.get(k[0], 9), k[0], k[3], k[4], k[2], k[1],
                                              metric_order(k[5], k[0]))):
        proto, phash, tag, ds, split, metric = key
        data = table[key]
        cells, deltas = _cells(data, groups), {}
        for g in groups:
            base_label = base_of.get(g.grid_key)
            if g.label in data and (proto, metric) in PAIRED_METRICS and g.variant != baseline and base_label in data:
                deltas[g.label] = _deltas(data[g.label], data[base_label], base_label, paired)
        sections.append({
            "protocol": proto, "protocol_hash": phash, "settings": store.protocol_settings(phash),
            "ambiguous_settings": len(hashes_per_set[(proto, tag, ds, split)]) > 1,
            "dataset": ds, "split": split, "tag": tag, "metric": metric,
            "depth_name": "t" if proto == "diagnose" else "T",
            "depths": sorted({t for per in data.values() for t in per}), "cells": cells, "deltas": deltas})
    return {"db": str(store.path), "sweeps": sorted({r.sweep for r in runs}), "baseline": baseline,
            "variants": [g.label for g in groups], "seeds": sorted({r.seed for r in runs}),
            "confidence": confidence, "bootstrap": {"resamples": n_resamples, "seed": bootstrap_seed},
            "train_range": _train_range(runs), "models": [_model_entry(g) for g in groups], "sections": sections}


def _eval_table(store: ResultStore, groups: list[_Group]) -> dict[tuple, dict[str, dict[int, dict[int, float]]]]:
    """(protocol, protocol_hash, tag, dataset, split, metric) → label → depth → seed → value."""
    table: dict[tuple, dict[str, dict[int, dict[int, float]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(dict)))
    for g in groups:
        seeds = {r.seed for r in g.runs}
        for row in store.evaluations(config_hash=g.runs[0].config_hash):
            if row["seed"] not in seeds:
                continue
            wanted = TABLE_METRICS.get(row["protocol"])
            if wanted is not None and row["metric"] not in wanted:
                continue
            key = (row["protocol"], row["protocol_hash"], row["tag"], row["dataset"], row["split"], row["metric"])
            table[key][g.label][row["depth"]][row["seed"]] = row["value"]
    return table


def _cells(data: dict[str, dict[int, dict[int, float]]], groups: list[_Group]) -> dict[str, dict[str, Any]]:
    cells: dict[str, dict[str, Any]] = {}
    for label in (g.label for g in groups if g.label in data):
        cells[label] = {}
        for t, per_seed in sorted(data[label].items()):
            seeds = sorted(per_seed)
            values = [per_seed[s] for s in seeds]
            m, s = mean_std(values)
            cells[label][str(t)] = {"n": len(values), "mean": m, "std": s, "seeds": seeds, "values": values}
    return cells


def _deltas(ours: dict[int, dict[int, float]], base: dict[int, dict[int, float]], base_label: str,
            paired: dict[str, Any]) -> dict[str, Any]:
    summaries = {t: summarize_paired(per_seed, base.get(t, {}), **paired) for t, per_seed in sorted(ours.items())}
    return {str(t): {**s.to_dict(), "baseline": base_label} for t, s in summaries.items() if s is not None}


def _model_entry(g: _Group) -> dict[str, Any]:
    r = g.runs[0]
    return {"label": g.label, "variant": g.variant, "grid": g.grid,
            "architecture": r.config["model"].get("architecture"), "rule": r.config["model"].get("rule"),
            "params": r.params, "flops": {str(k): v for k, v in sorted(r.flops.items())},
            "config_hash": r.config_hash, "config": r.config,
            "runs": [{**{k: v for k, v in asdict(x).items() if k not in ("config", "flops")},
                      "config_hash": x.config_hash} for x in g.runs]}


def _section_title(sec: dict[str, Any]) -> str:
    metric = METRIC_TITLES.get(sec["metric"], sec["metric"])
    where = f"{sec['dataset']} {sec['split']}"
    title = {"lambada": metric, "diagnose": f"diagnose {metric} — {where}"}.get(sec["protocol"],
                                                                              f"{metric} — {where}")
    if sec["tag"]:
        title += f" (tag {sec['tag']})"
    if sec["ambiguous_settings"]:
        title += f" [settings {json.dumps(sec['settings'], sort_keys=True)}]"
    return title


def plot_name(sec: dict[str, Any]) -> str:
    """File name of a section's depth plot, e.g. ``ppl_brown_test.png``."""
    parts = [sec["metric"], sec["dataset"], sec["split"]] + ([sec["tag"]] if sec["tag"] else [])
    if sec["ambiguous_settings"]:
        parts.append(sec["protocol_hash"][:8])
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", "_".join(parts)) + ".png"


def _n_text(counts: list[int]) -> str:
    if not counts:
        return "0"
    return str(counts[0]) if min(counts) == max(counts) else f"{min(counts)}–{max(counts)}"


def _depth_table(sec: dict[str, Any], key: str, fmt: Callable[[dict], str]) -> list[str]:
    """A section's ``cells`` or ``deltas`` as a Markdown table: variant, seeds (or pairs), one column per depth."""
    rows = [[label, _n_text([c["n"] for c in per.values()]),
             *[fmt(per[str(t)]) if str(t) in per else "–" for t in sec["depths"]]] for label, per in sec[key].items()]
    n = "n" if key == "cells" else "pairs"
    return md_table(["variant", n, *[f"{sec['depth_name']}={t}" for t in sec["depths"]]], rows) + [""]


def render_markdown(report: dict[str, Any], *, plots: dict[int, str] | None = None) -> str:
    """The report as Markdown (``plots``: section index → PNG file name to embed)."""
    plots = plots or {}
    conf = round(100 * report["confidence"])
    lines = ["# looplm report", "",
             f"Database `{report['db']}` · sweeps: {', '.join(report['sweeps'])} · variants: "
             f"{', '.join(report['variants'])} · seeds: {', '.join(map(str, report['seeds']))} · "
             f"baseline: {report['baseline']}", "",
             "Cells are mean ± std over seeds (sample std, ddof = 1; one seed shows the mean alone); "
             "n = seeds per cell. Paired deltas are variant − baseline matched by (seed, depth): mean ± "
             f"{conf}% Student-t half-width [{conf}% paired-bootstrap percentile interval, "
             f"{report['bootstrap']['resamples']:,} resamples, seed {report['bootstrap']['seed']}].", ""]

    depths = sorted({int(t) for m in report["models"] for t in m["flops"]})
    lines += ["## Parameters and FLOP proxy", "",
              "FLOPs per token, body + head (SCSE eq. 20–21), in millions.", ""]
    rows = [[m["label"], str(m["architecture"]), str(m["rule"]) if m["architecture"] != "unshared" else "–",
             f"{m['params']:,}" if m["params"] is not None else "–",
             *[f"{m['flops'][str(t)]['body_head'] / 1e6:.2f}" if str(t) in m["flops"] else "–" for t in depths]]
            for m in report["models"]]
    lines += md_table(["variant", "architecture", "rule", "params", *[f"T={t}" for t in depths]], rows) + [""]

    for i, sec in enumerate(report["sections"]):
        title = _section_title(sec)
        lines += [f"## {title}", ""] + _depth_table(sec, "cells", lambda c: format_mean_std(c["mean"], c["std"]))
        if sec["deltas"]:
            lines += [f"### Paired deltas vs {report['baseline']}: {title}", ""]
            lines += _depth_table(sec, "deltas", format_delta)
        if i in plots:
            lines += [f"![{title}]({plots[i]})", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_report(db: str | Path | ResultStore, out: str | Path, *, baseline: str | None = None,
                 sweep: str | None = None, plots: bool = True) -> dict[str, Any]:
    """Write ``report.md``, ``report.json`` and depth plots of ``db`` to ``out``; returns their paths and the
    ``report``.

    Args:
        baseline: the variant every paired delta is taken against (default: the first variant)
        sweep: report only the runs of this sweep name (default: every sweep in the database)
    """
    from looplm.analysis.plots import plot_mean_std_vs_depth

    # a path is opened read-only: never changes the file (FileNotFoundError when it does not exist)
    with contextlib.nullcontext(db) if isinstance(db, ResultStore) else ResultStore(db, readonly=True) as store:
        report = build_report(store, baseline=baseline, sweep=sweep)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pngs: dict[int, str] = {}
    if plots:
        for i, sec in enumerate(report["sections"]):
            if (sec["protocol"], sec["metric"]) not in PAIRED_METRICS or not sec["cells"]:
                continue
            curves = {label: {int(t): (c["mean"], c["std"]) for t, c in per.items()}
                      for label, per in sec["cells"].items()}
            name = plot_name(sec)
            plot_mean_std_vs_depth(curves, out / name, title=_section_title(sec),
                                   ylabel=METRIC_TITLES.get(sec["metric"], sec["metric"]),
                                   train_range=report["train_range"])
            pngs[i] = name
    md_path, json_path = out / "report.md", out / "report.json"
    md_path.write_text(render_markdown(report, plots=pngs))
    json_path.write_text(json.dumps(strict(report)[0], indent=2, allow_nan=False) + "\n")
    return {"markdown": md_path, "json": json_path, "plots": [out / p for p in pngs.values()], "report": report}
