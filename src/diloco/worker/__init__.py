"""The worker side: DiLoCoWorker around any torch optimizer, and its HTTP client."""

from diloco.worker.errors import (
    AuthError,
    ClientClosed,
    ServerError,
    ServerUnavailable,
    ServerUnreachable,
)
from diloco.worker.net.client import DiLoCoClient
from diloco.worker.net.retry import RetryPolicy
from diloco.worker.net.transport import ClientStats
from diloco.worker.settings import ServerSettingsError, WorkerSettings
from diloco.worker.worker import DiLoCoWorker

__all__ = [
    "AuthError",
    "ClientClosed",
    "ClientStats",
    "DiLoCoClient",
    "DiLoCoWorker",
    "RetryPolicy",
    "ServerError",
    "ServerSettingsError",
    "ServerUnavailable",
    "ServerUnreachable",
    "WorkerSettings",
]
