"""What looplm reads never runs code: train_state.pt loads as data (torch.load weights_only=True), DCP
metadata through a restricted unpickler; a pickled state is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from looplm.cli import main
from looplm.run.checkpoint import newest_valid_checkpoint
from looplm.train.trainer import train


def test_resume_refuses_a_state_that_runs_code(tmp_path, tiny_cfg, tiny_data, poison, capsys):
    run, marker = tmp_path / "run", tmp_path / "ran"
    train(tiny_cfg, run, progress=False, data=tiny_data, stop_after=2)
    ckpt = newest_valid_checkpoint(run)
    poison.train_state(ckpt, marker)
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "refused" in err and "train_state.pt" in err
    assert not marker.exists()  # the code never ran


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
