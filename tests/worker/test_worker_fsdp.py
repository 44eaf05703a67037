"""An FSDP2 group is one worker: each rank uploads its rows, and bad groups fail on every rank.

The run checks use outer SGD with lr 1 and one worker, where the global weights after each
round are exactly the worker's local weights: so the expected weights are plain SGD on the
same batches, computed here with torch alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diloco.server.settings import ServerSettings
from diloco.wire import decode_tensors
from diloco.worker import DiLoCoClient
from processes import process_group

if not hasattr(pytest.importorskip("torch.distributed.fsdp"), "fully_shard"):
    pytest.skip("FSDP2 (fully_shard) needs torch >= 2.6", allow_module_level=True)

SCRIPT = Path(__file__).with_name("fsdp_worker_script.py")
STEPS = 5  # H = 2: rounds after steps 2 and 4, and close() syncs step 5


def run_group(url: str, variant: str, out: Path, ranks: int = 2) -> list[dict]:
    """The script as a group of `ranks` processes (as torchrun starts them: tests/processes.py;
    `plain`: one process without a group); every rank's report, by rank."""
    args = [str(SCRIPT), url, variant, str(STEPS), str(out)]
    if variant == "plain":
        result = subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, timeout=180, check=False
        )
    else:
        result = process_group(args, ranks)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(ranks)]
    assert [report["rank"] for report in reports] == list(range(ranks))
    return reports


def server_weights(url: str) -> tuple[dict[str, torch.Tensor], int]:
    with DiLoCoClient(url) as client:
        body, round_number = client.get_weights()
    return {name: t.clone() for name, t in decode_tensors(body).items()}, round_number


def plain_sgd() -> dict[str, torch.Tensor]:
    """The script's model and batches trained without diloco or FSDP: 5 SGD steps, lr 0.1."""
    torch.manual_seed(0)
    first, last = torch.nn.Linear(5, 7), torch.nn.Linear(7, 1)
    params = [*first.parameters(), *last.parameters()]
    generator = torch.Generator().manual_seed(100)
    for _ in range(STEPS):
        x = torch.randn(12, 5, generator=generator)
        last(torch.relu(first(x))).pow(2).mean().backward()
        with torch.no_grad():
            for p in params:
                p -= 0.1 * p.grad
                p.grad = None
    return {"first.weight": first.weight, "first.bias": first.bias,
            "last.weight": last.weight, "last.bias": last.bias}  # fmt: skip


SLOW = pytest.mark.slow  # in `make test-slow`; the default suite keeps one case of each kind


@pytest.mark.parametrize("ranks", [pytest.param(1, marks=SLOW), 2, pytest.param(3, marks=SLOW)])
def test_an_fsdp_group_ends_on_the_weights_of_plain_sgd(
    live_server, tmp_path: Path, ranks: int
) -> None:
    """`last` has one row: from 2 ranks on, rank 1 and up hold none of it, and send and take
    nothing for it; the int buffer `seen` counts 1 per step on rank 0 and 101, 201 on the
    others, so only a broadcast of rank 0's value leaves every rank at 5."""
    settings = ServerSettings(sync_every=2, outer_optimizer="sgd", outer_lr=1.0)
    with live_server(settings) as server:
        lines = run_group(server.url, "fsdp", tmp_path, ranks)
        weights, round_number = server_weights(server.url)
    assert [line["error"] for line in lines] == [None] * ranks
    assert round_number == 3 and all(line["rounds"] == 3 for line in lines)
    assert int(weights["seen"]) == STEPS  # rank 0's int buffer, exact
    for name, value in plain_sgd().items():
        torch.testing.assert_close(weights[name], value.detach(), msg=name)
    for line in lines:  # every rank took its rows of the new weights back
        for name, value in line["state"].items():
            torch.testing.assert_close(torch.tensor(value), weights[name], msg=name)


@SLOW
def test_a_group_joining_a_run_that_already_has_weights_starts_from_them(
    live_server, tmp_path: Path
) -> None:
    """A server started from the script's initial weights (built here): the group skips the
    gather of its own weights and takes the server's rows, and ends where plain SGD does."""
    torch.manual_seed(0)
    first, last = torch.nn.Linear(5, 7), torch.nn.Linear(7, 1)
    initial = {"first.weight": first.weight, "first.bias": first.bias,
               "last.weight": last.weight, "last.bias": last.bias}  # fmt: skip
    initial = {name: t.detach().clone() for name, t in initial.items()}
    initial["seen"] = torch.zeros((), dtype=torch.int64)
    settings = ServerSettings(sync_every=2, outer_optimizer="sgd", outer_lr=1.0)
    with live_server(settings, initial) as server:
        lines = run_group(server.url, "fsdp", tmp_path)
        weights, round_number = server_weights(server.url)
    assert [line["error"] for line in lines] == [None, None] and round_number == 3
    for name, value in plain_sgd().items():
        torch.testing.assert_close(weights[name], value.detach(), msg=name)


