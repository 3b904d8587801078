"""The init studies' tables (issue 11 §1): per variant, over the seeds stored so far, the depth use
(issue 24: Brown *valid* PPL at T = 1, at the training depth T = 8 and at the best T), Brown valid PPL at
T = 8 and T = 48, the random-direction gain at t = 0 and t = 47 and the forcing ratio R_47 (mean ± std
and the seed count), read from experiments/scse-cpu/init-study/results.db (source-module init) and
experiments/scse-cpu/embed-study/results.db (embedding scale), and the embedding probe's paired deltas
against the init study's runs of the same seeds (their depth use: the paired delta at T = 1 · 8 · best T).

Run: python experiments/scse-cpu/init_study_table.py   (prints Markdown; --write puts the tables into
experiments/scse-cpu/init-study/README.md between the init-study-table and embed-study-table markers)
"""

from __future__ import annotations

import sys
from pathlib import Path

from looplm.analysis.claims import depth_use_cell, mean_std_cell as fmt, paired_claim, sweep_cells

HERE = Path(__file__).parent
DB = HERE / "init-study" / "results.db"
EMBED_DB = HERE / "embed-study" / "results.db"
ORDER = ["scse_gpt2", "scse_torch", "scse_matched", "scse_normal2",
         "adapter_gpt2", "adapter_torch", "adapter_matched", "adapter_normal2", "looped"]
EMBED_ORDER = ["looped_e1", "scse_e1", "adapter_e1"]
#: embedding-probe variant -> the init-study run it changes one field of (model.embed_init_std 0.02 -> 1.0)
EMBED_REFERENCE = {"looped_e1": "looped", "scse_e1": "scse_normal2", "adapter_e1": "adapter_normal2"}
MARKERS = {"init": ("<!-- init-study-table:begin -->", "<!-- init-study-table:end -->"),
           "embed": ("<!-- embed-study-table:begin -->", "<!-- embed-study-table:end -->")}
T_TRAIN = 8  # largest training depth (uniform 1..8)


def metrics(db: Path, sweep: str) -> dict[str, dict[str, dict[int, float]]]:
    """{variant: {"ppl8" | "ppl48" | "gain0" | "gain47" | "ratio47": {seed: value}, "depths": {T: {seed: PPL}}}}
    from ``db`` (read-only)."""
    cells, _ = sweep_cells(db, sweep)
    keys = {("ppl", "brown", "ppl", 8): "ppl8", ("ppl", "brown", "ppl", 48): "ppl48",
            ("diagnose", "brown", "gain", 0): "gain0", ("diagnose", "brown", "gain", 47): "gain47",
            ("diagnose", "brown", "forcing.ratio", 47): "ratio47"}
    return {v: {**{name: c[k] for k, name in keys.items() if k in c},
                "depths": {k[3]: x for k, x in c.items() if k[:3] == ("ppl", "brown", "ppl")}}
            for v, c in cells.items()}


def table(cells: dict[str, dict[str, dict[int, float]]], order: list[str]) -> str:
    lines = [f"| variant | depth use: Brown valid PPL at T=1 · T={T_TRAIN} · best T | seeds | Brown valid PPL T=8 "
             "| T=48 | gain t=0 | gain t=47 | forcing ratio t=47 |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for v in order:
        c = cells.get(v, {})
        seeds = sorted(c.get("ppl8", {}))
        lines.append(f"| `{v}` | {depth_use_cell(c.get('depths', {}), T_TRAIN)} "
                     f"| {', '.join(map(str, seeds)) or '–'} | {fmt(list(c.get('ppl8', {}).values()))} "
                     f"| {fmt(list(c.get('ppl48', {}).values()))} | {fmt(list(c.get('gain0', {}).values()), 2)} "
                     f"| {fmt(list(c.get('gain47', {}).values()), 2)} | {fmt(list(c.get('ratio47', {}).values()), 2)} |")
    return "\n".join(lines)


def embed_table(init: dict, embed: dict) -> str:
    """The embedding probe's table and its paired deltas (embedding N(0, 1) minus N(0, 0.02), same seeds)."""
    lines = [table(embed, EMBED_ORDER), "",
             "Paired over the seeds both studies have, embedding N(0, 1) minus N(0, 0.02) "
             "(mean [95% t interval] (95% bootstrap)):", "",
             f"| variant | depth use: paired delta at T=1 · T={T_TRAIN} · best T | Brown valid PPL T=8 | T=48 "
             "| gain t=0 |", "|---|---|---|---|---|"]
    for v in EMBED_ORDER:
        ref = init.get(EMBED_REFERENCE[v], {})
        xa, xb = embed.get(v, {}).get("depths", {}), ref.get("depths", {})
        deltas = {T: {s: xa[T][s] - xb[T][s] for s in set(xa[T]) & set(xb.get(T, {}))} for T in xa}
        cols = [depth_use_cell(deltas, T_TRAIN, signed=True)]
        cols += [paired_claim(embed.get(v, {}).get(k, {}), ref.get(k, {}), digits=d, expect="positive")[0]
                 for k, d in (("ppl8", 1), ("ppl48", 1), ("gain0", 2))]
        lines.append(f"| `{v}` vs `{EMBED_REFERENCE[v]}` | " + " | ".join(cols) + " |")
    return "\n".join(lines)


def main() -> None:
    init = metrics(DB, "init-study")
    texts = {"init": table(init, ORDER)}
    if EMBED_DB.exists():
        texts["embed"] = embed_table(init, metrics(EMBED_DB, "embed-study"))
    if "--write" in sys.argv:
        path = HERE / "init-study" / "README.md"
        doc = path.read_text()
        for key, text in texts.items():
            begin, end = MARKERS[key]
            if begin not in doc:
                continue
            head, rest = doc.split(begin)
            _, tail = rest.split(end)
            doc = head + begin + "\n" + text + "\n" + end + tail
        path.write_text(doc)
    print("\n\n".join(texts.values()))


if __name__ == "__main__":
    main()
