"""``looplm export``: a checkpoint → a Hugging Face folder (:mod:`looplm.run.hf_folder` describes it).

The tokenizer is saved as a ``PreTrainedTokenizerFast`` around the checkpoint's own ``tokenizers``
object (GPT-2 BPE or the trained byte-level BPE): ``tokenizer.json`` is that tokenizer unchanged, and
``tokenizer_config.json`` names ``<|endoftext|>`` as the BOS, EOS, UNK and padding token, with left
padding (what batched generation wants). ``AutoTokenizer.from_pretrained(folder)`` loads it.

Remote code: ``save_pretrained`` writes ``auto_map`` into ``config.json`` and two files generated from
looplm's own sources by :func:`remote_code`: ``configuration_looplm.py`` (``looplm.config`` +
``looplm.hf.configuration``) and ``modeling_looplm.py`` (``looplm.model``'s modules +
``looplm.hf.modeling``), each module's text unchanged except its ``looplm`` imports, which are dropped
(same file) or made relative (``from .configuration_looplm import …``). So
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` needs torch and transformers
only, not looplm. Nothing is fetched from the network.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from tokenizers import Tokenizer

AUTO_MAP = {"AutoConfig": "configuration_looplm.LoopLMConfig",
            "AutoModelForCausalLM": "modeling_looplm.LoopLMForCausalLM"}
# remote-code file → the looplm modules it holds, in dependency order
REMOTE_FILES = {"configuration_looplm": ("looplm.config", "looplm.hf.configuration"),
                "modeling_looplm": ("looplm.model.fused", "looplm.model.layers", "looplm.model.kvcache",
                                    "looplm.model.recurrence", "looplm.model.cursor", "looplm.model.looped",
                                    "looplm.hf.modeling")}
ALIASES = {"looplm.model": "looplm.model.looped"}  # a package whose imported names live in a listed module
PACKAGE_ONLY = {"looplm.hf.modeling": ("LoopLMForCausalLM.from_checkpoint", "LoopLMForCausalLM.save_pretrained")}
TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # what transformers 4.57 and 5 both read (5 writes TokenizersBackend)


def remote_code() -> dict[str, str]:
    """``{file name: source}`` of the self-contained remote code (module docstring).

    Raises:
        RuntimeError: a listed module imports a looplm module outside :data:`REMOTE_FILES`, or two modules of
            one file define the same top-level name.
    """
    import importlib.util

    import looplm

    home = {mod: name for name, mods in REMOTE_FILES.items() for mod in mods}
    files = {}
    for name, mods in REMOTE_FILES.items():
        parts, defined = [], {}
        for mod in mods:
            text = Path(importlib.util.find_spec(mod).origin).read_text()
            lines = text.splitlines()
            tree = ast.parse(text)
            edits = {}  # first line (0-based) → (last line, replacement lines)
            for qual in PACKAGE_ONLY.get(mod, ()):
                cls, meth = qual.split(".")
                node = next(f for c in tree.body if isinstance(c, ast.ClassDef) and c.name == cls
                            for f in c.body if isinstance(f, ast.FunctionDef) and f.name == meth)
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
                edits[first] = (node.end_lineno, [])  # the method and the blank line after it
            dropped = [range(first, last + 1) for first, (last, _) in edits.items()]
            for node in tree.body:
                for target in _names(node):
                    if defined.setdefault(target, mod) != mod:
                        raise RuntimeError(f"remote code: {target} is defined in {defined[target]} and {mod}")
            for node in ast.walk(tree):
                if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "looplm" for a in node.names):
                    raise RuntimeError(f"remote code: {mod} line {node.lineno}: 'import looplm…' cannot be rewritten")
                if not isinstance(node, ast.ImportFrom) or any(node.lineno - 1 in r for r in dropped):
                    continue
                indent = " " * node.col_offset
                if node.module == "__future__":
                    edits[node.lineno - 1] = (node.end_lineno - 1, [])
                elif node.module.split(".")[0] == "looplm":
                    src = home.get(ALIASES.get(node.module, node.module))
                    if src is None:
                        raise RuntimeError(f"remote code: {mod} line {node.lineno} imports {node.module}, "
                                           f"which is not in {sorted(home)}")
                    names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in node.names)
                    edits[node.lineno - 1] = (node.end_lineno - 1,
                                              [f"{indent}pass"] if src == name else [f"{indent}from .{src} import {names}"])
            out, i = [], 0
            for first in sorted(edits):
                last, repl = edits[first]
                out += lines[i:first] + repl
                i = last + 1
            parts.append(f"# {'-' * 40} {mod}\n" + "\n".join(out + lines[i:]).strip("\n") + "\n")
        header = (f'"""Remote code of a looplm export (transformers trust_remote_code=True), generated by looplm '
                  f'{looplm.__version__} from {", ".join(mods)}:\nthe modules unchanged but for their looplm imports. '
                  'Needs torch and transformers only."""\n\nfrom __future__ import annotations\n\n')
        files[name + ".py"] = header + "\n\n".join(parts)
    return files


def _names(node: ast.stmt) -> list[str]:
    """Top-level names a definition or assignment binds (imports excluded: they may repeat)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def write_remote_code(out: str | Path) -> None:
    """Write the remote-code files (:func:`remote_code`) into ``out`` and make sure its config.json has
    ``auto_map``."""
    out = Path(out)
    for name, text in remote_code().items():
        (out / name).write_text(text)
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
    path = Path(out) / "tokenizer_config.json"
    d = json.loads(path.read_text())
    d["tokenizer_class"] = TOKENIZER_CLASS
    path.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, num_steps: int | None = None,
                      kv_cache: str = "per_visit", device: str = "cpu", overwrite: bool = False) -> Path:
    """Write a checkpoint (or run directory, or an export) as a Hugging Face folder ``out``.

    Args:
        num_steps: default recurrence depth of the exported model (default: the checkpoint's
            ``train.eval_depth``, like ``looplm generate``).
        kv_cache: the cache layout ``generate`` uses by default (``per_visit`` or ``terminal``).
        overwrite: write into a non-empty ``out`` (its weight files are removed first, so no stale shard
            stays); without it a non-empty ``out`` is an error.

    Returns:
        ``out``.

    Raises:
        CheckpointError: damaged or missing checkpoint. ValueError: ``out`` is a file, or a non-empty
            folder without ``overwrite``.
    """
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
    hf.generation_config.bos_token_id = hf.generation_config.eos_token_id = eot
    hf.generation_config.pad_token_id = eot
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), *out.glob("model.safetensors.index.json")]:
        old.unlink()
    hf.save_pretrained(str(out))
    save_tokenizer(tok, out, model_max_length=cfg.model.seq_len)
    return out
