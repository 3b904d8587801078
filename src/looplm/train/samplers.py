"""Depth samplers (SPEC §5): one loop depth per microbatch, a pure function of (seed, step, micro).

Because a draw depends only on (seed, step, micro), every distributed rank draws the same depth and a
resumed run draws exactly the depths the uninterrupted run would have drawn.
"""

from __future__ import annotations

import hashlib

import numpy as np

from looplm.config import TrainConfig


def _rng(seed: int, step: int, micro: int, stream: str) -> np.random.Generator:
    digest = hashlib.sha256(f"{stream}:{seed}:{step}:{micro}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


class DepthSampler:
    """Base class: ``sample(seed, step, micro) -> T`` and the largest depth it can return."""

    name = ""

    def sample(self, seed: int, step: int, micro: int = 0) -> int:
        raise NotImplementedError

    @property
    def max_depth(self) -> int:
        raise NotImplementedError


class FixedDepth(DepthSampler):
    """Always T = depth."""

    name = "fixed"

    def __init__(self, depth: int):
        if depth < 1:
            raise ValueError(f"train.depth: must be >= 1, got {depth}")
        self.depth = depth

    def sample(self, seed, step, micro=0):
        return self.depth

    @property
    def max_depth(self):
        return self.depth


class UniformDepth(DepthSampler):
    """T ~ Uniform{lo, …, hi} (inclusive); SCSE trains with 1..8."""

    name = "uniform"

    def __init__(self, lo: int, hi: int):
        if not 1 <= lo <= hi:
            raise ValueError(f"train.depth_lo/depth_hi: need 1 <= lo <= hi, got {lo}..{hi}")
        self.lo, self.hi = lo, hi

    def sample(self, seed, step, micro=0):
        return int(_rng(seed, step, micro, "depth").integers(self.lo, self.hi + 1))

    @property
    def max_depth(self):
        return self.hi


SAMPLERS = {"fixed": FixedDepth, "uniform": UniformDepth}


def build_sampler(cfg: TrainConfig) -> DepthSampler:
    """The sampler named by ``cfg.depth_sampler``.

    Raises:
        KeyError: unknown sampler name (lists the known ones).
    """
    if cfg.depth_sampler == "fixed":
        return FixedDepth(cfg.depth)
    if cfg.depth_sampler == "uniform":
        return UniformDepth(cfg.depth_lo, cfg.depth_hi)
    raise KeyError(f"train.depth_sampler: unknown {cfg.depth_sampler!r}; known: {', '.join(SAMPLERS)}")
