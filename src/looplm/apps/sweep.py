'''Sweeps (``looplm sweep FILE.toml``): train and evaluate a grid of runs, resumably, into one results DB::

    # scse-vs-looped.toml
    name = "scse-vs-looped"     # default: the file name
    seeds = [0, 1, 2]           # train.seed values; default [0, 1, 2]
    baseline = "looped"         # the report's paired deltas compare with it; default: the first variant
    [base]
    preset = "cpu"              # or config = "path/config.json"
    "train.steps" = 400         # any config field as "section.field" = value, or a TOML dotted key
    [variants]                  # name → config overrides on top of the base
    looped = {"model.rule" = "looped"}
    scse = {"model.rule" = "scse"}
    unshared = {"model.architecture" = "unshared", "model.n_layers" = 4}
    [grid]                      # optional: every combination is a separate run
    "optim.lr" = [1e-3, 2e-3]
    [eval]                      # also splits, stride, batch_size, tag, device (EVAL_KEYS)
    depths = [1, 2, 4, 8, 16, 32, 48]        # default 1,2,4,8,12,16,24,32,48
    datasets = ["brown", "wikitext2"]        # default: the training corpus
    max_tokens = 16384                       # default: the whole split
    diagnose = true                          # hooks (HOOKS): true, or their keyword arguments
    lambada = {max_examples = 500}
    kv_sharing = {depths = [5]}              # terminal KV sharing at recurrences R
    tasks = {split = "test"}                 # data.dataset = "task" runs (no ppl): exact match by depth × k;
                                             # halting = {criterion = "hidden_update", target_depth = 4}

The grid is variants × seeds × grid points, seed-major, into ``OUT/runs/<variant>[-<field>=<value>...]-s<seed>/``,
``OUT/results.db`` and ``OUT/report/``. A run trained and evaluated for the weights on disk is skipped, a killed
one resumes, a run directory with another config raises :class:`SweepError`. ``only``, ``shard`` and
:func:`plan_sweep` split a sweep into parts that may run at once into one ``OUT`` (they write no report).
Stored protocols (depth column): ``ppl`` (T), ``diagnose`` (loop step t), ``lambada`` (T), ``kv_sharing`` (R),
``tasks`` (T; dataset ``<task>-k<k>``) and ``tasks_halting`` (the ceiling; one row per k).
'''

from __future__ import annotations

import contextlib
import importlib
import itertools
import json
import re
import time
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, get_args

from tqdm.auto import tqdm

from looplm.analysis.store import EvalIdentity, ResultStore, RunRecord, config_identity
from looplm.config import Config, ConfigError, DatasetName, apply_overrides
from looplm.run.finite import dumps
from looplm.run.provenance import weights_sha256

SWEEP_KEYS = ("name", "seeds", "baseline", "base", "variants", "grid", "eval")
BASE_KEYS = ("preset", "config")
SPLITS = ("train", "valid", "test")
DEFAULT_SEEDS = (0, 1, 2)
#: hook protocols: name → (module, function), imported only when the sweep file enables them.
HOOKS: dict[str, tuple[str, str]] = {
    "diagnose": ("looplm.diagnostics.runner", "diagnose_checkpoint"),
    "lambada": ("looplm.eval.lambada", "evaluate_lambada_checkpoint"),
    "kv_sharing": ("looplm.eval.kvsharing", "evaluate_kv_sharing_checkpoint"),
    "tasks": ("looplm.eval.tasks", "evaluate_task_checkpoint"),
}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class SweepError(ValueError):
    """A sweep file or a sweep's run directory is not usable; the message names the key or path."""


@dataclass(frozen=True)
class EvalProtocol:
    """The ``[eval]`` table: what every trained run is evaluated on."""

    depths: tuple[int, ...]
    datasets: tuple[str, ...] = ()  # empty: the training corpus of each run
    splits: tuple[str, ...] = ("test",)
    max_tokens: int | None = None
    stride: int | None = None
    batch_size: int = 16
    tag: str = ""
    device: str = "auto"
    # the hooks (HOOKS): keyword arguments of each; None = off (kv_sharing's own ``depths`` default [5])
    diagnose: dict[str, Any] | None = None
    lambada: dict[str, Any] | None = None
    kv_sharing: dict[str, Any] | None = None
    tasks: dict[str, Any] | None = None

    def ppl_datasets(self, data) -> tuple[str, ...]:
        """``datasets``, else the training corpus (none for a synthetic task: the ``tasks`` hook scores it)."""
        return self.datasets or (() if data.dataset == "task" else (data.dataset,))


EVAL_KEYS = tuple(f.name for f in fields(EvalProtocol))


@dataclass(frozen=True)
class RunSpec:
    """One run of the grid: its id, variant, seed, grid point and full config."""

    run_id: str
    variant: str
    variant_order: int
    seed: int
    grid: dict[str, Any]
    config: Config


