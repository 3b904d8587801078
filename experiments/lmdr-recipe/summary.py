"""Summary of LMDR's own recipe at CPU scale (issue 25 §1; sweeps `lmdr-recipe`, `lmdr-recipe-frozen` and the
one-seed probe `lmdr-recipe-probe`).

Reads results.db (and frozen/results.db) and, where the run folders exist, each run's metrics.jsonl (the
validation curve and the learned prior's per-step mean depth, entropy and advantage scale s, logged as
prior_mean_depth / prior_entropy / prior_advantage_scale) and diagnose/diagnose.json (the step's
random-direction gain); both are kept in committed JSON (curves.json, frozen/curves.json, gain.json),
because the run folders are not committed. Writes results.md.

The claims (arXiv:2610.06833 §3.1, §5.2, Table 2): at fixed R = 5, TBPTT b = 2 extrapolates and shares KV
better than full BPTT (one change); sampled depths share KV better than fixed-depth training; the learned
prior beats PLN-5 at R = 5 under terminal sharing. Verdicts: looplm.analysis.claims.paired_claim on paired
seeds (≥ 3 for a verdict).

Run: python experiments/lmdr-recipe/summary.py      (any time: it reports what is stored so far)
"""

from __future__ import annotations

from pathlib import Path

from looplm.analysis.claims import (depth_use_cell, diagnose_sections, mean_std_cell as fmt, paired_claim,
                                    status_table, sweep_cells, sweep_results, validation_curves)

EXP = Path(__file__).parent
ORDER = ["fixed5_bptt", "fixed5_tbptt2", "pln5", "learned", "learned_prior_lr5x", "uniform64", "uniform10",
         "frozen_final"]
PRIORS = ["learned", "learned_prior_lr5x", "uniform64", "uniform10", "frozen_final"]
PRIOR_SERIES = ("prior_mean_depth", "prior_entropy", "prior_advantage_scale")
R_TRAIN = 5
DEPTHS = (1, 2, 3, 5, 8, 16, 32, 64)


def probe_section() -> list[str]:
    """The one-seed, 200-step probe (probe.toml): PPL vs R and the step's gain, labelled as a probe."""
    cells, _ = sweep_cells(EXP / "probe" / "results.db", "lmdr-recipe-probe")
    gain = diagnose_sections(EXP / "probe" / "runs", EXP / "probe" / "gain.json", "gain",
                             lambda g: {str(x["t"]): x["gain"] for x in g})
    ppl = {d: v for (p, _, m, d), x in cells.get("fixed5_tbptt2", {}).items() if (p, m) == ("ppl", "ppl")
           for v in x.values()}
    if not ppl:
        return []
    share = cells["fixed5_tbptt2"].get(("kv_sharing", "brown", "sharing_penalty_pct", R_TRAIN), {})
    g = gain.get("fixed5_tbptt2-s0", {})
    return ["", "## PROBE: `fixed5_tbptt2`, seed 0, 200 steps (probe.toml; one seed, not a verdict)", "",
            "| " + " | ".join(f"R={d}" for d in sorted(ppl)) + " | sharing penalty | gain t=0 | gain t=4 |",
            "|" + "---:|" * (len(ppl) + 3),
            "| " + " | ".join(f"{ppl[d]:.1f}" for d in sorted(ppl)) + f" | {fmt(share.values(), 2)}% | "
            + " | ".join(f"{g[t]:.3f}" if t in g else "–" for t in ("0", "4")) + " |"]


def write(lines: list[str]) -> None:
    text = "\n".join(lines + probe_section()) + "\n"
    (EXP / "results.md").write_text(text)
    print(text)


