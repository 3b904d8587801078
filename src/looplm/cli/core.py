"""The generator of the ``looplm`` command line (stdlib argparse; no torch import).

A command's options come from the typed signature of the function it drives (:func:`add_options`):
one option per parameter (``max_tokens`` → ``--max-tokens``), its default from the signature, its help
from the docstring's ``Args:`` (:func:`doc_args`) and its parsing from the annotation: ``Literal`` →
choices, ``bool`` → ``--x`` (or ``--x/--no-x`` when on by default), ``int``/``float``/``str``,
``Sequence[int]`` → a comma list, ``list[str]`` → a repeatable option, ``Path``, and :data:`InFile` /
:data:`OutFile` / :data:`OutDir`, paths checked (outputs also created) before any work. A parameter
name means the same thing in every command, so :data:`NAMES` refines a name once (``batch_size`` is
an integer >= 1 everywhere).

Also here: :class:`Parser` (no abbreviations: ``--train.step`` never means ``--train.steps``), lazy
subcommands, the ``--section.field VALUE`` config overrides and their ``--help`` listing, and the one
report convention (:class:`Report`: ``--quiet/--json/--out``).
"""

from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import difflib
import inspect
import json
import os
import re
import shutil
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Literal, Sequence


class CliError(ValueError):
    """A command-line argument that cannot be used (``looplm`` prints it and exits with status 2)."""


class UsageError(CliError):
    """A missing or conflicting argument found by a command (``looplm`` prints the usage and exits 2)."""


# ---------------------------------------------------------------- parser
class Parser(argparse.ArgumentParser):
    """An ArgumentParser that refuses abbreviated options and can append a config-field listing to --help.

    Subparsers made from it (``add_subparsers().add_parser``) are Parsers too, so no level of the
    command line accepts a prefix of an option.
    """

    def __init__(self, *args: Any, config_help: Callable[[], str] | None = None, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        self.config_help = config_help

    def format_help(self) -> str:
        text = super().format_help()
        if self.config_help is not None:
            text += "\n" + self.config_help()
        return text


class LazyParsers(dict):
    """The name → parser map of a subparsers action, adding a parser's options on its first lookup.

    argparse looks a command's parser up only when that command is on the command line, and the
    top-level ``--help`` lists commands from their help strings alone; so ``looplm eval ppl`` imports
    the evaluation code but not the trainer or the benchmarks, and ``looplm --help`` imports neither.
    """

    def __init__(self) -> None:
        super().__init__()
        self.builders: dict[str, Callable[[argparse.ArgumentParser], None]] = {}

    def __getitem__(self, name: str) -> argparse.ArgumentParser:
        parser = super().__getitem__(name)
        build = self.builders.pop(name, None)
        if build is not None:
            build(parser)
        return parser


def lazy_subparsers(parser: argparse.ArgumentParser, **kwargs: Any) -> argparse._SubParsersAction:
    """``parser.add_subparsers(**kwargs)`` whose commands (added with :func:`add_command`) build lazily."""
    sub = parser.add_subparsers(**kwargs)
    sub._name_parser_map = sub.choices = LazyParsers()  # type: ignore[assignment]
    return sub


def add_command(sub: argparse._SubParsersAction, name: str, build: Callable[[argparse.ArgumentParser], None],
                **kwargs: Any) -> argparse.ArgumentParser:
    """Add command ``name`` (``kwargs`` as for ``add_parser``); ``build(parser)`` adds its options on first use."""
    parser = sub.add_parser(name, **kwargs)
    sub.choices.builders[name] = build  # type: ignore[attr-defined]
    return parser


def subcommands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The (built) parsers of ``parser``'s subcommands."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            out += [action.choices[name] for name in list(action.choices)]
    return out


def build_all(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Build every lazily added command below ``parser`` (for tests and documentation); returns it."""
    for child in subcommands(parser):
        build_all(child)
    return parser


def suggest(word: str, candidates: Iterable[str]) -> str:
    """``"; did you mean --x?"`` for the closest candidate to ``word``, or ``""``."""
    match = difflib.get_close_matches(word, sorted(set(candidates)), n=1, cutoff=0.6)
    return f"; did you mean {match[0]}?" if match else ""


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """The long option strings of ``parser`` (for suggestions)."""
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--")]


# ---------------------------------------------------------------- value types
MAX_DEPTH = 4096
InFile = Annotated[Path, "in"]  #: an existing file to read
OutFile = Annotated[Path, "out"]  #: a file to write (not a folder; its folder is created before the work)
OutDir = Annotated[Path, "outdir"]  #: a folder to write into (created before the work)


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


def comma_list(item: Any) -> Callable[[str], list[Any]]:
    """The argparse type of a comma-separated list of ``item`` (int: 0..MAX_DEPTH; a Literal: its values)."""
    choices = typing.get_args(item) if typing.get_origin(item) is Literal else None

    def parse(text: str) -> list[Any]:
        parts = [s.strip() for s in text.split(",")]
        try:
            values = [s if choices else item(s) for s in parts]
        except ValueError:
            values = []
        if choices and not set(values) <= set(choices):
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(choices)}; got {text!r}")
        if not values or (item is int and not 0 <= min(values) <= max(values) <= MAX_DEPTH):
            what = f"integers in 0..{MAX_DEPTH}" if item is int else item.__name__ + " values"
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, e.g. 1,2,4; got {text!r}")
        return values

    parse.__name__ = "list"
    return parse


def in_file(text: str) -> Path:
    """An existing readable file (argparse type)."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file" + (" (it is a directory)" if path.is_dir() else ""))
    return path


def out_file(text: str) -> Path:
    """A file path to write (argparse type): not an existing directory."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file path such as {path / 'result.json'}")
    return path


def out_dir(text: str) -> Path:
    """A directory to write into (argparse type): not an existing file."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; give a directory path")
    return path