@dataclass(frozen=True)
class Sweep:
    """A parsed sweep file (see the module docstring for the format)."""

    name: str
    base: Config
    variants: dict[str, dict[str, Any]]
    seeds: tuple[int, ...]
    eval: EvalProtocol
    grid: dict[str, list] = field(default_factory=dict)
    baseline: str = ""

    def runs(self) -> list[RunSpec]:
        """Every run, seed-major: for seed, for grid point, for variant. Raises SweepError on a bad override."""
        keys = list(self.grid)
        points = [dict(zip(keys, values)) for values in itertools.product(*(self.grid[k] for k in keys))]
        out = []
        for seed, point, (order, (variant, overrides)) in itertools.product(self.seeds, points,
                                                                             enumerate(self.variants.items())):
            run_id = "-".join([variant, *(f"{k}={_value_text(v)}" for k, v in point.items()), f"s{seed}"])
            try:
                cfg = apply_overrides(self.base, {**overrides, **point})
            except ConfigError as exc:
                raise SweepError(f"variants.{variant}: {exc}") from None
            cfg = cfg.replace(name=run_id, train=cfg.train.replace(seed=seed))
            out.append(RunSpec(run_id=run_id, variant=variant, variant_order=order, seed=seed, grid=point, config=cfg))
        return out


def _value_text(v: Any) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", json.dumps(v) if not isinstance(v, str) else v)


