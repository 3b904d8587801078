"""Dr. GRPO with rollout-state reuse (LMDR §3.1 "Post-training", §5.4, Table 4; appendix A.2).

:func:`sample_rollouts` samples G responses per prompt at depth R with the exact ``per_visit`` KV cache and
keeps every input position's depth-R state (``generate(save_states=True)``); rewards come from
:mod:`looplm.rl.rewards`. Dr. GRPO (arXiv:2503.20783): A_i = r_i − mean_j r_j (no std), and

    L(θ) = −1 / (P · G · M) · Σ_prompts Σ_i A_i Σ_t log π_θ(y_i,t | x, y_i,<t),

M = ``max_new_tokens``; one update per batch, so ratio 1, no clipping, no KL. Each update method
(:data:`UPDATE_METHODS`, Table 4's rows) re-scores ``prompt + response[:-1]`` in one non-cached forward:
``bptt`` through all R recurrences; ``recompute`` (Neumann-b) replays R without gradient, then b with
gradient from sg(z^R); ``reuse`` runs the same b from the saved states (no replay). Both read out at R + b
(:func:`compare_methods` reports the policy gap to R); the saved states equal the non-cached replay to fp32
rounding (~1e-6). The update runs in eval mode (no dropout; Huginn's fixed initial-state table).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence, get_args

import torch

from looplm.eval.generate import generate
from looplm.model.cursor import NLL, Gradient
from looplm.rl.config import UpdateMethod
from looplm.rl.rewards import get_reward
from looplm.rl.task import Problem, decode, encode

UPDATE_METHODS: tuple[str, ...] = get_args(UpdateMethod)


@dataclass
class Rollouts:
    """G responses for each of P prompts, row-major (N = P·G rows): ``states`` (len(prompt) + len(response) − 1, d)
    per row at depth R or None, ``rewards`` (P, G), ``texts`` decoded up to EOS."""

    prompts: list[list[int]]
    responses: list[list[int]]
    states: list[torch.Tensor] | None
    rewards: torch.Tensor
    texts: list[str]

    @property
    def generated_tokens(self) -> int:
        return sum(len(r) for r in self.responses)

    @property
    def state_positions(self) -> int:
        """Positions whose state was saved (0 when none)."""
        return sum(s.shape[0] for s in self.states) if self.states is not None else 0

    def state_bytes(self) -> int:
        """Bytes of the saved states (0 when none were saved)."""
        return sum(s.numel() * s.element_size() for s in self.states) if self.states is not None else 0


def response_text(ids: Sequence[int], eos_id: int) -> str:
    """The decoded response up to (not including) the first EOS."""
    ids = list(ids)
    return decode(ids[:ids.index(eos_id)] if eos_id in ids else ids)


@torch.no_grad()
def sample_rollouts(model, problems: Sequence[Problem], *, group_size: int, depth: int, max_new_tokens: int,
                    reward: str = "exact_match", temperature: float = 1.0, seed: int = 0, eos_id: int,
                    save_states: bool = True) -> Rollouts:
    """Sample G = ``group_size`` responses per problem in one cached decode at depth R; M = ``max_new_tokens``;
    ``reward`` names a verifier of :data:`looplm.rl.rewards.REWARDS`; ``save_states`` (for ``reuse``)."""
    score = get_reward(reward)
    prompts = [encode(p.prompt) for p in problems for _ in range(group_size)]
    gen = generate(model, prompts, max_new_tokens, depth, temperature=temperature, seed=seed, eos_id=eos_id,
                   save_states=save_states)
    texts = [response_text(t, eos_id) for t in gen.tokens]
    answers = [p.answer for p in problems for _ in range(group_size)]
    rewards = torch.tensor([score(t, a) for t, a in zip(texts, answers)], dtype=torch.float32)
    return Rollouts(prompts=prompts, responses=gen.tokens, states=gen.states,
                    rewards=rewards.view(len(problems), group_size), texts=texts)


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO advantages A_i = r_i − mean_group(r): (P, G) → (P, G) (no std normalization)."""
    return rewards - rewards.mean(dim=1, keepdim=True)


