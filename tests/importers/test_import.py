"""Issue 14 §2–3: ``looplm import huginn|ouro`` against the parity fixtures (tests/fixtures/import/, values
computed in fp32 by the original code; docs/importers-layout.md), strictness of the import, and the
diagnostics commands on imported models.

Determinism: Huginn's initial state is random in the original. Logits at a depth start the loop from the
fixture's saved ``initial_state`` (``model.loop(ids).resume(0, s0)``: the Huginn rule's loop state is h
itself, so the loop starts exactly there); its decoding fixture used ``init_scale=0``, i.e. the zero state
for every token (``--initial-state zeros``). Ouro has no randomness at inference.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from looplm.cli import main
from looplm.eval.exits import exit_cdf_depths
from looplm.eval.generate import generate
from looplm.importers.common import ImporterError
from looplm.importers.huginn import import_huginn, write_huginn_folder
from looplm.importers.ouro import import_ouro
from looplm.run.checkpoint import load_checkpoint
from looplm.train.losses import exit_distribution
from looplm.model.cursor import Readout

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "import"
TOL = 1e-4  # absolute, fp32 (logits std ≈ 2.5 for Huginn, 1.2 for Ouro)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """Both fixtures imported once (as stored: bf16), loaded back as looplm would load them (fp32)."""
    root = tmp_path_factory.mktemp("imported")
    out = {}
    for name, run in (("huginn", import_huginn), ("ouro", import_ouro)):
        run(FIXTURES / name, root / name, progress=False)
        model, cfg, _, ckpt = load_checkpoint(root / name)
        out[name] = (model, cfg, root / name, load_file(str(FIXTURES / name / "expected.safetensors")))
    return out


def _report(what: str, got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got.float() - want.float()).abs()
    print(f"{what}: max |diff| {diff.max().item():.3g}, mean {diff.mean().item():.3g}")
    return diff.max().item()


# ---------------------------------------------------------------- Huginn-0125
def test_huginn_logits_and_latents_equal_the_original_at_every_depth(imported):
    model, cfg, _, exp = imported["huginn"]
    assert cfg.train.eval_depth == 4 and cfg.model.position.table_dtype == "bfloat16"
    ids, s0 = exp["input_ids"], exp["initial_state"]
    with torch.no_grad():
        out = model.read(model.loop(ids).resume(0, s0), [1, 2, 4, 8], readout=Readout(states=True))
    for n in (1, 2, 4, 8):
        assert _report(f"logits n={n}", out.logits_by_depth[n], exp[f"logits_steps{n}"]) <= TOL
        # the original's latent_states: ln_f of the state after n steps, the coda's input
        assert _report(f"latent n={n}", model.norm_f(out.states[n]), exp[f"latent_steps{n}"]) <= TOL


def test_huginn_zero_state_logits_and_cached_greedy_decoding(imported, tmp_path):
    """The decoding fixture: init_scale=0 (every token starts from s0 = 0), num_steps=3 ≠ mean_recurrence."""
    exp = imported["huginn"][3]
    import_huginn(FIXTURES / "huginn", tmp_path / "zeros", initial_state="zeros", progress=False)
    model, cfg, _, _ = load_checkpoint(tmp_path / "zeros")
    assert cfg.model.options.state_init == "zeros"
    with torch.no_grad():
        logits = model(exp["input_ids"], depth=3).logits
    assert _report("zero-state logits n=3", logits, exp["logits_zero_init_steps3"]) <= TOL
    gen = generate(model, exp["input_ids"].tolist(), 8, 3)  # per-visit KV cache, greedy
    assert gen.tokens == exp["greedy_tokens"].tolist()


def test_huginn_needs_the_bf16_rope_table(imported):
    """The stored freqs_cis is looplm's float32 table rounded to bf16 (the importer checks it exactly);
    rotating with the unrounded table moves the logits far beyond the tolerance."""
    model, cfg, _, exp = imported["huginn"]
    exact = model.cfg.replace(position=model.cfg.position.replace(table_dtype="float32"))
    from looplm.model import build_model

    other = build_model(exact).eval()
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        logits = other.read(other.loop(exp["input_ids"]).resume(0, exp["initial_state"]), 4).logits
    assert _report("float32 table, n=4", logits, exp["logits_steps4"]) > 1e-3


# ---------------------------------------------------------------- Ouro
def test_ouro_logits_hidden_states_and_exit_distribution_equal_the_original(imported):
    model, cfg, _, exp = imported["ouro"]
    assert cfg.train.eval_depth == 4 and cfg.model.kv_heads == 2
    with torch.no_grad():
        out = model(exp["input_ids"], [1, 2, 3, 4], readout=Readout(states=True))
    for u in (1, 2, 3, 4):
        assert _report(f"logits ut={u}", out.logits_by_depth[u], exp[f"logits_ut{u}"]) <= TOL
        assert _report(f"hidden ut={u}", out.states[u], exp[f"hidden_ut{u}"]) <= TOL
    gates = [out.exit_logits_by_depth[u] for u in (1, 2, 3, 4)]
    assert _report("gate logits", torch.stack(gates, -1), exp["exit_gate_logits"]) <= TOL
    assert _report("exit pdf", exit_distribution(gates).movedim(0, -1), exp["exit_pdf"]) <= 1e-5


@pytest.mark.parametrize("tau,key", [(1.0, "exit_step_default"), (0.6, "exit_step_exit_threshold_0.6")])
def test_ouro_exit_steps_and_thresholded_logits(imported, tau, key):
    """Ouro's threshold rule is exit_cdf_depths over one fixed-depth forward; τ = 1.0 is its config default."""
    model, _, _, exp = imported["ouro"]
    with torch.no_grad():
        out = model(exp["input_ids"], depth=[1, 2, 3, 4])
    depth = exit_cdf_depths([out.exit_logits_by_depth[u] for u in (1, 2, 3, 4)], tau)
    # exact: integer steps (every CDF is ≥ 1e-3 from τ); the original's steps are 0-based
    assert torch.equal(depth - 1, exp[key])
    stack = torch.stack([out.logits_by_depth[u] for u in (1, 2, 3, 4)])  # (4, B, L, V)
    chosen = stack.gather(0, (depth - 1)[None, ..., None].expand(1, *stack.shape[1:]))[0]
    want = exp["logits_ut4"] if tau == 1.0 else exp["logits_exit_threshold_0.6"]
    assert _report(f"thresholded logits τ={tau}", chosen, want) <= TOL


