"""Gradient cosines of the truncated estimators against full BPTT (LMDR, arXiv:2610.06833, §3.1, §5.4, A.2).

At depth R and each b (dropout off): ``tbptt``-b (autograd through the last b recurrences) and ``endpoint``-b
(Neumann-b: from sg(z^R), CE read at R + b; = Σ_{k<b} J_R^k B_R at a fixed point), per parameter group
(:data:`GROUPS`) and overall: the cosine with full BPTT, the norm ratio, the CEs and the endpoint residual
‖h_{R+1} − h_R‖/‖h_R‖. (The paper's 0.997–0.999 compare reuse with recompute of one estimator, not this.)
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from tqdm.auto import tqdm

from looplm.diagnostics.forcing import DTYPES, check_shared
from looplm.model.cursor import NLL, Gradient, Readout
from looplm.run.finite import md_table

GROUPS: tuple[str, ...] = ("embeddings/readout", "prelude", "core", "rule", "coda", "other")
ESTIMATORS: tuple[str, ...] = ("tbptt", "endpoint")
_GROUP_OF = {**dict.fromkeys(("tok_emb", "pos_emb", "in_norm", "norm_f", "lm_head"), "embeddings/readout"),
             "prelude": "prelude", "coda": "coda", "rule": "rule",
             **dict.fromkeys(("core", "loop_norm", "damping_raw"), "core")}  # scale control counts as core


def parameter_group(name: str) -> str:
    """The :data:`GROUPS` entry of a parameter name."""
    return _GROUP_OF.get(name.split(".", 1)[0], "other")


def _grads(model, x, y, depth: int, gradient: Gradient) -> tuple[dict[str, torch.Tensor], float]:
    """{group: flat gradient} of the mean terminal CE, and the CE (float)."""
    model.zero_grad(set_to_none=True)
    out = model(x, depth, y, gradient=gradient, readout=NLL)
    out.loss.backward()
    flat: dict[str, list[torch.Tensor]] = {g: [] for g in GROUPS}
    for name, p in model.named_parameters():  # a tied parameter once, under its first name
        if p.requires_grad:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            flat[parameter_group(name)].append(grad.detach().flatten())
    res = {g: torch.cat(v) for g, v in flat.items() if v}
    res["overall"] = torch.cat([res[g] for g in GROUPS if g in res])
    return res, float(out.loss.detach())


def _cos(a: torch.Tensor, b: torch.Tensor) -> float | None:
    a, b = a.double(), b.double()  # float32 dot products of long vectors drift by ~1e-5
    na, nb = a.norm(), b.norm()
    if float(na) == 0.0 or float(nb) == 0.0:
        return None  # undefined: a group with no gradient
    return float(torch.dot(a, b) / (na * nb))


def _ratio(a: torch.Tensor, b: torch.Tensor) -> float | None:
    nb = float(b.double().norm())
    return None if nb == 0.0 else float(a.double().norm()) / nb


def gradient_cosines(model, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *, depth: int,
                     steps: Sequence[int] = (1, 2, 4, 8), estimators: Sequence[str] = ESTIMATORS,
                     dtype: str = "float32", progress: bool = False) -> dict[str, Any]:
    """Module docstring, on (x, y) batches ((B, L) each) with a copy of ``model`` in ``dtype``: ``rows`` of
    ``{"estimator", "b", "ce", "<group>": {"cos", "cos_batch_mean", "cos_batch_min", "norm_ratio"}}``.
    ValueError: an unshared model, depth < 1, a b < 1, an unknown estimator or dtype, or no batches."""
    check_shared(model, "gradient cosines")
    if depth < 1:
        raise ValueError(f"depth: need R >= 1, got {depth}")
    if not steps or min(steps) < 1:
        raise ValueError(f"steps: need b >= 1, got {list(steps)}")
    for e in estimators:
        if e not in ESTIMATORS:
            raise ValueError(f"estimators: got {e!r}; allowed: {', '.join(ESTIMATORS)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: got {dtype!r}; allowed: {', '.join(DTYPES)}")
    m = copy.deepcopy(model).to(DTYPES[dtype]).eval()
    keys = [(e, b) for b in steps for e in estimators]
    sums: dict[Any, dict[str, torch.Tensor]] = {}  # per (estimator, b): {group: batch-summed gradient}
    ces: dict[Any, list[float]] = {k: [] for k in [("bptt", 0), *keys]}
    per_batch: dict[Any, list[dict[str, float | None]]] = {k: [] for k in keys}
    residuals: list[torch.Tensor] = []
    batches = list(batches)
    n = len(batches)
    for x, y in tqdm(batches, desc="gradient cosines", unit="batch", disable=not progress):
        with torch.no_grad():
            hs = m(x, depth + 1, readout=Readout(logits=False, states=True)).states
            r = (hs[depth + 1] - hs[depth]).double().norm(dim=-1) / hs[depth].double().norm(dim=-1).clamp(min=1e-30)
            residuals.append(r[y != -100].flatten())
        for key in [("bptt", 0), *keys]:  # full BPTT first: the reference of the others
            g, ce = _grads(m, x, y, depth, Gradient(*key))
            ces[key].append(ce)
            sums[key] = g if key not in sums else {k: sums[key][k] + v for k, v in g.items()}
            if key in per_batch:
                per_batch[key].append({grp: _cos(g[grp], full[grp]) for grp in full})
            else:
                full = g
    if not n:
        raise ValueError("batches: no batches to measure")
    ref = sums[("bptt", 0)]
    groups = [g for g in GROUPS if g in ref]
    rows = []
    for key in keys:
        row: dict[str, Any] = {"estimator": key[0], "b": key[1], "ce": sum(ces[key]) / n}
        for grp in ["overall", *groups]:
            vals = [c[grp] for c in per_batch[key] if c[grp] is not None]
            row[grp] = {"cos": _cos(sums[key][grp], ref[grp]),
                        "cos_batch_mean": sum(vals) / len(vals) if vals else None,
                        "cos_batch_min": min(vals) if vals else None,
                        "norm_ratio": _ratio(sums[key][grp], ref[grp])}
        rows.append(row)
    res_all = torch.cat(residuals) if residuals else torch.zeros(0)
    result = {"depth": depth, "steps": list(steps), "estimators": list(estimators), "dtype": dtype,
              "batches": n, "groups": groups, "ce_bptt": sum(ces[("bptt", 0)]) / n,
              "group_sizes": {grp: int(ref[grp].numel()) for grp in ["overall", *groups]},
              "endpoint_residual": {"median": float(res_all.median()) if res_all.numel() else None,
                                    "mean": float(res_all.mean()) if res_all.numel() else None},
              "rows": rows}
    result["markdown"] = markdown_table(result)
    return result


def _fmt(v: float | None, digits: int = 4) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def markdown_table(result: dict[str, Any]) -> str:
    """The result as Markdown: one row per estimator and b, the cosine to full BPTT per group."""
    groups = result["groups"]
    lines = [f"Gradient cosine to full BPTT at depth R = {result['depth']} ({result['batches']} batches, "
             f"{result['dtype']}; cosine of the batch-summed gradients, per-batch min in brackets). Terminal "
             f"CE: BPTT {result['ce_bptt']:.4f} at R; endpoint-b reads it at R + b. Endpoint residual "
             f"‖h_(R+1) − h_R‖/‖h_R‖: median {_fmt(result['endpoint_residual']['median'])}.", ""]
    rows = [[row["estimator"], str(row["b"]),
             *(f"{_fmt(row[g]['cos'])} [{_fmt(row[g]['cos_batch_min'], 3)}]" for g in ["overall", *groups]),
             _fmt(row["overall"]["norm_ratio"], 3), f"{row['ce']:.4f}"] for row in result["rows"]]
    return "\n".join(lines + md_table(["estimator", "b", "overall", *groups, "‖g‖/‖g_bptt‖", "CE"], rows,
                                      align="l" + "r" * (len(groups) + 4)))


def gradcheck_checkpoint(checkpoint: str | Path, *, depth: int | None = None, steps: Sequence[int] = (1, 2, 4, 8),
                         estimators: Sequence[str] = ESTIMATORS, dataset: str | None = None,
                         split: str = "valid", batches: int = 4, batch_size: int = 8, dtype: str = "float32",
                         device: str = "cpu", progress: bool = True) -> dict[str, Any]:
    """:func:`gradient_cosines` of a checkpoint on the first ``batches`` windows of a corpus split.

    Args:
        depth: the depth R (default: the checkpoint's nominal training depth).
        steps: the b to measure, e.g. 1,2,4,8.
        estimators: tbptt and/or endpoint.
        batches, batch_size: the first BATCHES batches of BATCH_SIZE non-overlapping windows.
        dtype: float32 or float64.
    """
    from looplm.diagnostics.runner import load_windows

    model, cfg, ckpt, data_cfg, windows = load_windows(checkpoint, "looplm gradcheck", dataset=dataset, split=split,
                                                       batch_size=batch_size, batches=batches, device=device)
    depth = cfg.depth.nominal_depth() if depth is None else depth
    dev = torch.device(device)
    xs = [(x.to(dev), y.to(dev)) for x, y, _ in windows]
    res = gradient_cosines(model, xs, depth=depth, steps=steps, estimators=estimators, dtype=dtype,
                           progress=progress)
    head = f"`{cfg.name}` ({cfg.model.rule}, {model.num_params():,} parameters), {data_cfg.dataset}/{split}, " \
           f"{len(xs)}×{batch_size} windows of {cfg.model.seq_len} tokens.\n\n"
    res["markdown"] = head + res["markdown"]
    return {"checkpoint": str(ckpt), "name": cfg.name, "rule": cfg.model.rule, "dataset": data_cfg.dataset,
            "split": split, "batch_size": batch_size, "params": model.num_params(), **res}

