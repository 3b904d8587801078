"""Atomic checkpoints: ``model.safetensors`` + ``config.json`` + ``train_state.pt`` (+ tokenizer).

Layout of a run directory::

    RUN/latest                       name of the newest complete checkpoint (replaced atomically)
    RUN/checkpoints/step-000600/     model.safetensors, config.json, train_state.pt,
                                     tokenizer.json, manifest.json (sizes + sha256 of each file)

A checkpoint is written into a hidden temporary directory and renamed into place only when every
file is complete, then ``latest`` is replaced with ``os.replace``; a crash or kill at any moment
leaves the previous checkpoint intact and ``latest`` pointing at it. Loading verifies the manifest,
so a truncated or corrupted file gives :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

from looplm.config import Config
from looplm.model import LoopLM

MODEL_FILE, CONFIG_FILE, STATE_FILE, TOKENIZER_FILE, MANIFEST_FILE = (
    "model.safetensors", "config.json", "train_state.pt", "tokenizer.json", "manifest.json")
KEEP_LAST = 2


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupted; the message names the path."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: str | Path, step: int, model: LoopLM, cfg: Config, *,
                    train_state: dict[str, Any] | None = None, tokenizer_json: str | None = None) -> Path:
    """Write checkpoint ``step`` of ``model`` atomically under ``run_dir`` and point ``latest`` at it.

    Weights are saved from the unwrapped, uncompiled module (no ``module.``/``_orig_mod.`` prefixes).
    Keeps the newest ``KEEP_LAST`` checkpoints. Returns the checkpoint directory.
    """
    run_dir = Path(run_dir)
    ckpts = run_dir / "checkpoints"
    ckpts.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    tmp = ckpts / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_model(model, str(tmp / MODEL_FILE))
    (tmp / CONFIG_FILE).write_text(cfg.to_json())
    if train_state is not None:
        torch.save(train_state, tmp / STATE_FILE)
    if tokenizer_json is not None:
        (tmp / TOKENIZER_FILE).write_text(tokenizer_json)
    files = sorted(p.name for p in tmp.iterdir())
    manifest = {"step": step, "files": {f: {"bytes": (tmp / f).stat().st_size, "sha256": _sha256(tmp / f)}
                                        for f in files}}
    (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    final = ckpts / name
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(ckpts)
    latest_tmp = run_dir / f".latest-{os.getpid()}"
    latest_tmp.write_text(name + "\n")
    os.replace(latest_tmp, run_dir / "latest")
    _fsync_dir(run_dir)
    for old in sorted(p for p in ckpts.iterdir() if p.name.startswith("step-"))[:-KEEP_LAST]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint directories of a run, oldest first."""
    ckpts = Path(run_dir) / "checkpoints"
    if not ckpts.is_dir():
        return []
    return sorted(p for p in ckpts.iterdir() if p.name.startswith("step-") and (p / MANIFEST_FILE).exists())


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from either itself or a run directory (via ``latest``).

    Raises:
        CheckpointError: nothing loadable at ``path``.
    """
    path = Path(path)
    if (path / MANIFEST_FILE).exists() or (path / MODEL_FILE).exists():
        return path
    latest = path / "latest"
    if latest.exists():
        target = path / "checkpoints" / latest.read_text().strip()
        if target.is_dir():
            return target
        raise CheckpointError(f"{latest} names {target}, which does not exist")
    raise CheckpointError(f"{path}: no checkpoint here (expected {MODEL_FILE} or a run directory with 'latest')")


def verify_checkpoint(ckpt: Path) -> dict[str, Any]:
    """Check every file against the manifest. Returns the manifest.

    Raises:
        CheckpointError: a file is missing, truncated or has a different sha256.
    """
    mpath = ckpt / MANIFEST_FILE
    if not mpath.exists():
        raise CheckpointError(f"{ckpt}: missing {MANIFEST_FILE} (incomplete checkpoint)")
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{mpath}: not valid JSON ({exc})") from None
    for name, meta in manifest["files"].items():
        f = ckpt / name
        if not f.exists():
            raise CheckpointError(f"{f}: missing from checkpoint")
        size = f.stat().st_size
        if size != meta["bytes"]:
            raise CheckpointError(f"{f}: {size} bytes on disk, {meta['bytes']} expected (truncated or "
                                  "overwritten); load an earlier checkpoint from "
                                  f"{ckpt.parent} instead")
        if _sha256(f) != meta["sha256"]:
            raise CheckpointError(f"{f}: sha256 differs from the manifest (corrupted)")
    return manifest


def load_config(ckpt: str | Path) -> Config:
    ckpt = resolve_checkpoint(ckpt)
    return Config.from_json((ckpt / CONFIG_FILE).read_text())


def load_checkpoint(path: str | Path, *, device: str | torch.device = "cpu",
                    with_state: bool = False) -> tuple[LoopLM, Config, dict[str, Any] | None, Path]:
    """Load ``(model, config, train_state or None, checkpoint_dir)``; weights loaded with strict=True.

    Raises:
        CheckpointError: missing, truncated or corrupted checkpoint.
        ValueError: unknown device, or cuda on a machine without CUDA.
    """
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device: got {device!r}; allowed: cpu, cuda, cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device={device} but no CUDA device is available; use cpu")
    ckpt = resolve_checkpoint(path)
    verify_checkpoint(ckpt)
    cfg = Config.from_json((ckpt / CONFIG_FILE).read_text())
    model = LoopLM(cfg.model)
    try:
        load_model(model, str(ckpt / MODEL_FILE), strict=True, device=str(device))
    except Exception as exc:  # safetensors raises several types for damaged files
        raise CheckpointError(f"{ckpt / MODEL_FILE}: cannot load weights ({exc})") from exc
    model.to(device)
    state = None
    if with_state:
        if not (ckpt / STATE_FILE).exists():
            raise CheckpointError(f"{ckpt / STATE_FILE}: missing (weights-only checkpoint cannot resume)")
        state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=False)
    return model, cfg, state, ckpt


def newest_valid_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest checkpoint of a run that passes :func:`verify_checkpoint` (None if none does)."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        try:
            verify_checkpoint(ckpt)
            return ckpt
        except CheckpointError:
            continue
    return None


def checkpoint_problems(run_dir: str | Path) -> list[tuple[Path, str]]:
    """(checkpoint, reason) for every checkpoint of a run that fails :func:`verify_checkpoint`."""
    problems = []
    for ckpt in list_checkpoints(run_dir):
        try:
            verify_checkpoint(ckpt)
        except CheckpointError as exc:
            problems.append((ckpt, str(exc)))
    return problems
