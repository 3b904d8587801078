"""The generator of the ``looplm`` command line (stdlib argparse; imports no torch): options from typed
signatures (:func:`add_options`), lazy subcommands taking no abbreviated options, ``--section.field VALUE``
overrides and the one report convention (:class:`Report`: ``--quiet/--json/--out``).
"""

from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import inspect
import json
import os
import re
import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Literal, Sequence


class CliError(ValueError):
    """A command-line argument that cannot be used (printed; exit status 2)."""


class UsageError(CliError):
    """A missing or conflicting argument found by a command (the usage is printed; exit status 2)."""


# ---------------------------------------------------------------- parser
class LazyParsers(dict):
    """A subparsers' name → parser map that adds a command's options on its first lookup: ``looplm --help``
    lists commands from their help strings alone, and ``looplm eval ppl`` imports only its own code."""

    builders: dict[str, Callable[[argparse.ArgumentParser], None]]

    def __getitem__(self, name: str) -> argparse.ArgumentParser:
        parser = super().__getitem__(name)
        if name in self.builders:
            self.builders.pop(name)(parser)
        return parser


def lazy_subparsers(parser: argparse.ArgumentParser, **kwargs: Any) -> argparse._SubParsersAction:
    """``parser.add_subparsers(**kwargs)`` whose commands (:func:`add_command`) build on first use."""
    sub = parser.add_subparsers(**kwargs)
    sub._name_parser_map = sub.choices = LazyParsers()  # type: ignore[assignment]
    sub.choices.builders = {}  # type: ignore[attr-defined]
    return sub


def add_command(sub: argparse._SubParsersAction, name: str, build: Callable[[argparse.ArgumentParser], None],
                **kwargs: Any) -> argparse.ArgumentParser:
    """``sub.add_parser(name, **kwargs)``, no abbreviated options; ``build(parser)`` adds its options on first use."""
    sub.choices.builders[name] = build  # type: ignore[attr-defined]
    return sub.add_parser(name, allow_abbrev=False, **kwargs)


def subcommands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The (built) parsers of ``parser``'s subcommands."""
    return [a.choices[n] for a in parser._actions if isinstance(a, argparse._SubParsersAction) for n in list(a.choices)]


