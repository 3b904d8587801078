"""Typed, serializable configuration for looplm (torch-free).

Every config is a dataclass whose fields are plain JSON values; variant names are strings checked
against ``Literal`` name sets. Construction validates every field and raises :class:`ConfigError`
naming the field and what is allowed. Field help texts (``metadata["help"]``) become the
``--help`` of the CLI, which can override any field as ``--section.field VALUE``.

The meaning of every model field is pinned down in ``SPEC.md`` §1–2 (shared/SPEC.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

FORMAT_VERSION = 1

RuleName = Literal["looped", "adapter", "step_adapter", "step_film", "scse", "norm_reset", "sc_cond",
                   "sc_subtract", "additive_subtract", "scse_leak", "plain", "huginn_linear", "parcae_decay",
                   "parcae", "orthoinj", "deq_qkv"]
RULE_NAMES: tuple[str, ...] = get_args(RuleName)
Architecture = Literal["shared", "unshared"]
AnchorName = Literal["learned", "embedding", "init", "frozen_random"]
SamplerName = Literal["fixed", "uniform", "pln", "learned"]
StateInit = Literal["zeros", "embedding", "gaussian"]
Residual = Literal["pre_ln", "post_ln", "deepnorm", "deeploop"]
ReadoutName = Literal["rmsnorm", "raw", "final_only_norm"]
ScaleControl = Literal["none", "inter_loop_norm", "spectral_damping"]
Supervision = Literal["terminal", "per_loop", "exit_weighted"]
PriorReward = Literal["neg_ce", "log_ce", "exp_ce", "inv_ppl"]

#: rules of the Huginn family (SPEC §2): injection at the core entrance, full-block core
#: ``H^{r+1} = Core(ζ^r)``, initial state from ``state_init``.
HUGINN_RULES: tuple[str, ...] = ("huginn_linear", "parcae_decay", "parcae", "orthoinj", "deq_qkv")
#: the residual exponent p of each family (SPEC §3); post_ln has α = β = 1 (p = 0)
RESIDUAL_P: dict[str, float] = {"pre_ln": 0.0, "post_ln": 0.0, "deepnorm": 0.25, "deeploop": 0.5}
DatasetName = Literal["brown", "wikitext2", "wikitext103", "text", "openwebtext", "c4"]
TokenizerName = Literal["gpt2", "bpe"]
Device = Literal["cpu", "cuda", "auto"]
Parallel = Literal["ddp", "fsdp"]
DType = Literal["float32", "bfloat16"]
CheckpointFormat = Literal["consolidated", "sharded"]


#: residual step scale s per rule when ``step_scale == -1`` (SPEC §2; for the controls the paper gives
#: no value: adapter-family controls take the tuned adapter's 0.35, the SCSE-family ones SCSE's 0.5,
#: norm_reset the looped baseline's 1.0 — our choice).
DEFAULT_STEP_SCALE: dict[str, float] = {
    "looped": 1.0, "norm_reset": 1.0,
    "adapter": 0.35, "step_adapter": 0.35, "step_film": 0.35,
    "scse": 0.5, "sc_cond": 0.5, "sc_subtract": 0.5, "additive_subtract": 0.5, "scse_leak": 0.5,
    # rules whose step has no residual scale (SPEC §2): s is unused
    "plain": 1.0, "huginn_linear": 1.0, "parcae_decay": 1.0, "parcae": 1.0, "orthoinj": 1.0, "deq_qkv": 1.0,
}


class ConfigError(ValueError):
    """A config field has a value that is not allowed; the message names the field."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {msg}")


