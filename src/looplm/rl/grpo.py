"""Dr. GRPO with rollout-state reuse (LMDR §3.1 "Post-training", §5.4, Table 4; appendix A.2).

**Rollouts.** :func:`sample_rollouts` samples G responses per prompt at a fixed recurrence depth R with
the KV cache (:func:`looplm.eval.generate.generate`, ``per_visit``, so decoding is exact) and keeps, for every
position whose forward ran, the hidden state at depth R — the state the readout saw
(``generate(save_states=True)``): the prompt's positions from the prefill, each fed-back response
token's from its decode step. Rewards come from a registered verifier (:mod:`looplm.rl.rewards`).

**Dr. GRPO** (Liu et al., "Understanding R1-Zero-Like Training", arXiv:2503.20783). For a prompt with
rewards r_1 … r_G, the advantage is A_i = r_i − mean_j r_j (no division by the group's std); the
loss sums each response's token log-probabilities without dividing by its length:

    L(θ) = −1 / (P · G · M) · Σ_prompts Σ_i A_i Σ_t log π_θ(y_i,t | x, y_i,<t),

with P prompts per update and M = ``max_new_tokens``, the constant that replaces the per-response
length 1/|y_i| of GRPO. One policy update per batch of rollouts, so the importance ratio is 1 and the
clipped surrogate's gradient is the one of L (no ratio or clipping is formed; no KL term, as Dr. GRPO).

**Update methods** (:data:`UPDATE_METHODS`; Table 4's rows). Each re-scores the sampled tokens with one
non-cached forward over ``prompt + response[:-1]`` (:meth:`looplm.model.LoopLM.forward`, the one loop)
and back-propagates L:

- ``bptt``: full BPTT, the forward at depth R with gradient through all R recurrences (D̃_R);
- ``recompute``: recompute + Neumann-b, R recurrences replayed without gradient to the endpoint z^R,
  then b recurrences with gradient from sg(z^R) (``Gradient("endpoint", b)``);
- ``reuse``: reuse + Neumann-b, the same b recurrences from the saved rollout states
  (:meth:`~looplm.model.cursor.Loop.resume` at R from the saved states): no replay.

Reuse and recompute both read the log-probabilities out at z̄^b, i.e. after R + b recurrences, as the
paper's "apply b recurrences from z̄" (its gradient is Σ_{k<b} J^k B along z̄ = Σ_{k<b} J_R^k B_R at a
fixed point); the tokens were sampled from the readout at R, so π_{R+b} and π_R differ by how far z^R is
from a fixed point (:func:`compare_methods` reports that gap). When the saved states equal the replay's,
reuse and recompute compute the same numbers (the replayed endpoint enters through the same detach). The
saved states equal a teacher-forced replay through the same cached decoding bit for bit, and the
non-cached replay of ``recompute`` to fp32 rounding (~1e-6: a decode step multiplies one row where the
full forward multiplies all of them, and CPU matmul kernels then sum in a different order).

The update runs the model in evaluation mode: dropout off, and the Huginn Gaussian initial state from
the fixed table the sampler used, so ``bptt`` and ``recompute`` replay the trajectory that was sampled.
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


# ---------------------------------------------------------------------------------------------- rollouts


@dataclass
class Rollouts:
    """G sampled responses for each of P prompts (row-major: prompt p's responses are rows p·G … p·G+G−1).

    Attributes:
        prompts: N = P·G prompt id lists (each prompt repeated G times).
        responses: N response id lists (the EOS id included when emitted).
        states: N tensors (len(prompt) + len(response) − 1, d): the depth-R states of the rollout, or
            None when not saved.
        rewards: (P, G) float32.
        texts: N decoded responses (up to the EOS).
        depth: the sampling depth R.
        group_size: G.
    """

    prompts: list[list[int]]
    responses: list[list[int]]
    states: list[torch.Tensor] | None
    rewards: torch.Tensor
    texts: list[str]
    depth: int
    group_size: int

    @property
    def generated_tokens(self) -> int:
        return sum(len(r) for r in self.responses)

    @property
    def state_positions(self) -> int:
        """Positions whose state was saved (prompt positions + fed-back response tokens; 0 when none)."""
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
    """Sample ``group_size`` responses per problem in one cached, batched decode at depth ``depth``.

    Args:
        model: a looped model (put in eval mode by :func:`looplm.eval.generate.generate`).
        problems: P problems.
        group_size: G responses per prompt.
        depth: the recurrence depth R of every forward.
        max_new_tokens: M, the response budget (and Dr. GRPO's normalizer).
        reward: a name in :data:`looplm.rl.rewards.REWARDS`.
        temperature: sampling temperature (no top-k/top-p).
        seed: seed of the sampling generator.
        eos_id: the id that ends a response.
        save_states: keep each row's depth-R states (needed by ``reuse``).

    Returns:
        :class:`Rollouts`.
    """
    score = get_reward(reward)
    prompts = [encode(p.prompt) for p in problems for _ in range(group_size)]
    gen = generate(model, prompts, max_new_tokens, depth, temperature=temperature, seed=seed, eos_id=eos_id,
                   save_states=save_states)
    texts = [response_text(t, eos_id) for t in gen.tokens]
    answers = [p.answer for p in problems for _ in range(group_size)]
    rewards = torch.tensor([score(t, a) for t, a in zip(texts, answers)], dtype=torch.float32)
    return Rollouts(prompts=prompts, responses=gen.tokens, states=gen.states,
                    rewards=rewards.view(len(problems), group_size), texts=texts, depth=depth,
                    group_size=group_size)


# ---------------------------------------------------------------------------------------------- Dr. GRPO


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO advantages A_i = r_i − mean_group(r): (P, G) → (P, G) (no std normalization)."""
    return rewards - rewards.mean(dim=1, keepdim=True)


def dr_grpo_loss(nll: torch.Tensor, advantages: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """The Dr. GRPO loss from per-token NLLs (module docstring).

    Args:
        nll: (N, L) per-token −log π of the response tokens (0 at positions that score nothing).
        advantages: (N,) per-response advantages (rows in the order of ``nll``; N = P·G).
        max_new_tokens: M, the per-response token budget.

    Returns:
        Scalar ``Σ_i A_i Σ_t nll_i,t / (N · M)``: −1/(P·G·M) Σ A_i Σ_t log π.
    """
    return (advantages.to(nll.dtype)[:, None] * nll).sum() / (nll.shape[0] * max_new_tokens)


@dataclass
class ScoreBatch:
    """The scoring forward's input for N responses (left-padded prompts, right-padded responses).

    Row i is ``pad · prompt_i · response_i[:-1] · pad``; every prompt ends at column P_max − 1, so
    response token j is read out at column P_max − 1 + j.

    Attributes:
        idx: (N, L) int64 token ids (0 at padding).
        mask: (N, L) int64 attention mask (1 = real token).
        targets: (N, L) int64: response token j at column P_max − 1 + j, −100 elsewhere.
        states: (N, L, d) the rollout's saved depth-R states at the real positions (0 at padding), or None.
        advantages: (N,) float32.
    """

    idx: torch.Tensor
    mask: torch.Tensor
    targets: torch.Tensor
    states: torch.Tensor | None
    advantages: torch.Tensor


def pack(rollouts: Rollouts, device: torch.device | str = "cpu") -> ScoreBatch:
    """The :class:`ScoreBatch` of ``rollouts`` (advantages from :func:`group_advantages`)."""
    P = max(len(p) for p in rollouts.prompts)
    n = max(len(r) for r in rollouts.responses)
    N, L = len(rollouts.prompts), P + n - 1
    idx = torch.zeros(N, L, dtype=torch.long)
    mask = torch.zeros(N, L, dtype=torch.long)
    targets = torch.full((N, L), -100, dtype=torch.long)
    states = None
    if rollouts.states is not None:
        d = rollouts.states[0].shape[-1]
        states = torch.zeros(N, L, d, dtype=rollouts.states[0].dtype, device=rollouts.states[0].device)
    for i, (p, r) in enumerate(zip(rollouts.prompts, rollouts.responses)):
        seq = p + r[:-1]
        idx[i, P - len(p):P - len(p) + len(seq)] = torch.tensor(seq)
        mask[i, P - len(p):P - len(p) + len(seq)] = 1
        targets[i, P - 1:P - 1 + len(r)] = torch.tensor(r)
        if states is not None:
            states[i, P - len(p):P - len(p) + len(seq)] = rollouts.states[i]
    adv = group_advantages(rollouts.rewards).flatten()
    dev = torch.device(device)
    return ScoreBatch(idx=idx.to(dev), mask=mask.to(dev), targets=targets.to(dev),
                      states=None if states is None else states.to(dev), advantages=adv.to(dev))


def score(model, batch: ScoreBatch, method: str, *, depth: int, neumann_steps: int,
          state_depth: int | None = None) -> torch.Tensor:
    """Per-token NLL (N, L) of the sampled tokens under ``method``, with the method's autograd graph.

    Args:
        model: the policy (a looped model).
        batch: :func:`pack`'s output (``states`` needed by ``reuse``).
        method: ``bptt``, ``recompute`` or ``reuse`` (module docstring).
        depth: R, the sampling depth.
        neumann_steps: b of ``recompute`` / ``reuse`` (ignored by ``bptt``).
        state_depth: the depth T0 the saved states are at (default R); ``reuse`` reads out at T0 + b.

    Raises:
        ValueError: an unknown method, or ``reuse`` without saved states.
    """
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
    """Score + backward of the Dr. GRPO loss into ``model``'s ``.grad`` (zeroed first), timed.

    Returns:
        ``({"loss", "time_s" (scoring + backward, wall seconds), "nll_mean" (mean −log π per response
        token)}, the per-token NLL (N, L), detached)``.
    """
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
    """Every parameter's gradient (zeros where none) as one float64 vector, tied weights once."""
    seen, parts = set(), []
    for p in model.parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        parts.append((p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double())
    return torch.cat(parts)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float | None:
    na, nb = float(a.norm()), float(b.norm())
    return None if na == 0.0 or nb == 0.0 else float(torch.dot(a, b)) / (na * nb)


def compare_methods(model, batch: ScoreBatch, *, depth: int, neumann_steps: int, max_new_tokens: int,
                    methods: Sequence[str] = UPDATE_METHODS) -> dict[str, Any]:
    """Every method's gradient on one batch: timings, whole-model cosines between each pair, norms, and
    the policy gap (mean |log π_{R+b} − log π_R| per response token, the Neumann readout against the
    sampling readout). Leaves ``model``'s gradients zeroed.

    Returns:
        ``{"time_s": {method: s}, "grad_norm": {method: ‖g‖}, "cos": {"a|b": cosine},
        "policy_gap": float | None}``.
    """
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
