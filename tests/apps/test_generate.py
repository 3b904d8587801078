"""Generation (looplm.eval.generate): batched left-padded greedy decoding against per-prompt decoding and a
naive uncached loop, seeded sampling, top-k/top-p against hand computations, exit criteria, per-token
adaptive depth (never-firing = fixed depth; τ huge = one loop; copy-forward K/V checked in the banks),
EOS handling, and ``looplm generate`` end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch

from looplm.eval.exits import (EXIT_CRITERIA, EntropyChange, ExitCriterion, KLDivergence, RelativeChange,
                               build_exit_criterion)
from looplm.eval.generate import adaptive_decode_step, filter_logits, generate, next_tokens
from looplm.model import LoopLM, build_model
from looplm.model.kvcache import KVCache
from helpers import VARIANTS, tiny  # noqa: E402

SEQ = 20
PROMPTS = [[5, 17, 3, 88, 41, 9], [60], [7, 7, 21]]  # different lengths: the batch is left-padded
RULES = ["scse", "looped-prelude-coda", "huginn_linear-huginn", "deq_qkv-huginn", "sc_subtract", "parcae-huginn",
         "huginn-0125", "ouro"]


def model_for(name: str, seed: int = 0) -> LoopLM:
    """A tiny variant with sharper logits (init_std 0.1) and a 20-token context, in eval mode."""
    torch.manual_seed(seed)
    return build_model(tiny(**VARIANTS[name], seq_len=SEQ, init_std=0.1)).eval()


@torch.no_grad()
def naive_greedy(model: LoopLM, prompt: list[int], n: int, depth: int) -> list[int]:
    """The reference: re-run the full uncached forward on the growing sequence at every step."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]), depth=depth).logits[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("name", RULES)
def test_greedy_batched_equals_per_prompt_equals_naive(name):
    model = model_for(name)
    n, R = 8, 3
    batched = generate(model, PROMPTS, n, R)
    single = [generate(model, [p], n, R).tokens[0] for p in PROMPTS]
    ref = [naive_greedy(model, p, n, R) for p in PROMPTS]
    print(name, batched.tokens)
    assert batched.tokens == single == ref
    assert batched.depths == [[R] * n] * len(PROMPTS)
    assert len({tuple(t) for t in ref}) > 1  # the prompts really lead to different continuations


def test_the_cache_holds_the_prompt_and_the_new_tokens_not_seq_len(monkeypatch):
    """generate sizes its KV buffers to the padded prompt + new tokens; the tokens equal the naive loop."""
    import looplm.model.kvcache as kvcache

    made = []
    real = kvcache.KVCache.__init__

    def spy(self, mode="per_visit", max_len=None):
        made.append(max_len)
        real(self, mode, max_len)

    monkeypatch.setattr(kvcache.KVCache, "__init__", spy)
    model = model_for("scse")
    out = generate(model, PROMPTS, 4, 3)
    assert made == [6 + 4]  # the longest prompt (6) + 4 new tokens, where seq_len is 20
    assert out.tokens == [naive_greedy(model, p, 4, 3) for p in PROMPTS]


@pytest.mark.parametrize("name", ["scse", "huginn_linear-huginn"])
def test_terminal_cache_generation(name):
    model = model_for(name)
    # at depth 1 terminal sharing changes nothing
    assert generate(model, PROMPTS, 6, 1, cache_mode="terminal").tokens == generate(model, PROMPTS, 6, 1).tokens
    # at depth > 1 each step equals a hand-run terminal cache (batched == one prompt at a time)
    term = generate(model, PROMPTS, 6, 4, cache_mode="terminal").tokens
    for p, got in zip(PROMPTS, term):
        cache = KVCache("terminal")
        with torch.no_grad():
            logits = model.read(model.loop(torch.tensor([p]), cache=cache), 4).logits[0, -1]
            seq = []
            for _ in range(6):
                seq.append(int(logits.argmax()))
                logits = model.read(model.loop(torch.tensor([[seq[-1]]]), cache=cache), 4).logits[0, -1]
        assert got == seq
    with pytest.raises(ValueError, match="allowed"):
        generate(model, PROMPTS, 2, 2, cache_mode="nope")


