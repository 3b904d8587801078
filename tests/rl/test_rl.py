"""RL post-training with rollout-state reuse (looplm.rl; LMDR §3.1, §5.4; issue 12 §2).

References, one per test: the rollout's saved depth-R states against a replay (the same cached
decoding teacher-forced: bit-identical; the non-cached forward: fp32 rounding); reuse against
recompute (bit-identical when the saved states are the replay's); reuse from a zero initial state with
b = R against full BPTT; the Dr. GRPO loss against a hand computation; the scoring batch against
per-row unpadded forwards; pass@k against enumeration; the task's held-out set against its streams;
the rewards against hand-written cases; ``looplm rl`` end to end with an exact resume.
"""

from __future__ import annotations

import itertools
import json
import math
from typing import get_args

import pytest
import torch

from looplm.config import ModelConfig
from looplm.data.tokens import sample_batch
from looplm.eval.generate import generate
from looplm.model import build_model
from looplm.rl.grpo import (UPDATE_METHODS, compare_methods, dr_grpo_loss, flat_grad, group_advantages, pack,
                            pass_at_k, sample_rollouts, score, update_gradient)
from looplm.rl.config import RewardName, RLConfig, UpdateMethod
from looplm.rl.rewards import REWARDS, exact_match, get_reward, numeric
from looplm.rl.task import CHARS, NEWLINE_ID, VOCAB, AdditionTask, decode, encode, tokenizer
from looplm.model.cursor import NLL, Readout

R, B_NEUMANN, M = 4, 2, 4


def toy(seed: int = 0, **options) -> torch.nn.Module:
    """A tiny Huginn-style looped model (1 + 2×R + 1) on the task vocabulary, eval mode, sharp logits."""
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=len(VOCAB), d_model=32, n_heads=4, d_ff=64, seq_len=32, dropout=0.0,
                      rule="huginn_linear", n_prelude=1, n_core=2, n_coda=1, init_std=0.1, options=options)
    return build_model(cfg).eval()


def rollouts(model, eos: int = NEWLINE_ID, n_problems: int = 3, group: int = 4):
    problems = AdditionTask(digits=2).problems(n_problems, "test")
    return problems, sample_rollouts(model, problems, group_size=group, depth=R, max_new_tokens=M, seed=1, eos_id=eos)


def _eos_that_ends_some_rows(model) -> int:
    """A token id that some (not all) sampled rows emit before the budget, so rows leave the batch."""
    _, roll = rollouts(model, eos=-1)
    counts = {}
    for r in roll.responses:
        for t in set(r[:-1]):
            counts[t] = counts.get(t, 0) + 1
    return max(counts, key=lambda t: (0 < counts[t] < len(roll.responses), counts[t]))


def test_saved_states_are_the_replays_states():
    """Each rollout row keeps len(prompt) + len(response) − 1 depth-R states. A replay of the same rollout
    through the same cached decoding (teacher-forced, rows leaving the batch at EOS as they did) gives
    bit-identical fp32 states; the non-cached forward over prompt + response (the recompute update's
    replay) gives the same states to fp32 rounding (float64: 1e-12), not bitwise: a cached decode
    step multiplies one row where the full forward multiplies all (CPU matmul kernels sum differently)."""
    model = toy()
    eos = _eos_that_ends_some_rows(model)
    _, roll = rollouts(model, eos=eos)
    lengths = [len(r) for r in roll.responses]
    assert min(lengths) < M == max(lengths)  # some rows left the batch early
    for p, r, s in zip(roll.prompts, roll.responses, roll.states):
        assert s.shape == (len(p) + len(r) - 1, 32)
    replay = generate(model, roll.prompts, M, R, eos_id=eos, save_states=True, forced=roll.responses)
    assert replay.tokens == roll.responses
    assert all(torch.equal(a, b) for a, b in zip(replay.states, roll.states))  # exact: same cached decode
    batch = pack(roll)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        m = model.to(dtype)
        _, r2 = rollouts(m, eos=eos)
        b2 = pack(r2)
        with torch.no_grad():
            full = m.read(m.loop(b2.idx, attention_mask=b2.mask), R, readout=Readout(states=True)).states[-1]
        keep = b2.mask.bool()
        diff = (full - b2.states)[keep].abs().max().item()
        print(f"{dtype}: max |saved - non-cached replay| = {diff:.3g}")
        assert diff <= tol
        assert b2.states[~keep].abs().max() == 0
    assert batch.states.dtype == torch.float32


