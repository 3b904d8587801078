"""Summaries of the CPU-scale experiments of issues 4 and 5 (tables + plots from the sweeps' outputs).

    python experiments/summarize.py huginn    # experiments/huginn-cpu: extrapolation, sharing penalty, convergence
    python experiments/summarize.py deeploop  # experiments/deeploop-cpu: p-sweep and R comparison vs the unigram floor
    python experiments/summarize.py readout   # experiments/readout-cpu: per-loop norms and PPL

Each reads the sweep's ``results.db`` (``looplm sweep``), the runs' ``summary.json`` / ``metrics.jsonl`` and
the ``diagnose`` / ``sharing`` JSON files written next to the runs, and writes ``results.md`` (+ PNG) into
the experiment folder. Means are over the seeds present; every number comes from a stored evaluation.
Every PPL table opens with a depth-use column (issue 24): the metric at T = 1, at the training depth and at
the best T. The run folders are not committed: without them, the tables read from them (terminal sharing,
token convergence, per-loop norms, halting) are left out, and the summary says so.
"""

from __future__ import annotations

import json
import math
import sqlite3
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from looplm.analysis.claims import depth_use_cell  # noqa: E402

HERE = Path(__file__).resolve().parent


def ppl_table(db: Path, sweep: str, split: str = "test", dataset: str = "brown") -> dict[str, dict[int, dict[int, float]]]:
    """{variant: {depth: {seed: ppl}}} of the sweep's perplexity evaluations."""
    con = sqlite3.connect(db)
    rows = con.execute(
        "SELECT r.variant, e.depth, e.seed, e.value FROM runs r JOIN evaluations e ON e.config_hash = r.config_hash "
        "AND e.seed = r.seed WHERE r.sweep = ? AND e.protocol = 'ppl' AND e.metric = 'ppl' AND e.split = ? "
        "AND e.dataset = ?", (sweep, split, dataset)).fetchall()
    out: dict = defaultdict(lambda: defaultdict(dict))
    for variant, depth, seed, value in rows:
        out[variant][depth][seed] = value
    return out


def mean_std(values) -> str:
    v = np.asarray(list(values), dtype=float)
    if len(v) == 1:
        return f"{v[0]:.1f}"
    return f"{v.mean():.1f} ± {v.std(ddof=1):.1f}"


def runs(exp: Path) -> dict[str, Path]:
    """{run id: run folder} of the finished runs under ``exp/runs``; empty when the folder is missing (run
    folders are not committed)."""
    if not (exp / "runs").is_dir():
        return {}
    return {p.name: p for p in sorted((exp / "runs").iterdir()) if (p / "summary.json").exists()}


def no_runs_note(exp: Path, what: str) -> list[str]:
    """The line that replaces a table read from the run folders when they are not here."""
    return ["", f"{what}: read from the run folders (`{exp.name}/runs/`), which are not committed and are not here; "
            "no number of it is given here (earlier versions of this file had one, not from a committed file). "
            "Re-run the sweep to get it back."]


