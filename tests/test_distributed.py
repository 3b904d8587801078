"""Distributed training on CPU: 2 gloo ranks under torchrun against one process with the same global
batch (DDP and FSDP2), and a checkpoint saved under 2 ranks resumed in 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from looplm.cli import main

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


LEARNED = ["--model.rule", "huginn_linear", "--model.n_prelude", "1", "--model.n_coda", "1", "--model.state_init", "zeros",
           "--train.depth_sampler", "learned", "--train.depth_cap", "6", "--train.depth_mean", "3",
           "--train.prior_warmup", "1", "--train.prior_lr", "0.05", "--train.tbptt", "2",
           "--train.supervision", "exit_weighted"]


def test_learned_prior_tbptt_exit_gate_under_ddp_equals_single_process(tmp_path):
    """Every rank draws the same depths from the learned prior (its update is summed over ranks), and
    DDP needs no unused-parameter search with truncated BPTT and the exit gate. (The initial state is
    zeros: a gaussian one, like dropout, draws different noise for a batch split over ranks.)"""
    single = tmp_path / "single"
    assert main(["train", "--out", str(single), *ARGS, *LEARNED]) == 0
    run = tmp_path / "ddp"
    _torchrun(run, "--train.distributed", "ddp", *LEARNED)
    a, b = _trace(single), _trace(run)
    _assert_same_trace(a, b)
    for ra, rb in zip(a, b):
        assert rb["prior_mean_depth"] == pytest.approx(ra["prior_mean_depth"], rel=1e-5)
