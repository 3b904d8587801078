"""Corpus registry: raw text of the train / valid / test split of each dataset (SPEC §5, §11).

A split is a list of documents (the token stream puts the end-of-text token between them). Registered names
(= the ``DataConfig.dataset`` Literal, tested):

- ``brown``: ``<data_root>/brown/brown_untagged.txt``, 500 documents split by index i: ``i % 20`` 18 → valid,
  19 → test, else train (450 / 25 / 25; SPEC §11, our choice).
- ``wikitext2`` / ``wikitext103``: ``<data_root>/wikitext-{2,103}-raw/wiki.{split}.raw``, else the hub.
- ``text``: ``DataConfig.text_files = [train, valid, test]``, local UTF-8.
- ``openwebtext`` (hub, ``train`` rows [0, 200,000) / next 4,096 / next 4,096) and ``c4`` (hub, ``en``: the first
  100,000 ``train`` rows; ``validation`` rows [0, 4,096) valid (SCSE's slice), [4,096, 8,192) test) (SPEC §5).
- ``hf``: anything ``datasets.load_dataset`` reads: ``hf_path`` a local json/jsonl/parquet/txt file or folder,
  else a hub id; ``hf_splits`` the three split specs; one document per row (per paragraph of a ``.txt``).

Hub fingerprints need no network, so a token cache built online is reused offline; without a cache,
``datasets`` or the hub, loading raises FileNotFoundError naming the remedy.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from looplm.config import DataConfig

SPLITS: tuple[str, ...] = ("train", "valid", "test")
BROWN_FILE = "brown/brown_untagged.txt"
_BROWN_SPLIT_VERSION = "brown-mod20-v1"  # bump if the document split rule ever changes


@dataclass(frozen=True)
class Corpus:
    """A dataset: ``documents(cfg, split, data_root)`` and ``fingerprint`` (a cheap string that changes when the
    split's text can: the cache key); both raise FileNotFoundError naming the missing source."""

    name: str
    documents: Callable[[DataConfig, str, Path], list[str]]
    fingerprint: Callable[[DataConfig, str, Path], str]
    separator: str  # joins documents back into the split's text


def get_corpus(name: str) -> Corpus:
    """The registered corpus called ``name``; ValueError listing the known names otherwise."""
    if name not in CORPORA:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(sorted(CORPORA))}")
    return CORPORA[name]


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")


def load_split_documents(cfg: DataConfig, split: str, data_root: Path) -> list[str]:
    """Documents of ``split`` of ``cfg.dataset`` in file order (ValueError: unknown dataset or split)."""
    _check_split(split)
    return get_corpus(cfg.dataset).documents(cfg, split, Path(data_root))


def load_split_text(cfg: DataConfig, split: str, data_root: Path) -> str:
    """The documents of ``split`` joined with the corpus's separator (LF line endings)."""
    return get_corpus(cfg.dataset).separator.join(load_split_documents(cfg, split, data_root))


def source_fingerprint(cfg: DataConfig, split: str, data_root: Path) -> str:
    """sha256 hex of the corpus's fingerprint of ``split`` (a file's hash, or the hub id and slice): a cache key."""
    _check_split(split)
    desc = get_corpus(cfg.dataset).fingerprint(cfg, split, Path(data_root))
    return hashlib.sha256(desc.encode()).hexdigest()


_FILE_SHA: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """sha256 hex digest of the bytes of ``path`` (memoized on path, size and mtime)."""
    st = os.stat(path)
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
    if key not in _FILE_SHA:
        with open(path, "rb") as f:
            _FILE_SHA[key] = hashlib.file_digest(f, "sha256").hexdigest()
    return _FILE_SHA[key]


def read_text_lf(path: Path) -> str:
    """A UTF-8 text file with CRLF → LF (:func:`check_utf8`)."""
    return check_utf8(path).replace("\r\n", "\n")


