"""A model the server's machine cannot hold is refused at the first registration (507, naming
the sizes), before anything is allocated or recorded; the estimate is worked by hand."""

from __future__ import annotations

import pytest
import torch
import urllib3

from diloco.server.coordinator import Coordinator
from diloco.server.errors import Rejection
from diloco.server.model.footprint import (
    available_bytes,
    bytes_needed,
    disk_bytes_needed,
    model_bytes,
)
from diloco.server.settings import ServerSettings
from diloco.wire import TensorSpec

SPECS = [
    TensorSpec("w", (250, 4), torch.float32, "trainable"),  # 1000 fp32: 4000 bytes
    TensorSpec("h", (100,), torch.bfloat16, "trainable"),  # kept in fp32: 400 bytes
    TensorSpec("steps", (3,), torch.int64, "int_buffer"),  # 24 bytes
]


def test_the_footprint_is_four_model_copies_five_with_deltas_and_the_ram_bodies() -> None:
    assert model_bytes(SPECS) == 4000 + 400 + 24
    assert bytes_needed(SPECS, ServerSettings()) == 4 * 4424
    assert bytes_needed(SPECS, ServerSettings(download_codec="int8")) == 5 * 4424
    # two fp32 bodies in RAM, then two bf16 ones (half the bytes each)
    assert bytes_needed(SPECS, ServerSettings(memory_bodies=2)) == 4 * 4424 + 2 * 4424
    bf16 = ServerSettings(memory_bodies=2, upload_dtype=torch.bfloat16)
    assert bytes_needed(SPECS, bf16) == 4 * 4424 + 2 * 2212
    # sparse_mean (top-k's default) counts each element's senders: one fp32 model more
    assert bytes_needed(SPECS, ServerSettings(upload_codec="topk:0.5+int2")) == 5 * 4424


def test_this_machine_reports_its_available_memory() -> None:
    available = available_bytes()
    assert available is None or available > 0


def test_a_model_too_large_for_the_machine_is_refused_naming_the_sizes() -> None:
    coordinator = Coordinator(ServerSettings(), None)
    coordinator.registrar.available_memory = lambda: 10_000  # bytes: below 4 x 4424
    with pytest.raises(Rejection) as refused:
        coordinator.register("w0", SPECS, protocol_version=1)
    rejection = refused.value
    assert rejection.status == 507 and rejection.kind == "insufficient_memory"
    assert rejection.detail["model_bytes"] == 4424
    assert rejection.detail["needed_bytes"] == 17696
    assert rejection.detail["available_bytes"] == 10_000
    assert "diloco cluster --shards N" in rejection.error
    # nothing was recorded: no model, no member; with the memory, the same worker joins
    assert coordinator.model.specs is None and coordinator.membership.live_ids() == set()
    coordinator.registrar.available_memory = lambda: 17696
    assert coordinator.register("w0", SPECS, protocol_version=1)["worker_id"] == "w0"
    assert coordinator.model.specs is not None


def test_over_http_the_refusal_is_a_507_json_body_and_the_run_has_no_model(live_server) -> None:
    tensors = [
        {"name": s.name, "shape": list(s.shape), "dtype": d, "kind": s.kind}
        for s, d in zip(SPECS, ("float32", "bfloat16", "int64"), strict=True)
    ]
    body = {"protocol_version": 1, "worker_id": "w0", "tensors": tensors}
    with live_server() as server:
        server.coordinator.registrar.available_memory = lambda: 10_000
        pool = urllib3.PoolManager(timeout=30)
        headers = {"X-Diloco-Protocol": "1"}
        answer = pool.request("POST", server.url + "/v1/workers", json=body, headers=headers)
        assert answer.status == 507, answer.data
        refusal = answer.json()
        assert refusal["kind"] == "insufficient_memory"
        assert refusal["detail"] == {
            "model_bytes": 4424, "needed_bytes": 17696, "available_bytes": 10_000
        }  # fmt: skip
        assert "this model is 0 MiB in fp32" in refusal["error"]
        info = pool.request("GET", server.url + "/v1/info").json()
        assert info["model_fingerprint"] is None


def test_the_state_dir_holds_the_kept_checkpoints_one_being_written_and_the_step_log() -> None:
    # 3 kept + 1 written, each masters and momentum (2 x 4424), and 4 logged steps of 4424;
    # delta downloads add the published copy to each generation
    assert disk_bytes_needed(SPECS, ServerSettings(), 3, 4) == 4 * 2 * 4424 + 4 * 4424
    with_deltas = ServerSettings(download_codec="int8")
    assert disk_bytes_needed(SPECS, with_deltas, 3, 0) == 4 * 3 * 4424
    # steps that log their uploads (no more bytes than the sums): and the open round's copies
    assert disk_bytes_needed(SPECS, ServerSettings(), 3, 4, True) == 4 * 2 * 4424 + 5 * 4424


def test_a_model_whose_state_the_disk_cannot_hold_is_refused_naming_the_sizes(tmp_path) -> None:
    from diloco.server.state.journal import RoundJournal
    from diloco.server.state.store import StateStore

    settings = ServerSettings(min_workers=2)
    journal = RoundJournal(StateStore(tmp_path / "state"), settings, checkpoint_every=4)
    coordinator = Coordinator(settings, journal=journal)
    # 3 kept + 1 written, and 4 logged steps, and the open round's copies of the uploads
    needed = 4 * 2 * 4424 + 5 * 4424
    asked: list[object] = []

    def free(directory):
        asked.append(directory)
        return needed - 1

    coordinator.registrar.free_disk = free
    with pytest.raises(Rejection) as refused:
        coordinator.register("w0", SPECS, protocol_version=1)
    rejection = refused.value
    assert rejection.status == 507 and rejection.kind == "insufficient_storage"
    assert rejection.detail == {
        "model_bytes": 4424,
        "needed_bytes": needed,
        "free_bytes": needed - 1,
    }
    assert "4 logged steps of one model each: --checkpoint-every, and the open round" in (
        rejection.error
    )
    assert asked == [tmp_path / "state"]
    assert coordinator.model.specs is None and coordinator.membership.live_ids() == set()
    coordinator.registrar.free_disk = lambda directory: needed
    assert coordinator.register("w0", SPECS, protocol_version=1)["worker_id"] == "w0"
    coordinator.close()


def test_without_a_state_dir_the_disk_is_not_asked() -> None:
    coordinator = Coordinator(ServerSettings(), None)
    coordinator.registrar.free_disk = lambda directory: pytest.fail("asked")  # type: ignore[assignment]
    assert coordinator.register("w0", SPECS, protocol_version=1)["worker_id"] == "w0"
