"""Find and download a file from the package index pip is configured to use.

We read pip's settings (environment, then ``pip config list``) but never run ``pip download``:
for a source distribution that builds the package and so runs its setup script. Pages follow
PEP 503 (the "simple" HTML API); http(s) and file:// indexes both work.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import http.client
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path, PurePosixPath
from typing import BinaryIO
from urllib.parse import unquote, urldefrag, urljoin, urlsplit, urlunsplit

DEFAULT_INDEX_URL = "https://pypi.org/simple"
PIP_CONFIG_TIMEOUT = 20.0
MAX_PAGE_BYTES = 16 * 1024 * 1024
MAX_DOWNLOAD_BYTES = 256 * 1024 * 1024
CHUNK_BYTES = 64 * 1024


class IndexFetchError(Exception):
    """One index could not provide the file; the message is a short reason."""


def pip_config() -> dict[str, str]:
    """pip's configured values (``pip config list``), or {} if pip cannot tell us."""
    command = [sys.executable, "-m", "pip", "config", "list"]
    try:
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=PIP_CONFIG_TIMEOUT,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    if result.returncode != 0:
        return {}
    values: dict[str, str] = {}
    for line in result.stdout.splitlines():
        key, sep, raw = line.partition("=")
        if not sep:
            continue
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            continue
        if isinstance(value, str):
            values[key.strip()] = value
    return values


def configured_index_urls() -> list[str]:
    """The index URL pip would use, then its extra index URLs, without duplicates.

    Main index: $PIP_INDEX_URL, else pip's configured index-url, else PyPI. Extras:
    $PIP_EXTRA_INDEX_URL and pip's configured extra-index-url (space or newline separated).
    """
    config = pip_config()
    main = (
        os.environ.get("PIP_INDEX_URL")
        or config.get("install.index-url")
        or config.get("global.index-url")
        or DEFAULT_INDEX_URL
    )
    extras = (
        os.environ.get("PIP_EXTRA_INDEX_URL", "").split()
        + config.get("install.extra-index-url", "").split()
        + config.get("global.extra-index-url", "").split()
    )
    urls: list[str] = []
    for url in [main.strip(), *extras]:
        if url and url.rstrip("/") not in {known.rstrip("/") for known in urls}:
            urls.append(url)
    return urls


def redact(url: str) -> str:
    """``url`` with any user:password replaced, safe to show in messages."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))


def make_opener() -> urllib.request.OpenerDirector:
    """A urllib opener honouring proxy variables now, and $PIP_CERT as CA bundle if set."""
    handlers: list[urllib.request.BaseHandler] = []
    cafile = os.environ.get("PIP_CERT")
    if cafile and Path(cafile).is_file():
        context = ssl.create_default_context(cafile=cafile)
        handlers.append(urllib.request.HTTPSHandler(context=context))
    return urllib.request.build_opener(*handlers)


def _request(url: str) -> urllib.request.Request:
    """A GET request; credentials in the URL become a Basic auth header."""
    parts = urlsplit(url)
    headers = {"User-Agent": "diloco-data/1", "Accept": "text/html"}
    if "@" in parts.netloc:
        userinfo, _, host = parts.netloc.rpartition("@")
        token = base64.b64encode(unquote(userinfo).encode()).decode("ascii")
        headers["Authorization"] = f"Basic {token}"
        url = urlunsplit(parts._replace(netloc=host))
    return urllib.request.Request(url, headers=headers)


def _open(url: str, timeout: float, opener: urllib.request.OpenerDirector) -> BinaryIO:
    """Open an http(s) or file URL for reading; a file:// folder reads its index.html."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        path = Path(urllib.request.url2pathname(parts.path))
        if path.is_dir():
            path = path / "index.html"
        return path.open("rb")
    if parts.scheme not in ("http", "https"):
        raise IndexFetchError(f"unsupported URL scheme {parts.scheme!r}")
    return opener.open(_request(url), timeout=timeout)


def _reason(exc: BaseException, timeout: float) -> str:
    """A short human reason for a network or file error."""
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        if isinstance(exc.reason, BaseException):
            return _reason(exc.reason, timeout)
        return str(exc.reason)
    if isinstance(exc, TimeoutError):
        return f"timed out after {timeout:g} s"
    if isinstance(exc, FileNotFoundError):
        return f"not found: {exc.filename}"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


_FETCH_ERRORS = (OSError, http.client.HTTPException, ValueError)


class _AnchorCollector(HTMLParser):
    """Collects every <a href> and an optional <base href> from an HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.base: str | None = None
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href")
        if not href:
            return
        if tag == "a":
            self.hrefs.append(href)
        elif tag == "base" and self.base is None:
            self.base = href


def find_file_url(page_url: str, filename: str, page_html: str) -> str | None:
    """The absolute URL (no #fragment) of the anchor whose file name is ``filename``."""
    collector = _AnchorCollector()
    collector.feed(page_html)
    collector.close()
    base = urljoin(page_url, collector.base) if collector.base else page_url
    for href in collector.hrefs:
        url, _ = urldefrag(urljoin(base, href.strip()))
        if unquote(PurePosixPath(urlsplit(url).path).name) == filename:
            return url
    return None


def locate_file(
    index_url: str,
    project: str,
    filename: str,
    timeout: float,
    opener: urllib.request.OpenerDirector,
) -> str:
    """The URL of ``filename`` on ``index_url``'s simple page for ``project``."""
    page_url = f"{index_url.rstrip('/')}/{project}/"
    try:
        with _open(page_url, timeout, opener) as page:
            html = page.read(MAX_PAGE_BYTES).decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise IndexFetchError(f"no {project!r} project page") from exc
        raise IndexFetchError(_reason(exc, timeout)) from exc
    except FileNotFoundError as exc:
        raise IndexFetchError(f"no {project!r} project page") from exc
    except _FETCH_ERRORS as exc:
        raise IndexFetchError(_reason(exc, timeout)) from exc
    url = find_file_url(page_url, filename, html)
    if url is None:
        raise IndexFetchError(f"no {filename} link on its {project!r} page")
    return url


def download(
    url: str, destination: Path, timeout: float, opener: urllib.request.OpenerDirector
) -> str:
    """Stream ``url`` into ``destination`` and return the SHA-256 hex digest of the bytes.

    ``timeout`` bounds each network operation, not the whole transfer.
    """
    digest = hashlib.sha256()
    size = 0
    try:
        with _open(url, timeout, opener) as source, destination.open("wb") as sink:
            while chunk := source.read(CHUNK_BYTES):
                size += len(chunk)
                if size > MAX_DOWNLOAD_BYTES:
                    raise IndexFetchError(f"download exceeds {MAX_DOWNLOAD_BYTES} bytes")
                digest.update(chunk)
                sink.write(chunk)
    except _FETCH_ERRORS as exc:
        raise IndexFetchError(f"download failed: {_reason(exc, timeout)}") from exc
    return digest.hexdigest()