def test_reuse_equals_recompute_when_the_saved_states_are_the_replays():
    """With the replayed endpoint in place of the rollout's states, reuse and recompute produce
    bit-identical NLLs and gradients (the same detach, the same b steps); with the rollout's own
    states, the same gradient to rounding (cosine 1 − 1e-9)."""
    model = toy()
    _, roll = rollouts(model)
    batch = pack(roll)
    batch.advantages = torch.linspace(-1, 1, len(batch.advantages))  # every row contributes
    with torch.no_grad():
        replayed = model.read(model.loop(batch.idx, attention_mask=batch.mask), R,
                              readout=Readout(states=True)).states[-1]
    kw = dict(depth=R, neumann_steps=B_NEUMANN, max_new_tokens=M)
    _, nll_rec = update_gradient(model, batch, "recompute", **kw)
    g_rec = flat_grad(model)
    own = update_gradient(model, batch, "reuse", **kw)[1], flat_grad(model)
    batch.states = torch.where(batch.mask.bool()[..., None], replayed, batch.states)
    _, nll_reuse = update_gradient(model, batch, "reuse", **kw)
    g_reuse = flat_grad(model)
    assert torch.equal(nll_reuse, nll_rec) and torch.equal(g_reuse, g_rec)  # exact: same computation
    cos = float(torch.dot(own[1], g_rec) / (own[1].norm() * g_rec.norm()))
    print(f"reuse (rollout states) vs recompute: cos = {cos:.12f}, max |Δnll| = {(own[0] - nll_rec).abs().max():.3g}")
    assert cos > 1 - 1e-9


def test_reuse_with_b_equal_R_from_a_zero_initial_state_is_full_bptt():
    """With a zero initial state, "saved states" z^0 = 0 at depth 0 and b = R, reuse's b recurrences
    are the whole trajectory: its NLL and gradient equal full BPTT's at depth R."""
    model = toy(state_init="zeros")
    _, roll = rollouts(model)
    batch = pack(roll)
    batch.advantages = torch.linspace(-1, 1, len(batch.advantages))
    batch.states = torch.zeros_like(batch.states)
    _, nll_bptt = update_gradient(model, batch, "bptt", depth=R, neumann_steps=1, max_new_tokens=M)
    g_bptt = flat_grad(model)
    _, nll_reuse = update_gradient(model, batch, "reuse", depth=R, neumann_steps=R, max_new_tokens=M, state_depth=0)
    g_reuse = flat_grad(model)
    err = float((g_reuse - g_bptt).abs().max() / g_bptt.abs().max())
    print(f"max |g_reuse - g_bptt| / max |g_bptt| = {err:.3g}")
    assert torch.equal(nll_reuse, nll_bptt)  # exact: same forward
    assert err <= 1e-6
    # with the rollout's own states (depth R) it is a different estimator
    batch2 = pack(roll)
    batch2.advantages = batch.advantages
    update_gradient(model, batch2, "reuse", depth=R, neumann_steps=B_NEUMANN, max_new_tokens=M)
    assert not torch.allclose(flat_grad(model), g_bptt)


def test_dr_grpo_loss_matches_a_hand_computation():
    """Two prompts × three responses: A = r − group mean (no std), L = Σ_i A_i Σ_t nll_i,t / (N·M)."""
    rewards = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    adv = group_advantages(rewards)
    want_adv = [[2 / 3, -1 / 3, -1 / 3], [1 / 3, 1 / 3, -2 / 3]]
    assert torch.allclose(adv, torch.tensor(want_adv))
    assert torch.allclose(group_advantages(3 * rewards), 3 * adv)  # no std normalization
    nll = torch.tensor([[0.5, 0.25, 0.0], [1.0, 0.0, 0.0], [0.1, 0.2, 0.3],
                        [2.0, 0.0, 0.0], [0.4, 0.4, 0.0], [0.3, 0.0, 0.0]])
    flat = [a for row in want_adv for a in row]
    hand = sum(a * sum(row) for a, row in zip(flat, nll.tolist())) / (6 * 5)
    got = dr_grpo_loss(nll, adv.flatten(), max_new_tokens=5)
    assert math.isclose(float(got), hand, rel_tol=1e-6)
    # no length normalization: a response's tokens add up (a third token of −log π 0.3 adds A·0.3/(N·M))
    nll2 = nll.clone()
    nll2[0, 2] = 0.3
    assert math.isclose(float(dr_grpo_loss(nll2, adv.flatten(), 5) - got), (2 / 3) * 0.3 / 30, rel_tol=1e-5)


