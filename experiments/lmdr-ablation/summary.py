"""Summary of LMDR's ablation at CPU scale (issue 11 §3; sweep `lmdr-ablation`, experiments/lmdr-ablation/sweep.toml).

Reads experiments/lmdr-ablation/results.db and, where the run folders exist, each run's metrics.jsonl and
diagnose/diagnose.json (kept in curves.json and convergence.json, which are committed); writes
results.md and ppl_vs_recurrence.png / learning_curves.png next to this file.

The paper's claim (arXiv:2610.06833 §1 and App. C; SPEC §10): at fixed R = 5, full BPTT raises PPL by
over 25% when extrapolated to R = 64 and by 21% under terminal KV sharing; TBPTT b = 2 at the same fixed
R = 5 (one change) keeps both within 2–3%. Sampled depths (PLN-5, the learned prior) share KV better than
fixed-depth training (§5.2, Table 2). Verdicts: looplm.analysis.stats.claim_verdict on paired seeds
(≥ 3 seeds; provisional below), the rule fixed before the runs finished.

Every table opens with a depth-use column (issue 24): Brown test PPL at R = 1, at the training R = 5 and
at the best R; in the claim table, that of the row's first model.

Run: python experiments/lmdr-ablation/summary.py      (any time: it reports the seeds stored so far)
"""

from __future__ import annotations

from pathlib import Path

from looplm.analysis.claims import (curves_by_variant, curves_table, depth_use_cell, diagnose_sections,
                                    mean_std_cell as fmt, paired_claim, plot_mean_curves, status_table, sweep_results)
from looplm.analysis.stats import MIN_VERDICT_PAIRS

EXP = Path(__file__).parent
SWEEP = "lmdr-ablation"
ORDER = ["fixed5_bptt", "fixed5_tbptt2", "pln5_tbptt2", "learned_tbptt2"]
R_TRAIN = 5
EXTRA = (8, 16, 32, 64)


def load_convergence() -> dict[str, dict]:
    """{run_id: diagnose's token-convergence record} from the run folders, kept in convergence.json."""
    keys = ("depth_mean", "never_fraction", "spearman", "tau", "r_obs")
    return diagnose_sections(EXP / "runs", EXP / "convergence.json", "convergence",
                             lambda c: {k: c.get(k) for k in keys})


def load_step_map() -> dict[str, dict]:
    """{run_id: {"gain": {t: gain_t}, "motion": {t: N⁻¹‖Δ_{t+1} − Δ_t‖²}}} from diagnose's gain and forcing
    sections (kept in gain.json and forcing.json). The motion is the forcing bias energy over eq. 9's ratio."""
    gain = diagnose_sections(EXP / "runs", EXP / "gain.json", "gain",
                             lambda g: {str(x["t"]): x["gain"] for x in g})
    forcing = diagnose_sections(EXP / "runs", EXP / "forcing.json", "forcing",
                                lambda f: {str(x["t"]): {k: x[k] for k in ("bias_energy", "ratio")} for x in f})
    # eq. 9's ratio floors the motion at 1e-12, so a motion read back as 1e-12 is an upper bound
    return {rid: {"gain": gain[rid], "motion": {t: x["bias_energy"] / x["ratio"] for t, x in forcing[rid].items()}}
            for rid in gain if rid in forcing}


def ratio_pct(num: dict[int, float], den: dict[int, float]) -> dict[int, float]:
    """{seed: 100·(num/den − 1)} over common seeds."""
    return {s: 100 * (num[s] / den[s] - 1) for s in num if s in den}


