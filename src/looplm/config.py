"""Typed, serializable configuration for looplm (torch-free).

Dataclasses of plain JSON values, validated on construction (:class:`ConfigError` names the field and
what is allowed); field help texts are the CLI's ``--help`` (``--section.field VALUE``). Choices with
their own fields are typed sections, one frozen class per variant holding only what it reads: the rule
options (``model.options``, :data:`RULE_OPTIONS`), ``depth.sampler``, ``train.gradient.kind``,
``model.position.kind``, ``model.scale_control.kind``; a changed variant carries same-named fields over.
``optim`` is shared with distill and rl; no section rewrites another. Model fields: SPEC.md §1–2.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Iterable, Literal, get_args

#: config.json layout (4: typed choice sections, rule options under ``model.options``)
FORMAT_VERSION = 4

RuleName = Literal["looped", "adapter", "step_adapter", "step_film", "scse", "norm_reset", "sc_cond",
                   "sc_subtract", "additive_subtract", "scse_leak", "plain", "huginn_linear", "parcae_decay",
                   "parcae", "orthoinj", "deq_qkv"]
RULE_NAMES: tuple[str, ...] = get_args(RuleName)
Architecture = Literal["shared", "unshared"]
AnchorName = Literal["learned", "embedding", "init", "frozen_random"]
StateInit = Literal["zeros", "embedding", "gaussian", "truncated_normal"]
Residual = Literal["pre_ln", "post_ln", "deepnorm", "deeploop"]
ReadoutName = Literal["rmsnorm", "raw", "final_only_norm"]
RopeLayout = Literal["half", "interleaved"]
RopeScaling = Literal["none", "linear"]
BlockNorm = Literal["pre", "sandwich", "pre_post"]
ExitNorm = Literal["none", "learned", "final"]
Supervision = Literal["terminal", "per_loop", "exit_weighted"]
PriorReward = Literal["neg_ce", "log_ce", "exp_ce", "inv_ppl"]
Schedule = Literal["cosine", "wsd"]
SourceInit = Literal["gpt2", "torch", "matched", "normal"]
ProjectionInit = Literal["source", "unit"]
BlockInit = Literal["normal", "xavier_normal"]

#: the residual exponent p of each family (SPEC §3); post_ln has α = β = 1 (p = 0)
RESIDUAL_P: dict[str, float] = {"pre_ln": 0.0, "post_ln": 0.0, "deepnorm": 0.25, "deeploop": 0.5}
DatasetName = Literal["brown", "wikitext2", "wikitext103", "text", "openwebtext", "c4", "hf", "task"]
TaskName = Literal["phop", "modsum", "modsum_partial", "varchain", "addition", "pointer", "pointer_edges",
                   "pointer_pairs", "pointer_pairs_mq", "pointer_forest"]  # looplm.tasks.TASKS
TokenizerName = Literal["gpt2", "bpe"]
Device = Literal["cpu", "cuda", "auto"]
Parallel = Literal["ddp", "fsdp"]
DType = Literal["float32", "bfloat16"]
CheckpointFormat = Literal["consolidated", "sharded"]
#: ``train.logger`` backends (:mod:`looplm.train.loggers`); ``jsonl`` (metrics.jsonl) is always written
LOGGER_NAMES: tuple[str, ...] = ("jsonl", "tensorboard", "wandb", "trackio")


class ConfigError(ValueError):
    """A config field has a value that is not allowed; the message names the field."""


@dataclass(frozen=True)
class Range:
    """A number field's range, as ``Annotated[int, Range(1)]``: ``>= lo`` (``> lo`` if ``strict``), ``< below``."""

    lo: float
    strict: bool = False
    below: float = math.inf


PositiveInt = Annotated[int, Range(1)]
NonNegInt = Annotated[int, Range(0)]
PositiveFloat = Annotated[float, Range(0.0, strict=True)]
NonNegFloat = Annotated[float, Range(0.0)]
Fraction = Annotated[float, Range(0.0, below=1.0)]  # [0, 1)


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {msg}")


