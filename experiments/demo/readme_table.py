"""Render the README's "Measured results" table from a demo results.json (looplm.apps.demo.readme_table).

    python experiments/demo/readme_table.py                      # print the table of experiments/demo/results.json
    python experiments/demo/readme_table.py RESULTS.json --write  # replace the table in README.md with it,
                                                                  # and rewrite results.md beside RESULTS.json

The table sits between ``<!-- demo-results:begin -->`` and ``<!-- demo-results:end -->`` in README.md;
tests/train/test_faults.py checks that it, and experiments/demo/results.md (looplm.apps.demo.results_markdown), equal
the rendering of the committed experiments/demo/results.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from looplm.apps.demo import readme_table, results_markdown

REPO = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- demo-results:begin -->", "<!-- demo-results:end -->"


def replace_between_markers(text: str, table: str) -> str:
    """``text`` with everything between the two markers replaced by ``table``.

    Raises:
        ValueError: the markers are missing or out of order.
    """
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"README: expected {BEGIN} ... {END} around the demo table")
    return text[: i + len(BEGIN)] + "\n" + table + "\n" + text[j:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="?", type=Path, default=REPO / "experiments/demo/results.json")
    p.add_argument("--write", action="store_true", help="replace the table in --readme instead of printing it")
    p.add_argument("--readme", type=Path, default=REPO / "README.md")
    args = p.parse_args(argv)
    results = json.loads(args.results.read_text())
    table = readme_table(results)
    if args.write:
        args.readme.write_text(replace_between_markers(args.readme.read_text(), table))
        args.results.with_suffix(".md").write_text(results_markdown(results))
        print(f"wrote the table of {args.results} into {args.readme} and {args.results.with_suffix('.md')}")
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