@SLOW
def test_bf16_uploads_with_error_feedback_and_bf16_downloads_match_one_process(
    live_server, tmp_path: Path
) -> None:
    """Each rank codes its own rows to bf16 and keeps their residual; the one-process worker
    codes whole tensors. Equal up to a bf16 rounding that float order can flip."""
    settings = ServerSettings(sync_every=2, outer_optimizer="sgd", outer_lr=1.0,
                              upload_codec="bf16", error_feedback_beta=0.95,
                              download_dtype=torch.bfloat16)  # fmt: skip
    runs = {}
    for variant, ranks in (("fsdp", 2), ("plain", 1)):
        out = tmp_path / variant
        out.mkdir()
        with live_server(settings) as server:
            lines = run_group(server.url, variant, out, ranks)
            runs[variant], round_number = server_weights(server.url)
        assert [line["error"] for line in lines] == [None] * ranks and round_number == 3
        for line in lines:
            for name, value in line["state"].items():  # the bf16 download, on every rank
                served = runs[variant][name]
                torch.testing.assert_close(torch.tensor(value).to(served.dtype), served)
    for name, value in runs["plain"].items():
        assert runs["fsdp"][name].dtype == value.dtype == torch.bfloat16 or name == "seen"
        torch.testing.assert_close(runs["fsdp"][name].double(), value.double(), rtol=0,
                                   atol=4e-3, msg=name)  # fmt: skip


@pytest.mark.parametrize(
    ("variant", "rank_0_says", "rank_1_says"),
    [
        ("disagree", "rank(s) 1 of the worker's group hold another model than rank 0",
         "rank 1 of the worker's group holds another model than rank 0: tensor 'first.bias' "
         "has shape [8], the model has [7]"),
        pytest.param("half", "rank(s) 1 of the worker's group shard the model differently "
                     "from rank 0 (rank 0 does use FSDP)", "shard the model differently",
                     marks=SLOW),
        pytest.param("dtype", "rank(s) 1 of the worker's group hold another model than rank 0",
                     "tensor 'first.bias' is torch.float64, rank 0 has torch.float32",
                     marks=SLOW),
        pytest.param("hsdp", "a DiLoCo worker takes fully_shard's layout: rows split "
                     "(Shard(0)) over a 1-D mesh of all 2 ranks",
                     "a DiLoCo worker takes fully_shard's layout", marks=SLOW),
    ],
)  # fmt: skip
def test_a_group_that_cannot_be_one_worker_fails_on_every_rank_before_joining(
    live_server, tmp_path: Path, variant: str, rank_0_says: str, rank_1_says: str
) -> None:
    with live_server(ServerSettings(sync_every=2)) as server:
        lines = run_group(server.url, variant, tmp_path)
        assert server.coordinator.status()["workers"] == []  # nothing reached the run
    assert rank_0_says in lines[0]["error"], lines[0]["error"]
    assert rank_1_says in lines[1]["error"], lines[1]["error"]


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        pytest.param(ServerSettings(mode="streaming", sync_every=2, fragments=2),
                     "the server runs streaming mode; an FSDP-sharded worker syncs in sync or "
                     "async mode", marks=SLOW),
        (ServerSettings(sync_every=2, upload_codec="int8"),
         "the server sets upload codec int8; an FSDP-sharded worker sends fp32 or bf16"),
        pytest.param(ServerSettings(sync_every=2, download_codec="int8"),
                     "the server sets download codec int8; an FSDP-sharded worker sends fp32 "
                     "or bf16", marks=SLOW),
    ],
)  # fmt: skip
def test_settings_a_sharded_worker_cannot_follow_fail_on_every_rank(
    live_server, tmp_path: Path, settings: ServerSettings, says: str
) -> None:
    with live_server(settings) as server:
        lines = run_group(server.url, "fsdp", tmp_path)
        assert server.coordinator.status()["workers"] == []
    assert all(says in line["error"] for line in lines), lines


@SLOW
def test_a_sharded_worker_refuses_a_checkpoint_dir_even_on_one_rank(
    live_server, tmp_path: Path
) -> None:
    """Its state dict holds DTensors; the worker checkpoint saves plain tensors."""
    with live_server(ServerSettings(sync_every=2)) as server:
        (line,) = run_group(server.url, "checkpoint", tmp_path, ranks=1)
    assert "checkpoint_dir is for unsharded workers" in line["error"]


@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`")  # (one rank)
def test_an_fsdp1_model_is_refused_before_anything_reaches_the_server(tmp_path: Path) -> None:
    """FullyShardedDataParallel (FSDP1, the Trainer's and Lightning's FSDP v1): its
    state_dict() is a collective returning copies, so rank 0 reading it alone hung the group
    (or weights went into copies). Refused with one sentence, before any request (the URL
    has no server: a request would fail otherwise). A one-rank gloo group on the CPU."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel

    from diloco.worker import DiLoCoWorker

    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        model = FullyShardedDataParallel(torch.nn.Linear(4, 2), device_id=torch.device("cpu"))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(ValueError, match=r"FullyShardedDataParallel \(FSDP1\)"):
            DiLoCoWorker(model, optimizer, "http://127.0.0.1:9", worker_id="w")
    finally:
        dist.destroy_process_group()