def _flatten(d: Mapping[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
    """``{"model": {"rule": "x"}}`` and ``{"model.rule": "x"}`` → ``{"model.rule": "x"}``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = prefix + k
        if isinstance(v, dict):
            out.update(_flatten(v, where, key + "."))
        else:
            out[key] = v
    for key in out:
        if key == "name" or key == "train.seed":
            what = "run names are the run ids" if key == "name" else "list the seeds in the top-level `seeds`"
            raise SweepError(f"{where}.{key}: not allowed here ({what})")
        if "." not in key:
            raise SweepError(f"{where}.{key}: expected a config field as \"section.field\" "
                             "(sections: model, data, train)")
    return out


def _check_keys(d: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    if unknown := [k for k in d if k not in allowed]:
        raise SweepError(f"{where}{unknown[0]}: unknown key; allowed: {', '.join(allowed)}")


def _int_list(value: Any, where: str, *, min_value: int = 0) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, int) and not isinstance(v, bool)
                                                             and v >= min_value for v in value):
        raise SweepError(f"{where}: expected a non-empty list of integers >= {min_value}, got {value!r}")
    if len(set(value)) != len(value):
        raise SweepError(f"{where}: duplicate values in {value!r}")
    return tuple(value)


def _str_list(value: Any, where: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise SweepError(f"{where}: expected a non-empty list of strings, got {value!r}")
    if bad := [v for v in value if v not in allowed]:
        raise SweepError(f"{where}: {bad[0]!r} is not allowed; allowed: {', '.join(allowed)}")
    return tuple(value)


def _hook_kwargs(name: str, value: Any, depths: tuple[int, ...]) -> dict[str, Any] | None:
    """``eval.<name>`` of a hook: true (its defaults), false (off) or a table of its keyword arguments, less the
    ones the sweep sets. ``kv_sharing``'s ``depths`` (the recurrences R, default [5]) is its own; ``tasks``'
    ``halting`` table is checked here (a bad one fails at parse)."""
    where = f"eval.{name}"
    if value is False:
        return None
    if value is not True and not isinstance(value, dict):
        raise SweepError(f"{where}: expected true, false or a table of keyword arguments, got {value!r}")
    kwargs = {} if value is True else dict(value)
    own = ("depths",) if name == "kv_sharing" else ()
    if reserved := [k for k in kwargs if k in ("checkpoint", "depths", "out_dir", "progress") and k not in own]:
        raise SweepError(f"{where}.{reserved[0]}: set by the sweep; remove it")
    if name == "kv_sharing":
        kwargs = {"depths": list(_int_list(kwargs.pop("depths", [5]), f"{where}.depths", min_value=1)), **kwargs}
    if name == "tasks" and "halting" in kwargs:
        from looplm.eval.tasks import check_halting

        try:
            check_halting(kwargs["halting"], depths[-1])
        except ValueError as e:
            raise SweepError(f"{where}.{e}") from None
    return kwargs


def _positive_int(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SweepError(f"{where}: expected an integer >= 1, got {value!r}")
    return value


def parse_eval(d: Mapping[str, Any]) -> EvalProtocol:
    """Parse the ``[eval]`` table. Raises :class:`SweepError` naming the bad key."""
    from looplm.eval.perplexity import DEFAULT_DEPTHS

    if not isinstance(d, dict):
        raise SweepError(f"eval: expected a table, got {d!r}")
    _check_keys(d, EVAL_KEYS, "eval.")
    tag = d.get("tag", "")
    if not isinstance(tag, str):
        raise SweepError(f"eval.tag: expected a string, got {tag!r}")
    device = d.get("device", "auto")
    if device not in ("cpu", "cuda", "auto"):
        raise SweepError(f"eval.device: {device!r} is not allowed; allowed: cpu, cuda, auto")
    max_tokens = d.get("max_tokens")
    depths = tuple(sorted(_int_list(d.get("depths", list(DEFAULT_DEPTHS)), "eval.depths")))
    return EvalProtocol(
        depths=depths,
        datasets=_str_list(d["datasets"], "eval.datasets", get_args(DatasetName)) if "datasets" in d else (),
        splits=_str_list(d.get("splits", ["test"]), "eval.splits", SPLITS),
        max_tokens=None if max_tokens in (None, 0) else _positive_int(max_tokens, "eval.max_tokens"),
        stride=_positive_int(d["stride"], "eval.stride") if "stride" in d else None,
        batch_size=_positive_int(d.get("batch_size", 16), "eval.batch_size"),
        tag=tag, device=device,
        **{name: _hook_kwargs(name, d.get(name, False), depths) for name in HOOKS})


def parse_sweep(d: Mapping[str, Any], *, name: str = "sweep", root: str | Path = ".") -> Sweep:
    """Build a :class:`Sweep` from parsed TOML and validate every run's config (SweepError names the key).

    ``name``: default sweep name (the file stem); ``root``: the folder ``base.config`` is relative to.
    """
    from looplm.presets import PRESETS

    _check_keys(d, SWEEP_KEYS, "")
    name = d.get("name", name)
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise SweepError(f"name: expected letters, digits, '_', '.', '-', got {name!r}")
    base_d = d.get("base", {})
    if not isinstance(base_d, dict):
        raise SweepError(f"base: expected a table, got {base_d!r}")
    if "preset" in base_d and "config" in base_d:
        raise SweepError("base: give either preset or config, not both")
    if "config" in base_d:
        path = Path(root) / base_d["config"]
        if not path.is_file():
            raise SweepError(f"base.config: {path} does not exist")
        try:
            base = Config.from_json(path.read_text())
        except (ConfigError, json.JSONDecodeError) as exc:
            raise SweepError(f"base.config: {path}: {exc}") from None
    else:
        preset = base_d.get("preset", "cpu")
        if preset not in PRESETS:
            raise SweepError(f"base.preset: unknown preset {preset!r}; known: {', '.join(PRESETS)}")
        base = PRESETS[preset]
    overrides = _flatten({k: v for k, v in base_d.items() if k not in BASE_KEYS}, "base")
    try:
        base = apply_overrides(base, overrides)
    except ConfigError as exc:
        raise SweepError(f"base: {exc}") from None

    variants_d = d.get("variants")
    if not isinstance(variants_d, dict) or not variants_d:
        raise SweepError("variants: expected a table of at least one variant, e.g. "
                         "looped = {\"model.rule\" = \"looped\"}")
    variants = {}
    for vname, ov in variants_d.items():
        if not _NAME_RE.match(vname):
            raise SweepError(f"variants.{vname}: a variant name may hold letters, digits, '_', '.', '-'")
        if not isinstance(ov, dict):
            raise SweepError(f"variants.{vname}: expected a table of config overrides, got {ov!r}")
        variants[vname] = _flatten(ov, f"variants.{vname}")

    grid_d = d.get("grid", {})
    if not isinstance(grid_d, dict):
        raise SweepError(f"grid: expected a table of \"section.field\" = [values], got {grid_d!r}")
    grid = {}
    for key, values in _flatten(grid_d, "grid").items():
        if not isinstance(values, list) or not values:
            raise SweepError(f"grid.{key}: expected a non-empty list of values, got {values!r}")
        grid[key] = values
    if clash := [(v, k) for v, ov in variants.items() for k in ov if k in grid]:
        raise SweepError(f"grid.{clash[0][1]}: also set by variants.{clash[0][0]}; set it in one place")

    seeds = _int_list(d.get("seeds", list(DEFAULT_SEEDS)), "seeds")
    baseline = d.get("baseline", next(iter(variants)))
    if baseline not in variants:
        raise SweepError(f"baseline: unknown variant {baseline!r}; known: {', '.join(variants)}")
    sweep = Sweep(name=name, base=base, variants=variants, seeds=seeds, eval=parse_eval(d.get("eval", {})),
                  grid=grid, baseline=baseline)
    sweep.runs()  # validate every config before anything trains
    return sweep


def load_sweep(path: str | Path) -> Sweep:
    """Read and validate a sweep file (FileNotFoundError; SweepError naming the key)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such sweep file")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise SweepError(f"{path}: not valid TOML ({exc})") from None
    try:
        return parse_sweep(data, name=path.stem if _NAME_RE.match(path.stem) else "sweep", root=path.parent)
    except SweepError as exc:
        raise SweepError(f"{path}: {exc}") from None


# -- running --------------------------------------------------------------------------------------

@dataclass
class SweepResult:
    """What :func:`run_sweep` did; per-run status: skipped, trained, resumed or evaluated (missing or stale)."""

    out: Path
    db: Path
    runs: list[dict[str, Any]] = field(default_factory=list)
    report: dict[str, Any] | None = None

    def summary(self) -> dict[str, Any]:
        return {"out": str(self.out), "db": str(self.db), "runs": len(self.runs),
                **{s: sum(r["status"] == s for r in self.runs) for s in ("trained", "resumed", "evaluated", "skipped")},
                "report": str(self.report["markdown"]) if self.report else None}


def _diff(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff(va, vb, prefix + k + ".")
        elif va != vb:
            out.append(f"{prefix}{k}: {va!r} on disk, {vb!r} in the sweep")
    return out


def _hook(name: str) -> Callable[..., dict]:
    module, fn = HOOKS[name]
    try:
        return getattr(importlib.import_module(module), fn)
    except (ImportError, AttributeError) as exc:
        raise SweepError(f"eval.{name}: needs {module}.{fn}, which is not available ({exc})") from None


def _numeric(d: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class _Runner:
    """Runs one sweep; holds the store, the data cache and the display."""

    def __init__(self, sweep: Sweep, out: Path, store: ResultStore, data: dict[str, Any], progress: bool) -> None:
        self.sweep, self.out, self.store, self.data, self.progress = sweep, out, store, data, progress
        self.ev = sweep.eval

    def log(self, msg: str) -> None:
        if self.progress:
            tqdm.write(f"[sweep {self.sweep.name} {time.strftime('%H:%M:%S')}] {msg}")

    def device(self) -> str:
        from looplm.run.dist import resolve_device

        return resolve_device(self.ev.device).type

    # -- one run ----------------------------------------------------------------------------------
    @staticmethod
    def _saved_run(spec: RunSpec, run_dir: Path, ckpt: Path) -> tuple[Config, int]:
        """(saved config, step) of ``ckpt``; SweepError when it holds another config or seed than ``spec``."""
        saved = Config.from_json((ckpt / "config.json").read_text())
        wanted = spec.config.replace(model=spec.config.model.replace(vocab_size=saved.model.vocab_size))
        diff = _diff(config_identity(saved), config_identity(wanted))
        if saved.train.seed != spec.seed:
            diff.append(f"train.seed: {saved.train.seed} on disk, {spec.seed} in the sweep")
        if diff:
            raise SweepError(f"{run_dir}: holds a run with a different config ({'; '.join(diff)}); "
                             "delete that directory or use another --out")
        return saved, int(json.loads((ckpt / "manifest.json").read_text())["step"])

    def train(self, spec: RunSpec, run_dir: Path) -> tuple[str | None, Path]:
        """Train or resume as needed. Returns (what was done or None, newest checkpoint)."""
        from looplm.run.checkpoint import newest_valid_checkpoint
        from looplm.train.trainer import prepare_data, train

        cfg, step = spec.config, 0
        ckpt = newest_valid_checkpoint(run_dir)
        if ckpt is not None:
            _, step = self._saved_run(spec, run_dir, ckpt)
            if step >= cfg.train.steps:
                return None, ckpt
        key = json.dumps(cfg.data.to_dict(), sort_keys=True)  # one prepared dataset per data config
        if key not in self.data:
            self.log(f"preparing data: {cfg.data.dataset}, tokenizer {cfg.data.tokenizer}")
            self.data[key] = prepare_data(cfg, progress=self.progress)
        self.log(f"{spec.run_id}: {f'resuming from step {step}' if ckpt else 'training'} "
                 f"({cfg.train.steps} steps)")
        train(cfg, run_dir, resume=ckpt is not None, progress=self.progress, data=self.data[key],
              overwrite=True)  # its own run folder: a run with no checkpoint starts again
        return ("resumed" if ckpt is not None else "trained"), newest_valid_checkpoint(run_dir)

    def record(self, spec: RunSpec, run_dir: Path, ckpt: Path, saved: Config) -> RunRecord:
        import torch

        from looplm.analysis.flops import flops_per_token
        from looplm.model import build_model

        with torch.device("meta"):
            params = build_model(saved).num_params()
        summary = json.loads(p.read_text()) if (p := run_dir / "summary.json").exists() else {}
        return RunRecord(sweep=self.sweep.name, run_id=spec.run_id, variant=spec.variant,
                         variant_order=spec.variant_order, grid=spec.grid, seed=spec.seed, config=saved.to_dict(),
                         run_dir=str(run_dir.resolve()), params=params,
                         flops={T: flops_per_token(saved.model, T) for T in self.ev.depths},
                         weights_sha256=weights_sha256(ckpt), summary=summary)

    def evaluate(self, spec: RunSpec, ckpt: Path, saved: Config, force: bool, dry: bool = False) -> list[str]:
        """Run every missing evaluation (all when ``force``); returns what ran (``dry``: would run)."""
        done = self._eval_ppl(ckpt, saved, force, dry)
        for protocol in ("lambada", "tasks", "kv_sharing", "diagnose"):
            if getattr(self.ev, protocol) is not None:
                done += getattr(self, f"_eval_{protocol}")(spec, ckpt, saved, force, dry)
        return done

    def _eval_ppl(self, ckpt: Path, saved: Config, force: bool, dry: bool) -> list[str]:
        done, ev = [], self.ev
        settings = {"max_tokens": ev.max_tokens, "stride": ev.stride}  # they change a perplexity: hashed
        for dataset in ev.ppl_datasets(saved.data):
            for split in ev.splits:
                idents = {T: EvalIdentity.make(saved, "ppl", dataset=dataset, split=split, depth=T,
                                               settings=settings, tag=ev.tag) for T in ev.depths}
                if not self._todo(idents, "ppl", force):
                    continue
                if dry:
                    done.append(f"ppl {dataset}/{split}")
                    continue
                from looplm.eval.runner import evaluate_checkpoint

                res = evaluate_checkpoint(ckpt, depths=ev.depths, dataset=dataset, split=split,
                                          batch_size=ev.batch_size, max_tokens=ev.max_tokens, stride=ev.stride,
                                          device=self.device(), progress=self.progress)
                self._put([(idents[T], {k: float(v) for k, v in res["depths"][str(T)].items()
                                        if k in ("ppl", "nll", "tokens")}) for T in ev.depths], saved, settings, res)
                done.append(f"ppl {dataset}/{split}: " + ", ".join(
                    f"T={T} {res['depths'][str(T)]['ppl']:.1f}" for T in ev.depths))
        return done

    def _todo(self, idents, metric: str, force: bool) -> bool:
        return force or not all(self.store.has(i, [metric]) for i in idents.values())

    def _run_hook(self, protocol: str, ckpt: Path, **settings) -> dict:
        return _hook(protocol)(ckpt, progress=self.progress, **{"device": self.device(), **settings})

    def _put(self, items: list, saved: Config, settings: dict[str, Any], res: dict[str, Any]) -> None:
        self.store.put_many(items, config=saved, settings=settings, provenance=res.get("provenance"))

    def _depth_hook(self, protocol: str, ckpt: Path, saved: Config, settings: dict[str, Any], depths: list[int], *,
                    dataset: str, split: str, metric: str, force: bool, dry: bool) -> dict[str, Any] | None:
        """Run and store hook ``protocol`` at ``depths`` unless each holds ``metric``: its result (``{}`` if dry,
        None if nothing to do)."""
        idents = {d: EvalIdentity.make(saved, protocol, dataset=dataset, split=split, depth=d, settings=settings,
                                       tag=self.ev.tag) for d in depths}
        if not self._todo(idents, metric, force):
            return None
        if dry:
            return {}
        res = self._run_hook(protocol, ckpt, depths=depths, **settings)
        self._put([(ident, _numeric(res["depths"][str(d)])) for d, ident in idents.items()], saved, settings, res)
        return res

    def _eval_lambada(self, spec: RunSpec, ckpt: Path, saved: Config, force: bool, dry: bool) -> list[str]:
        res = self._depth_hook("lambada", ckpt, saved, dict(self.ev.lambada), list(self.ev.depths), dataset="lambada",
                               split="test", metric="target_ppl", force=force, dry=dry)
        return [] if res is None else ["lambada"]

    def _eval_tasks(self, spec: RunSpec, ckpt: Path, saved: Config, force: bool, dry: bool) -> list[str]:
        if saved.data.dataset != "task":
            return []
        from looplm.eval.tasks import default_ks

        ev, settings = self.ev, dict(self.ev.tasks)
        halting = settings.pop("halting", None)  # its rows have their own protocol (tasks_halting)
        if saved.model.architecture != "shared":  # no loop to halt (a stack's steps past its blocks are identities)
            halting = None
        ks = settings.get("ks") or default_ks(saved.data)
        split = str(settings.get("split", "test"))
        idents = {(k, T): EvalIdentity.make(saved, "tasks", dataset=f"{saved.data.task}-k{k}", split=split,
                                            depth=T, settings=settings, tag=ev.tag) for k in ks for T in ev.depths}
        halt_settings = {**settings, "halting": halting}
        halt_idents = {} if halting is None else {
            k: EvalIdentity.make(saved, "tasks_halting", dataset=f"{saved.data.task}-k{k}", split=split,
                                 depth=halting.get("ceiling", ev.depths[-1]), settings=halt_settings, tag=ev.tag)
            for k in ks}
        if not self._todo({**idents, **halt_idents}, "acc", force):
            return []
        if dry:
            return ["tasks"]
        res = self._run_hook("tasks", ckpt, depths=list(ev.depths), halting=halting, **settings)
        self._put([(ident, _numeric(res["accuracy"][str(k)][str(T)])) for (k, T), ident in idents.items()],
                  saved, settings, res)
        if halting is not None:
            tau = res["halting"]["tau"]
            self._put([(ident, {**_numeric(res["halting"]["by_k"][str(k)]), "tau": tau})
                       for k, ident in halt_idents.items()], saved, halt_settings, res)
        T = ev.depths[-1]
        return [f"tasks: acc (%) at T={T} " + ", ".join(
            f"k={k} {100 * res['accuracy'][str(k)][str(T)]['acc']:.0f}" for k in ks)]

    def _eval_kv_sharing(self, spec: RunSpec, ckpt: Path, saved: Config, force: bool, dry: bool) -> list[str]:
        if saved.model.architecture != "shared":
            return []
        settings = dict(self.ev.kv_sharing)
        depths = settings.pop("depths")
        res = self._depth_hook("kv_sharing", ckpt, saved, settings, depths, force=force, dry=dry, metric="ppl_terminal",
                               dataset=str(settings.get("dataset") or saved.data.dataset),
                               split=str(settings.get("split", "test")))
        if not res:
            return [] if res is None else ["kv_sharing"]
        return ["kv_sharing: " + ", ".join(f"R={R} {res['depths'][str(R)]['sharing_penalty_pct']:+.1f}%"
                                           for R in depths)]

    def _eval_diagnose(self, spec: RunSpec, ckpt: Path, saved: Config, force: bool, dry: bool) -> list[str]:
        if saved.model.architecture != "shared":
            return []
        tag, settings = self.ev.tag, dict(self.ev.diagnose)
        probe = EvalIdentity.make(saved, "diagnose", dataset="", split="", depth=0, settings=settings, tag=tag)
        where = dict(config_hash=probe.config_hash, protocol="diagnose", protocol_hash=probe.protocol_hash,
                     seed=probe.seed, tag=tag)
        if not force and self.store.count(**where):
            return []
        if dry:
            return ["diagnose"]
        res = self._run_hook("diagnose", ckpt, out_dir=ckpt.parent.parent / "diagnose", **settings)
        dataset = str(res.get("dataset", settings.get("dataset", saved.data.dataset)))
        split = str(res.get("split", settings.get("split", "-")))
        per_t: dict[int, dict[str, float]] = {}
        for key, records in res.items():
            for rec in records if isinstance(records, list) else []:
                if isinstance(rec, dict) and "t" in rec:
                    for m, v in _numeric(rec).items():
                        if m != "t":
                            per_t.setdefault(int(rec["t"]), {})[m if m == key else f"{key}.{m}"] = v
        if force:
            self.store.delete(**where)
        items = [(replace(probe, dataset=dataset, split=split, depth=t), m) for t, m in sorted(per_t.items()) if m]
        if not items:
            raise SweepError(f"eval.diagnose: {spec.run_id}: the diagnostic returned no records with a loop step t")
        self._put(items, saved, settings, res)
        return ["diagnose"]

    def _stale(self, spec: RunSpec, sha: str | None) -> bool:
        previous = self.store.run(self.sweep.name, spec.run_id) if self.store is not None else None
        return previous is None or previous.weights_sha256 != sha

    def pending(self, spec: RunSpec) -> list[str]:
        """What :meth:`run_one` would do for ``spec`` (empty: the run is done). Runs nothing."""
        from looplm.run.checkpoint import newest_valid_checkpoint

        run_dir = self.out / "runs" / spec.run_id
        ckpt = newest_valid_checkpoint(run_dir)
        if ckpt is None:
            return ["train"]
        saved, step = self._saved_run(spec, run_dir, ckpt)
        if step < spec.config.train.steps:
            return [f"resume from step {step}"]
        if self._stale(spec, weights_sha256(ckpt)):
            return ["evaluate"]
        return self.evaluate(spec, ckpt, saved, force=False, dry=True)

    def run_one(self, spec: RunSpec) -> dict[str, Any]:
        t0 = time.time()
        run_dir = self.out / "runs" / spec.run_id
        trained, ckpt = self.train(spec, run_dir)
        saved = Config.from_json((ckpt / "config.json").read_text())
        record = self.record(spec, run_dir, ckpt, saved)
        # evaluations stored for other weights (a retrained run) are stale: redo them all
        force = trained is not None or self._stale(spec, record.weights_sha256)
        self.store.put_run(record)
        done = self.evaluate(spec, ckpt, saved, force)
        status = trained or ("evaluated" if done else "skipped")
        self.log(f"{spec.run_id}: {status}" + (f"; {'; '.join(done)}" if done else "")
                 + f" ({time.time() - t0:.1f} s)")
        return {"run_id": spec.run_id, "variant": spec.variant, "seed": spec.seed, "grid": spec.grid,
                "status": status, "evaluations": done, "run_dir": str(run_dir), "checkpoint": str(ckpt),
                "wall_s": time.time() - t0}


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` → ``(i, n)`` with 0 <= i < n (shard i of n: the runs whose index ≡ i mod n)."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
    if not m or not int(m.group(2)) >= 1 or not int(m.group(1)) < int(m.group(2)):
        raise SweepError(f"--shard: expected i/n with 0 <= i < n (e.g. 0/4 … 3/4), got {text!r}")
    return int(m.group(1)), int(m.group(2))


def select_runs(specs: list[RunSpec], *, only: Sequence[str] | None = None,
                shard: tuple[int, int] | None = None) -> list[RunSpec]:
    """The runs of ``specs`` named in ``only`` and in ``shard`` ``(i, n)``: index in :meth:`Sweep.runs` ≡ i (mod n).

    So shards 0/n … n-1/n partition a sweep, whatever has finished. SweepError: an unknown run id, a bad shard.
    """
    if only is not None:
        known = [s.run_id for s in specs]
        for run_id in only:
            if run_id not in known:
                import difflib

                close = difflib.get_close_matches(run_id, known, n=1)
                raise SweepError(f"--only: no run {run_id!r} in this sweep"
                                 + (f" (did you mean {close[0]}?)" if close else "")
                                 + f"; runs: {', '.join(known)}")
    if shard is not None:
        i, n = shard
        if not (isinstance(i, int) and isinstance(n, int) and n >= 1 and 0 <= i < n):
            raise SweepError(f"--shard: expected i/n with 0 <= i < n, got {i}/{n}")
    return [s for k, s in enumerate(specs)
            if (only is None or s.run_id in only) and (shard is None or k % shard[1] == shard[0])]


def _sweep_and_out(sweep: Sweep | str | Path, out: str | Path | None) -> tuple[Sweep, Path]:
    sweep = sweep if isinstance(sweep, Sweep) else load_sweep(sweep)
    return sweep, Path(out) if out is not None else Path("results") / sweep.name


def plan_sweep(sweep: Sweep | str | Path, out: str | Path | None = None, *,
               shard: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """The runs of ``sweep`` that :func:`run_sweep` would train, resume or evaluate in ``out``; runs nothing.

    Returns per pending run ``index`` (in run order), ``run_id`` and ``todo`` (e.g. ``["resume from step 4"]``).
    """
    sweep, out = _sweep_and_out(sweep, out)
    specs = sweep.runs()
    chosen = {s.run_id for s in select_runs(specs, shard=shard)}
    db = out / "results.db"
    with ResultStore(db) if db.is_file() else contextlib.nullcontext() as store:
        if store is not None:
            store.rehash()  # rows stored under an older identity rule count as done
        runner = _Runner(sweep, out, store, {}, progress=False)  # type: ignore[arg-type]
        return [{"index": k, "run_id": spec.run_id, "todo": todo} for k, spec in enumerate(specs)
                if spec.run_id in chosen and (todo := runner.pending(spec))]


def _check_eval_sources(ev: EvalProtocol, specs: list[RunSpec]) -> None:
    """SweepError unless every corpus split the evaluation reads can be found (nothing downloaded or tokenized)."""
    from looplm.data.corpora import source_fingerprint
    from looplm.data.paths import resolve_data_root

    first: dict[tuple[str, str, str], RunSpec] = {}  # each (dataset, split, data root) once, with its first run
    for spec in specs:
        for dataset, split in itertools.product(ev.ppl_datasets(spec.config.data), ev.splits):
            first.setdefault((dataset, split, spec.config.data.data_root), spec)
    for (dataset, split, root), spec in first.items():
        try:
            source_fingerprint(spec.config.data.replace(dataset=dataset), split, resolve_data_root(root))
        except (FileNotFoundError, ValueError, ConfigError) as exc:
            raise SweepError(f"eval.datasets: {dataset} ({split} split) of run {spec.run_id} cannot be "
                             f"evaluated: {exc}") from None


def run_sweep(sweep: Sweep | str | Path, out: str | Path | None = None, *, progress: bool = True,
              data: dict[str, Any] | None = None, report: bool = True, only: Sequence[str] | None = None,
              shard: tuple[int, int] | None = None) -> SweepResult:
    """Train and evaluate every run of ``sweep`` (a :class:`Sweep` or a file) into ``out`` (default
    ``results/<name>``): ``runs/<run-id>/``, ``results.db``, ``sweep.json``, ``report/`` (when ``report``).

    ``data``: a cache of prepared training data keyed by the data config's JSON, shared between calls.
    ``only`` (run ids) and ``shard`` ``(i, n)`` select runs (:func:`select_runs`); parts may run at once
    into one ``out`` (the results DB takes concurrent writers).
    """
    sweep, out = _sweep_and_out(sweep, out)
    out.mkdir(parents=True, exist_ok=True)
    all_specs = sweep.runs()
    specs = select_runs(all_specs, only=only, shard=shard)
    for name in HOOKS:
        if getattr(sweep.eval, name) is not None:
            _hook(name)  # fail before training anything
    from looplm.data.paths import atomic_write

    _check_eval_sources(sweep.eval, specs)
    text = dumps({"name": sweep.name, "baseline": sweep.baseline, "seeds": list(sweep.seeds), "grid": sweep.grid,
                  "variants": sweep.variants, "eval": sweep.eval.__dict__,
                  "runs": [{"run_id": s.run_id, "variant": s.variant, "seed": s.seed, "grid": s.grid,
                            "config": s.config.to_dict()} for s in all_specs]}, indent=2) + "\n"
    with atomic_write(out / "sweep.json") as f:  # shards write the same text concurrently
        f.write(text.encode())
    result = SweepResult(out=out, db=out / "results.db")
    with ResultStore(result.db) as store:
        runner = _Runner(sweep, out, store, data if data is not None else {}, progress)
        if rekeyed := store.rehash():  # rows stored under an older identity rule stay found
            runner.log(f"results DB: {rekeyed} config hash(es) brought up to today's identity rules")
        runner.log(f"{len(all_specs)} runs ({len(sweep.variants)} variants × {len(sweep.seeds)} seeds"
                   + (f" × {len(all_specs) // (len(sweep.variants) * len(sweep.seeds))} grid points"
                      if sweep.grid else "")
                   + f") into {out}" + (f"; running {len(specs)} of them" if len(specs) != len(all_specs) else ""))
        bar = tqdm(specs, desc=f"sweep {sweep.name}", unit="run", disable=not progress, position=0,
                   dynamic_ncols=True)
        for i, spec in enumerate(bar):
            bar.set_postfix_str(spec.run_id)
            runner.log(f"[{i + 1}/{len(specs)}] {spec.run_id}")
            result.runs.append(runner.run_one(spec))
        bar.close()
        if report:
            from looplm.analysis.report import write_report

            result.report = write_report(store, out / "report", baseline=sweep.baseline, sweep=sweep.name)
            runner.log(f"report: {result.report['markdown']}")
    return result


def sweep_file(file: Path, *, out: Path | None = None, plan: bool = False, shard: str | None = None,
               only: Sequence[str] | None = None, progress: bool = True) -> dict[str, Any] | None:
    """``looplm sweep``: run the sweep in ``file`` (returns :meth:`SweepResult.summary`), or with ``plan``
    print one command per pending run.

    Args:
        file: sweep file
        out: output folder (default results/<sweep name>): runs/, results.db, report/
        plan: run nothing: print one `looplm sweep FILE --out OUT --only RUN_ID` command per pending run
        shard: I/N: only the runs whose index in the run order is I mod N; shards 0/N … N-1/N can run at once
            into one --out; no report is written (run `looplm report --db OUT/results.db` at the end)
        only: RUN_ID,...: only these runs (ids as in --plan); no report is written
    """
    import shlex
    import sys

    spec, out = _sweep_and_out(file, out)
    shards = parse_shard(shard) if shard is not None else None
    if plan:
        if only is not None:
            raise SweepError("--only and --plan do not go together (--plan lists the pending runs)")
        pending = plan_sweep(spec, out, shard=shards)
        # one command per pending run: they may run in any order, in parallel
        print("\n".join(f"looplm sweep {shlex.quote(str(file))} --out {shlex.quote(str(out))} "
                        f"--only {shlex.quote(p['run_id'])}" for p in pending), end="\n" if pending else "")
        print(f"# {len(pending)} pending of {len(spec.runs())} runs; afterwards: looplm report --db "
              f"{out / 'results.db'}", file=sys.stderr)
        return None
    partial = only is not None or shards is not None
    result = run_sweep(spec, out, progress=progress, only=only, shard=shards, report=not partial)
    if partial:
        print(f"part of the sweep: no report written; when every part is done: looplm report --db {result.db}",
              file=sys.stderr)
    return result.summary()
