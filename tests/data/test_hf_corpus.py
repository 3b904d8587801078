"""dataset=hf: any Hugging Face dataset through ``datasets.load_dataset``, tested offline on local
jsonl, parquet and text files made from Brown documents (a hub id is only checked to fail clearly)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from looplm.config import Config, ConfigError, DataConfig
from looplm.data.corpora import brown_documents, load_split_documents, source_fingerprint
from looplm.data.paths import resolve_data_root

datasets = pytest.importorskip("datasets")

ROOT = Path(".")


@pytest.fixture(scope="module")
def docs() -> list[str]:
    """60 real documents (the first Brown documents, cut to ~1,500 characters each)."""
    return [d[:1500] for d in brown_documents(resolve_data_root("") / "brown" / "brown_untagged.txt")[:60]]


def _jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)))
    return path


def test_jsonl_file_sliced_into_splits(tmp_path, docs):
    path = _jsonl(tmp_path / "docs.jsonl", docs)
    cfg = DataConfig(dataset="hf", hf_path=str(path), hf_splits=["train[:50]", "train[50:55]", "train[55:]"])
    got = {s: load_split_documents(cfg, s, ROOT) for s in ("train", "valid", "test")}
    assert got == {"train": docs[:50], "valid": docs[50:55], "test": docs[55:]}
    pct = cfg.replace(hf_splits=["train[:80%]", "train[80%:90%]", "train[90%:]"])
    assert [len(load_split_documents(pct, s, ROOT)) for s in ("train", "valid", "test")] == [48, 6, 6]
    # the cache key follows the file's content and the split spec, not its name or time
    fps = {s: source_fingerprint(cfg, s, ROOT) for s in ("train", "valid", "test")}
    assert len(set(fps.values())) == 3
    copy = _jsonl(tmp_path / "copy.jsonl", docs)
    assert source_fingerprint(cfg.replace(hf_path=str(copy)), "train", ROOT) == fps["train"]
    _jsonl(path, docs[::-1])
    assert source_fingerprint(cfg, "train", ROOT) != fps["train"]
    assert source_fingerprint(cfg.replace(text_column="id"), "valid", ROOT) != fps["valid"]


def test_parquet_folder_with_split_files_and_token_stream(tmp_path, docs):
    """A folder's split names come from its file names; the token stream joins documents with
    <|endoftext|> (as Brown's), built once into the token cache."""
    from looplm.data.tokenizer import get_tokenizer
    from looplm.data.tokens import load_tokens, tokens_cache_path

    folder = tmp_path / "pq"
    folder.mkdir()
    for name, part in (("train", docs[:40]), ("validation", docs[40:50]), ("test", docs[50:])):
        datasets.Dataset.from_dict({"body": part, "n": list(range(len(part)))}).to_parquet(str(folder / f"{name}.parquet"))
    cfg = DataConfig(dataset="hf", hf_path=str(folder), text_column="body", tokenizer="gpt2")
    assert load_split_documents(cfg, "valid", ROOT) == docs[40:50]
    root = resolve_data_root("")
    tok = get_tokenizer(cfg, root, tmp_path / "cache")
    stream = load_tokens(cfg, "test", tok, root, tmp_path / "cache")
    assert tok.decode(stream.tolist(), skip_special_tokens=False) == "<|endoftext|>".join(docs[50:])
    assert tokens_cache_path(cfg, "test", tok, root, tmp_path / "cache").is_file()
    with pytest.raises(ValueError, match=r"data.text_column: .* has no column 'text'; its columns: body, n"):
        load_split_documents(cfg.replace(text_column="text"), "train", ROOT)
    with pytest.raises(ValueError, match="data.text_column: 'n' of .* holds int values, not text"):
        load_split_documents(cfg.replace(text_column="n"), "train", ROOT)


def test_text_file_paragraphs_are_documents(tmp_path, docs):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(d.replace("\n", " ") for d in docs[:10]) + "\n")
    cfg = DataConfig(dataset="hf", hf_path=str(path), hf_splits=["train[:6]", "train[6:8]", "train[8:]"])
    got = load_split_documents(cfg, "train", ROOT)
    assert [g.strip() for g in got] == [d.replace("\n", " ").strip() for d in docs[:6]]


