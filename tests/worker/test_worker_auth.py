"""BearerAuth: which secret a worker's clients send, and when a refused one is worth a retry."""

from __future__ import annotations

import pytest

from diloco.worker.net.auth import BearerAuth


def test_the_credential_replaces_the_token_and_a_refused_one_falls_back_to_it() -> None:
    auth = BearerAuth("enroll")
    assert auth.secret() == "enroll"
    auth.credential = "mine"
    assert auth.secret() == "mine"
    assert auth.refused("mine") is True  # a fresh server: try the token instead
    assert (auth.credential, auth.secret()) == (None, "enroll")
    assert auth.refused("enroll") is False  # the token itself is wrong: nothing else to try


def test_without_a_token_a_refused_credential_is_final(monkeypatch) -> None:
    monkeypatch.delenv("DILOCO_TOKEN", raising=False)
    auth = BearerAuth(credential="mine")
    assert auth.refused("mine") is False
    assert auth.credential == "mine"


def test_a_secret_replaced_meanwhile_is_tried_anew() -> None:
    auth = BearerAuth("enroll", credential="old")
    auth.credential = "new"  # another thread registered again while "old" was in flight
    assert auth.refused("old") is True and auth.secret() == "new"


def test_the_token_comes_from_the_environment_when_not_given(monkeypatch) -> None:
    monkeypatch.setenv("DILOCO_TOKEN", "  from-env\n")
    assert BearerAuth().token == "from-env"
    assert BearerAuth("given").token == "given"
    monkeypatch.setenv("DILOCO_TOKEN", "")
    assert BearerAuth().token is None


@pytest.mark.parametrize("bad", ["", "two\nlines", "cr\r"])
def test_a_secret_is_one_non_empty_line(bad: str) -> None:
    with pytest.raises(ValueError, match="non-empty single line"):
        BearerAuth(bad)
    with pytest.raises(ValueError, match="credential"):
        BearerAuth("ok", credential=bad)
