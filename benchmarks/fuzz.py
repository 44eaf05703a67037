"""A long property-based fuzz of every HTTP route: many generated requests, no 5xx allowed.

The same fuzzing as tests/server/test_server_fuzz.py (schemathesis over the app's OpenAPI
schema, half of the requests pointed at a registered worker, its dataset and round 0; the
admin routes but stop with an admin token), with
`--examples` requests per route against a `diloco server` process. Prints and writes the
answers' status codes per route; exits 1 if any answer was a 5xx or a request failed.
Writes <out>/fuzz.md and .json.

    python benchmarks/fuzz.py --examples 1000
"""

from __future__ import annotations

import collections
import os
import tempfile
import time
from pathlib import Path

import torch
import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.console import check_output_path, fail, markdown_table, out, summary_table, write_json
from diloco.server.ops.launch import start_server, stop_process
from diloco.wire import PROTOCOL_HEADER, PROTOCOL_VERSION, encode_tensors
from diloco.worker import DiLoCoClient

RESULTS = Path(__file__).parent / "results"
TOKEN = "fuzz-enrollment-token"
ADMIN = "fuzz-admin-token-0123456789"
WORKER, DATASET = "fuzz-worker", "fuzz-data"
KNOWN = (("worker_id", WORKER), ("dataset_id", DATASET), ("round_number", 0),
         ("protocol_version", PROTOCOL_VERSION))  # fmt: skip


def operations(url: str, headers: dict[str, str]) -> dict:
    import schemathesis

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=headers)
    found = (result.ok() for result in schema.get_all_operations())
    return {f"{op.method.upper()} {op.path}": op for op in found}


def prepared(url: str) -> dict[str, str]:
    """Register the worker, its weights and dataset; the headers that act as that worker."""
    with DiLoCoClient(url, TOKEN) as client:
        spec = {"name": "w", "shape": [3, 2], "dtype": "float32", "kind": "trainable"}
        answer = client.register(WORKER, [spec])
        client.upload_initial(WORKER, encode_tensors({"w": torch.zeros(3, 2)}))
        client.register_dataset(WORKER, DATASET, 100, 0, 10)
    return {
        "Authorization": f"Bearer {answer['credential']}",
        PROTOCOL_HEADER: str(PROTOCOL_VERSION),
    }


def fuzz_route(
    operation, url: str, headers: dict[str, str], examples: int, derandomize: bool
) -> dict:
    statuses: collections.Counter[str] = collections.Counter()
    failures: list[str] = []

    @given(case=operation.as_strategy(), known=st.booleans())
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck),
              database=None, derandomize=derandomize)  # fmt: skip
    def fuzz(case, known: bool) -> None:
        for parameters in (case.path_parameters, case.query, case.body) if known else ():
            for key, value in KNOWN:
                if isinstance(parameters, dict) and key in parameters:
                    parameters[key] = value
        if case.path.endswith("/result"):
            case.query = {**(case.query or {}), "wait": 0}
        try:
            response = case.call(base_url=url, headers=headers, timeout=30)
        except Exception as exc:  # a dropped connection is a failure too
            statuses["no answer"] += 1
            failures.append(f"{type(exc).__name__}: {exc}")
            return
        statuses[str(response.status_code)] += 1
        if response.status_code >= 500:
            failures.append(f"{response.status_code}: {response.text[:300]}")

    fuzz()
    return {"statuses": dict(sorted(statuses.items())), "failures": failures[:5]}


def main(
    examples: int = typer.Option(1000, help="Generated requests per route (at most)."),
    derandomize: bool = typer.Option(False, help="The same requests every run (for tests)."),
    out_dir: Path = typer.Option(RESULTS, help="Where fuzz.md and .json go."),
) -> None:
    check_output_path(out_dir / "fuzz.json", "--out-dir")
    if examples < 1:
        raise fail(f"--examples must be at least 1, got {examples}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        tokens = Path(work) / "tokens"
        tokens.write_text(f"{TOKEN} enroll\n{ADMIN} admin\n")
        server, url = start_server(Path(work) / "port", "--sync-every", "2",
                                   "--tokens-file", str(tokens))  # fmt: skip
        try:
            headers = prepared(url)
            # The admin routes with the admin token (but stop, which would end the server:
            # it keeps the worker's credential, a 403); they and DELETE go last: once the
            # worker is deregistered, evicted or banned, the rest would only meet 404s.
            admin = {**headers, "Authorization": f"Bearer {ADMIN}"}
            found = operations(url, headers)

            def as_admin(label: str) -> bool:
                return ("/v1/admin/" in label or "/v1/dashboard" in label) and "/stop" not in label

            def last(label: str) -> tuple:
                return ("/v1/admin/" in label, label.startswith("DELETE"), label)

            routes = {
                label: fuzz_route(
                    found[label],
                    url,
                    admin if as_admin(label) else headers,
                    examples,
                    derandomize,
                )
                for label in sorted(found, key=last)
            }
        finally:
            stop_process(server)
    seconds = time.perf_counter() - started
    rows = []
    for label, found in routes.items():
        total = sum(found["statuses"].values())
        codes = ", ".join(f"{code}: {n}" for code, n in found["statuses"].items())
        rows.append([label, total, codes, len(found["failures"])])
    requests = sum(row[1] for row in rows)
    bad = sum(row[3] for row in rows)
    title = f"fuzz: {requests} requests over {len(rows)} routes in {seconds:.0f} s, {bad} failed"
    columns = ["route", "requests", "status codes", "5xx or no answer"]
    out.print(summary_table(title, columns, rows))
    document = {"examples": examples, "seconds": round(seconds, 1),
                "machine": f"{os.cpu_count()} cores", "routes": routes}  # fmt: skip
    write_json(out_dir / "fuzz.json", document)
    command = f"Command: `python benchmarks/fuzz.py --examples {examples}`"
    lines = [f"# {title}", "", command, "", *markdown_table(columns, rows)]
    (out_dir / "fuzz.md").write_text("\n".join(lines) + "\n")
    if bad:
        raise fail(f"{bad} request(s) got a 5xx or no answer; see {out_dir / 'fuzz.json'}", code=1)


if __name__ == "__main__":
    typer.run(main)
