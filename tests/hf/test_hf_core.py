"""The core without the optional extras: with transformers and lm-eval hidden, looplm imports, its command
line builds, a Hugging Face export folder loads through load_checkpoint, and `looplm export` / `looplm
lm-eval` fail with an error naming the extra to install."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SRC = Path(__file__).resolve().parents[2] / "src"

HIDE = ("import sys\n"
        "for name in ('transformers', 'lm_eval'):\n"
        "    sys.modules[name] = None  # import fails as if not installed\n")


@pytest.mark.slow
def test_core_runs_without_transformers_and_lm_eval(tmp_path):
    from safetensors.torch import save_file

    from looplm.config import Config, ModelConfig, TrainConfig, UniformDepthConfig
    from looplm.model import build_model

    cfg = Config(model=ModelConfig(vocab_size=50, d_model=16, n_heads=2, d_ff=32, seq_len=8, dropout=0.0),
                 depth=UniformDepthConfig(lo=1, hi=3), train=TrainConfig(eval_depth=2))
    torch.manual_seed(0)
    model = build_model(cfg.model)
    # what save_pretrained writes: prefixed keys, the tied readout dropped, the looplm config inside
    sd = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "looplm", "looplm": cfg.to_dict(),
                                                      "final_depth": 3, "num_steps": 2}))
    x = torch.randint(0, 50, (1, 6))
    torch.save(model(x, depth=2).logits.detach(), tmp_path / "want.pt")
    torch.save(x, tmp_path / "x.pt")
    code = HIDE + (
        "import torch, looplm, looplm.hf\n"
        "from looplm.cli import build_parser, main\n"
        "from looplm.run.checkpoint import load_checkpoint\n"
        "build_parser()\n"
        f"d = {str(tmp_path)!r}\n"
        "m, cfg, _, _ = load_checkpoint(d)\n"
        "assert m.final_depth == 3 and not m.training\n"
        # exact: load_checkpoint copies the weights into fresh parameters, so the same computation
        "assert torch.equal(m(torch.load(d + '/x.pt'), depth=2).logits, torch.load(d + '/want.pt'))\n"
        "assert main(['export', '--checkpoint', d, '--out', d + '-hf']) == 2\n"  # beside it: not inside
        "assert main(['lm-eval', '--checkpoint', d, '--tasks', 'x']) == 2\n"
        "assert 'transformers' not in [k for k, v in sys.modules.items() if v is not None]\n"
        "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
    assert "looplm[hf]" in res.stderr and "looplm[lmeval]" in res.stderr
