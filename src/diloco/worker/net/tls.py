"""TLS on the worker side: a CA file checked before any request, and a refused certificate
told apart from other handshake failures (it needs --ca-file, not patience)."""

from __future__ import annotations

import os
import ssl


def certificate_problem(exc: BaseException) -> str | None:
    """The verification message when `exc` is a refused server certificate, else None."""
    seen: set[int] = set()
    pending: list[object] = [exc]
    while pending:
        error = pending.pop()
        if not isinstance(error, BaseException) or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, ssl.SSLCertVerificationError):
            return str(error.verify_message or error.reason or error)
        pending.extend([error.__cause__, error.__context__, *error.args])
    return None


def check_ca_file(ca_file: str | os.PathLike[str]) -> None:
    """ValueError unless `ca_file` loads as PEM certificates (checked before any request)."""
    try:
        ssl.create_default_context(cafile=os.fspath(ca_file))
    except FileNotFoundError:
        raise ValueError(f"ca_file {ca_file} does not exist") from None
    except (ssl.SSLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or exc
        raise ValueError(
            f"ca_file {ca_file} is not a readable PEM certificate ({reason})"
        ) from None
