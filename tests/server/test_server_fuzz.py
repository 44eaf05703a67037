"""Property-based HTTP fuzzing of every route (schemathesis over the server's OpenAPI schema):
whatever a client sends that the schema describes, no answer is a 5xx.

Each route gets a real server (uvicorn on loopback, in this process) with one registered
worker, its initial weights and a dataset, and the requests carry that worker's credential and
the protocol header, so they get past authentication. In half of the generated requests the
worker id, dataset id and round number are replaced by ones the server knows, so that they
reach each route's deeper checks instead of stopping at "unknown worker". The schema is the
app's own (`app.openapi()`, what /openapi.json serves), read at collection so that each route
is a test of its own; each gets `EXAMPLES` requests (derandomized: the same ones every run;
benchmarks/fuzz.py sends 1000 per route). The admin routes and /v1/dashboard (but stop, which
would end the server) get an admin token instead of the worker's credential.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from diloco.server.coordinator import Coordinator  # noqa: E402
from diloco.server.http.app import create_app  # noqa: E402
from diloco.server.members.credentials import Credentials  # noqa: E402
from diloco.server.settings import ServerSettings  # noqa: E402
from diloco.wire import PROTOCOL_HEADER, PROTOCOL_VERSION, encode_tensors  # noqa: E402
from diloco.worker import DiLoCoClient  # noqa: E402

TOKEN = "fuzz-enrollment-token"
ADMIN = "fuzz-admin-token-0123456789"
WORKER, DATASET = "fuzz-worker", "fuzz-data"
KNOWN = (("worker_id", WORKER), ("dataset_id", DATASET), ("round_number", 0),
         ("protocol_version", PROTOCOL_VERSION))  # fmt: skip
EXAMPLES = 15

SCHEMA = schemathesis.openapi.from_dict(create_app(Coordinator(ServerSettings()), TOKEN).openapi())
OPERATIONS = {
    f"{op.method.upper()} {op.path}": op for op in (r.ok() for r in SCHEMA.get_all_operations())
}


@pytest.fixture
def server(live_server):
    """A server with WORKER registered (its credential in the headers), weights and DATASET."""
    credentials = Credentials([TOKEN], {ADMIN: "admin"})
    with live_server(ServerSettings(sync_every=2), None, credentials) as running:
        with DiLoCoClient(running.url, TOKEN) as client:
            spec = {"name": "w", "shape": [3, 2], "dtype": "float32", "kind": "trainable"}
            answer = client.register(WORKER, [spec])
            client.upload_initial(WORKER, encode_tensors({"w": torch.zeros(3, 2)}))
            client.register_dataset(WORKER, DATASET, 100, 0, 10)
        headers = {"Authorization": f"Bearer {answer['credential']}",
                   PROTOCOL_HEADER: str(PROTOCOL_VERSION)}  # fmt: skip
        yield running.url, headers


def known_ids(case) -> None:
    """Point the request (its path, query and JSON body) at the worker, dataset and round
    the server has."""
    for parameters in (case.path_parameters, case.query, case.body):
        if not isinstance(parameters, dict):
            continue
        for key, value in KNOWN:
            if key in parameters:
                parameters[key] = value


def _short_wait(generated: object) -> object:
    """A generated wait that the server would honour for long (or the default 30 s) becomes
    0; every other value (negative, not a number, past the cap) goes as generated."""
    try:
        seconds = float(generated)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0 if generated is None else generated
    return 0 if 0 < seconds <= 120 else generated


@pytest.mark.parametrize("label", sorted(OPERATIONS))
def test_no_request_gets_a_server_error(server, label: str) -> None:
    url, headers = server
    admin_route = label.split()[1].startswith(("/v1/admin/", "/v1/dashboard"))
    if admin_route and label != "POST /v1/admin/stop":
        # The admin routes with the admin token, so requests reach their checks (stop would
        # end the server under the fuzz: it keeps the worker's credential, a 403).
        headers = {**headers, "Authorization": f"Bearer {ADMIN}"}

    @given(case=OPERATIONS[label].as_strategy(), known=st.booleans())
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck), database=None)  # fmt: skip
    def fuzz(case, known: bool) -> None:
        if known:
            known_ids(case)
        if case.path.endswith("/result"):  # a long-poll: the fuzz must not wait out each one
            case.query = {**(case.query or {})}
            case.query["wait"] = _short_wait(case.query.get("wait"))
        response = case.call(base_url=url, headers=headers, timeout=30)
        assert response.status_code < 500, (
            f"{case.method} {case.formatted_path} answered {response.status_code}: "
            f"{response.text[:500]}\n{case.as_curl_command(headers=headers)}"
        )

    fuzz()
