"""Why no depth extrapolation: accuracy of each answer digit (teacher-forced argmax) by k and T on the valid
instances of a probe checkpoint, so one sees which answer positions fail beyond k_train.

    python experiments/depth-testbed/probes/digit_positions.py RUN_DIR OUT.json
"""

from __future__ import annotations

import json
import sys

import torch

from looplm.tasks.data import heldout, rows
from looplm.run.checkpoint import load_checkpoint


def main(run: str, out: str, depths=(1, 2, 4, 8, 16)) -> None:
    model, cfg, _, _ = load_checkpoint(run)
    model.eval()
    res = {}
    for k in range(1, 2 * cfg.data.task_k + 1):
        insts = heldout(cfg.data.task, k, "valid", cfg.data.task_heldout, cfg.data.task_seed)
        x, y = rows(cfg.data.task, list(insts), cfg.model.seq_len)
        pos = (y != -100).nonzero()[:, 1].view(len(y), -1)  # (N, k + 1): answer targets, least significant first
        with torch.no_grad():
            out_T = {T: model(x, depth=T).logits.argmax(-1) for T in depths}
        res[str(k)] = {str(T): [round(100 * float((p.gather(1, pos[:, j:j + 1]) == y.gather(1, pos[:, j:j + 1]))
                                             .float().mean()), 1) for j in range(pos.shape[1])]
                       for T, p in out_T.items()}
    json.dump({"run": cfg.name, "split": "valid", "per_digit_acc": res}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