def dr_grpo_loss(nll: torch.Tensor, advantages: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Dr. GRPO loss ``Σ_i A_i Σ_t nll_i,t / (N · M)`` from nll (N, L) (0 where nothing is scored), advantages (N,)."""
    return (advantages.to(nll.dtype)[:, None] * nll).sum() / (nll.shape[0] * max_new_tokens)


@dataclass
class ScoreBatch:
    """Scoring input: row i is ``pad · prompt_i · response_i[:-1] · pad`` (prompts end at column P_max − 1);
    ``idx``, ``mask``, ``targets`` (−100 off the response) (N, L); ``states`` (N, L, d) or None; ``advantages`` (N,)."""

    idx: torch.Tensor
    mask: torch.Tensor
    targets: torch.Tensor
    states: torch.Tensor | None
    advantages: torch.Tensor


def pack(rollouts: Rollouts, device: torch.device | str = "cpu") -> ScoreBatch:
    """The :class:`ScoreBatch` of ``rollouts`` (advantages from :func:`group_advantages`)."""
    P, n = max(map(len, rollouts.prompts)), max(map(len, rollouts.responses))
    N, L = len(rollouts.prompts), P + n - 1
    idx, mask = torch.zeros(N, L, dtype=torch.long), torch.zeros(N, L, dtype=torch.long)
    targets = torch.full((N, L), -100, dtype=torch.long)
    states = None
    if rollouts.states is not None:
        d = rollouts.states[0].shape[-1]
        states = torch.zeros(N, L, d, dtype=rollouts.states[0].dtype, device=rollouts.states[0].device)
    for i, (p, r) in enumerate(zip(rollouts.prompts, rollouts.responses)):
        seq = p + r[:-1]
        cols = slice(P - len(p), P - len(p) + len(seq))  # the prompt ends at column P − 1
        idx[i, cols], mask[i, cols] = torch.tensor(seq), 1
        targets[i, P - 1:P - 1 + len(r)] = torch.tensor(r)
        if states is not None:
            states[i, cols] = rollouts.states[i]
    adv = group_advantages(rollouts.rewards).flatten()
    return ScoreBatch(idx=idx.to(device), mask=mask.to(device), targets=targets.to(device),
                      states=None if states is None else states.to(device), advantages=adv.to(device))


def score(model, batch: ScoreBatch, method: str, *, depth: int, neumann_steps: int,
          state_depth: int | None = None) -> torch.Tensor:
    """Per-token NLL (N, L) of the sampled tokens under ``method`` (with its graph); b = ``neumann_steps``;
    ``state_depth``: T0 of the saved states (default R; ``reuse`` reads out at T0 + b).
    ValueError: an unknown method, or ``reuse`` without saved states."""
    if method not in UPDATE_METHODS:
        raise ValueError(f"method: unknown {method!r}; allowed: {', '.join(UPDATE_METHODS)}")
    if method == "reuse" and batch.states is None:
        raise ValueError("reuse: the rollouts carry no saved states (sample with save_states=True)")
    loop = model.loop(batch.idx, attention_mask=batch.mask)
    if method == "bptt":
        out = model.read(loop, depth, batch.targets, readout=NLL)
    else:
        T0 = depth if state_depth is None else state_depth
        if method == "reuse":
            loop.resume(T0, batch.states.detach())
        out = model.read(loop, T0 if method == "reuse" else depth, batch.targets,
                         gradient=Gradient("endpoint", neumann_steps), readout=NLL)
    return out.nll_by_depth[max(out.nll_by_depth)]


def update_gradient(model, batch: ScoreBatch, method: str, *, depth: int, neumann_steps: int,
                    max_new_tokens: int, state_depth: int | None = None) -> tuple[dict[str, float], torch.Tensor]:
    """Score + backward of the Dr. GRPO loss into ``.grad`` (zeroed first): ({"loss", "time_s", "nll_mean"}, nll)."""
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    nll = score(model, batch, method, depth=depth, neumann_steps=neumann_steps, state_depth=state_depth)
    loss = dr_grpo_loss(nll, batch.advantages, max_new_tokens)
    loss.backward()
    dt = time.perf_counter() - t0
    n_tok = int((batch.targets != -100).sum())
    stats = {"loss": float(loss.detach()), "time_s": dt, "nll_mean": float(nll.detach().sum()) / max(n_tok, 1)}
    return stats, nll.detach()


def flat_grad(model) -> torch.Tensor:
    """Every parameter's gradient (zeros where none) as one float64 vector, tied weights once (``parameters()``
    yields a shared tensor once)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double()
                      for p in model.parameters() if p.requires_grad])


def _cos(a: torch.Tensor, b: torch.Tensor) -> float | None:
    na, nb = float(a.norm()), float(b.norm())
    return None if na == 0.0 or nb == 0.0 else float(torch.dot(a, b)) / (na * nb)


def compare_methods(model, batch: ScoreBatch, *, depth: int, neumann_steps: int, max_new_tokens: int,
                    methods: Sequence[str] = UPDATE_METHODS) -> dict[str, Any]:
    """Every method's gradient on one batch (gradients left zeroed): ``{"time_s", "grad_norm", "cos": {"a|b"},
    "policy_gap"}``, the gap being mean |log π_{R+b} − log π_R| per response token."""
    grads, times, nlls = {}, {}, {}
    for m in methods:
        res, nlls[m] = update_gradient(model, batch, m, depth=depth, neumann_steps=neumann_steps,
                                       max_new_tokens=max_new_tokens)
        grads[m], times[m] = flat_grad(model), res["time_s"]
    model.zero_grad(set_to_none=True)
    cos = {f"{a}|{b}": _cos(grads[a], grads[b]) for i, a in enumerate(methods) for b in methods[i + 1:]}
    gap = None
    if "bptt" in nlls and len(nlls) > 1:
        other = next(m for m in methods if m != "bptt")
        keep = batch.targets != -100
        gap = float((nlls[other] - nlls["bptt"]).abs()[keep].mean())
    return {"time_s": times, "grad_norm": {m: float(g.norm()) for m, g in grads.items()}, "cos": cos,
            "policy_gap": gap}


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from n samples with c correct (Chen et al. 2021): 1 − C(n−c, k)/C(n, k)."""
    if k > n:
        raise ValueError(f"pass@k: k = {k} > n = {n} samples")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