def test_sampling_is_seeded():
    model = model_for("huginn_linear-huginn")
    kw = dict(temperature=0.9, top_k=20, top_p=0.95)
    a = generate(model, PROMPTS, 10, 2, seed=3, **kw).tokens
    assert a == generate(model, PROMPTS, 10, 2, seed=3, **kw).tokens
    assert a != generate(model, PROMPTS, 10, 2, seed=4, **kw).tokens
    assert a != generate(model, PROMPTS, 10, 2).tokens  # not greedy
    # top_k=1 sampling is greedy whatever the temperature
    assert generate(model, PROMPTS, 6, 2, temperature=2.0, top_k=1, seed=5).tokens == \
        generate(model, PROMPTS, 6, 2).tokens


def test_filter_logits_hand_computed():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.2, 0.1])
    logits = probs.log()[None]
    kept = lambda z: torch.isfinite(z[0]).nonzero().squeeze(-1).tolist()  # noqa: E731
    assert kept(filter_logits(logits, top_k=2)) == [1, 3]
    assert kept(filter_logits(logits, top_k=10)) == [0, 1, 2, 3, 4]
    # top-p: sorted probs .5 .2 .15 .1 .05, mass above each token 0 .5 .7 .85 .95
    assert kept(filter_logits(logits, top_p=0.5)) == [1]
    assert kept(filter_logits(logits, top_p=0.6)) == [1, 3]
    assert kept(filter_logits(logits, top_p=0.75)) == [0, 1, 3]
    assert kept(filter_logits(logits, top_p=1.0)) == [0, 1, 2, 3, 4]
    assert kept(filter_logits(logits, top_p=1e-6)) == [1]  # the top-1 is always kept
    # top-k 3 renormalizes to .5/.85 .2/.85 .15/.85 = .588 .235 .176; mass above: 0 .588 .824 → p=.8 keeps 2
    assert kept(filter_logits(logits, top_k=3, top_p=0.8)) == [1, 3]
    kept_logits = filter_logits(logits, top_k=3)[0]
    assert torch.allclose(kept_logits[[0, 1, 3]], logits[0, [0, 1, 3]])  # surviving entries untouched
    with pytest.raises(ValueError):
        filter_logits(logits, top_k=0)
    with pytest.raises(ValueError):
        filter_logits(logits, top_p=1.5)


def test_next_tokens_sampling_frequencies():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.2, 0.1])
    logits = probs.log().expand(40000, 5)
    g = torch.Generator().manual_seed(0)
    draws = next_tokens(logits, temperature=1.0, top_k=3, generator=g)
    freq = torch.bincount(draws, minlength=5).double() / len(draws)
    expect = torch.tensor([0.15, 0.5, 0.0, 0.2, 0.0], dtype=torch.float64) / 0.85
    print("frequencies", freq.tolist(), "expected", expect.tolist())
    assert torch.allclose(freq, expect, atol=0.01)
    # temperature 2 flattens: p ∝ probs^(1/2)
    draws = next_tokens(probs.log().expand(40000, 5), temperature=2.0, generator=g)
    freq = torch.bincount(draws, minlength=5).double() / len(draws)
    expect = probs.double().sqrt() / probs.double().sqrt().sum()
    assert torch.allclose(freq, expect, atol=0.01)
    assert next_tokens(logits[:2]).tolist() == [1, 1]
    with pytest.raises(ValueError):
        next_tokens(logits, temperature=-1.0)


def test_exit_criteria_hand_computed():
    prev_h = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    h = torch.tensor([[3.0, 4.5], [1.0, 0.0]])
    rc = RelativeChange(0.2)
    assert rc.score(prev_h, h, None, None).tolist() == pytest.approx([0.1, 0.0])
    assert rc.halts(rc.score(prev_h, h)).tolist() == [True, True]
    assert RelativeChange(0.05).halts(rc.score(prev_h, h)).tolist() == [False, True]
    p = torch.tensor([[0.5, 0.5], [0.9, 0.1]])
    q = torch.tensor([[0.25, 0.75], [0.9, 0.1]])
    kl = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # KL(p ‖ q) with p the newer loop
    assert KLDivergence(1.0).score(None, None, q.log(), p.log()).tolist() == pytest.approx([kl, 0.0], abs=1e-6)
    ent = lambda r: -sum(x * math.log(x) for x in r)  # noqa: E731
    dh = abs(ent([0.5, 0.5]) - ent([0.25, 0.75]))
    assert EntropyChange(1.0).score(None, None, q.log(), p.log()).tolist() == pytest.approx([dh, 0.0], abs=1e-6)
    ec = EntropyChange(dh / 2)
    assert ec.halts(ec.score(None, None, q.log(), p.log())).tolist() == [False, True]
    # one registry for generation, adaptive depth and halting (issue 10 §3)
    assert set(EXIT_CRITERIA) == {"relative", "kl", "entropy", "hidden_update", "margin", "exit_gate", "exit_cdf"}
    assert isinstance(build_exit_criterion("kl", 0.1), KLDivergence)
    with pytest.raises(KeyError, match="known: entropy, exit_cdf, exit_gate, hidden_update, kl, margin, relative"):
        build_exit_criterion("nope", 0.1)


