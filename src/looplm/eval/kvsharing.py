"""Terminal KV sharing (LMDR, arXiv:2610.06833 §3.2, Table 2; SPEC §6): each prefix token keeps only its
last-recurrence K/V per physical layer, which every recurrence of later tokens attends to.

Continuation protocol: each full window of L tokens is cut at P = L // 2 and positions P … L−1 are scored
(1) *full*: one uncached forward at depth R; (2) *terminal*: after prefilling 0 … P−1 into a ``terminal``
:class:`KVCache`; (3) *per_visit* (control, = full to rounding). Document-aware scoring (LMDR Table 8 caption;
our reading): target x_{j+1} counts only if no ``<|endoftext|>`` occurs in x_{P−1} … x_j. Sharing penalty
``100 · (PPL_terminal / PPL_full − 1)`` (%); memory: the prefix's K/V bytes per sequence.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from looplm.data.tokens import eval_windows
from looplm.run.finite import md_table
from looplm.model import LoopLM, eval_mode
from looplm.model.kvcache import KVCache
from looplm.model.cursor import Readout


def continuation_mask(x: torch.Tensor, P: int, eot_id: int | None) -> torch.Tensor:
    """(B, L) windows → (B, L − P) bool: column j − P (target x_{j+1}) is scored iff no ``eot_id`` is in
    x_{P−1} … x_j (all True without ``eot_id``)."""
    B, L = x.shape
    if eot_id is None:
        return torch.ones(B, L - P, dtype=torch.bool, device=x.device)
    ends = (x[:, P - 1:] == eot_id).long().cumsum(1)  # (B, L − P + 1): EOTs in x_{P−1} … x_{P−1+k}
    return ends[:, 1:] == 0  # column k ↔ j = P + k: EOTs in x_{P−1} … x_j


def _continuation_nll(model: LoopLM, x: torch.Tensor, y: torch.Tensor, depth: int, P: int, mode: str,
                      final_depth: int, scored: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Prefill x[:, :P] into a ``mode`` cache, score x[:, P:] in one pass: (NLL sum over the ``scored``
    targets, prefix cache bytes, prefix cache banks)."""
    cache = KVCache(mode)
    read = Readout(logits=False, final_depth=final_depth)
    model.read(model.loop(x[:, :P], cache=cache), depth, readout=read)
    nbytes, banks = cache.nbytes(), cache.n_banks()
    out = model.read(model.loop(x[:, P:], cache=cache), depth, y[:, P:], readout=read)
    nll = out.nll_by_depth[depth].double()
    return (nll * scored).sum(), nbytes, banks


