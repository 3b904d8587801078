"""``LoopLMForCausalLM``: a transformers ``PreTrainedModel`` + ``GenerationMixin`` around a looplm model,
and ``LoopLMCache``: a transformers ``Cache`` over looplm's :class:`~looplm.model.kvcache.KVCache`.

- **Depth.** ``num_steps=T`` (default ``config.num_steps``; ``generate`` passes it on) may be a list: one
  unroll, ``logits`` at the largest, ``logits_by_depth`` for each; ``output_loop_logits=True`` reads 0 … T.
- **States.** ``output_hidden_states=True`` returns (h_0, …, h_T) in readout coordinates, before the coda.
- **Cache.** With ``use_cache`` (shared architecture) a forward appends its chunk to a :class:`LoopLMCache`
  (layout ``config.kv_cache`` or ``kv_cache=``); an empty foreign cache (``generate``'s ``DynamicCache``) is
  replaced, a non-empty one is an error; beam search uses :meth:`LoopLMCache.reorder_cache`.
- **Padding.** ``attention_mask`` marks left padding; position ids are derived from it and the cache
  (transformers' ``position_ids`` are ignored); with a cache only the mask's last L columns are used.
- **Loss.** ``labels`` as in transformers (shifted inside, -100 ignored): mean CE at the largest depth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from looplm.hf.configuration import LoopLMConfig
from looplm.model.cursor import Readout
from looplm.model.kvcache import KVCache, check_cache_mode


class LoopLMCache(Cache):
    """A transformers ``Cache`` holding a looplm :class:`KVCache` ``kv`` (``per_visit`` or ``terminal``)."""

    is_compileable = is_croppable = False

    def __init__(self, mode: str = "per_visit", kv: KVCache | None = None):
        super().__init__(layers=[])
        check_cache_mode(mode, "kv_cache")
        self.kv = kv if kv is not None else KVCache(mode)

    def __repr__(self) -> str:
        return f"LoopLMCache(mode={self.kv.mode!r}, length={self.kv.length}, banks={self.kv.n_banks()})"

    def __len__(self) -> int:
        return self.kv.n_banks()

    def __bool__(self) -> bool:  # an empty cache is still a cache
        return True

    @property
    def mode(self) -> str:
        return self.kv.mode

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Cached positions (left padding included), as transformers counts them."""
        return self.kv.length

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    @property
    def is_initialized(self) -> bool:
        return self.kv.valid is not None

    is_sliding = is_linear = is_dummy = (False,)  # one cache "layer": no window, not linear, not a placeholder

    @property
    def batch_size(self) -> int:
        return 0 if self.kv.valid is None else int(self.kv.valid.shape[0])

    def nbytes(self) -> int:
        return self.kv.nbytes()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep the rows ``beam_idx`` (beam search, batch selection), in place; duplicates copy a row."""
        if self.kv.valid is not None:
            self.kv.select(beam_idx.to(self.kv.valid.device).long())

    batch_select_indices = reorder_cache

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.reorder_cache(torch.arange(self.batch_size).repeat_interleave(repeats))

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("LoopLMCache cannot be cropped (assisted decoding is not supported)")

    def reset(self) -> None:
        self.kv = KVCache(self.kv.mode)

    def update(self, *args, **kwargs):
        raise NotImplementedError("LoopLMCache is filled by the looplm model itself, not layer by layer")


@dataclass
class LoopLMCausalLMOutput(CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` plus ``logits_by_depth`` ({T: (B, L, V)}) when several depths are read
    out (``num_steps`` a list, or ``output_loop_logits=True``)."""

    logits_by_depth: dict[int, torch.Tensor] | None = None


#: the output field of the cache: ``cache`` (transformers 5) or ``past_key_values`` (earlier)
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
if _CACHE_FIELD != "cache":  # one spelling for looplm's callers on either transformers
    LoopLMCausalLMOutput.cache = property(lambda self: self.past_key_values)