# ---------------------------------------------------------------------------------------------- huginn
def huginn() -> None:
    exp = HERE / "huginn-cpu"
    tab = ppl_table(exp / "results.db", "huginn-cpu")
    lines = ["# Looped Models Done Right at CPU scale (issue 4 §4)", "",
             "Command: `looplm sweep experiments/huginn-cpu/sweep.toml --out experiments/huginn-cpu`, then per run "
             "`looplm eval kv-sharing --checkpoint experiments/huginn-cpu/runs/RUN --depths 5 --max-tokens 8192 "
             "--out experiments/huginn-cpu/runs/RUN/sharing.json`, then `python experiments/summarize.py huginn`.", "",
             "Brown test PPL (first 8,192 tokens), mean ± std over seeds:", "",
             "| variant | depth use: R=1 · R=5 · best R | seeds | R=1 | R=3 | R=5 | R=8 | R=16 | R=32 | R=64 |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    depths = [1, 3, 5, 8, 16, 32, 64]
    use = {v: depth_use_cell(tab[v], 5) for v in tab}
    for v in sorted(tab):
        seeds = sorted(tab[v][5])
        lines.append(f"| `{v}` | {use[v]} | {len(seeds)} | " + " | ".join(mean_std(tab[v][d].values()) for d in depths) + " |")
    lines += ["", "Extrapolation: PPL at R / PPL at the training mean R = 5, minus 1 (mean over seeds):", "",
              "| variant | depth use (PPL) | R=8 | R=16 | R=32 | R=64 |", "|---|---|---:|---:|---:|---:|"]
    degr: dict[str, dict[int, float]] = {}
    for v in sorted(tab):
        degr[v] = {d: float(np.mean([tab[v][d][s] / tab[v][5][s] - 1 for s in tab[v][5]])) for d in (8, 16, 32, 64)}
        lines.append(f"| `{v}` | {use[v]} | " + " | ".join(f"{100 * degr[v][d]:+.1f}%" for d in (8, 16, 32, 64))
                     + " |")
    share = defaultdict(list)
    conv = defaultdict(list)
    folders = runs(exp)
    for name, run in folders.items():
        variant = name.rsplit("-s", 1)[0]
        f = run / "sharing.json"
        if f.exists():
            share[variant].append(json.loads(f.read_text()))
        d = run / "diagnose" / "diagnose.json"
        if d.exists():
            c = json.loads(d.read_text()).get("convergence")
            if c:
                conv[variant].append(c)
    if share:
        lines += ["", "Terminal KV sharing at R = 5 (continuation protocol: prefill the first 64 tokens of each "
                  "128-token window into a terminal cache, score the last 64 in one pass):", "",
                  "| variant | depth use (PPL) | seeds | PPL full | PPL terminal | sharing penalty "
                  "| KV bytes per_visit / terminal |", "|---|---|---:|---:|---:|---:|---:|"]
        for v, items in sorted(share.items()):
            r = [it["depths"]["5"] for it in items]
            lines.append(f"| `{v}` | {use.get(v, '–')} | {len(r)} | {mean_std(x['ppl_full'] for x in r)} | "
                         f"{mean_std(x['ppl_terminal'] for x in r)} | "
                         f"{np.mean([x['sharing_penalty_pct'] for x in r]):+.1f}% | "
                         f"{r[0]['kv_bytes_full']:,} / {r[0]['kv_bytes_terminal']:,} |")
    if conv:
        lines += ["", "Token convergence (`looplm diagnose`, valid split, 2 × 8 windows, R_obs = 64, τ = 2%):", "",
                  "| variant | depth use (PPL) | mean convergence depth | never converged | Spearman(depth, position) |",
                  "|---|---|---:|---:|---:|"]
        for v, items in sorted(conv.items()):
            lines.append(f"| `{v}` | {use.get(v, '–')} | {np.mean([c['depth_mean'] for c in items]):.1f} | "
                         f"{100 * np.mean([c['never_fraction'] for c in items]):.1f}% | "
                         f"{np.mean([c['spearman'] for c in items if c['spearman'] is not None]):+.3f} |")
    if not folders:
        lines += no_runs_note(exp, "Terminal KV sharing at R = 5 and token convergence")
    fig, ax = plt.subplots(figsize=(6, 4))
    for v in sorted(tab):
        ds = sorted(tab[v])
        ax.plot(ds, [np.mean(list(tab[v][d].values())) for d in ds], marker="o", label=v)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.axvline(5, color="grey", ls=":", lw=1)
    ax.set_xlabel("recurrences R at evaluation")
    ax.set_ylabel("Brown test PPL")
    ax.set_title("Huginn-style 1+2×R+1 models: extrapolation")
    ax.legend()
    fig.tight_layout()
    fig.savefig(exp / "ppl_vs_recurrence.png", dpi=120)
    lines += ["", "![PPL vs recurrences](ppl_vs_recurrence.png)"]
    (exp / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


# -------------------------------------------------------------------------------------------- deeploop
def unigram_floor(cfg_json: dict, split: str) -> float:
    from looplm.config import Config
    from looplm.data.tokens import unigram_ppl
    from looplm.train.trainer import prepare_data

    cfg = Config.from_dict(cfg_json)
    data = prepare_data(cfg, progress=False)
    return unigram_ppl(data.train, data.valid if split == "valid" else data.test, data.vocab_size)


P_OF = {"post_ln-R3": 0.0, "p0.25-R3": 0.25, "p0.40-R3": 0.40, "p0.45-R3": 0.45, "deeploop-R3": 0.5, "p0.60-R3": 0.6}


def _sweep_runs(folder: Path) -> dict[str, dict[int, dict]]:
    """{variant: {seed: {val_loss, val_ppl, config, run}}} of the finished runs of the sweep in ``folder``,
    from its results.db (so it works without the run folders, which are not committed); ``run`` is the
    run folder when it still exists (for the training curves), else None."""
    out: dict = defaultdict(dict)
    if not (folder / "results.db").exists():
        return out
    con = sqlite3.connect(folder / "results.db")
    for run_id, variant, seed, summary, config, chash in con.execute(
            "SELECT run_id, variant, seed, summary_json, config_json, config_hash FROM runs"):
        summ = json.loads(summary)
        if summ.get("completed_steps") != summ.get("steps"):
            continue
        run = folder / "runs" / run_id
        by_depth = dict(con.execute("SELECT depth, value FROM evaluations WHERE config_hash = ? AND seed = ? AND "
                                    "protocol = 'ppl' AND dataset = 'brown' AND split = 'valid' AND metric = 'ppl'",
                                    (chash, seed)).fetchall())
        out[variant][int(seed)] = {"val_loss": summ["val_loss"], "val_ppl": summ["val_ppl"], "valid_by_depth": by_depth,
                                   "config": json.loads(config), "run": run if (run / "metrics.jsonl").exists() else None}
    con.close()
    return out


def _depth_use(seeds: dict[int, dict], train_depth: int) -> str:
    """Depth-use cell of Brown valid PPL (T = 1, 3, 5 stored) over the seeds of one variant."""
    by_depth: dict[int, dict[int, float]] = defaultdict(dict)
    for seed, r in seeds.items():
        for d, x in r.get("valid_by_depth", {}).items():
            by_depth[d][seed] = x
    return depth_use_cell(by_depth, train_depth)


DEEPLOOP_USE = "depth use: valid PPL at T=1 · T=R · best T"


def _p_table(by_variant, floor: float) -> tuple[list[str], list[tuple[float, float, bool]]]:
    lines = [f"| p | {DEEPLOOP_USE} | α = (2N)^p | β = (8N)^-p | final val loss per seed | trains |",
             "|---:|---|---:|---:|---|---:|"]
    pts = []
    n = 6
    for v, p in P_OF.items():
        seeds = by_variant.get(v)
        if not seeds:
            continue
        losses = [seeds[s]["val_loss"] for s in sorted(seeds)]
        ok = [seeds[s]["val_ppl"] < 0.8 * floor for s in sorted(seeds)]
        pts += [(p, x, t) for x, t in zip(losses, ok)]
        lines.append(f"| {p:.2f}{' (post_ln)' if p == 0 else ' (deeploop)' if p == 0.5 else ''} | "
                     f"{_depth_use(seeds, 3)} | {(2 * n) ** p:.3f} | {(8 * n) ** -p:.3f} | " + ", ".join(f"{x:.3f}" for x in losses)
                     + f" | {sum(ok)}/{len(ok)} |")
    return lines, pts


def _curves(ax, by_variant, floor: float, title: str) -> None:
    cmap = plt.get_cmap("viridis")
    for v in [*P_OF, "pre_ln-R3"]:
        for seed, r in sorted(by_variant.get(v, {}).items()):
            if r["run"] is None:  # run folder gone: no training curve
                continue
            rows = [json.loads(x) for x in (r["run"] / "metrics.jsonl").read_text().splitlines()]
            pts_ = [(x["step"], x["loss"]) for x in rows if "loss" in x and "step" in x]
            steps_, loss_ = np.array(pts_).T
            k = 10
            smooth = np.convolve(loss_, np.ones(k) / k, mode="valid")
            colour = "black" if v == "pre_ln-R3" else cmap(P_OF[v] / 0.6)
            ax.plot(steps_[k - 1:], smooth, color=colour, lw=1, label=v if seed == min(by_variant[v]) else None)
    ax.axhline(math.log(floor), color="grey", ls=":", label="unigram floor")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (10-step mean)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6)


def _has_run(*sweeps) -> bool:
    """Whether a run folder (with its training curve) of any of these sweeps is here."""
    return any(r["run"] is not None for d in sweeps for v in d.values() for r in v.values())


def _p_scatter(ax, t_pts, b_pts, u_pts, floor: float) -> None:
    """Final validation loss against the exponent p, one marker per sweep."""
    for pts, marker, label in ((t_pts, "x", "tied, 300 steps"), (b_pts, "+", "tied, 4× batch, 300 steps"),
                               (u_pts, "o", "untied, 150 steps")):
        if pts:
            ax.scatter([p for p, _, _ in pts], [x for _, x, _ in pts], marker=marker, label=label)
    ax.axhline(math.log(floor), color="grey", ls=":", label="unigram floor")
    ax.set_xlabel("exponent p (α = (2N)^p, β = (8N)^-p)")
    ax.set_ylabel("final validation loss (nats)")
    ax.set_title("Post-LN looped GPT, R = 3, K = 2", fontsize=9)
    ax.legend(fontsize=7)


def deeploop() -> None:
    exp = HERE / "deeploop-cpu"
    tied, untied, depth, tied64 = (_sweep_runs(f) for f in (exp, exp / "untied", exp / "depth", exp / "tied-b64"))
    if not tied:  # the tied sweep's DB is empty and its run folders are gone: its recorded losses
        rec = json.loads((exp / "tied-300.json").read_text())["runs"]
        tied = {v: {int(s): {**x, "run": None} for s, x in seeds.items()} for v, seeds in rec.items()}
    any_run = next(r for d in (untied, tied) for v in d.values() for r in v.values() if "config" in r)
    floor = unigram_floor(any_run["config"], "valid")
    lines = ["# DeepLoop at CPU scale (issue 5 §5)", "",
             "Commands (each sweep is resumable):", "", "```bash",
             "looplm sweep experiments/deeploop-cpu/sweep.toml --out experiments/deeploop-cpu          # tied, 300 steps",
             "looplm sweep experiments/deeploop-cpu/untied.toml --out experiments/deeploop-cpu/untied  # untied, 150 steps",
             "looplm sweep experiments/deeploop-cpu/depth.toml --out experiments/deeploop-cpu/depth    # R = 1, 5",
             "looplm sweep experiments/deeploop-cpu/tied-b64.toml --out experiments/deeploop-cpu/tied-b64  # tied, 4× batch",
             "python experiments/summarize.py deeploop", "```", "",
             f"Unigram floor (add-one unigram of Brown train → Brown valid, same BPE): PPL {floor:.1f} "
             f"(loss {math.log(floor):.3f}). A run *trains* when its final validation PPL is below 0.8 × the floor "
             "(our threshold), i.e. loss below "
             f"{math.log(0.8 * floor):.3f}; otherwise it stays at the unigram floor.", "",
             "Post-LN looped GPT (rule plain, input-embedding RMSNorm), K = 2 core blocks, R = 3, so N = 6.", "",
             "## p-sweep, the paper's recipe (tied embeddings), 300 steps, seed 0", ""]
    t_lines, t_pts = _p_table(tied, floor)
    lines += t_lines
    b_pts: list = []
    if tied64:
        lines += ["", "## p-sweep, tied embeddings at 4× the batch (64×128 = 8,192 tokens per step), 300 steps, seed 0",
                  ""]
        b_lines, b_pts = _p_table(tied64, floor)
        lines += b_lines
    lines += ["", "## p-sweep with untied embeddings, 150 steps, seeds 0–2", ""]
    u_lines, u_pts = _p_table(untied, floor)
    lines += u_lines
    lines += ["", "## DeepLoop (p = 1/2) vs α = β = 1 (post_ln) at R = 1, 3, 5 (untied, 150 steps)", "",
              f"| R | {DEEPLOOP_USE}, post_ln / deeploop | N = 2R | post_ln val loss | deeploop val loss | seeds |",
              "|---:|---|---:|---:|---:|---:|"]
    for R in (1, 3, 5):
        src = untied if R == 3 else depth
        a, b = src.get(f"post_ln-R{R}", {}), src.get(f"deeploop-R{R}", {})
        common = sorted(set(a) & set(b))
        if common:
            use = f"{_depth_use({s: a[s] for s in common}, R)} / {_depth_use({s: b[s] for s in common}, R)}"
            lines.append(f"| {R} | {use} | {2 * R} | {np.mean([a[s]['val_loss'] for s in common]):.3f} | "
                         f"{np.mean([b[s]['val_loss'] for s in common]):.3f} | {len(common)} |")
    if "pre_ln-R3" in depth:
        ref = depth["pre_ln-R3"]
        lines += ["", "Pre-norm reference (rule plain, pre_ln, untied, R = 3, 150 steps): val loss "
                  + ", ".join(f"{ref[s]['val_loss']:.3f}" for s in sorted(ref)) + f" ({len(ref)} seed); "
                  f"depth use: valid PPL {_depth_use(ref, 3)}."]
    lines += ["", "![p-sweep](p_sweep.png)"]
    if tied64:
        lines += ["", "![tied embeddings at 4× the batch](tied_b64.png)"]
    if _has_run(tied64):  # its own figure: the p-sweep's curve panels need the other sweeps' run folders
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        _p_scatter(axes[0], t_pts, b_pts, u_pts, floor)
        _curves(axes[1], tied64, floor, "training curves, tied, 4× batch (seed 0)")
        fig.tight_layout()
        fig.savefig(exp / "tied_b64.png", dpi=120)
        plt.close(fig)
    if not _has_run(tied, untied, depth):
        # the training curves come from the run folders (not committed): keep the figure drawn with them
        print("p_sweep.png left as it is: its training-curve panels need the run folders, which are not here",
              file=sys.stderr)
        (exp / "results.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    _p_scatter(axes[0], t_pts, b_pts, u_pts, floor)
    _curves(axes[1], tied, floor, "training curves, tied (seed 0)")
    _curves(axes[2], {**untied, **({"pre_ln-R3": depth["pre_ln-R3"]} if "pre_ln-R3" in depth else {})}, floor,
            "training curves, untied (all seeds; black: pre-LN)")
    fig.tight_layout()
    fig.savefig(exp / "p_sweep.png", dpi=120)
    (exp / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


# --------------------------------------------------------------------------------------------- readout
def readout() -> None:
    exp = HERE / "readout-cpu"
    tab = ppl_table(exp / "results.db", "readout-cpu")
    lines = ["# The readout blind spot at CPU scale (issue 5 §5)", "",
             "Command: `looplm sweep experiments/readout-cpu/sweep.toml --out experiments/readout-cpu`, then "
             "`python experiments/summarize.py readout`.", "",
             "Brown test PPL per loop (first 8,192 tokens; one seed):", "",
             "| variant | depth use: K=1 · K=4 · best K | PPL k=1 | k=2 | k=3 | k=4 |", "|---|---|---:|---:|---:|---:|"]
    for v in sorted(tab):
        lines.append(f"| `{v}` | {depth_use_cell(tab[v], 4)} | "
                     + " | ".join(mean_std(tab[v][k].values()) if k in tab[v] else "–" for k in (1, 2, 3, 4)) + " |")
    norms, norm_rows = {}, []
    folders = runs(exp)
    for name, run in folders.items():
        variant = name.rsplit("-s", 1)[0]
        d = run / "diagnose" / "diagnose.json"
        if not d.exists():
            continue
        sc = json.loads(d.read_text())["scale"]["loops"]
        by_k = {x["k"]: x for x in sc}
        norms[variant] = [by_k[k]["rms_mean"] for k in sorted(by_k)]
        norm_rows.append(f"| `{variant}` | {depth_use_cell(tab.get(variant, {}), 4)} | {by_k[1]['rms_mean']:.2f} | "
                     f"{by_k[4]['rms_mean']:.2f} / {by_k[4]['rms_p99']:.2f} / {by_k[4]['rms_max']:.2f} | "
                     f"{by_k[4]['radial_grad_fraction']:.2e} |")
    if norm_rows:
        lines += ["", "Final-loop hidden-state RMS (per token, `looplm diagnose` scale section, valid split, 2 × 8 "
                  "windows):", "", "| variant | depth use (PPL) | RMS loop 1 | RMS loop 4 (mean / p99 / max) "
                  "| radial grad. fraction r_4 |", "|---|---|---:|---:|---:|"] + norm_rows
    halt = []
    for name, run in folders.items():
        f = run / "halting" / "halting.json"
        if f.exists():
            h = json.loads(f.read_text())
            c, t = h["calibration"], h["timed"]
            tau = "∞" if c["tau"] is None else f"{c['tau']:.2f}"
            halt.append(f"| `{name.rsplit('-s', 1)[0]}` | {depth_use_cell(tab.get(name.rsplit('-s', 1)[0], {}), 4)} "
                        f"| {h['k_max']} | {tau} | {c['mean_loops']:.2f} | "
                        f"{t['dynamic']['mean_loops']:.2f} | {t['speedup']:.2f}× | {100 * (t['ppl_ratio'] - 1):+.2f}% | "
                        + " / ".join(f"{c['ppl_by_k'][str(k)]:.0f}" for k in range(1, h["k_max"] + 1)) + " |")
    if halt:
        lines += ["", "Logit-margin halting (`looplm eval halting`: τ calibrated on 160 Brown-valid windows to keep "
                  "PPL within 1% of K_max = 4; timed dynamic-batching run on Brown test):", "",
                  "| variant | depth use (PPL) | K_max | τ | mean loops (calib.) | mean loops (timed) | speedup "
                  "| PPL vs K_max (timed) | calib. PPL at K = 1 / 2 / 3 / 4 |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---|"] + halt
    if not folders:  # the norms and halting tables come from the run folders: the figure stays as drawn from them
        lines += no_runs_note(exp, "Per-loop norms (`diagnose.json` scale sections) and logit-margin halting "
                              "(`halting.json`)")
        lines += ["", "![norms per loop, drawn from the run folders when they were here](norms_per_loop.png)"]
        (exp / "results.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for v, ys in sorted(norms.items()):
        ax.plot(range(len(ys)), ys, marker="o", label=v)
    ax.set_yscale("log")
    ax.set_xlabel("loop k (0 = embedding)")
    ax.set_ylabel("mean per-token hidden RMS")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(exp / "norms_per_loop.png", dpi=120)
    lines += ["", "![norms per loop](norms_per_loop.png)"]
    (exp / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


MODES = {"huginn": huginn, "deeploop": deeploop, "readout": readout}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in MODES:
        raise SystemExit(f"usage: python experiments/summarize.py {{{'|'.join(MODES)}}}\n" + __doc__.split("\n\n")[1])
    MODES[sys.argv[1]]()
