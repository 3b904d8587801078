"""Verifiable rewards: a string-keyed registry of ``reward(response, answer) -> float``.

``response`` is the decoded continuation up to EOS. Rewards are binary, as in Dr. GRPO (arXiv:2503.20783) and
LMDR §5.4: ``exact_match`` (equal after stripping whitespace) and ``numeric`` (the first number, ``,`` ignored,
equals the answer's within 1e-9 relative: ``"0357"``, ``"357.0"``, ``"= 357"`` match ``"357"``).
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
    m = _NUMBER.search(text)  # the pattern always parses as a float once its commas are dropped
    return None if m is None else float(m.group(0).replace(",", ""))


def numeric(response: str, answer: str) -> float:
    """1.0 iff the first number of the response equals the answer's (relative tolerance 1e-9)."""
    got, want = first_number(response), first_number(answer)
    if got is None or want is None:
        return 0.0
    return float(math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12))


REWARDS: dict[str, Reward] = {"exact_match": exact_match, "numeric": numeric}


def get_reward(name: str) -> Reward:
    """The reward registered as ``name``; ValueError (listing the known ones) for an unknown name."""
    if name not in REWARDS:
        raise ValueError(f"reward: unknown {name!r}; known: {', '.join(REWARDS)}")
    return REWARDS[name]