def test_split_errors_and_config_checks(tmp_path, docs):
    path = _jsonl(tmp_path / "docs.jsonl", docs)
    cfg = DataConfig(dataset="hf", hf_path=str(path))  # default splits: train, validation, test
    with pytest.raises(ValueError, match=r"data.hf_splits\[1\]: .* has no split 'validation' .*its splits: train "
                                         r"\(slices of one also work, e.g. train\[:90%\]\)"):
        load_split_documents(cfg, "valid", ROOT)
    with pytest.raises(ValueError, match=r"data.hf_splits\[0\]: bad split spec 'train\[:abc\]'"):
        load_split_documents(cfg.replace(hf_splits=["train[:abc]", "train", "train"]), "train", ROOT)
    with pytest.raises(ConfigError, match="data.hf_path: dataset=hf needs a hub dataset id or a local"):
        DataConfig(dataset="hf")
    with pytest.raises(ConfigError, match="data.hf_splits: must be three split specs"):
        DataConfig(dataset="hf", hf_path="x", hf_splits=["train", "test"])
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "a.csv").write_text("text\nx\n")
    with pytest.raises(ValueError, match="data.hf_path: .*bin holds no data files"):
        load_split_documents(cfg.replace(hf_path=str(tmp_path / "bin")), "train", ROOT)
    # the fields do not change the results-store identity of other datasets (a config file states them)
    from looplm.analysis.store import config_hash
    from looplm.presets import PRESETS

    d = PRESETS["debug"].to_dict()
    for name in ("hf_path", "hf_name", "hf_splits", "text_column"):
        del d["data"][name]
    with pytest.raises(ConfigError, match="data.hf_path: missing"):
        Config.from_dict(d)
    assert config_hash(d) == config_hash(PRESETS["debug"])
    hf = PRESETS["debug"].replace(data=cfg)
    assert config_hash(hf) != config_hash(hf.replace(data=cfg.replace(text_column="body")))


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    """Not a local path → a hub id; offline, loading names the id and the remedy (no network: offline mode)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    cfg = DataConfig(dataset="hf", hf_path="looplm-tests/no-such-dataset", hf_name="en")
    assert source_fingerprint(cfg, "train", ROOT) != source_fingerprint(cfg.replace(hf_name="de"), "train", ROOT)
    with pytest.raises(FileNotFoundError, match=r"data.hf_path 'looplm-tests/no-such-dataset' is not a local file "
                                                r"or folder, so it is read as a Hugging Face hub dataset id "
                                                r"\(config 'en'\); loading its train split .* failed"):
        load_split_documents(cfg, "train", ROOT)


def test_train_cli_on_a_local_jsonl(tmp_path, docs):
    """`looplm train --data.dataset hf ...`: the debug preset trains 2 steps on a local jsonl file."""
    import torch

    from looplm.cli import main

    path = _jsonl(tmp_path / "docs.jsonl", docs)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["train", "--preset", "debug", "--out", str(tmp_path / "run"), "--data.dataset", "hf",
                     "--data.hf_path", str(path), "--data.hf_splits", "train[:50],train[50:55],train[55:]",
                     "--data.cache_dir", str(tmp_path / "cache"), "--train.steps", "2", "--train.eval_every", "0",
                     "--train.ckpt_every", "0", "--quiet"]) == 0
    finally:
        torch.set_num_threads(n)
    saved = Config.from_json((tmp_path / "run" / "config.json").read_text())
    assert saved.data.hf_splits == ["train[:50]", "train[50:55]", "train[55:]"] and saved.data.dataset == "hf"
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
