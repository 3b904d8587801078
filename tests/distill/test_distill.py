"""Distilled prefill (looplm.distill; LMDR §3.2 eq. 4, §5.5 Table 5; SPEC §8).

References: a student that returns the teacher's exact z^R makes the distilled prefill's terminal banks,
prefill logits and continuation logits equal the teacher's terminal-sharing prefill with R + 1
recurrences (the one recurrence after z^R), batched and left-padded, for every Huginn-family rule; the
eq. 4 loss against a hand computation with explicit loops; σ_T² against numpy; the student's
initialization against the teacher's core; causal attention; exact resume of ``distill``; strict and
teacher-checked loading; ``generate`` with a student against a hand-run prefill + greedy decoding; the
evaluation's teacher row against ``kv_sharing_eval`` (a second code path); the CLI end to end; the
bench's prefill case."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from looplm.config import Config, ConfigError, DataConfig, FixedDepthConfig, ModelConfig, OptimConfig, TrainConfig
from looplm.distill.config import DistillConfig
from looplm.distill.loss import VarianceAccumulator, distill_loss
from looplm.distill.prefill import distilled_prefill
from looplm.distill.student import StudentMismatchError, build_student, load_student, teacher_fingerprint
from looplm.model import KVCache, build_model
from looplm.model.cursor import Readout
from helpers import VARIANTS, tiny  # noqa: E402

HUGINN = ["huginn_linear-huginn", "parcae_decay-huginn", "parcae-huginn", "orthoinj-huginn", "deq_qkv-huginn",
          "looped-prelude-coda"]


def teacher_for(name: str, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(tiny(**VARIANTS[name], seq_len=24, init_std=0.1)).eval()


class Oracle:
    """A 'student' that returns a given ẑ (the teacher's exact z^R) whatever e it is shown."""

    def __init__(self, z: torch.Tensor):
        self.z = z
        self.seen_e: torch.Tensor | None = None

    def __call__(self, e, key_valid=None):
        self.seen_e = e
        return self.z


def _max_bank_diff(a: KVCache, b: KVCache) -> float:
    assert sorted(a.banks) == sorted(b.banks)
    assert a.length == b.length
    return max(float((a.banks[k][i] - b.banks[k][i]).abs().max()) for k in a.banks for i in (0, 1))


# --------------------------------------------------------------------------- the prefill path
@pytest.mark.parametrize("name", HUGINN)
@pytest.mark.parametrize("padded", [False, True])
@torch.no_grad()
def test_exact_student_reproduces_the_teachers_terminal_prefill(name, padded):
    """ẑ = z^R exactly: the banks, the prefill's logits and the continuation logits decoded at R equal
    the teacher's terminal-sharing prefill with R + 1 recurrences (the recurrence after z^R)."""
    model = teacher_for(name)
    R, P = 3, 10
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, model.cfg.vocab_size, (3, 18), generator=g)
    mask = None
    if padded:  # rows of 10, 6 and 8 real prompt tokens, left-padded
        mask = torch.ones(3, P, dtype=torch.long)
        mask[1, :4], mask[2, :2] = 0, 0
    prompt = x[:, :P]
    z_R = model.read(model.loop(prompt, attention_mask=mask), R, readout=Readout(states=True)).states[R]
    oracle = Oracle(z_R)
    distilled, teacher = KVCache("terminal"), KVCache("terminal")
    out_d = distilled_prefill(model, oracle, prompt, R, distilled, attention_mask=mask)
    out_t = model.read(model.loop(prompt, cache=teacher, attention_mask=mask), R + 1)
    bank_diff = _max_bank_diff(distilled, teacher)
    logit_diff = float((out_d.logits - out_t.logits).abs().max())
    if mask is None:  # the student is shown the prelude output e
        assert torch.equal(oracle.seen_e, model.embed(prompt))  # exact: same computation
    cont_d = model.read(model.loop(x[:, P:], cache=distilled), R).logits
    cont_t = model.read(model.loop(x[:, P:], cache=teacher), R).logits
    cont_diff = float((cont_d - cont_t).abs().max())
    print(f"{name} padded={padded}: max |Δ| banks {bank_diff:.2e}, prefill logits {logit_diff:.2e}, "
          f"continuation logits {cont_diff:.2e}")
    # exact: the last recurrence runs the same kernels on the same z^R (the teacher's own state)
    assert bank_diff == 0.0 and logit_diff == 0.0 and cont_diff == 0.0
    # the distilled path fills one bank per physical layer: prelude + core + coda
    assert distilled.n_banks() == model.cfg.n_prelude + model.cfg.n_core + model.cfg.n_coda


