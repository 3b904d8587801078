"""Probe 20: can a looped model learn to compose look-ups when each loop is told which hop it should have made?

`pointer_pairs` (k_train = 3), preset `task-pointer_pairs` with init_std 0.06 and lr 2e-3 (the settings under which
one look-up is learned, `probes/init_std/`), depth uniform in 1..8 as the preset. The loss is the per-loop
cross-entropy at the answer position (mean over loops 1..T, the readout paper's per-loop supervision), with one
change under ``--targets hop``: loop t is scored against the t-th ancestor of the queried node (the root once
t ≥ k; a root is its own parent), so every loop gets a supervised hop. ``--targets root`` scores every loop
against the root (plain per-loop CE): the control. Evaluation: exact match of the root on the VALID held-out
instances (`looplm.tasks.data.accuracy_by_depth`, T = 1 … 16, k = 1 … 7), never test; and, under both targets,
the share of instances whose loop-t readout is the t-th ancestor (hop accuracy, t = 1 … 8).

This is a probe with its own 20-line loop over looplm's model, optimizer and task rows (the trainer has no
per-loop targets); 1 seed.

    PYTHONPATH=src python experiments/depth-testbed/probes/hop_targets/hop_targets.py --targets hop --out DIR

``--task pointer_forest`` (probe 23) runs the same on the four-tree forest (preset ``task-pointer_forest``); the
default ``pointer_pairs`` is what ``hop/`` and ``hop-plain/`` ran. ``attention_on_other_roots`` (added with
``--task``): the mass on the other trees' self-loops.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from looplm.config import apply_overrides
from looplm.model import build_model, eval_mode, layers
from looplm.presets import get_preset
from looplm.tasks import get_task
from looplm.tasks.data import accuracy_by_depth, heldout, rows, task_data, train_instances
from looplm.tasks.forest import FOREST_NODES, forest_pair
from looplm.tasks.pointer import EDGE_NODES, pair_of
from looplm.train.optim import Optimization

TASK, K_EVAL, T_EVAL = "pointer_pairs", range(1, 8), list(range(1, 17))  # TASK: set by --task
#: per task, the node names and the (child, parent) of an edge token
GRAPHS = {"pointer_pairs": (EDGE_NODES, pair_of), "pointer_forest": (FOREST_NODES, forest_pair)}


def ancestors(prompt: str, depth: int, vocab: dict[str, int]) -> list[int]:
    """Token ids of the t-th ancestor of the queried node, t = 1 … depth (the root's parent is itself)."""
    nodes, pair_of = GRAPHS[TASK]
    edges, q = prompt.split("?")
    parent = dict(pair_of(tok) for tok in edges)
    node, out = nodes.index(q), []
    for _ in range(depth):
        node = parent[node]
        out.append(vocab[nodes[node]])
    return out


def hop_targets(insts, depth: int, vocab: dict[str, int], mode: str) -> torch.Tensor:
    """(depth, B) int64: loop t's target per instance (``hop``: the t-th ancestor; ``root``: the root)."""
    if mode == "root":
        return torch.tensor([vocab[i.answer] for i in insts]).expand(depth, -1)
    return torch.tensor([ancestors(i.prompt, depth, vocab) for i in insts]).T


def per_loop_readout(model, x: torch.Tensor, depth: int) -> torch.Tensor:
    """(depth, B, V) logits of loops 1 … depth at the last position (where the answer is read)."""
    loop, out = model.loop(x), []
    for _ in range(depth):
        h = loop.advance()  # (B, L, d)
        out.append(model.readout(h)[:, -1])  # (B, V)
    return torch.stack(out)


@torch.no_grad()
def hop_accuracy(model, insts, vocab: dict[str, int], depth: int = 8) -> list[float]:
    """Share of instances whose loop-t argmax is the t-th ancestor, t = 1 … depth."""
    with eval_mode(model):
        x, _ = rows(TASK, list(insts), model.cfg.seq_len)
        pred = per_loop_readout(model, x, depth).argmax(-1)  # (depth, N)
    return (pred == hop_targets(insts, depth, vocab, "hop")).float().mean(1).tolist()


@torch.no_grad()
def attention_on_chain(model, insts, loops: int = 4) -> tuple[list[list[float]], list[float]]:
    """``[t][j]``: attention mass of the answer position at loop t (1 … loops) on the edge of q's j-th ancestor
    (j = 0: q's own edge, … k: the root's self-loop), the head that puts most there, mean over instances (a
    1-block model: one attention call per loop). Read by wrapping ``looplm.model.layers.attention``. Also
    ``[t]``: the summed mass on the self-loops of the roots other than q's, the head that puts most there."""
    nodes, pair_of = GRAPHS[TASK]
    probs, plain = [], layers.attention

    def spy(q, k, v, **kw):  # q, k (B, H, L, hd): the last query's attention over all keys (causal)
        scores = (q[:, :, -1:] @ k.transpose(-1, -2))[:, :, 0] / q.shape[-1] ** 0.5  # (B, H, L)
        probs.append(torch.softmax(scores, -1))
        return plain(q, k, v, **kw)

    layers.attention = spy
    try:
        with eval_mode(model):
            x, _ = rows(TASK, list(insts), model.cfg.seq_len)
            per_loop_readout(model, x, loops)
    finally:
        layers.attention = plain
    k = insts[0].k
    where = torch.zeros(len(insts), k + 1, dtype=torch.long)  # position of the edge of ancestor j
    others = torch.zeros(len(insts), probs[0].shape[-1])  # 1 at the other roots' self-loops
    for r, inst in enumerate(insts):
        edges, q = inst.prompt.split("?")
        child = {pair_of(tok)[0]: pos for pos, tok in enumerate(edges)}
        node, parent = nodes.index(q), dict(map(pair_of, edges))
        for j in range(k + 1):
            where[r, j] = child[node]
            node = parent[node]
        for c, p in parent.items():
            if c == p and c != node:
                others[r, child[c]] = 1.0
    chain = [[round(float(p.gather(2, where[:, None, :].expand(-1, p.shape[1], -1)).amax(1)[:, j].mean()), 3)
              for j in range(k + 1)] for p in probs]
    return chain, [round(float((p * others[:, None, :]).sum(-1).amax(1).mean()), 3) for p in probs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", choices=["hop", "root"], required=True)
    ap.add_argument("--task", choices=sorted(GRAPHS), default="pointer_pairs")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a further config override, e.g. model.rule=plain (repeatable)")
    args = ap.parse_args()
    global TASK
    TASK = args.task
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = apply_overrides(get_preset(f"task-{TASK}"), {"model.init_std": 0.06, "optim.lr": 2e-3,
                                                        "train.steps": args.steps,
                                                        **dict(kv.split("=", 1) for kv in args.set)})
    data = task_data(cfg.data)
    cfg = apply_overrides(cfg, {"model.vocab_size": data.vocab_size})
    vocab = get_task(TASK).vocab.vocab
    model = build_model(cfg)
    opt = Optimization(model, cfg.optim, args.steps)
    valid = [i for k in K_EVAL for i in heldout(TASK, k, "valid", cfg.data.task_heldout, cfg.data.task_seed)]
    curve, t0, rng = [], time.time(), np.random.default_rng(0)
    for step in range(args.steps):
        depth = int(rng.integers(cfg.depth.lo, cfg.depth.hi + 1))
        insts = train_instances(cfg.data, cfg.train.batch_size, 0, step, 0)
        x, _ = rows(TASK, insts, cfg.model.seq_len)
        target = hop_targets(insts, depth, vocab, args.targets)  # (depth, B)
        logits = per_loop_readout(model, x, depth)  # (depth, B, V)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())
        loss.backward()
        opt.step(float(loss.detach()))
        if (step + 1) % 100 == 0:
            inside = [i for i in valid if i.k <= cfg.data.task_k]
            acc = accuracy_by_depth(model, *rows(TASK, inside, cfg.model.seq_len), [8])[8]["acc"]
            curve.append({"step": step + 1, "loss": round(float(loss), 4), "val_acc_T8": round(acc, 4),
                          "hop_acc": [round(a, 3) for a in hop_accuracy(model, inside, vocab)]})
            print(json.dumps(curve[-1]), flush=True)
    by_k = {}
    for k in K_EVAL:
        insts = list(heldout(TASK, k, "valid", cfg.data.task_heldout, cfg.data.task_seed))
        r = accuracy_by_depth(model, *rows(TASK, insts, cfg.model.seq_len), T_EVAL)
        chain, other_roots = attention_on_chain(model, insts)
        by_k[k] = {"acc_by_T": {T: round(100 * r[T]["acc"], 1) for T in T_EVAL},
                   "hop_acc": [round(100 * a, 1) for a in hop_accuracy(model, insts, vocab)],
                   "attention_on_chain": chain, "attention_on_other_roots": other_roots}
    args.out.mkdir(parents=True, exist_ok=True)
    json.dump({"task": TASK, "targets": args.targets, "set": args.set, "steps": args.steps, "wall_s": round(time.time() - t0), "k_train": cfg.data.task_k,
               "config": cfg.to_dict(), "validation": curve, "valid_by_k": by_k},
              open(args.out / "result.json", "w"), indent=1)


if __name__ == "__main__":
    main()
