"""Experiment tracking: the training loop's metric records mirrored to TensorBoard, W&B or trackio.

``metrics.jsonl`` is always written and stays the exact record; the ``train.logger`` backends are optional
mirrors written by rank 0 from the same records (:func:`scalars`): ``tensorboard`` (``RUN/tensorboard/``),
``wandb`` (offline unless ``WANDB_MODE``; ``RUN/wandb/``, project ``$WANDB_PROJECT``), ``trackio`` (its
local store, ``$TRACKIO_PROJECT``). On resume TensorBoard purges the steps after the checkpoint; W&B and
trackio resume the same run and cannot drop history. A missing package fails at startup
(:func:`check_loggers`), naming its extra. Details: README "Tracking and data", docs/interop.md.
"""
from __future__ import annotations

import importlib.util
import math
import os
import secrets
from pathlib import Path
from typing import Any, Mapping, Sequence

from looplm.run.finite import dumps

class LoggerError(ValueError):
    """A ``train.logger`` backend cannot be used (its package is missing); the message names the extra."""


def check_loggers(names: Sequence[str]) -> None:
    """Fail early (LoggerError naming ``pip install "looplm[EXTRA]"``) when a backend lacks its package."""
    for name in names:  # each backend's package and looplm extra share its name
        if name in TRACKERS and importlib.util.find_spec(name) is None:
            raise LoggerError(f"train.logger: {name} needs the {name} package, which is not installed; "
                              f"pip install \"looplm[{name}]\" (or drop {name} from train.logger)")


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The scalars of a metrics record, as the backends log them (see the module docstring)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step":
            continue
        if isinstance(value, (bool, int, float)):
            out[key] = float(value)
        elif key == "depths" and isinstance(value, list) and value:
            out["depth"] = float(sum(value)) / len(value)
    return out


def _json_block(d: Mapping[str, Any]) -> str:
    return "```\n" + dumps(dict(d), indent=2) + "\n```"


class TensorBoardTracker:
    def __init__(self, out: Path, config: Mapping[str, Any], name: str, start_step: int, resume: bool) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run hides the events the killed run logged after the checkpoint
        self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=start_step + 1 if start_step else None)
        self.writer.add_text("config", _json_block(config), global_step=start_step)
        self.step = start_step

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.step = step

    def close(self, summary: Mapping[str, Any] | None) -> None:
        if summary is not None:
            self.writer.add_text("summary", _json_block(summary), global_step=self.step)
        self.writer.close()


class WandbTracker:
    def __init__(self, out: Path, config: Mapping[str, Any], name: str, start_step: int, resume: bool) -> None:
        import wandb

        root = out / "wandb"
        root.mkdir(parents=True, exist_ok=True)
        id_file = root / "run_id"
        if resume and id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            run_id = secrets.token_hex(4)
            id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "looplm"), name=name, id=run_id,
                              dir=str(out), config=dict(config), resume="allow",
                              mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self, summary: Mapping[str, Any] | None) -> None:
        if summary is not None:
            for key, value in summary.items():
                if isinstance(value, (int, float, str)) or value is None:
                    self.run.summary[key] = value
        self.run.finish()


class TrackioTracker:
    def __init__(self, out: Path, config: Mapping[str, Any], name: str, start_step: int, resume: bool) -> None:
        import trackio

        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "looplm"), name=name,
                                config=dict(config), resume="allow")
        self.step = 0

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)
        self.step = step

    def close(self, summary: Mapping[str, Any] | None) -> None:
        if summary is not None:
            values = {f"summary/{k}": float(v) for k, v in summary.items()
                      if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
            if values:
                self.run.log(values, step=self.step)
        self.run.finish()


#: backend → its tracker, built as ``Tracker(out, config, name, start_step, resume)``, with ``log(values, step)``
#: and ``close(summary or None)``
TRACKERS: dict[str, type] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "trackio": TrackioTracker}


class Trackers:
    """The optional backends of one run (rank 0); ``jsonl`` is written by the trainer itself."""

    def __init__(self) -> None:
        self.trackers: list = []

    def open(self, names: Sequence[str], out: Path, config: Mapping[str, Any], *, name: str, start_step: int = 0,
             resume: bool = False) -> None:
        """Start the backends of ``names`` (other than ``jsonl``) for the run in ``out`` from ``start_step``
        (LoggerError: a backend's package is missing)."""
        check_loggers(names)
        try:
            for backend in filter(TRACKERS.__contains__, names):  # appended one by one: a failure closes the rest
                self.trackers.append(TRACKERS[backend](Path(out), config, name, start_step, resume))
        except BaseException:
            self.close(None)
            raise

    def log(self, record: Mapping[str, Any]) -> None:
        """Log the scalars of a ``metrics.jsonl`` record at its ``step``."""
        if self.trackers:
            values, step = scalars(record), int(record["step"])
            for t in self.trackers:
                t.log(values, step)

    def close(self, summary: Mapping[str, Any] | None = None) -> None:
        trackers, self.trackers = self.trackers, []
        for t in trackers:
            t.close(summary)

