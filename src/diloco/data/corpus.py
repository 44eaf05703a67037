"""Load a user-supplied corpus (a text file or a folder of text files) as raw bytes.

A folder is read recursively in sorted relative-path order so the same folder always gives
the same bytes. Hidden files and folders (names starting with ".") are skipped, and so is any
file whose first 8 KiB contain a NUL byte: that is the cheap, encoding-agnostic test for
"binary" that keeps images, archives and compiled files out of a byte-level corpus.
"""

from __future__ import annotations

import os
from pathlib import Path

from diloco.data.errors import CorpusError
from diloco.data.generated import generated_corpus

__all__ = ["generated_corpus", "is_text_file", "load_corpus", "text_files_under"]

SEPARATOR = b"\n"
SNIFF_BYTES = 8192


def is_text_file(path: Path) -> bool:
    """True if the first 8 KiB of ``path`` hold no NUL byte (our definition of text)."""
    with path.open("rb") as handle:
        return b"\x00" not in handle.read(SNIFF_BYTES)


def text_files_under(folder: Path) -> list[Path]:
    """Non-hidden regular text files below ``folder``, sorted by relative POSIX path."""
    found: list[tuple[str, Path]] = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [name for name in dirs if not name.startswith(".")]
        for name in files:
            path = Path(root, name)
            if name.startswith(".") or not path.is_file():
                continue
            if is_text_file(path):
                found.append((path.relative_to(folder).as_posix(), path))
    return [path for _, path in sorted(found)]


def load_corpus(path: str | os.PathLike[str]) -> bytes:
    """Read a text file, or every text file under a folder joined by newlines.

    Raises CorpusError if the path is missing, unreadable, or yields no bytes.
    """
    corpus_path = Path(path).expanduser()
    if not corpus_path.exists():
        raise CorpusError(f"corpus path does not exist: {corpus_path}")
    try:
        if corpus_path.is_dir():
            pieces = [file.read_bytes() for file in text_files_under(corpus_path)]
            data = SEPARATOR.join(piece for piece in pieces if piece)
        elif corpus_path.is_file():
            data = corpus_path.read_bytes()
        else:
            raise CorpusError(f"corpus path is neither a file nor a folder: {corpus_path}")
    except OSError as exc:
        raise CorpusError(f"cannot read corpus {corpus_path}: {exc.strerror or exc}") from exc
    if not data:
        hint = " (hidden and binary files are skipped)" if corpus_path.is_dir() else ""
        raise CorpusError(f"corpus is empty: {corpus_path}{hint}")
    return data