def check_utf8(path: Path) -> str:
    """The text of ``path`` as UTF-8; ValueError naming the file and the first bad byte's offset."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text: byte offset {e.start} holds {data[e.start:e.end + 3]!r} "
                         f"({e.reason}); convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


# --- brown ------------------------------------------------------------------------------------


def brown_documents(path: Path) -> list[str]:
    """Documents of ``brown_untagged.txt`` (a blank line ends each; its sentence lines joined with ``"\\n"``):
    500 documents, 57,340 sentences in the shared copy."""
    docs: list[str] = []
    sentences: list[str] = []
    for line in [*read_text_lf(path).split("\n"), ""]:  # "": the last document ends too
        if line.strip():
            sentences.append(line)
        elif sentences:
            docs.append("\n".join(sentences))
            sentences = []
    return docs


def brown_split(docs: list[str]) -> dict[str, list[str]]:
    """Split documents by 0-based index i (SPEC §11): ``i % 20`` 18 → valid, 19 → test, else train."""
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    for i, doc in enumerate(docs):
        out["valid" if i % 20 == 18 else "test" if i % 20 == 19 else "train"].append(doc)
    return out


def _brown_path(data_root: Path) -> Path:
    path = data_root / BROWN_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"Brown corpus not found: {path}. Put brown_untagged.txt (one sentence per line, a blank "
            f"line after each of the 500 documents; see shared/data/SOURCES.md) there, or set "
            f"LOOPLM_DATA / data.data_root to a directory that has {BROWN_FILE}.")
    return path


def _brown_docs(cfg: DataConfig, split: str, data_root: Path) -> list[str]:
    return brown_split(brown_documents(_brown_path(data_root)))[split]


def _brown_fingerprint(cfg: DataConfig, split: str, data_root: Path) -> str:
    return f"brown:{split}:{_BROWN_SPLIT_VERSION}:{file_sha256(_brown_path(data_root))}"


# --- wikitext ---------------------------------------------------------------------------------

_HF_SPLIT = {"train": "train", "valid": "validation", "test": "test"}


def _from_hub(load: Callable[[], Any], missing: Callable[[str], FileNotFoundError]) -> Any:
    """``load()``, or ``missing(why)`` raised when ``datasets`` is not installed or the hub fails."""
    try:
        importlib.import_module("datasets")
    except ImportError:
        raise missing("the `datasets` package is not installed") from None
    try:
        return load()
    except Exception as e:  # offline, hub down, auth …: all end in the same advice
        raise missing(f"the hub failed: {type(e).__name__}: {e}") from e


def _wikitext_hub_text(hub_config: str, split: str) -> str:
    """A raw WikiText split from ``Salesforce/wikitext`` rows, byte for byte (empty rows were ``" \\n"``)."""
    import datasets

    ds = datasets.load_dataset("Salesforce/wikitext", hub_config, split=_HF_SPLIT[split])
    return "".join(row if row else " \n" for row in ds["text"])


def _wikitext(dirname: str, hub_config: str) -> tuple[Callable, Callable]:
    def local_path(data_root: Path, split: str) -> Path:
        return data_root / dirname / f"wiki.{split}.raw"

    def missing(path: Path, split: str) -> Callable[[str], FileNotFoundError]:
        return lambda why: FileNotFoundError(
            f"{path} not found (and {why}). Put the raw WikiText file wiki.{split}.raw there, set "
            f"LOOPLM_DATA / data.data_root to a directory with {dirname}/wiki.{split}.raw, or "
            f"`pip install datasets` while online to load Salesforce/wikitext {hub_config} from "
            f"the Hugging Face hub.")

    def documents(cfg: DataConfig, split: str, data_root: Path) -> list[str]:
        path = local_path(data_root, split)
        if path.is_file():
            return [read_text_lf(path)]
        return _from_hub(lambda: [_wikitext_hub_text(hub_config, split)], missing(path, split))

    def fingerprint(cfg: DataConfig, split: str, data_root: Path) -> str:
        path = local_path(data_root, split)
        if path.is_file():
            return f"{cfg.dataset}:{split}:file:{file_sha256(path)}"
        return _from_hub(lambda: f"{cfg.dataset}:{split}:hub:Salesforce/wikitext:{hub_config}:{_HF_SPLIT[split]}",
                         missing(path, split))

    return documents, fingerprint


# --- text (local files) -----------------------------------------------------------------------


def _text_path(cfg: DataConfig, split: str) -> Path:
    if len(cfg.text_files) != 3:
        raise ValueError("data.text_files: dataset=text needs three paths: train, valid, test")
    path = Path(cfg.text_files[SPLITS.index(split)]).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: data.text_files[{SPLITS.index(split)}] must be "
                                f"the {split} split as a UTF-8 plain-text file")
    return path


def _text_docs(cfg: DataConfig, split: str, data_root: Path) -> list[str]:
    return [read_text_lf(_text_path(cfg, split))]


def _text_fingerprint(cfg: DataConfig, split: str, data_root: Path) -> str:
    return f"text:{split}:{file_sha256(_text_path(cfg, split))}"


# --- hub-only corpora (openwebtext, c4) -------------------------------------------------------

_HUB_SLICE_VERSION = "hub-slice-v1"  # bump if a slice rule below ever changes


@dataclass(frozen=True)
class HubSlice:
    """Rows ``[start, stop)`` of split ``hub_split`` of hub dataset ``hub_id`` (config ``hub_config``)."""

    hub_id: str
    hub_config: str | None
    hub_split: str
    start: int
    stop: int


def _hub_rows(sl: HubSlice) -> list[str]:
    """The ``text`` of the slice's rows, streamed (ValueError when the split is shorter)."""
    import datasets

    ds = datasets.load_dataset(sl.hub_id, sl.hub_config, split=sl.hub_split, streaming=True)
    rows = [row["text"] for row in itertools.islice(ds, sl.start, sl.stop)]
    if len(rows) != sl.stop - sl.start:
        raise ValueError(f"{sl.hub_id} {sl.hub_split}: expected rows [{sl.start}, {sl.stop}), the split "
                         f"ended after {sl.start + len(rows)}")
    return rows


