"""Tokenizers (SPEC §11): GPT-2 BPE and a byte-level BPE trained on the training split, both byte-level
(``decode(encode(text).ids) == text``) with the special ``<|endoftext|>`` (GPT-2: id 50256; trained: id 0)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE, WordLevel
from tokenizers.pre_tokenizers import ByteLevel
from tokenizers.trainers import BpeTrainer

from looplm.config import DataConfig
from looplm.data.corpora import load_split_text, source_fingerprint
from looplm.data.paths import atomic_write

EOT = "<|endoftext|>"
GPT2_FILES = ("gpt2-tokenizer/vocab.json", "gpt2-tokenizer/merges.txt")


def _byte_level(tok: Tokenizer) -> Tokenizer:
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def load_gpt2_tokenizer(data_root: Path) -> Tokenizer:
    """GPT-2's BPE ("Hello world" → [15496, 995]) from ``<data_root>/gpt2-tokenizer/``, else the hub;
    FileNotFoundError naming the files when neither is there."""
    vocab, merges = (Path(data_root) / f for f in GPT2_FILES)
    if vocab.is_file() and merges.is_file():
        tok = _byte_level(Tokenizer(BPE.from_file(str(vocab), str(merges))))
    else:
        try:
            tok = Tokenizer.from_pretrained("gpt2")
        except Exception as e:  # offline or hub error
            missing = ", ".join(str(p) for p in (vocab, merges) if not p.is_file())
            raise FileNotFoundError(
                f"GPT-2 tokenizer files not found: {missing}. Put OpenAI's vocab.json (encoder.json) "
                f"and merges.txt (vocab.bpe) in {vocab.parent}, set LOOPLM_DATA / data.data_root, "
                f"or go online so Tokenizer.from_pretrained('gpt2') can fetch them "
                f"({type(e).__name__}: {e})") from e
    tok.add_special_tokens([AddedToken(EOT, special=True)])
    return tok


def text_chunks(text: str, target_chars: int = 1 << 16) -> Iterator[str]:
    """Pieces of about ``target_chars`` that concatenate to ``text``, cut only after a ``"\\n"`` where GPT-2's
    pre-tokenizer splits anyway (the next line starts with a non-space, or one space and a non-space, and the
    ``"\\n"`` ends no longer whitespace run): the pieces encode to the same ids as ``text`` whole."""
    n, start = len(text), 0
    while n - start > target_chars:
        cut = -1
        pos = start + target_chars
        while cut < 0:
            nl = text.find("\n", pos)
            if nl < 0 or nl + 2 >= n:
                break
            a, b = text[nl + 1], text[nl + 2]
            if (not a.isspace() and not text[nl - 1].isspace()) or (a == " " and not b.isspace()):
                cut = nl + 1
            pos = nl + 1
        if cut < 0:
            break
        yield text[start:cut]
        start = cut
    if start < n:
        yield text[start:]


def train_bpe_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` ≥ 257 entries (256 bytes, ``<|endoftext|>`` = id 0); deterministic
    (ties broken by pair ids)."""
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be >= 257 (256 bytes + {EOT}), got {vocab_size}")
    tok = _byte_level(Tokenizer(BPE()))
    trainer = BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                         initial_alphabet=ByteLevel.alphabet())
    tok.train_from_iterator(text_chunks(text), trainer)
    return tok


def save_tokenizer(tok: Tokenizer, path: Path) -> None:
    """Write ``tok`` as HF tokenizer JSON to ``path`` atomically (temp file + rename)."""
    with atomic_write(Path(path)) as f:
        f.write(tok.to_str().encode())


def get_tokenizer(cfg: DataConfig, data_root: Path, cache_dir: Path) -> Tokenizer:
    """``cfg.tokenizer``: ``gpt2``, or ``bpe`` trained on the train split and cached as
    ``<cache_dir>/tokenizers/<dataset>-bpe<V>-<source fingerprint[:12]>.json``."""
    if cfg.tokenizer == "gpt2":
        return load_gpt2_tokenizer(data_root)
    if cfg.tokenizer != "bpe":
        raise ValueError(f"unknown tokenizer {cfg.tokenizer!r}; known: gpt2, bpe")
    fp = source_fingerprint(cfg, "train", data_root)[:12]
    path = Path(cache_dir) / "tokenizers" / f"{cfg.dataset}-bpe{cfg.bpe_vocab_size}-{fp}.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    tok = train_bpe_tokenizer(load_split_text(cfg, "train", data_root), cfg.bpe_vocab_size)
    save_tokenizer(tok, path)
    return tok


def tokenizer_fingerprint(tok: Tokenizer) -> str:
    """First 16 hex chars of sha256(``tok.to_str()``): changes whenever the tokenizer does."""
    return hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]


#: the document separators looplm recognizes, in order of preference: ``<|endoftext|>`` (GPT-2, looplm's own
#: BPE, Ouro) and ``<|end_text|>`` (Huginn-0125's end of text, its ``eos_token_id``)
EOT_NAMES: tuple[str, ...] = (EOT, "<|end_text|>")


def eot_token(tok: Tokenizer) -> str:
    """The document separator of ``tok``: the first of :data:`EOT_NAMES` it has; ValueError when it has none."""
    for name in EOT_NAMES:
        if tok.token_to_id(name) is not None:
            return name
    raise ValueError(f"tokenizer has no {EOT} token (nor {', '.join(EOT_NAMES[1:])})")


def eot_id(tok: Tokenizer) -> int:
    """Id of :func:`eot_token`."""
    return tok.token_to_id(eot_token(tok))


class CharVocab:
    """One token per character of ``chars`` (ids 1 …) and ``eot`` at id 0 (the padding): the task vocabularies."""

    def __init__(self, chars: str, eot: str = "<|endoftext|>"):
        self.chars, self.eot = chars, eot
        self.vocab: dict[str, int] = {eot: 0, **{c: i + 1 for i, c in enumerate(chars)}}
        self.id_to_char: dict[int, str] = {i: c for c, i in self.vocab.items() if c != eot}

    def encode(self, text: str) -> list[int]:
        """Characters → ids. Raises ValueError on a character outside ``chars``."""
        try:
            return [self.vocab[c] for c in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the task vocabulary {self.chars!r}") from None

    def decode(self, ids) -> str:
        """Ids → characters (``eot``/padding and unknown ids are dropped)."""
        return "".join(self.id_to_char.get(int(i), "") for i in ids)

    def tokenizer(self) -> Tokenizer:
        """The vocabulary as a ``tokenizers.Tokenizer`` (one token per character, ``eot`` special and unknown),
        saved with checkpoints."""
        tok = Tokenizer(WordLevel(dict(self.vocab), unk_token=self.eot))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens([AddedToken(self.eot, special=True)])
        return tok
