"""Token streams: one cached 1-D memmap per (dataset, split, tokenizer), and the batches cut from it.

Cache (nanoGPT style): ``<cache_dir>/tokens/<dataset>-<split>-<key16>.bin``, raw uint16 or uint32, key16 =
sha256(source fingerprint, tokenizer fingerprint, format version)[:16]: a changed source gives a new file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from looplm.config import DataConfig
from looplm.data.corpora import load_split_documents, source_fingerprint
from looplm.data.paths import atomic_write
from looplm.data.tokenizer import eot_id, text_chunks, tokenizer_fingerprint

TOKENS_FORMAT_VERSION = 1  # bump when the stream layout (EOT placement, chunking) changes
_BATCH_CHARS = 1 << 22  # characters handed to one encode_batch call
_PROGRESS_CHARS = 1 << 20  # show a progress bar above this many characters


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (``vocab_size`` ≤ 65,535), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


def tokens_cache_path(cfg: DataConfig, split: str, tok: Tokenizer, data_root: Path, cache_dir: Path) -> Path:
    """Path of the cached token stream of ``split`` (see the module docstring for the key)."""
    src = source_fingerprint(cfg, split, data_root)
    key = hashlib.sha256(f"{src}|{tokenizer_fingerprint(tok)}|v{TOKENS_FORMAT_VERSION}".encode())
    return Path(cache_dir) / "tokens" / f"{cfg.dataset}-{split}-{key.hexdigest()[:16]}.bin"


def encode_documents(docs: list[str], tok: Tokenizer, *, desc: str = "tokenizing",
                     progress: bool = True) -> Iterator[np.ndarray]:
    """The token ids of ``docs`` with ``<|endoftext|>`` between them, encoded in :func:`text_chunks` pieces
    (same ids), ~4M chars per ``encode_batch`` call; a bar above 1M chars."""
    dtype = token_dtype(tok.get_vocab_size())
    eot = np.array([eot_id(tok)], dtype=dtype)
    total = sum(len(d) for d in docs)
    bar = tqdm(total=total, unit="char", unit_scale=True, desc=desc, disable=not progress or total <= _PROGRESS_CHARS)
    group: list[str] = []  # chunks of possibly many documents, encoded in one parallel call
    eot_after: list[bool] = []  # chunk i ends a document that is followed by another one
    group_chars = 0
    for i, doc in enumerate(docs):
        chunks = list(text_chunks(doc)) or [""]  # an empty document still gets its separator
        for k, chunk in enumerate(chunks):
            group.append(chunk)
            eot_after.append(k == len(chunks) - 1 and i < len(docs) - 1)
            group_chars += len(chunk)
            if group_chars < _BATCH_CHARS and (i, k) != (len(docs) - 1, len(chunks) - 1):
                continue
            for enc, sep in zip(tok.encode_batch(group, add_special_tokens=False), eot_after):
                yield np.asarray(enc.ids, dtype=dtype)
                if sep:
                    yield eot
            bar.update(group_chars)
            group, eot_after, group_chars = [], [], 0
    bar.close()


def load_tokens(cfg: DataConfig, split: str, tok: Tokenizer, data_root: Path, cache_dir: Path, *,
                progress: bool = True) -> np.ndarray:
    """The token stream of ``split`` as a read-only 1-D memmap, built and cached on first use."""
    path = tokens_cache_path(cfg, split, tok, data_root, cache_dir)
    dtype = token_dtype(tok.get_vocab_size())
    if not path.is_file():
        docs = load_split_documents(cfg, split, data_root)
        with atomic_write(path) as f:
            for ids in encode_documents(docs, tok, desc=f"tokenizing {cfg.dataset}/{split}", progress=progress):
                f.write(ids.tobytes())
    if path.stat().st_size == 0:  # np.memmap refuses empty files
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def batch_seed(seed: int, step: int, micro: int = 0) -> int:
    """A 63-bit generator seed that is a pure function of (seed, step, micro)."""
    h = hashlib.blake2b(f"looplm-batch|{seed}|{step}|{micro}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def sample_batch(tokens: np.ndarray, batch_size: int, seq_len: int, *, seed: int, step: int,
                 micro: int = 0, stride: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random training windows x, y (B, L) int64 at offsets uniform over the multiples of ``stride`` in
    [0, len − L − 1], seeded by :func:`batch_seed` (the same on resume and on every rank)."""
    n = len(tokens)
    if n < seq_len + 1:
        raise ValueError(f"token stream has {n} tokens; a window needs seq_len + 1 = {seq_len + 1}")
    if stride < 1:
        raise ValueError(f"stride: need >= 1, got {stride}")
    g = torch.Generator().manual_seed(batch_seed(seed, step, micro))
    offsets = torch.randint(0, (n - seq_len - 1) // stride + 1, (batch_size,), generator=g).numpy() * stride
    idx = offsets[:, None] + np.arange(seq_len + 1)  # (B, L+1)
    w = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def _eval_plan(n: int, seq_len: int, stride: int | None) -> np.ndarray:
    """(start, lo, hi) per window: inputs ``tokens[start : start + L]``, scored positions [lo, hi)."""
    n_targets = n - 1
    if n_targets <= 0:
        return np.zeros((0, 3), dtype=np.int64)
    if stride is None:
        starts = np.arange(0, n_targets, seq_len)
        his = np.minimum(seq_len, n_targets - starts)
        return np.stack([starts, np.zeros_like(starts), his], axis=1)
    plan = [(0, 0, min(seq_len, n_targets))]
    end = plan[0][2]  # targets 1..end are scored
    while end < n_targets:
        new_end = min(end + stride, n_targets)
        plan.append((new_end - seq_len, seq_len - (new_end - end), seq_len))
        end = new_end
    return np.asarray(plan, dtype=np.int64)


def eval_windows(tokens: np.ndarray, seq_len: int, batch_size: int, *, stride: int | None = None,
                 max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Batches (x, y, mask), each (B, L), that score every target ``tokens[1:]`` exactly once: non-overlapping
    windows (the last may be partial, padded with 0), or sliding full windows scoring only their last ``stride``
    new targets. ValueError: ``stride`` outside [1, seq_len]."""
    if stride is not None and not 1 <= stride <= seq_len:
        raise ValueError(f"stride must be in [1, seq_len={seq_len}], got {stride}")
    n = len(tokens)
    plan = _eval_plan(n, seq_len, stride)
    pos = np.arange(seq_len + 1)
    for b, i in enumerate(range(0, len(plan), batch_size)):
        if max_batches is not None and b >= max_batches:
            return
        start, lo, hi = (plan[i:i + batch_size, k] for k in range(3))
        idx = start[:, None] + pos  # (B, L+1)
        w = np.where(idx < n, np.asarray(tokens[np.minimum(idx, n - 1)], dtype=np.int64), 0)
        j = pos[None, :-1]
        mask = (j >= lo[:, None]) & (j < hi[:, None])  # (B, L)
        w = torch.from_numpy(w)
        yield w[:, :-1].contiguous(), w[:, 1:].contiguous(), torch.from_numpy(mask)


def unigram_ppl(train_tokens: np.ndarray, test_tokens: np.ndarray, vocab_size: int) -> float:
    """PPL on ``test_tokens[1:]`` of the add-one-smoothed unigram model of ``train_tokens`` (a floor)."""
    counts = np.bincount(np.asarray(train_tokens), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    targets = np.asarray(test_tokens[1:], dtype=np.int64)
    if len(targets) == 0:
        raise ValueError("test_tokens needs at least 2 tokens (one target)")
    return float(np.exp(-logp[targets].mean()))
