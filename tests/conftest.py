"""Fixtures shared by the suites: a small generated corpus that trains in seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.data import generated_corpus


@pytest.fixture(scope="session")
def small_corpus() -> bytes:
    return generated_corpus(num_bytes=60_000, seed=7)


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory: pytest.TempPathFactory, small_corpus: bytes) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "generated.txt"
    path.write_bytes(small_corpus)
    return path
