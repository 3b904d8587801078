"""``LoopLMConfig``: the transformers config of a looplm model (``model_type = "looplm"``).

It holds the whole looplm Config dict under ``looplm`` plus ``num_steps`` (default depth, Huginn's name),
``kv_cache`` (``generate``'s layout) and ``final_depth``; the usual transformers names are derived from it.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig


DERIVED = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
           "max_position_embeddings", "num_hidden_layers", "rule", "tie_word_embeddings")


def _derived_error(key: str, value: Any) -> str:
    return (f"{key}: derived from the looplm config ({value!r}) and not overridable; the overridable fields are "
            "num_steps, kv_cache, final_depth, use_cache")


class LoopLMConfig(PretrainedConfig):
    """See the module docstring. ``LoopLMConfig.from_looplm(cfg)`` builds one from a looplm Config."""

    model_type = "looplm"  # looplm.run.hf_folder.MODEL_TYPE (this file is also remote code: no looplm import)

    def __init__(self, looplm: dict[str, Any] | None = None, num_steps: int | None = None,
                 kv_cache: str = "per_visit", final_depth: int | None = None, **kwargs: Any):
        from looplm.config import Config

        cfg = Config.from_dict(looplm) if looplm is not None else Config()
        m = cfg.model
        self.looplm = cfg.to_dict()
        self.num_steps = int(num_steps) if num_steps is not None else int(cfg.train.eval_depth)
        if kv_cache not in ("per_visit", "terminal"):
            raise ValueError(f"kv_cache: got {kv_cache!r}; allowed: per_visit, terminal")
        self.kv_cache = kv_cache
        self.final_depth = final_depth if final_depth is not None else int(cfg.depth.nominal_depth())
        derived = {"vocab_size": m.vocab_size, "hidden_size": m.d_model, "num_attention_heads": m.n_heads,
                   "num_key_value_heads": m.kv_heads, "intermediate_size": m.d_ff,
                   "max_position_embeddings": m.seq_len,
                   "num_hidden_layers": (m.n_prelude + m.n_core + m.n_coda) if m.architecture == "shared" else m.n_layers,
                   "rule": m.rule if m.architecture == "shared" else "unshared",
                   "tie_word_embeddings": bool(m.tie_embeddings)}
        for key, value in derived.items():  # stored for tools that read them; equal values pass (a saved config)
            if key in kwargs and kwargs.pop(key) != value:
                raise ValueError(_derived_error(key, value))
            setattr(self, key, value)
        self.use_cache = bool(kwargs.pop("use_cache", m.architecture == "shared"))
        super().__init__(tie_word_embeddings=derived["tie_word_embeddings"], **kwargs)

    def __setattr__(self, key: str, value: Any) -> None:
        """A derived field keeps its value (``from_pretrained(folder, hidden_size=7)`` is an error, not a no-op)."""
        if key in DERIVED and key in self.__dict__ and value != self.__dict__[key]:
            raise ValueError(_derived_error(key, self.__dict__[key]))
        super().__setattr__(key, value)

    @classmethod
    def from_looplm(cls, cfg, **kwargs: Any) -> "LoopLMConfig":
        """From a looplm :class:`~looplm.config.Config` (or its dict)."""
        return cls(looplm=cfg if isinstance(cfg, dict) else cfg.to_dict(), **kwargs)

    def looplm_config(self):
        """The looplm :class:`~looplm.config.Config` this config holds."""
        from looplm.config import Config

        return Config.from_dict(self.looplm)
