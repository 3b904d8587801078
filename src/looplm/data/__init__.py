"""Data layer: corpora (registry of raw text splits), tokenizers, cached token streams, batches.

Typical use::

    root, cache = resolve_data_root(cfg.data_root), resolve_cache_dir(cfg.cache_dir)
    tok = get_tokenizer(cfg, root, cache)
    train = load_tokens(cfg, "train", tok, root, cache)          # 1-D memmap
    x, y = sample_batch(train, B, L, seed=seed, step=step)       # (B, L) int64
    for x, y, mask in eval_windows(valid, L, B): ...             # every target scored once
"""

from looplm.data.corpora import (
    CORPORA,
    SPLITS,
    Corpus,
    brown_documents,
    brown_split,
    get_corpus,
    load_split_documents,
    load_split_text,
    register_corpus,
    source_fingerprint,
)
from looplm.data.paths import resolve_cache_dir, resolve_data_root
from looplm.data.tokenizer import (
    EOT,
    eot_id,
    get_tokenizer,
    load_gpt2_tokenizer,
    save_tokenizer,
    text_chunks,
    tokenizer_fingerprint,
    train_bpe_tokenizer,
)
from looplm.data.tokens import (
    batch_seed,
    encode_documents,
    eval_windows,
    load_tokens,
    sample_batch,
    token_dtype,
    tokens_cache_path,
    unigram_ppl,
)

__all__ = [
    "CORPORA", "SPLITS", "Corpus", "brown_documents", "brown_split", "get_corpus", "load_split_documents",
    "load_split_text", "register_corpus", "source_fingerprint", "resolve_cache_dir", "resolve_data_root",
    "EOT", "eot_id", "get_tokenizer", "load_gpt2_tokenizer", "save_tokenizer", "text_chunks",
    "tokenizer_fingerprint", "train_bpe_tokenizer", "batch_seed", "encode_documents", "eval_windows",
    "load_tokens", "sample_batch", "token_dtype", "tokens_cache_path", "unigram_ppl",
]
