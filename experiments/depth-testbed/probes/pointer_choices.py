"""What a `pointer_edges`, `pointer_pairs` or `pointer_forest` probe answers: per k and T, the share of valid
instances whose argmax answer is the queried node's root (right), another tree's root (the wrong root; for
`pointer_forest` any of the three), the queried node's parent, or another node.

    python experiments/depth-testbed/probes/pointer_choices.py RUN_DIR OUT.json
"""

from __future__ import annotations

import json
import sys

import torch

from looplm.run.checkpoint import load_checkpoint
from looplm.tasks import decode
from looplm.tasks.data import heldout, rows
from looplm.tasks.forest import FOREST_BASE, FOREST_NODES, forest_pair
from looplm.tasks.pointer import EDGE_NODES, pair_of


def choice(prompt: str, answer: str) -> tuple[str, set[str], str]:
    """(q's root = the answer, the other roots, q's parent): the last two read from the prompt's edge list."""
    edges, q = prompt.removesuffix("=").split("?")
    if ";" in edges:  # pointer_edges: "<child><parent>;" …
        parent = dict(e for e in edges.split(";") if e)
    elif ord(edges[0]) >= FOREST_BASE:  # pointer_forest: one token per edge, 32 nodes
        parent = {FOREST_NODES[c]: FOREST_NODES[p] for c, p in map(forest_pair, edges)}
    else:  # pointer_pairs: one token per edge
        parent = {EDGE_NODES[c]: EDGE_NODES[p] for c, p in map(pair_of, edges)}
    roots = [c for c, p in parent.items() if c == p]
    return answer, {r for r in roots if r != answer}, parent[q]


def main(run: str, out: str, depths=(1, 2, 4, 8, 16)) -> None:
    model, cfg, _, _ = load_checkpoint(run)
    model.eval()
    res = {}
    for k in range(1, max(2 * cfg.data.task_k, 4) + 1):
        insts = list(heldout(cfg.data.task, k, "valid", cfg.data.task_heldout, cfg.data.task_seed))
        x, y = rows(cfg.data.task, insts, cfg.model.seq_len)
        pos = (y != -100).float().argmax(1)  # the one answer position per row
        refs = [choice(i.prompt, i.answer) for i in insts]
        res[str(k)] = {}
        for T in depths:
            with torch.no_grad():
                pred = model(x, depth=T).logits.argmax(-1)[torch.arange(len(x)), pos]
            said = [decode([int(t)]) for t in pred]
            n = len(insts)
            res[str(k)][str(T)] = {
                "right_root": round(100 * sum(s == r[0] for s, r in zip(said, refs)) / n, 1),
                "other_root": round(100 * sum(s in r[1] for s, r in zip(said, refs)) / n, 1),
                "parent_not_root": round(100 * sum(s == r[2] != r[0] for s, r in zip(said, refs)) / n, 1),
                "other": round(100 * sum(s != r[0] and s not in r[1] and s != r[2] for s, r in zip(said, refs)) / n, 1)}
    json.dump({"run": cfg.name, "split": "valid", "n": len(insts), "answers_pct": res}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
