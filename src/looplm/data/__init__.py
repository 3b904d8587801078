"""Data layer: corpora (:mod:`.corpora`, the registry of raw text splits), tokenizers (:mod:`.tokenizer`), cached
token streams and batches (:mod:`.tokens`), data and cache paths (:mod:`.paths`)."""
