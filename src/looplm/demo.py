"""The main job (``looplm demo``): looped baseline vs SCSE on real English text, across loop depths.

Trains each rule with the ``cpu`` preset on the Brown train split (SPEC §11), evaluates every
checkpoint at every depth on Brown test and on the held-out WikiText-2 raw test split (no training
on it), and writes to OUT:

    results.json        per model × split × depth: ppl, nll, tokens; unigram baselines; timings
    results.md          Markdown tables of PPL by depth
    ppl_vs_depth.png    PPL against loop depth on a log2 axis (SCSE Figure 3 style)
    runs/<rule>/        the training runs (checkpoints, metrics.jsonl, summary.json)

Re-running skips finished training and resumes an interrupted training run (evaluation is rerun).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer

from looplm.analysis.plots import plot_ppl_vs_depth
from looplm.config import Config, DataConfig
from looplm.data.paths import resolve_cache_dir, resolve_data_root
from looplm.data.tokens import load_tokens, unigram_ppl
from looplm.eval.perplexity import DEFAULT_DEPTHS, evaluate_depths, markdown_table
from looplm.presets import get_preset
from looplm.train.checkpoint import load_checkpoint, newest_valid_checkpoint
from looplm.train.trainer import prepare_data, train

EVAL_SPLITS = (("brown", "Brown test"), ("wikitext2", "WikiText-2 raw test (held out)"))


def _log(msg: str) -> None:
    print(f"[looplm demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _train_or_resume(cfg, run_dir: Path, data, progress: bool) -> None:
    ckpt = newest_valid_checkpoint(run_dir)
    if ckpt is not None:
        saved = Config.from_json((ckpt / "config.json").read_text()).to_dict()  # format 1 migrated
        wanted = cfg.replace(model=cfg.model.replace(vocab_size=data.vocab_size)).to_dict()
        if saved != wanted:
            _log(f"{cfg.name}: saved run has a different config; starting it again")
            shutil.rmtree(run_dir)
            ckpt = None
    if ckpt is not None and int(ckpt.name.split("-")[1]) >= cfg.train.steps:
        _log(f"{cfg.name}: already trained ({ckpt}); skipping")
        return
    _log(f"{cfg.name}: {'resuming from ' + ckpt.name if ckpt else 'training'} "
         f"({cfg.train.steps} steps, uniform depth {cfg.train.depth_lo}..{cfg.train.depth_hi})")
    train(cfg, run_dir, resume=ckpt is not None, progress=progress, data=data)


def run_demo(out: str | Path, *, steps: int | None = None, eval_tokens: int | None = 16384,
             depths: Sequence[int] = DEFAULT_DEPTHS, rules: str = "looped,scse", progress: bool = True) -> dict:
    """Run the main job into ``out`` and return the results dict (also written to results.json)."""
    t0 = time.time()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    base = get_preset("cpu")
    if steps is not None:
        base = base.replace(train=base.train.replace(steps=steps, ckpt_every=max(1, steps // 3),
                                                     eval_every=max(1, steps // 3),
                                                     warmup_steps=min(base.train.warmup_steps, steps // 10)))
    _log(f"preparing data: Brown (SPEC §11 split), byte-level BPE {base.data.bpe_vocab_size}")
    data = prepare_data(base, progress=progress)
    tok = Tokenizer.from_str(data.tokenizer_json)
    root, cache = resolve_data_root(base.data.data_root), resolve_cache_dir(base.data.cache_dir)
    eval_sets = {}
    for dataset, title in EVAL_SPLITS:
        toks = load_tokens(DataConfig(dataset=dataset, data_root=base.data.data_root,
                                      cache_dir=base.data.cache_dir), "test", tok, root, cache)
        if eval_tokens:
            toks = toks[: eval_tokens + 1]
        eval_sets[title] = toks
    unigram = {title: unigram_ppl(data.train, toks, data.vocab_size) for title, toks in eval_sets.items()}
    _log("unigram baseline PPL: " + ", ".join(f"{k}: {v:.1f}" for k, v in unigram.items()))

    results: dict = {"preset": base.to_dict(), "depths": list(depths), "eval_tokens": eval_tokens,
                     "unigram_ppl": unigram, "models": {}}
    for rule in [r.strip() for r in rules.split(",") if r.strip()]:
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
            _log(f"{rule} on {title}: " + ", ".join(f"T={T}: {r['ppl']:.1f}" for T, r in res.items())
                 + f" ({time.time() - t1:.0f}s)")
        results["models"][rule] = entry

    md = ["# looplm demo: looped baseline vs SCSE across loop depths", "",
          f"Preset `cpu` ({base.model.d_model}-wide, 1 core block, {base.train.steps} steps, batch "
          f"{base.train.batch_size}×{base.model.seq_len}, uniform training depth "
          f"{base.train.depth_lo}..{base.train.depth_hi}), trained on Brown train; byte-level BPE "
          f"{data.vocab_size} trained on Brown train. Evaluation on the first {eval_tokens} tokens of each "
          "test split (non-overlapping windows, token-weighted).", ""]
    panels = {}
    for title in eval_sets:
        curves = {rule: {int(T): r["ppl"] for T, r in e["eval"][title].items()}
                  for rule, e in results["models"].items()}
        panels[title] = curves
        table = {rule: {int(T): r for T, r in e["eval"][title].items()} for rule, e in results["models"].items()}
        md += [f"## {title} — PPL by loop depth (unigram: {unigram[title]:.1f})", "",
               markdown_table(table, list(depths)), ""]
    plot_ppl_vs_depth(panels, out / "ppl_vs_depth.png", train_range=(base.train.depth_lo, base.train.depth_hi),
                      baselines={t: {"unigram": v} for t, v in unigram.items()},
                      title="looplm demo: PPL vs loop depth")
    results["wall_s"] = time.time() - t0
    md += ["![PPL vs depth](ppl_vs_depth.png)", "", f"Total wall time: {results['wall_s']:.0f} s."]
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    _log(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'ppl_vs_depth.png'} "
         f"in {results['wall_s']:.0f} s")
    return results
