"""Summarize a depth-testbed sweep from its results DB: the headline (sweep.toml → results.md, acc_vs_T.png) or
the extrapolation sweep (extrapolation.toml → extrapolation/results.md, extrapolation/acc_vs_T.png).

Reads ``<folder>/results.db`` (protocol ``tasks``: exact match per difficulty k and loop depth T on the held-out
test instances, the same instances for every model) and the planned runs from ``<folder>/sweep.json``. Every
table opens with the depth-use column (issue 24: accuracy at T = 1, at the model's training depth and at the
best T, seed means; :func:`looplm.analysis.claims.depth_use_cell`). Paired deltas pair the seeds (same seed,
same instances).

    python experiments/depth-testbed/summarize.py [headline|extrapolation|extrapolation-long]
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from looplm.analysis.claims import depth_use_cell, mean_std_cell, paired_claim, validation_curves
from looplm.analysis.store import ResultStore

HERE = Path(__file__).resolve().parent
#: name → (folder, sweep, baseline, the claim's sign (model − baseline), title, results.md and plot folder, extra
#: paired comparisons (model, reference): two-sided, no claimed side)
SWEEPS = {"headline": ("headline", "depth-testbed", "looped", "negative", "headline", HERE, ()),
          "extrapolation": ("extrapolation", "depth-extrapolation", "answer", "positive", "depth extrapolation",
                            HERE / "extrapolation", (("unshared_flops", "partial"),)),
          "extrapolation-long": ("extrapolation-long", "depth-extrapolation-long", "answer", "positive",
                                 "depth extrapolation, 10,000 steps", HERE / "extrapolation-long",
                                 (("unshared_flops", "partial"),))}


def train_depth(config: dict) -> int:
    """The depth a model was trained at: its fixed depth, or the top of its uniform range."""
    d = config["depth"]
    return d["depth"] if d["sampler"] == "fixed" else d["hi"]


def per_seed(by_seed: dict) -> str:
    """``"s0 a · s1 b · …"`` of ``{seed: value}``."""
    return " · ".join(f"s{s} {v:.1f}" for s, v in sorted(by_seed.items()))


def load(store: ResultStore, sweep: str) -> tuple[dict, dict]:
    """``acc[variant][k][T][seed]`` (%) and per-variant metadata (params, FLOPs, training depth, k_train)."""
    acc: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    meta: dict = {}
    for run in store.runs(sweep):
        T_train = train_depth(run.config)
        meta.setdefault(run.variant, {"order": run.variant_order, "params": run.params, "T": T_train,
                                      "flops": run.flops.get(T_train, {}).get("body_head"),
                                      "k_train": run.config["data"]["task_k"], "task": run.config["data"]["task"],
                                      "looped": run.config["model"]["architecture"] != "unshared",
                                      "seeds": set(), "wall_s": []})
        meta[run.variant]["wall_s"].append(run.summary.get("wall_s", float("nan")))
        rows = store.evaluations(protocol="tasks", config_hash=run.config_hash, seed=run.seed, metric="acc",
                                 split="test")
        if rows:
            meta[run.variant]["seeds"].add(run.seed)
        for r in rows:
            k = int(r["dataset"].rsplit("-k", 1)[1])
            acc[run.variant][k][r["depth"]][run.seed] = 100 * r["value"]
    return acc, meta


def plot(acc: dict, meta: dict, variants: list[str], path: Path) -> None:
    """One panel per model: accuracy against T, one curve per k (seed mean, min–max band; dashed k > k_train)."""
    from looplm.analysis.plots import plt, save_figure

    fig, axes = plt.subplots(1, len(variants), figsize=(4.2 * len(variants), 3.6), sharey=True, squeeze=False)
    ks = sorted({k for v in variants for k in acc[v]})
    colors = plt.cm.viridis([i / max(1, len(ks) - 1) for i in range(len(ks))])
    for ax, v in zip(axes[0], variants):
        for k, c in zip(ks, colors):
            Ts = sorted(acc[v].get(k, {}))
            if not Ts:
                continue
            vals = [list(acc[v][k][T].values()) for T in Ts]
            ax.plot(Ts, [statistics.mean(x) for x in vals], color=c, label=f"k={k}",
                    linestyle="--" if k > meta[v]["k_train"] else "-", marker=".")
            ax.fill_between(Ts, [min(x) for x in vals], [max(x) for x in vals], color=c, alpha=0.15)
        ax.axvline(meta[v]["T"], color="red", linestyle=":", linewidth=1)
        ax.set_title(f"{v} (seeds: {len(meta[v]['seeds'])}, trained T={meta[v]['T']})", fontsize=9)
        top = max(T for by_T in acc[v].values() for T in by_T)
        ax.set_xticks([T for T in (1, 2, 4, 8, 12, 16, 24, 32, 48) if T <= top])
        ax.set_xlabel("loop depth T")
        ax.set_ylim(-2, 102)
    axes[0][0].set_ylabel("exact match (%)")
    axes[0][-1].legend(fontsize=7, ncol=2)
    save_figure(fig, path)


def more_loops(acc: dict, meta: dict, variants: list[str], k_train: int) -> list[str]:
    """Issue 24 §2's "more loops than were trained": accuracy at T = 2·T_train against T = T_train per k,
    paired over seeds (one-sided: more loops higher), for each looped model evaluated at 2·T_train. The depth 2·T_train
    is fixed in advance, not picked on the test split."""
    lines = []
    for v in variants:
        T = meta[v]["T"]
        if not meta[v]["looped"] or not any(2 * T in by_T for by_T in acc[v].values()):
            continue
        lines += ["", f"## More loops than trained: `{v}` at T = {2 * T} (2 × its training depth) − at T = {T}, "
                  "paired over seeds", "",
                  f"| k | acc at T = {T} | acc at T = {2 * T} | Δ [95% t interval] (bootstrap) | verdict "
                  "(more loops higher) |", "|---:|---:|---:|---|---|"]
        for k in sorted(acc[v]):
            a, b = acc[v][k].get(2 * T, {}), acc[v][k].get(T, {})
            cell, verdict = paired_claim(a, b, expect="positive")
            lines.append(f"| {k}{'*' if k > k_train else ''} | {mean_std_cell(b.values())} | "
                         f"{mean_std_cell(a.values())} | {cell} | {verdict} |")
    return lines


def main(name: str = "headline") -> None:
    folder, sweep, baseline, expect, title, out, pairs = SWEEPS[name]
    db = HERE / folder / "results.db"
    with ResultStore(db, readonly=True) as store:
        acc, meta = load(store, sweep)
    variants = sorted((v for v in meta if meta[v]["seeds"]), key=lambda v: meta[v]["order"])
    total = sum(len(m["seeds"]) for m in meta.values())
    if not total:
        raise SystemExit(f"{db}: no evaluated run of sweep {sweep} yet")
    any_meta = next(iter(meta.values()))
    planned = len(json.loads((db.parent / "sweep.json").read_text())["runs"])
    k_train = any_meta["k_train"]
    toml = "sweep.toml" if name == "headline" else f"{name}.toml"
    lines = [f"# Depth testbed {title}: results", "",
             f"Generated by `python experiments/depth-testbed/summarize.py{'' if name == 'headline' else ' ' + name}` "
             f"from `{folder}/results.db` (sweep `{sweep}`, `{toml}`). Task `{any_meta['task']}`, trained on k = 1 … {k_train}; exact match "
             f"(%) on the held-out test instances of each k (the same instances for every model). Runs "
             f"evaluated: {total} of {planned} (`{folder}/sweep.json`).", "",
             "Depth use: accuracy at T = 1 · at the model's training depth · at the best T (seed means).", "",
             "## Per model: mean over k = 1 … k_train (in distribution) and k > k_train (extrapolation)", "",
             "| depth use, k ≤ k_train | model | seeds | params | FLOPs/token at T_train | acc at T_train, "
             "k ≤ k_train | depth use, k > k_train | training wall (s) |", "|---|---|---:|---:|---:|---:|---|---:|"]
    for v in variants:
        m = meta[v]

        def pooled(sel, v=v, m=m):  # {T: {seed: mean acc over the selected k}}
            ks = [k for k in acc[v] if sel(k)]
            Ts = set.intersection(*(set(acc[v][k]) for k in ks)) if ks else set()
            return {T: {s: statistics.mean(acc[v][k][T][s] for k in ks) for s in m["seeds"]
                        if all(s in acc[v][k][T] for k in ks)} for T in Ts}

        ind, ext = pooled(lambda k: k <= k_train), pooled(lambda k: k > k_train)
        lines.append(f"| {depth_use_cell(ind, m['T'], higher_is_better=True)} | `{v}` | {len(m['seeds'])} "
                     f"| {m['params']:,} | {m['flops']:,} | {mean_std_cell(ind.get(m['T'], {}).values())} "
                     f"| {depth_use_cell(ext, m['T'], higher_is_better=True)} "
                     f"| {min(m['wall_s']):.0f}–{max(m['wall_s']):.0f} |")
    higher = baseline if expect == "negative" else "model"
    lines += ["", f"## Per difficulty k (Δ: model − `{baseline}`, each at its training depth, paired over seeds: "
              "mean [95% t interval] (bootstrap))", "",
              f"| depth use | k | model | acc at T_train | per seed | Δ vs {baseline} | verdict ({higher} higher) |",
              "|---|---:|---|---:|---|---|---|"]
    for k in sorted({k for v in variants for k in acc[v]}):
        for v in variants:
            by_T, T = acc[v].get(k, {}), meta[v]["T"]
            base = acc.get(baseline, {}).get(k, {}).get(meta.get(baseline, {}).get("T"), {})
            cell, verdict = ("", "") if v == baseline else paired_claim(by_T.get(T, {}), base, expect=expect)
            lines.append(f"| {depth_use_cell(by_T, T, higher_is_better=True)} | {k}{'*' if k > k_train else ''} "
                         f"| `{v}` | {mean_std_cell(by_T.get(T, {}).values())} | {per_seed(by_T.get(T, {}))} "
                         f"| {cell} | {verdict} |")
    for v, ref in pairs:
        if v not in meta or ref not in meta:
            continue
        lines += ["", f"## `{v}` − `{ref}` per k, each at its training depth, paired over seeds", "",
                  f"| k | `{v}` | `{ref}` | Δ [95% t interval] (bootstrap) |", "|---:|---:|---:|---|"]
        for k in sorted(set(acc[v]) & set(acc[ref])):
            a, b = acc[v][k].get(meta[v]["T"], {}), acc[ref][k].get(meta[ref]["T"], {})
            lines.append(f"| {k}{'*' if k > k_train else ''} | {mean_std_cell(a.values())} | "
                         f"{mean_std_cell(b.values())} | {paired_claim(a, b)[0]} |")
    lines += more_loops(acc, meta, variants, k_train)
    lines += ["", "\\* k beyond training.", "", "![accuracy vs T](acc_vs_T.png)", ""]
    # learning curves (valid split, T = train.eval_depth), kept in curves.json: the run folders are not committed
    curves = validation_curves(HERE / folder / "runs", out / "curves.json", extra=("val_acc",))
    if curves:
        lines += ["## Learning curves (valid exact match at the evaluation depth; `curves.json`)", "",
                  "| run | steps | first step at ≥ 95% | last valid exact match |", "|---|---:|---:|---:|"]
        for run, c in sorted(curves.items()):
            acc_by_step = sorted((int(st), a) for st, a in c["val_acc"].items())
            first = next((st for st, a in acc_by_step if a >= 0.95), None)
            lines.append(f"| `{run}` | {c['steps_done']:,}{'' if c['finished'] else ' (unfinished)'} | "
                         f"{'–' if first is None else f'{first:,}'} | "
                         f"{100 * acc_by_step[-1][1] if acc_by_step else float('nan'):.1f}% |")
        lines.append("")
    plot(acc, meta, variants, out / "acc_vs_T.png")
    (out / "results.md").write_text("\n".join(lines))
    print(f"wrote {out / 'results.md'} ({total} of {planned} runs)")


if __name__ == "__main__":
    main(*sys.argv[1:2])
