"""``looplm export``: a checkpoint → a Hugging Face folder (:mod:`looplm.run.hf_folder` describes it).

The tokenizer is the checkpoint's own, unchanged, as a ``PreTrainedTokenizerFast`` (``<|endoftext|>`` as BOS,
EOS, UNK and pad; left padding); the folder loads without looplm through its remote code
(:mod:`looplm.hf.remote`). Nothing is fetched from the network.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from tokenizers import Tokenizer


def save_tokenizer(tok: Tokenizer, out: str | Path, *, model_max_length: int | None = None) -> None:
    """Write ``tok`` into ``out`` unchanged as a ``PreTrainedTokenizerFast`` with ``<|endoftext|>`` (Huginn-0125:
    ``<|end_text|>``) as BOS/EOS/UNK/pad, left padding. ValueError: ``tok`` has neither (``eot_token``)."""
    from transformers import PreTrainedTokenizerFast

    from looplm.data.tokenizer import eot_token

    eot = eot_token(tok)
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok.to_str()), bos_token=eot,
                                   eos_token=eot, unk_token=eot, pad_token=eot, padding_side="left",
                                   clean_up_tokenization_spaces=False, model_input_names=["input_ids", "attention_mask"])
    fast.model_max_length = int(model_max_length) if model_max_length is not None else int(1e30)
    fast.save_pretrained(str(out))
    (Path(out) / "tokenizer.json").write_text(tok.to_str())  # exactly the checkpoint's tokenizer
    path = Path(out) / "tokenizer_config.json"
    # the class that transformers 4.57 and 5 both read (5 writes TokenizersBackend)
    d = {**json.loads(path.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"}
    path.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, num_steps: int | None = None,
                      kv_cache: Literal["per_visit", "terminal"] = "per_visit", device: str = "cpu",
                      overwrite: bool = False) -> Path:
    """Write a checkpoint (or run directory, or an export) as a Hugging Face folder ``out``.

    Args:
        out: the Hugging Face folder to write.
        num_steps: default recurrence depth of the export (default: the checkpoint's train.eval_depth)
        kv_cache: the cache layout ``generate`` uses by default (``per_visit`` or ``terminal``).
        overwrite: write into a non-empty ``out`` (its weight files are removed first)
    CheckpointError: damaged or missing checkpoint. ValueError: ``out`` is a file, or a non-empty folder without
    ``overwrite``."""
    from looplm.data.tokenizer import eot_id
    from looplm.eval.runner import load_tokenizer_for
    from looplm.hf.modeling import LoopLMForCausalLM
    from looplm.run.checkpoint import load_checkpoint

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file; give a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"--out {out}: the folder is not empty; give an empty or new folder, or --overwrite")
    model, cfg, _, ckpt = load_checkpoint(checkpoint, device=device)
    tok = load_tokenizer_for(ckpt)
    eot = eot_id(tok)
    hf = LoopLMForCausalLM.from_looplm(model, cfg, num_steps=num_steps, kv_cache=kv_cache, bos_token_id=eot,
                                       eos_token_id=eot, pad_token_id=eot)
    gen = hf.generation_config
    gen.bos_token_id = gen.eos_token_id = gen.pad_token_id = eot
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), *out.glob("model.safetensors.index.json")]:
        old.unlink()
    hf.save_pretrained(str(out))
    save_tokenizer(tok, out, model_max_length=cfg.model.seq_len)
    return out