@torch.no_grad()
def test_exact_student_at_a_fixed_point_equals_the_prefill_at_R():
    """At an exact fixed point (z^{R+1} = z^R, and the same K/V at every recurrence) the distilled banks
    are the teacher's prefill at R itself: huginn_linear with the state half of its adapter zeroed,
    ζ = W_e e + b, so every recurrence r ≥ 1 computes the same ζ, K/V and z^r."""
    model = teacher_for("huginn_linear-huginn")
    model.rule.adapter.weight[:, :model.cfg.d_model] = 0.0
    x = torch.randint(0, model.cfg.vocab_size, (2, 16))
    R, P = 4, 9
    states = model(x[:, :P], R + 1, readout=Readout(states=True)).states
    assert float((states[R + 1] - states[R]).abs().max()) == 0.0  # exact: a fixed point
    distilled, teacher = KVCache("terminal"), KVCache("terminal")
    distilled_prefill(model, Oracle(states[R]), x[:, :P], R, distilled)
    model.read(model.loop(x[:, :P], cache=teacher), R)
    assert _max_bank_diff(distilled, teacher) == 0.0


def test_distilled_prefill_refuses_bad_caches():
    model = teacher_for("huginn_linear-huginn")
    x = torch.randint(0, model.cfg.vocab_size, (1, 8))
    z = torch.zeros(1, 8, model.cfg.d_model)
    with pytest.raises(ValueError, match="needs a terminal KV cache"):
        distilled_prefill(model, Oracle(z), x, 3, KVCache("per_visit"))
    cache = KVCache("terminal")
    model.read(model.loop(x, cache=cache), 2)
    with pytest.raises(ValueError, match="already holds 8 positions"):
        distilled_prefill(model, Oracle(z), x, 3, cache)
    with pytest.raises(ValueError, match="resume: the state must have shape"):
        distilled_prefill(model, Oracle(z[:, :5]), x, 3, KVCache("terminal"))


# --------------------------------------------------------------------------- the student
def test_student_starts_as_the_teachers_core_and_attends_causally():
    model = teacher_for("huginn_linear-huginn")
    model.requires_grad_(False)
    student = build_student(model, DistillConfig(n_blocks=3))
    core = model.core.blocks
    for i, block in enumerate(student.blocks):  # block i = core block i mod n_core
        for (n, p), q in zip(block.named_parameters(), core[i % len(core)].parameters()):
            assert torch.equal(p, q) and p.data_ptr() != q.data_ptr(), n  # exact: a copy
    assert all(p.requires_grad for p in student.parameters())
    rand = build_student(model, DistillConfig(init="random", seed=1))
    w = rand.blocks[0].attn.qkv.weight
    assert not torch.equal(w, core[0].attn.qkv.weight)
    assert float(w.detach().std()) == pytest.approx(model.cfg.init_std, rel=0.1)
    assert float(rand.blocks[0].attn.proj.weight.detach().std()) == pytest.approx(model.cfg.init_std / 2, rel=0.15)
    torch.testing.assert_close(build_student(model, DistillConfig(init="random", seed=1)).blocks[1].mlp.down.weight,
                               rand.blocks[1].mlp.down.weight)
    # causal: changing position 5 leaves positions 0..4 unchanged, and changes 5..
    e = torch.randn(2, 9, model.cfg.d_model)
    e2 = e.clone()
    e2[:, 5] += 1.0
    with torch.no_grad():
        a, b = student(e), student(e2)
    # exact: same shapes, the change masked
    assert torch.equal(a[:, :5], b[:, :5]) and not torch.allclose(a[:, 5:], b[:, 5:])
    # a left-padded row equals the unpadded row
    with torch.no_grad():
        padded = torch.cat([torch.randn(1, 3, model.cfg.d_model), e[:1, :6]], 1)
        valid = torch.tensor([[False] * 3 + [True] * 6])
        torch.testing.assert_close(student(padded, valid)[:, 3:], student(e[:1, :6]), rtol=1e-5, atol=1e-6)
    assert torch.allclose(a.pow(2).mean(-1), torch.ones(2, 9), atol=1e-4)  # out_norm: RMS 1 at gain 1