def test_scoring_batch_reads_each_response_token_where_an_unpadded_forward_does():
    """The packed, padded scoring forward (bptt at R) gives each response token the NLL of a forward
    over that row alone (prompt + response[:-1], no padding)."""
    model = toy()
    eos = _eos_that_ends_some_rows(model)
    _, roll = rollouts(model, eos=eos)
    batch = pack(roll)
    with torch.no_grad():
        nll = score(model, batch, "bptt", depth=R, neumann_steps=1)
    for i, (p, r) in enumerate(zip(roll.prompts, roll.responses)):
        x = torch.tensor([p + r[:-1]])
        y = torch.full_like(x, -100)
        y[0, len(p) - 1:] = torch.tensor(r)
        with torch.no_grad():
            ref = model(x, R, y, readout=NLL).nll_by_depth[R][0, len(p) - 1:]
        got = nll[i][batch.targets[i] != -100]
        assert torch.allclose(got, ref, atol=1e-5), (i, got, ref)
    assert int((batch.targets != -100).sum()) == roll.generated_tokens


def test_compare_methods_reports_every_pair():
    model = toy()
    _, roll = rollouts(model)
    batch = pack(roll)
    batch.advantages = torch.linspace(-1, 1, len(batch.advantages))
    res = compare_methods(model, batch, depth=R, neumann_steps=B_NEUMANN, max_new_tokens=M)
    assert set(res["time_s"]) == set(UPDATE_METHODS)
    assert set(res["cos"]) == {"bptt|recompute", "bptt|reuse", "recompute|reuse"}
    assert res["cos"]["recompute|reuse"] > 1 - 1e-9 and res["policy_gap"] >= 0
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="unknown 'nope'"):
        score(model, batch, "nope", depth=R, neumann_steps=1)