def _hub_corpus(name: str, slices: dict[str, HubSlice]) -> Corpus:
    def documents(cfg: DataConfig, split: str, data_root: Path) -> list[str]:
        sl = slices[split]
        cfg_txt = f" (config {sl.hub_config!r})" if sl.hub_config else ""
        return _from_hub(lambda: _hub_rows(sl), lambda why: FileNotFoundError(
            f"dataset {name!r} ({split} split) is loaded from the Hugging Face hub: {sl.hub_id}{cfg_txt}, "
            f"{sl.hub_split} rows [{sl.start}, {sl.stop}) — {why}. Go online and `pip install datasets`; "
            f"once tokenized, the split is reused offline from the token cache (LOOPLM_CACHE)."))

    def fingerprint(cfg: DataConfig, split: str, data_root: Path) -> str:
        sl = slices[split]
        return (f"{name}:{split}:hub:{sl.hub_id}:{sl.hub_config}:{sl.hub_split}:{sl.start}:{sl.stop}:"
                f"{_HUB_SLICE_VERSION}")

    return Corpus(name, documents, fingerprint, "\n\n")


OPENWEBTEXT_SLICES = {
    "train": HubSlice("Skylion007/openwebtext", None, "train", 0, 200_000),
    "valid": HubSlice("Skylion007/openwebtext", None, "train", 200_000, 204_096),
    "test": HubSlice("Skylion007/openwebtext", None, "train", 204_096, 208_192),
}
C4_SLICES = {
    "train": HubSlice("allenai/c4", "en", "train", 0, 100_000),
    "valid": HubSlice("allenai/c4", "en", "validation", 0, 4_096),
    "test": HubSlice("allenai/c4", "en", "validation", 4_096, 8_192),
}


# --- hf (any Hugging Face dataset, or local json/jsonl/parquet/text files) ---------------------

#: local file extension → ``datasets`` packaged builder
HF_LOCAL_BUILDERS: dict[str, str] = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text",
                                     ".text": "text"}
_HF_CORPUS_VERSION = "hf-v1"  # bump if the row → document rule below ever changes


def _hf_local_files(path: Path) -> tuple[str, list[Path]]:
    """(builder, files) of a local ``data.hf_path`` file or folder; ValueError: no files, unknown or mixed types."""
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in HF_LOCAL_BUILDERS
        and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise ValueError(f"data.hf_path: {path} holds no data files ({', '.join(HF_LOCAL_BUILDERS)})")
    builders = {HF_LOCAL_BUILDERS.get(p.suffix.lower()) for p in files}
    if None in builders:
        raise ValueError(f"data.hf_path: {path}: unknown file type {path.suffix!r}; allowed: "
                         f"{', '.join(HF_LOCAL_BUILDERS)}")
    if len(builders) > 1:
        raise ValueError(f"data.hf_path: {path} mixes file formats ({', '.join(sorted(builders))}); keep one")
    return builders.pop(), files


def _hf_local(cfg: DataConfig) -> Path | None:
    """``data.hf_path`` as a local file or folder, or None when it is not one (then: a hub id)."""
    path = Path(cfg.hf_path).expanduser()
    return path if path.exists() else None