@pytest.mark.parametrize("criterion", ["relative", "kl", "entropy"])
@pytest.mark.parametrize("name", ["scse", "huginn_linear-huginn", "looped-prelude-coda", "huginn-0125", "ouro"])
def test_adaptive_never_firing_equals_fixed_max_depth(name, criterion):
    model = model_for(name)
    R = 4
    fixed = generate(model, PROMPTS, 6, R)
    for mode in ("per_visit", "terminal"):
        got = generate(model, PROMPTS, 6, 2, max_depth=R, cache_mode=mode,
                       exit_criterion=build_exit_criterion(criterion, -1.0))
        ref = fixed if mode == "per_visit" else generate(model, PROMPTS, 6, R, cache_mode="terminal")
        assert got.tokens == ref.tokens
        assert got.depths == [[R] * 6] * len(PROMPTS)


@pytest.mark.parametrize("name", ["scse", "huginn_linear-huginn", "looped-prelude-coda"])
def test_adaptive_huge_tau_exits_after_one_loop(name):
    model = model_for(name)
    R, n = 4, 6
    got = generate(model, PROMPTS, n, R, exit_criterion=KLDivergence(1e9))
    assert got.depths == [[R] + [1] * (n - 1)] * len(PROMPTS)
    # reference: prefill at R, then every token at fixed depth 1 through a per_visit cache
    for p, toks in zip(PROMPTS, got.tokens):
        cache = KVCache("per_visit")
        with torch.no_grad():
            logits = model.read(model.loop(torch.tensor([p]), cache=cache), R).logits[0, -1]
            seq = []
            for _ in range(n):
                seq.append(int(logits.argmax()))
                logits = model.read(model.loop(torch.tensor([[seq[-1]]]), cache=cache), 1).logits[0, -1]
        assert toks == seq


class FireAt(ExitCriterion):
    """Test criterion: row ``row`` exits after loop ``loop``; no other row ever exits (statistic 0 for
    that row at that loop, 1 otherwise; fires below τ = 0.5)."""

    def __init__(self, row: int, loop: int):
        super().__init__(0.5)
        self.row, self.loop, self.calls = row, loop, 0

    def score(self, prev_h, h, prev_logits=None, logits=None, gate=None):
        self.calls += 1
        out = torch.ones(h.shape[:-1])
        if self.calls == self.loop:
            out[self.row] = 0.0
        return out


@torch.no_grad()
@pytest.mark.parametrize("name", ["huginn_linear-huginn", "scse"])
def test_exited_token_copies_its_exit_kv_forward(name):
    """Row 0 exits after loop 2 of 4: its later visits hold its exit visit's K/V (per_visit banks), its
    terminal K/V is that same exit visit's, and its logits equal a depth-2 step; row 1 runs all 4."""
    model = model_for(name)
    R, exit_loop = 4, 2
    prompts = torch.tensor([[5, 17, 3, 88], [7, 7, 21, 4]])
    nxt = torch.tensor([[30], [31]])
    caches, logits = {}, {}
    for mode in ("per_visit", "terminal"):
        caches[mode] = KVCache(mode)
        model.read(model.loop(prompts, cache=caches[mode]), R)
        logits[mode], depth = adaptive_decode_step(model, nxt, caches[mode], R, FireAt(0, exit_loop))
        assert depth.tolist() == [exit_loop, R]
    pv = caches["per_visit"].banks
    core_layers = sorted({lid for lid, v in pv if v > 0})
    assert len(core_layers) == model.cfg.n_core
    for lid in core_layers:
        exit_k, exit_v = pv[(lid, exit_loop - 1)]
        for v in range(exit_loop, R):
            k, vv = pv[(lid, v)]
            # exact: copies
            assert torch.equal(k[0, :, -1], exit_k[0, :, -1]) and torch.equal(vv[0, :, -1], exit_v[0, :, -1])
            assert not torch.equal(k[1, :, -1], exit_k[1, :, -1])  # row 1 kept looping
    # each row equals a fixed-depth step of that row alone (depth 2 for the exited row, 4 for the other):
    # its prediction and its cached K/V (terminal: the exit visit's, i.e. the depth-2 run's last visit)
    for mode in ("per_visit", "terminal"):
        for row, d in ((0, exit_loop), (1, R)):
            c = KVCache(mode)
            model.read(model.loop(prompts[row:row + 1], cache=c), R)
            ref = model.read(model.loop(nxt[row:row + 1], cache=c), d).logits[0, -1]
            assert torch.allclose(logits[mode][row], ref, atol=1e-5)
            for key, (k, v) in caches[mode].banks.items():
                rk, rv = c.banks[key]
                assert torch.allclose(k[row, :, -1], rk[0, :, -1], atol=1e-6), (mode, row, key)
                assert torch.allclose(v[row, :, -1], rv[0, :, -1], atol=1e-6), (mode, row, key)