def main() -> None:
    loaded = sweep_results(EXP, SWEEP)
    if loaded is None:
        return
    cells, params, curves = loaded
    conv = load_convergence()

    def c(v, protocol, metric, depth):
        return cells.get(v, {}).get((protocol, "brown", metric, depth), {})

    ppl = {v: {d: c(v, "ppl", "ppl", d) for d in (1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64)} for v in ORDER}
    extra = {v: {d: ratio_pct(ppl[v][d], ppl[v][R_TRAIN]) for d in EXTRA} for v in ORDER}
    share = {v: c(v, "kv_sharing", "sharing_penalty_pct", R_TRAIN) for v in ORDER}
    use = {v: depth_use_cell(ppl[v], R_TRAIN) for v in ORDER}
    use_head = "depth use: PPL at R=1 · R=5 · best R"
    lines = ["# LMDR's ablation at CPU scale (issue 11 §3): results so far", "",
             "Written by `python experiments/lmdr-ablation/summary.py` from `results.db` (curves and token "
             "convergence kept in `curves.json` / `convergence.json`). See `README.md` for the protocol.", "",
             "## Status", ""] + status_table(ORDER, params, {v: ppl[v][R_TRAIN].keys() for v in ORDER}, curves,
                                             depth_use=(use_head, use))
    lines += ["", "## Brown test PPL by recurrence count R (mean ± std over seeds)", "",
              f"| variant | {use_head} | " + " | ".join(f"R={d}" for d in (1, 2, 3, 5, 8, 16, 32, 64)) + " |",
              "|---|---|" + "---:|" * 8]
    for v in ORDER:
        lines.append(f"| `{v}` | {use[v]} | " + " | ".join(fmt(ppl[v][d].values()) for d in (1, 2, 3, 5, 8, 16, 32, 64)) + " |")
    lines += ["", f"Extrapolation: PPL at R / PPL at R = {R_TRAIN}, minus 1, in % (mean ± std over seeds); terminal "
              f"KV sharing penalty at R = {R_TRAIN} (continuation protocol, document-aware, SPEC §6):", "",
              f"| variant | {use_head} | " + " | ".join(f"R={d}" for d in EXTRA)
              + " | sharing penalty | PPL full / terminal |", "|---|---|" + "---:|" * (len(EXTRA) + 2)]
    for v in ORDER:
        lines.append(f"| `{v}` | {use[v]} | " + " | ".join(fmt(extra[v][d].values(), 2) for d in EXTRA)
                     + f" | {fmt(share[v].values(), 2)} | {fmt(c(v, 'kv_sharing', 'ppl_full', R_TRAIN).values())} / "
                     f"{fmt(c(v, 'kv_sharing', 'ppl_terminal', R_TRAIN).values())} |")

    lines += ["", "## Claims", "",
              f"Verdicts from paired seeds (≥ {MIN_VERDICT_PAIRS}): *reproduces* when the 95% t interval of the "
              "paired delta excludes 0 on the paper's side, *opposite* on the other side, *not resolved* "
              "otherwise; fewer seeds give a *provisional* sign. Absolute thresholds (e.g. > 25%) are checked on "
              "every seed.", "",
              f"| # | claim (paper) | {use_head} (first model) | measured (mean ± std) "
              "| paired delta [95% t] (95% bootstrap) | verdict |", "|---|---|---|---|---|---|"]

    def threshold(vals: dict[int, float], above: float | None = None, below: float | None = None) -> str:
        if not vals:
            return "no data"
        ok = [x > above if above is not None else x <= below for x in vals.values()]
        return f"holds on every seed ({len(ok)})" if all(ok) else f"does not hold ({sum(ok)} of {len(ok)} seeds)"

    def pct(vals: dict[int, float]) -> str:
        return fmt(vals.values(), 2) + ("%" if vals else "")

    b, t = "fixed5_bptt", "fixed5_tbptt2"
    rows = [("X1", f"`{b}`: extrapolating to R=64 raises PPL by > 25%", pct(extra[b][64]), "–",
             threshold(extra[b][64], above=25)),
            ("X2", f"`{t}`: extrapolating to R=64 raises PPL by ≤ 2%", pct(extra[t][64]), "–",
             threshold(extra[t][64], below=2)),
            ("X3", f"`{t}` extrapolates better than `{b}` (one change)",
             f"{pct(extra[t][64])} vs {pct(extra[b][64])}",
             *paired_claim(extra[t][64], extra[b][64], digits=2)),
            ("K1", f"`{b}`: terminal KV sharing raises PPL by ~21% (> 10% here)", pct(share[b]), "–",
             threshold(share[b], above=10)),
            ("K2", f"`{t}`: terminal KV sharing raises PPL by ≤ 3%", pct(share[t]), "–",
             threshold(share[t], below=3)),
            ("K3", f"`{t}` shares KV better than `{b}` (one change)",
             f"{pct(share[t])} vs {pct(share[b])}", *paired_claim(share[t], share[b], digits=2))]
    for v in ("pln5_tbptt2", "learned_tbptt2"):
        rows.append((f"K-{v.split('_')[0]}", f"sampled depths (`{v}`) share KV better than fixed-depth `{b}`",
                     f"{pct(share[v])} vs {pct(share[b])}",
                     *paired_claim(share[v], share[b], digits=2)))
    for v in ("fixed5_tbptt2", "pln5_tbptt2", "learned_tbptt2"):
        cell, _ = paired_claim(ppl[v][R_TRAIN], ppl[b][R_TRAIN])
        rows.append((f"R5-{v.split('_')[0]}-{v.split('_')[1]}", f"(reference, no claim) PPL at R=5, `{v}` vs `{b}`",
                     f"{fmt(ppl[v][R_TRAIN].values())} vs {fmt(ppl[b][R_TRAIN].values())}", cell, "reported only"))
    first = [b, t, t, b, t, t, "pln5_tbptt2", "learned_tbptt2", "fixed5_tbptt2", "pln5_tbptt2", "learned_tbptt2"]
    lines += [f"| {' | '.join([r[0], r[1], use[v], *r[2:]])} |" for r, v in zip(rows, first, strict=True)]

    if conv:
        lines += ["", "## Token convergence (`looplm diagnose`, Brown valid, 2 × 8 windows, R_obs = 64, τ = 2%)", "",
                  f"| variant | {use_head} | seeds | mean convergence depth | never converged "
                  "| Spearman(depth, position) |", "|---|---|---:|---:|---:|---:|"]
        for v in ORDER:
            items = [x for rid, x in conv.items() if rid.rsplit("-s", 1)[0] == v]
            if items:
                sp = [x["spearman"] for x in items if x.get("spearman") is not None]
                lines.append(f"| `{v}` | {use[v]} | {len(items)} | {fmt(x['depth_mean'] for x in items)} | "
                             f"{fmt([100 * x['never_fraction'] for x in items])}% | {fmt(sp, 3)} |")

    step_map = load_step_map()
    if step_map:
        lines += ["", "## Step-map contraction (`looplm diagnose`, Brown valid, 2 × 8 windows, float32)", "",
                  "Random-direction gain ‖T_t(Δ + εv) − T_t(Δ)‖_F / ε of one recurrence step at steps t = 0 and 4 "
                  "(unit v per example, ε = 1e-3, 4 directions; < 1 shrinks a perturbation of the state) and the "
                  "state's motion N⁻¹‖Δ₅ − Δ₄‖² along the ordinary trajectory (mean ± std over seeds). float32 "
                  "rounding can inflate gains this small (no float64 check is committed).", "",
                  f"| variant | {use_head} | seeds | gain t=0 | gain t=4 | motion t=4 |",
                  "|---|---|---:|---:|---:|---:|"]
        for v in ORDER:
            items = [x for rid, x in step_map.items() if rid.rsplit("-s", 1)[0] == v]
            if items:
                cells_ = ([fmt([x["gain"][t] for x in items], 3) for t in ("0", "4")]
                          + [fmt([x["motion"]["4"] for x in items], 2, notation="e")])
                lines.append(f"| `{v}` | {use[v]} | {len(items)} | " + " | ".join(cells_) + " |")

    by_variant = curves_by_variant(curves)
    if by_variant:
        plot_mean_curves({v: by_variant[v] for v in ORDER if v in by_variant}, EXP / "learning_curves.png",
                         xlabel="training step (16×128 tokens each)", ylabel="Brown valid PPL at R = 5")
        lines += ["", "## Learning curves (Brown valid PPL at R = 5, mean over seeds)", ""]
        lines += curves_table(by_variant, ORDER) + ["", "![learning curves](learning_curves.png)"]
    plot_mean_curves({v: {d: list(x.values()) for d, x in ppl[v].items()} for v in ORDER},
                     EXP / "ppl_vs_recurrence.png", xlabel="recurrences R at evaluation", ylabel="Brown test PPL",
                     title="1 + 2×R + 1 models: extrapolation beyond R = 5", log2x=True, vline=R_TRAIN)
    lines += ["", "![PPL vs recurrences](ppl_vs_recurrence.png)"]
    text = "\n".join(lines) + "\n"
    (EXP / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
