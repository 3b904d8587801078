"""What the importers share: read a Hugging Face folder, check its config key by key, map every tensor onto the
looplm state dict (coverage both ways), fill the model shard by shard, write a checkpoint. Strict (issue 14 §2):
an unknown key or unsupported value, an unused or missing tensor, or a wrong shape is an :class:`ImporterError`
naming it; every weight comes from a stored tensor.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from looplm.run.checkpoint import sha256_file

#: generic keys that transformers' ``PretrainedConfig`` (and the Hub) writes into every config.json: ids,
#: generation defaults and bookkeeping; none of them changes the forward pass
HF_GENERIC_KEYS: frozenset[str] = frozenset({
    "architectures", "auto_map", "model_type", "torch_dtype", "dtype", "transformers_version", "_name_or_path",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "use_cache",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript", "use_bfloat16", "pruned_heads",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder",
    "cross_attention_hidden_size", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
    "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "finetuning_task", "id2label", "label2id", "tokenizer_class", "prefix",
    "task_specific_params", "problem_type",
})

_MISSING = object()


class ImporterError(ValueError):
    """A source folder the importer cannot map exactly; the message names the config key or tensor."""


# ---------------------------------------------------------------- config.json
class ConfigReader:
    """Reads a published ``config.json`` (parsed: ``config``) key by key, so that :meth:`finish` can refuse every
    key that was neither read, checked nor declared irrelevant (:meth:`ignore`); ``model`` names it in messages."""

    def __init__(self, config: dict[str, Any], model: str):
        self.config = config
        self.model = model
        self.seen: set[str] = set()

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The value of ``key`` (``default`` when absent; no default: absent is an error)."""
        self.seen.add(key)
        if key in self.config:
            return self.config[key]
        if default is _MISSING:
            raise ImporterError(f"config.json: missing key {key!r}, which a {self.model} config has")
        return default

    def require(self, key: str, allowed: Iterable[Any], default: Any = _MISSING, why: str = "") -> Any:
        """The value of ``key``, which must be one of ``allowed`` (the values the import reproduces)."""
        value = self.get(key, default)
        allowed = list(allowed)
        if value not in allowed:
            raise ImporterError(f"config.json: {key} = {value!r} is not supported by the {self.model} importer"
                                f"{' (' + why + ')' if why else ''}; supported: {', '.join(map(repr, allowed))}")
        return value

    def positive_int(self, key: str, minimum: int = 1) -> int:
        """The integer value of ``key``, at least ``minimum`` (1: positive)."""
        value = self.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ImporterError(f"config.json: {key} must be an integer >= {minimum}, got {value!r}")
        return value

    def number(self, key: str, default: Any = _MISSING) -> float:
        value = self.get(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ImporterError(f"config.json: {key} must be a finite number, got {value!r}")
        return float(value)

    def ignore(self, *keys: str) -> None:
        """Declare keys that do not change the forward pass (training-only settings, documented)."""
        self.seen.update(keys)

    def finish(self) -> None:
        """Raise for every key that nobody read: the importer does not know what it would change."""
        unknown = sorted(k for k in self.config if k not in self.seen and k not in HF_GENERIC_KEYS)
        if unknown:
            raise ImporterError(f"config.json: unknown key{'s' if len(unknown) > 1 else ''} "
                                f"{', '.join(map(repr, unknown))} for {self.model}: the importer does not know "
                                "what it changes, so it cannot promise the same forward pass")


# ---------------------------------------------------------------- the folder
@dataclass
class Source:
    """A checkpoint folder read up to the tensor headers: per tensor name its shard (``where``), shape and dtype."""

    root: Path
    config: dict[str, Any]
    shards: list[Path]
    where: dict[str, Path]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    tokenizer_json: str


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8}


def open_source(src: str | Path) -> Source:
    """Read config.json, tokenizer.json and the tensor headers of the shards: those of
    ``model.safetensors.index.json`` (checked against their contents), else ``model.safetensors``, else every
    ``*.safetensors``. ImporterError: a missing file, no safetensors, a tensor stored twice or misplaced."""
    from safetensors import safe_open

    root = Path(src)
    if not root.is_dir():
        raise ImporterError(f"{root}: no such folder (give the folder of a downloaded Hugging Face checkpoint)")
    try:
        config = json.loads((root / "config.json").read_text())
    except FileNotFoundError:
        raise ImporterError(f"{root / 'config.json'}: missing; not a Hugging Face checkpoint folder") from None
    except json.JSONDecodeError as exc:
        raise ImporterError(f"{root / 'config.json'}: not valid JSON ({exc})") from None
    tok = root / "tokenizer.json"
    if not tok.is_file():
        raise ImporterError(f"{tok}: missing; looplm reads the tokenizer from tokenizer.json (HF tokenizers), so the "
                            "import needs it (download the whole repository, not only the weights)")
    index = root / "model.safetensors.index.json"
    weight_map: dict[str, str] | None = None
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ImporterError(f"{index}: no weight_map")
        shards = [root / name for name in sorted(set(weight_map.values()))]
    elif (root / "model.safetensors").exists():
        shards = [root / "model.safetensors"]
    else:
        shards = sorted(root.glob("*.safetensors"))
    if not shards:
        bins = sorted(p.name for p in root.glob("*.bin"))
        hint = f" (found {', '.join(bins)}: pickled weights are not read; convert them to safetensors first)"
        raise ImporterError(f"{root}: no safetensors weights" + (hint if bins else ""))
    where: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for shard in shards:
        if not shard.is_file():
            raise ImporterError(f"{shard}: named by {index.name} but missing")
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                if name in where:
                    raise ImporterError(f"tensor {name!r} is stored twice: in {where[name].name} and {shard.name}")
                sl = f.get_slice(name)
                where[name], shapes[name] = shard, tuple(sl.get_shape())
                dtypes[name] = _DTYPES.get(sl.get_dtype(), torch.float32)
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in where:
                raise ImporterError(f"{index}: names tensor {name!r} in {file}, which does not hold it")
            if where[name].name != file:
                raise ImporterError(f"{index}: names tensor {name!r} in {file}, but it is in {where[name].name}")
    return Source(root, config, shards, where, shapes, dtypes, tok.read_text())


