"""Evaluate a checkpoint on a corpus split at several loop depths (``looplm eval``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np
import torch
from tokenizers import Tokenizer

from looplm.analysis.flops import flops_per_token
from looplm.data.paths import resolve_cache_dir, resolve_data_root
from looplm.data.tokens import load_tokens
from looplm.eval.perplexity import DEFAULT_DEPTHS, evaluate_depths, markdown_table, nonfinite_depths
from looplm.run.finite import NonFiniteError, clean
from looplm.run.provenance import provenance
from looplm.run.checkpoint import TOKENIZER_FILE, CheckpointError, load_checkpoint


#: ``--dtype`` of ``looplm eval ppl``: the evaluation forward in float32, or under bf16 autocast
EVAL_DTYPES: tuple[str, ...] = ("float32", "bfloat16")


def load_tokenizer_for(ckpt: Path) -> Tokenizer:
    """The tokenizer saved with a checkpoint (``tokenizer.json``)."""
    path = ckpt / TOKENIZER_FILE
    if not path.exists():
        raise CheckpointError(f"{path}: missing; the checkpoint does not carry its tokenizer")
    return Tokenizer.from_file(str(path))


@dataclass
class OpenedCheckpoint:
    """A checkpoint loaded for evaluation; ``data``: its data config with the evaluated ``dataset``."""

    model: Any
    cfg: Any
    ckpt: Path
    data: Any
    tokenizer: Tokenizer

    def provenance(self, tokens: np.ndarray | None = None, **extra: Any) -> dict[str, Any]:
        """:func:`looplm.run.provenance.provenance` of this checkpoint (and of the evaluated ``tokens``)."""
        return provenance(self.ckpt, tokens=tokens, **extra)

    def tokens(self, split: str) -> np.ndarray:
        """The token stream of ``split`` of :attr:`data` with the checkpoint's tokenizer (cached)."""
        return load_tokens(self.data, split, self.tokenizer, resolve_data_root(self.data.data_root),
                           resolve_cache_dir(self.data.cache_dir))


def open_checkpoint(checkpoint: str | Path, *, dataset: str | None = None, device: str = "cpu") -> OpenedCheckpoint:
    """Load a checkpoint (or run folder) and its tokenizer to evaluate on ``dataset`` (default: its corpus)."""
    model, cfg, _, ckpt = load_checkpoint(checkpoint, device=device)
    data = cfg.data if dataset is None else cfg.data.replace(dataset=dataset)
    return OpenedCheckpoint(model=model, cfg=cfg, ckpt=ckpt, data=data, tokenizer=load_tokenizer_for(ckpt))


def evaluate_checkpoint(checkpoint: str | Path, *, depths: Sequence[int] = DEFAULT_DEPTHS,
                        dataset: str | None = None, split: str = "test", batch_size: int = 16,
                        max_tokens: int | None = None, stride: int | None = None, device: str = "cpu",
                        progress: bool = True, scale_clamp: bool = False,
                        dtype: Literal["float32", "bfloat16"] = "float32") -> dict[str, Any]:
    """Multi-depth perplexity of a checkpoint on ``dataset``/``split``.

    Args:
        dtype: ``float32``, or ``bfloat16``: the forward under ``torch.autocast`` (CPU or GPU), as deployed.
    """
    if dtype not in EVAL_DTYPES:
        raise ValueError(f"--dtype: got {dtype!r}; allowed: {', '.join(EVAL_DTYPES)}")
    opened = open_checkpoint(checkpoint, dataset=dataset, device=device)
    model, cfg, ckpt, data_cfg = opened.model, opened.cfg, opened.ckpt, opened.data
    if data_cfg.dataset == "task":
        raise ValueError(f"{ckpt}: trained on the synthetic task {data_cfg.task!r} (data.dataset=task), which has no "
                         "text to score: use `looplm eval tasks`, or --dataset to score it on a corpus")
    tokens = opened.tokens(split)
    dev = torch.device(device)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        res = evaluate_depths(model, tokens, depths, batch_size=batch_size, max_tokens=max_tokens, stride=stride,
                              device=dev, progress=progress, desc=f"eval {data_cfg.dataset}/{split}",
                              scale_clamp=scale_clamp)
    bad = nonfinite_depths(res)
    if bad:
        raise NonFiniteError(f"{ckpt}: the NLL on {data_cfg.dataset}/{split} is not finite at loop depth(s) "
                             f"{', '.join(map(str, bad))} ({', '.join(str(res[T]['nll']) for T in bad)}); the "
                             "model's activations overflow there, so no perplexity is reported")
    kind = cfg.model.rule if cfg.model.architecture == "shared" else f"unshared-{cfg.model.n_layers}"
    label = f"{cfg.name}: {kind} ({data_cfg.dataset} {split})"
    return clean({  # strict JSON: a PPL past float range (inf) becomes null, listed in "nonfinite"
        "checkpoint": str(ckpt), "name": cfg.name, "rule": cfg.model.rule,
        "architecture": cfg.model.architecture, "dataset": data_cfg.dataset, "split": split, "dtype": dtype,
        "params": model.num_params(), "max_tokens": max_tokens, "stride": stride, "scale_clamp": scale_clamp,
        "depths": {str(T): {**r, "flops_per_token": flops_per_token(cfg.model, T)} for T, r in res.items()},
        "markdown": markdown_table({label: res}, sorted(res)), "provenance": opened.provenance(tokens),
    })