def main() -> None:
    head = ["# LMDR's own recipe at CPU scale (issue 25 §1): results so far", "",
            "Written by `python experiments/lmdr-recipe/summary.py` from `results.db`, `frozen/results.db` and "
            "`probe/results.db` (curves and prior traces kept in `curves.json` and `frozen/curves.json`, step gains "
            "in `gain.json` and `probe/gain.json`). Protocol: `sweep.toml` and the `lmdr` preset's docstring.", ""]
    loaded = sweep_results(EXP, "lmdr-recipe", extra=PRIOR_SERIES)
    if loaded is None:  # the probe may have run before the sweep
        if probe_section():
            write(head + ["**The sweep has not run yet.**"])
        return
    cells, params, curves = loaded
    frozen_cells, frozen_params = sweep_cells(EXP / "frozen" / "results.db", "lmdr-recipe-frozen")
    cells, params = {**cells, **frozen_cells}, {**params, **frozen_params}
    curves = {**curves, **validation_curves(EXP / "frozen" / "runs", EXP / "frozen" / "curves.json", extra=PRIOR_SERIES)}
    order = [v for v in ORDER if v in params]

    def c(v, protocol, metric, depth):
        return cells.get(v, {}).get((protocol, "brown", metric, depth), {})

    ppl = {v: {d: c(v, "ppl", "ppl", d) for d in DEPTHS} for v in order}
    share = {v: c(v, "kv_sharing", "sharing_penalty_pct", R_TRAIN) for v in order}
    terminal = {v: c(v, "kv_sharing", "ppl_terminal", R_TRAIN) for v in order}
    extra64 = {v: {s: 100 * (ppl[v][64][s] / ppl[v][R_TRAIN][s] - 1) for s in ppl[v][64] if s in ppl[v][R_TRAIN]}
               for v in order}
    use_head = "depth use: PPL at R=1 · R=5 · best R"
    use = {v: depth_use_cell(ppl[v], R_TRAIN) for v in order}
    lines = head + ["## Status", ""]
    lines += status_table(order, params, {v: ppl[v][R_TRAIN].keys() for v in order}, curves, depth_use=(use_head, use))
    lines += ["", "## Brown test PPL by recurrence count R; terminal KV sharing at R = 5 (256-token prefill)", "",
              f"| variant | {use_head} | " + " | ".join(f"R={d}" for d in DEPTHS)
              + " | R=64 vs R=5 | sharing penalty | PPL terminal |", "|---|---|" + "---:|" * (len(DEPTHS) + 3)]
    for v in order:
        lines.append(f"| `{v}` | {use[v]} | " + " | ".join(fmt(ppl[v][d].values()) for d in DEPTHS)
                     + f" | {fmt(extra64[v].values(), 2)}% | {fmt(share[v].values(), 2)}% | "
                     f"{fmt(terminal[v].values())} |")

    b, t = "fixed5_bptt", "fixed5_tbptt2"
    claims = [(f"`{t}` extrapolates to R=64 better than `{b}` (one change)", extra64, t, b),
              (f"`{t}` shares KV better than `{b}` (one change)", share, t, b),
              (f"`pln5` shares KV better than `{b}`", share, "pln5", b),
              (f"`learned` shares KV better than `{b}`", share, "learned", b),
              ("`learned` beats `pln5`: PPL at R=5 under terminal sharing", terminal, "learned", "pln5"),
              ("`frozen_final` beats `learned`: PPL at R=5 under terminal sharing", terminal, "frozen_final", "learned"),
              ("`uniform64` beats `learned`: PPL at R=5 under terminal sharing (a control, not a paper claim; its "
               "prior keeps a mean depth of about 20, so it trains with about 4× the loops)", terminal, "uniform64",
               "learned")]
    lines += ["", "## Claims (paired seeds; ≥ 3 for a verdict)", "",
              "| claim (paper) | paired delta [95% t] (95% bootstrap) | verdict |", "|---|---|---|"]
    for text, metric, v, ref in claims:
        if v in metric and ref in metric:
            lines.append(f"| {text} | {' | '.join(paired_claim(metric[v], metric[ref], digits=2))} |")

    lines += ["", "## Depth priors at the end of training (mean ± std over the evaluated seeds; per-step traces in "
              "curves.json)", "", "| variant | seeds | E_p[R] | H(p) (nats) | advantage scale s |",
              "|---|---:|---:|---:|---:|"]
    for v in PRIORS:
        done = set(ppl.get(v, {}).get(R_TRAIN, {}))  # runs still training are left out
        runs = [x for rid, x in curves.items() if rid.rsplit("-s", 1)[0] == v and int(rid.rsplit("-s", 1)[1]) in done]
        last = {k: [x[k][max(x[k], key=int)] for x in runs if x.get(k)] for k in PRIOR_SERIES}
        if last["prior_mean_depth"]:
            lines.append(f"| `{v}` | {len(runs)} | {fmt(last['prior_mean_depth'], 2)} | "
                         f"{fmt(last['prior_entropy'], 3)} | "
                         f"{fmt(last['prior_advantage_scale'], 3) if last['prior_advantage_scale'] else '– (no s)'} |")

    gain = diagnose_sections(EXP / "runs", EXP / "gain.json", "gain", lambda g: {str(x["t"]): x["gain"] for x in g})
    if gain:
        lines += ["", "## Random-direction gain of one step (`looplm diagnose`, Brown valid, float32; < 1 contracts)", "",
                  "| variant | seeds | gain t=0 | gain t=4 |", "|---|---:|---:|---:|"]
        for v in order:
            items = [x for rid, x in gain.items() if rid.rsplit("-s", 1)[0] == v]
            if items:
                lines.append(f"| `{v}` | {len(items)} | " + " | ".join(fmt([x[s] for x in items], 3) for s in ("0", "4"))
                             + " |")
    write(lines)


if __name__ == "__main__":
    main()
