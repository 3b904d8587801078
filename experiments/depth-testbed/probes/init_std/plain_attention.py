"""An independent check of the init finding: a plain 1-layer transformer (torch.nn.MultiheadAttention, no norm
before attention, untied) on the same `pointer_pairs` rows (k = 1, one look-up), Adam(W) lr 1e-3, batch 64,
1,000 steps, with torch's default N(0, 1) token embeddings and with N(0, 0.02) ones (GPT-2's, looplm's default).

    python experiments/depth-testbed/probes/init_std/plain_attention.py OUT.json
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from looplm.config import DataConfig
from looplm.tasks import get_task
from looplm.tasks.data import heldout, rows, train_instances


class Plain(nn.Module):
    def __init__(self, vocab: int, d: int = 128):
        super().__init__()
        self.emb, self.att, self.out = nn.Embedding(vocab, d), nn.MultiheadAttention(d, 4, batch_first=True), \
            nn.Linear(d, vocab)
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, L = self.emb(x), x.shape[1]
        h = h + self.att(h, h, h, attn_mask=torch.triu(torch.ones(L, L, dtype=torch.bool), 1))[0]
        return self.out(h + self.mlp(h))


def curve(embed_std: float | None, steps: int = 1000) -> list[dict]:
    torch.manual_seed(0)
    cfg = DataConfig(dataset="task", task="pointer_pairs", task_k=1)
    model = Plain(len(get_task("pointer_pairs").vocab.vocab))
    if embed_std is not None:
        nn.init.normal_(model.emb.weight, std=embed_std)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    xv, yv = rows("pointer_pairs", list(heldout("pointer_pairs", 1, "valid", 256, 0)), 18)
    out = []
    for step in range(1, steps + 1):
        x, y = rows("pointer_pairs", train_instances(cfg, 64, 0, step, 0), 18)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0:
            with torch.no_grad():
                s = yv != -100
                acc = (model(xv).argmax(-1)[s] == yv[s]).float().mean().item()
            out.append({"step": step, "train_loss": round(loss.item(), 4), "val_acc": round(acc, 4)})
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    json.dump({"embedding N(0, 1) (torch default)": curve(None), "embedding N(0, 0.02)": curve(0.02)},
              open(sys.argv[1], "w"), indent=1)