def test_eos_stops_a_row_and_others_continue():
    model = model_for("huginn_linear-huginn")
    n, R = 8, 3
    ref = [naive_greedy(model, p, n, R) for p in PROMPTS]
    eos = ref[0][2]
    got = generate(model, PROMPTS, n, R, eos_id=eos).tokens
    for r, g in zip(ref, got):
        cut = r.index(eos) + 1 if eos in r else n
        assert g == r[:cut]
    assert len(got[0]) <= 3 and max(len(g) for g in got) == n


def test_generate_errors():
    model = model_for("scse")
    with pytest.raises(ValueError, match="seq_len is 20"):
        generate(model, [[1] * 15], 7, 2)
    assert len(generate(model, [[1] * 15], 6, 2).tokens[0]) == 6  # 15 + 6 − 1 = 20 positions fit
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[1], []], 2, 2)
    with pytest.raises(ValueError, match="depth"):
        generate(model, [[1]], 2, 0)
    with pytest.raises(ValueError, match="shared"):
        generate(model_for("unshared"), [[1]], 2, 2)
    assert generate(model, [[1, 2]], 0, 2).tokens == [[]]


# --- the static decode step (issue 28 §1) ------------------------------------------------------------


@pytest.fixture
def aot_eager(monkeypatch):
    """``torch.compile`` with the ``aot_eager`` backend: dynamo traces the same one graph (fullgraph: a
    graph break is an error) without inductor's C++ code generation (minutes on a loaded 2-core box)."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": "aot_eager"}))


@pytest.mark.parametrize("name", RULES)
def test_static_step_tokens_equal_cached_and_naive(name):
    """The static step (eager) decodes the same greedy tokens as the KVCache path and recomputation."""
    model = model_for(name)
    ref = [naive_greedy(model, p, 8, 3) for p in PROMPTS]
    assert generate(model, PROMPTS, 8, 3).tokens == ref
    assert generate(model, PROMPTS, 8, 3, static_step="eager").tokens == ref


@pytest.mark.slow
@pytest.mark.parametrize("name", ["huginn-0125", "scse", "sc_subtract"])
def test_compiled_static_step_tokens_equal_naive_without_recompiling(name, aot_eager):
    """One compiled graph per shape: a second call with other prompts of the same padded shape reuses it."""
    model = model_for(name)
    other = [[9, 1, 4, 4, 2, 30], [3], [8, 8]]
    assert generate(model, PROMPTS, 8, 3, static_step="compile").tokens == [naive_greedy(model, p, 8, 3)
                                                                             for p in PROMPTS]
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = generate(model, other, 8, 3, static_step="compile").tokens
    assert got == [naive_greedy(model, p, 8, 3) for p in other]


def test_static_step_eos_rows_stay_in_the_batch_and_are_dropped():
    """Rows that emit EOS keep running in the static batch; the others' tokens equal recomputation."""
    model = model_for("huginn_linear-huginn")
    ref = [naive_greedy(model, p, 8, 3) for p in PROMPTS]
    eos = ref[0][2]
    got = generate(model, PROMPTS, 8, 3, eos_id=eos, static_step="eager").tokens
    assert got == [r[:r.index(eos) + 1] if eos in r else r for r in ref]
    assert len(got[0]) == 3 and max(len(g) for g in got) == 8