def test_ouro_cached_greedy_decoding(imported):
    model, cfg, _, exp = imported["ouro"]
    gen = generate(model, exp["input_ids"].tolist(), 8, cfg.train.eval_depth)  # τ = 1.0: every token at depth 4
    assert gen.tokens == exp["greedy_tokens"].tolist()


# ---------------------------------------------------------------- strictness
def _copy(name: str, tmp: Path, *, tensors=None, config=None) -> Path:
    """A copy of fixture ``name`` with its tensors and/or config.json edited by the given functions."""
    src = tmp / f"{name}-edited"
    shutil.copytree(FIXTURES / name, src)
    if tensors is not None:
        sd = load_file(str(src / "model.safetensors"))
        tensors(sd)
        save_file(sd, str(src / "model.safetensors"))
    if config is not None:
        cfg = json.loads((src / "config.json").read_text())
        config(cfg)
        (src / "config.json").write_text(json.dumps(cfg))
    return src


STRICT = {
    "huginn extra tensor": ("huginn", dict(tensors=lambda sd: sd.update({"transformer.extra.weight": torch.ones(2)})),
                            "'transformer.extra.weight'"),
    "huginn missing tensor": ("huginn", dict(tensors=lambda sd: sd.pop("transformer.core_block.1.mlp.fc.weight")),
                              "'transformer.core_block.1.mlp.fc.weight' (for core.blocks.1.mlp.gate_up.weight)"),
    "huginn missing rope table": ("huginn", dict(tensors=lambda sd: sd.pop("freqs_cis")), "'freqs_cis'"),
    "huginn other rope table": ("huginn", dict(tensors=lambda sd: sd["freqs_cis"].mul_(1.01)),
                                "tensor 'freqs_cis'"),
    "huginn shape": ("huginn", dict(config=lambda c: c.update(intermediate_size=64)),
                     "'transformer.prelude.0.mlp.fc.weight' [96, 64] gives [96, 64] for prelude.0.mlp.gate_up.weight, "
                     "but config.json describes [128, 64]"),
    "huginn noise": ("huginn", dict(config=lambda c: c.update(test_time_noise=0.1)), "test_time_noise"),
    "huginn gqa": ("huginn", dict(config=lambda c: c.update(num_key_value_heads=2)), "num_key_value_heads"),
    "huginn head_dim": ("huginn", dict(config=lambda c: c.update(head_dim=32)), "head_dim"),
    "huginn unknown key": ("huginn", dict(config=lambda c: c.update(lookup_strategy="latest-m4")), "'lookup_strategy'"),
    "huginn seq_len": ("huginn", dict(), "--seq-len 33"),
    "ouro extra tensor": ("ouro", dict(tensors=lambda sd: sd.update({"model.rotary_emb.inv_freq": torch.ones(8)})),
                          "'model.rotary_emb.inv_freq'"),
    "ouro missing tensor": ("ouro", dict(tensors=lambda sd: sd.pop("model.layers.1.self_attn.k_proj.weight")),
                            "'model.layers.1.self_attn.k_proj.weight' (for core.blocks.1.attn.qkv.weight)"),
    "ouro sliding window": ("ouro", dict(config=lambda c: c.update(use_sliding_window=True)), "use_sliding_window"),
    "ouro layer types": ("ouro", dict(config=lambda c: c.update(layer_types=["full_attention", "sliding_attention"])),
                         "layer_types"),
    "ouro head_dim": ("ouro", dict(config=lambda c: c.update(head_dim=32)), "head_dim"),
    "ouro rope scaling": ("ouro", dict(config=lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0})),
                          "rope_scaling.rope_type"),
    "ouro exit step": ("ouro", dict(config=lambda c: c.update(early_exit_step=1)), "early_exit_step"),
    "ouro unknown key": ("ouro", dict(config=lambda c: c.update(qk_norm=True)), "'qk_norm'"),
    "ouro tied head": ("ouro", dict(config=lambda c: c.update(tie_word_embeddings=True)), "'lm_head.weight'"),
}


