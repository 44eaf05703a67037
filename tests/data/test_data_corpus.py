"""Loading user corpora, the generated corpus, and the --corpus resolver."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from diloco.data import CorpusError, generated_corpus, load_corpus, load_named_corpus
from diloco.data import named as named_module


def test_load_corpus_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "play.txt"
    path.write_bytes(b"To be, or not to be.\n")
    assert load_corpus(path) == b"To be, or not to be.\n"
    assert load_corpus(str(path)) == b"To be, or not to be.\n"


def test_folder_is_read_in_sorted_relative_path_order(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "a.txt").write_bytes(b"second")
    (tmp_path / "a.txt").write_bytes(b"first")
    (tmp_path / "c").write_bytes(b"third")
    assert load_corpus(tmp_path) == b"first\nsecond\nthird"


def test_folder_skips_binary_hidden_and_empty_files(tmp_path: Path) -> None:
    (tmp_path / "text.md").write_bytes(b"words")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00")
    (tmp_path / ".secret").write_bytes(b"hidden")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_bytes(b"ref: refs/heads/main")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "late_nul.txt").write_bytes(b"x" * 9000 + b"\x00")
    # Only the first 8 KiB are sniffed, so a late NUL does not make a file binary.
    assert load_corpus(tmp_path) == b"x" * 9000 + b"\x00" + b"\nwords"


def test_missing_path_is_a_corpus_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(CorpusError, match=r"corpus path does not exist: .*nope.txt"):
        load_corpus(missing)


def test_empty_file_is_a_corpus_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.txt"
    path.write_bytes(b"")
    with pytest.raises(CorpusError, match=r"corpus is empty: .*empty.txt"):
        load_corpus(path)


def test_folder_without_text_is_a_corpus_error(tmp_path: Path) -> None:
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01")
    with pytest.raises(CorpusError, match=r"corpus is empty: .*binary files are skipped"):
        load_corpus(tmp_path)
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(CorpusError, match="corpus is empty"):
        load_corpus(empty)


def test_corpus_error_is_a_value_error() -> None:
    assert issubclass(CorpusError, ValueError)


def test_generated_corpus_is_deterministic_and_sized() -> None:
    first = generated_corpus(50_000, seed=3)
    assert first == generated_corpus(50_000, seed=3)
    assert len(first) == 50_000
    assert first != generated_corpus(50_000, seed=4)
    assert len(generated_corpus()) == 200_000
    assert generated_corpus(1_000, seed=3) == first[:1_000]
    first.decode("ascii")


def test_generated_corpus_looks_like_a_play() -> None:
    text = generated_corpus(20_000).decode("ascii")
    assert "ACT I. SCENE I." in text
    assert "Enter " in text
    speaker_lines = [
        line for line in text.splitlines() if line.split(":")[0].isupper() and ":" in line
    ]
    assert len(speaker_lines) > 20


def test_generated_corpus_is_learnable() -> None:
    """Even a bigram model beats the uniform 5.55 nats by far, so small models learn it."""
    tokens = np.frombuffer(generated_corpus(), dtype=np.uint8)
    counts = np.zeros((256, 256))
    np.add.at(counts, (tokens[:-1], tokens[1:]), 1)
    joint = counts / counts.sum()
    conditional = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    seen = counts > 0
    entropy = -(joint[seen] * np.log(conditional[seen])).sum()
    assert entropy < 0.5 * math.log(256)


def test_generated_corpus_rejects_non_positive_size() -> None:
    with pytest.raises(ValueError, match="num_bytes"):
        generated_corpus(0)


def test_named_corpus_generated_specs() -> None:
    assert load_named_corpus("generated") == generated_corpus()
    assert load_named_corpus("generated:7") == generated_corpus(seed=7)
    with pytest.raises(CorpusError, match="must be an integer"):
        load_named_corpus("generated:seven")


def test_named_corpus_path(tmp_path: Path) -> None:
    path = tmp_path / "x.txt"
    path.write_bytes(b"abc")
    assert load_named_corpus(str(path)) == b"abc"
    with pytest.raises(CorpusError, match="does not exist"):
        load_named_corpus(str(tmp_path / "missing"))


def test_named_corpus_default_is_shakespeare(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(named_module, "shakespeare_corpus", lambda: b"plays")
    assert load_named_corpus(None) == b"plays"
    assert load_named_corpus("shakespeare") == b"plays"
