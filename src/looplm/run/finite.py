"""Non-finite numbers: one error type, a weight check, and strict JSON (RFC 8259) for every file looplm writes:
a NaN/inf becomes ``null`` and the top-level ``"nonfinite"`` lists where (dotted paths)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

NONFINITE_KEY = "nonfinite"


class NonFiniteError(ValueError):
    """A loss, gradient, weight or metric that must be finite is NaN or ±inf; the message names it."""


def strict(obj: Any, _path: str = "", _found: list[str] | None = None) -> tuple[Any, list[str]]:
    """``obj`` (dicts, lists, tuples → lists) with every non-finite float as ``None``, and their dotted paths."""
    found = [] if _found is None else _found
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj, found
        found.append(_path or "<value>")
        return None, found
    if isinstance(obj, dict):
        return {k: strict(v, f"{_path}.{k}" if _path else str(k), found)[0] for k, v in obj.items()}, found
    if isinstance(obj, (list, tuple)):
        return [strict(v, f"{_path}.{i}" if _path else str(i), found)[0] for i, v in enumerate(obj)], found
    return obj, found


def clean(obj: Any) -> Any:
    """:func:`strict` of ``obj``; a dict gains ``"nonfinite"``, the sorted dotted paths of the values
    replaced (merged with any list it already has), when there are any."""
    out, found = strict(obj)
    if found and isinstance(out, dict):
        out[NONFINITE_KEY] = sorted(set(out.get(NONFINITE_KEY) or []) | set(found))
    return out


def dumps(obj: Any, *, indent: int | None = None) -> str:
    """Strict JSON text of :func:`clean` ``(obj)``."""
    return json.dumps(clean(obj), indent=indent, allow_nan=False)


def write_json_markdown(result: dict[str, Any], out: str | Path, *, markdown: str | None = None) -> list[Path]:
    """Write ``out`` ← :func:`dumps` of ``result`` and ``out.md`` ← ``markdown`` (default ``result["markdown"]``)."""
    out = Path(out)
    md = out.with_suffix(".md")
    text = result["markdown"] if markdown is None else markdown
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(result, indent=2) + "\n")
    md.write_text(text + "\n")
    return [out, md]


def md_table(header: list[str], rows: list[list[str]], align: str = "") -> list[str]:
    """The lines of a Markdown table: the header, a rule per column (``align``: a letter each, ``l`` ``r`` or
    ``c``; ``l`` past its end), one line per row."""
    rule = {"l": "---", "r": "---:", "c": ":---:"}
    return ["| " + " | ".join(header) + " |", "|" + "|".join(rule[a] for a in align.ljust(len(header), "l")) + "|",
            *("| " + " | ".join(r) + " |" for r in rows)]


def nonfinite_tensors(named: Iterable[tuple[str, Any]]) -> list[str]:
    """Names of the floating tensors (a DTensor: its local shard) in ``(name, tensor)`` pairs holding NaN/inf."""
    import torch

    local = ((name, t.to_local() if hasattr(t, "to_local") else t) for name, t in named)
    return [name for name, t in local if torch.is_floating_point(t) and not bool(torch.isfinite(t).all())]