def test_pass_at_k_matches_enumeration():
    for n, c, k in [(8, 0, 1), (8, 3, 1), (8, 3, 4), (8, 3, 8), (5, 5, 2), (6, 1, 3)]:
        subsets = list(itertools.combinations(range(n), k))
        want = sum(any(i < c for i in s) for s in subsets) / len(subsets)
        assert math.isclose(pass_at_k(n, c, k), want, rel_tol=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_task_heldout_is_disjoint_and_tokenizer_agrees():
    task = AdditionTask(digits=2)
    held = task.heldout()
    assert len({p.prompt for p in held}) == len(held) == 500
    for p in held[:50]:
        a, b = map(int, p.prompt.strip("\n=").split("+"))
        assert int(p.answer) == a + b and len(p.answer) == 3
    ids = task.stream(2000)
    assert len(ids) == 2000 * task.record_len == 2000 * 10
    seen = {line.split("=")[0] for line in decode(ids).split("\n") if "=" in line}
    assert len(seen) > 1000 and not seen & {p.prompt.strip("\n=") for p in held}
    # the trainer's windows at multiples of the record length start at a record: a prompt at position 0
    x, y = sample_batch(ids, 16, 2 * task.record_len, seed=0, step=3, stride=task.record_len)
    assert (x[:, 0] == NEWLINE_ID).all() and (x[:, task.record_len] == NEWLINE_ID).all()
    assert torch.equal(x[:, 1:], y[:, :-1])  # exact: integers
    assert torch.equal(sample_batch(ids, 4, 7, seed=0, step=1)[0], sample_batch(ids, 4, 7, seed=0, step=1, stride=1)[0])
    assert not {p.prompt for p in task.problems(2000, "rl", 0, 0)} & {p.prompt for p in held}
    assert task.problems(5, "rl", 0, 3) == AdditionTask(digits=2).problems(5, "rl", 0, 3)  # a pure function
    tok = tokenizer()
    text = "\n12+345=0357\n"
    assert tok.encode(text).ids == encode(text) and tok.decode(encode(text)) == text
    assert tok.get_vocab_size() == len(CHARS) + 1
    with pytest.raises(ValueError, match="not in the task vocabulary"):
        encode("1-2")


def test_training_problems_fresh_or_a_fixed_set_visited_once_per_epoch():
    from looplm.rl.runner import training_problems

    task = AdditionTask(digits=2)
    fresh = RLConfig(prompts_per_update=4, train_problems=0, seed=0)
    assert training_problems(task, fresh, 3) == task.problems(4, "rl", 0, 3) != training_problems(task, fresh, 4)
    fixed = RLConfig(prompts_per_update=4, train_problems=10, seed=0)
    epoch0 = [p for u in range(5) for p in training_problems(task, fixed, u)][:10]  # updates 0-2 and half of 3
    pool = task.problems(10, "rl-set", 0)
    assert sorted(p.prompt for p in epoch0) == sorted(p.prompt for p in pool)  # each problem once per epoch
    assert training_problems(task, fixed, 7) == training_problems(task, fixed.replace(), 7)


def test_rl_config_optim_warms_up_then_holds_the_lr():
    """RL's optim section (the shared AdamW): no weight decay, betas (0.9, 0.98), lr·min(1, (u + 1)/warm-up)."""
    from looplm.config import ConfigError
    from looplm.train.optim import Optimization

    cfg = RLConfig()
    model = torch.nn.Linear(3, 2)
    optim = Optimization(model, cfg.optim, cfg.updates)
    lrs = []
    for _ in range(30):
        model(torch.ones(1, 3)).sum().backward()
        lrs.append(optim.step(1.0)[1])
    assert lrs == [cfg.optim.lr * min(1.0, (u + 1) / cfg.optim.warmup_steps) for u in range(30)]
    assert all(g["weight_decay"] == 0.0 and g["betas"] == (0.9, 0.98) for g in optim.opt.param_groups)
    with pytest.raises(ConfigError, match="rl.group_size: Dr. GRPO needs >= 2"):
        RLConfig(group_size=1)
    with pytest.raises(ConfigError, match="rl.method: got 'sgd'"):
        cfg.with_overrides({"rl.method": "sgd"})


def test_rewards():
    assert exact_match(" 357 ", "357") == 1.0 and exact_match("0357", "357") == 0.0
    assert numeric("0357", "357") == numeric("357.0", "357") == numeric("= 357 apples", "357") == 1.0
    assert numeric("1,024", "1024") == 1.0 and numeric("356", "357") == 0.0 and numeric("", "357") == 0.0
    assert set(REWARDS) == {"exact_match", "numeric"} and get_reward("numeric") is numeric
    assert get_args(RewardName) == tuple(REWARDS) and get_args(UpdateMethod) == UPDATE_METHODS  # config = registry
    with pytest.raises(ValueError, match="known: exact_match, numeric"):
        get_reward("f1")


def test_rl_cli_pretrain_train_resume_eval(tmp_path, capsys, poison):
    """`looplm rl pretrain` (the trainer on the task stream), `looplm rl train` interrupted after 2 of 3
    updates and resumed equals an uninterrupted run bit for bit; results.json, rl.png, `looplm rl eval`."""
    import shutil

    from looplm.cli import main
    from looplm.run.checkpoint import load_checkpoint

    base = tmp_path / "base"
    tiny = ["--model.d_model", "32", "--model.d_ff", "64", "--model.seq_len", "20", "--train.steps", "3",
            "--train.batch_size", "4", "--train.eval_every", "0", "--train.ckpt_every", "0"]
    assert main(["rl", "pretrain", "--out", str(base), "--digits", "2", "--train-records", "400", "--quiet",
                 *tiny]) == 0
    assert json.loads((base / "task.json").read_text())["digits"] == 2
    opts = ["--rl.depth", "3", "--rl.neumann_steps", "2", "--rl.group_size", "2", "--rl.prompts_per_update", "2",
            "--rl.updates", "3", "--rl.eval_problems", "3", "--rl.eval_samples", "2", "--rl.compare_every", "2",
            "--rl.ckpt_every", "1", "--optim.lr", "1e-2", "--quiet"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main(["rl", "train", "--checkpoint", str(base), "--out", str(full), *opts]) == 0
    assert main(["rl", "train", "--checkpoint", str(base), "--out", str(cut), "--stop-after", "2", *opts]) == 0
    assert not (cut / "results.json").exists()
    assert main(["rl", "train", "--out", str(cut), "--resume", "--quiet"]) == 0
    a, b = (load_checkpoint(d)[0].state_dict() for d in (full, cut))
    assert all(torch.equal(a[k], b[k]) for k in a)  # exact: resume runs the same steps
    from looplm.run.checkpoint import newest_valid_checkpoint

    hostile = tmp_path / "hostile"  # a train_state.pt that runs code when unpickled: refused, never run
    shutil.copytree(cut, hostile)
    poison.train_state(newest_valid_checkpoint(hostile), tmp_path / "ran")
    capsys.readouterr()
    assert main(["rl", "train", "--out", str(hostile), "--resume", "--rl.updates", "4", "--quiet"]) == 2
    assert "refused" in capsys.readouterr().err and not (tmp_path / "ran").exists()
    res = json.loads((full / "results.json").read_text())
    assert res["updates"] == 3 and res["compare"]["updates"] == [1, 3]
    assert set(res["compare"]["time_s_median"]) == set(UPDATE_METHODS)
    assert res["state_bytes_per_position"] == 32 * 4 and res["state_bytes_per_generated_token"] > 0
    assert {"pass@1", "pass@2", "greedy"} <= set(res["before"]) and (full / "rl.png").stat().st_size > 0
    strip = lambda d: [{k: v for k, v in json.loads(ln).items() if not k.endswith("_s") and k != "compare"}
                       for ln in (d / "metrics.jsonl").read_text().splitlines()]
    assert strip(full) == strip(cut)
    capsys.readouterr()
    assert main(["rl", "eval", "--checkpoint", str(full), "--depth", "3", "--samples", "2", "--problems", "4",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["digits"] == 2 and out["problems"] == 4
    with pytest.raises(SystemExit):
        main(["rl", "train", "--out", str(tmp_path / "x")])  # --checkpoint needed without --resume
    # the task comes from the base's task.json; a checkpoint that is not an `rl pretrain` base is refused
    from looplm.rl.runner import _task_of
    from looplm.run.checkpoint import newest_valid_checkpoint

    ckpt = newest_valid_checkpoint(base)
    assert _task_of(ckpt, None, None).digits == 2
    other = tmp_path / "other"
    shutil.copytree(base, other)
    (other / "task.json").unlink()
    ock = newest_valid_checkpoint(other)
    with pytest.raises(ValueError, match="no task.json.*--digits"):
        _task_of(ock, None, None)
    assert _task_of(ock, None, 3).digits == 3
    tok = json.loads((ock / "tokenizer.json").read_text())
    tok["model"]["vocab"]["x"] = len(tok["model"]["vocab"])
    (ock / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="not the RL task's character vocabulary"):
        _task_of(ock, "addition", 3)


def test_all_zero_rewards_say_why_the_cosines_are_null(tmp_path):
    from pathlib import Path

    from looplm.rl.runner import summarize_run

    model = toy()
    _, roll = rollouts(model)
    roll.rewards.zero_()  # no response correct: every group's advantages r - mean(r) are 0
    batch = pack(roll)
    assert torch.equal(batch.advantages, torch.zeros_like(batch.advantages))
    cmp = compare_methods(model, batch, depth=R, neumann_steps=B_NEUMANN, max_new_tokens=M)
    assert set(cmp["cos"].values()) == {None} and set(cmp["grad_norm"].values()) == {0.0}
    rec = {"update": 1, "reward": 0.0, "rollout_s": 0.1, "update_s": 0.1, "generated_tokens": 4, "state_bytes": 0,
           "state_positions": 0, "compare": cmp}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rec) + "\n")
    res = summarize_run(tmp_path, RLConfig(), {}, {}, source=Path("base"), params=1)["compare"]
    assert set(res["cos_median"].values()) == {None}
    assert res["cos_null_reason"].startswith("1 of 1 compared updates had a zero gradient") and "all 0" in \
        res["cos_null_reason"]
    rec["compare"] = {**cmp, "grad_norm": {m: 1.0 for m in cmp["grad_norm"]}}  # a nonzero gradient: no reason
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rec) + "\n")
    res = summarize_run(tmp_path, RLConfig(), {}, {}, source=Path("base"), params=1)["compare"]
    assert res["cos_null_reason"] is None
