"""Greedy decoding side by side with Huginn's own modeling file (issue 28 §1).

    python benchmarks/huginn_side_by_side.py PATH/TO/raven_modeling_minimal.py --out benchmarks/results/NAME

Builds Huginn-0125's ``RavenForCausalLM`` (from ``seal-rg/recurrent-pretraining``, the file given, with
``raven_config_minimal.py`` next to it; not part of looplm) and looplm in Huginn-0125's layout
(:func:`looplm.importers.huginn.huginn_layout_config`) at the same shape, both fp32 with random weights,
and times one greedy ``generate`` call of ``--new-tokens`` tokens after a ``--prompt``-token prompt
(prefill included) per batch size: looplm's static compiled step (``static_step="compile"``, compiled
before timing) against Huginn's ``generate`` (HF ``GenerationMixin``, its dynamic cache) and against
looplm's eager cached path, each pair in interleaved A/B/B/A rounds (:func:`looplm.apps.bench.interleaved`),
reported as median [min, max] of the per-round ratios. ``--profile`` adds, at batch 1, the operators of
one eager and one compiled decode step (``torch.profiler``) and the graph count of the compiled step
(``torch._dynamo.explain``). Also the batch-1 memory floor: a batch-1 token reads every weight at least once
(the tied 50,257 × 256 readout alone is 51 MB in fp32), so no decoder beats (unique weight bytes) / (this
machine's copy bandwidth, same thread count); each side's ms/token is reported against that floor. Writes
NAME.json and NAME.md with the machine and its load (``uptime``).

Huginn's file was written against transformers 4.51.3; with transformers 5 it fails (the script says
where). Run it with that version first on the path, e.g.
``pip install --target /tmp/tf451 --no-deps transformers==4.51.3 'tokenizers<0.22' 'huggingface-hub<1'``
and ``PYTHONPATH=/tmp/tf451``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from looplm.apps.bench import interleaved
from looplm.eval.generate import generate
from looplm.importers.huginn import huginn_layout_config
from looplm.model import build_model


def load_huginn(path: Path):
    """Huginn's modeling module, imported as a package so its ``from .raven_config_minimal import`` resolves."""
    pkg = types.ModuleType("huginn_raven")
    pkg.__path__ = [str(path.parent)]
    sys.modules["huginn_raven"] = pkg
    return (importlib.import_module(f"huginn_raven.{path.stem}"),
            importlib.import_module("huginn_raven.raven_config_minimal"))


def build_pair(modeling: Path, *, vocab: int, d: int, heads: int, d_ff: int, seq_len: int, depth: int):
    """(Huginn's model, its GenerationConfig maker, looplm's model) at one shape, fp32, eval mode."""
    mod, cfg_mod = load_huginn(modeling)
    from transformers import GenerationConfig

    torch.manual_seed(0)
    huginn = mod.RavenForCausalLM(cfg_mod.RavenConfig(
        n_embd=d, n_heads=heads, n_layers=4, block_size=seq_len, vocab_size=vocab, intermediate_size=d_ff,
        n_layers_in_prelude=1, n_layers_in_recurrent_block=2, n_layers_in_coda=1, mean_recurrence=depth,
        torch_dtype="float32")).float().eval()
    torch.manual_seed(0)
    looplm = build_model(huginn_layout_config(vocab_size=vocab, d_model=d, n_heads=heads, d_ff=d_ff, seq_len=seq_len,
                                              n_prelude=1, n_core=2, n_coda=1)).eval()
    n_h, n_l = (sum(p.numel() for p in m.parameters()) for m in (huginn, looplm))
    if n_h != n_l:
        raise SystemExit(f"the two models differ in size: Huginn {n_h} parameters, looplm {n_l}")

    def gen_config(new: int):
        return GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, use_cache=True,
                                pad_token_id=0, eos_token_id=None)

    return huginn, gen_config, looplm


def copy_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes/s of a large fp32 ``copy_`` (read + write counted), the best of ``repeats``: the memory bandwidth a
    weight-streaming decode step can use at this thread count."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / best


