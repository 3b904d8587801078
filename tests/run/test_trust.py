"""What looplm reads never runs code: train_state.pt loads as data (torch.load weights_only=True), DCP
metadata through a restricted unpickler; a pickled state is refused until the user converts it explicitly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from looplm.cli import main
from looplm.run.checkpoint import (CheckpointError, load_train_state, newest_valid_checkpoint,
                                   sha256_file)
from looplm.train.trainer import train


def _trace(run):
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_resume_refuses_a_state_that_runs_code_and_conversion_is_explicit(tmp_path, tiny_cfg, tiny_data,
                                                                         poison, capsys):
    run, marker = tmp_path / "run", tmp_path / "ran"
    train(tiny_cfg, run, progress=False, data=tiny_data, stop_after=2)
    ckpt = newest_valid_checkpoint(run)
    poison.train_state(ckpt, marker)
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "refused" in err and "convert-train-state" in err and "train_state.pt" in err
    assert not marker.exists()  # the code never ran
    assert main(["convert-train-state", "--checkpoint", str(ckpt)]) == 2  # refused without --trust-pickle
    assert not marker.exists() and "--trust-pickle" in capsys.readouterr().err


def test_convert_train_state_rewrites_a_trusted_file_as_data_and_resume_stays_exact(tmp_path, tiny_cfg, tiny_data):
    """An older-style state holding numpy objects (data, but pickled): refused, converted once, then the
    resumed run equals the uninterrupted one bit for bit (same code path, same machine)."""
    full, part = tmp_path / "full", tmp_path / "part"
    train(tiny_cfg, full, progress=False, data=tiny_data)
    train(tiny_cfg, part, progress=False, data=tiny_data, stop_after=3)
    ckpt = newest_valid_checkpoint(part)
    path = ckpt / "train_state.pt"
    state = torch.load(path, weights_only=True)
    keys = state["rng"]["numpy"]["keys"]
    state["rng"]["numpy"]["keys"] = keys.numpy().astype(np.uint32)  # an ndarray: pickled, not weights_only data
    torch.save(state, path)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["train_state.pt"] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="refused"):
        load_train_state(ckpt)
    assert main(["convert-train-state", "--checkpoint", str(ckpt), "--trust-pickle"]) == 0
    converted = torch.load(path, weights_only=True)
    assert torch.equal(converted["rng"]["numpy"]["keys"].long(), keys)  # the same integers, now a tensor
    train(tiny_cfg, part, progress=False, data=tiny_data, resume=True)  # verifies the rewritten manifest
    assert _trace(full) == _trace(part)


def test_rng_state_round_trips_numpy_and_python():
    import random

    from looplm.run.folder import rng_state, set_rng_state

    saved = rng_state()
    expect = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    set_rng_state(torch.load(_save(saved), weights_only=True))  # through a weights_only round trip
    got = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    assert torch.equal(expect[0], got[0]) and np.array_equal(expect[1], got[1]) and expect[2] == got[2]


def _save(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_sharded_metadata_that_names_another_global_is_refused(tmp_path, tiny_cfg, tiny_data, poison, capsys):
    """DCP's own reader unpickles .metadata with plain pickle; looplm's allows only DCP metadata types."""
    from looplm.run.dist import shard_keys

    cfg = tiny_cfg.replace(train=tiny_cfg.train.replace(checkpoint_format="sharded"))
    run, marker = tmp_path / "run", tmp_path / "ran"
    train(cfg, run, progress=False, data=tiny_data, stop_after=2)
    ckpt = newest_valid_checkpoint(run)
    assert any(k.startswith("model.") for k in shard_keys(ckpt / "sharded"))  # the real file reads
    poison.file(ckpt, "sharded/.metadata", marker)
    with pytest.raises(RuntimeError, match="refused global builtins.exec"):
        shard_keys(ckpt / "sharded")
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--quiet"]) == 2
    assert "builtins.exec" in capsys.readouterr().err and not marker.exists()
