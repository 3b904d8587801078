"""Autoregressive generation with a KV cache: fixed depth or per-token adaptive depth (SPEC §6).

Prompts are left-padded and prefilled in one cached forward (padded keys masked), then one token per
step is fed through the cache (:class:`~looplm.model.kvcache.KVCache`, ``per_visit`` or ``terminal``).
``temperature=0`` is greedy; else top-k, then top-p, then a draw from a ``torch.Generator`` seeded with
``seed``. Rows that emit ``eos_id`` stop (EOS kept). ``len(prompt) + max_new_tokens − 1 ≤ seq_len``, else
``ValueError`` (nothing is truncated).

With an ``exit_criterion`` (:mod:`looplm.eval.exits`) the prompt is prefilled at ``max_depth`` and each
token loops until its criterion fires, in :func:`~looplm.eval.exits.exit_loop`; an exited row is frozen
and its later visits copy its exit visit's K/V forward (:meth:`AttentionScope.freeze`). Criteria that
read logits read out without recording in the cache.

``save_states`` (rollout-state reuse, LMDR §3.1/§5.4) returns each row's depth-R states of every input
position of a forward over ``prompt + tokens[:-1]``; ``forced`` replays given continuations. ``static_step``
(issue 28 §1) runs each fixed-depth ``per_visit`` token step as one static region
(:class:`~looplm.model.static_decode.DecodeStep`). A ``student`` prefills through the distilled prefill
(LMDR §3.2, §5.5) into a ``terminal`` cache. ``Generation.depths[i][j]``: loop steps of the forward that
gave token j (the prefill depth for j = 0; 1 for a distilled prefill).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Sequence

import torch

from looplm.eval.exits import EXIT_CRITERIA, ExitCriterion, build_exit_criterion, check_criterion, exit_loop
from looplm.model import eval_mode
from looplm.model.cursor import Readout
from looplm.model.kvcache import CacheMode, KVCache, check_cache_mode
from looplm.model.static_decode import DecodeStep, StaticKVCache, StepHow


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Top-k (ties kept), then top-p (Holtzman et al. 2020; top-1 always kept): removed entries become −inf.
    (B, V) → (B, V). Raises ValueError for top_k < 1 or top_p outside (0, 1]."""
    if top_k is not None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        k = min(top_k, logits.shape[-1])
        kth = logits.topk(k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p is not None:
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
        probs = sorted_logits.float().softmax(-1)
        before = probs.cumsum(-1) - probs  # probability mass ranked above each token
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, -math.inf)
    return logits