def profile_step(model, prompt: torch.Tensor, depth: int, how: str, capacity: int, steps: int = 4) -> dict:
    """Top operators (self CPU time) of ``steps`` static decode steps run ``how`` (eager | compile) on a
    cache of ``capacity`` positions (``generate``'s, so the compiled graph is reused)."""
    from torch.profiler import ProfilerActivity, profile

    from looplm.model.kvcache import KVCache
    from looplm.model.static_decode import DecodeStep, StaticKVCache

    cache = KVCache("per_visit")
    with torch.no_grad():
        tok = model.read(model.loop(prompt, cache=cache), depth).logits[:, -1].argmax(-1)
    step = DecodeStep(model, StaticKVCache(cache, capacity, model.cfg.seq_len), depth, how)
    res = {}
    if how == "compile":
        ex = torch._dynamo.explain(step._step)(tok)
        res.update(graphs=ex.graph_count, graph_breaks=ex.graph_break_count, traced_ops=ex.op_count)
    start = step.state()
    step(tok)  # compiles
    step.rewind(start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            tok = step(tok).argmax(-1)
    ev = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ev)
    res["ms_per_step"] = total / 1e3 / steps
    res["operator_calls_per_step"] = sum(e.count for e in ev) / steps
    res["top"] = [{"op": e.key, "share": e.self_cpu_time_total / total, "calls_per_step": e.count / steps}
                  for e in ev[:8]]
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("modeling", type=Path, help="Huginn's raven_modeling_minimal.py (raven_config_minimal.py beside it)")
    p.add_argument("--out", type=Path, required=True, help="results path without suffix (.json and .md written)")
    p.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes (default 1,8,64)")
    p.add_argument("--depth", type=int, default=8, help="recurrence R (default 8: 1 + 2×8 + 1 block calls)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens (default 32)")
    p.add_argument("--new-tokens", type=int, default=32, help="new tokens per generate call (default 32)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved A/B/B/A rounds (default 3)")
    p.add_argument("--profile", action="store_true", help="also profile one eager and one compiled step at batch 1")
    a = p.parse_args()
    shape = dict(vocab=50257, d=256, heads=4, d_ff=1024, seq_len=128, depth=a.depth)
    huginn, gen_config, model = build_pair(a.modeling, **shape)
    import transformers

    res = {"shape": {**shape, "layout": "1 prelude + 2-block core x R + 1 coda, Huginn-0125 (sandwich, RoPE, "
                     "qk bias, embed scale, exit norm), fp32"},
           "prompt_tokens": a.prompt, "new_tokens": a.new_tokens, "rounds": a.rounds,
           "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                       "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                       "transformers": transformers.__version__,
                       "uptime_before": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()},
           "batches": {}}
    weight_bytes = sum(t.numel() * t.element_size() for t in {p.data_ptr(): p for p in model.parameters()}.values())
    bw = copy_bandwidth()
    res["memory_floor"] = {"weight_bytes": weight_bytes, "copy_bytes_per_s": bw, "ms_per_token": 1e3 * weight_bytes / bw}
    dev = torch.device("cpu")
    for B in [int(b) for b in a.batches.split(",")]:
        x = torch.randint(0, shape["vocab"], (B, a.prompt), generator=torch.Generator().manual_seed(B))
        prompts = x.tolist()
        cfg = gen_config(a.new_tokens)
        t0 = time.perf_counter()
        compiled = generate(model, prompts, a.new_tokens, a.depth, static_step="compile")  # compiles once per B
        compile_s = time.perf_counter() - t0
        eager = generate(model, prompts, a.new_tokens, a.depth)
        assert compiled.tokens == eager.tokens, f"batch {B}: the compiled step's greedy tokens differ from eager"

        def ours() -> None:
            generate(model, prompts, a.new_tokens, a.depth, static_step="compile")

        def ours_eager() -> None:
            generate(model, prompts, a.new_tokens, a.depth)

        def theirs() -> None:
            out = huginn.generate(x, cfg, num_steps=a.depth)
            assert out.shape == (B, a.prompt + a.new_tokens)

        vs_h = interleaved(ours, theirs, rounds=a.rounds, repeat=1, device=dev)
        vs_e = interleaved(ours, ours_eager, rounds=a.rounds, repeat=1, device=dev)
        ms = {"looplm_compiled": 1e3 * vs_h["a_s"] / a.new_tokens, "huginn": 1e3 * vs_h["b_s"] / a.new_tokens,
              "looplm_eager": 1e3 * vs_e["b_s"] / a.new_tokens}
        res["batches"][str(B)] = {"compile_s": compile_s, "ms_per_token_call": ms,
                                  "tokens_per_s": {k: B * 1e3 / v for k, v in ms.items()},
                                  "compiled_vs_huginn": vs_h, "compiled_vs_eager": vs_e}
        print(f"batch {B}: compiled {ms['looplm_compiled']:.1f} ms/token, Huginn {ms['huginn']:.1f}, looplm eager "
              f"{ms['looplm_eager']:.1f}; x{vs_h['median']:.2f} [{vs_h['min']:.2f}, {vs_h['max']:.2f}] of Huginn, "
              f"x{vs_e['median']:.2f} [{vs_e['min']:.2f}, {vs_e['max']:.2f}] of eager (compile {compile_s:.0f} s)",
              flush=True)
    if a.profile:
        prompt = torch.randint(0, shape["vocab"], (1, a.prompt), generator=torch.Generator().manual_seed(1))
        cap = a.prompt + a.new_tokens - 1
        res["profile_b1"] = {how: profile_step(model, prompt, a.depth, how, cap) for how in ("eager", "compile")}
    res["machine"]["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    a.out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    a.out.with_suffix(".md").write_text(markdown(res))
    print(f"wrote {a.out.with_suffix('.json')} and {a.out.with_suffix('.md')}")


def markdown(res: dict) -> str:
    m = res["machine"]
    iv = lambda r: f"{r['median']:.2f}× [{r['min']:.2f}, {r['max']:.2f}]"  # noqa: E731
    lines = [f"# Greedy decoding: looplm vs Huginn's modeling file ({res['shape']['layout']})", "",
             f"V = {res['shape']['vocab']}, d = {res['shape']['d']}, R = {res['shape']['depth']}, "
             f"{res['prompt_tokens']}-token prompt + {res['new_tokens']} new tokens per generate call (prefill "
             f"included), {res['rounds']} interleaved A/B/B/A rounds; ratios are per-round median [min, max].", "",
             f"Machine: {m['platform']}, {m['cpus']} CPUs, {m['torch_threads']} torch thread(s), torch {m['torch']}, "
             f"transformers {m['transformers']}. Load (`uptime`) before: `{m['uptime_before']}`; after: "
             f"`{m['uptime_after']}`.", "",
             "| batch | looplm compiled ms/token | Huginn ms/token | looplm eager ms/token | compiled / Huginn | "
             "compiled / eager | compile s |", "|---|---|---|---|---|---|---|"]
    for B, r in res["batches"].items():
        ms = r["ms_per_token_call"]
        lines.append(f"| {B} | {ms['looplm_compiled']:.1f} | {ms['huginn']:.1f} | {ms['looplm_eager']:.1f} | "
                     f"{iv(r['compiled_vs_huginn'])} | {iv(r['compiled_vs_eager'])} | {r['compile_s']:.0f} |")
    if (f := res.get("memory_floor")) and "1" in res["batches"]:
        ms = res["batches"]["1"]["ms_per_token_call"]
        lines += ["", f"Memory floor at batch 1: every token reads the {f['weight_bytes'] / 1e6:.1f} MB of unique weights "
                  f"at least once; at this machine's copy bandwidth ({f['copy_bytes_per_s'] / 1e9:.1f} GB/s, read + "
                  f"write, same threads) that takes {f['ms_per_token']:.1f} ms/token. looplm compiled takes "
                  f"{ms['looplm_compiled'] / f['ms_per_token']:.1f}× the floor, Huginn "
                  f"{ms['huginn'] / f['ms_per_token']:.1f}×; 3× Huginn would be {ms['huginn'] / 3:.1f} ms/token, "
                  f"{ms['huginn'] / 3 / f['ms_per_token']:.1f}× the floor. The ms/token include the "
                  "prefill, which reads the weights once more per call."]
    for how, pr in res.get("profile_b1", {}).items():
        lines += ["", f"Profile, batch 1, static step {how}: {pr['ms_per_step']:.1f} ms/step (self CPU), "
                  f"{pr['operator_calls_per_step']:.0f} operator calls/step"
                  + (f"; dynamo: {pr['graphs']} graph, {pr['graph_breaks']} graph breaks, {pr['traced_ops']} "
                     "traced ops" if how == "compile" else ""), "",
                  "| operator | share | calls/step |", "|---|---|---|"]
        lines += [f"| `{t['op']}` | {t['share']:.0%} | {t['calls_per_step']:.0f} |" for t in pr["top"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
