"""Do two `looplm bench` runs agree? (issue 28 §3: within 5% on every ratio, on one quiet machine)

    looplm bench --out benchmarks/results/quiet-a.json && looplm bench --out benchmarks/results/quiet-b.json
    python benchmarks/bench_agreement.py benchmarks/results/quiet-a.json benchmarks/results/quiet-b.json \
        --out benchmarks/results/quiet-agreement

Compares every ratio the runs share (each target key, and each interleaved ratio in ``intervals``): the two
medians, their relative difference |a − b| / mean(a, b), and whether it is within ``--tolerance`` (default 5%).
Writes NAME.json and NAME.md; exits 1 when a ratio disagrees.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def agreement(a: dict, b: dict, tolerance: float = 0.05) -> dict:
    """``{"rows": [{key, a, b, rel_diff, agree}], "agree": all agree, "tolerance"}`` over the shared ratio keys."""
    keys = sorted((set(a.get("targets", {})) | set(a.get("intervals", {})))
                  & (set(b.get("targets", {})) | set(b.get("intervals", {}))))
    rows = []
    for k in keys:
        x, y = float(a[k]), float(b[k])
        rel = abs(x - y) / ((abs(x) + abs(y)) / 2) if x or y else 0.0
        rows.append({"key": k, "a": x, "b": y, "rel_diff": rel, "agree": rel <= tolerance})
    return {"rows": rows, "agree": all(r["agree"] for r in rows), "tolerance": tolerance}


def markdown(res: dict, names: tuple[str, str]) -> str:
    lines = [f"# Two bench runs: {names[0]} vs {names[1]}", "",
             f"{sum(r['agree'] for r in res['rows'])} of {len(res['rows'])} ratios agree within "
             f"{res['tolerance']:.0%} (|a − b| / mean).", "", "| ratio | a | b | difference | agree |",
             "|---|---:|---:|---:|---|"]
    lines += [f"| `{r['key']}` | {r['a']:.4g} | {r['b']:.4g} | {r['rel_diff']:.1%} | {'yes' if r['agree'] else 'no'} |"
              for r in res["rows"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("a", type=Path, help="the first run's JSON (looplm bench --out)")
    p.add_argument("b", type=Path, help="the second run's JSON")
    p.add_argument("--out", type=Path, required=True, help="results path without suffix (.json and .md written)")
    p.add_argument("--tolerance", type=float, default=0.05, help="largest relative difference that agrees (0.05)")
    args = p.parse_args(argv)
    res = agreement(json.loads(args.a.read_text()), json.loads(args.b.read_text()), args.tolerance)
    res["runs"] = [str(args.a), str(args.b)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(res, (args.a.name, args.b.name)))
    print(markdown(res, (args.a.name, args.b.name)))
    return 0 if res["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
