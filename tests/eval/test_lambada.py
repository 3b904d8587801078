"""Held-out transfer data and LAMBADA (SPEC §5, §6, §11).

LAMBADA: the context/target split against hand-checked passages of the real file, tokenization
against GPT-2's encoding of the whole passage, and the batched multi-depth metrics against an
unbatched full forward per example. Hub corpora (openwebtext, c4): slices and offline errors with a
fake ``datasets`` module (never the network).
"""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from looplm.config import DataConfig, ModelConfig
from looplm.data.corpora import load_split_documents, source_fingerprint
from looplm.data.paths import resolve_data_root
from looplm.data.tokens import load_tokens
from looplm.eval.lambada import (EncodedExample, encode_examples, evaluate_lambada_checkpoint, lambada_path,
                                 load_lambada, score_lambada, split_passage)
from looplm.model import build_model

PATH = lambada_path(resolve_data_root(""))


@pytest.fixture(scope="module")
def lambada():
    return load_lambada(PATH)


@pytest.fixture(scope="module")
def bpe(tiny_data):
    return Tokenizer.from_str(tiny_data.tokenizer_json)


# --- LAMBADA: split and tokenization ---------------------------------------------------------------


def test_split_hand_checked_passages(lambada):
    assert len(lambada) == 5153
    first3 = [json.loads(line)["text"] for line in PATH.read_text(encoding="utf-8").splitlines()[:3]]
    expected = [  # (context tail, target), read off the file
        ("his mouth curved in a confident grin, I don't care about", " signs"),
        ('the dock.\n\n"I can make it there on my own,', " Shane"),
        ('she wailed. "What do you mean you don\'t have any', " insurance"),
    ]
    for text, ex, (tail, target) in zip(first3, lambada, expected):
        assert ex.context.endswith(tail) and ex.target == target
        assert ex.context + ex.target == text
    # quotes and punctuation stay with the word; a newline before the word stays in the context
    assert lambada[70].context.endswith("Yet he managed to whisper,") and lambada[70].target == ' "Nadia'
    assert lambada[1757].target == " thought...Tess"
    assert lambada[1053].context.endswith("sure it\u2019ll be\u2013\u201d\n") and lambada[1053].target == "\u201cSal"
    assert sum(not ex.target.startswith(" ") for ex in lambada) == 7


