"""train.logger: the config field, the startup check, and each backend read back offline against
metrics.jsonl (TensorBoard event files, a W&B offline run's .wandb file, trackio's local store)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from looplm.config import Config, ConfigError, apply_overrides
from looplm.train.loggers import LoggerError, check_loggers, scalars


@pytest.fixture(autouse=True)
def one_thread():
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _cfg(tiny_cfg, logger, **train):
    return tiny_cfg.replace(train=tiny_cfg.train.replace(logger=logger, steps=4, eval_every=2, ckpt_every=2,
                                                         **train))


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _expected(run: Path) -> dict[int, dict[str, float]]:
    """step → the scalars the backends log, from metrics.jsonl (null → NaN)."""
    out = {}
    for rec in _records(run):
        out[rec["step"]] = {k: (math.nan if v is None else v) for k, v in
                            scalars({k: (math.nan if v is None else v) for k, v in rec.items()}).items()}
    return out


def _close(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


def test_logger_field(tiny_cfg):
    base = tiny_cfg.train
    assert base.logger == ["jsonl"]
    assert base.replace(logger="tensorboard").logger == ["jsonl", "tensorboard"]  # jsonl implied, first
    assert base.replace(logger=["wandb", "jsonl", "trackio"]).logger == ["jsonl", "wandb", "trackio"]
    cfg = apply_overrides(tiny_cfg, {"train.logger": "jsonl,tensorboard"})  # as --train.logger gives it
    assert cfg.train.logger == ["jsonl", "tensorboard"]
    assert Config.from_json(cfg.to_json()) == cfg
    with pytest.raises(ConfigError, match=r"train\.logger: unknown logger 'tensorbord' \(did you mean "
                                          r"tensorboard\?\); allowed: jsonl, tensorboard, wandb, trackio"):
        base.replace(logger=["tensorbord"])
    with pytest.raises(ConfigError, match="train.logger: a logger is named twice"):
        base.replace(logger="wandb,wandb")
    with pytest.raises(ConfigError, match="train.logger: must be a list of names"):
        base.replace(logger=3)
    # the field is not part of the results store's config identity (a config file must state it)
    from looplm.analysis.store import config_hash

    d = tiny_cfg.to_dict()
    del d["train"]["logger"]
    with pytest.raises(ConfigError, match="train.logger: missing"):
        Config.from_dict(d)
    assert config_hash(cfg) == config_hash(tiny_cfg) == config_hash(d)


def test_missing_package_fails_at_startup(tmp_path, tiny_cfg, monkeypatch):
    import importlib.util

    from looplm.train.trainer import train

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(LoggerError, match=r'train.logger: wandb needs the wandb package.*pip install "looplm\[wandb\]"'):
        check_loggers(["jsonl", "wandb"])

    def no_data(*a, **k):
        raise AssertionError("data prepared before the logger check")

    monkeypatch.setattr("looplm.train.trainer.prepare_data", no_data)
    with pytest.raises(LoggerError, match="looplm\\[wandb\\]"):
        train(_cfg(tiny_cfg, "jsonl,wandb"), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_tensorboard_matches_metrics_and_resume_purges(tmp_path, tiny_cfg, tiny_data):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from looplm.train.trainer import train

    run = tmp_path / "run"
    cfg = _cfg(tiny_cfg, "tensorboard")
    summary = train(cfg, run, progress=False, data=tiny_data)

    def read() -> EventAccumulator:
        acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        return acc

    def check(acc: EventAccumulator) -> None:
        want = _expected(run)
        tags = set(acc.Tags()["scalars"])
        assert {"loss", "lr", "grad_norm", "tokens_per_s", "val_ppl", "val_loss", "depth"} <= tags
        assert tags == {k for values in want.values() for k in values}
        for tag in tags:
            got = {e.step: e.value for e in acc.Scalars(tag)}
            assert sorted(got) == sorted(s for s, v in want.items() if tag in v), tag  # each step once
            assert all(_close(got[s], want[s][tag]) for s in got), tag

    acc = read()
    check(acc)
    assert [e.step for e in acc.Scalars("val_ppl")] == [2, 4]
    texts = {t for t in acc.Tags()["tensors"]}
    assert {"config/text_summary", "summary/text_summary"} <= texts
    text = acc.Tensors("summary/text_summary")[0].tensor_proto.string_val[0].decode()
    assert f'"val_ppl": {summary["val_ppl"]}' in text

    # killed after step 4 with only the step-2 checkpoint valid: the resumed run re-logs steps 3-4;
    # TensorBoard hides the killed run's events after step 2 (purge_step), like metrics.jsonl drops them
    before = {e.step: e.value for e in acc.Scalars("tokens_per_s")}
    shutil.rmtree(run / "checkpoints" / "step-000004")
    (run / "summary.json").unlink()
    (run / "latest").write_text("step-000002\n")
    train(cfg, run, resume=True, progress=False, data=tiny_data)
    assert [r["step"] for r in _records(run)] == [1, 2, 3, 4]
    acc = read()
    check(acc)
    after = {e.step: e.value for e in acc.Scalars("tokens_per_s")}
    assert after[1] == before[1] and after[4] != before[4]  # the resumed run's values, not the old ones


def _wandb_records(path: Path):
    """Records of a W&B ``.wandb`` file (a LevelDB-style log of protobuf ``Record``s: a 7-byte header,
    then 32 KiB blocks of chunks, each 4-byte CRC, 2-byte length, 1-byte type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0:  # zero padding
            continue
        if kind == 1:  # full
            pending = b""
            whole = chunk
        elif kind == 2:  # first
            pending = chunk
            continue
        elif kind == 3:  # middle
            pending += chunk
            continue
        else:  # last
            whole, pending = pending + chunk, b""
        rec = pb.Record()
        rec.ParseFromString(whole)
        yield rec


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


@pytest.mark.slow
def test_wandb_offline_history_matches_metrics(tmp_path, tiny_cfg, tiny_data, monkeypatch):
    pytest.importorskip("wandb")
    from looplm.train.trainer import train

    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_PROJECT": "looplm-test",
                       "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "cfg"),
                       "WANDB_CACHE_DIR": str(tmp_path / "cache"), "WANDB_DATA_DIR": str(tmp_path / "data")}.items():
        monkeypatch.setenv(key, value)
    run = tmp_path / "run"
    summary = train(_cfg(tiny_cfg, ["wandb"]), run, progress=False, data=tiny_data)
    # run.finish() can return before wandb-core has flushed the .wandb file (a CI run once read it with
    # the run record but no history); teardown stops the service, which closes the file.
    import wandb
    wandb.teardown()
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    run_id = (run / "wandb" / "run_id").read_text().strip()
    assert files[0].name == f"run-{run_id}.wandb"
    history, config, summ = {}, {}, {}
    records = list(_wandb_records(files[0]))
    kinds = [r.WhichOneof("record_type") for r in records]
    assert "exit" in kinds, kinds  # the file is complete
    for kind, rec in zip(kinds, records):
        if kind == "history":
            items = {_key(i): json.loads(i.value_json) for i in rec.history.item}
            history.setdefault(rec.history.step.num, {}).update(
                {k: v for k, v in items.items() if not k.startswith("_")})
        elif kind == "summary":
            summ.update({_key(i): json.loads(i.value_json) for i in rec.summary.update})
        elif kind == "run":  # the run record holds the config
            assert rec.run.run_id == run_id and rec.run.project == "looplm-test" and rec.run.display_name == "tiny"
            config.update({_key(i): json.loads(i.value_json) for i in rec.run.config.update})
    want = _expected(run)
    assert sorted(history) == sorted(want)
    for step, values in want.items():
        got = {k: (math.nan if v in ("NaN", None) else float(v)) for k, v in history[step].items()}
        assert got.keys() == values.keys() and all(_close(got[k], values[k]) for k in values), step
    assert config["model"]["d_model"] == 32 and config["train"]["logger"] == ["jsonl", "wandb"]
    assert summ["val_ppl"] == pytest.approx(summary["val_ppl"]) and summ["params"] == summary["params"]


