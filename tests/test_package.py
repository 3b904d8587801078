"""The package's shape (issue 26): no import circle (function-level imports included), no module importing
another's private names, no function over 80 lines, and a package root that holds only the library's face."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "looplm"


def _modules() -> dict[str, Path]:
    """Dotted module name → file, every module of the package (a package by its ``__init__``)."""
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]):
    """``(imported module, names)`` of every looplm import in the file, at any depth (function-level too)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((a.name, []) for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = name.split(".")[: None if path.name == "__init__.py" else -1]
            target = node.module if node.level == 0 else ".".join(
                base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            if target and target.split(".")[0] == "looplm":
                for a in node.names:  # `from pkg import submodule` depends on the submodule
                    yield (f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target), [a.name]


def test_no_import_circle():
    modules = _modules()
    graph = {m: {t for t, _ in _imports(m, p, modules) if t != m and t in modules} for m, p in modules.items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        raise AssertionError(f"import circle: {' -> '.join(exc.args[1])}") from None


def test_no_module_imports_private_names():
    modules = _modules()
    found = [f"{m} imports {t}.{n}" for m, p in modules.items() for t, names in _imports(m, p, modules)
             for n in names if n.startswith("_") and not n.startswith("__")]
    assert not found, found


def test_no_function_over_80_lines():
    long = [f"{p.relative_to(SRC)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for p in SRC.rglob("*.py") for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 80]
    assert not long, long


def test_package_root_holds_only_the_library_face():
    """Applications live in apps/ and cli/, the run layer's helpers in run/: the root is what a user imports."""
    assert sorted(p.stem for p in SRC.glob("*.py")) == ["__init__", "__main__", "config", "presets", "version"]