# ---------------------------------------------------------------- options from a function
_DOC_ARG = re.compile(r"^(\s*)([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*(?:\([^)]*\))?:\s*(.*)$")


def doc_args(func: Callable[..., Any]) -> dict[str, str]:
    """Help per parameter from the ``Args:`` section of a Google-style docstring (empty when absent).

    ``a, b: text`` gives both names the text; continuation lines (indented deeper) are joined. A
    dataclass's fields give theirs from ``metadata["help"]``.
    """
    out: dict[str, str] = {}
    if dataclasses.is_dataclass(func):
        out = {f.name: f.metadata["help"] for f in dataclasses.fields(func) if "help" in f.metadata}
    lines = (inspect.getdoc(func) or "").splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Args:")
    except StopIteration:
        return out
    names: list[str] = []
    indent = None
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        m = _DOC_ARG.match(line)
        level = len(line) - len(line.lstrip())
        if indent is None:
            indent = level
        if level < indent:  # the next section (Returns:, Raises:)
            break
        if m and level == indent:
            names = [n.strip() for n in m.group(2).split(",")]
            for n in names:
                out[n] = m.group(3).strip()
        elif names:
            for n in names:
                out[n] += " " + line.strip()
    return out


@dataclasses.dataclass(frozen=True)
class Opt:
    """How a parameter differs on the command line from what its signature says (unset: the signature's).

    ``type`` is an annotation (``OutDir``, ``Sequence[int]``) or an argparse type function; ``choices``
    may be a function returning them (read when the command is built).
    """

    help: str | None = None
    type: Any = None
    default: Any = inspect.Parameter.empty
    metavar: str | None = None
    choices: Any = None
    positional: bool = False

    def over(self, other: Opt | None) -> Opt:
        """``self`` with the fields that ``other`` sets."""
        if other is None:
            return self
        unset = Opt()
        return dataclasses.replace(self, **{f.name: getattr(other, f.name) for f in dataclasses.fields(Opt)
                                            if getattr(other, f.name) != getattr(unset, f.name)})


def _exit_criteria() -> tuple[str, ...]:
    from looplm.eval.exits import EXIT_CRITERIA

    return tuple(EXIT_CRITERIA)