def test_trackio_local_matches_metrics(tmp_path, tiny_cfg, tiny_data, monkeypatch):
    pytest.importorskip("trackio")
    from trackio import sqlite_storage

    from looplm.train.trainer import train

    monkeypatch.setattr(sqlite_storage, "TRACKIO_DIR", tmp_path / "trackio")  # read when trackio is imported
    monkeypatch.setenv("TRACKIO_PROJECT", "looplm-test")
    run = tmp_path / "run"
    summary = train(_cfg(tiny_cfg, "trackio"), run, progress=False, data=tiny_data)
    assert (tmp_path / "trackio" / "looplm-test.db").is_file()
    logs = sqlite_storage.SQLiteStorage.get_logs("looplm-test", "tiny")
    by_step: dict[int, dict] = {}
    for row in logs:
        by_step.setdefault(row["step"], {}).update({k: v for k, v in row.items() if k not in ("step", "timestamp")})
    want = _expected(run)
    assert sorted(by_step) == sorted(want)
    for step, values in want.items():
        got = {k: v for k, v in by_step[step].items() if not k.startswith("summary/") and not k.startswith("_")}
        assert got.keys() == values.keys() and all(_close(float(got[k]), values[k]) for k in values), step
    assert by_step[4]["summary/val_ppl"] == pytest.approx(summary["val_ppl"])
    assert sqlite_storage.SQLiteStorage.get_run_config("looplm-test", "tiny")["model"]["d_model"] == 32
