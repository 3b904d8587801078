"""The RL drivers: task pretraining with looplm's trainer (:func:`pretrain_task`), pass@k evaluation
(:func:`evaluate_passk`), and the resumable Dr. GRPO run (:func:`rl_train`; rollout seeds and prompts are pure
functions of (seed, update), so a resume continues exactly; writes metrics.jsonl, results.json, rl.png).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from looplm.config import Config, DataConfig, ModelConfig, OptimConfig, PLNDepthConfig, TrainConfig
from looplm.data.paths import atomic_write
from looplm.run.finite import dumps
from looplm.run.checkpoint import TOKENIZER_FILE, load_checkpoint, save_checkpoint
from looplm.run.folder import Fit, RunFolder, run_state
from looplm.rl.config import RLConfig
from looplm.rl.grpo import (UPDATE_METHODS, compare_methods, pack, pass_at_k, response_text, sample_rollouts,
                            update_gradient)
from looplm.rl.rewards import get_reward
from looplm.rl.task import NEWLINE_ID, VOCAB, build_task, encode, tokenizer
from looplm.tasks.base import key_hash
from looplm.train.optim import Optimization

#: :func:`pretrain_task`'s config (our choice, for a 2-core CPU): Huginn-style 1 + 2×R + 1 (0.28M parameters), LMDR's
#: recipe at small scale (PLN mean 5 cap 16, TBPTT-4, WSD); the context is one 13-token record; ``data`` is unread.
PRETRAIN_CONFIG = Config(
    name="addition",
    model=ModelConfig(rule="huginn_linear", vocab_size=14, d_model=64, n_heads=4, d_ff=256, seq_len=13,
                      dropout=0.0, n_prelude=1, n_core=2, n_coda=1),
    data=DataConfig(),
    depth=PLNDepthConfig(mean=5.0, cap=16),
    optim=OptimConfig(lr=2e-3, warmup_steps=40, schedule="wsd", beta2=0.98),
    train=TrainConfig(steps=800, batch_size=128, gradient={"kind": "tbptt", "steps": 4}, eval_every=200, eval_batches=4,
                      eval_depth=6, ckpt_every=200, device="cpu", num_threads=1),
)


def _seed(*key: object) -> int:
    return key_hash("looplm-rl-seed", *key) & ((1 << 63) - 1)


def pretrain_task(out: str | Path, cfg: Config = PRETRAIN_CONFIG, *, task: str = "addition", digits: int = 3,
                  train_records: int = 200_000, resume: bool = False, stop_after: int | None = None,
                  progress: bool = True, overwrite: bool = False) -> dict[str, Any]:
    """Supervised pretraining of ``cfg``'s model on the task's stream (windows at record boundaries); returns the
    trainer's summary plus ``task``.

    Args:
        out: run folder (checkpoints, metrics.jsonl, config.json, tokenizer.json, summary.json, task.json).
        cfg: the config (default :data:`PRETRAIN_CONFIG`); ``model.vocab_size`` is set from the task.
        task: the task name (:data:`looplm.rl.task.TASKS`).
        digits: the task's operand width D.
        train_records: records (examples) in the training stream.
        resume: continue from the newest valid checkpoint in ``out``.
        stop_after: stop (with a checkpoint) after this many steps of this invocation.
        overwrite: replace the files a run writes in an ``out`` that holds no checkpoint (refused otherwise).
    ValueError: ``model.seq_len`` not a multiple of the record length, or ``out`` holds another task."""
    from looplm.train.trainer import TrainData, train

    t = build_task(task, digits=digits)
    if cfg.model.seq_len % t.record_len:
        raise ValueError(f"model.seq_len: {cfg.model.seq_len} is not a multiple of the {t.name} record length "
                         f"{t.record_len} (D = {digits}); use e.g. --model.seq_len {t.record_len}")
    spec = {"task": task, "digits": digits, "seed": t.seed, "heldout_size": t.heldout_size,
            "train_records": train_records}
    out = Path(out)
    task_file = out / "task.json"
    if task_file.exists() and json.loads(task_file.read_text()) != spec:
        raise ValueError(f"{task_file}: the run was started with {task_file.read_text().strip()}, not {spec}")
    tok = tokenizer()
    data = TrainData(train=t.stream(train_records, "train"), valid=t.stream(max(2_000, train_records // 100), "valid"),
                     tokenizer_json=tok.to_str(), vocab_size=tok.get_vocab_size(), window_stride=t.record_len)
    out.mkdir(parents=True, exist_ok=True)
    task_file.write_text(json.dumps(spec, indent=2) + "\n")
    summary = train(cfg, out, resume=resume, progress=progress, data=data, stop_after=stop_after, overwrite=overwrite)
    return {**summary, "task": spec}


@torch.no_grad()
def evaluate_passk(model, problems, *, depth: int, samples: int = 8, temperature: float = 1.0, seed: int = 0,
                   max_new_tokens: int, reward: str = "exact_match", batch_rows: int = 1024,
                   greedy: bool = True, progress: bool = False) -> dict[str, Any]:
    """pass@1, pass@``samples`` (Chen et al. 2021) and greedy accuracy on ``problems``, as fractions."""
    score = get_reward(reward)
    rows = [(i, p) for i, p in enumerate(problems) for _ in range(samples)]
    correct = [0] * len(problems)
    for start in tqdm(range(0, len(rows), batch_rows), desc="pass@k", unit="chunk", disable=not progress):
        chunk = rows[start:start + batch_rows]
        gen = generate_chunk(model, [p for _, p in chunk], depth, max_new_tokens, temperature,
                             _seed("eval", seed, start))
        for (i, p), ids in zip(chunk, gen):
            correct[i] += int(score(response_text(ids, NEWLINE_ID), p.answer) > 0.5)
    res: dict[str, Any] = {"problems": len(problems), "samples": samples, "temperature": temperature, "depth": depth}
    for k in sorted({1, samples}):
        res[f"pass@{k}"] = sum(pass_at_k(samples, c, k) for c in correct) / len(problems)
    if greedy:
        gen = [ids for start in range(0, len(problems), batch_rows)
               for ids in generate_chunk(model, problems[start:start + batch_rows], depth, max_new_tokens, 0.0, 0)]
        hits = sum(score(response_text(ids, NEWLINE_ID), p.answer) > 0.5 for p, ids in zip(problems, gen))
        res["greedy"] = hits / len(problems)
    return res


def generate_chunk(model, problems, depth: int, max_new_tokens: int, temperature: float, seed: int) -> list[list[int]]:
    from looplm.eval.generate import generate

    return generate(model, [encode(p.prompt) for p in problems], max_new_tokens, depth, temperature=temperature,
                    seed=seed, eos_id=NEWLINE_ID).tokens


def _task_of(ckpt: Path, task: str | None, digits: int | None):
    """The task a checkpoint was pretrained on (its run's task.json), unless given.
    ValueError: not the task vocabulary (not a `looplm rl pretrain` model), or no task.json nor ``digits``."""
    tok = ckpt / TOKENIZER_FILE
    vocab = json.loads(tok.read_text()).get("model", {}).get("vocab") if tok.exists() else None
    if vocab != VOCAB:
        raise ValueError(f"checkpoint {ckpt}: its tokenizer is not the RL task's character vocabulary "
                         f"({len(VOCAB)} tokens); RL post-training needs a base model from `looplm rl pretrain`")
    found = next((f / "task.json" for f in (ckpt, ckpt.parent.parent) if (f / "task.json").exists()), None)
    spec = json.loads(found.read_text()) if found else {}
    if digits is None and "digits" not in spec:
        raise ValueError(f"checkpoint {ckpt}: no task.json next to it to say the task's width; give --digits")
    name = task or spec.get("task", "addition")
    return build_task(name, digits=digits if digits is not None else spec["digits"])


def rl_eval_checkpoint(checkpoint: str | Path, *, depth: int = 6, samples: int = 8, temperature: float = 1.0,
                       problems: int = 500, task: str | None = None, digits: int | None = None, seed: int = 0,
                       reward: str = "exact_match", device: str = "cpu", progress: bool = True) -> dict[str, Any]:
    """pass@k of a checkpoint on its task's held-out problems.

    Args:
        checkpoint: checkpoint or run directory (a ``looplm rl pretrain`` or ``looplm rl train`` run).
        depth: the recurrence depth R of decoding.
        samples: n responses per problem (pass@1 and pass@n are reported).
        temperature: sampling temperature.
        problems: evaluate the first this many held-out problems.
        task, digits: the task (default: the run's task.json).
        seed: seed of the evaluation samples.
        reward: the verifier (exact_match or numeric).
        device: cpu, cuda or cuda:N.
    """
    model, cfg, _, ckpt = load_checkpoint(checkpoint, device=device)
    t = _task_of(Path(ckpt), task, digits)
    held = t.heldout()[:problems]
    res = evaluate_passk(model, held, depth=depth, samples=samples, temperature=temperature, seed=seed,
                         max_new_tokens=t.digits + 2, reward=reward, progress=progress)
    res.update(checkpoint=str(ckpt), task=t.name, digits=t.digits, reward=reward)
    res["markdown"] = (f"`{ckpt}` on {len(held)} held-out {t.name} problems ({t.digits} digits), R = {depth}, "
                       f"{samples} samples at T = {temperature}: pass@1 {100 * res['pass@1']:.2f}%, pass@{samples} "
                       f"{100 * res[f'pass@{samples}']:.2f}%, greedy {100 * res['greedy']:.2f}%")
    return res


def training_problems(task, cfg: RLConfig, update: int) -> list:
    """The P problems of ``update``: fresh for (seed, update), or the next P of the fixed set, reshuffled by
    (seed, epoch); a pure function of (config, update)."""
    P, N = cfg.prompts_per_update, cfg.train_problems
    if not N:
        return task.problems(P, "rl", cfg.seed, update)
    pool = task.problems(N, "rl-set", cfg.seed)
    out = []
    for i in range(update * P, update * P + P):
        epoch, j = divmod(i, N)
        order = torch.randperm(N, generator=torch.Generator().manual_seed(_seed("epoch", cfg.seed, epoch)))
        out.append(pool[int(order[j])])
    return out


def rl_train(checkpoint: str | Path | None, out: str | Path, cfg: RLConfig | None = None, *, resume: bool = False,
             stop_after: int | None = None, progress: bool = True, device: str = "cpu") -> dict[str, Any]:
    """Dr. GRPO post-training of ``checkpoint`` (None with ``resume``, where the saved config wins over ``cfg``) into
    ``out``: :func:`rl_update` per update, pass@k before and after; returns ``results.json``'s dict.
    ValueError: a fresh run into a folder that holds checkpoints, or no ``checkpoint``; CheckpointError: missing or
    damaged checkpoint; ``resume`` with none to resume."""
    folder = RunFolder(out)
    with folder.start(resume=resume, writes=("rl_config.json", "task.json", "results.json", "rl.png")) as ckpt:
        if ckpt:
            model, mcfg, state, _ = load_checkpoint(ckpt, device=device, with_state=True)
            cfg, source = RLConfig.from_dict(state["rl"]), Path(state["source"])
        elif checkpoint is None:
            raise ValueError("checkpoint: needed to start a run")
        else:
            (model, mcfg, _, source), state, cfg = load_checkpoint(checkpoint, device=device), None, cfg or RLConfig()
        task = _task_of(source, cfg.task or None, cfg.digits or None)
        cfg = cfg.replace(task=task.name, digits=task.digits)
        optim = Optimization(model, cfg.optim, cfg.updates)
        held = task.heldout()[:cfg.eval_problems]

        def evaluate() -> dict[str, Any]:
            return evaluate_passk(model, held, depth=cfg.depth, samples=cfg.eval_samples, temperature=cfg.temperature,
                                  seed=cfg.eval_seed, max_new_tokens=task.digits + 2, reward=cfg.reward)

        if state is not None:
            optim.load_state_dict(state)
            start, before = int(state["step"]), state["before"]
        else:
            start, before = 0, evaluate()
        (folder.path / "rl_config.json").write_text(dumps({**cfg.to_dict(), "source": str(source)}, indent=2) + "\n")
        (folder.path / "task.json").write_text(json.dumps({"task": task.name, "digits": task.digits}, indent=2) + "\n")

        def save(update: int) -> None:
            save_checkpoint(folder.path, update, model, mcfg, tokenizer_json=tokenizer().to_str(),
                            train_state=run_state(update, cfg.seed, **optim.state_dict(), rl=cfg.to_dict(),
                                                  source=str(source), before=before))

        fit = Fit(folder, start=start, total=cfg.updates, stop_after=stop_after, ckpt_every=cfg.ckpt_every,
                  save=save, desc=f"rl {cfg.method}", unit="update", key="update", progress=progress)
        model.eval()  # dropout off; the Huginn initial state from the table the sampler used (grpo docstring)
        with fit:
            for update in fit:
                rec = rl_update(model, optim, task, cfg, update, device=device)
                fit.log(rec, reward=f"{rec['reward']:.3f}", update_s=f"{rec['update_s']:.3f}")
        if fit.end < cfg.updates:
            return {"completed_updates": fit.end, "updates": cfg.updates, "out": str(folder.path)}
        results = summarize_run(folder.path, cfg, before, evaluate(), source=source, params=model.num_params())
        with atomic_write(folder.path / "results.json") as fh:
            fh.write((dumps(results, indent=2) + "\n").encode())
        plot_run(folder.path, results)
        return results


def rl_update(model, optim: Optimization, task, cfg: RLConfig, update: int, *, device: str = "cpu") -> dict[str, Any]:
    """One Dr. GRPO update: rollouts, (every ``compare_every``) the methods compared, scoring + backward, one step."""
    R, b, M = cfg.depth, cfg.neumann_steps, task.digits + 2
    compare = cfg.compare_every > 0 and update % cfg.compare_every == 0
    t0 = time.perf_counter()
    roll = sample_rollouts(model, training_problems(task, cfg, update), group_size=cfg.group_size, depth=R,
                           max_new_tokens=M, reward=cfg.reward, temperature=cfg.temperature,
                           seed=_seed("rollout", cfg.seed, update), eos_id=NEWLINE_ID,
                           save_states=cfg.method == "reuse" or compare)
    rec: dict[str, Any] = {"update": update + 1, "reward": float(roll.rewards.mean()),
                           "rollout_s": time.perf_counter() - t0, "generated_tokens": roll.generated_tokens,
                           "response_len": roll.generated_tokens / len(roll.responses),
                           "state_bytes": roll.state_bytes(), "state_positions": roll.state_positions}
    batch = pack(roll, device=device)
    if compare:
        rec["compare"] = compare_methods(model, batch, depth=R, neumann_steps=b, max_new_tokens=M)
    stats, _ = update_gradient(model, batch, cfg.method, depth=R, neumann_steps=b, max_new_tokens=M)
    grad_norm, lr, kept = optim.step(stats["loss"])
    if not kept:
        rec["skipped"] = True
    rec.update(loss=stats["loss"], update_s=stats["time_s"], nll_mean=stats["nll_mean"], grad_norm=grad_norm, lr=lr)
    return rec


def _cos_null_reason(cmp: list[dict[str, Any]]) -> str | None:
    """Why some compared updates have no gradient cosine (None when every one has them all)."""
    zero = [c for c in cmp if any(v == 0.0 for v in c["grad_norm"].values())]
    if not zero:
        return None
    return (f"{len(zero)} of {len(cmp)} compared updates had a zero gradient, so their cosines are undefined (null): "
            "every group's rewards were equal (e.g. all 0), so each Dr. GRPO advantage r - mean(r) is 0")


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def summarize_run(out: Path, cfg: RLConfig, before: dict[str, Any], after: dict[str, Any], *,
                  source: Path, params: int) -> dict[str, Any]:
    """The results of a finished run from its ``metrics.jsonl``."""
    recs = _records(out)
    cmp = [r["compare"] for r in recs if "compare" in r]
    times = {m: [c["time_s"][m] for c in cmp] for m in UPDATE_METHODS}
    pairs = sorted({k for c in cmp for k in c["cos"]})
    saved = [r for r in recs if r.get("state_bytes")]
    gen, state_bytes = sum(r["generated_tokens"] for r in saved), sum(r["state_bytes"] for r in saved)
    positions = sum(r["state_positions"] for r in saved)
    n = len(recs)
    tail = recs[-max(1, n // 10):]
    med = (lambda v: statistics.median(v) if v else None)
    return {
        "options": cfg.to_dict(), "source": str(source), "params": params, "updates": n,
        "before": before, "after": after,
        "update_s_median": med([r["update_s"] for r in recs]),
        "rollout_s_median": med([r["rollout_s"] for r in recs]),
        "reward_first_10pct": statistics.fmean(r["reward"] for r in recs[:max(1, n // 10)]),
        "reward_last_10pct": statistics.fmean(r["reward"] for r in tail),
        "compare": {
            "updates": [r["update"] for r in recs if "compare" in r],
            "time_s_median": {m: med(v) for m, v in times.items()},
            "speedup_vs_bptt": {m: (med(times["bptt"]) / med(v)) if v and med(v) else None
                                for m, v in times.items()},
            "cos_median": {k: med([c["cos"][k] for c in cmp if c["cos"].get(k) is not None]) for k in pairs},
            "cos_min": {k: min((c["cos"][k] for c in cmp if c["cos"].get(k) is not None), default=None) for k in pairs},
            "policy_gap_median": med([c["policy_gap"] for c in cmp if c["policy_gap"] is not None]),
            "cos_null_reason": _cos_null_reason(cmp),
        },
        "state_bytes_per_generated_token": state_bytes / gen if gen else None,
        "state_bytes_per_position": state_bytes / positions if positions else None,
        "state_bytes_per_update_median": med([r["state_bytes"] for r in saved]),
    }


def plot_run(out: Path, results: dict[str, Any]) -> Path:
    """``out/rl.png``: reward per update (and its running mean) and the scoring + backward time."""
    import matplotlib.pyplot as plt

    from looplm.analysis.plots import save_figure

    recs = _records(out)
    x = [r["update"] for r in recs]
    rew = [r["reward"] for r in recs]
    w = max(1, len(rew) // 20)
    run = [statistics.fmean(rew[max(0, i - w + 1):i + 1]) for i in range(len(rew))]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    ax[0].plot(x, rew, alpha=0.3, label="batch mean")
    ax[0].plot(x, run, label=f"running mean ({w})")
    ax[0].set(xlabel="update", ylabel="reward", title=f"Dr. GRPO, {results['options']['method']}")
    ax[0].legend()
    ax[1].plot(x, [r["update_s"] for r in recs], ".", ms=3)
    ax[1].set(xlabel="update", ylabel="scoring + backward (s)")
    return save_figure(fig, out / "rl.png")