_POSITIVE = Opt(type=positive_int, metavar="N")
#: what a parameter name means in every command (the signature's annotation and docstring come first)
NAMES: dict[str, Opt] = {
    **{n: _POSITIVE for n in ("batch_size", "max_tokens", "max_examples", "batches", "n_calib", "n_timed", "repeats",
                              "steps", "eval_tokens", "matmul_n", "rounds", "train_records", "group_size", "updates",
                              "prompts_per_update", "eval_problems", "eval_samples", "samples", "problems",
                              "seq_len", "stop_after", "max_new_tokens")},
    **{n: Opt(type=positive_int, metavar="R") for n in ("depth", "ceiling", "k_max", "scale_loops", "neumann_steps",
                                                       "num_steps", "max_depth")},
    "digits": Opt(type=positive_int, metavar="D"),
    "depths": Opt(metavar="T,T,...", help="comma-separated loop depths, e.g. 1,2,4,8,12,16,24,32,48"),
    "dataset": Opt(help="brown, wikitext2, wikitext103, openwebtext or c4 (the last two from the Hugging Face hub, "
                   "online; default: the checkpoint's training corpus, which may also be a text or hf corpus: its "
                   "paths are in the checkpoint's config)"),
    "split": Opt(type=Literal["train", "valid", "test"], help="split"),
    "device": Opt(help="cpu, cuda or cuda:N"),
    "criterion": Opt(choices=_exit_criteria, metavar="NAME", help="exit criterion (looplm.eval.exits)"),
    "scale_clamp": Opt(help="rescale each token's state after every loop to its loop-1 RMS before readout and "
                       "recurrence (the readout-blind-spot diagnostic, SPEC §4)"),
    "out": Opt(type=OutDir),
    "checkpoint": Opt(type=Path, help="checkpoint or run directory"),
    "student": Opt(type=Path, metavar="DIR"),
}
#: parameters the command line supplies itself, never options
NEVER = frozenset({"func", "options", "progress", "cfg", "overrides", "out_json", "out_dir", "data_root", "stem",
                   "plot", "plots",                   "lm", "timed"})
_MARKS = {"in": in_file, "out": out_file, "outdir": out_dir}


def _hints(func: Callable[..., Any]) -> dict[str, Any]:
    """The parameter annotations of ``func``, resolved one by one (an unresolvable one: ``str``)."""
    target = func.__init__ if isinstance(func, type) else func
    out = {}
    for name, value in getattr(target, "__annotations__", {}).items():
        try:
            out[name] = eval(value, target.__globals__) if isinstance(value, str) else value
        except Exception:  # noqa: BLE001 - e.g. a name imported only for type checking
            out[name] = str
    return out


def json_object(text: str) -> dict[str, Any]:
    """A JSON object (argparse type), e.g. ``'{"criterion": "margin", "tau": 0.5}'``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object; {exc.msg} in {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object {{...}}; got {text!r}")
    return value


def _parse_kw(tp: Any, default: Any) -> dict[str, Any]:
    """argparse keywords (type, choices, action; ``mark`` for checked paths) for annotation ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        kw = _parse_kw(args[0], default)
        mark = next((m for m in args[1:] if m in _MARKS), None)
        return {**kw, "type": _MARKS[mark], "mark": mark} if mark else kw
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        pick = next((a for a in members if typing.get_origin(a) is Annotated or a is Path), members[0])
        return _parse_kw(pick, default)
    if origin is Literal:
        return {"type": type(args[0]), "choices": args}
    if tp is bool:
        return {"action": argparse.BooleanOptionalAction if default is True else "store_true"}
    if origin is list and args == (str,):  # free texts (which may hold commas): a repeatable option
        return {"action": "append"}
    if origin in (list, tuple, collections.abc.Sequence):
        return {"type": comma_list(args[0] if args else str)}
    if tp is dict or origin in (dict, collections.abc.Mapping):
        return {"type": json_object}
    if tp in (int, float, str, Path) or (callable(tp) and not isinstance(tp, type)):
        return {"type": tp}
    return {"type": str}