@torch.no_grad()
def kv_sharing_eval(model: LoopLM, tokens: np.ndarray, depths: Sequence[int], *, batch_size: int = 16,
                    max_tokens: int | None = None, device: str | torch.device = "cpu",
                    progress: bool = True, eot_id: int | None = None) -> dict[int, dict[str, float]]:
    """The continuation protocol on ``tokens[: max_tokens + 1]`` at each depth R ≥ 1 (``eot_id``: document-aware);
    ``{R: {ppl_full, ppl_terminal, ..., kv_bytes_full, kv_bytes_terminal, kv_ratio}}``, nll in nats per token.

    ValueError: an unshared model, no depths or one < 1, no full window, or no scored target.
    """
    depths = sorted({int(R) for R in depths})
    if not depths or depths[0] < 1:
        raise ValueError(f"depths: need loop depths >= 1, got {list(depths)}")
    if not model.shared:
        raise ValueError("kv sharing: needs the shared (looped) architecture; an unshared model has no KV cache")
    if max_tokens is not None:
        tokens = tokens[: max_tokens + 1]
    L = model.cfg.seq_len
    P = L // 2
    n_full = (len(tokens) - 1) // L
    if n_full < 1:
        raise ValueError(f"kv sharing: need at least one full window of {L} tokens (+1 target), "
                         f"got {len(tokens)} tokens")
    # one final_only_norm threshold for the full forward and every continuation (see LoopLM.forward)
    final_depth = model.resolve_final_depth(None, depths[-1])
    sums = {R: {"full": 0.0, "terminal": 0.0, "per_visit": 0.0} for R in depths}
    mem: dict[int, dict[str, int]] = {}
    count = n_seq = 0
    n_batches = math.ceil(n_full / batch_size)  # each holds a full window
    with eval_mode(model):
        for x, y, mask in tqdm(eval_windows(tokens, L, batch_size, max_batches=n_batches), total=n_batches,
                               desc="kv sharing", disable=not progress, leave=False, unit="batch"):
            full = mask.all(1)  # only full windows: both halves have real tokens
            x, y = x[full].to(device), y[full].to(device)
            scored = continuation_mask(x, P, eot_id)  # (B, L − P)
            out = model(x, depths, y, readout=Readout(logits=False, final_depth=final_depth))
            for R in depths:
                sums[R]["full"] += float((out.nll_by_depth[R][:, P:].double() * scored).sum())
                for mode in ("terminal", "per_visit"):
                    nll, nbytes, banks = _continuation_nll(model, x, y, R, P, mode, final_depth, scored)
                    sums[R][mode] += float(nll)
                    mem.setdefault(R, {})[mode] = (nbytes // x.shape[0], banks)
            count += int(scored.sum())
            n_seq += x.shape[0]
    if count == 0:
        raise ValueError(f"kv sharing: no second-half target continues a document begun in its prompt "
                         f"(<|endoftext|> id {eot_id}); score without document boundaries (doc_aware=False)")
    out = {}
    for R in depths:
        nll = {k: v / count for k, v in sums[R].items()}
        ppl = {k: math.exp(v) for k, v in nll.items()}
        (full_b, full_n), (term_b, term_n) = mem[R]["per_visit"], mem[R]["terminal"]
        out[R] = {"ppl_full": ppl["full"], "ppl_terminal": ppl["terminal"], "ppl_per_visit": ppl["per_visit"],
                  "sharing_penalty_pct": 100.0 * (ppl["terminal"] / ppl["full"] - 1.0),
                  "nll_full": nll["full"], "nll_terminal": nll["terminal"], "tokens": count, "sequences": n_seq,
                  "prefix_tokens": P, "kv_bytes_full": full_b, "kv_bytes_terminal": term_b,
                  "kv_banks_full": full_n, "kv_banks_terminal": term_n, "kv_ratio": full_b / term_b}
    return out


def markdown_table(res: dict[int, dict[str, float]], label: str = "model") -> str:
    """One row per depth: PPL full / terminal, sharing penalty, KV bytes per sequence and banks."""
    rows = [[str(R), f"{r['ppl_full']:.3f}", f"{r['ppl_terminal']:.3f}", f"{r['sharing_penalty_pct']:+.2f}",
             f"{r['kv_bytes_full']:,}", f"{r['kv_bytes_terminal']:,}",
             f"{r['kv_banks_full']} / {r['kv_banks_terminal']}"] for R, r in sorted(res.items())]
    return "\n".join([f"**{label}**", "", *md_table(["R", "PPL full", "PPL terminal", "sharing penalty (%)",
                                                    "KV bytes per_visit", "KV bytes terminal",
                                                    "banks per_visit / terminal"], rows, align="r" * 7)])


def evaluate_kv_sharing_checkpoint(ckpt_dir: str | Path, depths: Sequence[int], *, split: str = "test",
                                   max_tokens: int | None = None, batch_size: int = 16, dataset: str | None = None,
                                   device: str = "cpu", progress: bool = True, doc_aware: bool = True
                                   ) -> dict[str, Any]:
    """Terminal KV sharing of a checkpoint on ``dataset``/``split`` (module docstring).

    Args:
        doc_aware: score only targets continuing the prompt's document (LMDR's protocol); else all
    """
    from looplm.data.tokenizer import eot_id
    from looplm.eval.runner import open_checkpoint

    opened = open_checkpoint(ckpt_dir, dataset=dataset, device=device)
    model, cfg, ckpt, data_cfg, tok = opened.model, opened.cfg, opened.ckpt, opened.data, opened.tokenizer
    tokens = opened.tokens(split)
    res = kv_sharing_eval(model, tokens, depths, batch_size=batch_size, max_tokens=max_tokens,
                          device=torch.device(device), progress=progress, eot_id=eot_id(tok) if doc_aware else None)
    label = (f"{cfg.name}: {cfg.model.rule} ({data_cfg.dataset} {split}), terminal KV sharing"
             + (", tokens continuing the prompt's document" if doc_aware else ", every second-half token"))
    return {"checkpoint": str(ckpt), "name": cfg.name, "rule": cfg.model.rule, "dataset": data_cfg.dataset,
            "split": split, "seq_len": cfg.model.seq_len, "prefix_tokens": cfg.model.seq_len // 2,
            "max_tokens": max_tokens, "doc_aware": doc_aware, "params": model.num_params(),
            "depths": {str(R): r for R, r in res.items()}, "markdown": markdown_table(res, label),
            "provenance": opened.provenance(tokens)}