def build_all(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Build every lazily added command below ``parser`` (tests, documentation); returns it."""
    for child in subcommands(parser):
        build_all(child)
    return parser


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--")]


# ---------------------------------------------------------------- value types (argparse types)
MAX_DEPTH = 4096


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


def comma_list(item: Any) -> Callable[[str], list[Any]]:
    """A comma-separated list of ``item`` (int: 0..MAX_DEPTH)."""

    def parse(text: str) -> list[Any]:
        try:
            values = [item(s.strip()) for s in text.split(",")]
        except ValueError:
            values = []
        if not values or (item is int and not 0 <= min(values) <= max(values) <= MAX_DEPTH):
            what = f"integers in 0..{MAX_DEPTH}" if item is int else item.__name__ + " values"
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, e.g. 1,2,4; got {text!r}")
        return values

    parse.__name__ = "list"
    return parse


def in_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file" + (" (it is a directory)" if path.is_dir() else ""))
    return path


def out_file(text: str) -> Path:
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file path such as {Path(text, 'x.json')}")
    return Path(text)


def out_dir(text: str) -> Path:
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; give a directory path")
    return Path(text)


def new_dir(text: str) -> Path:
    return out_dir(text)


InFile = Annotated[Path, in_file]  #: an existing file to read
OutFile = Annotated[Path, out_file]  #: a file to write (its folder is created before the work)
OutDir = Annotated[Path, out_dir]  #: a folder to write into (created before the work)
#: a folder the command fills with files of its own (config.json, weights, tokenizer): also refused where it is,
#: holds or lies inside an input of the command (--checkpoint, an input file), before the work (:func:`check_apart`)
NewDir = Annotated[Path, new_dir]


def json_object(text: str) -> dict[str, Any]:
    """A JSON object, e.g. ``'{"criterion": "margin", "tau": 0.5}'``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object; {exc.msg} in {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object {{...}}; got {text!r}")
    return value


# ---------------------------------------------------------------- options from a function
_DOC_ARG = re.compile(r"^(\s*)([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*(?:\([^)]*\))?:\s*(.*)$")


def doc_args(func: Callable[..., Any]) -> dict[str, str]:
    """Help per parameter from a Google-style ``Args:`` section (``a, b: text`` names both; indented lines
    continue)."""
    out: dict[str, str] = {}
    lines = (inspect.getdoc(func) or "").splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Args:"), len(lines))
    names: list[str] = []
    indent = None
    for line in filter(str.strip, lines[start + 1:]):
        m, level = _DOC_ARG.match(line), len(line) - len(line.lstrip())
        indent = level if indent is None else indent
        if level < indent:  # the next section (Returns:, Raises:)
            break
        if m and level == indent:
            names = [n.strip() for n in m.group(2).split(",")]
            out.update(dict.fromkeys(names, m.group(3).strip()))
        else:
            out.update({n: out[n] + " " + line.strip() for n in names})
    return out


@dataclasses.dataclass(frozen=True)
class Opt:
    """How a parameter's option differs from its signature (unset: the signature's). ``type``: an annotation
    or an argparse type; ``choices``: values or a function returning them (read when the command builds)."""

    help: str | None = None
    type: Any = None
    default: Any = inspect.Parameter.empty
    metavar: str | None = None
    choices: Any = None
    positional: bool = False

    def over(self, other: Opt | None) -> Opt:
        """``self`` with the fields that ``other`` sets."""
        unset = Opt()
        return dataclasses.replace(self, **{f.name: getattr(other, f.name) for f in dataclasses.fields(Opt)
                                            if other and getattr(other, f.name) != getattr(unset, f.name)})


def exit_criteria() -> tuple[str, ...]:
    from looplm.eval.exits import EXIT_CRITERIA

    return tuple(EXIT_CRITERIA)


#: what a parameter name means in every command (the signature's annotation and docstring come first)
NAMES: dict[str, Opt] = {
    **dict.fromkeys(("batches", "n_calib", "n_timed", "repeats", "steps", "eval_tokens", "matmul_n", "rounds",
                     "train_records", "stop_after", "samples", "problems", "seq_len", "max_new_tokens", "depth",
                     "k_max", "scale_loops", "num_steps", "max_depth", "digits"),
                    Opt(type=positive_int, metavar="N")),
    "batch_size": Opt(type=positive_int, metavar="N", help="rows per forward pass"),
    "max_tokens": Opt(type=positive_int, metavar="N",
                      help="score only the first N tokens of each split read (default: all)"),
    "max_examples": Opt(type=positive_int, metavar="N", help="read only the first N examples (default: all)"),
    "ceiling": Opt(type=positive_int, metavar="N", help="the deepest loop an adaptive run may reach"),
    "seed": Opt(help="the random seed of this command's draws"),
    "preset": Opt(help="a named config (`looplm info --list`)"),
    "depths": Opt(metavar="T,T,...", help="comma-separated loop depths, e.g. 1,2,4,8,12,16,24,32,48"),
    "dataset": Opt(help="brown, wikitext2, wikitext103, openwebtext or c4 (default: the checkpoint's training corpus)"),
    "split": Opt(type=Literal["train", "valid", "test"], help="split"),
    "device": Opt(help="cpu, cuda or cuda:N"),
    "criterion": Opt(choices=exit_criteria, metavar="NAME", help="exit criterion (looplm.eval.exits)"),
    "scale_clamp": Opt(help="rescale each token's state after every loop to its loop-1 RMS (SPEC §4)"),
    "out": Opt(type=OutDir),
    "student": Opt(type=Path, metavar="DIR"),
}
#: parameters the command line supplies itself, never options
NEVER = frozenset({"func", "options", "progress", "cfg", "overrides", "out_json", "out_dir", "data_root", "stem",
                   "plot", "plots", "timed"})


def _hints(func: Callable[..., Any]) -> dict[str, Any]:
    """The parameter annotations of ``func``, resolved one by one (an unresolvable one: ``str``)."""
    out = {}
    for name, value in getattr(func, "__annotations__", {}).items():
        try:
            out[name] = eval(value, func.__globals__) if isinstance(value, str) else value
        except Exception:  # noqa: BLE001 - e.g. a name imported only for type checking
            out[name] = str
    return out


def _parse_kw(tp: Any, default: Any) -> dict[str, Any]:
    """argparse keywords (type, choices, action) for annotation ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        check = next((m for m in args[1:] if m in (in_file, out_file, out_dir, new_dir)), None)
        return {**_parse_kw(args[0], default), **({"type": check} if check else {})}
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        return _parse_kw(next((a for a in members if typing.get_origin(a) is Annotated or a is Path), members[0]),
                         default)
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
    return {"type": tp if tp in (int, float, str, Path) or (callable(tp) and not isinstance(tp, type)) else str}


def add_options(parser: argparse.ArgumentParser, func: Callable[..., Any], opts: dict[str, Opt] | None = None,
                skip: Iterable[str] = (), key: str = "_params") -> None:
    """One option per parameter of ``func`` (but ``skip`` and :data:`NEVER`): ``max_tokens`` → ``--max-tokens``,
    default and help (``Args:``) from ``func``, parsing from the annotation: ``Literal`` → choices, ``bool`` →
    a flag, ``Sequence[int]`` → a comma list, ``list[str]`` → repeatable, ``Mapping`` → a JSON object,
    :data:`InFile` / :data:`OutFile` / :data:`OutDir` / :data:`NewDir` → checked paths; :data:`NAMES` refines a
    name everywhere.

    A parameter without a default is required. The names go to ``args.<key>``, ``(func, names)`` to
    ``args._driven``, the output paths to ``args._prepare`` and the input files to ``args._inputs``
    (:func:`prepare_outputs`).
    """
    hints, docs, opts, skip = _hints(func), doc_args(func), opts or {}, set(skip) | NEVER
    names, prepare, inputs = [], [], []
    for name, p in inspect.signature(func).parameters.items():
        if name in skip or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        opt = NAMES.get(name, Opt()).over(Opt(help=docs.get(name) or None)).over(opts.get(name))
        default = p.default if opt.default is inspect.Parameter.empty else opt.default
        required = default is inspect.Parameter.empty
        kw = _parse_kw(hints.get(name, type(default) if default is not None else str), default)
        # the command's Opt, else a name's meaning where the annotation says no more (int, Path, str)
        if name in opts and opts[name].type or opt.type and kw.get("type") in (int, Path, str):
            kw = _parse_kw(opt.type, default)
        if opt.choices is not None:
            kw["choices"] = opt.choices() if callable(opt.choices) else opt.choices
        help_text = opt.help or ""
        if "action" not in kw:
            kw["metavar"] = opt.metavar or ("{" + ",".join(map(str, kw["choices"])) + "}" if "choices" in kw else None)
            if not required and default is not None and "default" not in help_text:
                shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
                help_text += f" (default {shown})"
        kw["help"] = help_text.replace("%", "%%")
        if opt.positional:
            parser.add_argument(name, **{**kw, "metavar": opt.metavar or name.upper()})
        else:
            kw.update(required=True) if required else kw.update(default=default)
            parser.add_argument("--" + name.replace("_", "-"), dest=name, **kw)
        names.append(name)
        if kw.get("type") in (out_file, out_dir, new_dir):
            prepare.append((name, kw["type"]))
        elif kw.get("type") is in_file:
            inputs.append(name)
    parser.set_defaults(**{key: tuple(parser.get_default(key) or ()) + tuple(names),
                           "_driven": tuple(parser.get_default("_driven") or ()) + ((func, tuple(names)),),
                           "_prepare": tuple(parser.get_default("_prepare") or ()) + tuple(prepare),
                           "_inputs": tuple(parser.get_default("_inputs") or ()) + tuple(inputs)})


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def prepare_outputs(args: argparse.Namespace) -> None:
    """Before the work: every given output path checked (a :data:`NewDir` against the inputs named in
    ``args._inputs`` too) and its folder created."""
    inputs = [(_flag(n), p) for n in getattr(args, "_inputs", ()) if (p := getattr(args, n, None)) is not None]
    for name, check in getattr(args, "_prepare", ()):
        if (path := getattr(args, name)) is not None:
            if check is new_dir:
                check_apart(path, _flag(name), inputs)
            (prepare_out_file if check is out_file else prepare_out_dir)(path, _flag(name))


# ---------------------------------------------------------------- config overrides
_CONFIG_FLAG = re.compile(r"^--([A-Za-z_][\w-]*(?:\.[A-Za-z_][\w-]*)+)(?:=(.*))?$", re.S)
_NUMBER = re.compile(r"^-[\d.]")


def split_config_overrides(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """Split the ``--section.field[.sub] VALUE`` (or ``=VALUE``) pairs out of ``argv`` (not after ``--``).

    Returns the rest and ``{"section.field": "VALUE"}`` (the last of a repeated key wins); the keys are
    checked by :func:`looplm.config.apply_overrides`.
    """
    rest: list[str] = []
    overrides: dict[str, str] = {}
    tokens = iter(argv)
    for arg in tokens:
        m = _CONFIG_FLAG.match(arg)
        if arg == "--":
            return [*rest, arg, *tokens], overrides
        if not m:
            rest.append(arg)
        elif m.group(2) is not None:
            overrides[m.group(1)] = m.group(2)
        elif (value := next(tokens, None)) is None or (value.startswith("-") and not _NUMBER.match(value)):
            raise CliError(f"--{m.group(1)}: expected a value (--{m.group(1)} VALUE)")
        else:
            overrides[m.group(1)] = value
    return rest, overrides


def add_config_fields(parser: argparse.ArgumentParser, start: str, fields: list[tuple[str, str, Any]]) -> None:
    """List every config field (``(key, help, default)``, as ``fields_help`` of :mod:`looplm.config` gives them)
    in ``parser``'s --help (never parsed: :func:`split_config_overrides` takes them first; ``start``: what the
    overrides apply to)."""
    parser.usage = parser.format_usage().removeprefix("usage: ").rstrip() + " [--SECTION.FIELD V ...]"
    group = parser.add_argument_group("config fields", f"override any as --SECTION.FIELD VALUE on top of {start}; "
                                      "the config parses and checks the value; [the base default]")
    for key, text, default in fields:
        if "--" + key not in parser._option_string_actions:
            group.add_argument("--" + key, metavar="V", default=argparse.SUPPRESS, help=(text + (
                "" if default is dataclasses.MISSING else f" [{default!r}]")).replace("%", "%%"))


# ---------------------------------------------------------------- output paths and the report convention
def check_apart(path: Path, flag: str, inputs: Iterable[tuple[str, Path]]) -> None:
    """CliError naming ``flag`` and the input's flag where output folder ``path`` is an input of ``inputs``
    (``(flag, path)`` pairs), lies inside one or holds one (paths compared resolved: links, ``..``): the files
    written there would replace or mix with the files the command reads (a checkpoint, its run folder)."""
    out = path.resolve()
    for in_flag, src in inputs:
        source = Path(src).resolve()
        how = ("is" if out == source else "lies inside" if out.is_relative_to(source) else
               "holds" if source.is_relative_to(out) else None)
        if how:
            raise CliError(f"{flag} {path}: {how} {in_flag} {src}; writing there would change what the command "
                           f"reads; give a {flag} folder outside {in_flag}")


def prepare_out_dir(path: Path, flag: str, shown: Path | None = None) -> Path:
    """Create folder ``path`` before any work; CliError naming ``flag`` and ``shown`` if it cannot be written."""
    shown = path if shown is None else shown
    anc = next((a for a in (path, *path.parents) if os.path.lexists(a)), None)
    if anc is not None and not anc.is_dir():
        raise CliError(f"{flag} {shown}: " + ("is a file" if anc == shown else
                                               f"cannot be written: {anc} is a file, not a folder"))
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"{flag} {shown}: cannot create the folder {path}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CliError(f"{flag} {shown}: the folder {path} is not writable")
    return path


def prepare_out_file(path: Path, flag: str, companions: Iterable[Path] = ()) -> Path:
    """Create the folder of file ``path`` (and ``companions``); CliError naming ``flag`` if one cannot be written."""
    for p in (path, *companions):
        if p.is_dir():
            raise CliError(f"{flag} {path}: {p} is a folder; give a file path such as {p / 'result.json'}")
    prepare_out_dir(path.parent, flag, shown=path)
    for p in (path, *companions):
        if p.exists() and not os.access(p, os.W_OK):
            raise CliError(f"{flag} {path}: {p} exists and is not writable")
    return path


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
        """Write --out, print ``result`` (its Markdown; JSON with --json) and the files written."""
        from looplm.run.finite import write_json_markdown

        written = write_json_markdown(result, self.out) if self.out else []
        written += [p for p in map(Path, files) if p not in written]
        print(json.dumps(result, indent=2, default=str) if self.json else result["markdown"])
        if written:
            print("wrote " + ", ".join(map(str, written)), file=sys.stderr if self.json else sys.stdout)
        return 0
