"""Summary of DeepLoop with trainable references and κ̂_R (issue 25 §2; arXiv:2607.13491; sweeps
`deeploop-references` and `deeploop-p-sweep`, references.toml and p_sweep.toml).

Reads each sweep's results.db (Brown test PPL at the training R) and, where the run folders exist, their
validation curves (kept in curves.json) and `looplm diagnose`'s visit alignment κ̂_R = max_j ‖Σ_r G_{r,j}‖² /
Σ_r ‖G_{r,j}‖² at the training depth R (SPEC §7, DeepLoop eq. 12; kept in kappa.json), both in each sweep's
folder, committed because the run folders are not. A run *trains* when its final validation PPL is below
0.8 × the add-one unigram floor of Brown train → valid (deeploop-cpu's rule, our choice). Writes results.md.

Run: python experiments/deeploop-recipe/summary.py      (any time: it reports what is stored so far)
"""

from __future__ import annotations

import re
from pathlib import Path

from looplm.analysis.claims import diagnose_sections, mean_std_cell as fmt, sweep_results
from looplm.apps.sweep import load_sweep

EXP = Path(__file__).parent
SWEEPS = {"references": "deeploop-references", "p_sweep": "deeploop-p-sweep"}


def unigram_floor() -> float:
    """Add-one unigram PPL of Brown train → Brown valid under the sweeps' BPE (looplm.data.tokens.unigram_ppl)."""
    from looplm.data.tokens import unigram_ppl
    from looplm.train.trainer import prepare_data

    data = prepare_data(load_sweep(EXP / "references.toml").base, progress=False)
    return unigram_ppl(data.train, data.valid, data.vocab_size)


def section(folder: str, sweep: str, floor: float) -> list[str]:
    loaded = sweep_results(EXP / folder, sweep)
    if loaded is None:
        return []
    cells, params, curves = loaded
    kappa = diagnose_sections(EXP / folder / "runs", EXP / folder / "kappa.json", "visit_alignment",
                              lambda va: {"kappa_hat": va["kappa_hat"], "depth": va["depth"]})
    variants = list(load_sweep(EXP / f"{folder}.toml").variants)
    grid = sorted({rid.rsplit("-s", 1)[0] for rid in curves} | set(cells), key=lambda v: (
        [i for i, x in enumerate(variants) if v.startswith(x)] or [len(variants)], v))
    lines = [f"## `{sweep}` ({folder}.toml)", "",
             "| variant | R | seeds | final val PPL | trains | Brown test PPL at R | κ̂_R |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    pivot: dict[str, dict[int, list[float]]] = {}  # family (the variant without -R<R>) → R → κ̂_R per seed
    for v in grid:
        r = int(re.search(r"-R(\d+)", v).group(1))
        runs = {rid: c for rid, c in curves.items() if rid.rsplit("-s", 1)[0] == v and c.get("finished")}
        val = [c["val"][max(c["val"], key=int)] for c in runs.values() if c.get("val")]
        test = cells.get(v, {}).get(("ppl", "brown", "ppl", r), {})
        k = [x["kappa_hat"] for rid, x in kappa.items() if rid.rsplit("-s", 1)[0] == v and x["kappa_hat"] is not None]
        trains = f"{sum(x < 0.8 * floor for x in val)}/{len(val)}" if val else "–"
        lines.append(f"| `{v}` | {r} | {len(runs)} | {fmt(val)} | {trains} | {fmt(test.values())} | {fmt(k, 2)} |")
        pivot.setdefault(re.sub(r"-R\d+", "", v), {})[r] = k
    depths = sorted({r for row in pivot.values() for r in row})
    lines += ["", "κ̂_R against R (does visit alignment grow with R, as DeepLoop argues?):", "",
              "| family | " + " | ".join(f"R={r}" for r in depths) + " |", "|---|" + "---:|" * len(depths)]
    lines += [f"| `{f}` | " + " | ".join(fmt(row.get(r, []), 2) for r in depths) + " |" for f, row in pivot.items()]
    return lines + [""]


def main() -> None:
    floor = unigram_floor()
    lines = ["# DeepLoop with trainable references and κ̂_R (issue 25 §2): results so far", "",
             "Written by `python experiments/deeploop-recipe/summary.py`. Unigram floor (add-one, Brown train → "
             f"valid): PPL {floor:.1f}; *trains*: final validation PPL < {0.8 * floor:.1f}. κ̂_R: `looplm diagnose`'s "
             "visit alignment at the training depth (2 × 8 Brown valid windows; mean ± std over seeds); κ̂_R "
             "lies in [0, R]: 1 for orthogonal visits, R for identical ones.", ""]
    for folder, sweep in SWEEPS.items():
        lines += section(folder, sweep, floor)
    text = "\n".join(lines) + "\n"
    (EXP / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
