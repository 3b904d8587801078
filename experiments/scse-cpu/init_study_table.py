"""The init study's table (issue 11 §1): per variant, over the seeds stored so far, Brown *valid* PPL at
T = 8 and T = 48, the random-direction gain at t = 0 and t = 47 and the forcing ratio R_47 (mean ± std
and the seed count), read from experiments/scse-cpu/init-study/results.db.

Run: python experiments/scse-cpu/init_study_table.py   (prints Markdown; --write puts it into
experiments/scse-cpu/init-study/README.md between the init-study-table markers)
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from looplm.analysis.store import ResultStore

HERE = Path(__file__).parent
DB = HERE / "init-study" / "results.db"
ORDER = ["scse_gpt2", "scse_torch", "scse_matched", "scse_normal2",
         "adapter_gpt2", "adapter_torch", "adapter_matched", "adapter_normal2", "looped"]
BEGIN, END = "<!-- init-study-table:begin -->", "<!-- init-study-table:end -->"


def fmt(values: list[float], digits: int = 1) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def table() -> str:
    with ResultStore(DB) as store:
        runs = {(r.config_hash, r.seed): r for r in store.runs("init-study")}
        cells: dict[str, dict[str, dict[int, float]]] = {}
        for row in store.evaluations():
            run = runs.get((row["config_hash"], row["seed"]))
            if run is None:
                continue
            key = None
            if row["protocol"] == "ppl" and row["metric"] == "ppl" and row["depth"] in (8, 48):
                key = f"ppl{row['depth']}"
            elif row["protocol"] == "diagnose" and row["metric"] == "gain":
                key = f"gain{row['depth']}"
            elif row["protocol"] == "diagnose" and row["metric"] == "forcing.ratio" and row["depth"] == 47:
                key = "ratio47"
            if key:
                cells.setdefault(run.variant, {}).setdefault(key, {})[row["seed"]] = row["value"]
    lines = ["| variant | seeds | Brown valid PPL T=8 | T=48 | gain t=0 | gain t=47 | forcing ratio t=47 |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for v in ORDER:
        c = cells.get(v, {})
        seeds = sorted(c.get("ppl8", {}))
        lines.append(f"| `{v}` | {', '.join(map(str, seeds)) or '–'} | {fmt(list(c.get('ppl8', {}).values()))} "
                     f"| {fmt(list(c.get('ppl48', {}).values()))} | {fmt(list(c.get('gain0', {}).values()), 2)} "
                     f"| {fmt(list(c.get('gain47', {}).values()), 2)} | {fmt(list(c.get('ratio47', {}).values()), 2)} |")
    return "\n".join(lines)


def main() -> None:
    text = table()
    if "--write" in sys.argv:
        path = HERE / "init-study" / "README.md"
        doc = path.read_text()
        head, rest = doc.split(BEGIN)
        _, tail = rest.split(END)
        path.write_text(head + BEGIN + "\n" + text + "\n" + END + tail)
    print(text)


if __name__ == "__main__":
    main()
