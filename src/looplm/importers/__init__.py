"""Importers of published looped language models (issue 14 §2): ``looplm import huginn SRC --out DIR``
and ``looplm import ouro SRC --out DIR`` read a downloaded Hugging Face folder (``config.json``, safetensors
shards, ``tokenizer.json``), map every tensor onto a looplm model (coverage checked both ways; an unknown
or missing tensor or config key is an error that names it) and write a looplm checkpoint with the
tokenizer and the import's provenance (``import.json``).

- :mod:`looplm.importers.huginn`: Huginn-0125 (``tomg-group-umd/huginn-0125``);
- :mod:`looplm.importers.ouro`: Ouro (``ByteDance/Ouro-1.4B``, ``Ouro-2.6B``);
- :mod:`looplm.importers.common`: reading folders, config keys, the tensor map, writing.

The layouts: ``docs/importers-layout.md``; usage and the parity method: ``docs/importers.md``. Importing
this package imports neither torch nor the importers (the command line registers ``looplm import``
through :mod:`looplm.cli`).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

#: importer name → (module, function)
IMPORTERS: dict[str, tuple[str, str]] = {"huginn": ("looplm.importers.huginn", "import_huginn"),
                                         "ouro": ("looplm.importers.ouro", "import_ouro")}


def get_importer(name: str) -> Callable[..., dict[str, Any]]:
    """The import function of ``name``.

    Raises:
        KeyError: an unknown name (the message lists the known ones).
    """
    if name not in IMPORTERS:
        raise KeyError(f"importer: unknown {name!r}; known: {', '.join(IMPORTERS)}")
    module, func = IMPORTERS[name]
    return getattr(importlib.import_module(module), func)
