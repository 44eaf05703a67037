"""The server's file checksums (checkpoints.py): XXH3-128 now, SHA-256 for older files.

Expected digests are published vectors (XXH3-128 and SHA-256 of the empty input) or come from
the xxhash and hashlib libraries called directly, never from the module under test.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import xxhash

from diloco import checkpoints

EMPTY_XXH3_128 = "99aa06d3014798d86001c324468d497f"  # xxHash's test vector for ""
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def test_digests_of_the_empty_input_are_the_published_vectors() -> None:
    assert checkpoints.DIGEST == "xxh3_128"
    assert checkpoints.digest_of(b"") == EMPTY_XXH3_128
    assert checkpoints.digest_of(b"", "sha256") == EMPTY_SHA256


def test_a_file_is_hashed_in_reads_as_its_bytes_are(tmp_path: Path) -> None:
    """More than one 8 MiB read, and a prefix of an open file by its descriptor."""
    data = os.urandom(1000) * (9 * 1049)  # 9.4 MB
    path = tmp_path / "body"
    path.write_bytes(data)
    assert checkpoints.file_digest(path) == xxhash.xxh3_128(data).hexdigest()
    assert checkpoints.file_digest(path, "sha256") == hashlib.sha256(data).hexdigest()
    fd = os.open(path, os.O_RDONLY)
    try:
        assert checkpoints.descriptor_digest(fd, 12345) == xxhash.xxh3_128(data[:12345]).hexdigest()
        assert checkpoints.descriptor_digest(fd, 0) == EMPTY_XXH3_128
        with pytest.raises(OSError, match=f"ended after {len(data)} of {len(data) + 1} bytes"):
            checkpoints.descriptor_digest(fd, len(data) + 1)
    finally:
        os.close(fd)


def test_an_unknown_algorithm_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown digest 'md5'; known: xxh3_128, sha256"):
        checkpoints.digest_hasher("md5")


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"bytes": 3, "xxh3_128": "0" * 32}, ("xxh3_128", "0" * 32)),
        ({"bytes": 3, "sha256": "a" * 64}, ("sha256", "a" * 64)),
        ({"bytes": 3}, None),
        ({"xxh3_128": "0" * 32, "sha256": "a" * 64}, None),  # two: which one holds?
        ({"xxh3_128": "0" * 64}, None),
        ({"sha256": "A" * 64}, None),  # hex digests are lower case
        ({"xxh3_128": 7}, None),
        ({"md5": "0" * 32}, None),
    ],
)
def test_a_record_names_exactly_one_well_formed_digest(entry: dict, expected) -> None:
    assert checkpoints.named_digest(entry) == expected