# ---------------------------------------------------------------- the tensor map
@dataclass(frozen=True)
class Entry:
    """One looplm weight: ``target`` (a state-dict key) = ``combine(sources)`` (stored names, in order)."""

    target: str
    sources: tuple[str, ...]
    combine: Callable[[list[torch.Tensor]], torch.Tensor] | None = None

    def build(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return self.combine(tensors) if self.combine is not None else tensors[0]


def cat_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Stack matrices along the output rows: q, k, v → ``qkv``; gate, up → ``gate_up``."""
    return torch.cat(tensors, dim=0)


def check_coverage(source: Source, entries: Sequence[Entry], model: torch.nn.Module, *, model_name: str,
                   consumed: Iterable[str] = ()) -> None:
    """Both directions, before any tensor is read: every stored tensor is used exactly once (by an entry, or
    in ``consumed`` by a check such as Huginn's RoPE table), every tensor an entry needs is stored, the
    entries fill exactly the looplm state dict (tied aliases once), and each combined shape matches.
    ImporterError: naming the unknown, missing or misshapen tensor (and the looplm key it feeds)."""
    used: dict[str, str] = {}
    for e in entries:
        for s in e.sources:
            if s in used:
                raise ImporterError(f"internal: tensor {s!r} mapped twice ({used[s]}, {e.target})")
            used[s] = e.target
    for s in consumed:
        used[s] = "(checked, not stored)"
    stored = set(source.where)
    unknown = sorted(stored - set(used))
    if unknown:
        raise ImporterError(f"{source.root}: unknown tensor{'s' if len(unknown) > 1 else ''} "
                            f"{', '.join(map(repr, unknown[:8]))}{' …' if len(unknown) > 8 else ''}: not part of the "
                            f"{model_name} layout for this config.json, so no looplm weight takes "
                            f"{'them' if len(unknown) > 1 else 'it'} (loading is strict)")
    missing = sorted(set(used) - stored)
    if missing:
        raise ImporterError(f"{source.root}: missing tensor{'s' if len(missing) > 1 else ''} "
                            + ", ".join(f"{m!r} (for {used[m]})" for m in missing[:8])
                            + (" …" if len(missing) > 8 else "") + f": the {model_name} layout of this config.json "
                            "needs it and nothing is invented")
    want = model.state_dict()
    first: dict[int, str] = {}  # tensor id → its first key; a later key is a tied alias (lm_head.weight)
    aliases = {key for key, t in model.state_dict(keep_vars=True).items() if first.setdefault(id(t), key) != key}
    targets = [e.target for e in entries]
    extra, lacking = set(targets) - set(want), set(want) - aliases - set(targets)
    if extra or lacking or len(targets) != len(set(targets)):
        raise ImporterError(f"internal: the {model_name} map does not fill the looplm state dict "
                            f"(unknown {sorted(extra)[:4]}, unfilled {sorted(lacking)[:4]})")
    for e in entries:
        metas = [torch.empty(source.shapes[s], device="meta") for s in e.sources]
        try:
            shape = tuple(e.build(metas).shape)
        except RuntimeError as exc:
            shapes = ", ".join(str(list(m.shape)) for m in metas)
            raise ImporterError(f"tensor{'s' if len(e.sources) > 1 else ''} {', '.join(e.sources)} with shape "
                                f"{shapes} cannot form {e.target} ({exc})") from None
        if shape != tuple(want[e.target].shape):
            stored = ", ".join(f"{s!r} {list(source.shapes[s])}" for s in e.sources)
            raise ImporterError(f"tensor shape{'s' if len(e.sources) > 1 else ''} {stored} "
                                f"{'give' if len(e.sources) > 1 else 'gives'} {list(shape)} for {e.target}, but "
                                f"config.json describes {list(want[e.target].shape)}")


def fill(model: torch.nn.Module, source: Source, entries: Sequence[Entry], *, progress: bool = True,
         desc: str = "import") -> None:
    """Copy every entry into ``model`` (cast to the parameter's dtype), reading the shards lazily; a bar
    counts the bytes read."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    params = model.state_dict()
    handles = {}
    total = sum(math.prod(source.shapes[s]) * source.dtypes[s].itemsize for e in entries for s in e.sources)
    with contextlib.ExitStack() as stack, tqdm(total=total, unit="B", unit_scale=True, disable=not progress,
                                               desc=f"{desc} ({len(source.shards)} shard"
                                                    f"{'s' if len(source.shards) > 1 else ''})") as bar:
        for e in entries:
            tensors = []
            for s in e.sources:
                shard = source.where[s]
                if shard not in handles:
                    handles[shard] = stack.enter_context(safe_open(str(shard), framework="pt"))
                tensors.append(handles[shard].get_tensor(s))
                bar.update(tensors[-1].numel() * tensors[-1].element_size())
            with torch.no_grad():
                params[e.target].copy_(e.build(tensors))


# ---------------------------------------------------------------- the pipeline
STORE_DTYPES = ("source", "float32", "bfloat16")


def import_folder(src: str | Path, out: str | Path, read: Callable[[Source], tuple[Any, dict[str, Any]]],
                  tensor_map: Callable[[Any], list[Entry]], *, fmt: str, model_name: str, dtype: str,
                  progress: bool, consumed: Sequence[str] = ()) -> dict[str, Any]:
    """Import folder ``src`` as step 0 of run folder ``out`` (``out/latest`` → ``out/checkpoints/step-000000``).

    ``read(source)`` gives the ModelConfig and the fields (``depth`` first) that ``import.json`` and the returned
    summary add; ``consumed``: tensors checked, not stored. ``dtype``: ``source`` keeps the widest stored float
    dtype (bf16 for the published checkpoints: no value changes), or ``float32`` / ``bfloat16``. The model is
    built on the meta device (no initialization time or second copy). ``import.json`` records the provenance.
    ImporterError: ``out`` holds a checkpoint (checked before any work), or what the steps raise."""
    from looplm.config import Config, DataConfig, FixedDepthConfig, TrainConfig
    from looplm.model import build_model
    from looplm.run.checkpoint import save_checkpoint
    from looplm.version import __version__

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ImporterError(f"--out {out}: is a file; give a folder")
    if out.is_dir() and ((out / "latest").exists() or (out / "checkpoints").exists() or (out / "config.json").exists()):
        raise ImporterError(f"--out {out}: already holds a checkpoint; choose another folder or remove it")
    source = open_source(src)
    model_cfg, info = read(source)
    depth = info["depth"]
    cfg = Config(model=model_cfg, depth=FixedDepthConfig(depth=depth), train=TrainConfig(eval_depth=depth), name=fmt,
                 data=DataConfig(dataset="brown", tokenizer="bpe", bpe_vocab_size=max(260, model_cfg.vocab_size)))
    if dtype not in STORE_DTYPES:
        raise ImporterError(f"--dtype: got {dtype!r}; allowed: {', '.join(STORE_DTYPES)}")
    floats = {d for d in source.dtypes.values() if d.is_floating_point}
    weights = (getattr(torch, dtype) if dtype != "source"
               else max(floats, key=lambda d: d.itemsize) if floats else torch.float32)
    with torch.device("meta"):
        model = build_model(model_cfg)
    model = model.to(weights).to_empty(device="cpu").eval()
    if model_cfg.tie_embeddings:  # to_empty gives every parameter its own storage: tie the head again
        model.lm_head.weight = model.tok_emb.weight
    entries = tensor_map(model_cfg)
    check_coverage(source, entries, model, model_name=model_name, consumed=consumed)
    fill(model, source, entries, progress=progress, desc=f"import {fmt.split('-')[0]}")
    sizes = {"seq_len": model_cfg.seq_len, "dtype": str(weights).removeprefix("torch.")}
    record = {"format": fmt, **info, **sizes, "mapped": {e.target: list(e.sources) for e in entries},
              **({"checked_not_stored": list(consumed)} if consumed else {})}
    provenance = {"source": str(source.root.resolve()), "config_sha256": sha256_file(source.root / "config.json"),
                  "tokenizer_sha256": sha256_file(source.root / "tokenizer.json"),
                  "shards": {p.name: p.stat().st_size for p in source.shards}, "tensors": len(source.where),
                  "source_dtypes": sorted({str(d).removeprefix("torch.") for d in source.dtypes.values()})}
    ckpt = save_checkpoint(out, 0, model, cfg, tokenizer_json=source.tokenizer_json, extra_files={
        "import.json": json.dumps({"looplm_version": __version__, **provenance, **record}, indent=2) + "\n"})
    return {"checkpoint": str(ckpt), "model": model_name, **info, "params": model.num_params(), **sizes}
