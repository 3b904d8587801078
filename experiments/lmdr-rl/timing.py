"""Scoring + backward time of the three update methods against R and b, on identical batches.

Loads the pretrained base model, samples one batch of rollouts (8 prompts x 16 responses) at each depth
R, then times `update_gradient` for bptt, recompute-b and reuse-b, REPS rounds in rotating order
(median per method), single thread. Writes results/timing.json.

    python experiments/lmdr-rl/timing.py [--reps 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from looplm.rl.grpo import pack, sample_rollouts, update_gradient
from looplm.rl.task import NEWLINE_ID, AdditionTask
from looplm.train.checkpoint import load_checkpoint

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--depths", default="6,12")
    ap.add_argument("--steps", default="1,2,3,4")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, cfg, _, _ = load_checkpoint(HERE / "runs" / "base")
    task = AdditionTask(digits=3)
    rows = []
    for R in map(int, args.depths.split(",")):
        roll = sample_rollouts(model, task.problems(8, "timing", R), group_size=16, depth=R,
                               max_new_tokens=task.digits + 2, seed=0, eos_id=NEWLINE_ID)
        batch = pack(roll)
        for b in map(int, args.steps.split(",")):
            methods = ["bptt", "recompute", "reuse"]
            times: dict[str, list[float]] = {m: [] for m in methods}
            for rep in range(args.reps + 1):
                for m in methods[rep % 3:] + methods[:rep % 3]:  # rotate the order
                    t = update_gradient(model, batch, m, depth=R, neumann_steps=b, max_new_tokens=task.digits + 2)[0]
                    if rep:  # the first round warms up
                        times[m].append(t["time_s"])
            med = {m: statistics.median(v) for m, v in times.items()}
            row = {"R": R, "b": b, "time_s": med, "speedup_vs_bptt": {m: med["bptt"] / med[m] for m in methods},
                   "tokens": int((batch.targets != -100).sum()), "rows": int(batch.idx.shape[0]),
                   "seq_len": int(batch.idx.shape[1])}
            rows.append(row)
            print(json.dumps(row))
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "timing.json").write_text(json.dumps({"reps": args.reps, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
