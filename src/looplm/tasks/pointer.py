"""Pointer chasing to a root: a two-tree forest over 26 nodes, k = the hops from the queried node to its root.

Nodes ``a … z``; the prompt lists each node's parent in node order (a root is its own parent), then the query:
``"<26 parents>?q="``, answer the root of q (one token). Each tree has 13 nodes and holds a chain of exactly k hops
(the queried one ends at q); its other 12 − k nodes attach, in a random order, to a uniformly chosen node of the
same tree placed before them. Both trees have the same size and a k-hop chain, so no count tells the roots apart:
only following q's pointers does (a first design, three roots and unequal trees, reached 76% valid accuracy without
following pointers: test accuracy rose with k, as the queried tree grows with k). Unlike the other families the
prompt has the same length at every k, so k beyond training asks for more hops, never for unseen positions (the
addition headline's k > k_train failure is positional). Our design, after the pointer-chasing tasks of the looped-
model literature; sizes our choice.
"""

from __future__ import annotations

import numpy as np

from looplm.tasks.base import Instance, TaskFamily, register_task

NODES = "abcdefghijklmnopqrstuvwxyz"
TREE = len(NODES) // 2  # nodes per tree


@register_task
class Pointer(TaskFamily):
    name = "pointer"
    max_k = TREE - 1

    def make(self, k: int, rng: np.random.Generator) -> Instance:
        parent = np.empty(len(NODES), dtype=np.int64)
        trees = rng.permutation(len(NODES)).reshape(2, TREE)  # trees[0] holds the query
        for tree in trees:
            chain, rest = tree[: k + 1], tree[k + 1:]
            parent[chain[0]] = chain[0]
            parent[chain[1:]] = chain[:-1]
            for i, node in enumerate(rest):
                parent[node] = tree[rng.integers(k + 1 + i)]
        prompt = "".join(NODES[p] for p in parent) + f"?{NODES[trees[0][k]]}="
        return Instance(prompt=prompt, answer=NODES[trees[0][0]], k=k)

    def row_len(self, k: int) -> int:
        return len(NODES) + 3 + 1

    def space(self, k: int) -> int:
        return 10**9  # 26! / (13!)**2 tree splits times their chains and attachments
