"""Prefill latency of LMDR Table 5's paths (issue 12 §3) with `looplm.apps.bench.prefill_measurements`, the
function behind the prefill case of `looplm bench`: the teacher at R, the teacher stopped after 3, 2, 1
recurrences and the distilled prefill (2-block student + one recurrence), one prefill of a 512- and a
2,048-token prompt into a terminal KV cache, last position read out, batch 1, six timed prefills per path
(interleaved, after one warm-up round; LMDR reports mean ± s.d. of six). Weights are random (timing does
not depend on them); the context is grown to 2,048 positions.

Shapes: the experiment's teacher (preset `huginn-cpu`: V = 8,192, d = 192, 3 heads, SwiGLU 768,
1 + 2×R + 1) and the bench's Huginn shape (V = 50,257, d = 256, 4 heads, SwiGLU 1,024), both at R = 5.

    OMP_NUM_THREADS=1 python experiments/lmdr-distill/latency.py --out experiments/lmdr-distill/results/latency.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from looplm.apps.bench import huginn_config, machine, prefill_markdown, prefill_measurements
from looplm.presets import get_preset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=6)
    ap.add_argument("--contexts", default="512,2048")
    args = ap.parse_args()
    contexts = tuple(int(c) for c in args.contexts.split(","))
    dev = torch.device("cpu")
    shapes = {"huginn-cpu": get_preset("huginn-cpu").model, "huginn-bench": huginn_config()}
    res = {"machine": machine(), "depth": args.depth, "repeat": args.repeat, "contexts": list(contexts),
           "shapes": {}}
    md = [f"# Prefill latency (R = {args.depth}, batch 1, CPU, {torch.get_num_threads()} thread(s))", ""]
    for name, cfg in shapes.items():
        r = prefill_measurements(cfg, depth=args.depth, contexts=contexts, repeat=args.repeat, device=dev)
        res["shapes"][name] = {"config": {k: getattr(cfg, k) for k in ("vocab_size", "d_model", "n_heads", "d_ff",
                                                                     "n_prelude", "n_core", "n_coda", "rule")},
                               **r}
        md += [f"**{name}** (d = {cfg.d_model}, V = {cfg.vocab_size:,})", "", *prefill_markdown(r), ""]
        print("\n".join(md[-(len(prefill_markdown(r)) + 3):]), flush=True)
    res["markdown"] = "\n".join(md)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(res["markdown"] + "\n")


if __name__ == "__main__":
    main()
