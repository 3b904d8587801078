"""Shared fixtures: real data from ../shared/data (offline), tiny configs, a persistent test cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("LOOPLM_CACHE", str(REPO / ".cache" / "test"))
# One inductor cache per ATen kernel set: torch 2.13 reuses kernels compiled under another
# ATEN_CPU_CAPABILITY from its shared cache and then decodes wrong tokens (test_perf's compiled decode).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(
    REPO / ".cache" / "test" / f"inductor-{os.environ.get('ATEN_CPU_CAPABILITY', 'native')}"))
# Tiny test models run fastest on one thread; several threads per process oversubscribe a 2-core box.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_cfg():
    """A tiny SCSE config on Brown with a 512-entry byte-level BPE (trains in seconds)."""
    from looplm.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig, UniformDepthConfig

    return Config(
        name="tiny",
        model=ModelConfig(rule="scse", d_model=32, n_heads=2, d_ff=64, seq_len=32, dropout=0.1),
        data=DataConfig(dataset="brown", tokenizer="bpe", bpe_vocab_size=512),
        depth=UniformDepthConfig(lo=1, hi=4), optim=OptimConfig(lr=3e-3, warmup_steps=2),
        train=TrainConfig(steps=6, batch_size=4, eval_every=3, eval_batches=2, eval_depth=4, ckpt_every=2,
                          device="cpu"),
    )


@pytest.fixture(scope="session")
def tiny_data(tiny_cfg):
    from looplm.train.trainer import prepare_data

    return prepare_data(tiny_cfg, progress=False)


def pytest_sessionstart(session):
    """The suite checks values on real data: fail loudly (never skip) when the data is missing."""
    from looplm.data.paths import resolve_data_root

    root = resolve_data_root("")
    if not (root / "brown" / "brown_untagged.txt").is_file():
        pytest.exit(f"shared data not found at {root}: set LOOPLM_DATA to the folder holding brown/, "
                    "wikitext-2-raw/, gpt2-tokenizer/ and lambada/", returncode=1)



class _RunsCode:
    """Unpickles by calling ``exec``: creates the file ``marker`` (what a hostile pickle could do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


class Poison:
    """Hostile edits of a checkpoint, with its manifest updated to match (the manifest sits in the same
    folder, so it cannot help): ``train_state(ckpt, marker)`` adds an object that creates ``marker`` when
    unpickled; ``file(ckpt, relpath, marker)`` replaces a file by such a pickle."""

    @staticmethod
    def _rehash(ckpt, relpath):
        import json

        from looplm.run.checkpoint import sha256_file

        path = Path(ckpt) / relpath
        manifest = json.loads((Path(ckpt) / "manifest.json").read_text())
        manifest["files"][relpath] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
        (Path(ckpt) / "manifest.json").write_text(json.dumps(manifest))

    def train_state(self, ckpt, marker):
        import torch

        path = Path(ckpt) / "train_state.pt"
        torch.save({**torch.load(path, weights_only=True), "hostile": _RunsCode(marker)}, path)
        self._rehash(ckpt, "train_state.pt")

    def file(self, ckpt, relpath, marker):
        import pickle

        (Path(ckpt) / relpath).write_bytes(pickle.dumps(_RunsCode(marker)))
        self._rehash(ckpt, relpath)


@pytest.fixture
def poison():
    return Poison()


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A saved (untrained) tiny SCSE checkpoint with a 300-entry byte-level BPE trained on Brown text."""
    import torch

    from looplm.config import Config, DataConfig, TrainConfig, UniformDepthConfig
    from looplm.data.corpora import load_split_text
    from looplm.data.paths import resolve_data_root
    from looplm.data.tokenizer import train_bpe_tokenizer
    from looplm.model import build_model
    from looplm.run.checkpoint import save_checkpoint
    from helpers import tiny

    data = DataConfig(dataset="brown", tokenizer="bpe", bpe_vocab_size=300)
    tok = train_bpe_tokenizer(load_split_text(data, "train", resolve_data_root(""))[:60000], 300)
    cfg = Config(name="tiny-hf", model=tiny(rule="scse", vocab_size=300, seq_len=48, init_std=0.1), data=data,
                 depth=UniformDepthConfig(lo=1, hi=4), train=TrainConfig(eval_depth=3))
    torch.manual_seed(0)
    run = tmp_path_factory.mktemp("ckpt") / "run"
    save_checkpoint(run, 1, build_model(cfg.model).eval(), cfg, tokenizer_json=tok.to_str())
    return run


@pytest.fixture(scope="module")
def exported(tiny_ckpt, tmp_path_factory):
    """``looplm export`` of :func:`tiny_ckpt` (an HF folder)."""
    from looplm.cli import main

    out = tmp_path_factory.mktemp("export") / "hf"
    assert main(["export", "--checkpoint", str(tiny_ckpt), "--out", str(out)]) == 0
    return out


@pytest.fixture(autouse=True)
def _drop_closed_log_handlers():
    """Libraries (lm-eval, transformers) attach logging handlers to the sys.stderr of the moment, which
    under pytest is a capture stream closed after its test; later log records would print 'Logging
    error' tracebacks into other tests' stderr. Drop handlers whose stream is closed."""
    import logging

    for logger in (logging.getLogger(), *map(logging.getLogger, list(logging.root.manager.loggerDict))):
        for h in list(getattr(logger, "handlers", [])):
            if isinstance(h, logging.StreamHandler) and getattr(h.stream, "closed", False):
                logger.removeHandler(h)
    yield
