"""Where looplm looks for raw data and where it keeps derived files (token streams, tokenizers)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

# src/looplm/data/paths.py -> parents[3] is the repository root (the parent of ``src``).
_REPO = Path(__file__).resolve().parents[3]


def default_data_roots() -> list[Path]:
    """Data-root candidates tried in order when neither the config nor ``$LOOPLM_DATA`` names one."""
    return [_REPO.parent / "shared" / "data", Path.cwd() / "data"]


def resolve_data_root(configured: str = "") -> Path:
    """Return the directory holding the raw data (``brown/``, ``wikitext-2-raw/``, ``gpt2-tokenizer/`` …).

    Order:
      1. ``configured`` (``DataConfig.data_root``) when non-empty;
      2. the environment variable ``LOOPLM_DATA`` when set and non-empty;
      3. the first existing of ``<repo>/../shared/data`` (``<repo>`` = the parent of ``src``) and
         ``./data`` (relative to the current directory).

    When no candidate of step 3 exists, ``./data`` is returned anyway, so that the loaders' errors
    name the files to put there. The path is not required to exist (hub fallbacks may not need it).
    """
    if configured:
        return Path(configured).expanduser()
    env = os.environ.get("LOOPLM_DATA", "")
    if env:
        return Path(env).expanduser()
    candidates = default_data_roots()
    for path in candidates:
        if path.is_dir():
            return path
    return candidates[-1]


def resolve_cache_dir(configured: str = "") -> Path:
    """Return the cache directory for derived files (``tokens/*.bin``, ``tokenizers/*.json``).

    Order: ``configured`` (``DataConfig.cache_dir``) when non-empty, else ``$LOOPLM_CACHE`` when set
    and non-empty, else ``~/.cache/looplm``. The directory is created lazily by the writers.
    """
    if configured:
        return Path(configured).expanduser()
    env = os.environ.get("LOOPLM_CACHE", "")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "looplm"


@contextlib.contextmanager
def atomic_write(path: Path) -> Iterator[BinaryIO]:
    """Open a temporary file next to ``path`` for binary writing; rename it onto ``path`` on success.

    A build that is killed or raises leaves no file at ``path`` (the temporary is removed on
    exceptions; a killed process may leave a ``.tmp`` file, never a half-written ``path``).
    Concurrent writers of the same content are safe: the last rename wins.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
