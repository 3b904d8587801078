"""The config of a Dr. GRPO run (``looplm rl train``; torch-free): ``--rl.FIELD`` and ``--optim.FIELD``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from looplm.config import OptimConfig, RunSection, section_field as _f

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
    depth: int = _f(6, "R, the recurrence depth of sampling and of the BPTT / endpoint forward")
    neumann_steps: int = _f(4, "b, recurrences with gradient of recompute and reuse (read out at R + b)")
    group_size: int = _f(8, "G, responses per prompt (Dr. GRPO needs >= 2)")
    prompts_per_update: int = _f(16, "P, prompts per update")
    updates: int = _f(100, "policy updates (one per batch of P x G rollouts)")
    train_problems: int = _f(0, "0 = fresh problems every update; N = a fixed set of N, reshuffled each epoch")
    temperature: float = _f(1.0, "sampling temperature of rollouts and of the pass@k samples")
    reward: RewardName = _f("exact_match", "verifier: exact_match or numeric")
    seed: int = _f(0, "seed of the training prompts and rollout samples")
    task: RLTask = _f("", "the task (default: the starting checkpoint's task.json)")
    digits: int = _f(0, "the task's operand width D (0 = the starting checkpoint's task.json)")
    eval_problems: int = _f(500, "held-out problems evaluated before and after")
    eval_samples: int = _f(8, "samples per held-out problem (pass@1 and pass@n)")
    eval_seed: int = _f(0, "seed of the evaluation samples (the same for every run, so runs are paired)")
    compare_every: int = _f(10, "every this many updates, compare the three methods' gradients (0 = never)")
    ckpt_every: int = _f(25, "checkpoint every this many updates (0 = only at the end)")
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig(lr=1e-4, warmup_steps=10, min_lr_ratio=1.0, weight_decay=0.0, beta2=0.98),
        metadata={"help": "AdamW and its schedule (RL's defaults: lr 1e-4 after 10 warm-up updates, then constant; "
                          "betas (0.9, 0.98); no weight decay)"})

    def validate(self) -> None:
        self.at_least(1, "depth", "neumann_steps", "updates", "prompts_per_update", "eval_problems", "eval_samples")
        self.at_least(0, "train_problems", "digits", "compare_every", "ckpt_every")
        self.require(self.group_size >= 2, "group_size", f"Dr. GRPO needs >= 2 responses per prompt, got "
                     f"{self.group_size}")
        self.require(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