def _hf_rows(cfg: DataConfig, split: str) -> list[str]:
    """The ``text_column`` of split spec ``hf_splits[i]``; ValueError naming the splits or columns there are."""
    import datasets

    i = SPLITS.index(split)
    spec = cfg.hf_splits[i]
    local = _hf_local(cfg)
    if local is not None:
        builder, files = _hf_local_files(local)
        for f in files if builder in ("text", "json") else ():  # fail in one line, not in `datasets`
            check_utf8(f)
        kwargs = {"sample_by": "paragraph"} if builder == "text" else {}  # text: a paragraph is a document
        # a file is one split called train; a folder's split names come from its file names
        source = {"data_files": {"train": str(local)}} if local.is_file() else {"data_dir": str(local)}
        load = functools.partial(datasets.load_dataset, builder, **source, **kwargs)
        where = str(local)
    else:
        load = functools.partial(datasets.load_dataset, cfg.hf_path, cfg.hf_name or None)
        where = f"hub dataset {cfg.hf_path}" + (f" (config {cfg.hf_name})" if cfg.hf_name else "")
    splits = list(load(split=None))
    base = spec.split("[", 1)[0].strip()
    if base not in splits:
        raise ValueError(f"data.hf_splits[{i}]: {where} has no split {base!r} (in {spec!r}); its splits: "
                         f"{', '.join(splits)} (slices of one also work, e.g. {splits[0]}[:90%])")
    try:
        ds = load(split=spec)
    except ValueError as e:
        raise ValueError(f"data.hf_splits[{i}]: bad split spec {spec!r} for {where}: {e}") from None
    if cfg.text_column not in ds.column_names:
        raise ValueError(f"data.text_column: {where} has no column {cfg.text_column!r}; its columns: "
                         f"{', '.join(ds.column_names)}")
    rows = ds[cfg.text_column]
    bad = next((r for r in rows if r is not None and not isinstance(r, str)), None)
    if bad is not None:
        raise ValueError(f"data.text_column: {cfg.text_column!r} of {where} holds {type(bad).__name__} values, "
                         "not text")
    return [r.replace("\r\n", "\n") for r in rows if r is not None]


def _hf_docs(cfg: DataConfig, split: str, data_root: Path) -> list[str]:
    try:
        importlib.import_module("datasets")
    except ImportError:
        raise FileNotFoundError("dataset 'hf' is read with the `datasets` package, which is not installed; "
                                "pip install \"looplm[hub]\"") from None
    try:
        return _hf_rows(cfg, split)
    except Exception as e:  # offline, unknown id, auth …: all end in the same advice
        # but local data, and our own messages (a split or column it lacks), raise as they are
        if _hf_local(cfg) is not None or isinstance(e, ValueError) and "data." in str(e):
            raise
        name = f" (config {cfg.hf_name!r})" if cfg.hf_name else ""
        raise FileNotFoundError(
            f"data.hf_path {cfg.hf_path!r} is not a local file or folder, so it is read as a Hugging Face hub "
            f"dataset id{name}; loading its {split} split ({cfg.hf_splits[SPLITS.index(split)]!r}) failed: "
            f"{type(e).__name__}: {e}. Check the path, or go online with `pip install \"looplm[hub]\"`; once "
            "tokenized, the split is reused offline from the token cache (LOOPLM_CACHE).") from e


def _hf_fingerprint(cfg: DataConfig, split: str, data_root: Path) -> str:
    spec = cfg.hf_splits[SPLITS.index(split)]
    what = f"{spec}|{cfg.text_column}|{_HF_CORPUS_VERSION}"
    local = _hf_local(cfg)
    if local is None:  # the hub id names the data (a dataset changed on the hub is not detected)
        return f"hf:{split}:hub:{cfg.hf_path}|{cfg.hf_name}|{what}"
    builder, files = _hf_local_files(local)
    if local.is_file():  # its content; a folder: also the file names (they name the splits)
        content = file_sha256(local)
    else:
        content = ",".join(f"{p.relative_to(local)}={file_sha256(p)}" for p in files)
    return f"hf:{split}:local:{builder}:{content}|{what}"


#: the registry: name → :class:`Corpus` (the names are the ``DataConfig.dataset`` Literal, tested)
CORPORA: dict[str, Corpus] = {c.name: c for c in (
    Corpus("brown", _brown_docs, _brown_fingerprint, "\n\n"),
    Corpus("wikitext2", *_wikitext("wikitext-2-raw", "wikitext-2-raw-v1"), ""),
    Corpus("wikitext103", *_wikitext("wikitext-103-raw", "wikitext-103-raw-v1"), ""),
    Corpus("text", _text_docs, _text_fingerprint, ""),
    _hub_corpus("openwebtext", OPENWEBTEXT_SLICES),
    _hub_corpus("c4", C4_SLICES),
    Corpus("hf", _hf_docs, _hf_fingerprint, "\n\n"))}
