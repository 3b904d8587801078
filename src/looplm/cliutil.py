"""Building blocks of the ``looplm`` command line (stdlib argparse; no torch import).

* :class:`Parser`: argparse that refuses abbreviations (``--train.step`` never means ``--train.steps``).
* :func:`add_function_options`: a command's options generated from the signature (names, defaults) and
  docstring (``Args:`` help) of the library function it drives; :func:`call_with_options` calls it.
* :func:`split_config_overrides`: every ``--section.field[.sub] VALUE`` token pair, handed as strings to
  :func:`looplm.config.apply_overrides`, which owns parsing and validation of config fields.
* :func:`config_help`: the ``--help`` listing of config fields, walked from the config dataclasses.
* :func:`prepare_out_file` / :func:`prepare_out_dir`: output paths checked and their folders created
  before any computation; a path that cannot be written is a :class:`CliError` naming it.
* :func:`suggest`: "did you mean ...?" for a misspelled option (difflib).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import os
import re
import shutil
import textwrap
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence


class CliError(ValueError):
    """A command-line argument that cannot be used (``looplm`` prints it and exits with status 2)."""


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
    """Add command ``name`` (``kwargs`` as for ``add_parser``: help, description); ``build(parser)`` adds
    its options on first use. A command with a ``func`` default also records its parser (``_parser``)."""
    parser = sub.add_parser(name, **kwargs)

    def run(p: argparse.ArgumentParser) -> None:
        build(p)
        if p.get_default("func") is not None:
            p.set_defaults(_parser=p)

    if isinstance(sub.choices, LazyParsers):
        sub.choices.builders[name] = run
    else:
        run(parser)
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


# ---------------------------------------------------------------- options from a function
_DOC_ARG = re.compile(r"^(\s*)([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*(?:\([^)]*\))?:\s*(.*)$")


def doc_args(func: Callable[..., Any]) -> dict[str, str]:
    """Help per parameter from the ``Args:`` section of a Google-style docstring (empty when absent).

    ``a, b: text`` gives both names the text; continuation lines (indented deeper) are joined.
    """
    doc = inspect.getdoc(func) or ""
    out: dict[str, str] = {}
    lines = doc.splitlines()
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
    """How one parameter of a driven function becomes a command-line option.

    Unset fields come from the function: the option name from the parameter name (``max_tokens`` →
    ``--max-tokens``), the default from the signature, the help from the docstring's ``Args:``.
    """

    help: str | None = None
    type: Callable[[str], Any] | None = None
    default: Any = inspect.Parameter.empty
    metavar: str | None = None
    choices: Sequence[Any] | None = None
    show_default: bool = True


def _fmt_default(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def add_function_options(parser: argparse.ArgumentParser, func: Callable[..., Any], opts: dict[str, Opt],
                         group: str | None = None) -> None:
    """Add one option per ``opts`` entry, each named after and defaulting like a parameter of ``func``.

    The parameter names are recorded on the parser (``args._params``) so :func:`call_with_options`
    passes exactly these to ``func``, and ``(func, names)`` as ``_driven``. A parameter that ``func``
    lacks (a stand-in function in a test, or a library change) does not break the parser: its option
    defaults to ``Opt.default`` or None; ``tests/test_cli.py`` checks every ``_driven`` spec against
    the real signatures.
    """
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        params = {}
    docs = doc_args(func)
    target = parser.add_argument_group(group) if group else parser
    for name, opt in opts.items():
        default = opt.default
        if default is inspect.Parameter.empty:
            default = params[name].default if name in params else None
            default = None if default is inspect.Parameter.empty else default
        help_text = opt.help if opt.help is not None else docs.get(name, "")
        kw: dict[str, Any] = {"dest": name, "default": default}
        if isinstance(default, bool) and opt.type is None:  # on by default: --name / --no-name
            kw["action"] = argparse.BooleanOptionalAction if default else "store_true"
        else:
            kw["type"] = opt.type or (type(default) if isinstance(default, (int, float, str)) else str)
            if opt.metavar:
                kw["metavar"] = opt.metavar
            if opt.choices is not None:
                kw["choices"] = opt.choices
            if opt.show_default and default is not None and "default" not in help_text:
                help_text += f" (default {_fmt_default(default)})"
        kw["help"] = help_text.replace("%", "%%")
        target.add_argument("--" + name.replace("_", "-"), **kw)
    parser.set_defaults(_params=tuple(parser.get_default("_params") or ()) + tuple(opts),
                        _driven=tuple(parser.get_default("_driven") or ()) + ((func, tuple(opts)),))


def call_with_options(func: Callable[..., Any], args: argparse.Namespace, *positional: Any, **extra: Any) -> Any:
    """``func(*positional, **{p: args.p for the parser's generated options}, **extra)``."""
    kwargs = {name: getattr(args, name) for name in getattr(args, "_params", ())}
    kwargs.update(extra)
    return func(*positional, **kwargs)


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
    (``depth``, ``train.gradient``) list each field with the variants that read it. Used for ``--help`` and suggestions only; parsing is :func:`apply_overrides`'.
    """
    if root is None:
        from looplm.config import Config

        root = Config
    out: list[tuple[str, str, Any]] = []
    seen: set[str] = set()
    for f in dataclasses.fields(root):
        if f.name.startswith("_"):
            continue
        key = prefix + f.name
        tp = _field_type(root, f)
        from looplm import config

        if key == "model.options":  # per-rule options: the config lists them with the rules that read each
            out += [(k, text, dataclasses.MISSING) for k, text in config.options_help().items()]
            continue
        if isinstance(tp, type) and issubclass(tp, config._Choice):  # a sampler / estimator and its fields
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


def config_help(start: str = "--preset or --config") -> str:
    """The config-field part of ``looplm train --help`` / ``looplm info --help``.

    Args:
        start: what the overrides apply on top of (``rl pretrain``: its built-in config, not a preset).
    """
    width = max(60, min(shutil.get_terminal_size().columns, 120) - 2)
    lines = textwrap.wrap(f"config fields (override any as --SECTION.FIELD VALUE, on top of {start}; "
                          "the config parses and checks the value; [the base default, which that starting "
                          "config may change]):", width)
    section = None
    for key, help_text, default in config_fields():
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
