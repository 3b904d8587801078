"""Hugging Face interop (looplm.hf): transformers wrapper, cache, export, tokenizer, lm-eval backend.

Offline, tiny random models: transformers logits equal LoopLM's for every rule, ``generate`` with the
LoopLMCache equals recompute and ``looplm.eval.generate.generate`` (greedy, padded batches, terminal
sharing), sampling and beam search with the cache equal their uncached runs, save → load keeps the
weights bit for bit (the logits to float32 rounding), ``AutoTokenizer`` / ``AutoModelForCausalLM`` /
``pipeline`` / remote code load an export, and looplm commands accept an export folder. The lm-eval
part checks the harness against ``looplm eval lambada`` and looplm's perplexity on local task
YAMLs.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# offline, and the harness's dataset cache inside the repository's test cache (never ~/.cache)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_CACHE", str(Path(__file__).resolve().parents[2] / ".cache" / "test" / "hf-datasets"))
transformers = pytest.importorskip("transformers")

from looplm.config import RULE_NAMES, Config, TrainConfig, UniformDepthConfig  # noqa: E402
from looplm.eval.generate import generate  # noqa: E402
from looplm.hf import LoopLMCache, LoopLMConfig, LoopLMForCausalLM  # noqa: E402
from looplm.model import build_model  # noqa: E402
from looplm.model.cursor import Readout
from helpers import VARIANTS, tiny  # noqa: E402

SEQ = 24
VARIANTS = {**VARIANTS, "looped-untied": dict(rule="looped", tie_embeddings=False)}
ALL = [*RULE_NAMES, "looped-prelude-coda", "looped-final_only_norm", "looped-untied", "huginn-0125", "ouro",
       "unshared"]
SHARED = [n for n in ALL if n != "unshared"]
PROMPTS = [[5, 17, 3, 88, 41, 9], [60], [7, 7, 21]]


def pair(name: str, seed: int = 0, **train):
    """(looplm model, its HF wrapper, looplm Config) of a tiny variant in eval mode."""
    torch.manual_seed(seed)
    cfg = Config(model=tiny(**VARIANTS[name], seq_len=SEQ, init_std=0.1),
                 depth=UniformDepthConfig(lo=1, hi=4), train=TrainConfig(eval_depth=3, **train))
    model = build_model(cfg.model).eval()
    model.final_depth = cfg.depth.nominal_depth()
    return model, LoopLMForCausalLM.from_looplm(model, cfg).eval(), cfg


def left_pad(prompts, pad: int = 0):
    P = max(map(len, prompts))
    ids = torch.tensor([[pad] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def new_tokens(out: torch.Tensor, prompt_len: int) -> list[list[int]]:
    return out[:, prompt_len:].tolist()


# ---------------------------------------------------------------------------------------------- forward


@pytest.mark.parametrize("name", ALL)
@torch.no_grad()
def test_logits_states_and_loss_match_looplm(name):
    model, hf, _ = pair(name)
    x = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    out = hf(x)  # config.num_steps = train.eval_depth = 3
    ref = model(x, 3, readout=Readout(states=True))
    assert (out.logits - ref.logits).abs().max() <= 1e-5
    assert out.logits_by_depth is None and out.hidden_states is None
    multi = hf(x, num_steps=[1, 5], output_hidden_states=True, use_cache=False)
    ref5 = model(x, [1, 5], readout=Readout(states=True))
    # exact: one tensor
    assert sorted(multi.logits_by_depth) == [1, 5] and torch.equal(multi.logits, multi.logits_by_depth[5])
    for T in (1, 5):
        assert (multi.logits_by_depth[T] - ref5.logits_by_depth[T]).abs().max() <= 1e-5
    assert len(multi.hidden_states) == 6
    for a, b in zip(multi.hidden_states, ref5.states):
        assert (a - b).abs().max() <= 1e-5
    every = hf(x, num_steps=2, output_loop_logits=True, use_cache=False)
    assert sorted(every.logits_by_depth) == [0, 1, 2]
    labels = x.clone()
    labels[0, :3] = -100
    loss = hf(x, labels=labels, num_steps=2, use_cache=False).loss
    logits = model(x, depth=2).logits
    want = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    assert abs(float(loss) - float(want)) <= 1e-5


def test_cache_returned_and_incremental_forward_matches_full():
    model, hf, _ = pair("scse")
    x = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a = hf(x[:, :6], num_steps=4)
        assert isinstance(a.cache, LoopLMCache) and a.cache.get_seq_length() == 6 and a.cache.mode == "per_visit"
        b = hf(x[:, 6:], num_steps=4, cache=a.cache, attention_mask=torch.ones(2, 10, dtype=torch.long))
        full = model(x, depth=4).logits
    assert b.cache is a.cache and a.cache.get_seq_length() == 10
    assert (b.logits - full[:, 6:]).abs().max() <= 1e-5
    t = hf(x[:, :6], num_steps=4, kv_cache="terminal").cache
    assert t.mode == "terminal" and t.nbytes() < a.cache.nbytes()
    with pytest.raises(ValueError, match="non-empty"):
        dyn = transformers.DynamicCache(config=hf.config)
        dyn.update(torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 3, 8), 0)
        hf(x[:, :2], cache=dyn)


# ---------------------------------------------------------------------------------------------- generate


@pytest.mark.parametrize("name", SHARED)
@torch.no_grad()
def test_generate_with_cache_equals_recompute_and_looplm_generate(name):
    """Greedy, left-padded batch: LoopLMCache == no cache == looplm.eval.generate == each prompt alone."""
    model, hf, _ = pair(name)
    ids, mask = left_pad(PROMPTS)
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=96)
    cached = hf.generate(ids, attention_mask=mask, num_steps=3, return_dict_in_generate=True, **kw)
    assert isinstance(getattr(cached, "cache", None) or cached.past_key_values, LoopLMCache)
    recomputed = hf.generate(ids, attention_mask=mask, num_steps=3, use_cache=False, **kw)
    ref = generate(model, PROMPTS, 5, 3, eos_id=96)
    got = new_tokens(cached.sequences, ids.shape[1])
    assert got == new_tokens(recomputed, ids.shape[1])
    for row, want in zip(got, ref.tokens):
        assert row[:len(want)] == want
    for p, row in zip(PROMPTS, got):
        alone = hf.generate(torch.tensor([p]), num_steps=3, **kw)
        assert new_tokens(alone, len(p))[0][:len(row)] == row[:alone.shape[1] - len(p)]


@torch.no_grad()
def test_unshared_reference_generates_by_recomputing():
    model, hf, _ = pair("unshared")
    assert not hf.config.use_cache
    out = hf.generate(torch.tensor([PROMPTS[0]]), num_steps=3, max_new_tokens=4, do_sample=False, pad_token_id=0,
                      eos_token_id=96)
    seq = list(PROMPTS[0])
    for _ in range(out.shape[1] - len(seq)):
        seq.append(int(model(torch.tensor([seq]), depth=3).logits[0, -1].argmax()))
    assert out[0].tolist() == seq


@pytest.mark.parametrize("name", ["scse", "huginn_linear", "sc_subtract", "looped-prelude-coda"])
@torch.no_grad()
def test_generate_terminal_cache_equals_looplm_terminal(name):
    model, hf, _ = pair(name)
    ids, mask = left_pad(PROMPTS)
    out = hf.generate(ids, attention_mask=mask, num_steps=4, kv_cache="terminal", max_new_tokens=5,
                      do_sample=False, pad_token_id=0, eos_token_id=96)
    ref = generate(model, PROMPTS, 5, 4, cache_mode="terminal", eos_id=96)
    for row, want in zip(new_tokens(out, ids.shape[1]), ref.tokens):
        assert row[:len(want)] == want


@pytest.mark.parametrize("name", ["scse", "sc_subtract", "parcae"])
@torch.no_grad()
def test_sampling_and_beam_search_with_cache_equal_no_cache(name):
    _, hf, _ = pair(name)
    ids, mask = left_pad(PROMPTS)
    kw = dict(attention_mask=mask, num_steps=3, max_new_tokens=5, pad_token_id=0, eos_token_id=96)
    runs = []
    for use_cache in (True, False):
        torch.manual_seed(7)
        runs.append(hf.generate(ids, do_sample=True, temperature=0.9, top_k=20, top_p=0.95, use_cache=use_cache,
                                **kw))
    assert torch.equal(runs[0], runs[1])  # exact: token ids (discrete)
    beams = [hf.generate(ids, num_beams=3, num_return_sequences=2, do_sample=False, use_cache=use_cache,
                         return_dict_in_generate=True, output_scores=True, **kw) for use_cache in (True, False)]
    assert torch.equal(beams[0].sequences, beams[1].sequences)  # exact: token ids
    assert torch.allclose(beams[0].sequences_scores, beams[1].sequences_scores, atol=1e-5)


def test_cache_reorder_and_select():
    _, hf, _ = pair("scse")
    x = torch.randint(0, 97, (3, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache = hf(x, num_steps=2).cache
    rows = {k: v[0].clone() for k, v in cache.kv.banks.items()}
    stats = {k: v.clone() for k, v in cache.kv.stats.items()}
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    assert cache.batch_size == 3
    for k, v in cache.kv.banks.items():
        assert torch.equal(v[0], rows[k][[2, 2, 0]])  # exact: copies
    for k, v in cache.kv.stats.items():
        assert torch.equal(v, stats[k][[2, 2, 0]])  # exact: copies
    cache.batch_repeat_interleave(2)
    assert cache.batch_size == 6
    cache.batch_select_indices(torch.tensor([1]))
    assert cache.batch_size == 1 and cache.get_seq_length() == 5
    with pytest.raises(NotImplementedError):
        cache.crop(2)


# ---------------------------------------------------------------------------------------------- save / load


@pytest.mark.parametrize("name", ALL)
def test_save_pretrained_round_trip_is_exact(name, tmp_path):
    model, hf, _ = pair(name)
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "looplm" and cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_looplm.LoopLMForCausalLM"
    assert (tmp_path / "modeling_looplm.py").exists() and (tmp_path / "configuration_looplm.py").exists()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(back, LoopLMForCausalLM) and not back.training
    sd, sd2 = model.state_dict(), back.model.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        assert torch.equal(sd[k], sd2[k]), k  # exact: a copy
    for k, b in model.named_buffers():
        assert torch.equal(b, dict(back.model.named_buffers())[k]), k  # exact: a copy
    assert model.lm_head.weight is model.tok_emb.weight or not model.cfg.tie_embeddings
    if model.cfg.tie_embeddings:
        assert back.model.lm_head.weight is back.model.tok_emb.weight
    assert back.model.final_depth == model.final_depth
    x = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    # tolerant (different memory layout): from_pretrained keeps the safetensors tensors where they lie,
    # at 4-byte-aligned offsets, and MKL picks its matrix-vector kernel by alignment: step_adapter's
    # P_step γ_t differs in the last bit (bitwise again once the weights are cloned to fresh memory);
    # O(1) logits, d = 32 sums: measured max 4e-7, so 1e-5 leaves a 25x margin
    with torch.no_grad():
        torch.testing.assert_close(back(x, use_cache=False).logits, hf(x, use_cache=False).logits,
                                   rtol=1e-5, atol=1e-5)
    from looplm.run.checkpoint import load_checkpoint

    plain, pcfg, _, _ = load_checkpoint(tmp_path)  # the core reads the export without transformers
    assert pcfg.model == model.cfg and plain.final_depth == model.final_depth
    for k, v in plain.state_dict().items():
        assert torch.equal(v, sd[k]), k  # exact: a copy


# ---------------------------------------------------------------------------------------------- export


def test_export_tokenizer_and_auto_classes(tiny_ckpt, exported):
    from tokenizers import Tokenizer

    from looplm.run.checkpoint import load_checkpoint, resolve_checkpoint

    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "configuration_looplm.py", "modeling_looplm.py"} <= names
    raw = Tokenizer.from_file(str(resolve_checkpoint(tiny_ckpt) / "tokenizer.json"))
    tok = transformers.AutoTokenizer.from_pretrained(exported)
    text = "The jury said it did find that \"many of Atlanta's\" 1,913 <|endoftext|> lines."
    assert tok(text)["input_ids"] == raw.encode(text).ids
    assert tok.decode(raw.encode(text).ids) == text
    assert tok.eos_token == tok.pad_token == "<|endoftext|>" and tok.eos_token_id == raw.token_to_id("<|endoftext|>")
    assert tok.padding_side == "left" and tok.model_max_length == 48
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    direct = LoopLMForCausalLM.from_pretrained(exported)
    wrapped = LoopLMForCausalLM.from_checkpoint(tiny_ckpt, num_steps=5)
    assert wrapped.config.num_steps == 5 and not wrapped.training
    for (k, v), (_, w) in zip(model.state_dict().items(), wrapped.state_dict().items()):
        assert torch.equal(v, w), k
    for (k, v), (_, w) in zip(model.state_dict().items(), direct.state_dict().items()):
        assert torch.equal(v, w), k
    ref, cfg, _, _ = load_checkpoint(tiny_ckpt)
    assert model.config.num_steps == 3 and model.generation_config.eos_token_id == tok.eos_token_id
    enc = tok(["The jury said", "It"], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=6, do_sample=False)
    want = generate(ref, [raw.encode("The jury said").ids, raw.encode("It").ids], 6, 3, eos_id=tok.eos_token_id)
    for row, w in zip(new_tokens(out, enc["input_ids"].shape[1]), want.tokens):
        assert row[:len(w)] == w
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tok)
    res = pipe(["The jury said", "It"], max_new_tokens=4, do_sample=False)
    assert res[0][0]["generated_text"].startswith("The jury said")


def test_gpt2_tokenizer_as_fast_tokenizer(tmp_path):
    from looplm.data.paths import resolve_data_root
    from looplm.data.tokenizer import load_gpt2_tokenizer
    from looplm.hf.export import save_tokenizer

    raw = load_gpt2_tokenizer(resolve_data_root(""))
    save_tokenizer(raw, tmp_path, model_max_length=1024)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tok("Hello world")["input_ids"] == [15496, 995]
    assert tok.eos_token_id == 50256 and tok.bos_token_id == 50256 and tok.pad_token_id == 50256
    assert tok.decode([15496, 995, 50256]) == "Hello world<|endoftext|>"


@pytest.mark.slow
def test_remote_code_loads_without_registration(exported, tmp_path):
    """A fresh interpreter that imports only transformers loads the export with trust_remote_code."""
    code = ("import sys, torch, transformers\n"
            "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
            "assert 'looplm.hf' not in sys.argv\n"
            "print(type(m).__name__, type(m.config).__name__, m.config.num_steps)\n")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).parents[2] / "src"),
                                                     os.environ.get("PYTHONPATH", "")) if p)}
    res = subprocess.run([sys.executable, "-c", code, str(exported)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["LoopLMForCausalLM", "LoopLMConfig", "3"]


def test_looplm_commands_accept_an_export(tiny_ckpt, exported, tmp_path, capsys):
    from looplm.cli import main

    assert main(["generate", "--checkpoint", str(exported), "--prompt", "The jury", "--max-new-tokens", "3"]) == 0
    from_export = capsys.readouterr().out
    assert main(["generate", "--checkpoint", str(tiny_ckpt), "--prompt", "The jury", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out == from_export
    out = tmp_path / "lambada.json"
    assert main(["eval", "lambada", "--checkpoint", str(exported), "--max-examples", "3", "--depths", "1,2",
                 "--out", str(out), "--quiet"]) == 0
    assert set(json.loads(out.read_text())["depths"]) == {"1", "2"}


def test_config_defaults_and_errors():
    c = LoopLMConfig()
    assert c.model_type == "looplm" and c.num_steps == Config().train.eval_depth
    with pytest.raises(ValueError, match="kv_cache"):
        LoopLMConfig(kv_cache="nope")
    _, hf, _ = pair("scse")
    with pytest.raises(ValueError, match="inputs_embeds"):
        hf(inputs_embeds=torch.zeros(1, 2, 32))


# ---------------------------------------------------------------------------------------------- lm-eval

N_LAMBADA = 24


@pytest.fixture(scope="module")
def harness_tasks(tmp_path_factory):
    """Local task YAMLs: the first 24 LAMBADA passages (lambada_openai's format) and two WikiText-2 raw
    test articles (cut at 2,500 characters), plus a generate_until task; and a data root holding the
    same LAMBADA lines for ``looplm eval lambada``."""
    pytest.importorskip("lm_eval")
    from looplm.data.paths import resolve_data_root
    from looplm.hf.harness import write_local_tasks

    root = resolve_data_root("")
    base = tmp_path_factory.mktemp("harness")
    lines = (root / "lambada" / "lambada_test.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    (base / "data" / "lambada").mkdir(parents=True)
    small = base / "data" / "lambada" / "lambada_test.jsonl"
    small.write_text("".join(lines[:N_LAMBADA]), encoding="utf-8")
    tasks = base / "tasks"
    write_local_tasks(tasks, lambada_jsonl=small, wikitext_raw=root / "wikitext-2-raw" / "wiki.test.raw", docs=2,
                      max_chars=2500)
    (tasks / "looplm_gen.yaml").write_text(
        "task: looplm_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: " + json.dumps(str(small))
        + "\noutput_type: generate_until\ntest_split: test\n"
        "doc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"\ndoc_to_target: \"{{' '+text.split(' ')[-1]}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\", \".\"]\n  max_gen_toks: 4\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
        "metadata:\n  version: 1.0\n")
    return tasks, base / "data"


@pytest.fixture(scope="module")
def harness_run(tiny_ckpt, harness_tasks, tmp_path_factory):
    from looplm.hf.harness import evaluate_harness

    tasks, _ = harness_tasks
    db = tmp_path_factory.mktemp("db") / "results.db"
    res = evaluate_harness(tiny_ckpt, tasks=["looplm_lambada", "looplm_wikitext"], depths=[1, 3],
                           include_path=tasks, include_defaults=False, batch_size=8, bootstrap_iters=0, db=db)
    return res, db


def test_lm_eval_lambada_agrees_with_looplm_eval(tiny_ckpt, harness_tasks, harness_run):
    """Harness acc = looplm exact_acc; harness perplexity = exp(mean per-passage target NLL) from looplm's
    scorer (looplm's own target_ppl is token-weighted: a different definition, also checked here)."""
    from looplm.eval.lambada import encode_examples, evaluate_lambada_checkpoint, load_lambada, score_lambada
    from looplm.eval.runner import load_tokenizer_for
    from looplm.run.checkpoint import load_checkpoint

    res, _ = harness_run
    _, data_root = harness_tasks
    ref = evaluate_lambada_checkpoint(tiny_ckpt, depths=[1, 3], data_root=data_root, progress=False)
    model, cfg, _, ckpt = load_checkpoint(tiny_ckpt)
    enc = encode_examples(load_lambada(data_root / "lambada" / "lambada_test.jsonl"), load_tokenizer_for(ckpt),
                          cfg.model.seq_len)
    per = [score_lambada(model, [e], [1, 3], progress=False) for e in enc]
    assert ref["examples"] == N_LAMBADA
    for T in (1, 3):
        got = res["depths"][str(T)]["results"]["looplm_lambada"]
        assert got["acc"] == pytest.approx(ref["depths"][str(T)]["exact_acc"], abs=1e-12)
        per_passage = [p[T]["nll"] * p[T]["target_tokens"] for p in per]
        assert got["perplexity"] == pytest.approx(math.exp(sum(per_passage) / len(per)), rel=1e-6)
        token_weighted = math.exp(sum(per_passage) / sum(e.n_target for e in enc))
        assert token_weighted == pytest.approx(ref["depths"][str(T)]["target_ppl"], rel=1e-6)


def test_lm_eval_rolling_perplexity_agrees_with_looplm_windows(tiny_ckpt, harness_tasks, harness_run):
    """looplm_wikitext: the harness's word perplexity and bits per byte from looplm's evaluate_depths on
    each article's token stream with the <|endoftext|> prefix (the harness scores the first token)."""
    import re

    import numpy as np

    from looplm.eval.perplexity import evaluate_depths
    from looplm.eval.runner import load_tokenizer_for
    from looplm.run.checkpoint import load_checkpoint

    res, _ = harness_run
    tasks, _ = harness_tasks
    pages = [json.loads(line)["page"] for line in (tasks / "looplm_wikitext.jsonl").read_text().splitlines()]
    assert len(pages) == 2
    model, _, _, ckpt = load_checkpoint(tiny_ckpt)
    tok = load_tokenizer_for(ckpt)
    eot = tok.token_to_id("<|endoftext|>")
    for T in (1, 3):
        nll = 0.0
        for page in pages:
            r = evaluate_depths(model, np.array([eot, *tok.encode(page).ids]), [T], batch_size=4, progress=False)[T]
            nll += r["nll"] * r["tokens"]
        words = sum(len(re.split(r"\s+", p)) for p in pages)
        nbytes = sum(len(p.encode("utf-8")) for p in pages)
        got = res["depths"][str(T)]["results"]["looplm_wikitext"]
        assert got["word_perplexity"] == pytest.approx(math.exp(nll / words), rel=1e-6)
        assert got["bits_per_byte"] == pytest.approx(nll / nbytes / math.log(2), rel=1e-6)


def test_lm_eval_multi_depth_is_one_unroll_and_lands_in_the_store(tiny_ckpt, harness_tasks, harness_run):
    from looplm.analysis.store import ResultStore
    from looplm.hf.harness import evaluate_harness

    res, db = harness_run
    tasks, _ = harness_tasks
    single = evaluate_harness(tiny_ckpt, tasks=["looplm_lambada", "looplm_wikitext"], depths=[3], include_path=tasks,
                              include_defaults=False, batch_size=8, bootstrap_iters=0)
    assert res["unrolls"] == single["unrolls"] > 0  # two depths cost what one does
    assert single["depths"]["3"]["results"] == res["depths"]["3"]["results"]
    assert "| looplm_lambada | acc |" in res["markdown"]
    with ResultStore(db) as store:
        rows = store.evaluations(protocol="lm_eval")
        assert {(r["dataset"], r["depth"]) for r in rows} == {(t, d) for t in ("looplm_lambada", "looplm_wikitext")
                                                              for d in (1, 3)}
        acc = {r["depth"]: r["value"] for r in rows if r["dataset"] == "looplm_lambada" and r["metric"] == "acc"}
        assert acc == {T: res["depths"][str(T)]["results"]["looplm_lambada"]["acc"] for T in (1, 3)}
        assert res["stored"] == 4
        # like any other evaluation, `looplm report` tabulates it for a stored run of that config
        from looplm.analysis.report import build_report
        from looplm.analysis.store import RunRecord
        from looplm.run.checkpoint import load_config

        cfg = load_config(tiny_ckpt)
        store.put_run(RunRecord(sweep="s", run_id="r0", variant="scse", seed=cfg.train.seed, config=cfg.to_dict(),
                                run_dir=str(tiny_ckpt)))
        sections = build_report(store)["sections"]
        got = {(sec["protocol"], sec["dataset"], sec["metric"]) for sec in sections}
        assert ("lm_eval", "looplm_lambada", "acc") in got and ("lm_eval", "looplm_wikitext", "word_perplexity") in got


def test_lm_eval_generate_until_is_looplm_generation(tiny_ckpt, harness_tasks):
    import lm_eval
    from lm_eval.api.instance import Instance

    from looplm.hf.harness import LoopLMEvalHarness

    lm = lm_eval.api.registry.get_model("looplm").create_from_arg_string(
        f"checkpoint={tiny_ckpt},depths=1;3", {"batch_size": 2, "device": "cpu"})
    assert isinstance(lm, LoopLMEvalHarness) and lm.depths == [1, 3] and lm.depth == 3
    ctxs = ["The jury said that", "It was", "Mrs. Smith"]
    reqs = [Instance(request_type="generate_until", doc={}, arguments=(c, {"until": ["."], "max_gen_toks": 5}), idx=0)
            for c in ctxs]
    got = lm.generate_until(reqs, disable_tqdm=True)
    want = generate(lm.model, [lm.tok_encode(c) for c in ctxs], 5, 3, eos_id=lm.eot)
    for g, toks in zip(got, want.tokens):
        text = lm.tok_decode(toks)
        assert g == text.split(".")[0].split("<|endoftext|>")[0]
    tasks, _ = harness_tasks
    from looplm.hf.harness import evaluate_harness

    res = evaluate_harness(tiny_ckpt, tasks=["looplm_gen"], depths=[2], include_path=tasks, include_defaults=False,
                           limit=3, bootstrap_iters=0)
    assert 0.0 <= res["depths"]["2"]["results"]["looplm_gen"]["exact_match"] <= 1.0


@pytest.mark.slow
def test_lm_eval_commands(tiny_ckpt, exported, harness_tasks, tmp_path, monkeypatch, capsys):
    """`looplm lm-eval` (multi-depth, JSON) and the harness's own command line with looplm registered
    (`python -m looplm.hf.harness --model looplm ...`, the export folder as checkpoint)."""
    from looplm.cli import main
    from looplm.hf.harness import cli_main

    tasks, _ = harness_tasks
    out = tmp_path / "lm_eval.json"
    assert main(["lm-eval", "--checkpoint", str(tiny_ckpt), "--tasks", "looplm_lambada", "--depths", "1,2",
                 "--include-path", str(tasks), "--only-include-path", "--bootstrap-iters", "0", "--limit", "6",
                 "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert set(saved["depths"]) == {"1", "2"} and "acc" in saved["depths"]["2"]["results"]["looplm_lambada"]
    capsys.readouterr()
    cli_main(["--model", "looplm", "--model_args", f"checkpoint={exported},depth=2", "--tasks", "looplm_lambada",
              "--include_path", str(tasks), "--limit", "6", "--batch_size", "4"])
    text = capsys.readouterr().out
    assert "looplm_lambada" in text and "acc" in text


@pytest.mark.slow
def test_import_looplm_registers_only_when_transformers_is_loaded():
    code = ("import sys\n"
            "import looplm\n"
            "assert 'transformers' not in sys.modules and 'looplm.hf' not in sys.modules\n"
            "import transformers, importlib\n"
            "importlib.reload(looplm)\n"
            "from transformers import AutoConfig\n"
            "print(type(AutoConfig.for_model('looplm')).__name__)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).parents[2] / "src"),
                                                     os.environ.get("PYTHONPATH", "")) if p)}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["LoopLMConfig"]
