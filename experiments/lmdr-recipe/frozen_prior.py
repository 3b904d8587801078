"""Write frozen.toml, the frozen-prior ablation of LMDR (arXiv:2610.06833 §5.2: the learned prior's final
distribution, frozen from the first update), from the finished `learned` runs of sweep.toml.

Reads each runs/learned-s<seed>/ newest checkpoint's depth-prior logits (train_state.pt, loaded as data),
keeps every seed's final p in prior_final.json (committed: the run folders are not), and writes frozen.toml,
sweep.toml's base and evaluation with one variant:
the `learned` variant with depth.init = the mean over the seeds whose run folders are present (at least 2;
our choice: one distribution for all seeds; the paper trains one seed) of the final p and depth.warmup = train.steps, so the
logits never move (the sampler's warm-up only collects its baseline; App. B.3 "the fixed arm freezes the
logits in the same sampler").

Run: python experiments/lmdr-recipe/frozen_prior.py
     looplm sweep experiments/lmdr-recipe/frozen.toml --out experiments/lmdr-recipe/frozen
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from looplm.apps.sweep import load_sweep
from looplm.run.checkpoint import load_train_state, newest_valid_checkpoint

EXP = Path(__file__).parent


def main() -> None:
    sweep = load_sweep(EXP / "sweep.toml")
    final = {}
    for spec in sweep.runs():
        ckpt = newest_valid_checkpoint(EXP / "runs" / spec.run_id) if spec.variant == "learned" else None
        state = load_train_state(ckpt) if ckpt is not None else None
        if state is not None and state.get("step") == spec.config.train.steps:
            final[spec.run_id] = torch.softmax(torch.as_tensor(state["depth_prior"]["logits"]), 0).tolist()
    if len(final) < 2:  # run folders do not outlive a session: learned-s0's was gone before this was run
        raise SystemExit(f"need the finished learned runs of at least 2 seeds; found {sorted(final)}")
    (EXP / "prior_final.json").write_text(json.dumps(final, indent=1, sort_keys=True) + "\n")
    mean = torch.tensor(list(final.values()), dtype=torch.float64).mean(0)
    weights = ", ".join(f"{float(p):.6g}" for p in mean)
    overrides = sweep.variants["learned"]
    fields = ", ".join(f'"{k}" = {json.dumps(v)}' for k, v in overrides.items())
    steps = sweep.base.train.steps
    src = (EXP / "sweep.toml").read_text()
    base = src.split("\n[base]\n", 1)[1].split("\n[variants]\n", 1)[0]  # the same base and evaluation
    text = (f"# Written by frozen_prior.py from prior_final.json (the mean over seeds of the `learned` runs' final\n"
            f"# prior): LMDR's frozen-prior ablation; depth.warmup = steps keeps the logits fixed.\n"
            f"# Run: looplm sweep experiments/lmdr-recipe/frozen.toml --out experiments/lmdr-recipe/frozen\n"
            f'name = "lmdr-recipe-frozen"\nseeds = {list(sweep.seeds)}\n\n[base]\n{base}\n[variants]\n'
            f'frozen_final = {{{fields}, "depth.warmup" = {steps}, "depth.init" = [{weights}]}}\n\n'
            "[eval]\n" + src.split("\n[eval]\n", 1)[1])
    (EXP / "frozen.toml").write_text(text)
    print(f"frozen.toml: prior mean {float(mean @ torch.arange(1, len(mean) + 1, dtype=torch.float64)):.3f} "
          f"from {sorted(final)}")


if __name__ == "__main__":
    main()