def _show(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def add_options(parser: argparse.ArgumentParser, func: Callable[..., Any], opts: dict[str, Opt] | None = None,
                skip: Iterable[str] = (), key: str = "_params") -> None:
    """Add one option per parameter of ``func`` (but ``skip`` and :data:`NEVER`), as the module docstring says.

    A parameter without a default is a required option (a positional argument with ``Opt(positional=True)``).
    The option names go to ``args.<key>`` and ``(func, names)`` to ``args._driven``; checked output paths
    to ``args._prepare`` (created by :func:`prepare_outputs` before the work).
    """
    params = inspect.signature(func).parameters
    hints, docs, opts, skip = _hints(func), doc_args(func), opts or {}, set(skip) | NEVER
    names, prepare = [], []
    for name, p in params.items():
        if name in skip or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        opt = NAMES.get(name, Opt()).over(Opt(help=docs.get(name) or None)).over(opts.get(name))
        default = p.default if opt.default is inspect.Parameter.empty else opt.default
        required = default is inspect.Parameter.empty
        hint = hints.get(name, type(default) if default is not None else str)
        kw = _parse_kw(hint, default)
        # the command's Opt, else a name's meaning where the annotation says no more (int, Path, str)
        if name in opts and opts[name].type or opt.type and "mark" not in kw and kw.get("type") in (int, Path, str):
            kw = _parse_kw(opt.type, default)
        mark = kw.pop("mark", None)
        choices = opt.choices() if callable(opt.choices) else opt.choices
        if choices is not None:
            kw["choices"] = choices
        help_text = opt.help or ""
        if "action" not in kw:
            kw["metavar"] = opt.metavar or ("{" + ",".join(map(str, kw["choices"])) + "}" if "choices" in kw
                                            else None)
            if not required and default is not None and "default" not in help_text:
                help_text += f" (default {_show(default)})"
        kw["help"] = help_text.replace("%", "%%")
        if opt.positional:
            parser.add_argument(name, **{k: v for k, v in kw.items() if k != "metavar"},
                                metavar=opt.metavar or name.upper())
        else:
            kw.update(required=True) if required else kw.update(default=default)
            parser.add_argument("--" + name.replace("_", "-"), dest=name, **kw)
        names.append(name)
        if mark in ("out", "outdir"):
            prepare.append((name, mark))
    parser.set_defaults(**{key: tuple(parser.get_default(key) or ()) + tuple(names),
                           "_driven": tuple(parser.get_default("_driven") or ()) + ((func, tuple(names)),),
                           "_prepare": tuple(parser.get_default("_prepare") or ()) + tuple(prepare)})


def prepare_outputs(args: argparse.Namespace) -> None:
    """Before the work: every given output path of the command checked and its folder created."""
    for name, mark in getattr(args, "_prepare", ()):
        path = getattr(args, name)
        if path is not None:
            (prepare_out_dir if mark == "outdir" else prepare_out_file)(path, "--" + name.replace("_", "-"))


# ---------------------------------------------------------------- config overrides
_CONFIG_FLAG = re.compile(r"^--([A-Za-z_][\w-]*(?:\.[A-Za-z_][\w-]*)+)(?:=(.*))?$", re.S)
_NUMBER = re.compile(r"^-[\d.]")


def split_config_overrides(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """Split ``--section.field[.sub] VALUE`` (or ``--section.field=VALUE``) pairs out of ``argv``.

    Returns the remaining arguments and ``{"section.field": "VALUE"}`` (strings, in order; the last
    of a repeated key wins). Field names are not checked here: :func:`looplm.config.apply_overrides`
    owns them. Nothing after a bare ``--`` is taken.
    """
    rest: list[str] = []
    overrides: dict[str, str] = {}
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            rest += argv[i:]
            break
        m = _CONFIG_FLAG.match(tok)
        if not m:
            rest.append(tok)
            i += 1
            continue
        key, value = m.group(1), m.group(2)
        if value is None:
            if i + 1 >= len(argv) or (argv[i + 1].startswith("-") and not _NUMBER.match(argv[i + 1])):
                raise CliError(f"--{key}: expected a value (--{key} VALUE)")
            value = argv[i + 1]
            i += 1
        overrides[key] = value
        i += 1
    return rest, overrides


def _field_type(owner: type, f: dataclasses.Field) -> Any:
    try:
        return typing.get_type_hints(owner).get(f.name, f.type)
    except Exception:  # noqa: BLE001 - a forward reference the help walk cannot resolve
        return f.type


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        try:
            return f.default_factory()  # type: ignore[misc]
        except Exception:  # noqa: BLE001
            return dataclasses.MISSING
    return dataclasses.MISSING


def config_fields(root: type | None = None, prefix: str = "") -> list[tuple[str, str, Any]]:
    """``(key, help, default)`` of every leaf config field, walked from the config dataclasses.

    Nested dataclasses are walked with dotted keys; per-rule options and the typed choice sections
    (``depth``, ``train.gradient``) list each field with the variants that read it. Used for ``--help``
    and suggestions only; parsing is :func:`apply_overrides`'.
    """
    from looplm import config

    root = config.Config if root is None else root
    out: list[tuple[str, str, Any]] = []
    seen: set[str] = set()
    for f in dataclasses.fields(root):
        if f.name.startswith("_"):
            continue
        key = prefix + f.name
        tp = _field_type(root, f)
        if key == "model.options":  # per-rule options: the config lists them with the rules that read each
            out += [(k, text, dataclasses.MISSING) for k, text in config.options_help().items()]
            continue
        if isinstance(tp, type) and issubclass(tp, config.ChoiceSection):  # a sampler / estimator and its fields
            out += [(k, text, dataclasses.MISSING) for k, text in config.choice_help(tp, key + ".").items()]
            continue
        default = _default_of(f)
        members = [t for t in (typing.get_args(tp) or (tp,)) if isinstance(t, type) and dataclasses.is_dataclass(t)]
        if dataclasses.is_dataclass(default) and type(default) not in members:
            members.append(type(default))
        if members:
            for member in members:
                for item in config_fields(member, key + "."):
                    if item[0] not in seen:
                        seen.add(item[0])
                        out.append(item)
        elif prefix:  # top-level scalars (the run name) have their own flags
            out.append((key, str(f.metadata.get("help", "")), default))
    return out


def config_keys() -> list[str]:
    """``--section.field`` of every config field (for suggestions)."""
    try:
        return ["--" + k for k, _, _ in config_fields()]
    except Exception:  # noqa: BLE001 - suggestions are best effort
        return []


def config_help(start: str = "--preset or --config", fields: list[tuple[str, str, Any]] | None = None) -> str:
    """The config-field part of ``looplm train --help`` / ``looplm info --help``.

    Args:
        start: what the overrides apply on top of (``rl pretrain``: its built-in config, not a preset).
        fields: ``(key, help, default)`` of each field (default: :func:`config_fields`).
    """
    width = max(60, min(shutil.get_terminal_size().columns, 120) - 2)
    lines = textwrap.wrap(f"config fields (override any as --SECTION.FIELD VALUE, on top of {start}; "
                          "the config parses and checks the value; [the base default, which that starting "
                          "config may change]):", width)
    section = None
    for key, help_text, default in config_fields() if fields is None else fields:
        sec = key.split(".")[0]
        if sec != section:
            section = sec
            lines.append(f"\n{sec}:")
        flag = f"  --{key} V"
        text = help_text + ("" if default is dataclasses.MISSING else f" [{default!r}]")
        body = textwrap.wrap(text, width - 26) or [""]
        if len(flag) > 23:
            lines.append(flag)
            lines += [" " * 26 + b for b in body]
        else:
            lines.append(flag.ljust(26) + body[0])
            lines += [" " * 26 + b for b in body[1:]]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- output paths
def prepare_out_dir(path: Path, flag: str, shown: Path | None = None) -> Path:
    """Check that folder ``path`` can be written and create it (with parents), before any work.

    Raises:
        CliError: naming ``flag`` and the path when a part of it is a file, it cannot be created, or
            it is not writable.
    """
    shown = path if shown is None else shown
    for anc in (path, *path.parents):
        if os.path.lexists(anc):
            if not anc.is_dir():
                what = "is a file" if anc == shown else f"cannot be written: {anc} is a file, not a folder"
                raise CliError(f"{flag} {shown}: {what}")
            break
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"{flag} {shown}: cannot create the folder {path}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CliError(f"{flag} {shown}: the folder {path} is not writable")
    return path


def prepare_out_file(path: Path, flag: str, companions: Iterable[Path] = ()) -> Path:
    """Check that file ``path`` (and ``companions`` written next to it) can be written; create its folder.

    Raises:
        CliError: naming ``flag`` and the path when it is a folder, its folder cannot be created, or
            it exists and is not writable.
    """
    for p in (path, *companions):
        if p.is_dir():
            raise CliError(f"{flag} {path}: {p} is a folder; give a file path such as {p / 'result.json'}")
    prepare_out_dir(path.parent, flag, shown=path)
    for p in (path, *companions):
        if p.exists() and not os.access(p, os.W_OK):
            raise CliError(f"{flag} {path}: {p} exists and is not writable")
    return path


# ---------------------------------------------------------------- the report convention
def write_report_files(out: Path | None, result: dict[str, Any]) -> list[Path]:
    """``out`` ← the result as JSON, ``out.md`` ← its Markdown; returns the paths (none without ``out``)."""
    from looplm.finite import write_json_markdown

    return [] if out is None else write_json_markdown(result, out)


@dataclasses.dataclass(frozen=True)
class Report:
    """``--out FILE.json`` (also FILE.md) and ``--json`` of a protocol command (``--quiet`` is ``progress``)."""

    out: Path | None = None
    json: bool = False

    def check(self) -> None:
        """Before the work: --out FILE and FILE.md must be writable (their folder is created)."""
        if self.out is not None:
            prepare_out_file(self.out, "--out", companions=[self.out.with_suffix(".md")])

    def emit(self, result: dict[str, Any], files: Iterable[Any] = ()) -> int:
        """Write --out, print ``result`` (Markdown for people; JSON with --json) and the files written."""
        written = write_report_files(self.out, result)
        written += [p for p in map(Path, files) if p not in written]
        print(json.dumps(result, indent=2, default=str) if self.json else result["markdown"])
        if written:
            print("wrote " + ", ".join(map(str, written)), file=sys.stderr if self.json else sys.stdout)
        return 0
