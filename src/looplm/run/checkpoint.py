"""Atomic checkpoints, consolidated or sharded, each with ``config.json``, train state and tokenizer.

Layout of a run directory::

    RUN/latest                       name of the newest complete checkpoint (replaced atomically)
    RUN/checkpoints/step-000600/     consolidated: model.safetensors, config.json, train_state.pt,
                                     tokenizer.json, manifest.json (sizes + sha256 of each file)
    RUN/checkpoints/step-000600/     sharded: sharded/ (torch.distributed.checkpoint: one .distcp file
                                     per writing rank + .metadata; model and optimizer), config.json,
                                     train_state.pt (everything else), tokenizer.json, manifest.json

A checkpoint is written into a hidden temporary directory, renamed into place once complete (sharded: after
every rank wrote), then ``latest`` is replaced: a crash at any moment leaves the previous checkpoint. Loading
verifies the manifest (:class:`CheckpointError` names a damaged file). A sharded checkpoint loads under any world
size, consolidated on load for inference (:func:`consolidate_checkpoint` adds a ``model.safetensors``).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_model

from looplm.config import Config
from looplm.data.paths import atomic_write, plain_mode
from looplm.run.finite import NonFiniteError, nonfinite_tensors
from looplm.model import LoopLM, build_model
from looplm.run.dist import DistEnv, barrier, load_shards, resolve_device, save_shards, shard_keys
from looplm.run.hf_folder import WEIGHTS_PREFIX, hf_export, hf_export_config

MODEL_FILE, CONFIG_FILE, STATE_FILE, TOKENIZER_FILE, MANIFEST_FILE = (
    "model.safetensors", "config.json", "train_state.pt", "tokenizer.json", "manifest.json")
SHARDED_DIR = "sharded"
KEEP_LAST = 2


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupted; the message names the path."""


def sha256_file(path: str | Path) -> str:
    """sha256 hex digest of the bytes of the file at ``path``."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fsync(path: Path) -> None:
    """fsync a file or a directory (its entries) by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_weights(model: torch.nn.Module, path: Path) -> None:
    """``save_model`` with the mode every other file gets (0o666 less the umask; safetensors writes 0o600)."""
    save_model(model, str(path))
    plain_mode(path)


def _files(root: Path) -> list[str]:
    """Every file under ``root`` (recursive, hidden ones too) as sorted POSIX paths relative to it."""
    return sorted(str((Path(d) / f).relative_to(root).as_posix()) for d, _, fs in os.walk(root) for f in fs)


