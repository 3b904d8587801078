"""``looplm export``: a checkpoint → a Hugging Face folder (:mod:`looplm.hf_folder` describes it).

The tokenizer is saved as a ``PreTrainedTokenizerFast`` around the checkpoint's own ``tokenizers``
object (GPT-2 BPE or the trained byte-level BPE): ``tokenizer.json`` is that tokenizer unchanged, and
``tokenizer_config.json`` names ``<|endoftext|>`` as the BOS, EOS, UNK and padding token, with left
padding (what batched generation wants). ``AutoTokenizer.from_pretrained(folder)`` loads it.

Remote code: ``save_pretrained`` writes ``auto_map`` into ``config.json`` and two small shim files,
``configuration_looplm.py`` and ``modeling_looplm.py``, that import the classes from the installed
looplm package. So ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` loads
without importing looplm first (but looplm[hf] must be installed: the shims are not a copy of
looplm's model code). Nothing is fetched from the network.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from looplm.hf_folder import WEIGHTS_PREFIX  # noqa: F401  (documented layout)

CONFIG_SHIM = '''"""Remote-code shim of a looplm export (transformers trust_remote_code=True).

The classes live in the looplm package: install it with `pip install looplm[hf]`.
"""
from looplm.hf.configuration import LoopLMConfig

__all__ = ["LoopLMConfig"]
'''

MODELING_SHIM = '''"""Remote-code shim of a looplm export (transformers trust_remote_code=True).

The classes live in the looplm package: install it with `pip install looplm[hf]`.
"""
from looplm.hf.modeling import LoopLMCache, LoopLMForCausalLM

__all__ = ["LoopLMCache", "LoopLMForCausalLM"]
'''

AUTO_MAP = {"AutoConfig": "configuration_looplm.LoopLMConfig",
            "AutoModelForCausalLM": "modeling_looplm.LoopLMForCausalLM"}


def write_remote_code(out: str | Path) -> None:
    """Write the two remote-code shims into ``out`` and make sure its config.json has ``auto_map``."""
    out = Path(out)
    (out / "configuration_looplm.py").write_text(CONFIG_SHIM)
    (out / "modeling_looplm.py").write_text(MODELING_SHIM)
    path = out / "config.json"
    if path.exists():
        d = json.loads(path.read_text())
        if d.get("auto_map") != AUTO_MAP:
            d["auto_map"] = AUTO_MAP
            path.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")


def fast_tokenizer(tok: Tokenizer):
    """A ``PreTrainedTokenizerFast`` around ``tok`` with ``<|endoftext|>`` (Huginn-0125: ``<|end_text|>``) as
    BOS/EOS/UNK/pad, left padding.

    Raises:
        ValueError: ``tok`` has neither (:func:`looplm.data.tokenizer.eot_token`).
    """
    from transformers import PreTrainedTokenizerFast

    from looplm.data.tokenizer import eot_token

    eot = eot_token(tok)  # raises when missing
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok.to_str()), bos_token=eot,
                                   eos_token=eot, unk_token=eot, pad_token=eot, padding_side="left",
                                   clean_up_tokenization_spaces=False, model_input_names=["input_ids", "attention_mask"])
    fast.model_max_length = int(1e30)
    return fast


def save_tokenizer(tok: Tokenizer, out: str | Path, *, model_max_length: int | None = None) -> None:
    """Write ``tok`` into ``out`` as a PreTrainedTokenizerFast (``tokenizer.json`` unchanged)."""
    fast = fast_tokenizer(tok)
    if model_max_length is not None:
        fast.model_max_length = int(model_max_length)
    fast.save_pretrained(str(out))
    (Path(out) / "tokenizer.json").write_text(tok.to_str())  # exactly the checkpoint's tokenizer


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, num_steps: int | None = None,
                      kv_cache: str = "per_visit", device: str = "cpu") -> Path:
    """Write a checkpoint (or run directory, or an export) as a Hugging Face folder ``out``.

    Args:
        num_steps: default recurrence depth of the exported model (default: the checkpoint's
            ``train.eval_depth``, like ``looplm generate``).
        kv_cache: the cache layout ``generate`` uses by default (``per_visit`` or ``terminal``).

    Returns:
        ``out``.

    Raises:
        CheckpointError: damaged or missing checkpoint. ValueError: ``out`` is a file.
    """
    from looplm.data.tokenizer import eot_id
    from looplm.eval.runner import load_tokenizer_for
    from looplm.hf.modeling import LoopLMForCausalLM
    from looplm.train.checkpoint import load_checkpoint

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file; give a folder")
    model, cfg, _, ckpt = load_checkpoint(checkpoint, device=device)
    tok = load_tokenizer_for(ckpt)
    eot = eot_id(tok)
    hf = LoopLMForCausalLM.from_looplm(model, cfg, num_steps=num_steps, kv_cache=kv_cache, bos_token_id=eot,
                                       eos_token_id=eot, pad_token_id=eot)
    hf.generation_config.bos_token_id = hf.generation_config.eos_token_id = eot
    hf.generation_config.pad_token_id = eot
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out))
    save_tokenizer(tok, out, model_max_length=cfg.model.seq_len)
    return out