def _check_literal(obj: Any, prefix: str) -> None:
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        tp = hints[f.name]
        value = getattr(obj, f.name)
        if typing.get_origin(tp) is Literal:
            allowed = get_args(tp)
            _check(value in allowed, f"{prefix}{f.name}",
                   f"got {value!r}; allowed: {', '.join(map(repr, allowed))}")
        elif tp is bool:
            _check(isinstance(value, bool), f"{prefix}{f.name}", f"must be true/false, got {value!r}")
        elif tp is int:
            _check(isinstance(value, int) and not isinstance(value, bool), f"{prefix}{f.name}",
                   f"must be an integer, got {value!r}")
        elif tp is float:
            _check(isinstance(value, (int, float)) and not isinstance(value, bool),
                   f"{prefix}{f.name}", f"must be a number, got {value!r}")


class _Base:
    """Shared JSON round-trip for the config dataclasses."""

    _prefix = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"{cls._prefix}{unknown[0]}: unknown field; known: {', '.join(sorted(names))}")
        return cls(**d)

    def replace(self, **changes: Any):
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


@dataclass(frozen=True)
class ModelConfig(_Base):
    """Shape and recurrence rule of a looped (or unshared reference) language model (SPEC §1–2)."""

    _prefix = "model."
    architecture: Architecture = _f("shared", "shared: prelude + core×T + coda with a recurrence rule; "
                                    "unshared: n_layers distinct blocks, no recurrence (reference)")
    rule: RuleName = _f("scse", "recurrence rule (SPEC §2): " + ", ".join(RULE_NAMES))
    vocab_size: int = _f(50257, "vocabulary size V (set from the tokenizer when training)")
    d_model: int = _f(384, "model width d")
    n_heads: int = _f(6, "attention heads (d_model must be divisible by it)")
    d_ff: int = _f(1536, "SwiGLU hidden width")
    seq_len: int = _f(128, "context length L (learned absolute positions)")
    dropout: float = _f(0.1, "dropout probability on embeddings, attention and residual branches")
    n_prelude: int = _f(0, "unshared prelude blocks before the loop")
    n_core: int = _f(1, "K: blocks in the shared core applied once per loop step")
    n_coda: int = _f(0, "unshared coda blocks after the loop")
    n_layers: int = _f(4, "unshared architecture only: number of distinct blocks")
    tie_embeddings: bool = _f(True, "tie the readout W_out to the token embedding")
    norm_eps: float = _f(1e-6, "RMSNorm epsilon")
    init_std: float = _f(0.02, "std of the normal initialization of linear and embedding weights")
    step_scale: float = _f(-1.0, "residual step scale s; -1 takes the rule's default "
                           "(looped, norm_reset 1.0; adapter, step_adapter, step_film 0.35; scse, sc_cond, "
                           "sc_subtract, additive_subtract, scse_leak 0.5)")
    anchor_scale: float = _f(0.1, "c_a: anchor h* = e + c_a·A(e) (every rule except looped, norm_reset)")
    init_scale: float = _f(0.1, "c_0: initial state h_0 = e + c_0·I(e) (every rule except looped, "
                           "norm_reset)")
    alpha_init: float = _f(0.15, "adapter, step_adapter, step_film, additive_subtract: initial value of "
                           "the learned source gain α")
    step_tau: float = _f(0.015, "step_adapter: scale τ of the projected sinusoidal step embedding")
    scse_anchor: AnchorName = _f("learned", "scse, sc_cond, sc_subtract, scse_leak anchor: learned "
                                 "(e + c_a·A(e)), embedding (h*=e), "
                                 "init (h*=h_0, Δ stays 0), frozen_random (A random, not trained)")
    scse_mask: bool = _f(True, "scse, sc_cond, sc_subtract, scse_leak: apply the zero-deviation mask "
                         "m = 1{‖Δ‖²_F > ε}")
    scse_eps: float = _f(1e-8, "scse family: mask threshold ε on the per-example squared Frobenius norm")
    scse_leak: float = _f(0.0, "scse: deviation leak λ_leak (0 in the main method; 0.02 in the "
                          "leak diagnostic)")
    scse_kappa: float = _f(0.0, "scse: initial learned gain κ of the conditioning input κ·W_c h*; "
                           "0 = no W_c (main method); 0.15 in the leak diagnostic")
    film_sigma: float = _f(0.1, "step_film: modulation scale σ of (1 + σ·g_t)⊙u + σ·b_t")
    film_steps: int = _f(8, "step_film: rows of the learned step-embedding table (g_t, b_t); steps "
                         "t >= film_steps reuse the last row")
    norm_reset_period: int = _f(4, "norm_reset: P, apply the parameter-free h ← RMSNorm(h) after every "
                                "P-th loop step")
    sc_kappa: float = _f(0.15, "sc_cond, sc_subtract, scse_leak: initial learned gain κ of the source "
                         "conditioning c_sc = κ·W_c h*")
    sc_leak: float = _f(0.02, "scse_leak: deviation leak λ_leak of Δ_{t+1} = (1 − λ_leak)·Δ_t + m·q_t")
    subtract_step_tau: float = _f(0.0, "additive_subtract: scale τ of the optional step term "
                                  "τ_t = τ·P_step γ_t of SCSE eq. 22 (0 = none, the paper's control)")
    state_init: StateInit = _f("gaussian", "Huginn-family rules: initial loop state h_0: zeros, embedding "
                               "(the prelude output e) or gaussian (std state_init_std)")
    state_init_std: float = _f(0.02, "state_init=gaussian: std of the initial state")
    state_init_seed: int = _f(0, "state_init=gaussian: seed of the evaluation-mode noise (a fixed (seq_len, d) "
                              "table indexed by position, so evaluation and cached decoding are "
                              "deterministic); -1 draws fresh noise from the global RNG in evaluation too")
    parcae_delta_init: float = _f(0.0, "parcae, parcae_decay, orthoinj: initial Δ_raw (Δ = softplus(Δ_raw))")
    parcae_alpha_init: float = _f(0.0, "parcae, parcae_decay, orthoinj: initial α_raw (α = exp(α_raw); "
                                  "Λ = exp(−Δ⊙α))")
    residual: Residual = _f("pre_ln", "block residual parameterization (SPEC §3): pre_ln, post_ln "
                            "(α=β=1), deepnorm (p=1/4), deeploop (p=1/2): x ← RMSNorm(α·x + f(x)), "
                            "α=(2N)^p, β=(8N)^-p, N=K·R")
    residual_p: float = _f(-1.0, "post-LN family: exponent p of α=(2N)^p, β=(8N)^-p; -1 takes the "
                           "family's (post_ln 0, deepnorm 0.25, deeploop 0.5)")
    residual_depth: int = _f(0, "post-LN family: R in N = K·R (0 = the training depth sampler's maximum)")
    input_norm: bool = _f(False, "RMSNorm on the input embedding e (the DeepLoop baseline)")
    readout: ReadoutName = _f("rmsnorm", "readout at loop k (SPEC §4): rmsnorm (W_out·RMSNorm(H_k)), raw "
                              "(W_out·H_k), final_only_norm (raw at intermediate loops, RMSNorm at the last)")
    scale_control: ScaleControl = _f("none", "between loops (SPEC §4): none, inter_loop_norm (RMSNorm "
                                     "with learned gain), spectral_damping (learned factor in (0, 1))")
    damping_init: float = _f(0.9, "spectral_damping: initial factor σ(ρ) in (0, 1)")
    exit_gate: bool = _f(False, "a learned exit gate (Linear d→1 per token and loop) for "
                         "train.supervision=exit_weighted (set automatically)")

    def __post_init__(self) -> None:
        _check_literal(self, self._prefix)
        p = self._prefix
        for name in ("vocab_size", "d_model", "n_heads", "d_ff", "seq_len", "n_core", "n_layers"):
            _check(getattr(self, name) >= 1, p + name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("n_prelude", "n_coda"):
            _check(getattr(self, name) >= 0, p + name, f"must be >= 0, got {getattr(self, name)}")
        _check(self.d_model % self.n_heads == 0, p + "n_heads",
               f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        _check(0.0 <= self.dropout < 1.0, p + "dropout", f"must be in [0, 1), got {self.dropout}")
        _check(self.norm_eps > 0, p + "norm_eps", "must be > 0")
        _check(self.init_std > 0, p + "init_std", "must be > 0")
        _check(self.step_scale == -1.0 or self.step_scale > 0, p + "step_scale",
               f"must be > 0 or -1 (rule default), got {self.step_scale}")
        _check(0.0 <= self.scse_leak < 1.0, p + "scse_leak", f"must be in [0, 1), got {self.scse_leak}")
        _check(self.scse_eps >= 0, p + "scse_eps", "must be >= 0")
        _check(self.film_sigma >= 0, p + "film_sigma", f"must be >= 0, got {self.film_sigma}")
        _check(self.film_steps >= 1, p + "film_steps", f"must be >= 1, got {self.film_steps}")
        _check(self.norm_reset_period >= 1, p + "norm_reset_period",
               f"must be >= 1, got {self.norm_reset_period}")
        _check(0.0 <= self.sc_leak < 1.0, p + "sc_leak", f"must be in [0, 1), got {self.sc_leak}")
        _check(self.subtract_step_tau >= 0, p + "subtract_step_tau",
               f"must be >= 0, got {self.subtract_step_tau}")
        _check(self.state_init_std >= 0, p + "state_init_std", f"must be >= 0, got {self.state_init_std}")
        _check(self.state_init_seed >= -1, p + "state_init_seed", f"must be >= -1, got {self.state_init_seed}")
        _check(self.residual_p == -1.0 or 0.0 <= self.residual_p <= 2.0, p + "residual_p",
               f"must be in [0, 2] or -1 (family default), got {self.residual_p}")
        _check(self.residual_depth >= 0, p + "residual_depth", f"must be >= 0, got {self.residual_depth}")
        _check(0.0 < self.damping_init < 1.0, p + "damping_init", f"must be in (0, 1), got {self.damping_init}")
        if self.architecture == "unshared":
            _check(self.residual == "pre_ln", p + "residual", "the unshared reference supports pre_ln only")
            _check(self.scale_control == "none", p + "scale_control",
                   "the unshared reference has no loop to control; allowed: none")
            _check(not self.exit_gate, p + "exit_gate", "exit gates need the shared architecture; allowed: false")

    @property
    def resolved_residual_p(self) -> float:
        """The exponent p of α = (2N)^p, β = (8N)^-p (SPEC §3)."""
        return RESIDUAL_P[self.residual] if self.residual_p == -1.0 else self.residual_p

    @property
    def residual_alpha_beta(self) -> tuple[float, float]:
        """(α, β) of the post-LN family with N = n_core · residual_depth (SPEC §3); (1, 1) for pre_ln.

        Raises:
            ConfigError: a post-LN family model without a resolved ``residual_depth``.
        """
        if self.residual == "pre_ln":
            return 1.0, 1.0
        _check(self.residual_depth >= 1, self._prefix + "residual_depth",
               "must be >= 1 for a post-LN family model (set it, or build the model from a full Config)")
        n = self.n_core * self.residual_depth
        p = self.resolved_residual_p
        return (2.0 * n) ** p, (8.0 * n) ** (-p)

    @property
    def resolved_step_scale(self) -> float:
        """The residual step scale s actually used (SPEC §2 defaults per rule)."""
        if self.step_scale != -1.0:
            return self.step_scale
        return DEFAULT_STEP_SCALE[self.rule]


@dataclass(frozen=True)
class DataConfig(_Base):
    """Where the training and evaluation text comes from (SPEC §5, §11)."""

    _prefix = "data."
    dataset: DatasetName = _f("brown", "training corpus: brown (SPEC §11 document split), wikitext2, "
                              "wikitext103 (raw), text (local files, see text_files), openwebtext or c4 "
                              "(hub slices of SPEC §5, online only)")
    text_files: list = _f([], "dataset=text: [train, valid, test] plain-text file paths")
    tokenizer: TokenizerName = _f("gpt2", "gpt2: GPT-2 BPE (50,257); bpe: byte-level BPE trained on "
                                  "the training split with bpe_vocab_size entries")
    bpe_vocab_size: int = _f(8192, "tokenizer=bpe: vocabulary size")
    data_root: str = _f("", "data root; empty = $LOOPLM_DATA, else ../shared/data next to the repo")
    cache_dir: str = _f("", "token cache; empty = $LOOPLM_CACHE, else ~/.cache/looplm")

    def __post_init__(self) -> None:
        _check_literal(self, self._prefix)
        _check(self.bpe_vocab_size >= 260, self._prefix + "bpe_vocab_size", "must be >= 260")
        if self.dataset == "text":
            _check(len(self.text_files) == 3, self._prefix + "text_files",
                   "dataset=text needs three paths: train, valid, test")


@dataclass(frozen=True)
class TrainConfig(_Base):
    """Optimization schedule (SPEC §5)."""

    _prefix = "train."
    steps: int = _f(5000, "optimizer steps")
    batch_size: int = _f(32, "sequences per microbatch")
    grad_accum: int = _f(1, "microbatches per optimizer step")
    lr: float = _f(3e-4, "peak learning rate")
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of lr (cosine floor)")
    warmup_steps: int = _f(500, "linear warm-up steps")
    weight_decay: float = _f(0.1, "AdamW weight decay, applied to matrices only")
    beta1: float = _f(0.9, "AdamW β1")
    beta2: float = _f(0.95, "AdamW β2")
    grad_clip: float = _f(1.0, "gradient-norm clipping threshold (0 = off)")
    depth_sampler: SamplerName = _f("uniform", "training depth sampler (SPEC §5): fixed (depth), uniform "
                                    "(depth_lo..depth_hi inclusive), pln (Poisson log-normal, mean depth_mean, "
                                    "σ pln_sigma, capped at depth_cap) or learned (categorical prior over "
                                    "1..depth_cap trained by REINFORCE); one draw per microbatch")
    depth: int = _f(8, "fixed sampler: loop depth T")
    depth_lo: int = _f(1, "uniform sampler: lowest depth")
    depth_hi: int = _f(8, "uniform sampler: highest depth")
    depth_mean: float = _f(5.0, "pln: target mean E[min(R, cap)]; learned: budget target R̄")
    pln_sigma: float = _f(0.5, "pln (and the learned prior's initialization): σ of ξ ~ N(μ, σ²)")
    depth_cap: int = _f(64, "pln: cap on R; learned: R_max")
    prior_lr: float = _f(1e-3, "learned: Adam learning rate of the prior logits")
    prior_entropy: float = _f(0.01, "learned: entropy weight λ_H")
    prior_budget: float = _f(1.0, "learned: budget weight λ_m of (E_p[R] − R̄)²")
    prior_warmup: int = _f(32, "learned: warm-up updates that only collect the reward baseline")
    prior_reward: PriorReward = _f("neg_ce", "learned: reward arm: neg_ce (−CE), log_ce (−log CE), "
                                   "exp_ce (−exp(CE)), inv_ppl (exp(−CE))")
    tbptt: int = _f(0, "truncated BPTT: back-propagate through the last b recurrences only (0 = full BPTT)")
    supervision: Supervision = _f("terminal", "loss (SPEC §4): terminal (CE at the last loop), per_loop "
                                  "(mean CE over loops 1..T), exit_weighted (learned exit gate weights the "
                                  "per-loop CE, plus an entropy term)")
    exit_entropy: float = _f(0.05, "exit_weighted: weight of the exit-distribution entropy bonus")
    norm_penalty: float = _f(0.0, "λ of the scale penalty λ·T⁻¹ Σ_k mean_tokens ‖H_k‖²_rms (0 = off)")
    seed: int = _f(0, "seed for initialization, data order and depth draws")
    eval_every: int = _f(500, "validate every this many steps (0 = only at the end)")
    eval_batches: int = _f(20, "validation batches per periodic validation")
    eval_depth: int = _f(8, "loop depth used for periodic validation")
    ckpt_every: int = _f(500, "write a checkpoint every this many steps (0 = only at the end)")
    checkpoint_format: CheckpointFormat = _f("consolidated", "consolidated (full weights gathered to rank 0, "
                                             "written as model.safetensors + train_state.pt) or sharded "
                                             "(every rank writes its own shards with torch.distributed."
                                             "checkpoint; needs a filesystem all ranks see); both resume under "
                                             "any world size")
    device: Device = _f("auto", "cpu, cuda, or auto (cuda when available)")
    dtype: DType = _f("float32", "autocast dtype for forward/backward (bfloat16 on GPU)")
    num_threads: int = _f(0, "torch CPU threads (0 = torch default)")
    distributed: Parallel = _f("ddp", "under torchrun (WORLD_SIZE > 1): ddp (replicated weights) or fsdp "
                               "(FSDP2 fully_shard per block); batch_size is the global batch, split "
                               "evenly across ranks")
    compile: bool = _f(False, "torch.compile each block (compiled once; changing the loop depth does not "
                       "recompile)")
    max_nonfinite_steps: int = _f(5, "stop with an error after this many consecutive steps with a non-finite "
                                  "loss or gradient norm (each such step is skipped: no optimizer update)")

    def __post_init__(self) -> None:
        _check_literal(self, self._prefix)
        p = self._prefix
        for name in ("steps", "batch_size", "grad_accum", "depth", "depth_lo", "depth_hi", "eval_batches",
                     "eval_depth"):
            _check(getattr(self, name) >= 1, p + name, f"must be >= 1, got {getattr(self, name)}")
        _check(self.depth_mean >= 1, p + "depth_mean", f"must be >= 1, got {self.depth_mean}")
        _check(self.pln_sigma > 0, p + "pln_sigma", f"must be > 0, got {self.pln_sigma}")
        _check(self.depth_cap >= 1, p + "depth_cap", f"must be >= 1, got {self.depth_cap}")
        if self.depth_sampler in ("pln", "learned"):
            _check(self.depth_mean < self.depth_cap, p + "depth_mean",
                   f"must be < depth_cap={self.depth_cap}, got {self.depth_mean}")
        _check(self.prior_lr > 0, p + "prior_lr", "must be > 0")
        for name in ("prior_entropy", "prior_budget", "exit_entropy", "norm_penalty"):
            _check(getattr(self, name) >= 0, p + name, f"must be >= 0, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "ckpt_every", "num_threads", "prior_warmup", "tbptt"):
            _check(getattr(self, name) >= 0, p + name, f"must be >= 0, got {getattr(self, name)}")
        _check(self.depth_lo <= self.depth_hi, p + "depth_hi",
               f"must be >= depth_lo={self.depth_lo}, got {self.depth_hi}")
        _check(self.lr > 0, p + "lr", "must be > 0")
        _check(0 <= self.min_lr_ratio <= 1, p + "min_lr_ratio", "must be in [0, 1]")
        _check(self.grad_clip >= 0, p + "grad_clip", "must be >= 0")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, p + "beta1", "betas must be in [0, 1)")
        _check(self.max_nonfinite_steps >= 1, p + "max_nonfinite_steps", "must be >= 1")

    @property
    def max_depth(self) -> int:
        """The largest loop depth the training sampler can draw."""
        return {"fixed": self.depth, "uniform": self.depth_hi}.get(self.depth_sampler, self.depth_cap)

    @property
    def nominal_depth(self) -> int:
        """The loop depth a trained model stands for: ``depth`` (fixed), ``depth_hi`` (uniform), or
        ``depth_mean`` rounded up (pln, learned). The default K_max of halting and of the scale
        diagnostics, and the depth from which a ``final_only_norm`` readout normalizes."""
        if self.depth_sampler in ("fixed", "uniform"):
            return self.max_depth
        return int(math.ceil(self.depth_mean))


@dataclass(frozen=True)
class Config(_Base):
    """A whole run: model, data and training (serialized as ``config.json``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    name: str = "run"

    def __post_init__(self) -> None:
        # resolve model fields that follow from training (saved into config.json, so a checkpoint
        # rebuilds the same model): N = K·R of the post-LN family and the exit gate
        changes: dict[str, Any] = {}
        if self.model.residual != "pre_ln" and self.model.residual_depth == 0:
            changes["residual_depth"] = self.train.max_depth
        if self.model.architecture == "unshared":
            _check(self.train.supervision != "exit_weighted", "train.supervision",
                   "exit_weighted needs learned exit gates, which only the shared architecture has; "
                   "allowed for model.architecture=unshared: terminal, per_loop")
        if self.train.supervision == "exit_weighted" and not self.model.exit_gate:
            changes["exit_gate"] = True
        if changes:
            object.__setattr__(self, "model", self.model.replace(**changes))

    def to_dict(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, "name": self.name, "model": self.model.to_dict(),
                "data": self.data.to_dict(), "train": self.train.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        d = dict(d)
        version = d.pop("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise ConfigError(f"format_version: this looplm reads version {FORMAT_VERSION}, got {version}")
        unknown = sorted(set(d) - {"model", "data", "train", "name"})
        if unknown:
            raise ConfigError(f"{unknown[0]}: unknown section; known: model, data, train, name")
        for key in ("model", "data", "train"):
            if key in d and not isinstance(d[key], dict):
                raise ConfigError(f"{key}: must be a JSON object")
        return cls(model=ModelConfig.from_dict(d.get("model", {})),
                   data=DataConfig.from_dict(d.get("data", {})),
                   train=TrainConfig.from_dict(d.get("train", {})),
                   name=str(d.get("name", "run")))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> "Config":
        return cls.from_dict(json.loads(text))


SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}


def parse_field_value(section: str, name: str, text: str) -> Any:
    """Parse a command-line string for ``section.name`` into the field's type.

    Raises:
        ConfigError: unknown section/field, or text that does not parse as the field's type.
    """
    if section not in SECTIONS:
        raise ConfigError(f"{section}: unknown section; known: {', '.join(SECTIONS)}")
    cls = SECTIONS[section]
    hints = typing.get_type_hints(cls)
    if name not in {f.name for f in dataclasses.fields(cls)}:
        known = ", ".join(f.name for f in dataclasses.fields(cls))
        raise ConfigError(f"{section}.{name}: unknown field; known: {known}")
    tp = hints[name]
    try:
        if tp is bool:
            low = text.lower()
            if low not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise ValueError(text)
            return low in ("true", "1", "yes", "on")
        if tp is int:
            return int(text)
        if tp is float:
            return float(text)
        if tp is list or typing.get_origin(tp) is list:
            return [s for s in text.split(",") if s] if not text.startswith("[") else json.loads(text)
        return text
    except ValueError:
        raise ConfigError(f"{section}.{name}: cannot parse {text!r} as {getattr(tp, '__name__', tp)}") from None


def apply_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """Return ``cfg`` with ``{"section.field": value}`` overrides applied (and re-validated)."""
    per: dict[str, dict[str, Any]] = {}
    name = cfg.name
    for key, value in overrides.items():
        if key == "name":
            name = str(value)
            continue
        section, _, fname = key.partition(".")
        if isinstance(value, str):
            value = parse_field_value(section, fname, value)
        elif section not in SECTIONS:
            raise ConfigError(f"{section}: unknown section; known: {', '.join(SECTIONS)}")
        per.setdefault(section, {})[fname] = value
    d = cfg.to_dict()
    for section, changes in per.items():
        d[section].update(changes)
    d["name"] = name
    return Config.from_dict(d)