def next_tokens(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B,) int64 tokens from (B, V) logits: argmax at temperature 0, else a draw from
    softmax(filter_logits(logits / temperature)). Raises ValueError for a negative temperature."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return logits.argmax(-1)
    probs = filter_logits(logits.float() / temperature, top_k, top_p).softmax(-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class Generation:
    """Per prompt: new ``tokens``, loop ``depths`` per token, ``states`` ((len(prompt) + len(tokens) − 1, d)
    with ``save_states``)."""

    tokens: list[list[int]] = field(default_factory=list)
    depths: list[list[int]] = field(default_factory=list)
    states: list[torch.Tensor] | None = None


def _left_pad(prompts: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) int64 ids (pad id 0) and (B, P) int64 attention mask (0 = left padding)."""
    P = max(len(p) for p in prompts)
    idx = torch.tensor([[0] * (P - len(p)) + list(p) for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    return idx.to(device), mask.to(device)


def adaptive_decode_step(model, idx: torch.Tensor, cache: KVCache, max_depth: int,
                         criterion: ExitCriterion) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed idx (B, 1) through ``cache`` with per-token early exit (:func:`exit_loop`, exited rows frozen):
    (logits (B, V) at each row's exit state, depth (B,) int64 loop steps run)."""
    loop = model.loop(idx, cache=cache)
    res = exit_loop(loop, criterion, max_depth, drop=False)
    out = model.readout(res.h, final=True, scope=loop.scope)[:, -1]  # (B, V), each row at its own exit state
    loop.scope.commit()
    return out, res.depth


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, depth: int, *,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             cache_mode: CacheMode = "per_visit", exit_criterion: ExitCriterion | None = None,
             max_depth: int | None = None, eos_id: int | None = None, save_states: bool = False,
             forced: Sequence[Sequence[int]] | None = None, student=None,
             student_depth: int | None = None, static_step: StepHow | None = None) -> Generation:
    """Continue B prompts (non-empty token-id lists) at loop depth ``depth`` (module docstring); ``model`` is
    a shared LoopLM, put in eval mode and restored. ``max_depth``: the adaptive ceiling and prefill depth
    (default ``depth``); ``student_depth``: the student's R (default ``depth``).

    Raises:
        ValueError: a bad argument or combination (:func:`_check_request` names it), the unshared architecture,
            or a prompt + continuation longer than seq_len.
    """
    ceiling = _check_request(model, prompts, max_new_tokens, depth, cache_mode=cache_mode,
                             exit_criterion=exit_criterion, max_depth=max_depth, save_states=save_states,
                             forced=forced, student=student, static_step=static_step)
    if forced is not None:  # a row stops at the end of its continuation
        forced = [list(f[:max_new_tokens]) for f in forced]
    result = Generation(tokens=[[] for _ in prompts], depths=[[] for _ in prompts])
    if max_new_tokens == 0:
        return result
    states = _States(prompts, depth) if save_states else None
    hook = states.hook if save_states else None
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(int(seed))
    with eval_mode(model):
        idx, mask = _left_pad(prompts, device)
        # capacity: the padded prompt and the new tokens (the last one is never fed back), not seq_len
        cache = KVCache(cache_mode, max_len=idx.shape[1] + max_new_tokens)
        logits, prefill_depth = _prefill(model, idx, mask, cache, ceiling if exit_criterion is not None else depth,
                                         student=student, student_depth=student_depth or depth, on_depth=hook)
        advance = _token_step(model, cache, depth, ceiling=ceiling, exit_criterion=exit_criterion,
                              static_step=static_step if max_new_tokens > 1 else None,
                              capacity=idx.shape[1] + max_new_tokens - 1, states=states)
        _decode(result, logits, prefill_depth, advance, lambda lg: next_tokens(lg, temperature, top_k, top_p, gen),
                max_new_tokens=max_new_tokens, eos_id=eos_id, forced=forced)
    if states is not None:
        result.states = [torch.cat(parts) for parts in states.parts]
    return result


class _States:
    """``save_states``: each row's depth-R states in position order, kept by ``hook`` (``read``'s ``on_depth``):
    the prefill's real (left-padded) positions, then the fed-back token of each ``active`` row."""

    def __init__(self, prompts, depth: int):
        self.depth, self.lengths, self.active = depth, [len(p) for p in prompts], None
        self.parts = [[] for _ in prompts]  # per row: (n, d) pieces

    def hook(self, T: int, h: torch.Tensor, _logits) -> None:  # h (B, L, d)
        if T != self.depth:
            return
        if self.active is None:  # the prefill
            for i, n in enumerate(self.lengths):
                self.parts[i].append(h[i, h.shape[1] - n:])  # (n, d)
        else:
            for j, row in enumerate(self.active):
                self.parts[row].append(h[j])  # (1, d)


def _decode(result: Generation, logits: torch.Tensor, prefill_depth: int, advance, sample, *,
            max_new_tokens: int, eos_id: int | None, forced) -> None:
    """The token loop: pick, record, drop stopped rows (EOS, end of a forced continuation), feed the rest back."""
    active = list(range(len(result.tokens)))  # original row of each batch row
    step_depth = torch.full((len(active),), prefill_depth, dtype=torch.long, device=logits.device)
    for n in range(max_new_tokens):
        tok = sample(logits) if forced is None else torch.tensor(  # (B,)
            [forced[row][n] for row in active], dtype=torch.long, device=logits.device)
        for row, t, d in zip(active, tok.tolist(), step_depth.tolist()):
            result.tokens[row].append(t)
            result.depths[row].append(d)
        if n == max_new_tokens - 1:
            break
        done = tok == eos_id if eos_id is not None else torch.zeros_like(tok, dtype=torch.bool)
        if forced is not None:
            done |= torch.tensor([len(forced[row]) == n + 1 for row in active], device=tok.device)
        keep = (~done).nonzero().squeeze(-1) if bool(done.any()) else None  # (B_keep,)
        if keep is not None and len(keep) == 0:
            break
        if keep is not None:
            active, tok = [active[i] for i in keep.tolist()], tok[keep]
        logits, step_depth = advance(tok, keep, active)