@pytest.mark.slow
@torch.no_grad()
def test_inductor_static_step_logits_equal_recomputation():
    """The default backend (inductor, fused kernels): each step's logits equal the full forward's."""
    from looplm.model.static_decode import DecodeStep, StaticKVCache

    model = model_for("huginn-0125")
    x = torch.randint(0, model.cfg.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    full = model(x, depth=3).logits  # (2, SEQ, V)
    cache = KVCache("per_visit")
    model.read(model.loop(x[:, :5], cache=cache), 3)
    step = DecodeStep(model, StaticKVCache(cache, SEQ, SEQ), 3, "compile")
    got = torch.stack([step(x[:, j]) for j in range(5, SEQ)], 1)  # (2, SEQ − 5, V)
    print(f"max |Δlogits| {(got - full[:, 5:]).abs().max().item():.2e}")
    # fp32 throughout; inductor fuses and reorders the reductions (RMSNorm, softmax, matmul accumulation)
    # and attention runs over another key length (masked capacity): rounding ~1e-6 relative per op through
    # 1 + 2·3 + 1 blocks, logits of O(1)
    torch.testing.assert_close(got, full[:, 5:], rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_static_step_runs_on_transposed_weight_copies_and_equals_recomputation():
    """On CPU every nn.Linear of the step (the readout included) runs on an (in, out)-in-memory copy of its
    weight (the same values): each step's logits equal the full forward's, and the model's own weights keep
    their (out, in) layout."""
    from looplm.model.static_decode import DecodeStep, StaticKVCache

    model = model_for("huginn-0125")
    x = torch.randint(0, model.cfg.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    full = model(x, depth=3).logits  # (2, SEQ, V)
    cache = KVCache("per_visit")
    model.read(model.loop(x[:, :5], cache=cache), 3)
    step = DecodeStep(model, StaticKVCache(cache, SEQ, SEQ), 3, "eager")
    got = torch.stack([step(x[:, j]) for j in range(5, SEQ)], 1)  # (2, SEQ − 5, V)
    print(f"max |Δlogits| {(got - full[:, 5:]).abs().max().item():.2e}")
    # another matmul kernel for every linear (and attention over the masked capacity) sums in another
    # order: fp32 rounding, ~1e-7 relative per op through 1 + 2·3 + 1 blocks, logits of O(1)
    torch.testing.assert_close(got, full[:, 5:], rtol=1e-5, atol=1e-5)
    linears = {f"model.{n}.weight": m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears.keys() == step._layout.keys() and "model.lm_head.weight" in linears
    for name, w in linears.items():
        n_out, n_in = w.shape
        assert torch.equal(step._layout[name], w) and step._layout[name].stride() == (1, n_out), name
        assert w.stride() == (n_in, 1), name


def test_static_step_errors():
    model = model_for("scse")
    with pytest.raises(ValueError, match="static_step: unknown 'graph'; allowed: eager, compile, cuda_graph, "
                                         "compile_cuda_graph"):
        generate(model, PROMPTS, 2, 2, static_step="graph")
    for kw in ({"cache_mode": "terminal"}, {"save_states": True}, {"exit_criterion": RelativeChange(0.1)}):
        with pytest.raises(ValueError, match="static_step: needs fixed-depth decoding"):
            generate(model, PROMPTS, 2, 2, static_step="eager", **kw)
    if not torch.cuda.is_available():
        for how in ("cuda_graph", "compile_cuda_graph"):
            with pytest.raises(ValueError, match=f"how: {how} needs the model and cache on a CUDA device"):
                generate(model, PROMPTS, 2, 2, static_step=how)


# --- the CLI ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_cfg, tiny_data):
    from looplm.train.trainer import train

    run = tmp_path_factory.mktemp("generate") / "run"
    train(tiny_cfg, run, progress=False, data=tiny_data)
    return run


def test_cli_generate(checkpoint, tmp_path, capsys):
    from looplm.cli import main
    from looplm.eval.runner import load_tokenizer_for
    from looplm.run.checkpoint import load_checkpoint

    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("It was a\n\n")
    out = tmp_path / "gen.json"
    rc = main(["generate", "--checkpoint", str(checkpoint), "--prompt", "The man", "--prompts-file",
               str(prompts_file), "--max-new-tokens", "5", "--depth", "3", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert [r["prompt"] for r in res["results"]] == ["The man", "It was a"]
    model, cfg, _, ckpt = load_checkpoint(checkpoint)
    tok = load_tokenizer_for(ckpt)
    ids = [tok.encode(r["prompt"], add_special_tokens=False).ids for r in res["results"]]
    ref = generate(model, ids, 5, 3, eos_id=tok.token_to_id("<|endoftext|>"))
    for r, toks in zip(res["results"], ref.tokens):
        assert r["tokens"] == toks and r["continuation"] == tok.decode(toks)
        assert r["continuation"] in printed and r["prompt"] in printed
    # adaptive depth and sampling options
    rc = main(["generate", "--checkpoint", str(checkpoint), "--prompt", "The", "--max-new-tokens", "4",
               "--exit", "relative", "--exit-tau", "1e9", "--max-depth", "4", "--temperature", "0.8",
               "--top-k", "10", "--top-p", "0.9", "--seed", "1", "--kv-cache", "terminal", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["results"][0]["depths"] == [4, 1, 1, 1] and res["settings"]["exit"] == "relative"
    # errors are reported, not raised
    rc = main(["generate", "--checkpoint", str(checkpoint), "--prompt", "The", "--max-new-tokens", "100"])
    assert rc == 2 and "seq_len" in capsys.readouterr().err
    rc = main(["generate", "--checkpoint", str(checkpoint), "--max-new-tokens", "3"])
    assert rc == 2 and "--prompt" in capsys.readouterr().err


def test_cli_generate_help(capsys):
    from looplm.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    for opt in ("--prompt", "--prompts-file", "--max-new-tokens", "--depth", "--temperature", "--top-k",
                "--top-p", "--seed", "--kv-cache", "--exit", "--exit-tau", "--max-depth", "--static-step", "--out"):
        assert opt in text


def test_cli_generate_static_step_equals_the_cached_path(checkpoint, tmp_path):
    from looplm.cli import main

    outs = {}
    for how in (None, "eager"):
        out = tmp_path / f"{how}.json"
        extra = [] if how is None else ["--static-step", how]
        assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", "The", "--prompt", "It was a",
                     "--max-new-tokens", "6", "--out", str(out), *extra]) == 0
        outs[how] = json.loads(out.read_text())
    assert outs["eager"]["settings"]["static_step"] == "eager"
    assert [r["tokens"] for r in outs["eager"]["results"]] == [r["tokens"] for r in outs[None]["results"]]


@pytest.mark.parametrize("args, message", [
    (["--top-k", "5"], "--temperature"),
    (["--max-depth", "8"], "--exit"),
    (["--exit", "kl", "--exit-tau", "-1"], "exit-tau"),
])
def test_cli_generate_rejects_options_it_would_ignore(checkpoint, capsys, args, message):
    from looplm.cli import main

    rc = main(["generate", "--checkpoint", str(checkpoint), "--prompt", "The", "--max-new-tokens", "2", *args])
    assert rc == 2 and message in capsys.readouterr().err


def test_cli_output_paths_and_plain_export(checkpoint, tmp_path, capsys):
    """A directory given as an output file (or a file as a run directory) fails before any work; an
    option the task would ignore is refused; a plain export (config + weights + tokenizer, no
    manifest or train state) loads for inference."""
    import shutil

    from looplm.cli import main
    from looplm.run.checkpoint import CheckpointError, load_checkpoint, resolve_checkpoint

    afile = tmp_path / "afile"
    afile.write_text("")
    for argv, message in ((["eval", "ppl", "--checkpoint", str(checkpoint), "--out", str(tmp_path)], "is a directory"),
                          (["generate", "--checkpoint", str(checkpoint), "--prompt", "The", "--out", str(tmp_path)],
                           "is a directory"),
                          (["train", "--preset", "debug", "--out", str(afile)], "is a file")):
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # each eval protocol has only its own options
        main(["eval", "lambada", "--checkpoint", str(checkpoint), "--scale-clamp"])
    assert exc.value.code == 2 and "--scale-clamp" in capsys.readouterr().err
    ckpt = resolve_checkpoint(checkpoint)
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(ckpt / name, plain / name)
    model, _, _, _ = load_checkpoint(plain)
    ref, _, _, _ = load_checkpoint(checkpoint)
    assert not model.training
    for (n, p), (_, q) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(p, q), n  # exact: the same saved weights
    with pytest.raises(CheckpointError, match="manifest"):
        load_checkpoint(plain, with_state=True)
    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    (copy / "train_state.pt").unlink()
    load_checkpoint(copy)  # inference does not need the training state
    with pytest.raises(CheckpointError, match="train_state"):
        load_checkpoint(copy, with_state=True)
