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


def resolve_data_root(configured: str = "") -> Path:
    """The raw-data directory (``brown/``, ``gpt2-tokenizer/`` …): ``configured``, else ``$LOOPLM_DATA``, else the
    first existing of ``../shared/data`` (beside the repository) and ``./data``, else ``./data`` (so the loaders'
    errors name the files)."""
    if configured or os.environ.get("LOOPLM_DATA", ""):
        return Path(configured or os.environ["LOOPLM_DATA"]).expanduser()
    candidates = [_REPO.parent / "shared" / "data", Path.cwd() / "data"]
    return next((path for path in candidates if path.is_dir()), candidates[-1])


def resolve_cache_dir(configured: str = "") -> Path:
    """The cache of derived files (``tokens/``, ``tokenizers/``): ``configured``, else ``$LOOPLM_CACHE``, else
    ``~/.cache/looplm`` (created by the writers)."""
    if configured or os.environ.get("LOOPLM_CACHE", ""):
        return Path(configured or os.environ["LOOPLM_CACHE"]).expanduser()
    return Path.home() / ".cache" / "looplm"


def file_mode() -> int:
    """The permission bits a plain ``open(path, "w")`` gives a new file: 0o666 less the process umask."""
    mask = os.umask(0)  # the umask can only be read by setting it; set it straight back
    os.umask(mask)
    return 0o666 & ~mask


def plain_mode(path: str | Path) -> None:
    """Give the file ``path`` :func:`file_mode` (writers through ``mkstemp``, such as safetensors, leave 0o600:
    other users could not read a shared run or export)."""
    os.chmod(path, file_mode())


@contextlib.contextmanager
def atomic_write(path: Path) -> Iterator[BinaryIO]:
    """A temporary file next to ``path`` for binary writing, renamed onto it on success: never a half-written
    ``path`` (a killed process may leave a ``.tmp``); concurrent writers of the same content are safe. ``path``
    gets the mode a plain ``open()`` would give it (:func:`file_mode`), not ``mkstemp``'s 0o600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
