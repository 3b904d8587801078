"""LAMBADA last-word completion at several loop depths (SPEC §6; SCSE, arXiv:2607.27656, Table 16).

Data: ``<data_root>/lambada/lambada_test.jsonl`` (OpenAI's detokenized test set, 5,153 passages). Split (our
choice): the target is the last whitespace-separated word with its leading space (as GPT-2's pre-tokenizer
attaches it; after a newline, 7 passages, the newline stays in the context); its GPT-2 tokens are the word's
tokens in the passage (checked on all 5,153). Context and target are tokenized separately, the context
left-truncated to fit ``seq_len + 1``. Per depth: ``target_ppl``, ``target_acc`` (greedy-correct target tokens)
and ``exact_acc`` (examples with every target token correct).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from looplm.data.paths import resolve_data_root
from looplm.model import LoopLM, eval_mode
from looplm.model.cursor import Readout
from looplm.run.finite import md_table

LAMBADA_FILE = "lambada/lambada_test.jsonl"
DEFAULT_DEPTHS: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 48)


@dataclass(frozen=True)
class LambadaExample:
    """One passage split into ``context`` and ``target`` (``context + target`` = the passage)."""

    context: str
    target: str


@dataclass(frozen=True)
class EncodedExample:
    """``ids`` = (left-truncated) context + target tokens, the last ``n_target`` the target."""

    ids: tuple[int, ...]
    n_target: int
    truncated: bool


def split_passage(text: str) -> LambadaExample:
    """Split a passage into context and last-word target (module docstring); ValueError for < 2 words."""
    text = text.rstrip()
    i = len(text) - len(text.split()[-1]) if text else 0  # the last word starts at i
    if i == 0 or not text[:i].strip():
        raise ValueError(f"LAMBADA passage needs a context and a last word, got {text!r}")
    if text[i - 1] == " ":
        i -= 1
    return LambadaExample(context=text[:i], target=text[i:])


def lambada_path(data_root: str | Path) -> Path:
    """``<data_root>/lambada/lambada_test.jsonl``."""
    return Path(data_root).expanduser() / LAMBADA_FILE


def load_lambada(path: str | Path, max_examples: int | None = None) -> list[LambadaExample]:
    """Parse the OpenAI LAMBADA jsonl (``{"text": passage}`` per line); FileNotFoundError, ValueError (line)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"LAMBADA not found: {path}. Put OpenAI's lambada_test.jsonl (detokenized, one "
            f'{{"text": ...}} per line) there, or set LOOPLM_DATA / data_root to a directory with '
            f"{LAMBADA_FILE}.")
    out: list[LambadaExample] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if max_examples is not None and len(out) >= max_examples:
                break
            if not line.strip():
                continue
            try:
                out.append(split_passage(json.loads(line)["text"]))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{n}: not a LAMBADA line ({type(exc).__name__}: {exc})") from None
    return out


def encode_examples(examples: Sequence[LambadaExample], tok: Tokenizer, seq_len: int) -> list[EncodedExample]:
    """Tokenize context and target separately; keep the last ``seq_len + 1`` ids (ValueError: target too long)."""
    ctx = tok.encode_batch([e.context for e in examples], add_special_tokens=False)
    tgt = tok.encode_batch([e.target for e in examples], add_special_tokens=False)
    out = []
    for ex, c, t in zip(examples, ctx, tgt):
        if not 1 <= len(t.ids) <= seq_len:
            raise ValueError(f"target {ex.target!r} has {len(t.ids)} tokens; need 1 … seq_len={seq_len}")
        keep = seq_len + 1 - len(t.ids)
        if not c.ids:
            raise ValueError(f"context of target {ex.target!r} has no tokens")
        out.append(EncodedExample(ids=tuple(c.ids[-keep:]) + tuple(t.ids), n_target=len(t.ids),
                                  truncated=len(c.ids) > keep))
    return out


def right_pad(seqs: Sequence[Sequence[int]], n_targets: Sequence[int], device: torch.device | str):
    """Right-padded inputs x (B, Lmax) of token sequences, and (N,) rows, columns and targets: the positions that
    predict each sequence's last ``n_targets[b]`` tokens, with those tokens."""
    width = max(len(s) for s in seqs) - 1
    x = torch.zeros(len(seqs), width, dtype=torch.int64)
    for b, s in enumerate(seqs):
        x[b, : len(s) - 1] = torch.tensor(s[:-1])
    pos = [(b, j, s[j + 1]) for b, (s, n) in enumerate(zip(seqs, n_targets))
           for j in range(len(s) - 1 - n, len(s) - 1)]  # position j predicts s[j + 1]
    rows, cols, tgt = (torch.tensor([p[i] for p in pos], dtype=torch.int64, device=device) for i in range(3))
    return x.to(device), rows, cols, tgt