def test_distill_config_validation():
    with pytest.raises(ConfigError, match="distill.kl_weight: hidden_weight and kl_weight are both 0"):
        DistillConfig(hidden_weight=0.0, kl_weight=0.0)
    with pytest.raises(ConfigError, match="distill.init"):
        DistillConfig(init="copy")
    with pytest.raises(ConfigError, match="distill.n_blocks"):
        DistillConfig(n_blocks=0)
    with pytest.raises(ConfigError, match="optim.lr: must be > 0"):
        DistillConfig(optim={"lr": 0.0})
    cfg = DistillConfig().with_overrides({"distill.n_blocks": "3", "optim.lr": "2e-3"})
    assert (cfg.n_blocks, cfg.optim.lr, cfg.optim.warmup_steps) == (3, 2e-3, 20)  # distill's own optim defaults
    assert DistillConfig.from_dict(json.loads(cfg.to_json())) == cfg
    with pytest.raises(ConfigError, match=r"distill.n_block: unknown field \(did you mean n_blocks\?\)"):
        cfg.with_overrides({"distill.n_block": "3"})
    with pytest.raises(ConfigError, match="optim.warmup: unknown field"):
        cfg.with_overrides({"optim.warmup": "3"})
    with pytest.raises(ConfigError, match="optim: missing"):
        DistillConfig.from_dict({k: v for k, v in cfg.to_dict().items() if k != "optim"})


# --------------------------------------------------------------------------- eq. 4
def test_loss_equals_a_hand_computation():
    g = torch.Generator().manual_seed(0)
    B, N, d, V = 2, 3, 4, 5
    z_hat, z = torch.randn(B, N, d, generator=g), torch.randn(B, N, d, generator=g)
    s_logits, t_logits = torch.randn(B, N, V, generator=g), torch.randn(B, N, V, generator=g)
    sigma2 = 0.7
    # by hand: per window ‖ẑ − z‖²_F / (N d σ²) and N⁻¹ Σ_t Σ_v p log(p / p̂), then the batch mean
    hidden = kl = 0.0
    for b in range(B):
        sq = sum((float(z_hat[b, t, i]) - float(z[b, t, i])) ** 2 for t in range(N) for i in range(d))
        hidden += sq / (N * d * sigma2) / B
        for t in range(N):
            zp = sum(math.exp(float(v)) for v in t_logits[b, t])
            zq = sum(math.exp(float(v)) for v in s_logits[b, t])
            for v in range(V):
                p = math.exp(float(t_logits[b, t, v])) / zp
                q = math.exp(float(s_logits[b, t, v])) / zq
                kl += p * math.log(p / q) / (N * B)
    res = distill_loss(z_hat, z, sigma2, student_logits=s_logits, teacher_logits=t_logits)
    print(f"hidden {float(res.hidden):.8f} vs {hidden:.8f}; kl {float(res.kl):.8f} vs {kl:.8f}")
    assert float(res.hidden) == pytest.approx(hidden, rel=1e-5)
    assert float(res.kl) == pytest.approx(kl, rel=1e-5)
    assert float(res.loss) == pytest.approx(hidden + kl, rel=1e-5)
    weighted = distill_loss(z_hat, z, sigma2, student_logits=s_logits, teacher_logits=t_logits,
                            hidden_weight=0.5, kl_weight=2.0)
    assert float(weighted.loss) == pytest.approx(0.5 * hidden + 2 * kl, rel=1e-5)
    hidden_only = distill_loss(z_hat, z, sigma2, kl_weight=0.0)  # KL switched off: no logits needed
    assert float(hidden_only.loss) == pytest.approx(hidden, rel=1e-5) and float(hidden_only.kl) == 0.0
    kl_only = distill_loss(z_hat, z, sigma2, student_logits=s_logits, teacher_logits=t_logits, hidden_weight=0.0)
    assert float(kl_only.loss) == pytest.approx(kl, rel=1e-5)
    assert float(distill_loss(z, z, sigma2, student_logits=t_logits, teacher_logits=t_logits).loss) == 0.0
    with pytest.raises(ValueError, match="kl_weight > 0 needs"):
        distill_loss(z_hat, z, sigma2)