def test_split_edge_cases(tmp_path):
    assert split_passage("a b  c \n") == split_passage("a b  c")
    assert split_passage("a b  c").context == "a b " and split_passage("a b  c").target == " c"
    with pytest.raises(ValueError, match="context and a last word"):
        split_passage("  lonely ")
    with pytest.raises(FileNotFoundError, match="lambada_test.jsonl.*LOOPLM_DATA"):
        load_lambada(tmp_path / "lambada" / "lambada_test.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "one two"}\n{"txt": "x y"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_lambada(bad)
    assert len(load_lambada(bad, max_examples=1)) == 1


def test_gpt2_target_tokens_are_the_passage_tail(lambada):
    from looplm.data.tokenizer import load_gpt2_tokenizer

    tok = load_gpt2_tokenizer(resolve_data_root(""))
    assert encode_examples(lambada[:1], tok, 128)[0].ids[-1:] == (5895,)  # " signs"
    whole = tok.encode_batch([ex.context + ex.target for ex in lambada], add_special_tokens=False)
    enc = encode_examples(lambada, tok, 10_000)  # no truncation
    assert not any(e.truncated for e in enc)
    differ = []
    for i, (w, e) in enumerate(zip(whole, enc)):
        assert tuple(w.ids[-e.n_target:]) == e.ids[-e.n_target:]
        if tuple(w.ids) != e.ids:
            differ.append(i)  # context alone ends in "\n\n" (one token) where the passage has "\n", "\n"
    assert differ == [426, 3977, 4462]


def test_left_truncation_keeps_the_target(lambada, bpe):
    L = 32
    enc = encode_examples(lambada[:50], bpe, L)
    for ex, e in zip(lambada[:50], enc):
        ctx = bpe.encode(ex.context, add_special_tokens=False).ids
        tgt = bpe.encode(ex.target, add_special_tokens=False).ids
        assert e.ids == tuple((ctx + tgt)[-(L + 1):]) and e.n_target == len(tgt)
        assert e.truncated == (len(ctx) + len(tgt) > L + 1)
    assert sum(e.truncated for e in enc) > 40  # passages are far longer than 32 BPE-512 tokens


# --- LAMBADA: metrics ----------------------------------------------------------------------------


@torch.no_grad()
def _reference(model, encoded, depths):
    """One example at a time, a plain full forward per depth: no batching, padding or gathering."""
    model.eval()
    out = {}
    for T in depths:
        nll, hits, exact, n = 0.0, 0, 0, 0
        for e in encoded:
            x = torch.tensor(e.ids[:-1])[None]
            logits = model(x, depth=T).logits[0, -e.n_target:].double()  # (k, V)
            y = torch.tensor(e.ids[-e.n_target:])
            nll += float(-F.log_softmax(logits, dim=-1)[torch.arange(len(y)), y].sum())
            ok = logits.argmax(-1) == y
            hits, exact, n = hits + int(ok.sum()), exact + int(ok.all()), n + len(y)
        out[T] = {"target_ppl": torch.tensor(nll / n).exp().item(), "target_acc": hits / n,
                  "exact_acc": exact / len(encoded), "target_tokens": n, "examples": len(encoded)}
    return out


def _assert_matches(got, ref):
    for T, r in ref.items():
        g = got[T] if T in got else got[str(T)]
        print(T, {k: g[k] for k in r}, r)
        assert g["target_ppl"] == pytest.approx(r["target_ppl"], rel=1e-5)
        for k in ("target_acc", "exact_acc", "target_tokens", "examples"):
            assert g[k] == r[k]


@pytest.mark.parametrize("layout", [{}, {"n_prelude": 1, "n_coda": 1}], ids=["core", "prelude+coda"])
def test_batched_scores_equal_unbatched_reference(layout, lambada, bpe):
    torch.manual_seed(0)
    cfg = ModelConfig(rule="scse", vocab_size=bpe.get_vocab_size(), d_model=32, n_heads=2, d_ff=64, seq_len=32,
                      dropout=0.0, init_std=0.2, **layout)
    model = build_model(cfg).eval()
    encoded = encode_examples(lambada[:30], bpe, cfg.seq_len)
    encoded.append(encode_examples([split_passage("the cat sat on the mat")], bpe, cfg.seq_len)[0])  # short
    depths = (0, 1, 3)
    _assert_matches(score_lambada(model, encoded, depths, batch_size=7, progress=False),
                    _reference(model, encoded, depths))
    # targets that are the model's own greedy continuation at T=3, the last token spoiled in every
    # other example: known accuracies at T=3
    greedy = []
    with torch.no_grad():
        for i, e in enumerate(encoded[:8]):
            ids = list(e.ids[: -e.n_target])[-(cfg.seq_len - 1):]
            for _ in range(2):
                ids.append(int(model(torch.tensor(ids)[None], depth=3).logits[0, -1].argmax()))
            if i % 2:
                ids[-1] = (ids[-1] + 1) % cfg.vocab_size
            greedy.append(EncodedExample(tuple(ids), 2, False))
    got = score_lambada(model, greedy, depths, batch_size=3, progress=False)
    assert (got[3]["target_acc"], got[3]["exact_acc"]) == (12 / 16, 4 / 8)
    _assert_matches(got, _reference(model, greedy, depths))


def test_evaluate_lambada_checkpoint(tmp_path, tiny_cfg, tiny_data):
    from looplm.run.checkpoint import load_checkpoint
    from looplm.train.trainer import train

    run = tmp_path / "run"
    train(tiny_cfg, run, progress=False, data=tiny_data)
    res = evaluate_lambada_checkpoint(run, depths=(1, 2, 8), max_examples=12, batch_size=5, progress=False)
    json.dumps(res)
    print(res["markdown"])
    assert (res["examples"], res["dataset"], res["seq_len"]) == (12, "lambada", 32)
    assert set(res["depths"]) == {"1", "2", "8"}
    model, cfg, _, ckpt = load_checkpoint(run)
    encoded = encode_examples(load_lambada(PATH, 12), Tokenizer.from_file(str(ckpt / "tokenizer.json")), 32)
    assert res["truncated"] == sum(e.truncated for e in encoded)
    _assert_matches(res["depths"], _reference(model, encoded, (1, 2, 8)))
    assert "| tiny (LAMBADA) | T=8 |" in res["markdown"] and "| T=8 |" in res["markdown"]


# --- hub corpora (openwebtext, c4) ---------------------------------------------------------------


def _fake_datasets(monkeypatch, calls):
    fake = types.ModuleType("datasets")

    def load_dataset(path, name=None, *, split, streaming=False):
        calls.append((path, name, split, streaming))
        return ({"text": f"{path}/{split} row {i}"} for i in range(10**6))

    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    return fake


def test_hub_corpora_slices(monkeypatch, tmp_path):
    calls = []
    _fake_datasets(monkeypatch, calls)
    owt = DataConfig(dataset="openwebtext")
    docs = load_split_documents(owt, "valid", tmp_path)
    assert docs == [f"Skylion007/openwebtext/train row {i}" for i in range(200_000, 204_096)]
    assert load_split_documents(owt, "test", tmp_path)[0] == "Skylion007/openwebtext/train row 204096"
    assert len(load_split_documents(owt, "train", tmp_path)) == 200_000
    c4 = DataConfig(dataset="c4")
    assert load_split_documents(c4, "valid", tmp_path)[::4095] == ["allenai/c4/validation row 0",
                                                                   "allenai/c4/validation row 4095"]
    test = load_split_documents(c4, "test", tmp_path)
    assert (len(test), test[0]) == (4096, "allenai/c4/validation row 4096")
    assert len(load_split_documents(c4, "train", tmp_path)) == 100_000
    assert calls[-3:] == [("allenai/c4", "en", "validation", True), ("allenai/c4", "en", "validation", True),
                          ("allenai/c4", "en", "train", True)]
    assert calls[0] == ("Skylion007/openwebtext", None, "train", True)


def test_hub_corpora_offline_errors(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    for name, hub in (("openwebtext", "Skylion007/openwebtext"), ("c4", "allenai/c4")):
        with pytest.raises(FileNotFoundError, match=f"'{name}'.*{hub}.*not installed.*pip install datasets"):
            load_split_documents(DataConfig(dataset=name), "valid", tmp_path)
    fake = types.ModuleType("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("offline")

    fake.load_dataset = offline
    monkeypatch.setitem(sys.modules, "datasets", fake)
    with pytest.raises(FileNotFoundError, match="'c4'.*hub failed: ConnectionError.*pip install datasets"):
        load_split_documents(DataConfig(dataset="c4"), "test", tmp_path)


def test_hub_token_stream_reused_offline(monkeypatch, tmp_path, bpe):
    """The fingerprint needs no network, so a stream tokenized online loads offline from the cache."""
    cfg = DataConfig(dataset="c4")
    fps = {source_fingerprint(DataConfig(dataset=d), s, tmp_path) for d in ("c4", "openwebtext")
           for s in ("train", "valid", "test")}
    assert len(fps) == 6
    _fake_datasets(monkeypatch, [])
    online = load_tokens(cfg, "valid", bpe, tmp_path, tmp_path / "cache")
    monkeypatch.setitem(sys.modules, "datasets", None)
    offline = load_tokens(cfg, "valid", bpe, tmp_path, tmp_path / "cache")
    assert len(online) > 4096 and (online == offline).all()
    with pytest.raises(FileNotFoundError, match="not installed"):
        load_tokens(cfg, "test", bpe, tmp_path, tmp_path / "cache")
