"""Pointer chasing to a root: a two-tree forest, k = the hops from the queried node to its root.

``pointer`` addresses nodes by position; ``pointer_edges`` by content (an edge list in random order);
``pointer_pairs`` by content with each edge one token.

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

from looplm.data.tokenizer import CharVocab
from looplm.tasks.base import CHARS, EOT, Instance, TaskFamily, register_task

NODES = "abcdefghijklmnopqrstuvwxyz"
TREE = len(NODES) // 2  # nodes per tree


def forest(n: int, k: int, rng: np.random.Generator, n_trees: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """``(parent, trees)``: ``n_trees`` trees of n/n_trees nodes over ``range(n)``, each with a chain of exactly k
    hops ending at ``trees[i][k]`` (``trees[0]`` holds the query); the other nodes attach to an earlier node of
    their tree. The same draws for every ``n_trees``: two trees give what they gave before the argument."""
    parent = np.empty(n, dtype=np.int64)
    trees = rng.permutation(n).reshape(n_trees, n // n_trees)
    for tree in trees:
        chain, rest = tree[: k + 1], tree[k + 1:]
        parent[chain[0]] = chain[0]
        parent[chain[1:]] = chain[:-1]
        for i, node in enumerate(rest):
            parent[node] = tree[rng.integers(k + 1 + i)]
    return parent, trees


@register_task
class Pointer(TaskFamily):
    name = "pointer"
    max_k = TREE - 1

    def make(self, k: int, rng: np.random.Generator) -> Instance:
        parent, trees = forest(len(NODES), k, rng)
        prompt = "".join(NODES[p] for p in parent) + f"?{NODES[trees[0][k]]}="
        return Instance(prompt=prompt, answer=NODES[trees[0][0]], k=k)

EDGE_NODES = NODES[:16]


@register_task
class PointerEdges(TaskFamily):
    """The same forest over 16 nodes (two trees of 8) as an edge list: ``"<child><parent>;"`` per node in random
    order (a root is its own parent), then ``"?q="``. Each hop is a look-up by content (find q's edge), so one
    loop can follow one pointer whatever the positions; past the root more hops change nothing (a fixed point).
    Its subclasses change ``nodes``, ``n_trees``, :meth:`edge` and the query's ``end``."""

    name = "pointer_edges"
    nodes, n_trees, end = EDGE_NODES, 2, "="
    max_k = len(EDGE_NODES) // 2 - 1

    def edge(self, child: int, parent: int) -> str:
        return f"{self.nodes[child]}{self.nodes[parent]};"

    def edges(self, parent: np.ndarray, rng: np.random.Generator) -> str:
        """Every node's edge, in a random order."""
        return "".join(self.edge(c, parent[c]) for c in rng.permutation(len(self.nodes)))

    def make(self, k: int, rng: np.random.Generator) -> Instance:
        parent, trees = forest(len(self.nodes), k, rng, self.n_trees)
        edges = self.edges(parent, rng)
        return Instance(prompt=f"{edges}?{self.nodes[trees[0][k]]}{self.end}", answer=self.nodes[trees[0][0]], k=k)


def pair_token(child: int, parent: int, n: int = len(EDGE_NODES), base: int = 0x100) -> str:
    """The token of the edge child → parent (indices of n nodes): one of n² letters from ``base`` on (U+0100 for
    ``pointer_pairs``' 16 nodes)."""
    return chr(base + n * child + parent)


def pair_of(token: str, n: int = len(EDGE_NODES), base: int = 0x100) -> tuple[int, int]:
    """``(child, parent)`` of a :func:`pair_token`."""
    return divmod(ord(token) - base, n)


@register_task
class PointerPairs(PointerEdges):
    """``pointer_edges`` with each edge ``<child><parent>`` one token (:func:`pair_token`; a vocabulary of the
    shared characters and the 256 pairs), then ``"?q"``, the answer read at q itself: a hop is one attention
    look-up (match q against the edge tokens' child, read their parent) from the first loop on, with no
    induction-head composition and no copy of q to learn first. 18 prompt tokens."""

    name = "pointer_pairs"
    end = ""
    vocab = CharVocab(CHARS + "".join(pair_token(c, p) for c in range(len(EDGE_NODES))
                                      for p in range(len(EDGE_NODES))), EOT)

    def edge(self, child: int, parent: int) -> str:
        return pair_token(child, parent)


def _hops(parent: np.ndarray) -> np.ndarray:
    """Hops from each node to its root (``parent[root] == root``)."""
    hops = np.zeros(len(parent), dtype=np.int64)
    for v in range(len(parent)):
        u = v
        while parent[u] != u:
            u, hops[v] = parent[u], hops[v] + 1
    return hops


@register_task
class PointerPairsMQ(PointerPairs):
    """``pointer_pairs`` whose training rows carry up to ``queries`` queries, each answer scored (multi-query
    associative recall, Zoology, arXiv:2312.04927): ``"<edges>?xr?ys?q"``. The extra queries are nodes of
    either tree 1 … k_train hops from their root, never q nor one of q's ancestors (whose answer would shorten
    q's chain). Held-out instances are single-query, as in ``pointer_pairs``: the extra queries only add
    training signal (probe 13: one scored answer per row did not learn the look-up)."""

    name = "pointer_pairs_mq"
    queries = 4

    def make_train(self, k: int, k_train: int, rng: np.random.Generator) -> Instance:
        parent, trees = forest(len(EDGE_NODES), k, rng)
        hops, chain = _hops(parent), set(trees[0][: k + 1].tolist())
        pool = [v for v in range(len(EDGE_NODES)) if v not in chain and 1 <= hops[v] <= k_train]
        extra = rng.permutation(pool)[: int(rng.integers(self.queries))]
        edges = self.edges(parent, rng)
        roots = {v: EDGE_NODES[trees[0][0] if v in trees[0] else trees[1][0]] for v in extra.tolist()}
        prompt = edges + "".join(f"?{EDGE_NODES[v]}{roots[v]}" for v in extra.tolist())
        targets = tuple((j - 1, prompt[j]) for j in (len(edges) + 3 * i + 2 for i in range(len(extra))))
        return Instance(prompt=prompt + f"?{EDGE_NODES[trees[0][k]]}", answer=EDGE_NODES[trees[0][0]], k=k,
                        targets=targets)

    def views(self, inst: Instance) -> list[tuple[int, str]]:
        edges, *queries = inst.prompt.split("?")
        parent = np.empty(len(EDGE_NODES), dtype=np.int64)
        for c, p in map(pair_of, edges):
            parent[c] = p
        hops = _hops(parent)
        return [(int(hops[EDGE_NODES.index(qa[0])]), f"{edges}?{qa[0]}") for qa in queries]