@pytest.mark.parametrize("case", list(STRICT))
def test_import_refuses_what_it_cannot_map_naming_the_key(case, tmp_path):
    name, edits, named = STRICT[case]
    src = _copy(name, tmp_path, **edits)
    run = import_huginn if name == "huginn" else import_ouro
    kw = {"seq_len": 33} if case == "huginn seq_len" else {}
    with pytest.raises(ImporterError) as err:
        run(src, tmp_path / "out", progress=False, **kw)
    print(err.value)
    assert named in str(err.value)
    assert not (tmp_path / "out" / "latest").exists()


def test_cli_import_and_refused_output(tmp_path, capsys):
    out = tmp_path / "h"
    assert main(["import", "huginn", str(FIXTURES / "huginn"), "--out", str(out), "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["depth"] == 4 and summary["rope_table_dtype"] == "bfloat16" and summary["dtype"] == "bfloat16"
    record = json.loads((Path(summary["checkpoint"]) / "import.json").read_text())
    assert record["format"] == "huginn-0125" and record["checked_not_stored"] == ["freqs_cis"]
    assert len(record["mapped"]) + 1 == record["tensors"]  # every stored tensor but freqs_cis feeds a weight
    # an existing checkpoint is refused before any work; an unknown source folder names itself
    assert main(["import", "huginn", str(FIXTURES / "huginn"), "--out", str(out), "--quiet"]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert main(["import", "ouro", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert main(["import", "ouro", str(FIXTURES / "ouro"), "--out", str(tmp_path / "o"), "--dtype", "float32",
                 "--seq-len", "48", "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["dtype"] == "float32" and summary["seq_len"] == 48
    assert load_file(str(Path(summary["checkpoint"]) / "model.safetensors"))["tok_emb.weight"].dtype == torch.float32


def test_sharded_source_with_index_imports_the_same_weights(imported, tmp_path):
    """The published checkpoints come in shards with model.safetensors.index.json: split the Ouro fixture in two,
    import it, get the same weights; an index that misplaces a tensor is refused by name."""
    src = tmp_path / "sharded"
    shutil.copytree(FIXTURES / "ouro", src, ignore=shutil.ignore_patterns("model.safetensors", "expected.*"))
    sd = load_file(str(FIXTURES / "ouro" / "model.safetensors"))
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(src / file))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    import_ouro(src, tmp_path / "out", progress=False)
    back = load_checkpoint(tmp_path / "out")[0].state_dict()
    want = imported["ouro"][0].state_dict()
    assert back.keys() == want.keys() and all(torch.equal(back[k], want[k]) for k in want)  # exact: copies
    index["weight_map"][names[0]] = "model-00002-of-00002.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ImporterError, match=f"names tensor '{names[0]}' in model-00002-of-00002.safetensors, but it "
                       "is in model-00001-of-00002.safetensors"):
        import_ouro(src, tmp_path / "out2", progress=False)


# ---------------------------------------------------------------- round trip: a looplm model in Huginn's layout
def test_huginn_layout_round_trip_is_exact(tmp_path):
    """A looplm model with Huginn-0125's options, written in the published layout and imported again, has the
    same weights and logits (float32 throughout, so the RoPE table is the unrounded one)."""
    from looplm.config import Config
    from looplm.importers.huginn import huginn_layout_config
    from looplm.model import build_model

    torch.manual_seed(0)
    cfg = Config(model=huginn_layout_config(vocab_size=96, d_model=32, n_heads=2, d_ff=48, seq_len=24, n_prelude=1,
                                            n_core=2, n_coda=1))
    model = build_model(cfg.model).eval()
    with torch.no_grad():
        for p in model.parameters():  # non-trivial norms and biases
            p.add_(0.1 * torch.randn_like(p))
    tok = (FIXTURES / "ouro" / "tokenizer.json").read_text()
    write_huginn_folder(model, tok, tmp_path / "src", depth=3)
    import_huginn(tmp_path / "src", tmp_path / "out", progress=False)
    back, bcfg, _, _ = load_checkpoint(tmp_path / "out")
    assert bcfg.model.position.table_dtype == "float32" and bcfg.train.eval_depth == 3
    sd, bsd = model.state_dict(), back.state_dict()
    assert sd.keys() == bsd.keys() and all(torch.equal(sd[k], bsd[k]) for k in sd)  # exact: copies
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # exact: load_checkpoint copies the weights into fresh parameters, so the same computation
        assert torch.equal(model(ids, depth=[1, 5]).logits, back(ids, depth=[1, 5]).logits)


# ---------------------------------------------------------------- §3: diagnostics on imported models
@pytest.mark.slow
@pytest.mark.parametrize("name", ["huginn", "ouro"])
def test_diagnostics_commands_run_on_imported_models(imported, name, tmp_path, capsys):
    """looplm diagnose (convergence, scale, visit alignment), eval kv-sharing and eval halting (logit margin)
    from the command line on an imported fixture, at the imported depth (mean_recurrence / total_ut_steps)."""
    ckpt = imported[name][2]
    diag = tmp_path / "diag.json"
    assert main(["diagnose", "--checkpoint", str(ckpt), "--out", str(diag), "--depth", "6", "--batches", "1",
                 "--batch-size", "2", "--quiet"]) == 0
    res = json.loads(diag.read_text())
    assert res["scale"]["K"] == 4 and len(res["scale"]["loops"]) == 5  # loops 0 … K at the imported depth
    assert res["visit_alignment"]["depth"] == 4 and 0.0 <= res["visit_alignment"]["kappa_hat"] <= 4.0 + 1e-9
    assert res["convergence"]["depth"] == 6 and res["convergence"]["tokens"] > 0
    kv = tmp_path / "kv.json"
    assert main(["eval", "kv-sharing", "--checkpoint", str(ckpt), "--depths", "1,4", "--max-tokens", "512",
                 "--batch-size", "4", "--quiet", "--json", "--out", str(kv)]) == 0
    rows = json.loads(kv.read_text())["depths"]
    assert rows["1"]["sharing_penalty_pct"] == 0.0  # at depth 1 terminal sharing is the per-visit cache
    assert rows["4"]["kv_bytes_terminal"] < rows["4"]["kv_bytes_full"]
    halt = tmp_path / "halting" / "h.json"
    assert main(["eval", "halting", "--checkpoint", str(ckpt), "--max-examples", "8", "--batch-size", "4",
                 "--repeats", "1", "--quiet", "--json", "--out", str(halt)]) == 0
    res = json.loads(halt.read_text())
    assert res["k_max"] == 4 and res["criterion"] == "margin"
    assert sorted(res["calibration"]["ppl_by_k"]) == ["1", "2", "3", "4"]
    capsys.readouterr()


# ---------------------------------------------------------------- the HF export of an imported model (interop)
@pytest.mark.slow
def test_hf_export_of_imported_models_keeps_parity(tmp_path, capsys):
    """`looplm export` of an imported checkpoint loads with transformers and reproduces the originals' logits and
    cached greedy tokens (Huginn imported with --initial-state zeros, decoded at num_steps=3 as its fixture)."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    for name, kw, steps, key in (("huginn", {"initial_state": "zeros"}, 3, "logits_zero_init_steps3"),
                                 ("ouro", {}, 4, "logits_ut4")):
        (import_huginn if name == "huginn" else import_ouro)(FIXTURES / name, tmp_path / name, progress=False, **kw)
        assert main(["export", "--checkpoint", str(tmp_path / name), "--out", str(tmp_path / f"{name}-hf")]) == 0
        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / f"{name}-hf")).eval()
        exp = load_file(str(FIXTURES / name / "expected.safetensors"))
        ids = exp["input_ids"]
        with torch.no_grad():
            assert _report(f"{name} HF export logits", hf(ids, num_steps=steps).logits, exp[key]) <= TOL
            new = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                              num_steps=steps)[:, ids.shape[1]:]
        assert new.tolist() == exp["greedy_tokens"].tolist()
    capsys.readouterr()
