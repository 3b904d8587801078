"""Where a `modsum` / `modsum_partial` model stops extrapolating: accuracy of each running sum (the readout at
operand i's digit, teacher-forced argmax against (d_1 + … + d_i) mod 10, what `modsum_partial` trains) and
of the answer, by k × T, on the held-out test prompts. Causal attention: operand i's running sum in a k-operand
prompt sees the same prefix as in an i-operand one, so a drop at i > k_train at every T locates the failure.

    python experiments/depth-testbed/probes/running_sums.py RUN_DIR OUT.json [--ks 1,...,12] [--depths 1,7,14,28]
"""

from __future__ import annotations

import argparse
import json

import torch

from looplm.run.checkpoint import load_checkpoint
from looplm.tasks.data import heldout, rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run")
    p.add_argument("out")
    p.add_argument("--ks", default="1,2,3,4,5,6,7,8,9,10,11,12")
    p.add_argument("--depths", default="1,4,7,10,14,20,28")
    a = p.parse_args(argv)
    model, cfg, _, _ = load_checkpoint(a.run)
    model.eval()
    depths = [int(t) for t in a.depths.split(",")]
    res = {}
    for k in (int(s) for s in a.ks.split(",")):
        insts = list(heldout(cfg.data.task, k, "test", cfg.data.task_heldout, cfg.data.task_seed))
        x, y = rows(cfg.data.task, insts, cfg.model.seq_len)
        digits = x[:, 0:2 * k:2] - 1  # token ids 1 … 10 are the characters 0 … 9
        sums = (digits.cumsum(1) % 10) + 1  # (N, k): the running sums as token ids
        res[k] = {}
        with torch.no_grad():  # every depth from one unroll
            logits = model.read(model.loop(x), depths).logits_by_depth
        for T in depths:
            pred = logits[T].argmax(-1)  # (N, L)
            per_op = (pred[:, 0:2 * k:2] == sums).float().mean(0)
            answer = (pred[:, 2 * k - 1] == y[:, 2 * k - 1]).float().mean()
            res[k][T] = {"running_sum_acc": [round(100 * float(v), 1) for v in per_op],
                         "answer_acc": round(100 * float(answer), 1), "n": len(x)}
    json.dump({"run": a.run, "task_k": cfg.data.task_k, "split": "test", "by_k": res}, open(a.out, "w"), indent=1)
    for T in depths:
        print(f"T={T}: running-sum accuracy (%) by operand i, then the answer")
        for k, r in res.items():
            print(f"  k={k:2d} " + " ".join(f"{v:5.1f}" for v in r[T]["running_sum_acc"]) + f" | {r[T]['answer_acc']:5.1f}")


if __name__ == "__main__":
    main()
