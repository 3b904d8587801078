"""Pointer chasing to a root: a forest over 16 nodes, k = the hops from the queried node to its root.

Nodes ``a … p``; the prompt lists each node's parent in node order (a root is its own parent), then the
query: ``"<16 parents>?q="``, answer the root of q (one token). The queried chain has exactly k hops; the
other nodes attach in a random order to a uniformly chosen node placed before them, under the queried
chain's root or under one of two more roots (distractor trees). Unlike the other families the prompt has the
same length at every k, so k beyond training asks for more hops, never for unseen positions (issue 24 §2:
the addition headline's k > k_train failure is positional). Our design, after the pointer-chasing tasks of
the looped-model literature; sizes our choice.
"""

from __future__ import annotations

import numpy as np

from looplm.tasks.base import Instance, TaskFamily, register_task

NODES = "abcdefghijklmnop"
N_ROOTS = 3  # the queried chain's root and two distractor roots


class Pointer(TaskFamily):
    name = "pointer"
    max_k = len(NODES) - N_ROOTS

    def make(self, k: int, rng: np.random.Generator) -> Instance:
        order = rng.permutation(len(NODES))
        chain, roots, rest = order[: k + 1], order[k + 1: k + N_ROOTS], order[k + N_ROOTS:]
        parent = np.empty(len(NODES), dtype=np.int64)
        parent[chain[0]] = chain[0]
        parent[chain[1:]] = chain[:-1]
        parent[roots] = roots
        placed = [*chain, *roots]
        for node in rest:
            parent[node] = placed[rng.integers(len(placed))]
            placed.append(node)
        prompt = "".join(NODES[p] for p in parent) + f"?{NODES[chain[-1]]}="
        return Instance(prompt=prompt, answer=NODES[chain[0]], k=k)

    def row_len(self, k: int) -> int:
        return len(NODES) + 3 + 1

    def space(self, k: int) -> int:
        return 10**9  # 16!/(16 − k − 3)! orderings of the chain and roots times the forests of the rest


register_task(Pointer())
