"""``pointer_forest``: ``pointer_pairs`` over a four-tree forest, so that recognising the roots pays 25%, not 50%.

Motivation (experiments/depth-testbed, probes 20–21): on ``pointer_pairs`` (two trees) a looped model supervised
at every loop makes the first hop at 100% but never the second; loop 2 attends to the roots' self-loop edges
``x→x`` instead, a content shortcut that needs nothing loop 1 wrote and earns a coin flip between the two roots
(so does the bag-of-edges shortcut, "a parent that is never a child"). With F = 4 trees either shortcut earns
1/4, so composing the look-ups pays three times as much as it.

Our design (sizes our choice): 32 nodes (``FOREST_NODES``: ``a … z``, ``0 … 5``), four trees of 8 nodes, each
holding a chain of exactly k hops (the queried one ends at q) and the other 7 − k nodes attached to an earlier
node of their tree (``pointer.forest`` with ``n_trees=4``): all trees the same size, each with a k-hop chain,
so no count tells the roots apart. Each edge child → parent is one token (:func:`forest_token`, 1,024 tokens
U+4E00 + 32·child + parent, apart from ``pointer_pairs``' U+0100 … U+01FF; a root is its own parent); the prompt
is the 32 edge tokens in random order, then ``"?q"``, and the answer, the root of q, is read at q itself. 34
prompt tokens at every k (k ≤ 7).

U+4E00 … U+51FF (CJK ideographs) rather than U+0400 on: that block holds combining marks, format (bidi)
characters and unassigned code points; these are 1,024 assigned letters (category Lo), one token each.
"""

from __future__ import annotations

from looplm.data.tokenizer import CharVocab
from looplm.tasks.base import CHARS, EOT, register_task
from looplm.tasks.pointer import PointerPairs, pair_of, pair_token

FOREST_NODES = "abcdefghijklmnopqrstuvwxyz012345"
N_TREES = 4
FOREST_BASE = 0x4E00


def forest_token(child: int, parent: int) -> str:
    """:func:`~looplm.tasks.pointer.pair_token` over ``FOREST_NODES`` from ``FOREST_BASE``."""
    return pair_token(child, parent, len(FOREST_NODES), FOREST_BASE)


def forest_pair(token: str) -> tuple[int, int]:
    """``(child, parent)`` of a :func:`forest_token`."""
    return pair_of(token, len(FOREST_NODES), FOREST_BASE)


@register_task
class PointerForest(PointerPairs):
    name = "pointer_forest"
    nodes, n_trees = FOREST_NODES, N_TREES
    max_k = len(FOREST_NODES) // N_TREES - 1
    vocab = CharVocab(CHARS + "".join(forest_token(c, p) for c in range(len(FOREST_NODES))
                                      for p in range(len(FOREST_NODES))), EOT)

    def edge(self, child: int, parent: int) -> str:
        return forest_token(child, parent)
