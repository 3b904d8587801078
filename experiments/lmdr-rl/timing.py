"""Scoring + backward time and gradient cosines of the three update methods against R and b.

Loads the pretrained base model, samples one batch of rollouts (8 prompts x 16 responses) at each depth
R, then times `update_gradient` for bptt, recompute-b and reuse-b, REPS rounds in rotating order
(median per method), single thread, and takes their whole-model gradient cosines and the policy gap
(`compare_methods`) on that batch, with the endpoint residual ||h_(R+1) - h_R|| / ||h_R|| (token
median); and the cosines of an untrained model of the same config (advantages set to a fixed ramp, since
it earns no reward). Writes results/timing.json.

    python experiments/lmdr-rl/timing.py [--reps 9] [--depths 1,2,3,6,12] [--steps 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from looplm.model import Readout, build_model
from looplm.rl.grpo import compare_methods, pack, sample_rollouts, update_gradient
from looplm.rl.task import NEWLINE_ID, AdditionTask
from looplm.run.checkpoint import load_checkpoint

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--depths", default="1,2,3,6,12")
    ap.add_argument("--steps", default="1,2,4")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, cfg, _, _ = load_checkpoint(HERE / "runs" / "base")
    task = AdditionTask(digits=3)
    rows = []
    for R in map(int, args.depths.split(",")):
        roll = sample_rollouts(model, task.problems(8, "timing", R), group_size=16, depth=R,
                               max_new_tokens=task.digits + 2, seed=0, eos_id=NEWLINE_ID)
        batch = pack(roll)
        with torch.no_grad():
            loop = model.loop(batch.idx, attention_mask=batch.mask)
            hs = model.read(loop, R + 1, readout=Readout(states=True)).states
        keep = batch.mask.bool()
        residual = float(((hs[R + 1] - hs[R]).norm(dim=-1) / hs[R].norm(dim=-1))[keep].median())
        for b in map(int, args.steps.split(",")):
            methods = ["bptt", "recompute", "reuse"]
            times: dict[str, list[float]] = {m: [] for m in methods}
            for rep in range(args.reps + 1):
                for m in methods[rep % 3:] + methods[:rep % 3]:  # rotate the order
                    t = update_gradient(model, batch, m, depth=R, neumann_steps=b, max_new_tokens=task.digits + 2)[0]
                    if rep:  # the first round warms up
                        times[m].append(t["time_s"])
            med = {m: statistics.median(v) for m, v in times.items()}
            cmp = compare_methods(model, batch, depth=R, neumann_steps=b, max_new_tokens=task.digits + 2)
            row = {"R": R, "b": b, "time_s": med, "speedup_vs_bptt": {m: med["bptt"] / med[m] for m in methods},
                   "cos": cmp["cos"], "policy_gap": cmp["policy_gap"], "endpoint_residual": residual,
                   "tokens": int((batch.targets != -100).sum()), "rows": int(batch.idx.shape[0]),
                   "seq_len": int(batch.idx.shape[1])}
            rows.append(row)
            print(json.dumps(row))
    # the same cosines at initialization (the base config, seed 0, no training): no fixed point yet
    init_rows = []
    torch.manual_seed(0)
    init = build_model(cfg.model).eval()
    for R in map(int, args.depths.split(",")):
        roll = sample_rollouts(init, task.problems(8, "timing", R), group_size=16, depth=R,
                               max_new_tokens=task.digits + 2, seed=0, eos_id=NEWLINE_ID)
        batch = pack(roll)
        batch.advantages = torch.linspace(-1, 1, len(batch.advantages))  # untrained: every reward is 0
        for b in map(int, args.steps.split(",")):
            cmp = compare_methods(init, batch, depth=R, neumann_steps=b, max_new_tokens=task.digits + 2)
            init_rows.append({"R": R, "b": b, "cos": cmp["cos"], "policy_gap": cmp["policy_gap"]})
            print(json.dumps(init_rows[-1]))
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "timing.json").write_text(json.dumps({"reps": args.reps, "rows": rows, "init": init_rows},
                                                             indent=2) + "\n")


if __name__ == "__main__":
    main()
