"""``looplm eval distill``: continuation perplexity after each prefill path, LMDR Table 5's layout
(arXiv:2610.06833 §5.5; SPEC §6, §8).

Every full window of L = ``seq_len`` tokens is cut at P = L // 2; each path (the teacher at R, stopped after
r < R recurrences, the distilled prefill) prefills x_0 … x_{P−1} into a fresh ``terminal`` cache, and the
teacher scores the continuation at R with terminal KV sharing. ``ppl_first`` scores x_P from the prefill's own
readout, ``ppl_rest`` x_{P+1} … x_L from the decoding pass, ``ppl`` both. Document-aware by default
(:func:`~looplm.eval.kvsharing.continuation_mask`). The ``full`` row is the uncached forward at R;
``prefill_ms`` the mean prefill wall time per batch.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from looplm.data.tokens import eval_windows
from looplm.distill.prefill import prefill_paths
from looplm.distill.student import Student, default_student_dir, load_student
from looplm.eval.exits import sync_device
from looplm.eval.kvsharing import continuation_mask
from looplm.run.finite import clean, md_table, write_json_markdown
from looplm.model import KVCache, LoopLM
from looplm.model.cursor import NLL, Readout

#: row labels of the Markdown table (Table 5's wording)
LABELS = {"full": "Teacher, full forward (no cache)", "teacher": "Teacher (R={R})",
          "distilled": "Distilled (student + 1 recurrence)"}


def _label(name: str, R: int) -> str:
    if name.startswith("teacher_r"):
        r = int(name[len("teacher_r"):])
        return f"{['', 'One', 'Two', 'Three', 'Four'][r] if r <= 4 else r} recurrence{'s' if r > 1 else ''} (R={r})"
    return LABELS[name].format(R=R)


@torch.no_grad()
def distill_continuation_eval(teacher: LoopLM, student: Student | None, tokens: np.ndarray, depth: int, *,
                              early_depths: Sequence[int] = (3, 2, 1), batch_size: int = 16,
                              max_tokens: int | None = None, eot_id: int | None = None,
                              device: str | torch.device = "cpu", progress: bool = True) -> dict[str, dict[str, Any]]:
    """The protocol of the module docstring on a 1-D token stream at decoding depth R = ``depth`` (``student``
    None: teacher rows only; ``eot_id`` None: every target counts). Returns ``{path: {ppl, ppl_first, ppl_rest,
    nll (nats/token), tokens, recurrences, prefill_ms, kv_bytes (per sequence), label, ...}}``.
    ValueError: depth < 1, no full window, or no scored target."""
    if depth < 1:
        raise ValueError(f"depth: the decoding depth R must be >= 1, got {depth}")
    if max_tokens is not None:
        tokens = tokens[: max_tokens + 1]
    dev = torch.device(device)
    L = teacher.cfg.seq_len
    n_full = (len(tokens) - 1) // L
    if n_full < 1:
        raise ValueError(f"eval distill: need at least one full window of {L} tokens (+1 target), got {len(tokens)}")
    paths = prefill_paths(teacher, student, depth, tuple(early_depths))
    names = ["full", *paths]
    sums = {n: {"first": 0.0, "rest": 0.0, "prefill_s": 0.0, "kv_bytes": 0} for n in names}
    n_first = n_rest = n_batches = 0
    teacher.eval()
    bar = tqdm(total=math.ceil(n_full / batch_size), desc="eval distill", disable=not progress, leave=False,
               unit="batch")
    with bar:
        for x, y, mask in eval_windows(tokens, L, batch_size):
            full = mask.all(1)
            if not bool(full.any()):
                continue
            first, rest = _score_batch(teacher, paths, x[full].to(dev), y[full].to(dev), depth, eot_id, sums)
            n_first += first
            n_rest += rest
            n_batches += 1
            bar.update(1)
    if n_first + n_rest == 0:
        raise ValueError(f"eval distill: no continuation target continues a document begun in its prompt "
                         f"(<|endoftext|> id {eot_id}); score without document boundaries (doc_aware=False)")
    res: dict[str, dict[str, Any]] = {}
    for name in names:
        s = sums[name]
        nll = (s["first"] + s["rest"]) / (n_first + n_rest)
        res[name] = {"label": _label(name, depth), "recurrences": depth if name == "full" else paths[name][0],
                     "ppl": math.exp(nll), "nll": nll,
                     "ppl_first": math.exp(s["first"] / n_first) if n_first else math.nan,
                     "ppl_rest": math.exp(s["rest"] / n_rest) if n_rest else math.nan,
                     "tokens": n_first + n_rest, "tokens_first": n_first,
                     "prefill_s": s["prefill_s"], "prefill_ms": 1000 * s["prefill_s"] / n_batches if name != "full"
                     else math.nan, "kv_bytes": s["kv_bytes"]}
    return res


def _score_batch(teacher: LoopLM, paths: dict, x: torch.Tensor, y: torch.Tensor, depth: int, eot_id: int | None,
                 sums: dict[str, dict[str, Any]]) -> tuple[int, int]:
    """Add one batch x, y (B, L) to ``sums`` per path; returns the numbers of first and rest targets scored."""
    B, P, dev = x.shape[0], x.shape[1] // 2, x.device
    rest = continuation_mask(x, P, eot_id)  # (B, L − P): targets y_P … y_{L−1}
    first = (torch.ones(B, dtype=torch.bool, device=dev) if eot_id is None
             else x[:, P - 1] != eot_id)  # (B,): target y_{P−1} = x_P
    out = teacher(x, depth, y, readout=NLL)
    nll = out.nll_by_depth[depth].double()  # (B, L)
    sums["full"]["first"] += float((nll[:, P - 1] * first).sum())
    sums["full"]["rest"] += float((nll[:, P:] * rest).sum())
    last = (torch.arange(B, device=dev), torch.full((B,), P - 1, device=dev))
    for name, (_, prefill) in paths.items():
        cache = KVCache("terminal")
        sync_device(dev)
        t0 = time.perf_counter()
        pre = prefill(x[:, :P], cache, targets=y[:, P - 1], readout=Readout(logits=False, tokens=last))
        sync_device(dev)
        sums[name]["prefill_s"] += time.perf_counter() - t0
        sums[name]["kv_bytes"] = cache.nbytes() // B
        (first_nll,) = pre.nll_by_depth.values()  # (B,), the prefill's only readout
        sums[name]["first"] += float((first_nll.double() * first).sum())
        cont = teacher.read(teacher.loop(x[:, P:], cache=cache), depth, y[:, P:], readout=NLL)
        sums[name]["rest"] += float((cont.nll_by_depth[depth].double() * rest).sum())
    return int(first.sum()), int(rest.sum())


def markdown_table(res: dict[str, dict[str, Any]], title: str) -> str:
    """One Markdown row per prefill path (Table 5 order)."""
    ref = res["teacher"]["ppl"]
    rows = [[r["label"], str(r["recurrences"]), f"{r['ppl']:.2f}", f"{100 * (r['ppl'] / ref - 1):+.2f}%",
             f"{r['ppl_first']:.2f}", f"{r['ppl_rest']:.2f}",
             "–" if not math.isfinite(r["prefill_ms"]) else f"{r['prefill_ms']:.1f}",
             f"{r['kv_bytes']:,}" if r["kv_bytes"] else "–"] for r in res.values()]
    return "\n".join([f"**{title}**", "", *md_table(["prefill path", "recurrences in prefill", "PPL", "Δ vs teacher",
                                                    "PPL first token", "PPL rest", "prefill (ms/batch)",
                                                    "KV bytes / seq"], rows, align="l" + "r" * 7)])


def evaluate_distill_checkpoint(checkpoint: str | Path, out_json: str | Path | None = None, *,
                                student: str | Path | None = None, early_depths: Sequence[int] = (3, 2, 1),
                                dataset: str | None = None, split: str = "test", max_tokens: int | None = None,
                                batch_size: int = 16, device: str = "cpu", progress: bool = True,
                                doc_aware: bool = True, teacher_only: bool = False) -> dict[str, Any]:
    """Continuation PPL after each prefill path (module docstring) for a teacher and its student.

    Args:
        checkpoint: the teacher's run folder or checkpoint.
        student: the student's run folder or checkpoint (default: ``student/`` next to the teacher's run).
        early_depths: early-stopped prefill depths r < R of the teacher rows.
        teacher_only: leave the distilled row out (no student needed).
        doc_aware: score only targets that continue the document begun in the prompt (LMDR).

    R is the student's (``teacher_only``: the teacher's nominal depth). Returns the JSON-ready results (also to
    ``out_json`` and ``.md``).

    Raises:
        CheckpointError: a damaged teacher or student. StudentMismatchError: a student of another teacher.
        FileNotFoundError: a missing data split. ValueError: see :func:`distill_continuation_eval`.
    """
    from looplm.data.tokenizer import eot_id
    from looplm.eval.runner import open_checkpoint

    opened = open_checkpoint(checkpoint, dataset=dataset, device=device)
    teacher, cfg, ckpt, data_cfg, tok = opened.model, opened.cfg, opened.ckpt, opened.data, opened.tokenizer
    stu, stu_dir, depth = None, None, cfg.depth.nominal_depth()
    if not teacher_only:
        stu, record, stu_dir = load_student(student or default_student_dir(checkpoint), teacher)
        depth = record.distill.depth
    tokens = opened.tokens(split)
    res = distill_continuation_eval(teacher, stu, tokens, depth, early_depths=early_depths, batch_size=batch_size,
                                    max_tokens=max_tokens, eot_id=eot_id(tok) if doc_aware else None,
                                    device=device, progress=progress)
    title = (f"{cfg.name}: prefill paths, then the teacher decodes at R={depth} with terminal KV sharing "
             f"({data_cfg.dataset} {split}, {cfg.model.seq_len // 2}-token prompts"
             + (", tokens continuing the prompt's document)" if doc_aware else ", every continuation token)"))
    result = clean({"checkpoint": str(ckpt), "student": None if stu_dir is None else str(stu_dir), "depth": depth,
                    "name": cfg.name, "rule": cfg.model.rule, "dataset": data_cfg.dataset, "split": split,
                    "seq_len": cfg.model.seq_len, "prefix_tokens": cfg.model.seq_len // 2, "batch_size": batch_size,
                    "max_tokens": max_tokens, "doc_aware": doc_aware, "paths": res,
                    "markdown": markdown_table(res, title), "provenance": opened.provenance(tokens)})
    if out_json is not None:
        write_json_markdown(result, out_json)
    return result
