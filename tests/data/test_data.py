"""Data layer: corpora, tokenizers, token caches and batches, each checked against a reference.

References: shared/data/SOURCES.md (counts and hashes), GPT-2's published ids, SPEC §11 (Brown split),
and hand-computed values. Offline; needs the shared data directory (skipped with a reason otherwise).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import sys
import types
from pathlib import Path
from typing import get_args

import numpy as np
import pytest
import torch

from looplm.config import DataConfig, DatasetName
from looplm.data import tokens as tokens_mod
from looplm.data.corpora import CORPORA, brown_documents, brown_split, get_corpus, load_split_text, source_fingerprint
from looplm.data.paths import atomic_write, resolve_cache_dir, resolve_data_root
from looplm.data.tokenizer import eot_id, get_tokenizer, load_gpt2_tokenizer, text_chunks, train_bpe_tokenizer
from looplm.data.tokens import eval_windows, load_tokens, sample_batch, tokens_cache_path, unigram_ppl

ROOT = resolve_data_root("")
BROWN = ROOT / "brown" / "brown_untagged.txt"
needs_data = pytest.mark.skipif(not BROWN.is_file(),
                                reason=f"shared data not found at {ROOT} (set LOOPLM_DATA)")


@pytest.fixture(scope="module")
def gpt2():
    if not (ROOT / "gpt2-tokenizer" / "vocab.json").is_file():
        pytest.skip(f"GPT-2 tokenizer files not found under {ROOT}")
    return load_gpt2_tokenizer(ROOT)


@pytest.fixture(scope="module")
def brown_docs():
    if not BROWN.is_file():
        pytest.skip(f"{BROWN} not found")
    return brown_documents(BROWN)


# --- paths -------------------------------------------------------------------------------------


def test_resolve_paths_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("LOOPLM_DATA", str(tmp_path / "env"))
    monkeypatch.setenv("LOOPLM_CACHE", str(tmp_path / "envcache"))
    assert resolve_data_root("/x/y") == Path("/x/y")
    assert resolve_data_root("") == tmp_path / "env"
    assert resolve_cache_dir("/c") == Path("/c")
    assert resolve_cache_dir("") == tmp_path / "envcache"
    monkeypatch.delenv("LOOPLM_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_cache_dir("") == tmp_path / ".cache" / "looplm"


# --- corpora -----------------------------------------------------------------------------------


def test_registry_matches_config_literal():
    assert set(CORPORA) == set(get_args(DatasetName)) - {"task"}  # tasks are generated: looplm.tasks
    with pytest.raises(ValueError, match="unknown split 'dev'; known: train, valid, test"):
        load_split_text(DataConfig(), "dev", ROOT)


def test_unknown_dataset_lists_known_names():

    with pytest.raises(ValueError, match="unknown dataset 'pile'; known: brown, c4, hf, openwebtext, text, "
                                         "wikitext103, wikitext2"):
        get_corpus("pile")


@needs_data
def test_brown_documents_and_split_sizes(brown_docs):
    assert len(brown_docs) == 500
    assert sum(d.count("\n") + 1 for d in brown_docs) == 57_340  # SOURCES.md sentence count
    split = brown_split(brown_docs)
    assert {k: len(v) for k, v in split.items()} == {"train": 450, "valid": 25, "test": 25}
    assert split["valid"][0] is brown_docs[18] and split["valid"][1] is brown_docs[38]
    assert split["test"][0] is brown_docs[19]
    assert split["train"][18] is brown_docs[20]
    assert brown_docs[0].startswith("The Fulton County Grand Jury said Friday")
    text = load_split_text(DataConfig(dataset="brown"), "valid", ROOT)
    assert text == "\n\n".join(split["valid"])


@needs_data
@pytest.mark.parametrize("split, size, sha", [
    ("valid", 1146846, "4cd0f6876d07a413aa911261ff6d363c72d757d47f0fdd6015702014c89cb9c7"),
    ("test", 1290590, "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08"),
])
def test_wikitext2_crlf_normalized(split, size, sha):
    data = load_split_text(DataConfig(dataset="wikitext2"), split, ROOT).encode("utf-8")
    assert (len(data), hashlib.sha256(data).hexdigest()) == (size, sha)  # SOURCES.md, after LF


def test_missing_wikitext2_train_names_the_file(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    cfg = DataConfig(dataset="wikitext2")
    expected = str(tmp_path / "wikitext-2-raw" / "wiki.train.raw")
    for fn in (load_split_text, source_fingerprint):
        with pytest.raises(FileNotFoundError, match="wiki.train.raw") as e:
            fn(cfg, "train", tmp_path)
        msg = str(e.value)
        assert expected in msg and "LOOPLM_DATA" in msg and "pip install datasets" in msg


def test_wikitext_hub_failure_and_rows(monkeypatch, tmp_path):
    fake = types.ModuleType("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("offline")

    fake.load_dataset = offline
    monkeypatch.setitem(sys.modules, "datasets", fake)
    cfg = DataConfig(dataset="wikitext2")
    with pytest.raises(FileNotFoundError, match="wiki.train.raw.*hub failed: ConnectionError"):
        load_split_text(cfg, "train", tmp_path)
    # Hub rows keep "\n" but store the raw file's " \n" blank lines as empty rows.
    calls = []

    def rows(path, name, split):
        calls.append((path, name, split))
        return {"text": ["", " = A = \n", "", " Body .\n"]}

    fake.load_dataset = rows
    assert load_split_text(cfg, "valid", tmp_path) == " \n = A = \n \n Body .\n"
    assert calls == [("Salesforce/wikitext", "wikitext-2-raw-v1", "validation")]


def test_text_corpus_crlf_and_missing_file(tmp_path):
    files = [tmp_path / f"{s}.txt" for s in ("train", "valid", "test")]
    for f in files:
        f.write_bytes(b"line one\r\nline two\r\n")
    cfg = DataConfig(dataset="text", text_files=[str(f) for f in files])
    assert load_split_text(cfg, "test", tmp_path) == "line one\nline two\n"
    files[1].unlink()
    with pytest.raises(FileNotFoundError, match=r"valid\.txt.*text_files\[1\]"):
        load_split_text(cfg, "valid", tmp_path)


# --- tokenizers --------------------------------------------------------------------------------


@needs_data
def test_gpt2_known_ids_and_round_trip(gpt2):
    assert gpt2.encode("Hello world").ids == [15496, 995]
    assert gpt2.get_vocab_size() == 50257 and eot_id(gpt2) == 50256
    assert gpt2.encode("a<|endoftext|>b").ids == [64, 50256, 65]
    text = load_split_text(DataConfig(dataset="wikitext2"), "test", ROOT)
    paragraph = text.split("\n")[3]
    assert paragraph.startswith(" Robert Boulter is an English film")
    assert gpt2.decode(gpt2.encode(paragraph).ids) == paragraph
    # Cutting text into chunks at the allowed newlines gives the same ids as encoding it whole.
    part = text[:60_000]
    chunks = list(text_chunks(part, 2_000))
    assert len(chunks) > 10 and "".join(chunks) == part
    assert [i for c in chunks for i in gpt2.encode(c).ids] == gpt2.encode(part).ids


@needs_data
def test_bpe_training_is_deterministic(brown_docs):
    text = "\n\n".join(brown_split(brown_docs)["train"][:15])
    a, b = train_bpe_tokenizer(text, 512), train_bpe_tokenizer(text, 512)
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() == 512 and eot_id(a) == 0
    held_out = brown_split(brown_docs)["test"][0][:2000]
    assert a.decode(a.encode(held_out).ids) == held_out


def _text_cfg(tmp_path: Path, train: str, **kw) -> DataConfig:
    paths = []
    for split, body in (("train", train), ("valid", "valid text .\n"), ("test", "test text .\n")):
        paths.append(tmp_path / f"{split}.txt")
        paths[-1].write_text(body, encoding="utf-8")
    return DataConfig(dataset="text", text_files=[str(p) for p in paths], **kw)


def test_bpe_tokenizer_cached(tmp_path):
    cfg = _text_cfg(tmp_path, "the cat sat on the mat .\n" * 200, tokenizer="bpe", bpe_vocab_size=300)
    tok = get_tokenizer(cfg, tmp_path, tmp_path / "cache")
    (path,) = (tmp_path / "cache" / "tokenizers").glob("*.json")
    fp12 = source_fingerprint(cfg, "train", tmp_path)[:12]
    assert path.name == f"text-bpe300-{fp12}.json"
    mtime = path.stat().st_mtime_ns
    assert get_tokenizer(cfg, tmp_path, tmp_path / "cache").to_str() == tok.to_str()
    assert path.stat().st_mtime_ns == mtime


# --- token streams -----------------------------------------------------------------------------


@needs_data
def test_token_cache_reused_and_rebuilt(gpt2, tmp_path):
    cache = tmp_path / "cache"
    cfg = _text_cfg(tmp_path, "Hello world\nHello world\n")
    toks = load_tokens(cfg, "train", gpt2, tmp_path, cache)
    assert toks.dtype == np.uint16 and toks.tolist() == [15496, 995, 198, 15496, 995, 198]
    path = tokens_cache_path(cfg, "train", gpt2, tmp_path, cache)
    mtime = path.stat().st_mtime_ns
    assert load_tokens(cfg, "train", gpt2, tmp_path, cache).tolist() == toks.tolist()
    assert path.stat().st_mtime_ns == mtime  # reused, not rebuilt
    Path(cfg.text_files[0]).write_text("Hello\n", encoding="utf-8")
    new_path = tokens_cache_path(cfg, "train", gpt2, tmp_path, cache)
    assert new_path != path
    assert load_tokens(cfg, "train", gpt2, tmp_path, cache).tolist() == [15496, 198]
    assert sorted(p.name for p in (cache / "tokens").iterdir()) == sorted([path.name, new_path.name])


@needs_data
def test_killed_token_build_leaves_no_file(gpt2, tmp_path, monkeypatch):
    cfg = _text_cfg(tmp_path, "Hello world\n")

    def crash(*args, **kwargs):
        yield np.array([1, 2, 3], dtype=np.uint16)
        raise KeyboardInterrupt

    monkeypatch.setattr(tokens_mod, "encode_documents", crash)
    with pytest.raises(KeyboardInterrupt):
        load_tokens(cfg, "train", gpt2, tmp_path, tmp_path / "cache")
    assert list((tmp_path / "cache" / "tokens").iterdir()) == []


@needs_data
def test_brown_stream_has_eot_between_documents(gpt2, brown_docs, tmp_path):
    toks = load_tokens(DataConfig(dataset="brown"), "valid", gpt2, ROOT, tmp_path)
    valid = brown_split(brown_docs)["valid"]
    assert int((toks == 50256).sum()) == len(valid) - 1
    assert gpt2.decode(toks.tolist(), skip_special_tokens=False) == "<|endoftext|>".join(valid)


# --- batches -----------------------------------------------------------------------------------


def test_sample_batch_deterministic_windows():
    tokens = np.arange(1000, dtype=np.uint16)  # x rows are runs o..o+L-1, so y must be x + 1
    x, y = sample_batch(tokens, 8, 16, seed=3, step=7)
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1) and torch.equal(x[:, 1:], x[:, :-1] + 1)  # exact: integers
    assert int(x.max()) + 1 <= 999
    x2, _ = sample_batch(tokens, 8, 16, seed=3, step=7)
    assert torch.equal(x, x2)  # exact: a pure function of (seed, step, micro)
    for other in ({"seed": 4, "step": 7}, {"seed": 3, "step": 8}, {"seed": 3, "step": 7, "micro": 1}):
        assert not torch.equal(x, sample_batch(tokens, 8, 16, **other)[0])
    with pytest.raises(ValueError, match="seq_len \\+ 1 = 17"):
        sample_batch(tokens[:16], 1, 16, seed=0, step=0)


@pytest.mark.parametrize("n", [1, 2, 10, 17, 33, 100, 1001])
@pytest.mark.parametrize("stride", [None, 1, 5, 16])
def test_eval_windows_score_each_target_once(n, stride):
    tokens = np.arange(7, 7 + n, dtype=np.uint16)
    L, B = 16, 3
    batches = list(eval_windows(tokens, L, B, stride=stride))
    assert all(x.shape[0] == B for x, _, _ in batches[:-1])
    scored_y = torch.cat([y[m] for _, y, m in batches]) if batches else torch.zeros(0, dtype=torch.int64)
    scored_x = torch.cat([x[m] for x, _, m in batches]) if batches else torch.zeros(0, dtype=torch.int64)
    assert len(scored_y) == n - 1
    assert scored_y.tolist() == tokens[1:].tolist()  # each target once, in stream order
    assert scored_x.tolist() == tokens[:-1].tolist()  # and predicted from the right input
    for x, y, m in batches:
        real = (x != 0) | (y != 0)  # tokens start at 7, so 0 only appears as padding
        assert not (m & ~real).any()
        if stride is not None and n > L:
            assert real.all()  # sliding windows are full length: every target has context


def test_eval_windows_sliding_context_and_max_batches():
    tokens = np.arange(1, 101, dtype=np.uint16)
    (x0, y0, m0), (x1, y1, m1) = list(eval_windows(tokens, 16, 1, stride=4, max_batches=2))
    assert m0.sum() == 16 and m1.sum() == 4
    assert x1[0].tolist() == list(range(5, 21)) and y1[0][m1[0]].tolist() == [18, 19, 20, 21]


def test_unigram_ppl_hand_computed():
    # add-one counts on train [0, 0, 1] with V=3: p = (3, 2, 1)/6; test targets (0, 1).
    ppl = unigram_ppl(np.array([0, 0, 1]), np.array([2, 0, 1]), 3)
    assert ppl == pytest.approx(np.exp(-(np.log(3 / 6) + np.log(2 / 6)) / 2))


def test_tokenizing_progress_bar_follows_progress(gpt2, capsys):
    """The tokenizing bar (shown above 1M characters) is off with progress=False (`--quiet`); the ids
    are the same either way."""
    docs = ["the cat sat on the mat. " * 45_000]  # 1.08M characters
    quiet = np.concatenate(list(tokens_mod.encode_documents(docs, gpt2, progress=False)))
    assert capsys.readouterr().err == ""
    loud = np.concatenate(list(tokens_mod.encode_documents(docs, gpt2)))
    assert "tokenizing" in capsys.readouterr().err
    assert np.array_equal(quiet, loud)


def test_non_utf8_text_corpus_names_file_and_offset_and_leaves_no_run_folder(tmp_path, capsys):
    from looplm.cli import main

    cfg = _text_cfg(tmp_path, "fine text .\n")
    bad = Path(cfg.text_files[0])
    body = b"caf\xc3\xa9 ok\nna\xefve latin-1\n"  # a valid 2-byte character, then a latin-1 byte
    bad.write_bytes(body)
    at = body.index(b"\xef")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(bad))}: not UTF-8 text: byte offset {at} "):
        load_split_text(cfg, "train", tmp_path)
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--quiet", "--data.dataset", "text", "--data.tokenizer", "bpe",
            "--data.text_files", ",".join(cfg.text_files), "--data.cache_dir", str(tmp_path / "cache")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{bad}: not UTF-8 text: byte offset {at}" in err
    assert not out.exists()  # no folder with a stale .lock


def test_non_utf8_local_hf_text_file_is_one_line(tmp_path):
    bad = tmp_path / "corpus.txt"
    body = b"first paragraph\n\nsecond \xff\n"
    bad.write_bytes(body)
    cfg = DataConfig(dataset="hf", hf_path=str(bad), hf_splits=["train", "train", "train"])
    at = body.index(b"\xff")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(bad))}: not UTF-8 text: byte offset {at} ") as info:
        load_split_text(cfg, "train", tmp_path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_atomic_write_gives_the_mode_of_a_plain_open(tmp_path, umask):
    """mkstemp creates 0o600; the renamed file must be readable as a plain ``open()``'s would be (0o666 & ~umask),
    a new file and a replaced one alike."""
    old = os.umask(umask)
    try:
        (tmp_path / "plain.json").write_text("{}")
        for _ in range(2):
            with atomic_write(tmp_path / "atomic.json") as f:
                f.write(b"{}")
            assert stat.S_IMODE((tmp_path / "atomic.json").stat().st_mode) == 0o666 & ~umask
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "plain.json").stat().st_mode) == 0o666 & ~umask
