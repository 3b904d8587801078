"""The config of a Dr. GRPO run (``looplm rl train``; torch-free): ``--rl.FIELD`` and ``--optim.FIELD``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from looplm.config import NonNegInt, OptimConfig, PositiveFloat, PositiveInt, RunSection, section_field as _f

#: update methods of :mod:`looplm.rl.grpo` (``grpo.UPDATE_METHODS``)
UpdateMethod = Literal["bptt", "recompute", "reuse"]
#: verifiers of :data:`looplm.rl.rewards.REWARDS`
RewardName = Literal["exact_match", "numeric"]
#: tasks of :data:`looplm.rl.task.TASKS`; "" = the starting checkpoint's task.json
RLTask = Literal["", "addition"]


@dataclass(frozen=True)
class RLConfig(RunSection):
    """A Dr. GRPO run (:func:`looplm.rl.runner.rl_train`): rollouts, the update method and its evaluation."""

    _prefix = "rl."
    method: UpdateMethod = _f("reuse", "update method: bptt (full), recompute (replay R, then Neumann-b) or reuse "
                              "(Neumann-b from the saved depth-R states)")
    depth: PositiveInt = _f(6, "R, the recurrence depth of sampling and of the BPTT / endpoint forward")
    neumann_steps: PositiveInt = _f(4, "b, recurrences with gradient of recompute and reuse (read out at R + b)")
    group_size: int = _f(8, "G, responses per prompt (Dr. GRPO needs >= 2)")
    prompts_per_update: PositiveInt = _f(16, "P, prompts per update")
    updates: PositiveInt = _f(100, "policy updates (one per batch of P x G rollouts)")
    train_problems: NonNegInt = _f(0, "0 = fresh problems every update; N = a fixed set of N, reshuffled each epoch")
    temperature: PositiveFloat = _f(1.0, "sampling temperature of rollouts and of the pass@k samples")
    reward: RewardName = _f("exact_match", "verifier: exact_match or numeric")
    seed: int = _f(0, "seed of the training prompts and rollout samples")
    task: RLTask = _f("", "the task (default: the starting checkpoint's task.json)")
    digits: NonNegInt = _f(0, "the task's operand width D (0 = the starting checkpoint's task.json)")
    eval_problems: PositiveInt = _f(500, "held-out problems evaluated before and after")
    eval_samples: PositiveInt = _f(8, "samples per held-out problem (pass@1 and pass@n)")
    eval_seed: int = _f(0, "seed of the evaluation samples (the same for every run, so runs are paired)")
    compare_every: NonNegInt = _f(10, "every this many updates, compare the three methods' gradients (0 = never)")
    ckpt_every: NonNegInt = _f(25, "checkpoint every this many updates (0 = only at the end)")
    # after 10 warm-up updates a constant lr 1e-4; betas (0.9, 0.98); no weight decay
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig(lr=1e-4, warmup_steps=10, min_lr_ratio=1.0, weight_decay=0.0, beta2=0.98))

    def validate(self) -> None:
        self.require(self.group_size >= 2, "group_size", f"Dr. GRPO needs >= 2 responses per prompt, got "
                     f"{self.group_size}")
