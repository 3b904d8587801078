"""Verifiable rewards: a string-keyed registry of ``reward(response, answer) -> float``.

``response`` is the decoded continuation (the EOS newline and anything after it removed), ``answer`` the
problem's reference text. Both shipped rewards are binary (1.0 correct, 0.0 otherwise), as in the
verifiable-reward RL of Dr. GRPO (Liu et al., arXiv:2503.20783) and LMDR §5.4:

- ``exact_match``: the response equals the answer after stripping surrounding whitespace;
- ``numeric``: the first number in the response (optional sign, digits, optional decimal part,
  thousands separators ``,`` ignored) equals the answer's number within 1e-9 relative tolerance; so
  ``"0357"``, ``"357.0"`` and ``"= 357"`` all match ``"357"``; a response without a number scores 0.

Add a reward by registering a function in :data:`REWARDS`; :func:`get_reward` fails on an unknown name
and lists the known ones.
"""

from __future__ import annotations

import math
import re
from typing import Callable

Reward = Callable[[str, str], float]

_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*)(?:\.\d+)?|[-+]?\.\d+")


def exact_match(response: str, answer: str) -> float:
    """1.0 iff ``response.strip() == answer.strip()``."""
    return float(response.strip() == answer.strip())


def first_number(text: str) -> float | None:
    """The first number in ``text`` as a float (commas dropped), or None."""
    m = _NUMBER.search(text)
    if m is None:
        return None
    try:
        return float(m.group(0).replace(",", ""))
    except ValueError:
        return None


def numeric(response: str, answer: str) -> float:
    """1.0 iff the first number of the response equals the answer's (relative tolerance 1e-9)."""
    got, want = first_number(response), first_number(answer)
    if got is None or want is None:
        return 0.0
    return float(math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12))


REWARDS: dict[str, Reward] = {"exact_match": exact_match, "numeric": numeric}


def get_reward(name: str) -> Reward:
    """The reward registered as ``name``.

    Raises:
        ValueError: unknown name (lists the known ones).
    """
    if name not in REWARDS:
        raise ValueError(f"reward: unknown {name!r}; known: {', '.join(REWARDS)}")
    return REWARDS[name]