def _check_request(model, prompts, max_new_tokens: int, depth: int, *, cache_mode: CacheMode, exit_criterion,
                   max_depth: int | None, save_states: bool, forced, student, static_step: StepHow | None) -> int:
    """Validate :func:`generate`'s arguments; returns the adaptive depth ceiling."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: need at least one prompt, each with at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    check_cache_mode(cache_mode, "cache_mode")
    if not getattr(model, "shared", False):
        raise ValueError("generate: needs the shared (looped) architecture; KV caches do not cover unshared models")
    if student is not None and cache_mode != "terminal":
        raise ValueError(f"generate: a distilled prefill fills terminal KV banks; use cache_mode='terminal', "
                         f"got {cache_mode!r}")
    if static_step is not None:
        if static_step not in DecodeStep.HOW:
            raise ValueError(f"static_step: unknown {static_step!r}; allowed: {', '.join(DecodeStep.HOW)} (or None)")
        if exit_criterion is not None or save_states or cache_mode != "per_visit":
            raise ValueError("static_step: needs fixed-depth decoding with a per_visit cache and no save_states "
                             "(adaptive depth, saved states and terminal caches keep the eager path)")
    seq_len = model.cfg.seq_len
    for i, p in enumerate(prompts):
        if len(p) + max_new_tokens - 1 > seq_len:
            raise ValueError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                             f"{len(p) + max_new_tokens - 1} positions but the model's seq_len is {seq_len}: "
                             "shorten the prompt or ask for fewer tokens")
    ceiling = depth if max_depth is None else int(max_depth)
    if exit_criterion is not None:
        if ceiling < 1:
            raise ValueError(f"max_depth must be >= 1, got {ceiling}")
        check_criterion(model, exit_criterion)
        if save_states:
            raise ValueError("save_states: needs fixed-depth decoding (every token's state at the same depth R)")
    if save_states and student is not None:
        raise ValueError("save_states: a distilled prefill has no depth-R states of the prompt (the student "
                         "predicts them); use the teacher's prefill")
    if forced is not None and (len(forced) != len(prompts) or any(len(f) == 0 for f in forced)):
        raise ValueError(f"forced: need one non-empty continuation per prompt ({len(prompts)}), got "
                         f"{[len(f) for f in forced]}")
    return ceiling


def _prefill(model, idx: torch.Tensor, mask: torch.Tensor, cache: KVCache, depth: int, *, student,
             student_depth: int, on_depth) -> tuple[torch.Tensor, int]:
    """Prefill idx (B, P) into ``cache`` (through ``student`` if given); (last logits (B, V), first token's depth)."""
    B, P = idx.shape
    # read out only the last position (left padding: every row's last token is real)
    last = (torch.arange(B, device=idx.device), torch.full((B,), P - 1, device=idx.device))
    if student is None:
        return model.read(model.loop(idx, cache=cache, attention_mask=mask), depth, readout=Readout(tokens=last),
                          on_depth=on_depth).logits, depth  # (B, V)
    from looplm.distill.prefill import distilled_prefill

    return distilled_prefill(model, student, idx, student_depth, cache, attention_mask=mask,
                             readout=Readout(tokens=last)).logits, 1  # the one teacher recurrence after the student


def _token_step(model, cache: KVCache, depth: int, *, ceiling: int, exit_criterion, static_step: StepHow | None,
                capacity: int, states: _States | None):
    """``advance(tok (B,), keep (B_keep,) | None, active) → (logits (B, V), depth (B,))`` of the static, adaptive
    or eager cached path, on the rows ``keep`` leaves (``active``: their original rows)."""
    B, device = cache.n_valid.shape[0], cache.n_valid.device

    def fixed(n: int) -> torch.Tensor:
        return torch.full((n,), depth, dtype=torch.long, device=device)

    if static_step is not None:  # rows that stop stay in the static batch; their outputs are dropped
        step = DecodeStep(model, StaticKVCache(cache, capacity, model.cfg.seq_len), depth, static_step)
        feed = torch.zeros(B, dtype=torch.long, device=device)  # (B,): the static batch's tokens
        rows = [torch.arange(B, device=device)]  # the static batch row of each active row

        def static(tok: torch.Tensor, keep: torch.Tensor | None, active: list[int]):
            if keep is not None:
                rows[0] = rows[0][keep]
            feed[rows[0]] = tok
            return step(feed)[rows[0]], fixed(len(tok))  # (B_active, V)
        return static

    def cached(tok: torch.Tensor, keep: torch.Tensor | None, active: list[int]):
        if keep is not None:
            cache.select(keep)
        if exit_criterion is not None:
            return adaptive_decode_step(model, tok[:, None], cache, ceiling, exit_criterion)
        if states is not None:
            states.active = active
        return model.read(model.loop(tok[:, None], cache=cache), depth,
                          on_depth=None if states is None else states.hook).logits[:, -1], fixed(len(tok))
    return cached


def _check_cli_request(prompts: list[str], temperature: float, top_k, top_p, exit: str, exit_tau, max_depth,
                       prefill: str, student, kv_cache, checkpoint) -> str:
    """``generate_checkpoint``'s option checks (ValueError naming the flag); returns the KV cache mode."""
    if not prompts:
        raise ValueError("give at least one --prompt TEXT or a --prompts-file with one prompt per line")
    if temperature <= 0 and (top_k is not None or top_p is not None):
        raise ValueError("--top-k/--top-p shape sampling; give --temperature > 0 with them (0 = greedy)")
    if exit == "none" and (max_depth is not None or exit_tau is not None):
        raise ValueError("--max-depth/--exit-tau apply to per-token adaptive depth; give --exit with an exit "
                         "criterion (see --help)")
    if exit_tau is not None and exit_tau <= 0:
        raise ValueError(f"--exit-tau: must be > 0, got {exit_tau}")
    if prefill == "teacher" and student is not None:
        raise ValueError("--student applies to --prefill distilled")
    if prefill == "distilled" and kv_cache == "per_visit":
        raise ValueError("--prefill distilled fills terminal KV banks (the student predicts only the endpoint); "
                         "use --kv-cache terminal (its default)")
    if exit != "none" and exit not in EXIT_CRITERIA:
        raise ValueError(f"--exit: got {exit!r}; allowed: none, {', '.join(EXIT_CRITERIA)}")
    if kv_cache is None:  # an export's own default (config.json kv_cache), as transformers uses
        from looplm.run.hf_folder import export_kv_cache

        kv_cache = "terminal" if prefill == "distilled" else export_kv_cache(checkpoint) or "per_visit"
    return kv_cache


def generate_checkpoint(checkpoint: str | Path, *, prompt: list[str] | None = None, prompts_file: Path | None = None,
                        max_new_tokens: int = 32, depth: int | None = None, temperature: float = 0.0,
                        top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                        kv_cache: CacheMode | None = None,
                        prefill: Literal["teacher", "distilled"] = "teacher", student: Path | None = None,
                        exit: str = "none", exit_tau: float | None = None, max_depth: int | None = None,
                        static_step: StepHow | None = None, device: str = "cpu",
                        out: Path | None = None) -> int:
    """Continue each prompt of a checkpoint (``looplm generate``); print them, ``out`` also as JSON.

    Args:
        prompt: a prompt (repeat for a batch)
        prompts_file: a text file with one prompt per line (blank lines skipped), after the --prompt values
        max_new_tokens: new tokens per prompt
        depth: loop depth of every forward, >= 1 (default: the checkpoint's train.eval_depth)
        temperature: sampling temperature; 0 = greedy argmax
        top_k: sample only from the K most likely tokens (with --temperature > 0)
        top_p: nucleus sampling threshold P in (0, 1] (with --temperature > 0; after --top-k)
        seed: seed of the sampling generator
        kv_cache: per_visit (exact; the default with --prefill teacher unless an export says otherwise) or
            terminal (terminal KV sharing; the only cache with --prefill distilled)
        prefill: teacher (the model at --depth) or distilled (the student of looplm distill predicts z^R; LMDR)
        student: with --prefill distilled: the student's run directory or checkpoint (default: student/ beside the run)
        exit: per-token adaptive depth criterion (looplm.eval.exits); none = fixed --depth
        exit_tau: threshold of --exit (default: the criterion's)
        max_depth: with --exit: loop ceiling per token and prefill depth (default --depth)
        static_step: fixed-depth per_visit decoding as one static region per token: eager, compile, cuda_graph or
            compile_cuda_graph
        out: also write prompts, token ids, continuations and loops per token as JSON
    """
    prompts = list(prompt or []) + ([s for s in prompts_file.read_text().splitlines() if s.strip()]
                                    if prompts_file else [])
    kv_cache = _check_cli_request(prompts, temperature, top_k, top_p, exit, exit_tau, max_depth, prefill, student,
                                  kv_cache, checkpoint)
    from looplm.data.tokenizer import eot_id
    from looplm.eval.runner import open_checkpoint

    opened = open_checkpoint(checkpoint, device=device)
    model, cfg, ckpt, tok = opened.model, opened.cfg, opened.ckpt, opened.tokenizer
    try:
        eos = eot_id(tok)
    except ValueError:
        eos = None
    ids = [tok.encode(p, add_special_tokens=False).ids for p in prompts]
    for p, i in zip(prompts, ids):
        if not i:
            raise ValueError(f"prompt {p!r} encodes to no tokens")
        if eos is not None and i.count(eos) > p.count(tok.id_to_token(eos)):  # a vocabulary's unknown token
            raise ValueError(f"prompt {p!r} has characters outside the tokenizer's vocabulary (they would read "
                             f"as {tok.id_to_token(eos)})")
    model_student = student_depth = None
    if prefill == "distilled":
        from looplm.distill.student import default_student_dir, load_student

        model_student, record, _ = load_student(student or default_student_dir(checkpoint), model)
        student_depth = record.distill.depth
    depth = depth or student_depth or cfg.train.eval_depth
    criterion = None if exit == "none" else build_exit_criterion(exit, exit_tau)
    gen = generate(model, ids, max_new_tokens, depth, temperature=temperature, top_k=top_k, top_p=top_p,
                   seed=seed, cache_mode=kv_cache, exit_criterion=criterion, max_depth=max_depth, eos_id=eos,
                   student=model_student, student_depth=student_depth, static_step=static_step)
    settings = {"depth": depth, "max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k,
                "top_p": top_p, "seed": seed, "kv_cache": kv_cache, "prefill": prefill, "student_depth": student_depth,
                "exit": exit, "exit_tau": None if criterion is None else criterion.tau,
                "max_depth": (max_depth or depth) if criterion is not None else None, "eos_id": eos,
                "static_step": static_step}
    _show(prompts, ids, gen, tok, out, {"checkpoint": str(ckpt), "name": cfg.name, "rule": cfg.model.rule,
                                        "settings": settings})
    return 0


def _show(prompts: list[str], ids: list[list[int]], gen: "Generation", tok, out: Path | None, head: dict) -> None:
    """Print each continuation; with ``out``, write ``head`` and the results as JSON."""
    import json
    import sys

    results = []
    for n, (p, i, toks, depths) in enumerate(zip(prompts, ids, gen.tokens, gen.depths), 1):
        text = tok.decode(toks)
        mean = sum(depths) / len(depths) if depths else 0.0
        results.append({"prompt": p, "prompt_tokens": i, "continuation": text, "tokens": toks, "depths": depths,
                        "mean_depth": mean})
        print(f"=== [{n}/{len(prompts)}] {len(i)} prompt tokens -> {len(toks)} new tokens, "
              f"loops per token: mean {mean:.2f}")
        print(f"{p}\033[1m{text}\033[0m" if sys.stdout.isatty() else p + text)
    if out is not None:
        out.write_text(json.dumps({**head, "results": results}, indent=2) + "\n")
        print(f"wrote {out}")