def test_sigma2_is_the_population_variance_of_every_entry():
    g = torch.Generator().manual_seed(1)
    chunks = [torch.randn(3, 5, 4, generator=g) * 2 + 0.5 for _ in range(3)]
    acc = VarianceAccumulator()
    for c in chunks:
        acc.add(c)
    ref = np.var(np.concatenate([c.numpy().ravel() for c in chunks]).astype(np.float64))
    assert acc.variance() == pytest.approx(ref, rel=1e-9)
    with pytest.raises(ValueError, match="constant states"):
        const = VarianceAccumulator()
        const.add(torch.ones(2, 3))
        const.variance()


# --------------------------------------------------------------------------- training, checkpoints, resume
TEACHER_CFG = Config(
    name="tiny-huginn",
    model=ModelConfig(rule="huginn_linear", n_prelude=1, n_core=2, n_coda=1, d_model=32, n_heads=2, d_ff=64,
                      seq_len=32, dropout=0.0),
    data=DataConfig(dataset="brown", tokenizer="bpe", bpe_vocab_size=512),
    depth=FixedDepthConfig(depth=3), optim=OptimConfig(lr=3e-3, warmup_steps=2),
    train=TrainConfig(steps=8, batch_size=4, eval_every=0, eval_batches=2, eval_depth=3, ckpt_every=0, device="cpu"))
SMALL = dict(steps=6, batch_size=4, eval_every=3, eval_batches=2, ckpt_every=3, sigma_batches=2,
             optim=OptimConfig(lr=3e-3, warmup_steps=20))


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    from looplm.train.trainer import train

    run = tmp_path_factory.mktemp("distill") / "teacher"
    train(TEACHER_CFG, run, progress=False)
    return run


@pytest.fixture(scope="module")
def student_run(teacher_run):
    from looplm.distill.train import distill

    summary = distill(teacher_run, None, DistillConfig(**SMALL), progress=False)
    assert summary["completed_steps"] == 6
    return teacher_run / "student"


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_distill_writes_a_student_next_to_the_teacher(teacher_run, student_run):
    from looplm.distill.student import read_record
    from looplm.run.checkpoint import load_checkpoint

    record, ckpt = read_record(student_run)
    teacher = load_checkpoint(teacher_run)[0]
    assert ckpt.parent == student_run / "checkpoints" and ckpt.name == "step-000006"
    assert record.teacher.fingerprint == teacher_fingerprint(teacher)
    assert record.distill.depth == 3 and record.distill.steps == 6  # the teacher's nominal depth
    assert record.sigma2 > 0
    rows = _metrics(student_run)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert {"val_hidden", "val_kl", "val_ce_teacher", "val_ce_student"} <= set(rows[2])
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert json.loads((student_run / "summary.json").read_text())["completed_steps"] == 6


def test_default_budget_is_a_quarter_of_the_teachers_tokens():
    from looplm.distill.train import resolve_config

    cfg = resolve_config(DistillConfig(), TEACHER_CFG)
    assert (cfg.depth, cfg.batch_size, cfg.steps) == (3, 4, 2)  # 8 steps × 4 windows / 4 = 8 windows
    assert resolve_config(DistillConfig(batch_size=3), TEACHER_CFG).steps == 3  # ceil(8 / 3)


def test_resume_is_exact(teacher_run, student_run, tmp_path):
    from looplm.distill.train import distill

    out = tmp_path / "resumed"
    distill(teacher_run, out, DistillConfig(**SMALL), stop_after=4, progress=False)
    distill(teacher_run, out, None, resume=True, progress=False)
    a, b = _metrics(student_run), _metrics(out)
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    from looplm.run.checkpoint import load_checkpoint

    teacher = load_checkpoint(teacher_run)[0]
    s1, s2 = load_student(student_run, teacher)[0], load_student(out, teacher)[0]
    for (n, p), q in zip(s1.state_dict().items(), s2.state_dict().values()):
        assert torch.equal(p, q), n  # exact: resume runs the same steps
    with pytest.raises(ValueError, match="already holds a student"):
        distill(teacher_run, out, DistillConfig(**SMALL), progress=False)


