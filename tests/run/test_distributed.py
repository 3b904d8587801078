"""Distributed training on CPU: 2 gloo ranks under torchrun against one process with the same global
batch (DDP and FSDP2), a checkpoint saved under 2 ranks resumed in 1, and sharded (DCP) checkpoints:
resumed across world sizes, consolidated for evaluation, and rejected when a shard is damaged."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from looplm.cli import main
from looplm.run.checkpoint import CheckpointError, consolidate_checkpoint, load_checkpoint

pytestmark = pytest.mark.slow  # every test here starts torchrun subprocesses

ARGS = ["--preset", "debug", "--quiet", "--train.steps", "4", "--train.batch_size", "4", "--train.ckpt_every", "2",
        "--train.eval_every", "2", "--train.eval_batches", "1", "--train.num_threads", "1",
        "--model.dropout", "0.0"]


def _trace(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _torchrun(run, *extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "looplm", "train", "--out", str(run), *ARGS, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _assert_same_trace(a, b, rtol=1e-5):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        print(ra["step"], ra["loss"], rb["loss"], ra.get("val_loss"), rb.get("val_loss"))
        assert ra["depths"] == rb["depths"]
        assert rb["loss"] == pytest.approx(ra["loss"], rel=rtol)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4)
        if "val_loss" in ra:
            assert rb["val_loss"] == pytest.approx(ra["val_loss"], rel=rtol)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    run = tmp_path_factory.mktemp("single")
    assert main(["train", "--out", str(run), *ARGS]) == 0
    return run


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_rank_loss_trace_equals_single_process(tmp_path, single, mode):
    run = tmp_path / mode
    _torchrun(run, "--train.distributed", mode)
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2
    _assert_same_trace(_trace(single), _trace(run))


def test_checkpoint_saved_under_two_ranks_resumes_in_one(tmp_path, single):
    run = tmp_path / "resume"
    _torchrun(run, "--train.distributed", "fsdp", "--stop-after", "2")
    assert [r["step"] for r in _trace(run)] == [1, 2]
    assert main(["train", "--out", str(run), *ARGS, "--resume"]) == 0
    _assert_same_trace(_trace(single), _trace(run))


SHARDED = ["--train.checkpoint_format", "sharded"]


def test_sharded_checkpoint_resumes_across_world_sizes(tmp_path, single):
    """2 FSDP ranks write sharded checkpoints and stop; 1 process resumes for one step (DCP gathers the
    shards), then 2 ranks finish (DCP splits them again): the loss trace is the uninterrupted one."""
    run = tmp_path / "sharded"
    _torchrun(run, "--train.distributed", "fsdp", *SHARDED, "--stop-after", "2")
    ckpt = run / "checkpoints" / "step-000002"
    assert sorted(p.name for p in (ckpt / "sharded").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (ckpt / "model.safetensors").exists()
    assert main(["train", "--out", str(run), *ARGS, "--resume", "--stop-after", "1"]) == 0
    assert [r["step"] for r in _trace(run)] == [1, 2, 3]
    _torchrun(run, "--resume")
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2
    _assert_same_trace(_trace(single), _trace(run))


@pytest.fixture(scope="module")
def sharded_single(tmp_path_factory):
    """One process, sharded checkpoints, stopped after 2 of the 4 steps of ``single``."""
    run = tmp_path_factory.mktemp("sharded_single")
    assert main(["train", "--out", str(run), *ARGS, *SHARDED, "--stop-after", "2"]) == 0
    return run


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_sharded_checkpoint_loads_for_eval_like_the_consolidated_one(single, sharded_single, capsys):
    """Same run, same step: the sharded checkpoint consolidates on load to the consolidated weights bit
    for bit, evaluates to the same perplexity, and `consolidate` writes the same model.safetensors."""
    ref = single / "checkpoints" / "step-000002"
    model_ref, _, _, _ = load_checkpoint(ref)
    model, cfg, state, ckpt = load_checkpoint(sharded_single, with_state=True)
    assert ckpt.name == "step-000002" and state["step"] == 2 and "optimizer" not in state
    sd_ref = model_ref.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, sd_ref[key]), key  # exact: the same saved weights
    scores = []
    for path in (ref, ckpt):
        capsys.readouterr()
        assert main(["eval", "ppl", "--checkpoint", str(path), "--depths", "1,4", "--max-tokens", "512", "--quiet",
                     "--json"]) == 0
        scores.append(json.loads(capsys.readouterr().out)["depths"])
    print(scores)
    assert scores[0] == scores[1]
    copy = ckpt.parent.parent / "consolidated"
    shutil.copytree(ckpt, copy)
    assert main(["consolidate", "--checkpoint", str(copy)]) == 0
    assert _sha(copy / "model.safetensors") == _sha(ref / "model.safetensors")
    assert consolidate_checkpoint(copy) == copy / "model.safetensors"  # verifies the new manifest; no-op
    assert json.loads((copy / "manifest.json").read_text())["files"]["model.safetensors"]["sha256"] == \
        _sha(ref / "model.safetensors")


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_shard_gives_checkpoint_error_naming_it(tmp_path, sharded_single, damage):
    ckpt = tmp_path / "step-000002"
    shutil.copytree(sharded_single / "checkpoints" / "step-000002", ckpt)
    shard = ckpt / "sharded" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"sharded/__0_0\.distcp: .*(truncated|corrupted)"):
        load_checkpoint(ckpt)


LEARNED = ["--model.rule", "huginn_linear", "--model.n_prelude", "1", "--model.n_coda", "1",
           "--model.options.state_init", "zeros", "--model.exit_gate", "true",
           "--depth.sampler", "learned", "--depth.cap", "6", "--depth.mean", "3",
           "--depth.warmup", "1", "--depth.lr", "0.05", "--train.supervision", "exit_weighted"]


@pytest.mark.parametrize("estimator", [["--train.gradient.kind", "tbptt", "--train.gradient.steps", "2"],
                                       ["--train.gradient.kind", "endpoint", "--train.gradient.steps", "2"]],
                         ids=["tbptt2", "endpoint2"])
def test_learned_prior_tbptt_exit_gate_under_ddp_equals_single_process(tmp_path, estimator):
    """Every rank draws the same depths from the learned prior (its update is summed over ranks), and
    DDP needs no unused-parameter search with truncated BPTT or endpoint gradients (the exact-zero
    detach) and the exit gate. (The initial state is zeros: a gaussian one, like dropout, draws
    different noise for a batch split over ranks.)"""
    single = tmp_path / "single"
    assert main(["train", "--out", str(single), *ARGS, *LEARNED, *estimator]) == 0
    run = tmp_path / "ddp"
    _torchrun(run, "--train.distributed", "ddp", *LEARNED, *estimator)
    a, b = _trace(single), _trace(run)
    _assert_same_trace(a, b)
    for ra, rb in zip(a, b):
        assert rb["prior_mean_depth"] == pytest.approx(ra["prior_mean_depth"], rel=1e-5)
