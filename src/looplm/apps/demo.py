"""The main job (``looplm demo``): looped baseline vs SCSE on real English text, across loop depths.

Trains each rule with the ``cpu`` preset on Brown train (SPEC §11), evaluates every depth on Brown test and the
held-out WikiText-2 raw test, and writes ``results.json``, ``results.md``, ``ppl_vs_depth.png`` and ``runs/<rule>/``
to OUT; re-running skips or resumes training. :func:`readme_table` renders the README's "Measured results".
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

from tokenizers import Tokenizer

from looplm.analysis.claims import depth_use_cell
from looplm.analysis.plots import plot_ppl_vs_depth
from looplm.config import Config, ConfigError, DataConfig
from looplm.data.paths import resolve_cache_dir, resolve_data_root
from looplm.data.tokens import load_tokens, unigram_ppl
from looplm.eval.perplexity import DEFAULT_DEPTHS, evaluate_depths, nonfinite_depths
from looplm.run.finite import dumps, md_table
from looplm.presets import get_preset
from looplm.run.checkpoint import list_checkpoints, load_checkpoint, newest_valid_checkpoint
from looplm.run.lock import RunLock
from looplm.train.trainer import prepare_data, train

EVAL_SPLITS = (("brown", "Brown test"), ("wikitext2", "WikiText-2 raw test (held out)"))
#: the README's "Measured results" table: (split title, column label, depths shown)
README_COLUMNS = (("Brown test", "Brown test PPL", (1, 4, 8, 16, 48)),
                  ("WikiText-2 raw test (held out)", "WikiText-2 raw test PPL (held out)", (1, 8, 16, 48)))
RULE_TITLES = {"looped": "looped baseline", "scse": "SCSE"}


def _log(msg: str) -> None:
    print(f"[looplm demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _remove_run(run_dir: Path) -> None:
    """Delete a run folder, but never one that another process is training into (RunLockedError)."""
    with RunLock(run_dir):
        shutil.rmtree(run_dir)


def _train_or_resume(cfg, run_dir: Path, data, progress: bool) -> None:
    ckpt = newest_valid_checkpoint(run_dir)
    if ckpt is not None:
        try:  # through Config, which validates it
            saved = Config.from_json((ckpt / "config.json").read_text()).to_dict()
        except ConfigError:
            saved = None
        wanted = cfg.replace(model=cfg.model.replace(vocab_size=data.vocab_size)).to_dict()
        if saved != wanted:
            _log(f"{cfg.name}: saved run has a different config; starting it again")
            _remove_run(run_dir)
            ckpt = None
    elif list_checkpoints(run_dir):
        _log(f"{cfg.name}: no valid checkpoint in {run_dir} (all damaged); starting it again")
        _remove_run(run_dir)
    if ckpt is not None and int(ckpt.name.split("-")[1]) >= cfg.train.steps:
        _log(f"{cfg.name}: already trained ({ckpt}); skipping")
        return
    _log(f"{cfg.name}: {'resuming from ' + ckpt.name if ckpt else 'training'} "
         f"({cfg.train.steps} steps, uniform depth {cfg.depth.lo}..{cfg.depth.hi})")
    train(cfg, run_dir, resume=ckpt is not None, progress=progress, data=data,
          overwrite=True)  # its own run folder: a run with no checkpoint starts again


def demo_title(rules: Sequence[str]) -> str:
    """``looped baseline vs SCSE across loop depths`` for rules ``["looped", "scse"]``."""
    return " vs ".join(RULE_TITLES.get(r, r) for r in rules) + " across loop depths"


def run_demo(out: str | Path, *, steps: int | None = None, eval_tokens: int | None = 16384,
             depths: Sequence[int] = DEFAULT_DEPTHS, rules: str = "looped,scse", progress: bool = True,
             preset: str = "cpu") -> dict:
    """Run the main job into ``out``; returns the results (also results.json, a non-finite PPL as null).

    Args:
        steps: training steps per model (default: the preset's)
        eval_tokens: tokens of each evaluation split
        rules: comma-separated recurrence rules, one model each
    """
    t0 = time.time()
    rule_list = [r.strip() for r in rules.split(",") if r.strip()]
    if not rule_list:
        raise ConfigError(f"rules: give at least one recurrence rule, got {rules!r}")
    base = get_preset(preset)
    for rule in rule_list:  # a bad rule name fails here, before any work
        base.model.replace(rule=rule)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if steps is not None:
        base = base.replace(train=base.train.replace(steps=steps, ckpt_every=max(1, steps // 3),
                                                     eval_every=max(1, steps // 3)),
                            optim=base.optim.replace(warmup_steps=min(base.optim.warmup_steps, steps // 10)))
    _log(f"preparing data: Brown (SPEC §11 split), byte-level BPE {base.data.bpe_vocab_size}")
    data = prepare_data(base, progress=progress)
    base = base.replace(model=base.model.replace(vocab_size=data.vocab_size))  # as train() builds the models
    tok = Tokenizer.from_str(data.tokenizer_json)
    root, cache = resolve_data_root(base.data.data_root), resolve_cache_dir(base.data.cache_dir)
    eval_sets = {title: load_tokens(DataConfig(dataset=dataset, data_root=base.data.data_root,
                                               cache_dir=base.data.cache_dir), "test", tok, root, cache)
                 for dataset, title in EVAL_SPLITS}
    if eval_tokens:
        eval_sets = {title: toks[: eval_tokens + 1] for title, toks in eval_sets.items()}
    unigram = {title: unigram_ppl(data.train, toks, data.vocab_size) for title, toks in eval_sets.items()}
    _log("unigram baseline PPL: " + ", ".join(f"{k}: {v:.1f}" for k, v in unigram.items()))

    results: dict = {"preset": base.to_dict(), "depths": list(depths), "eval_tokens": eval_tokens,
                     "unigram_ppl": unigram, "models": {}}
    for rule in rule_list:
        cfg = base.replace(name=rule, model=base.model.replace(rule=rule))
        run_dir = out / "runs" / rule
        _train_or_resume(cfg, run_dir, data, progress)
        model, saved_cfg, _, ckpt = load_checkpoint(run_dir)
        summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
        entry = {"checkpoint": str(ckpt), "params": model.num_params(), "train": summary, "eval": {}}
        for title, toks in eval_sets.items():
            t1 = time.time()
            res = evaluate_depths(model, toks, depths, batch_size=32, progress=progress, desc=f"{rule} {title}")
            entry["eval"][title] = {str(T): r for T, r in res.items()}
            if nonfinite_depths(res):
                _log(f"WARNING: {rule} on {title}: NLL not finite at T={nonfinite_depths(res)} (null in results.json)")
            _log(f"{rule} on {title}: " + ", ".join(f"T={T}: {r['ppl']:.1f}" for T, r in res.items())
                 + f" ({time.time() - t1:.0f}s)")
        results["models"][rule] = entry

    panels = {title: {rule: {int(T): r["ppl"] for T, r in e["eval"][title].items()}
                      for rule, e in results["models"].items()} for title in eval_sets}
    plot_ppl_vs_depth(panels, out / "ppl_vs_depth.png", train_range=(base.depth.lo, base.depth.hi),
                      baselines={t: {"unigram": v} for t, v in unigram.items()},
                      title="looplm demo: PPL vs loop depth")
    results["wall_s"] = time.time() - t0
    md = results_markdown(results)
    (out / "results.json").write_text(dumps(results, indent=2))
    (out / "results.md").write_text(md)
    print(md, end="")
    _log(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'ppl_vs_depth.png'} "
         f"in {results['wall_s']:.0f} s")
    return results


def _ppl(x: Any, digits: int = 1) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) and math.isfinite(x) else "n/a"


def _get_ppl(entry: dict[str, Any], title: str, T: int) -> float:
    v = entry["eval"].get(title, {}).get(str(T), {}).get("ppl")
    return v if isinstance(v, (int, float)) and math.isfinite(v) else math.nan


def _depth_use(entry: dict[str, Any], title: str, train_depth: int) -> str:
    """:func:`~looplm.analysis.claims.depth_use_cell` of one model's finite PPLs on ``title``."""
    return depth_use_cell({int(T): {0: p} for T in entry["eval"].get(title, {})
                           if math.isfinite(p := _get_ppl(entry, title, int(T)))}, train_depth)


def results_markdown(results: dict[str, Any]) -> str:
    """``results.md`` from a ``results.json`` dict: the setup, per split PPL by depth (depth use first), the plot."""
    cfg = Config.from_dict(results["preset"])
    m, t, depth = cfg.model, cfg.train, cfg.depth
    depths = [int(T) for T in results["depths"]]
    md = [f"# looplm demo: {demo_title(list(results['models']))}", "",
          f"Preset `{cfg.name}` ({m.d_model}-wide, 1 core block, {t.steps} steps, batch {t.batch_size}×{m.seq_len}, "
          f"uniform training depth {depth.lo}..{depth.hi}), trained on Brown train; byte-level BPE "
          f"{m.vocab_size} trained on Brown train. Evaluation on the first {results['eval_tokens']} tokens of each "
          "test split (non-overlapping windows, token-weighted).", ""]
    for title, uni in results["unigram_ppl"].items():
        rows = [[rule, _depth_use(e, title, depth.nominal_depth()), *(_ppl(_get_ppl(e, title, T), 2) for T in depths)]
                for rule, e in results["models"].items()]
        md += [f"## {title} — PPL by loop depth (unigram: {uni:.1f})", "",
               *md_table(["model", f"depth use: PPL at T=1 · T={depth.nominal_depth()} · best T",
                          *(f"T={T}" for T in depths)], rows, align="ll" + "r" * len(depths)), ""]
    md += ["![PPL vs depth](ppl_vs_depth.png)", "", f"Total wall time: {results['wall_s']:.0f} s."]
    return "\n".join(md) + "\n"


def readme_table(results: dict[str, Any]) -> str:
    """The README's "Measured results" table (unigram and each model at the :data:`README_COLUMNS` depths)."""
    evaluated = {int(T) for T in results["depths"]}
    train_depth = Config.from_dict(results["preset"]).depth.nominal_depth()
    brown = README_COLUMNS[0][0]
    cols = [(title, label, [T for T in shown if T in evaluated]) for title, label, shown in README_COLUMNS]
    rows = [["unigram (add-one, Brown train)", "–", "–", *(_ppl(results["unigram_ppl"][t]) for t, _, _ in cols)]]
    rows += [[f"`{rule}`", _depth_use(entry, brown, train_depth), f"{entry['params']:,}",
              *(" / ".join(_ppl(entry["eval"][title][str(T)]["ppl"]) for T in ds) for title, _, ds in cols)]
             for rule, entry in results["models"].items()]
    lines = md_table(["model", f"depth use: Brown test PPL at T=1 · T={train_depth} · best T", "params",
                      *(f"{label}, T={' / '.join(map(str, ds))}" for _, label, ds in cols)], rows, align="llr")
    return "\n".join(lines) + "\n\n" + readme_summary(results)


def readme_summary(results: dict[str, Any]) -> str:
    """The README's sentences about a demo run, every number computed from its ``results.json``."""
    models = results["models"]
    depths = sorted(int(T) for T in results["depths"])
    t_ref, t_max = (8 if 8 in depths else depths[len(depths) // 2]), depths[-1]
    brown, wt2 = README_COLUMNS[0][0], README_COLUMNS[1][0]
    train_s = ", ".join(f"`{r}` {m['train'].get('wall_s', math.nan):.0f} s" for r, m in models.items())
    lines = [f"Wall time: {results.get('wall_s', math.nan):.0f} s in all; training {train_s}."]
    ranked = sorted(models, key=lambda r: _get_ppl(models[r], brown, t_ref))
    if len(ranked) > 1:
        lines.append(f"- **At T={t_ref} on Brown test** `{ranked[0]}` has the lowest PPL "
                     f"({_ppl(_get_ppl(models[ranked[0]], brown, t_ref))}; "
                     + ", ".join(f"`{r}` {_ppl(_get_ppl(models[r], brown, t_ref))}" for r in ranked[1:]) + ").")
    for title, label in ((brown, "Brown test"), (wt2, "WikiText-2 (held out)")):
        uni = results["unigram_ppl"].get(title, math.nan)
        parts = [f"`{r}` {uni / _get_ppl(m, title, t_ref):.2f}×" for r, m in models.items()]
        lines.append(f"- **{label}, against the unigram model** ({_ppl(uni)}), PPL ratio unigram / model at "
                     f"T={t_ref}: " + ", ".join(parts) + ".")
    parts = [f"`{r}` {100 * (_get_ppl(m, brown, t_max) / _get_ppl(m, brown, t_ref) - 1):+.0f}% "
             f"({_ppl(_get_ppl(m, brown, t_ref))} → {_ppl(_get_ppl(m, brown, t_max))})" for r, m in models.items()]
    lines.append(f"- **Depth beyond training** (Brown test, T={t_ref} → T={t_max}): " + ", ".join(parts) + ".")
    parts = [f"`{r}` {_ppl(m['train'].get('val_ppl', math.nan))}" for r, m in models.items()]
    lines.append("- **Validation PPL at the end of training** (Brown valid, T = train.eval_depth): "
                 + ", ".join(parts) + ".")
    return "\n".join(lines)