def _commit(tmp: Path, run_dir: Path, name: str, step: int, cfg: Config, train_state: dict[str, Any] | None,
            tokenizer_json: str | None, extra_files: dict[str, str] | None = None) -> Path:
    """Add config, train state, tokenizer, ``extra_files`` and manifest to ``tmp``, fsync, rename it to ``name``,
    point ``latest`` at it and keep the newest ``KEEP_LAST`` checkpoints."""
    ckpts = tmp.parent
    (tmp / CONFIG_FILE).write_text(cfg.to_json())
    if train_state is not None:
        torch.save(train_state, tmp / STATE_FILE)
    if tokenizer_json is not None:
        (tmp / TOKENIZER_FILE).write_text(tokenizer_json)
    for fname, text in (extra_files or {}).items():
        (tmp / fname).write_text(text)
    files = _files(tmp)
    # the config is kept in the manifest too, so an edited config.json can be reported field by field
    manifest = {"step": step, "files": {f: {"bytes": (tmp / f).stat().st_size, "sha256": sha256_file(tmp / f)}
                                        for f in files}, "config": cfg.to_dict()}
    (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
    for f in _files(tmp):
        _fsync(tmp / f)
    final = ckpts / name
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(ckpts)
    latest_tmp = run_dir / f".latest-{os.getpid()}"
    latest_tmp.write_text(name + "\n")
    os.replace(latest_tmp, run_dir / "latest")
    _fsync(run_dir)
    for old in sorted(p for p in ckpts.iterdir() if p.name.startswith("step-"))[:-KEEP_LAST]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_checkpoint(run_dir: str | Path, step: int, model: LoopLM, cfg: Config, *,
                    train_state: dict[str, Any] | None = None, tokenizer_json: str | None = None,
                    extra_files: dict[str, str] | None = None) -> Path:
    """Write consolidated checkpoint ``step`` of the unwrapped ``model`` atomically (one process) with
    ``extra_files`` ({name: text}, in the manifest). NonFiniteError, nothing written, for NaN/inf weights."""
    run_dir = Path(run_dir)
    bad = nonfinite_tensors(model.state_dict().items())
    if bad:
        raise NonFiniteError(f"{run_dir}: refusing to write checkpoint step {step}: non-finite weights in "
                             f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")
    name = f"step-{step:06d}"
    tmp = run_dir / "checkpoints" / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _save_weights(model, tmp / MODEL_FILE)
    return _commit(tmp, run_dir, name, step, cfg, train_state, tokenizer_json, extra_files)


def save_sharded_checkpoint(run_dir: str | Path, step: int, state_dict: dict[str, Any], cfg: Config,
                            env: DistEnv, *, train_state: dict[str, Any] | None = None,
                            tokenizer_json: str | None = None) -> Path:
    """Write sharded checkpoint ``step`` atomically; every rank calls it and writes its shards of ``state_dict``
    (``{"model", "optimizer"}``), then rank 0 adds the other files (its own train state) and commits."""
    run_dir = Path(run_dir)
    ckpts = run_dir / "checkpoints"
    name = f"step-{step:06d}"
    tmp = ckpts / f".tmp-{name}-sharded"  # one name for all ranks (their pids differ)
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(env)
    save_shards(state_dict, tmp / SHARDED_DIR, env)
    barrier(env)  # every rank's shards are on disk before rank 0 hashes and renames
    if env.is_main:
        _commit(tmp, run_dir, name, step, cfg, train_state, tokenizer_json)
    barrier(env)
    return ckpts / name


def is_sharded(ckpt: str | Path) -> bool:
    """Whether a checkpoint directory holds a sharded (DCP) model and optimizer state."""
    return (Path(ckpt) / SHARDED_DIR).is_dir()


def load_sharded(ckpt: str | Path, state_dict: dict[str, Any], *, distributed: bool = False) -> None:
    """Fill ``state_dict`` (the saved layout, tensors placed as wanted now) in place from ``ckpt``'s ``sharded/``
    state; ``distributed=False``: without collectives. CheckpointError: not sharded, or a missing key or shard."""
    path = Path(ckpt) / SHARDED_DIR
    if not path.is_dir():
        raise CheckpointError(f"{ckpt}: no {SHARDED_DIR}/ directory (not a sharded checkpoint)")
    try:
        load_shards(state_dict, path, distributed=distributed)
    except RuntimeError as exc:
        raise CheckpointError(f"{path}: cannot load sharded state ({exc})") from exc


def sharded_keys(ckpt: str | Path) -> set[str]:
    """Flattened keys of ``ckpt``'s ``sharded/`` state (``model.<fqn>``, ...) from its DCP metadata."""
    try:
        return shard_keys(Path(ckpt) / SHARDED_DIR)
    except RuntimeError as exc:
        raise CheckpointError(f"{Path(ckpt) / SHARDED_DIR}: cannot read the DCP metadata ({exc})") from exc


def _check_keys(where: Path, model: LoopLM, saved: set[str]) -> None:
    """CheckpointError unless the ``saved`` weight names are exactly ``model``'s."""
    expected = set(model.state_dict())
    if saved != expected:
        missing, unexpected = sorted(expected - saved), sorted(saved - expected)
        raise CheckpointError(f"{where}: weights do not match the model of config.json "
                              f"(missing {missing[:5]}, unexpected {unexpected[:5]})")


def _load_sharded_model(ckpt: Path, model: LoopLM) -> None:
    """Consolidate the sharded weights of ``ckpt`` into the plain ``model`` (strict: same key set)."""
    _check_keys(ckpt / SHARDED_DIR, model, {k[len("model."):] for k in sharded_keys(ckpt) if k.startswith("model.")})
    sd = {"model": model.state_dict()}
    load_sharded(ckpt, sd)
    model.load_state_dict(sd["model"], strict=True)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint directories of a run, oldest first."""
    ckpts = Path(run_dir) / "checkpoints"
    if not ckpts.is_dir():
        return []
    return sorted(p for p in ckpts.iterdir() if p.name.startswith("step-") and (p / MANIFEST_FILE).exists())


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from either itself or a run directory (via ``latest``)."""
    path = Path(path)
    if (path / MANIFEST_FILE).exists() or (path / MODEL_FILE).exists():
        return path
    latest = path / "latest"
    if latest.exists():
        target = path / "checkpoints" / latest.read_text().strip()
        if target.is_dir():
            return target
        raise CheckpointError(f"{latest} names {target}, which does not exist")
    raise CheckpointError(f"{path}: no checkpoint here (expected {MANIFEST_FILE}, {MODEL_FILE} or a run directory "
                          "with 'latest')")


def verify_checkpoint(ckpt: Path, *, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The manifest, after checking every file but ``skip`` against it; CheckpointError names a missing or
    changed file (an edited ``config.json``: the fields that differ)."""
    mpath = ckpt / MANIFEST_FILE
    if not mpath.exists():
        raise CheckpointError(f"{ckpt}: missing {MANIFEST_FILE} (incomplete checkpoint)")
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{mpath}: not valid JSON ({exc})") from None
    for name, meta in manifest["files"].items():
        if name in skip:
            continue
        f = ckpt / name
        if not f.exists():
            raise CheckpointError(f"{f}: missing from checkpoint")
        size, sha = f.stat().st_size, sha256_file(f)
        if size == meta["bytes"] and sha == meta["sha256"]:
            continue
        what = (f"{size} bytes on disk, {meta['bytes']} in the manifest (truncated or overwritten)"
                if size != meta["bytes"] else f"same size ({size} bytes), different content (corrupted or edited)")
        fields = _config_changes(f, manifest.get("config")) if name == CONFIG_FILE else ""
        raise CheckpointError(f"{f}: differs from {MANIFEST_FILE}: {what}; sha256 {sha[:16]}… on disk, "
                              f"{meta['sha256'][:16]}… in the manifest{fields}; load an earlier checkpoint "
                              f"from {ckpt.parent} instead")
    return manifest


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b": leaf}`` of nested dicts."""
    if not isinstance(d, dict):
        return {prefix: d}
    return {key: leaf for k, v in d.items() for key, leaf in _flatten(v, f"{prefix}.{k}" if prefix else str(k)).items()}


def _config_changes(path: Path, saved: dict[str, Any] | None) -> str:
    """``"; edited fields: optim.lr 0.003 → 0.01, ..."`` between ``path`` and the manifest's config."""
    if saved is None:
        return ""
    try:
        now = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"; it no longer parses as JSON ({exc})"
    a, b = _flatten(saved), _flatten(now)

    def shown(d: dict[str, Any], k: str) -> str:
        return repr(d[k]) if k in d else "(absent)"

    diffs = [f"{k} {shown(a, k)} → {shown(b, k)}" for k in sorted(a.keys() | b.keys())
             if a.get(k, ...) != b.get(k, ...)]
    return f"; edited fields: {', '.join(diffs)}" if diffs else "; same fields and values (formatting only)"


def load_config(ckpt: str | Path) -> Config:
    """The config saved with a checkpoint (``ckpt``: checkpoint or run directory)."""
    ckpt = resolve_checkpoint(ckpt)
    export = hf_export(ckpt)
    return hf_export_config(export) if export else Config.from_json((ckpt / CONFIG_FILE).read_text())


def load_train_state(ckpt: str | Path) -> dict[str, Any]:
    """The training state (step, scheduler, RNG, depth prior; consolidated: the optimizer), loaded as data
    (``weights_only=True``); CheckpointError when missing or holding pickled objects (they could run code)."""
    path = resolve_checkpoint(ckpt) / STATE_FILE
    if not path.exists():
        raise CheckpointError(f"{path}: missing (weights-only checkpoint cannot resume)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: refused: it holds pickled objects beyond tensors, numbers, strings and "
                              f"containers, and loading them could run code ({reason})") from None


def _load_hf_weights(path: Path, model: LoopLM, device: str | torch.device) -> None:
    """Load an export folder's ``model*.safetensors`` into ``model`` strictly (without the export's key prefix)."""
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no model.safetensors in this Hugging Face export")
    state: dict[str, torch.Tensor] = {}
    try:
        for f in files:
            state.update(load_file(str(f), device=str(device)))
    except Exception as exc:  # safetensors raises several types for damaged files
        raise CheckpointError(f"{path}: cannot load weights ({exc})") from exc
    state = {k[len(WEIGHTS_PREFIX):] if k.startswith(WEIGHTS_PREFIX) else k: v for k, v in state.items()}
    if model.cfg.tie_embeddings and "lm_head.weight" not in state and "tok_emb.weight" in state:
        state["lm_head.weight"] = state["tok_emb.weight"]  # save_pretrained drops the tied copy
    _check_keys(path, model, set(state))
    model.load_state_dict(state, strict=True)


def load_checkpoint(path: str | Path, *, device: str | torch.device = "cpu",
                    with_state: bool = False) -> tuple[LoopLM, Config, dict[str, Any] | None, Path]:
    """``(model, config, train_state or None, checkpoint_dir)``, strict, in eval mode, ``final_depth`` the
    nominal training depth. Also a sharded checkpoint (consolidated here) and, without ``with_state``, a plain
    ``config.json`` + ``model.safetensors`` folder or a Hugging Face export.

    CheckpointError: damaged checkpoint; NonFiniteError: NaN/inf weights; ValueError: a bad device.
    """
    device = resolve_device(str(device), "--device")
    ckpt = resolve_checkpoint(path)
    bare = not with_state and not (ckpt / MANIFEST_FILE).exists()
    hf = hf_export(ckpt) if bare else None
    if hf is not None:  # a Hugging Face export (`looplm export`): no transformers
        cfg = hf_export_config(hf)
        model = build_model(cfg)
        _load_hf_weights(ckpt, model, device)
    else:
        if bare and (ckpt / CONFIG_FILE).exists() and (ckpt / MODEL_FILE).exists():
            files = {MODEL_FILE}  # a plain export: config.json + model.safetensors (+ tokenizer)
        else:  # inference does not need the training state
            files = verify_checkpoint(ckpt, skip=frozenset() if with_state else frozenset({STATE_FILE}))["files"]
        cfg = Config.from_json((ckpt / CONFIG_FILE).read_text())
        model = build_model(cfg)
        if MODEL_FILE not in files and is_sharded(ckpt):
            _load_sharded_model(ckpt, model)
        else:
            try:
                load_model(model, str(ckpt / MODEL_FILE), strict=True, device=str(device))
            except Exception as exc:  # safetensors raises several types for damaged files
                raise CheckpointError(f"{ckpt / MODEL_FILE}: cannot load weights ({exc})") from exc
    bad = nonfinite_tensors(model.state_dict().items())
    if bad:  # evaluating, generating or resuming from it would only propagate NaN
        raise NonFiniteError(f"{ckpt}: the weights hold NaN/inf values (in {', '.join(bad[:5])}"
                             f"{', ...' if len(bad) > 5 else ''}): the run diverged before this checkpoint was "
                             "written; use an earlier checkpoint")
    model.to(device)
    # where a final_only_norm readout normalizes: the nominal training depth, or the export's
    model.final_depth = (hf or {}).get("final_depth", cfg.depth.nominal_depth())
    model.eval()  # inference by default (dropout off); the trainer switches to train mode
    state = load_train_state(ckpt) if with_state else None
    return model, cfg, state, ckpt


def consolidate_checkpoint(path: str | Path) -> Path:
    """Add the full weights of a sharded checkpoint as ``model.safetensors`` (and to its manifest), atomically;
    a no-op when it has one. Returns its path."""
    ckpt = resolve_checkpoint(path)
    manifest = verify_checkpoint(ckpt)
    if MODEL_FILE in manifest["files"]:
        return ckpt / MODEL_FILE
    if not is_sharded(ckpt):
        raise CheckpointError(f"{ckpt}: neither {MODEL_FILE} nor {SHARDED_DIR}/ to consolidate")
    model = build_model(Config.from_json((ckpt / CONFIG_FILE).read_text()))
    _load_sharded_model(ckpt, model)
    tmp, final = ckpt / f".{MODEL_FILE}.tmp-{os.getpid()}", ckpt / MODEL_FILE
    _save_weights(model, tmp)
    _fsync(tmp)
    os.replace(tmp, final)
    manifest["files"][MODEL_FILE] = {"bytes": final.stat().st_size, "sha256": sha256_file(final)}
    manifest["files"] = dict(sorted(manifest["files"].items()))
    with atomic_write(ckpt / MANIFEST_FILE) as fh:  # the manifest last: a crash before leaves it unchanged
        fh.write(json.dumps(manifest, indent=2).encode())
    _fsync(ckpt)
    return final


def _problem(ckpt: Path) -> str | None:
    """Why ``ckpt`` fails :func:`verify_checkpoint`, or None."""
    try:
        verify_checkpoint(ckpt)
    except CheckpointError as exc:
        return str(exc)
    return None


def newest_valid_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest checkpoint of a run that passes :func:`verify_checkpoint` (None if none does)."""
    return next((c for c in reversed(list_checkpoints(run_dir)) if _problem(c) is None), None)


def checkpoint_problems(run_dir: str | Path) -> list[tuple[Path, str]]:
    """(checkpoint, reason) for every checkpoint of a run that fails :func:`verify_checkpoint`."""
    return [(c, p) for c in list_checkpoints(run_dir) if (p := _problem(c)) is not None]