@torch.no_grad()
def score_lambada(model: LoopLM, examples: Sequence[EncodedExample], depths: Sequence[int] = DEFAULT_DEPTHS, *,
                  batch_size: int = 32, device: str | torch.device = "cpu",
                  progress: bool = True) -> dict[int, dict[str, float]]:
    """``{T: {target_ppl, target_acc, exact_acc, nll, examples, target_tokens}}``, one unroll per batch in
    length order, only the target positions read out. ValueError: no depths, one < 0, or no examples."""
    depths = sorted({int(t) for t in depths})
    if not depths or depths[0] < 0:
        raise ValueError(f"depths: need one or more loop depths >= 0, got {depths!r}")
    if not examples:
        raise ValueError("score_lambada: no examples")
    device = torch.device(device)
    with eval_mode(model):
        nll, correct, exact = dict.fromkeys(depths, 0.0), dict.fromkeys(depths, 0), dict.fromkeys(depths, 0)
        order = sorted(range(len(examples)), key=lambda i: len(examples[i].ids))
        for i in tqdm(range(0, len(order), batch_size), desc="lambada", disable=not progress, leave=False,
                      unit="batch"):
            chunk = [examples[k] for k in order[i:i + batch_size]]
            x, rows, cols, tgt = right_pad([e.ids for e in chunk], [e.n_target for e in chunk], device)
            out = model(x, depths, readout=Readout(tokens=(rows, cols)))  # logits (N, V) per depth
            for T in depths:
                logits = out.logits_by_depth[T].float()
                nll[T] += float(F.cross_entropy(logits, tgt, reduction="sum").double())
                hit = logits.argmax(dim=-1) == tgt  # (N,)
                misses = torch.zeros(len(chunk), device=device).index_add_(0, rows, (~hit).float())  # (B,)
                correct[T] += int(hit.sum())
                exact[T] += int((misses == 0).sum())
    n_tok = sum(e.n_target for e in examples)
    return {T: {"target_ppl": math.exp(nll[T] / n_tok), "target_acc": correct[T] / n_tok,
                "exact_acc": exact[T] / len(examples), "nll": nll[T] / n_tok, "examples": len(examples),
                "target_tokens": n_tok} for T in depths}


def markdown_table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown in the paper's Table 16 layout (T=8, else the smallest, and the deepest depth), and every depth."""
    def cells(T: str, m: dict[str, float]) -> list[str]:
        return [f"T={T}", f"{m['target_ppl'] / 1e3:.2f}", f"{100 * m['target_acc']:.2f}"]

    rows = []
    for label, res in results.items():
        ds = sorted(res["depths"], key=int)
        first = "8" if "8" in res["depths"] else ds[0]
        rows.append([label, *cells(first, res["depths"][first]),
                     *(cells(ds[-1], res["depths"][ds[-1]]) if ds[-1] != first else ["–"] * 3)])
    cols = ["depth", "completion PPL (10³)", "target-token acc. (%)"]
    out = ["\n".join(md_table(["model", *cols, *cols], rows, align="l" + "r" * 6))]
    for label, res in results.items():
        rows = [[str(T), f"{m['target_ppl']:.1f}", f"{100 * m['target_acc']:.2f}", f"{100 * m['exact_acc']:.2f}"]
                for T, m in sorted(res["depths"].items(), key=lambda item: int(item[0]))]
        out.append("\n".join([f"{label}: {res['examples']} passages, {res['target_tokens']} target tokens, "
                              f"{res['truncated']} contexts left-truncated to seq_len.", "",
                              *md_table(["T", "target PPL", "target acc (%)", "exact acc (%)"], rows, align="rrrr")]))
    return "\n\n".join(out)


def evaluate_lambada_checkpoint(checkpoint: str | Path, *, depths: Sequence[int] = DEFAULT_DEPTHS,
                                max_examples: int | None = None, batch_size: int = 32,
                                data_root: str | Path | None = None, device: str = "cpu",
                                progress: bool = True) -> dict[str, Any]:
    """LAMBADA completion of a checkpoint at several loop depths (SCSE Table 16); ``data_root`` None: the
    checkpoint's; ``max_examples``: the first N passages."""
    from looplm.eval.runner import open_checkpoint

    opened = open_checkpoint(checkpoint, device=device)
    model, cfg, ckpt = opened.model, opened.cfg, opened.ckpt
    path = lambada_path(resolve_data_root(cfg.data.data_root) if data_root is None else data_root)
    examples = load_lambada(path, max_examples)
    encoded = encode_examples(examples, opened.tokenizer, cfg.model.seq_len)
    res = score_lambada(model, encoded, depths, batch_size=batch_size, device=device, progress=progress)
    out = {"checkpoint": str(ckpt), "name": cfg.name, "rule": cfg.model.rule,
           "architecture": cfg.model.architecture, "params": model.num_params(), "dataset": "lambada",
           "file": str(path), "seq_len": cfg.model.seq_len, "examples": len(encoded),
           "target_tokens": sum(e.n_target for e in encoded),
           "truncated": sum(e.truncated for e in encoded),
           "depths": {str(T): r for T, r in res.items()}, "provenance": opened.provenance(data_files=[path])}
    out["markdown"] = markdown_table({f"{cfg.name} (LAMBADA)": out})
    return out
