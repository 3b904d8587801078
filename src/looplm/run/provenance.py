"""Where a result came from: software versions, time, weights and data hashes (issue 27 §4).

Every eval JSON carries ``"provenance": provenance(...)`` and the results DB keeps it per evaluation
(:meth:`looplm.analysis.store.ResultStore.put_many`), so a stored number traces to the exact model and data.
"""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
import time
from pathlib import Path
from typing import Any, Iterable

import numpy as np


@functools.cache
def git_commit() -> str | None:
    """The commit (``-dirty`` when tracked files differ) of the git checkout looplm is imported from; None for
    an untracked copy (an installed wheel) or no git."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(Path(__file__).parent), *args], capture_output=True, text=True,
                              timeout=10)

    try:
        if git("ls-files", "--error-unmatch", "__init__.py").returncode != 0:
            return None
        out = git("describe", "--always", "--dirty", "--abbrev=40", "--exclude=*")
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def weights_sha256(ckpt: str | Path) -> str | None:
    """sha256 of a checkpoint's ``model.safetensors`` (from its manifest if any); None when it has none."""
    from looplm.run.checkpoint import MANIFEST_FILE, MODEL_FILE, sha256_file

    ckpt = Path(ckpt)
    manifest = ckpt / MANIFEST_FILE
    if manifest.is_file():
        entry = json.loads(manifest.read_text())["files"].get(MODEL_FILE)
        return entry["sha256"] if entry else None
    return sha256_file(ckpt / MODEL_FILE) if (ckpt / MODEL_FILE).is_file() else None


def tokens_sha256(tokens: np.ndarray) -> str:
    """sha256 of a token stream as little-endian int64 (independent of the cache's storage dtype)."""
    return hashlib.sha256(np.asarray(tokens, dtype="<i8").tobytes()).hexdigest()


def provenance(ckpt: str | Path | None = None, *, tokens: np.ndarray | None = None,
               data_files: Iterable[str | Path] = (), **extra: Any) -> dict[str, Any]:
    """Versions, commit, UTC time, ``weights_sha256`` of ``ckpt``, ``tokens_sha256`` and ``data_files`` hashes,
    plus ``extra``."""
    import torch

    from looplm.run.checkpoint import sha256_file
    from looplm.version import __version__

    out: dict[str, Any] = {"looplm_version": __version__, "git_commit": git_commit(),
                           "torch_version": torch.__version__,
                           "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if ckpt is not None:
        out["checkpoint"] = str(ckpt)
        out["weights_sha256"] = weights_sha256(ckpt)
    if tokens is not None:
        out["tokens_sha256"] = tokens_sha256(tokens)
    files = {str(p): sha256_file(p) for p in data_files}
    if files:
        out["data_files"] = files
    return {**out, **extra}