def suggest(name: str, known: Iterable[str], form: str = " (did you mean {}?)", cutoff: float = 0.7) -> str:
    """``form`` holding the closest known name (the CLI's: ``"; did you mean {}?"``, cutoff 0.6), or ``""``."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=cutoff)
    return form.format(close[0]) if close else ""


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def _unknown(where: str, kind: str, known: Iterable[str]) -> ConfigError:
    known = list(known)
    return ConfigError(f"{where}: unknown {kind}{suggest(where.rsplit('.', 1)[-1], known)}; "
                       f"known: {', '.join(known)}")


def _check_literal(obj: Any, prefix: str) -> None:
    """Type-check every field of ``obj``: Literal names, strings, bools, ints, finite floats, a :class:`Range`."""
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for f in dataclasses.fields(obj):
        tp, name, value = hints[f.name], prefix + f.name, getattr(obj, f.name)
        tp, bound = get_args(tp) if typing.get_origin(tp) is Annotated else (tp, None)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if typing.get_origin(tp) is Literal:
            _check(value in get_args(tp), name, f"got {value!r}; allowed: {', '.join(map(repr, get_args(tp)))}")
        elif tp is str:
            _check(isinstance(value, str), name, f"must be a string, got {value!r}")
        elif tp is bool:
            _check(isinstance(value, bool), name, f"must be true/false, got {value!r}")
        elif tp is int:
            _check(number and isinstance(value, int), name, f"must be an integer, got {value!r}")
        elif tp is float:
            _check(number, name, f"must be a number, got {value!r}")
            _check(math.isfinite(value), name, f"must be finite, got {value!r}")
        if bound is not None:
            lo, hi, op = bound.lo, bound.below, ">" if bound.strict else ">="
            shown = f"{op} {lo:g}" if hi == math.inf else f"in {'(' if bound.strict else '['}{lo:g}, {hi:g})"
            _check((value > lo if bound.strict else value >= lo) and value < hi, name, f"must be {shown}, got {value}")


def _variant(base: type, cls_name: str, **attrs: Any) -> Any:
    """A frozen subclass of ``base`` with no fields of its own (a choice variant: ``NAME=...``)."""
    return dataclass(frozen=True)(type(cls_name, (base,), {"__module__": __name__, **attrs}))


class _Base:
    """Shared JSON round-trip and checks for the config dataclasses."""

    _prefix = ""
    _key_kind = "field"  # what a key of its dict is, in the errors of _check_keys (Config: a section)

    def require(self, cond: bool, name: str, msg: str) -> None:
        _check(cond, self._prefix + name, msg)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)  # type: ignore[call-overload]
        return {**d, **{name: getattr(self, name).to_dict() for name in _sections(type(self))}}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str):
        return cls.from_dict(json.loads(text))

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]

    @classmethod
    def _check_keys(cls, d: dict[str, Any]) -> None:
        """A complete dict (as read from a file): no unknown and no missing field."""
        _check(isinstance(d, dict), cls._prefix.rstrip("."), "must be a JSON object")
        names = cls.field_names()
        for key in d:
            if key not in names:
                raise _unknown(f"{cls._prefix}{key}", cls._key_kind, names)
        missing = [n for n in names if n not in d]
        if missing:
            raise ConfigError(f"{cls._prefix}{missing[0]}: missing; a config file gives every {cls._key_kind} "
                              f"(missing: {', '.join(missing)})")

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        """Build from a complete dict, as ``to_dict`` writes it (ConfigError: unknown, missing or bad field)."""
        cls._check_keys(d)
        sections = _sections(cls)
        return cls(**{k: sections[k].from_dict(v) if k in sections else v for k, v in d.items()})

    def __post_init__(self) -> None:
        self._build_sections()
        _check_literal(self, self._prefix)
        self.validate()

    def validate(self) -> None:
        """Range checks, after the type checks."""

    def _build_sections(self) -> None:
        """A section given as a dict becomes its section (a choice section: its variant)."""
        for name, base in _sections(type(self)).items():
            value = getattr(self, name)
            if isinstance(value, dict):
                value = build_choice(base, value) if issubclass(base, ChoiceSection) else base(**value)
                object.__setattr__(self, name, value)
            self.require(isinstance(value, base), name, f"must be {_a(name.replace('_', ' '))} config, "
                         f"got {value!r}")

    def replace(self, **changes: Any):
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def fields_help(self) -> list[tuple[str, str, Any]]:
        """``(key, help, default)`` of every leaf field below this config, for ``--help``; a field of the rule
        options or a choice section lists the variants that read it (default ``dataclasses.MISSING``)."""
        out: list[tuple[str, str, Any]] = []
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            key, value = self._prefix + f.name, getattr(self, f.name)
            if key == "model.options":
                classes = {"/".join(_rules_of(cls)): cls for cls in RULE_OPTIONS.values()}
                out += _variants_help("model.options.", classes, "rule default")
            elif isinstance(value, ChoiceSection):
                out.append((value._prefix + value.KEY, f"{value.HELP}; its fields follow [default: {value.NAME}]",
                            dataclasses.MISSING))
                out += _variants_help(value._prefix, value.VARIANTS, value.KEY)
            elif isinstance(value, _Base):
                out += value.fields_help()
            elif self._prefix:
                out.append((key, f.metadata.get("help", ""), value))
        return out


# ---------------------------------------------------------------- per-rule options (SPEC §2)
#: step_scale defaults (SPEC §2): looped 1, adapter 0.35, SCSE 0.5 (paper); controls take their family's value
_STEP_SCALE_HELP = "residual step scale s of the rule's update"
_SOURCE_INIT_HELP = ("init of the source modules ({}): gpt2 (N(0, model.init_std)), torch (nn.Linear's default), "
                     "matched ({}; see recurrence.init_source_modules), normal (N(0, source_init_std))")
_SOURCE_INIT_STD_HELP = "source_init=normal: std of the source modules' weights (stored 0 under other schemes)"
#: SCSE/adapter source-module init from the init study of issue 11 (experiments/scse-cpu/init-study, Brown valid
#: PPL and t = 0 gain, 3 seeds): N(0, 2.0) gives rms(Δ₀) ≈ 4·rms(e) at d = 192 (SCSE arXiv:2607.27656 §5 regime)
ANCHORED_SOURCE_INIT, ANCHORED_SOURCE_INIT_STD = "normal", 2.0


@dataclass(frozen=True)
class RuleOptions(_Base):
    """Options of one recurrence rule (``ModelConfig.options``): exactly the fields its rules read."""

    _prefix = "model.options."

    def validate(self) -> None:
        """Range checks (every float is already checked to be finite)."""
        if hasattr(self, "source_init"):
            if self.source_init == "normal":
                self.require(self.source_init_std > 0, "source_init_std",
                             f"must be > 0 with source_init=normal, got {self.source_init_std}")
            else:
                default = type(self).__dataclass_fields__["source_init_std"].default
                self.require(self.source_init_std in (0.0, default), "source_init_std",
                             f"read only by source_init=normal (got source_init={self.source_init!r}); leave it at "
                             f"{default:g} (its default) or 0, got {self.source_init_std}")
                # stored as 0 when unread, so a scheme's config is the same whichever default it came from
                object.__setattr__(self, "source_init_std", 0.0)


PlainOptions = _variant(RuleOptions, "PlainOptions")  # plain: no injection, no residual scale


@dataclass(frozen=True)
class LoopedOptions(RuleOptions):
    """``looped``: h + s·G(h + e)."""

    step_scale: PositiveFloat = _f(1.0, _STEP_SCALE_HELP)


@dataclass(frozen=True)
class NormResetOptions(LoopedOptions):
    """``norm_reset``: the looped step, then h ← RMSNorm(h) every ``period`` steps."""

    period: PositiveInt = _f(4, "P: apply the parameter-free h ← RMSNorm(h) after every P-th loop step")


@dataclass(frozen=True)
class _AnchoredOptions(RuleOptions):
    """The learned anchor h* = e + c_a·A(e) and initial state h_0 = e + c_0·I(e) (SCSE eq. 3–4)."""

    step_scale: PositiveFloat = _f(0.5, _STEP_SCALE_HELP)
    anchor_scale: NonNegFloat = _f(0.1, "c_a: anchor h* = e + c_a·A(e)")
    init_scale: NonNegFloat = _f(0.1, "c_0: initial state h_0 = e + c_0·I(e)")
    source_init: SourceInit = _f(ANCHORED_SOURCE_INIT, _SOURCE_INIT_HELP.format(
        "A, I, W_in, W_c, P_step", "Δ₀ = c_0·I(e) − c_a·A(e) has the RMS of e") + "; default: the init study's")
    source_init_std: float = _f(ANCHORED_SOURCE_INIT_STD, _SOURCE_INIT_STD_HELP)
    projection_init: ProjectionInit = _f("source", "source_init=normal: W_in, W_c, P_step draw from source (N(0, "
                                         "source_init_std)) or unit (N(0, 1/√fan_in); issue 25 §3)")

    def validate(self) -> None:
        super().validate()
        self.require(self.projection_init == "source" or self.source_init == "normal", "projection_init",
                     f"read only by source_init=normal (got source_init={self.source_init!r}); allowed: 'source'")


@dataclass(frozen=True)
class AdapterOptions(_AnchoredOptions):
    """``adapter`` (tuned adapter): h + s·G(h + α·W_in h*)."""

    step_scale: PositiveFloat = _f(0.35, _STEP_SCALE_HELP)
    alpha_init: float = _f(0.15, "initial value of the learned source gain α")


@dataclass(frozen=True)
class StepAdapterOptions(AdapterOptions):
    """``step_adapter``: the adapter plus τ·P_step γ_t in the core input."""

    step_tau: NonNegFloat = _f(0.015, "scale τ of the projected sinusoidal step embedding τ·P_step γ_t")


@dataclass(frozen=True)
class StepFilmOptions(AdapterOptions):
    """``step_film``: h + s·G((1 + σ·g_t)⊙u + σ·b_t), u = h + α·W_in h*."""

    sigma: NonNegFloat = _f(0.1, "modulation scale σ of (1 + σ·g_t)⊙u + σ·b_t")
    steps: PositiveInt = _f(8, "rows of the learned step-embedding table (g_t, b_t); later steps reuse the last row")


@dataclass(frozen=True)
class _SourceCenteredOptions(_AnchoredOptions):
    """The masked source-centered recurrence of the SCSE family (SCSE eq. 5)."""

    anchor: AnchorName = _f("learned", "anchor h*: learned (e + c_a·A(e)), embedding (e), init (h_0), frozen_random")
    mask: bool = _f(True, "apply the zero-deviation mask m = 1{‖Δ‖²_F > ε}")
    eps: NonNegFloat = _f(1e-8, "mask threshold ε on the per-example squared Frobenius norm")


@dataclass(frozen=True)
class SCSEOptions(_SourceCenteredOptions):
    """``scse``: Δ ← (1 − λ_leak)·Δ + m·s·G(Δ + κ·W_c h*); the main method has λ_leak = 0, κ = 0."""

    leak: Fraction = _f(0.0, "deviation leak λ_leak (0 in the main method; 0.02 in the leak diagnostic)")
    kappa: float = _f(0.0, "initial learned gain κ of the conditioning input κ·W_c h*; 0 = no W_c (main method)")


@dataclass(frozen=True)
class SCCondOptions(_SourceCenteredOptions):
    """``sc_cond``, ``sc_subtract``: the SCSE recurrence with the source conditioning c_sc = κ·W_c h*."""

    kappa: float = _f(0.15, "initial learned gain κ of the source conditioning c_sc = κ·W_c h*")


@dataclass(frozen=True)
class SCSELeakOptions(SCCondOptions):
    """``scse_leak``: the leak diagnostic, SC-Cond with a deviation leak."""

    leak: Fraction = _f(0.02, "deviation leak λ_leak of Δ_{t+1} = (1 − λ_leak)·Δ_t + m·q_t")


@dataclass(frozen=True)
class AdditiveSubtractOptions(_AnchoredOptions):
    """``additive_subtract`` (SCSE eq. 22): Δ + s·[G(h* + Δ + α·W_in e + τ_t) − G(h* + α·W_in e + τ_t)]."""

    alpha_init: float = _f(0.15, "initial value of the learned source gain α")
    step_tau: NonNegFloat = _f(0.0, "scale τ of the optional step term τ_t = τ·P_step γ_t (0 = none, the paper's "
                               "control)")


@dataclass(frozen=True)
class HuginnOptions(RuleOptions):
    """``huginn_linear``, ``deq_qkv``: the initial loop state of the Huginn family."""

    state_init: StateInit = _f("gaussian", "initial loop state h_0: zeros, embedding (e), gaussian (N(0, "
                               "state_init_std²)) or truncated_normal (cut at ±3 std; Huginn-0125)")
    state_init_std: NonNegFloat = _f(0.02, "gaussian / truncated_normal: std of h_0 (Huginn-0125: √(2/5))")
    state_init_seed: Annotated[int, Range(-1)] = _f(
        0, "gaussian / truncated_normal: seed of the fixed evaluation-mode (seq_len, d) noise table; -1: fresh "
        "global-RNG noise in evaluation too (Huginn-0125)")
    source_init: SourceInit = _f("gpt2", _SOURCE_INIT_HELP.format(
        "the injection matrices", "N(0, 1/√fan_in): the injected term has its input's RMS"))
    source_init_std: float = _f(0.0, _SOURCE_INIT_STD_HELP)


@dataclass(frozen=True)
class HuginnLinearOptions(HuginnOptions):
    """``huginn_linear``: ζ = W_lin [h; e] (+ bias), then the core, then (by default) a parameter-free RMSNorm."""

    adapter_bias: bool = _f(True, "a bias in the adapter W_lin [h; e; 1] (LMDR); false: none (Huginn-0125)")
    step_norm: bool = _f(True, "a parameter-free RMSNorm after every step (LMDR); false: none (Huginn-0125)")


@dataclass(frozen=True)
class DecayOptions(HuginnOptions):
    """``parcae``, ``parcae_decay``, ``orthoinj``: Λ = diag(exp(−Δ⊙α)), Δ = softplus(Δ_raw), α = exp(α_raw)."""

    delta_raw_init: float = _f(0.0, "initial Δ_raw (Δ = softplus(Δ_raw))")
    alpha_raw_init: float = _f(0.0, "initial α_raw (α = exp(α_raw); Λ = exp(−Δ⊙α))")


@dataclass(frozen=True)
class ParcaeDecayOptions(DecayOptions):
    """``parcae_decay``: ζ = Λh + Δ ⊙ W·RMSNorm(e)."""

    input_norm_affine: bool = _f(True, "learned gains in the RMSNorm of e (LMDR Table 7); false: parameter-free")


#: the options class of every rule
RULE_OPTIONS: dict[str, type[RuleOptions]] = {
    "looped": LoopedOptions, "norm_reset": NormResetOptions,
    "adapter": AdapterOptions, "step_adapter": StepAdapterOptions, "step_film": StepFilmOptions,
    "scse": SCSEOptions, "sc_cond": SCCondOptions, "sc_subtract": SCCondOptions, "scse_leak": SCSELeakOptions,
    "additive_subtract": AdditiveSubtractOptions, "plain": PlainOptions,
    "huginn_linear": HuginnLinearOptions, "deq_qkv": HuginnOptions,
    "parcae_decay": ParcaeDecayOptions, "parcae": DecayOptions, "orthoinj": DecayOptions,
}

def _rules_of(cls: type[RuleOptions]) -> list[str]:
    return [r for r, c in RULE_OPTIONS.items() if c is cls]


def options_class(rule: str) -> type[RuleOptions]:
    """The options class of ``rule`` (ConfigError for an unknown rule, listing the known ones)."""
    _check(rule in RULE_OPTIONS, "model.rule", f"got {rule!r}; allowed: {', '.join(map(repr, RULE_NAMES))}")
    return RULE_OPTIONS[rule]


def _check_fields(prefix: str, d: dict[str, Any], variants: dict[str, Any], variant: str, complete: bool,
                  key: str = "rule", verb: str = "use", kind: str = "option") -> None:
    """ConfigError for a key of ``d`` that ``variant`` lacks (naming its owners), or with ``complete`` a missing one."""
    own = variants[variant].field_names()
    for name in d:
        if name not in own:
            owners = [v for v, c in variants.items() if name in c.field_names()]
            known = {n for c in variants.values() for n in c.field_names()}
            what = (f"{key} {variant} does not {verb} it ({_a(kind)} of {', '.join(owners)})"
                    if owners else f"unknown {kind}{suggest(name, known)}")
            raise ConfigError(f"{prefix}{name}: {what}; {kind}s of {variant}: {', '.join(own) or 'none'}")
    if complete:
        variants[variant]._check_keys(d)


def _options_from_dict(rule: str, d: dict[str, Any], *, complete: bool) -> RuleOptions:
    _check_fields("model.options.", d, RULE_OPTIONS, rule, complete)
    return RULE_OPTIONS[rule](**d)


def carry_options(model: "ModelConfig", rule: str, architecture: str) -> dict[str, Any] | None:
    """The options ``model`` set away from their defaults, for ``rule`` / ``architecture`` (ConfigError: one
    that the new rule, or the unshared architecture, does not have)."""
    opts = model.options
    changed = {} if opts is None else {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)
                                       if getattr(opts, f.name) != f.default}
    own = RULE_OPTIONS[rule].field_names() if rule in RULE_OPTIONS else None  # None: ModelConfig names the bad rule
    for name, value in changed.items():
        if architecture == "unshared":
            raise ConfigError(f"model.options.{name}: {value!r} was set for rule {model.rule}; the unshared "
                              "architecture has no rule options")
        if own is not None and name not in own:
            raise ConfigError(f"model.options.{name}: {value!r} was set for rule {model.rule}, but rule {rule} "
                              f"has no such option (options of {rule}: {', '.join(own) or 'none'}); "
                              "set rule-specific options together with model.rule")
    return None if architecture == "unshared" or own is None else changed


# ---------------------------------------------------------------- typed choice sections
class ChoiceSection(_Base):
    """A section whose variant is named by ``KEY`` (``depth.sampler``, ...); each variant (``NAME``) holds the
    fields it reads and registers itself in the ``VARIANTS`` of its family's base (the class that sets ``KEY``)."""

    KEY: ClassVar[str]
    NAME: ClassVar[str]
    HELP: ClassVar[str]
    VARIANTS: ClassVar[dict[str, type[ChoiceSection]]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "KEY" in vars(cls):
            cls.VARIANTS = {}
        if "NAME" in vars(cls):
            cls.VARIANTS[cls.NAME] = cls

    def to_dict(self) -> dict[str, Any]:
        return {self.KEY: self.NAME, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ChoiceSection":
        return build_choice(cls, d, complete=True)


def _sections(cls: type) -> dict[str, type[_Base]]:
    """``{field: class}`` of ``cls``'s fields that hold a section (a typed choice section's base class)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)
            if isinstance(hints[f.name], type) and issubclass(hints[f.name], _Base)}


def build_choice(base: type[ChoiceSection], d: dict[str, Any], *, complete: bool = False,
                 carry: ChoiceSection | None = None) -> ChoiceSection:
    """The variant of ``base``'s family named by ``d[base.KEY]`` (default: ``carry``'s) with the fields of ``d``
    (strings parsed), the others from ``carry`` where its variant has them, else defaults (ConfigError: an unknown
    variant or field, a field the variant does not read, a missing field with ``complete``, a bad value)."""
    _check(isinstance(d, dict), base._prefix.rstrip("."), f"must be a JSON object, got {d!r}")
    variants = base.VARIANTS
    d = dict(d)
    name = d.pop(base.KEY, getattr(carry, "NAME", None))
    _check(name in variants, base._prefix + base.KEY, f"got {name!r}; allowed: {', '.join(map(repr, variants))}")
    cls = variants[name]
    _check_fields(base._prefix, d, variants, name, complete, base.KEY, "read", "field")
    carried = {k: getattr(carry, k) for k in cls.field_names() if hasattr(carry, k)}  # none without carry
    return cls(**{**carried, **_parsed(cls, base._prefix, d)})


def _variants_help(prefix: str, classes: dict[str, Any], tag: str) -> list[tuple[str, str, Any]]:
    """``(prefix + FIELD, help [tag: variant default; ...], MISSING)`` over the ``{variant: class}``."""
    readers: dict[str, list[str]] = {}
    helps: dict[str, str] = {}
    for name, cls in classes.items():
        for f in dataclasses.fields(cls):
            helps.setdefault(f.name, f.metadata["help"])
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            readers.setdefault(f.name, []).append(f"{name} {default!r}")
    return [(prefix + n, f"{helps[n]} [{tag}: {'; '.join(r)}]", dataclasses.MISSING) for n, r in readers.items()]


# ---------------------------------------------------------------- position signal (SPEC §1)
@dataclass(frozen=True)
class PositionConfig(ChoiceSection):
    """The position signal (SPEC §1), ``model.position.kind``."""

    _prefix = "model.position."
    KEY = "kind"
    HELP = ("position signal (SPEC §1): learned (absolute position table; GPT-2), rope (rotary q, k; Huginn-0125, "
            "Ouro), none (the causal mask only)")


LearnedPositionConfig = _variant(PositionConfig, "LearnedPositionConfig", NAME="learned")


@dataclass(frozen=True)
class RopeConfig(PositionConfig):
    """``rope``: the rotary embedding of q and k in every attention layer (arXiv:2104.09864)."""

    NAME = "rope"
    theta: float = _f(10000.0, "base θ of the frequencies θ^(−2i/head_dim) (HF rope_theta; Huginn-0125 5e4, Ouro 1e6)")
    layout: RopeLayout = _f("half", "rotated pairs: half ((i, i + head_dim/2): HF Llama, Ouro) or interleaved "
                            "((2i, 2i+1): Huginn-0125)")
    scaling: RopeScaling = _f("none", "none, or linear (frequencies divided by scaling_factor; HF rope_type linear)")
    scaling_factor: float = _f(1.0, "scaling=linear: the factor (> 0); 1 otherwise")
    table_dtype: DType = _f("float32", "dtype the cos/sin table is rounded to before the float32 rotation (bfloat16: "
                            "Huginn-0125's stored table)")

    def validate(self) -> None:
        self.require(self.theta > 1.0, "theta", f"must be > 1, got {self.theta}")
        if self.scaling == "none":
            self.require(self.scaling_factor == 1.0, "scaling_factor",
                         f"read only by scaling=linear; leave it at 1, got {self.scaling_factor}")
        else:
            self.require(self.scaling_factor > 0, "scaling_factor", f"must be > 0, got {self.scaling_factor}")


NoPositionConfig = _variant(PositionConfig, "NoPositionConfig", NAME="none")


# ---------------------------------------------------------------- scale control (SPEC §4)
@dataclass(frozen=True)
class ScaleControlConfig(ChoiceSection):
    """The scale control applied to the state between loops (SPEC §4), ``model.scale_control.kind``."""

    _prefix = "model.scale_control."
    KEY = "kind"
    HELP = ("between loops (SPEC §4): none, inter_loop_norm (RMSNorm, learned gain), spectral_damping (learned "
            "factor in (0, 1)), final_norm (h ← norm_f(h); Ouro; pair with model.readout=raw)")


NoScaleControlConfig = _variant(ScaleControlConfig, "NoScaleControlConfig", NAME="none")
InterLoopNormConfig = _variant(ScaleControlConfig, "InterLoopNormConfig", NAME="inter_loop_norm")


@dataclass(frozen=True)
class SpectralDampingConfig(ScaleControlConfig):
    """``spectral_damping``: h ← σ(ρ)·h after every step, ρ learned."""

    NAME = "spectral_damping"
    init: Annotated[float, Range(0.0, strict=True, below=1.0)] = _f(0.9, "initial factor σ(ρ) in (0, 1)")


FinalNormConfig = _variant(ScaleControlConfig, "FinalNormConfig", NAME="final_norm")


@dataclass(frozen=True)
class ModelConfig(_Base):
    """Shape and recurrence rule of a looped (or unshared reference) language model (SPEC §1–2)."""

    _prefix = "model."
    architecture: Architecture = _f("shared", "shared: prelude + core×T + coda; unshared: n_layers distinct blocks")
    rule: RuleName = _f("scse", "recurrence rule (SPEC §2): " + ", ".join(RULE_NAMES))
    options: RuleOptions | None = _f(None, "the rule's options (model.options.FIELD); None when unshared")
    vocab_size: PositiveInt = _f(50257, "vocabulary size V (set from the tokenizer when training)")
    d_model: PositiveInt = _f(384, "model width d")
    n_heads: PositiveInt = _f(6, "attention heads (d_model must be divisible by it)")
    d_ff: PositiveInt = _f(1536, "SwiGLU hidden width")
    seq_len: PositiveInt = _f(128, "context length L (the longest sequence of any forward)")
    dropout: Fraction = _f(0.1, "dropout probability on embeddings, attention and residual branches")
    n_prelude: NonNegInt = _f(0, "unshared prelude blocks before the loop")
    n_core: PositiveInt = _f(1, "K: blocks in the shared core applied once per loop step")
    n_coda: NonNegInt = _f(0, "unshared coda blocks after the loop")
    n_layers: PositiveInt = _f(4, "unshared architecture only: number of distinct blocks")
    tie_embeddings: bool = _f(True, "tie the readout W_out to the token embedding")
    norm_eps: PositiveFloat = _f(1e-6, "RMSNorm epsilon")
    init_std: PositiveFloat = _f(0.02, "std of the normal initialization of linear and embedding weights")
    block_init: BlockInit = _f("normal", "post-LN family: block matrix init before β: normal or xavier_normal "
                               "(per q, k, v, gate, up; DeepNet arXiv:2203.00555)")
    embed_init_std: float = _f(-1.0, "std of the token/position embedding init; -1 = init_std (GPT-2)")
    residual: Residual = _f("pre_ln", "residual (SPEC §3): pre_ln, or x ← RMSNorm(α·x + f(x)), α=(2N)^p, β=(8N)^-p, "
                            "N=K·R: post_ln (p=0), deepnorm (p=1/4), deeploop (p=1/2)")
    residual_p: float = _f(-1.0, "post-LN family: exponent p; -1 takes the family's")
    residual_depth: NonNegInt = _f(0, "post-LN family: R in N = K·R (0 = the depth sampler's maximum, resolved by "
                                   "build_model)")
    input_norm: bool = _f(False, "RMSNorm on the input embedding e (the DeepLoop baseline)")
    readout: ReadoutName = _f("rmsnorm", "readout at loop k (SPEC §4): rmsnorm (W_out·RMSNorm(H_k)), raw, "
                              "final_only_norm (RMSNorm at the last loop only)")
    scale_control: ScaleControlConfig = field(default_factory=NoScaleControlConfig)
    exit_gate: bool = _f(False, "a learned exit gate (Linear d→1 per token and loop; Ouro), for "
                         "supervision=exit_weighted and the exit criteria exit_gate / exit_cdf")
    position: PositionConfig = field(default_factory=LearnedPositionConfig)
    n_kv_heads: NonNegInt = _f(0, "key/value heads (grouped-query attention); 0 = n_heads")
    qk_bias: bool = _f(False, "a learned bias on the q and k projections, zero-initialized (Huginn-0125)")
    block_norm: BlockNorm = _f("pre", "norms in every block (residual=pre_ln): pre (x + f(N(x))), sandwich "
                               "(x + N'(f(N(x))); Ouro), pre_post (x ← N'(x + f(N(x))); Huginn-0125)")
    embed_scale: PositiveFloat = _f(1.0, "factor on the token embedding, not the tied readout (Huginn-0125: √d)")
    exit_norm: ExitNorm = _f("none", "an RMSNorm of h_T before the coda: none, learned, final (norm_f; Huginn-0125)")

    def validate(self) -> None:
        self.require(self.d_model % self.n_heads == 0, "n_heads",
                     f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        self.require(self.embed_init_std == -1.0 or self.embed_init_std > 0, "embed_init_std",
                     f"must be > 0, or -1 (init_std), got {self.embed_init_std}")
        self.require(self.residual_p == -1.0 or 0.0 <= self.residual_p <= 2.0, "residual_p",
                     f"must be in [0, 2] or -1 (family default), got {self.residual_p}")
        self.require(self.block_init == "normal" or self.residual != "pre_ln", "block_init",
                     "xavier_normal is the post-LN family's base initializer; allowed with residual=pre_ln: 'normal'")
        self.require(self.n_heads % self.kv_heads == 0, "n_kv_heads",
                     f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}")
        if self.position.NAME == "rope":
            self.require(self.head_dim % 2 == 0, "position.kind",
                         f"rope rotates pairs of coordinates; head_dim = d_model / n_heads = {self.head_dim} must be "
                         "even")
        self.require(self.block_norm == "pre" or self.residual == "pre_ln", "block_norm",
                     f"{self.block_norm} blocks have their own norm placement; allowed with residual={self.residual}: "
                     "pre")
        self._resolve_options()
        if self.architecture == "unshared":
            self.require(self.residual == "pre_ln", "residual", "the unshared reference supports pre_ln only")
            self.require(self.scale_control.NAME == "none", "scale_control.kind",
                         "the unshared reference has no loop to control; allowed: none")
            self.require(not self.exit_gate, "exit_gate", "exit gates need the shared architecture; allowed: false")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def qkv_width(self) -> int:
        """Rows of the fused Q/K/V projection: (n_heads + 2·kv_heads)·head_dim (3·d_model without GQA)."""
        return (self.n_heads + 2 * self.kv_heads) * self.head_dim

    @property
    def resolved_residual_p(self) -> float:
        """The exponent p of α = (2N)^p, β = (8N)^-p (SPEC §3)."""
        return RESIDUAL_P[self.residual] if self.residual_p == -1.0 else self.residual_p

    @property
    def residual_alpha_beta(self) -> tuple[float, float]:
        """(α, β) of the post-LN family with N = n_core · residual_depth (SPEC §3); (1, 1) for pre_ln (ConfigError:
        a post-LN model with residual_depth 0)."""
        if self.residual == "pre_ln":
            return 1.0, 1.0
        self.require(self.residual_depth >= 1, "residual_depth",
                     "must be >= 1 for a post-LN family model (set it, or build the model from a full Config)")
        n = self.n_core * self.residual_depth
        p = self.resolved_residual_p
        return (2.0 * n) ** p, (8.0 * n) ** (-p)

    def _resolve_options(self) -> None:
        """Turn ``options`` into the rule's options object (None → defaults, dict → fields)."""
        opts, cls = self.options, RULE_OPTIONS[self.rule]
        if self.architecture == "unshared":
            self.require(opts is None or opts == {}, "options",
                         f"the unshared architecture has no rule options; got {opts!r}")
            opts = None
        elif opts is None or isinstance(opts, dict):
            opts = _options_from_dict(self.rule, opts or {}, complete=False)
        elif type(opts) is not cls:
            raise ConfigError(f"{self._prefix}options: {type(opts).__name__} holds the options of "
                              f"{', '.join(_rules_of(type(opts))) or 'no rule'}; rule {self.rule} takes {cls.__name__}")
        object.__setattr__(self, "options", opts)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a complete ``model`` dict, options and choice sections too (ConfigError otherwise)."""
        cls._check_keys(d)
        if d["architecture"] == "shared" and d["rule"] in RULE_OPTIONS:
            _check(isinstance(d["options"], dict), "model.options",
                   f"must be a JSON object of the options of rule {d['rule']}, got {d['options']!r}")
            d = {**d, "options": _options_from_dict(d["rule"], d["options"], complete=True)}
        return super().from_dict(d)

    def replace(self, **changes: Any) -> "ModelConfig":
        """``dataclasses.replace``; a new rule or architecture carries the options over (:func:`carry_options`)."""
        if ("rule" in changes or "architecture" in changes) and "options" not in changes:
            changes["options"] = carry_options(self, changes.get("rule", self.rule),
                                               changes.get("architecture", self.architecture))
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class DataConfig(_Base):
    """Where the training and evaluation text comes from (SPEC §5, §11)."""

    _prefix = "data."
    dataset: DatasetName = _f("brown", "training corpus: brown (SPEC §11 split), wikitext2, wikitext103, text (see "
                              "text_files), openwebtext or c4 (SPEC §5, online), hf (see hf_path), task (synthetic, "
                              "loss on the answer tokens)")
    text_files: list = _f([], "dataset=text: [train, valid, test] plain-text file paths")
    hf_path: str = _f("", "dataset=hf: a local .json/.jsonl/.parquet/.txt file or folder, else a hub dataset id")
    hf_name: str = _f("", "dataset=hf: the dataset config (name) on the hub; empty = the default")
    hf_splits: list = _f(["train", "validation", "test"], "dataset=hf: the [train, valid, test] split specs "
                         "(slicing allowed)")
    text_column: str = _f("text", "dataset=hf: the column holding each document's text")
    task: TaskName = _f("phop", "dataset=task: the task family (looplm.tasks)")
    task_k: int = _f(4, "dataset=task: train on difficulties k = 1 … task_k (uniform)")
    task_heldout: int = _f(256, "dataset=task: held-out instances per k in each of valid and test")
    task_seed: int = _f(0, "dataset=task: seed of the held-out sets and of the training instances")
    tokenizer: TokenizerName = _f("gpt2", "gpt2 (GPT-2 BPE) or bpe (byte-level BPE trained on the training split)")
    bpe_vocab_size: int = _f(8192, "tokenizer=bpe: vocabulary size")
    data_root: str = _f("", "data root; empty = $LOOPLM_DATA, else shared/data beside the repo folder, else ./data")
    cache_dir: str = _f("", "token cache; empty = $LOOPLM_CACHE, else ~/.cache/looplm")

    def validate(self) -> None:
        self.require(self.bpe_vocab_size >= 260, "bpe_vocab_size", "must be >= 260")
        if self.dataset == "text":
            self.require(len(self.text_files) == 3, "text_files",
                         "dataset=text needs three paths: train, valid, test")
        self.require(isinstance(self.hf_splits, list) and len(self.hf_splits) == 3
                     and all(isinstance(x, str) and x.strip() for x in self.hf_splits), "hf_splits",
                     f"must be three split specs (train, valid, test), e.g. train,validation,test or "
                     f"train[:90%],train[90%:95%],train[95%:]; got {self.hf_splits!r}")
        if self.dataset == "hf":
            self.require(bool(self.hf_path.strip()), "hf_path",
                         "dataset=hf needs a hub dataset id or a local json/jsonl/parquet/text file or folder")
            self.require(bool(self.text_column.strip()), "text_column", "must name a column")
        if self.dataset == "task":
            for name in ("task_k", "task_heldout"):
                self.require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        else:
            for name in ("task", "task_k", "task_heldout", "task_seed"):
                self.require(getattr(self, name) == DataConfig.__dataclass_fields__[name].default, name,
                             f"only read with data.dataset=task (dataset is {self.dataset})")


# ---------------------------------------------------------------- depth sampler (SPEC §5)
@dataclass(frozen=True)
class DepthConfig(ChoiceSection):
    """The training depth sampler (SPEC §5), one draw per microbatch (``depth.sampler``)."""

    _prefix = "depth."
    KEY = "sampler"
    HELP = ("training depth sampler (SPEC §5), one draw per microbatch: fixed, uniform (lo..hi), pln (Poisson "
            "log-normal) or learned (categorical prior trained by REINFORCE)")

    def nominal_depth(self) -> int:
        """The depth a trained model stands for (default K_max of halting; final_only_norm's last loop)."""
        return self.max_depth()


@dataclass(frozen=True)
class FixedDepthConfig(DepthConfig):
    """``fixed``: every microbatch at depth T."""

    NAME = "fixed"
    depth: PositiveInt = _f(8, "loop depth T")

    def max_depth(self) -> int:
        return self.depth


@dataclass(frozen=True)
class UniformDepthConfig(DepthConfig):
    """``uniform``: T uniform in lo..hi (inclusive)."""

    NAME = "uniform"
    lo: PositiveInt = _f(1, "lowest depth")
    hi: int = _f(8, "highest depth")

    def validate(self) -> None:
        self.require(self.lo <= self.hi, "hi", f"must be >= depth.lo={self.lo}, got {self.hi}")

    def max_depth(self) -> int:
        return self.hi


@dataclass(frozen=True)
class PLNDepthConfig(DepthConfig):
    """``pln``: Poisson log-normal depths min(R, cap), R ~ Poisson(exp ξ), ξ ~ N(μ, σ²) with μ set so that
    E[min(R, cap)] = mean (LMDR §3.1)."""

    NAME = "pln"
    mean: float = _f(5.0, "pln: target mean E[min(R, cap)]; learned: budget target R̄ (and the init's mean)")
    sigma: PositiveFloat = _f(0.5, "σ of ξ ~ N(μ, σ²) (learned: of the PLN initialization)")
    cap: Annotated[int, Range(2)] = _f(64, "pln: cap on R; learned: R_max")

    def validate(self) -> None:
        self.require(1 <= self.mean < self.cap, "mean", f"must be in [1, depth.cap={self.cap}), got {self.mean}")

    def max_depth(self) -> int:
        return self.cap

    def nominal_depth(self) -> int:
        return int(math.ceil(self.mean))


@dataclass(frozen=True)
class LearnedDepthConfig(PLNDepthConfig):
    """``learned``: a categorical prior over 1..cap trained by REINFORCE (LMDR §3.1, App. B.3)."""

    NAME = "learned"
    lr: PositiveFloat = _f(1e-3, "Adam learning rate of the prior logits")
    entropy: NonNegFloat = _f(0.01, "entropy weight λ_H")
    budget: NonNegFloat = _f(1.0, "budget weight λ_m of (E_p[R] − R̄)²")
    warmup: NonNegInt = _f(32, "warm-up updates that only collect the reward baseline")
    init: list = _f([], "initial prior weights over depths 1..cap (normalized; [] = the capped PLN); LMDR App. B.3")
    reward: PriorReward = _f("neg_ce", "reward: neg_ce (−CE), log_ce (−log CE), exp_ce (−exp(CE)), inv_ppl (exp(−CE); "
                             "LMDR's main setting, with scale)")
    scale: bool = _f(False, "multiply the advantage by s = std(CE)/std(reward) of the previous updates (LMDR App. B.3)")
    scale_window: PositiveInt = _f(1, "scale: s pools the microbatches of the last W updates")

    def validate(self) -> None:
        super().validate()
        w = self.init
        self.require(isinstance(w, list), "init", f"must be a list of numbers, got {w!r}")
        if not w:
            return
        self.require(len(w) == self.cap, "init", f"needs depth.cap={self.cap} weights, got {len(w)}")
        try:  # command-line lists arrive as strings
            vals = [float(v) for v in w if not isinstance(v, bool)]
        except (TypeError, ValueError):
            vals = []
        self.require(len(vals) == len(w) and all(math.isfinite(v) and v > 0 for v in vals), "init",
                     f"weights must be finite numbers > 0, got {w!r}")
        object.__setattr__(self, "init", vals)



# ---------------------------------------------------------------- gradient estimator (SPEC §5)
@dataclass(frozen=True)
class GradientConfig(ChoiceSection):
    """The gradient estimator (SPEC §5; LMDR §3.1, A.2) of :class:`looplm.model.cursor.Gradient`."""

    _prefix = "train.gradient."
    KEY = "kind"
    HELP = ("gradient estimator (SPEC §5; LMDR §3.1, A.2): bptt (full), tbptt (the last b = steps recurrences), "
            "endpoint (Neumann-b: b more recurrences from sg(z^T), loss read at T+b)")
    steps: ClassVar[int] = 0


BPTTConfig = _variant(GradientConfig, "BPTTConfig", NAME="bptt")


@dataclass(frozen=True)
class TBPTTConfig(GradientConfig):
    """``tbptt``: the last b of the T recurrences with gradient, from the visited state z^(T−b)."""

    NAME = "tbptt"
    steps: int = _f(1, "b: recurrences with gradient (>= 1)")

    def validate(self) -> None:
        self.require(self.steps >= 1, "steps", f"{self.NAME} needs b >= 1, got {self.steps}")


EndpointConfig = _variant(TBPTTConfig, "EndpointConfig", NAME="endpoint")  # Neumann-b: the loss read at T + b


# ---------------------------------------------------------------- optimizer (SPEC §5)
@dataclass(frozen=True)
class OptimConfig(_Base):
    """AdamW and its learning-rate schedule (SPEC §5); one section shared by train, distill and rl."""

    _prefix = "optim."
    lr: PositiveFloat = _f(3e-4, "peak learning rate")
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of lr (cosine floor)")
    warmup_steps: NonNegInt = _f(500, "linear warm-up steps")
    schedule: Schedule = _f("cosine", "schedule after the warm-up (SPEC §5): cosine (to min_lr_ratio·lr) or wsd "
                            "(LMDR: constant, then cosine over the last tenth of the steps)")
    weight_decay: NonNegFloat = _f(0.1, "AdamW weight decay, applied to matrices only")
    beta1: Fraction = _f(0.9, "AdamW β1")
    beta2: Fraction = _f(0.95, "AdamW β2")
    grad_clip: NonNegFloat = _f(1.0, "gradient-norm clipping threshold (0 = off)")

    def validate(self) -> None:
        self.require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")


section_field = _f  # a RunSection field: its default and its --help text


@dataclass(frozen=True)
class RunSection(_Base):
    """The config of ``distill`` / ``rl train``: own fields (``--PREFIX.FIELD``) and an ``optim`` section."""

    def with_overrides(self, overrides: dict[str, Any]):
        """This config with ``{"PREFIX.FIELD" or "optim.FIELD": value}`` applied (ConfigError for a bad key/value)."""
        d = self.to_dict()
        own = self._prefix[:-1]
        for key, value in overrides.items():
            _set_field({own: type(self), "optim": OptimConfig}, {own: d, "optim": d["optim"]}, key, value)
        return type(self).from_dict(d)


@dataclass(frozen=True)
class TrainConfig(_Base):
    """The training loop (SPEC §5): steps, batches, gradient estimator, loss, evaluation and checkpoints."""

    _prefix = "train."
    steps: PositiveInt = _f(5000, "optimizer steps")
    batch_size: PositiveInt = _f(32, "sequences per microbatch")
    grad_accum: PositiveInt = _f(1, "microbatches per optimizer step")
    gradient: GradientConfig = field(default_factory=BPTTConfig)
    supervision: Supervision = _f("terminal", "loss (SPEC §4): terminal (CE at the last loop), per_loop "
                                  "(mean CE over loops 1..T), exit_weighted (learned exit gate weights the "
                                  "per-loop CE, plus an entropy term)")
    exit_entropy: NonNegFloat = _f(0.05, "exit_weighted: weight of the exit-distribution entropy bonus")
    norm_penalty: NonNegFloat = _f(0.0, "λ of the scale penalty λ·T⁻¹ Σ_k mean_tokens ‖H_k‖²_rms (0 = off)")
    seed: int = _f(0, "seed for initialization, data order and depth draws")
    eval_every: NonNegInt = _f(500, "validate every this many steps (0 = only at the end)")
    eval_batches: PositiveInt = _f(20, "validation batches per periodic validation")
    eval_depth: PositiveInt = _f(8, "loop depth used for periodic validation")
    ckpt_every: NonNegInt = _f(500, "write a checkpoint every this many steps (0 = only at the end)")
    checkpoint_format: CheckpointFormat = _f("consolidated", "consolidated (rank 0 writes model.safetensors) or "
                                             "sharded (every rank writes its shards; a shared filesystem)")
    device: Device = _f("auto", "cpu, cuda, or auto (cuda when available)")
    dtype: DType = _f("float32", "autocast dtype for forward/backward (bfloat16 on GPU)")
    num_threads: NonNegInt = _f(0, "torch CPU threads (0 = torch default)")
    distributed: Parallel = _f("ddp", "under torchrun: ddp or fsdp (FSDP2 per block); batch_size is the global batch")
    compile: bool = _f(False, "torch.compile each block (a new loop depth does not recompile)")
    max_nonfinite_steps: PositiveInt = _f(5, "stop after this many consecutive skipped steps with a non-finite loss or "
                                          "gradient norm")
    logger: list = _f(["jsonl"], "metric loggers (comma-separated): jsonl (always), tensorboard, wandb (offline "
                      "unless WANDB_MODE), trackio; the optional ones need their extra")

    def validate(self) -> None:
        names = self.logger
        if isinstance(names, str):
            names = [s.strip() for s in names.split(",") if s.strip()]
        self.require(isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names), "logger",
                     f"must be a list of names or a comma-separated string, got {self.logger!r}")
        for n in names:
            self.require(n in LOGGER_NAMES, "logger",
                         f"unknown logger {n!r}{suggest(n, LOGGER_NAMES)}; allowed: {', '.join(LOGGER_NAMES)}")
        self.require(len(set(names)) == len(names), "logger", f"a logger is named twice in {list(names)!r}")
        # canonical form: jsonl first (always written), then the others in the order given
        object.__setattr__(self, "logger", ["jsonl", *(n for n in names if n != "jsonl")])


@dataclass(frozen=True)
class Config(_Base):
    """A whole run: model, data, depth sampler, optimizer and training loop (serialized as ``config.json``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    depth: DepthConfig = field(default_factory=UniformDepthConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    name: str = "run"
    _key_kind = "section"

    def validate(self) -> None:
        sup = self.train.supervision
        if self.model.architecture == "unshared":
            _check(sup != "exit_weighted", "train.supervision",
                   "exit_weighted needs learned exit gates, which only the shared architecture has; "
                   "allowed for model.architecture=unshared: terminal, per_loop")
        _check(sup != "exit_weighted" or self.model.exit_gate, "train.supervision",
               "exit_weighted needs model.exit_gate=true (the learned exit gate it trains)")

    def to_dict(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, "name": self.name, **super().to_dict()}  # name second, as in files

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        """Build from a complete ``config.json`` dict (ConfigError names a bad, unknown or missing key)."""
        d = dict(d)
        _check("format_version" in d, "format_version",
               f"missing; a config file states its format ({FORMAT_VERSION})")
        version = d.pop("format_version")
        _check(version == FORMAT_VERSION, "format_version",
               f"this looplm reads version {FORMAT_VERSION}, got {version!r}")
        return super().from_dict(d)


assert set(RULE_OPTIONS) == set(RULE_NAMES), "RULE_OPTIONS must name the options class of every rule"


def _set_field(sections: dict[str, type], d: dict[str, Any], key: str, value: Any) -> None:
    """``d[section][field] = value`` (parsed) for ``key = "section.field"`` of the ``{section: class}`` (ConfigError:
    an unknown section or field, a section set whole, a bad string)."""
    section, _, name = key.partition(".")
    if section not in sections:
        raise _unknown(section, "section", sections)
    cls = sections[section]
    whole = _sections(cls).get(name, RuleOptions if key == "model.options" else None)
    if whole is not None:
        raise ConfigError(f"{key}: set its fields one at a time, as {whole._prefix}FIELD")
    if name not in cls.field_names():
        raise _unknown(key, "field", cls.field_names())
    d[section][name] = _parse(typing.get_type_hints(cls)[name], key, value)


def _parse(tp: Any, key: str, text: Any) -> Any:
    """Parse a command-line string as type ``tp`` (bool, int, float, list, or a string name); other values pass."""
    if not isinstance(text, str):
        return text
    try:
        if tp is bool:
            low = text.lower()
            if low not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise ValueError(text)
            return low in ("true", "1", "yes", "on")
        if tp in (int, float):
            return tp(text)
        if tp is list or typing.get_origin(tp) is list:
            return [s for s in text.split(",") if s] if not text.startswith("[") else json.loads(text)
        return text
    except ValueError:
        raise ConfigError(f"{key}: cannot parse {text!r} as {getattr(tp, '__name__', tp)}") from None


def _parsed(cls: type, prefix: str, d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with its strings parsed as the types of ``cls``'s fields (names it does not have are kept as they are)."""
    hints = typing.get_type_hints(cls)
    return {k: _parse(hints[k], prefix + k, v) if k in hints else v for k, v in d.items()}


def apply_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """``cfg`` with ``{"section.field": value}`` overrides applied (strings parsed) and re-validated.

    Keys: ``section.field``, ``name``, ``model.options.FIELD`` and choice-section fields (``depth.FIELD``,
    ``train.gradient.FIELD``, ...) of the resulting rule or variant, which carries same-named fields over. Raises
    ConfigError for an unknown key, an option or field the chosen rule or variant lacks, or a bad value.
    """
    d = cfg.to_dict()
    choices = {"depth": cfg.depth, "train.gradient": cfg.train.gradient, "model.position": cfg.model.position,
               "model.scale_control": cfg.model.scale_control}
    given: dict[str, dict[str, Any]] = {where: {} for where in [*choices, "model.options"]}
    for key, value in overrides.items():
        where, _, name = key.rpartition(".")
        if key == "name":
            d["name"] = str(value)
        elif where in given:
            given[where][name] = value
        else:
            _set_field(_sections(Config), d, key, value)
    options = given.pop("model.options")
    for where, carry in choices.items():
        section, _, name = where.rpartition(".")
        (d[section] if section else d)[name] = build_choice(type(carry), given[where], carry=carry).to_dict()
    m = d["model"]
    if (m["rule"], m["architecture"]) != (cfg.model.rule, cfg.model.architecture):
        carried = carry_options(cfg.model, m["rule"], m["architecture"])
        m["options"] = None if carried is None else dataclasses.asdict(RULE_OPTIONS[m["rule"]](**carried))
    if options:
        _check(m["architecture"] != "unshared", f"model.options.{next(iter(options))}",
               "the unshared architecture has no rule options")
        parsed = _parsed(options_class(m["rule"]), "model.options.", options)
        m["options"] = _options_from_dict(m["rule"], {**(m["options"] or {}), **parsed}, complete=False).to_dict()
    return Config.from_dict(d)

