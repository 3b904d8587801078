"""The leads for a faster compiled static decode step (issue 28 §1), each against one baseline, on CPU.

    python benchmarks/decode_leads.py --out benchmarks/results/NAME [--batch 1] [--rounds 3]

looplm in Huginn-0125's layout at the Huginn shape (V = 50,257, d = 256, 1 + 2×8 + 1, fp32, random weights),
a 32-token prompt prefilled into a static cache of 63 positions, then ``--steps`` greedy steps of
:class:`looplm.model.static_decode.DecodeStep` (``how="compile"``), rewound before every run. Each variant
is timed against ``plain`` (no weight copies: the model's own (out, in) weights, inductor's Python wrapper)
in interleaved A/B/B/A rounds (:func:`looplm.apps.bench.interleaved`): per-round median [min, max] of the
speed ratio. Variants: ``transposed`` (the readout weight laid out (d, V) in memory), ``transposed_all``
(every linear's weight laid out (in, out): what ``DecodeStep`` does on CPU), ``cpp_wrapper`` (inductor's
C++ wrapper), both, and both plus inductor's ``freezing``
(weights as constants, prepacked for oneDNN) or ``max_autotune`` (GEMM templates benchmarked at compile
time), and ``transposed+bf16`` (the whole model in bf16: half the weight bytes streamed per token; its
logits differ from fp32 by bf16 rounding). Writes NAME.json and NAME.md with the machine's load (``uptime``).
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import time
from pathlib import Path

import torch

from looplm.apps.bench import interleaved
from looplm.importers.huginn import huginn_layout_config
from looplm.model import build_model
from looplm.model.kvcache import KVCache
from looplm.model.static_decode import DecodeStep, StaticKVCache

#: variant → (weights transposed in memory: False, True (the readout's) or "all" (every linear's), inductor
#: options, weight dtype)
VARIANTS = {"plain": (False, {}, torch.float32), "transposed": (True, {}, torch.float32),
            "transposed_all": ("all", {}, torch.float32),
            "cpp_wrapper": (False, {"cpp_wrapper": True}, torch.float32),
            "transposed+cpp_wrapper": (True, {"cpp_wrapper": True}, torch.float32),
            "transposed+cpp_wrapper+freezing": (True, {"cpp_wrapper": True, "freezing": True}, torch.float32),
            "transposed+cpp_wrapper+max_autotune": (True, {"cpp_wrapper": True, "max_autotune": True}, torch.float32),
            "transposed+bf16": (True, {}, torch.bfloat16)}


def timed_step(model, prompt: torch.Tensor, variant: str, steps: int):
    """(run: ``steps`` greedy steps from the prefilled prompt, seconds to compile, first logits (B, V))."""
    transposed, options, dtype = VARIANTS[variant]
    model = copy.deepcopy(model).to(dtype) if dtype != torch.float32 else model
    cache = KVCache("per_visit")
    with torch.no_grad():
        tok = model.read(model.loop(prompt, cache=cache), 8).logits[:, -1].argmax(-1)
    step = DecodeStep(model, StaticKVCache(cache, prompt.shape[1] + steps, model.cfg.seq_len), 8, "compile")
    if transposed != "all":  # DecodeStep's own layout: every linear weight (in, out) in memory
        step._layout = {k: w for k, w in step._layout.items() if k == "model.lm_head.weight"} if transposed else {}
    step._fn = torch.compile(step._step, dynamic=False, fullgraph=True, options=options)
    start = step.state()
    t0 = time.perf_counter()
    first = step(tok).clone()
    compile_s = time.perf_counter() - t0

    def run() -> None:
        step.rewind(start)
        t = tok
        for _ in range(steps):
            t = step(t).argmax(-1)
    return run, compile_s, first.float()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="results path without suffix (.json and .md written)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=24, help="greedy steps per timed run (default 24)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved A/B/B/A rounds (default 3)")
    p.add_argument("--variants", default=",".join(v for v in VARIANTS if v != "plain"))
    a = p.parse_args()
    torch.manual_seed(0)
    model = build_model(huginn_layout_config(vocab_size=50257, d_model=256, n_heads=4, d_ff=1024, seq_len=128,
                                             n_prelude=1, n_core=2, n_coda=1)).eval()
    prompt = torch.randint(0, 50257, (a.batch, 32), generator=torch.Generator().manual_seed(0))
    uptime = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()  # noqa: E731
    res = {"batch": a.batch, "steps": a.steps, "rounds": a.rounds, "torch": torch.__version__,
           "torch_threads": torch.get_num_threads(), "uptime_before": uptime(), "variants": {}}
    base, res["plain_compile_s"], ref = timed_step(model, prompt, "plain", a.steps)
    for v in a.variants.split(","):
        run, compile_s, first = timed_step(model, prompt, v, a.steps)
        iv = interleaved(run, base, rounds=a.rounds, repeat=1, device=torch.device("cpu"))
        res["variants"][v] = {"speedup": iv, "compile_s": compile_s, "ms_per_step": 1e3 * iv["a_s"] / a.steps,
                              "plain_ms_per_step": 1e3 * iv["b_s"] / a.steps,
                              "max_abs_logit_diff": (first - ref).abs().max().item()}
        print(f"{v}: x{iv['median']:.2f} [{iv['min']:.2f}, {iv['max']:.2f}] of plain (compile {compile_s:.0f} s)",
              flush=True)
        del run
    res["uptime_after"] = uptime()
    a.out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    lines = [f"# Compiled static decode step: leads against `plain` (batch {a.batch}, Huginn shape, fp32, CPU)", "",
             f"{a.steps} greedy steps per run, {a.rounds} interleaved A/B/B/A rounds, torch {res['torch']}, "
             f"{res['torch_threads']} thread(s). Load (`uptime`) before: `{res['uptime_before']}`; after: "
             f"`{res['uptime_after']}` (a shared 2-core machine: absolute ms move with the load, prefer the "
             "per-round ratios).", "",
             "| variant | speed over plain, median [min, max] | per-round | ms/step (plain) | compile s | max abs logit diff |",
             "|---|---|---|---|---|---|"]
    for v, r in res["variants"].items():
        iv = r["speedup"]
        lines.append(f"| {v} | {iv['median']:.2f}× [{iv['min']:.2f}, {iv['max']:.2f}] | "
                     f"{', '.join(f'{x:.2f}' for x in iv['rounds'])} | {r['ms_per_step']:.1f} ({r['plain_ms_per_step']:.1f}) "
                     f"| {r['compile_s']:.0f} | {r['max_abs_logit_diff']:.1e} |")
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out.with_suffix('.json')} and {a.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
