"""Do two `looplm bench` runs agree? (issue 28 §3: within 5% on every ratio, on one quiet machine)

    looplm bench --out benchmarks/results/quiet-a.json && looplm bench --out benchmarks/results/quiet-b.json
    python benchmarks/bench_agreement.py benchmarks/results/quiet-a.json benchmarks/results/quiet-b.json \
        --out benchmarks/results/quiet-agreement

Compares every ratio the runs share (each target key, and each interleaved ratio in ``intervals``): the two
values (an interleaved ratio's median), their relative difference |a − b| / mean(a, b), and whether it is within
``--tolerance`` (default 5%); a value that is missing or not finite (null in the JSON) never agrees. Runs of
another shape (preset, depth, batch size, sequence length, device) are refused. Writes NAME.json and NAME.md;
exits 1 when a ratio disagrees or none is shared.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

SHAPE = ("preset", "depth", "batch_size", "seq_len", "device")


def agreement(a: dict, b: dict, tolerance: float = 0.05) -> dict:
    """``{"rows": [{key, a, b, rel_diff, agree}], "agree", "tolerance"}`` over the shared ratio keys (``agree``:
    at least one row and every row agrees). ValueError when the runs differ in shape (:data:`SHAPE`)."""
    differ = [f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in SHAPE if a.get(k) != b.get(k)]
    if differ:
        raise ValueError("the runs measure different things: " + ", ".join(differ))
    keys = sorted((set(a.get("targets", {})) | set(a.get("intervals", {})))
                  & (set(b.get("targets", {})) | set(b.get("intervals", {}))))
    rows = []
    for k in keys:
        x, y = a.get(k), b.get(k)
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (x, y)):
            rows.append({"key": k, "a": x, "b": y, "rel_diff": None, "agree": False})
            continue
        rel = abs(x - y) / ((abs(x) + abs(y)) / 2) if x or y else 0.0
        rows.append({"key": k, "a": x, "b": y, "rel_diff": rel, "agree": rel <= tolerance})
    return {"rows": rows, "agree": bool(rows) and all(r["agree"] for r in rows), "tolerance": tolerance}


def markdown(res: dict, names: tuple[str, str]) -> str:
    lines = [f"# Two bench runs: {names[0]} vs {names[1]}", "",
             f"{sum(r['agree'] for r in res['rows'])} of {len(res['rows'])} ratios agree within "
             f"{res['tolerance']:.0%} (|a − b| / mean).", "", "| ratio | a | b | difference | agree |",
             "|---|---:|---:|---:|---|"]
    num = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
    lines += [f"| `{r['key']}` | {num(r['a'], '.4g')} | {num(r['b'], '.4g')} | {num(r['rel_diff'], '.1%')} | "
              f"{'yes' if r['agree'] else 'no'} |" for r in res["rows"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("a", type=Path, help="the first run's JSON (looplm bench --out)")
    p.add_argument("b", type=Path, help="the second run's JSON")
    p.add_argument("--out", type=Path, required=True, help="results path without suffix (.json and .md written)")
    p.add_argument("--tolerance", type=float, default=0.05, help="largest relative difference that agrees (0.05)")
    args = p.parse_args(argv)
    try:
        res = agreement(json.loads(args.a.read_text()), json.loads(args.b.read_text()), args.tolerance)
    except ValueError as exc:
        p.error(str(exc))
    res["runs"] = [str(args.a), str(args.b)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(res, (args.a.name, args.b.name)))
    print(markdown(res, (args.a.name, args.b.name)))
    return 0 if res["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