def test_resume_refuses_a_train_state_that_runs_code(teacher_run, student_run, tmp_path, poison):
    import shutil

    from looplm.distill.train import distill
    from looplm.run.checkpoint import CheckpointError, newest_valid_checkpoint

    out, marker = tmp_path / "student", tmp_path / "ran"
    shutil.copytree(student_run, out)
    poison.train_state(newest_valid_checkpoint(out), marker)
    with pytest.raises(CheckpointError, match="refused"):
        distill(teacher_run, out, None, resume=True, progress=False)
    assert not marker.exists()


def test_loading_checks_the_teacher_and_is_strict(teacher_run, student_run, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from looplm.run.checkpoint import CheckpointError, load_checkpoint

    teacher = load_checkpoint(teacher_run)[0]
    other = load_checkpoint(teacher_run)[0]
    with torch.no_grad():
        other.coda[0].mlp.down.weight[0, 0] += 1e-3
    with pytest.raises(StudentMismatchError, match="distilled from the teacher"):
        load_student(student_run, other)
    # an extra weight is refused (strict), even with a manifest that matches it
    bad = tmp_path / "bad"
    shutil.copytree(student_run / "checkpoints" / "step-000006", bad)
    weights = load_file(str(bad / "model.safetensors"))
    weights["extra.weight"] = torch.zeros(2)
    save_file(weights, str(bad / "model.safetensors"))
    manifest = json.loads((bad / "manifest.json").read_text())
    from looplm.run.checkpoint import sha256_file

    manifest["files"]["model.safetensors"] = {"bytes": (bad / "model.safetensors").stat().st_size,
                                              "sha256": sha256_file(bad / "model.safetensors")}
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="cannot load the student's weights"):
        load_student(bad, teacher)
    with pytest.raises(CheckpointError, match="not a distilled-student config"):
        load_student(load_checkpoint(teacher_run)[3], teacher)  # the teacher's own checkpoint


# --------------------------------------------------------------------------- generate, eval, CLI
def test_generate_with_a_student_equals_a_hand_run_prefill(teacher_run, student_run):
    from looplm.eval.generate import generate
    from looplm.run.checkpoint import load_checkpoint

    teacher = load_checkpoint(teacher_run)[0]
    student, record, _ = load_student(student_run, teacher)
    R, n = record.distill.depth, 6
    prompts = [[5, 17, 3, 88, 41, 9, 2], [60, 4, 4, 13, 200, 7, 99]]
    got = generate(teacher, prompts, n, R, cache_mode="terminal", student=student)
    with torch.no_grad():
        cache = KVCache("terminal")
        nxt = distilled_prefill(teacher, student, torch.tensor(prompts), R, cache).logits[:, -1].argmax(-1)
        ref = [nxt]
        for _ in range(n - 1):
            nxt = teacher.read(teacher.loop(nxt[:, None], cache=cache), R).logits[:, -1].argmax(-1)
            ref.append(nxt)
    assert got.tokens == torch.stack(ref, 1).tolist()
    assert got.depths == [[1] + [R] * (n - 1)] * 2
    with pytest.raises(ValueError, match="cache_mode='terminal'"):
        generate(teacher, prompts, n, R, student=student)


def test_eval_teacher_row_matches_kv_sharing_and_full_first_token(teacher_run, student_run):
    """Second code path: the teacher row's rest-of-continuation PPL is ``kv_sharing_eval``'s terminal PPL,
    and its first-token PPL is the full forward's (a prefill's last position sees the same context)."""
    from looplm.data.paths import resolve_cache_dir, resolve_data_root
    from looplm.data.tokenizer import eot_id
    from looplm.data.tokens import load_tokens
    from looplm.distill.evaluate import distill_continuation_eval
    from looplm.eval.kvsharing import kv_sharing_eval
    from looplm.eval.runner import load_tokenizer_for
    from looplm.run.checkpoint import load_checkpoint

    teacher, cfg, _, ckpt = load_checkpoint(teacher_run)
    student = load_student(student_run, teacher)[0]
    tok = load_tokenizer_for(ckpt)
    tokens = load_tokens(cfg.data, "valid", tok, resolve_data_root(""), resolve_cache_dir(""))
    eot = eot_id(tok)
    res = distill_continuation_eval(teacher, student, tokens, 3, batch_size=4, max_tokens=640, eot_id=eot,
                                    progress=False)
    assert list(res) == ["full", "teacher", "teacher_r2", "teacher_r1", "distilled"]
    kv = kv_sharing_eval(teacher, tokens, [3], batch_size=4, max_tokens=640, eot_id=eot, progress=False)[3]
    assert res["teacher"]["ppl_rest"] == pytest.approx(kv["ppl_terminal"], rel=1e-6)
    assert res["full"]["ppl_rest"] == pytest.approx(kv["ppl_full"], rel=1e-6)
    assert res["teacher"]["ppl_first"] == pytest.approx(res["full"]["ppl_first"], rel=1e-5)
    assert res["teacher"]["kv_bytes"] == res["distilled"]["kv_bytes"] == kv["kv_bytes_terminal"]
    assert [res[k]["recurrences"] for k in res] == [3, 3, 2, 1, 1]
    for r in res.values():
        assert math.isfinite(r["ppl"]) and r["tokens"] == res["full"]["tokens"]