class LoopLMForCausalLM(PreTrainedModel, GenerationMixin):
    """A looplm model as a transformers causal LM (module docstring). ``self.model`` is the plain
    :class:`~looplm.model.LoopLM` (or :class:`~looplm.model.TransformerLM`)."""

    config_class = LoopLMConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _supports_sdpa = True

    def _init_weights(self, module):
        """No-op: the looplm model initializes itself when built, and ``from_pretrained`` loads every weight."""

    def __init__(self, config: LoopLMConfig, model=None):
        super().__init__(config)
        from looplm.model.looped import build_model

        cfg = config.looplm_config()
        self.model = model if model is not None else build_model(cfg)
        self.model.final_depth = config.final_depth
        if cfg.model.tie_embeddings:
            self._tied_weights_keys = {"model.lm_head.weight": "model.tok_emb.weight"}
        self.post_init()

    @classmethod
    def from_looplm(cls, model, cfg, **config_kwargs: Any) -> "LoopLMForCausalLM":
        """Wrap a built looplm model (weights shared, not copied) with its looplm ``cfg``."""
        config = LoopLMConfig.from_looplm(cfg, **config_kwargs)
        if model.final_depth is not None and "final_depth" not in config_kwargs:
            config.final_depth = int(model.final_depth)
        hf = cls(config, model=model)
        hf.train(model.training)
        return hf

    @classmethod
    def from_checkpoint(cls, path, *, device: str = "cpu", **config_kwargs: Any) -> "LoopLMForCausalLM":
        """A looplm checkpoint, run directory or export folder as a transformers model (no export needed;
        ``config_kwargs`` such as ``num_steps`` or ``kv_cache`` go to :class:`LoopLMConfig`)."""
        from looplm.run.checkpoint import load_checkpoint

        model, cfg, _, _ = load_checkpoint(path, device=device)
        return cls.from_looplm(model, cfg, **config_kwargs)

    def get_input_embeddings(self):
        return self.model.tok_emb

    def set_input_embeddings(self, value):
        self.model.tok_emb = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value):
        self.model.lm_head = value

    def _resolve_cache(self, cache, use_cache: bool, kv_cache: str | None) -> LoopLMCache | None:
        if not self.model.shared:
            if cache is not None and cache.get_seq_length() > 0:
                raise ValueError("cache: the unshared reference has no KV cache")
            return None
        if isinstance(cache, LoopLMCache):
            return cache
        if cache is not None and cache.get_seq_length() > 0:
            raise ValueError(f"cache: a non-empty {type(cache).__name__} cannot hold a looped model's K/V; "
                             "pass a LoopLMCache (or none)")
        return LoopLMCache(kv_cache or self.config.kv_cache) if use_cache or cache is not None else None

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
                past_key_values: Cache | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, output_hidden_states: bool | None = None,
                output_attentions: bool | None = None, return_dict: bool | None = None,
                num_steps: int | Sequence[int] | None = None, output_loop_logits: bool = False,
                kv_cache: str | None = None, inputs_embeds: torch.Tensor | None = None,
                **kwargs: Any):
        """See the module docstring. ``position_ids`` is accepted and ignored (derived from the mask).
        ValueError: ``inputs_embeds`` (not supported), ``output_attentions``, a bad depth, or a non-empty cache of
        another type."""
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("inputs_embeds: LoopLMForCausalLM takes input_ids (and not inputs_embeds)")
        if output_attentions:
            raise ValueError("output_attentions: not supported (looplm attends through SDPA)")
        for ignored in ("logits_to_keep", "cache_position", "token_type_ids"):  # sent by generate or tokenizers; unused
            kwargs.pop(ignored, None)
        if kwargs:
            raise TypeError(f"LoopLMForCausalLM.forward: unexpected arguments {sorted(kwargs)}")
        cache = past_key_values if cache is None else cache
        output_hidden_states = (output_hidden_states if output_hidden_states is not None
                                else self.config.output_hidden_states)
        use_cache = bool(use_cache if use_cache is not None else self.config.use_cache) and not self.training
        steps = self.config.num_steps if num_steps is None else num_steps
        multi = not isinstance(steps, int)
        depths = sorted({int(t) for t in steps}) if multi else [int(steps)]
        if output_loop_logits:
            depths, multi = list(range(depths[-1] + 1)), True
        hf_cache = self._resolve_cache(cache, use_cache, kv_cache)
        kv = hf_cache.kv if hf_cache is not None else None
        B, L = input_ids.shape
        mask = attention_mask
        if mask is not None:
            past = kv.length if kv is not None else 0
            if mask.shape[1] == past + L:
                mask = mask[:, past:]
            elif mask.shape[1] != L:
                raise ValueError(f"attention_mask: {tuple(mask.shape)} for {L} new tokens after {past} cached ones")
            if kv is None and bool(mask.all()):
                mask = None  # no padding: the plain causal forward (the same numbers)
        targets = None if labels is None else torch.cat([labels[:, 1:], labels.new_full((B, 1), -100)], dim=1)
        out = self.model.read(self.model.loop(input_ids, cache=kv, attention_mask=mask), depths if multi else depths[0],
                              targets, readout=Readout(states=bool(output_hidden_states)))
        result = {"loss": out.loss, "logits": out.logits, _CACHE_FIELD: hf_cache,
                  "hidden_states": tuple(out.states) if output_hidden_states else None,
                  "logits_by_depth": dict(out.logits_by_depth) if multi else None}
        if return_dict is False:
            return tuple(v for v in result.values() if v is not None)
        return LoopLMCausalLMOutput(**result)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' ``save_pretrained``, plus ``auto_map`` in config.json and the two remote-code files
        (``trust_remote_code=True`` then loads without looplm's registration; see
        :mod:`looplm.hf.remote`); the weight files get the mode of the other files (safetensors writes 0o600)."""
        from pathlib import Path

        from looplm.data.paths import plain_mode
        from looplm.hf.remote import AUTO_MAP, write_remote_code

        self.config.auto_map = dict(AUTO_MAP)
        result = super().save_pretrained(save_directory, *args, **kwargs)
        for weights in Path(save_directory).glob("model*.safetensors"):
            plain_mode(weights)
        write_remote_code(save_directory)
        return result

    def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
        """transformers' own, without ``position_ids`` (derived from the mask by the model)."""
        inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        inputs.pop("position_ids", None)
        return inputs
