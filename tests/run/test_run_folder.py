"""The run layer's folder and step loop (looplm.run.folder): resume, metrics truncation, checkpoint cadence, lock."""

from __future__ import annotations

import json

import pytest
import torch

from looplm.run.folder import Fit, RunFolder, rng_state, set_rng_state
from looplm.run.lock import RunLockedError


def _toy_run(folder: RunFolder, saved: dict, *, start: int = 0, stop_after: int | None = None) -> Fit:
    """A loop of 7 steps whose record draws from the global torch RNG; ``saved`` plays the checkpoints
    (step → the RNG state at that step)."""
    if start:
        set_rng_state(saved[start])
    else:
        torch.manual_seed(0)
    fit = Fit(folder, start=start, total=7, stop_after=stop_after, ckpt_every=3, progress=False, desc="toy",
              save=lambda done: saved.__setitem__(done, rng_state()))
    with fit:
        for step in fit:
            fit.log({"step": step + 1, "x": torch.rand(()).item()})
    return fit


def test_fit_stopped_and_resumed_logs_what_the_uninterrupted_loop_logs(tmp_path):
    full, saved_full = RunFolder(tmp_path / "full"), {}
    full.path.mkdir()
    assert _toy_run(full, saved_full).end == 7
    assert sorted(saved_full) == [3, 6, 7]  # every ckpt_every steps and at the end

    part, saved = RunFolder(tmp_path / "part"), {}
    part.path.mkdir()
    assert _toy_run(part, saved, stop_after=4).end == 4
    assert sorted(saved) == [3, 4]  # a stopped invocation checkpoints where it stops
    with part.metrics.open("a") as f:  # a crash after step 5 was logged but before its checkpoint
        f.write(json.dumps({"step": 5, "x": -1.0}) + "\n")
    _toy_run(part, saved, start=4)
    assert sorted(saved) == [3, 4, 6, 7]
    # the same computation twice: the resumed log is the uninterrupted one, byte for byte
    assert part.metrics.read_text() == full.metrics.read_text()
    assert [json.loads(line)["step"] for line in full.metrics.read_text().splitlines()] == list(range(1, 8))


def test_fit_fresh_start_replaces_an_old_log_and_a_rank_that_does_not_write_leaves_it(tmp_path):
    folder = RunFolder(tmp_path)
    folder.metrics.write_text('{"step": 9}\n')
    with Fit(folder, start=0, total=0, stop_after=None, ckpt_every=0, save=print, desc="", progress=False,
             write=False):
        pass
    assert folder.metrics.read_text() == '{"step": 9}\n'
    with Fit(folder, start=0, total=0, stop_after=None, ckpt_every=0, save=print, desc="", progress=False):
        pass
    assert folder.metrics.read_text() == ""


def test_start_is_exclusive_and_a_failed_start_leaves_no_folder(tmp_path):
    folder = RunFolder(tmp_path / "run")
    with pytest.raises(RuntimeError, match="boom"):
        with folder.start(resume=False):
            raise RuntimeError("boom")
    assert not folder.path.exists()  # nothing was written: no folder with a stale .lock
    with folder.start(resume=False):
        with pytest.raises(RunLockedError, match="in use by another training process"):
            RunFolder(folder.path).start(resume=False).__enter__()
        (folder.path / "config.json").write_text("{}")
    with pytest.raises(RuntimeError):
        with folder.start(resume=False):
            raise RuntimeError("later failure")
    assert (folder.path / "config.json").exists()  # a folder with content stays


def test_summary_is_written_once_finished_and_read_back_when_nothing_is_left(tmp_path):
    def fit(start: int, end: int) -> Fit:
        return Fit(RunFolder(tmp_path), start=start, total=5, stop_after=end - start, ckpt_every=0, save=print,
                   desc="run")

    assert fit(0, 3).summary({"a": 1}) == {"a": 1}
    assert not (tmp_path / "summary.json").exists()  # stopped early: no summary yet
    assert fit(3, 5).summary({"a": 2}) == {"a": 2}
    assert fit(5, 5).summary({"a": 3}) == {"a": 2}  # finished before: the stored one


@pytest.mark.parametrize("overwrite", [False, None])
def test_a_fresh_run_refuses_a_folder_holding_files_it_writes(tmp_path, overwrite):
    """A folder that is not a looplm run (or a run that wrote no checkpoint) keeps its files: config.json,
    tokenizer.json (``writes``), summary.json, metrics.jsonl (every run's) are refused unless ``overwrite``;
    ``overwrite=None`` (distill, rl train) offers no --overwrite in the message."""
    user = {"config.json": "{}", "tokenizer.json": "mine", "summary.json": "[]", "notes.txt": "keep"}
    for name, text in user.items():
        (tmp_path / name).write_text(text)
    folder = RunFolder(tmp_path)
    with pytest.raises(ValueError) as err:
        with folder.start(resume=False, writes=("config.json", "tokenizer.json"), overwrite=overwrite):
            pytest.fail("the block ran")
    assert f"--out {tmp_path} already holds summary.json, config.json, tokenizer.json" in str(err.value)
    assert ("pass --overwrite" in str(err.value)) == (overwrite is False)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(user)  # no .lock left behind
    assert all((tmp_path / name).read_text() == text for name, text in user.items())
    (tmp_path / "summary.json").unlink()
    with folder.start(resume=False, writes=("task.json",)):  # files the run does not write are no obstacle
        pass


def test_overwrite_lets_a_fresh_run_replace_its_files_but_never_checkpoints(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "config.json").write_text("{}")
    with RunFolder(tmp_path).start(resume=False, writes=("config.json",), overwrite=True) as ckpt:
        assert ckpt is None
    (tmp_path / "checkpoints" / "step-000001").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-000001" / "manifest.json").write_text("{}")
    with pytest.raises(ValueError, match="already holds a run; continue it with --resume"):
        with RunFolder(tmp_path).start(resume=False, overwrite=True):
            pass