def test_cli_distill_eval_and_generate(teacher_run, student_run, tmp_path, capsys):
    from looplm.cli import main

    out = tmp_path / "d.json"
    assert main(["eval", "distill", "--checkpoint", str(teacher_run), "--max-tokens", "400", "--batch-size", "4",
                 "--early-depths", "2,1", "--split", "valid", "--out", str(out), "--quiet"]) == 0
    res = json.loads(out.read_text())
    assert list(res["paths"]) == ["full", "teacher", "teacher_r2", "teacher_r1", "distilled"]
    assert res["depth"] == 3 and res["student"].endswith("step-000006")
    assert "Distilled (student + 1 recurrence)" in out.with_suffix(".md").read_text()
    capsys.readouterr()
    gen = tmp_path / "g.json"
    assert main(["generate", "--checkpoint", str(teacher_run), "--prompt", "The jury said", "--max-new-tokens", "4",
                 "--prefill", "distilled", "--out", str(gen)]) == 0
    settings = json.loads(gen.read_text())["settings"]
    assert settings["prefill"] == "distilled" and settings["kv_cache"] == "terminal" and settings["depth"] == 3
    assert main(["generate", "--checkpoint", str(teacher_run), "--prompt", "The", "--prefill", "distilled",
                 "--kv-cache", "per_visit"]) == 2
    assert "use --kv-cache terminal" in capsys.readouterr().err
    # a fresh CLI run: options come from DistillConfig; a second run into the same folder is refused
    run = tmp_path / "stu"
    assert main(["distill", "--checkpoint", str(teacher_run), "--out", str(run), "--distill.steps", "2",
                 "--distill.batch_size", "2", "--distill.sigma_batches", "1", "--distill.eval_every", "0",
                 "--distill.init", "random", "--distill.kl_weight", "0", "--optim.lr", "2e-3", "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["completed_steps"] == 2 and "val_kl" in summary
    from looplm.run.checkpoint import newest_valid_checkpoint

    saved = json.loads((newest_valid_checkpoint(run) / "config.json").read_text())["distill"]
    assert (saved["optim"]["lr"], saved["init"]) == (2e-3, "random")
    assert main(["distill", "--checkpoint", str(teacher_run), "--out", str(run), "--quiet"]) == 2
    assert "already holds a student" in capsys.readouterr().err
    assert main(["distill", "--checkpoint", str(teacher_run), "--out", str(run), "--quiet", "--distill.hidden_weight",
                 "0", "--distill.kl_weight", "0"]) == 2


def test_bench_prefill_case_quick():
    from looplm.apps.bench import huginn_config, prefill_markdown, prefill_measurements

    res = prefill_measurements(huginn_config(quick=True), depth=5, contexts=(12, 16), repeat=2,
                               device=torch.device("cpu"), prefix="h_")
    assert res["h_prefill_blocks"] == {"teacher": 12, "teacher_r3": 8, "teacher_r2": 6, "teacher_r1": 4,
                                       "distilled": 6}
    for c in (12, 16):
        assert set(res[f"h_prefill_ms_ctx{c}"]) == set(res["h_prefill_blocks"])
        assert res[f"h_distilled_prefill_speedup_ctx{c}"] > 0
        # the speed-up is the median of its interleaved A/B/B/A rounds (issue 28 §3), three by default
        rounds = res[f"h_prefill_rounds_ctx{c}"]["rounds"]
        assert len(rounds) == 3 and res[f"h_distilled_prefill_speedup_ctx{c}"] == sorted(rounds)[1]
    assert "distilled speed-up" in "\n".join(prefill_markdown(res, "h_"))
