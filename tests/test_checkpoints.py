"""CheckpointStore: atomic generations on real files, checksum fallback, pruning, permissions."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import stat
from pathlib import Path

import pytest
import torch
import xxhash

from diloco import checkpoints
from diloco.checkpoints import MANIFEST_NAME, RECYCLED_NAME, CheckpointStore
from diloco.wire import encode_tensors


def _tensors(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "weights": {
            "w": torch.randn(4, 3, generator=generator),
            "b": torch.randn(5, generator=generator).to(torch.bfloat16),
            "scalar": torch.tensor(float(seed)),
        },
        "outer_state": {
            "step": torch.tensor(seed, dtype=torch.int64),
            "counts": torch.arange(6, dtype=torch.int64).reshape(2, 3),
            "mask": torch.tensor([True, False, True]),
        },
    }


def _assert_bitwise_equal(
    actual: dict[str, dict[str, torch.Tensor]], expected: dict[str, dict[str, torch.Tensor]]
) -> None:
    assert actual.keys() == expected.keys()
    for group, tensors in expected.items():
        assert actual[group].keys() == tensors.keys()
        for name, tensor in tensors.items():
            got = actual[group][name]
            assert got.dtype == tensor.dtype
            assert got.shape == tensor.shape
            as_bytes = got.reshape(-1).view(torch.uint8)
            assert torch.equal(as_bytes, tensor.reshape(-1).view(torch.uint8))


def _gen_dir(root: Path, generation: int) -> Path:
    return root / f"gen-{generation:012d}"


def test_round_trip_is_bitwise_and_keeps_metadata(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    tensors = _tensors(1)
    metadata = {"round": 7, "settings": {"H": 500, "mode": "sync"}, "lr": 0.7}
    path = store.write(7, tensors, metadata)

    assert path == _gen_dir(tmp_path / "ckpt", 7)
    assert sorted(p.name for p in path.iterdir()) == [
        MANIFEST_NAME,
        "outer_state.safetensors",
        "weights.safetensors",
    ]
    loaded = CheckpointStore(tmp_path / "ckpt").load_latest()
    assert loaded is not None
    assert loaded.generation == 7
    assert loaded.path == path
    assert loaded.metadata == metadata
    _assert_bitwise_equal(loaded.tensors, tensors)
    assert loaded.tensors["weights"]["scalar"].dim() == 0
    assert loaded.tensors["outer_state"]["step"].item() == 1


def test_empty_directory_loads_none(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "missing" / "ckpt")
    assert (tmp_path / "missing" / "ckpt").is_dir()
    assert store.load_latest() is None
    assert store.generations() == []


def test_keep_prunes_older_generations(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    for generation in (1, 2, 3, 5):
        store.write(generation, _tensors(generation), {"round": generation})
    assert store.generations() == [3, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "gen-000000000003",
        "gen-000000000005",
    ]
    loaded = store.load_latest()
    assert loaded is not None and loaded.metadata == {"round": 5}


def test_unpruned_writes_keep_every_generation_until_dropped(tmp_path: Path) -> None:
    """A step log writes without pruning (off its critical path) and drops what its
    checkpoints hold later: `drop(first, last)` removes exactly that range and temp dirs."""
    store = CheckpointStore(tmp_path, keep=1)
    for generation in (1, 2, 3, 5):
        store.write(generation, _tensors(generation), {"round": generation}, prune=False)
    assert store.generations() == [1, 2, 3, 5]
    (tmp_path / "gen-000000000006.tmp-00ff").mkdir()  # a write a crash cut short
    store.drop(last=2)
    assert store.generations() == [3, 5]
    assert not (tmp_path / "gen-000000000006.tmp-00ff").exists()
    store.drop(4)
    assert store.generations() == [3]
    store.drop()
    assert store.generations() == [] and store.load_latest() is None


@pytest.mark.parametrize("keep", [0, -1])
def test_keep_below_one_is_rejected(tmp_path: Path, keep: int) -> None:
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(tmp_path, keep=keep)


def test_non_monotonic_generation_is_rejected(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.write(4, _tensors(4), {})
    for generation in (4, 3):
        with pytest.raises(ValueError, match="not newer"):
            store.write(generation, _tensors(generation), {})
    assert store.generations() == [4]


def test_flipped_byte_falls_back_with_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path)
    store.write(1, _tensors(1), {"round": 1})
    newest = store.write(2, _tensors(2), {"round": 2})
    target = newest / "weights.safetensors"
    data = bytearray(target.read_bytes())
    data[-3] ^= 0x01  # inside the tensor data: the header still parses, only the hash catches it
    target.write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING, logger="diloco.server"):
        loaded = store.load_latest()
    assert loaded is not None
    assert loaded.generation == 1
    _assert_bitwise_equal(loaded.tensors, _tensors(1))
    assert any("weights.safetensors" in r.getMessage() for r in caplog.records)
    assert any("gen-000000000002" in r.getMessage() for r in caplog.records)


def _as_sha256_manifest(generation: Path) -> None:
    """Rewrite a generation's manifest as a server before XXH3-128 wrote it: each file's
    SHA-256 (hashlib's, over the bytes on disk) under "sha256"."""
    manifest = json.loads((generation / MANIFEST_NAME).read_text())
    assert manifest["format"] == 2
    manifest["format"] = 1
    for name, entry in manifest["files"].items():
        del entry["xxh3_128"]
        entry["sha256"] = hashlib.sha256((generation / name).read_bytes()).hexdigest()
    (generation / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_a_generation_written_with_sha256_checksums_still_loads_and_is_checked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A state dir from before XXH3-128: its manifests name SHA-256. The newest loads, checked
    with SHA-256 (a flipped byte in the next one makes it fall back, naming the check)."""
    store = CheckpointStore(tmp_path)
    for generation in (1, 2):
        _as_sha256_manifest(store.write(generation, _tensors(generation), {"round": generation}))
    loaded = store.load_latest()
    assert loaded is not None and loaded.generation == 2
    _assert_bitwise_equal(loaded.tensors, _tensors(2))
    target = _gen_dir(tmp_path, 2) / "weights.safetensors"
    data = bytearray(target.read_bytes())
    data[-3] ^= 0x01
    target.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="diloco.server"):
        loaded = store.load_latest()
    assert loaded is not None and loaded.generation == 1
    assert any("fails its sha256 check" in r.getMessage() for r in caplog.records)


def test_a_generation_of_a_later_format_is_neither_loaded_nor_pruned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Going back a version: the newest generation was written by a later one (format 3 in
    its manifest). It is not loaded (the one before is), and the writes that follow, which
    prune what is past `keep`, leave it where it is for the later version to read again."""
    store = CheckpointStore(tmp_path, keep=1)
    store.write(1, _tensors(1), {"round": 1})
    later = store.write(2, _tensors(2), {"round": 2}, prune=False)
    manifest = json.loads((later / MANIFEST_NAME).read_text())
    manifest["format"] = 3
    (later / MANIFEST_NAME).write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="diloco.server"):
        loaded = store.load_latest()
    assert loaded is not None and loaded.generation == 1
    assert "is format 3, not one this version reads (1, 2): a later version wrote it" in (
        caplog.text
    )
    store.write(3, _tensors(3), {"round": 3})
    store.write(4, _tensors(4), {"round": 4})
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("gen-")) == [
        "gen-000000000002",
        "gen-000000000004",
    ]


class _Adopted:
    """An upload's body written before its step (an AdoptedFile), durable at once."""

    def __init__(self, path: Path, data: bytes) -> None:
        self.path = path
        path.write_bytes(data)
        self.data = data

    def durable(self) -> tuple[int, str]:
        return len(self.data), xxhash.xxh3_128(self.data).hexdigest()


def test_a_step_log_of_adopted_bodies_written_with_sha256_still_loads_and_is_checked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A step log from before XXH3-128 that holds the round's bodies (adopted files): its
    manifest names each body's SHA-256; the body loads, verified with it, and a flipped byte
    in it makes the step unusable, the check named."""
    store = CheckpointStore(tmp_path / "steps")
    data = b"a body as it came" * 1000
    adopted = {"input-0000.body": _Adopted(tmp_path / "upload.body", data)}
    path = store.stage(3, {}, {"round": 3}, adopted=adopted)()
    assert json.loads((path / MANIFEST_NAME).read_text())["files"]["input-0000.body"] == {
        "bytes": len(data),
        "xxh3_128": xxhash.xxh3_128(data).hexdigest(),
    }
    _as_sha256_manifest(path)
    loaded = store.load(3)
    assert loaded is not None and loaded.bodies["input-0000.body"].read_bytes() == data
    damaged = bytearray(data)
    damaged[5] ^= 0x01
    (path / "input-0000.body").write_bytes(bytes(damaged))
    with caplog.at_level(logging.WARNING, logger="diloco.server"):
        assert store.load(3) is None
    assert "input-0000.body fails its sha256 check" in caplog.text


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ({"bytes": 1}, "names no checksum (one of xxh3_128, sha256)"),
        (
            {"bytes": 1, "xxh3_128": "0" * 32, "sha256": "0" * 64},
            "names 2 checksums (xxh3_128, sha256), not one",
        ),
        # a SHA-256's length under XXH3-128's name, and the other way round
        ({"bytes": 1, "xxh3_128": "0" * 64}, "has a xxh3_128 that is not xxh3_128's lower-case"),
        ({"bytes": 1, "sha256": "0" * 32}, "has a sha256 that is not sha256's lower-case hex"),
        ({"bytes": 1, "xxh3_128": "Z" * 32}, "has a xxh3_128 that is not"),
        ({"bytes": 1, "md5": "0" * 32}, "names no checksum (one of xxh3_128, sha256)"),
    ],
)
def test_a_manifest_entry_without_exactly_one_well_formed_checksum_is_unusable(
    tmp_path: Path, entry: dict, problem: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path)
    store.write(1, _tensors(1), {"round": 1})
    newest = store.write(2, _tensors(2), {"round": 2})
    manifest = json.loads((newest / MANIFEST_NAME).read_text())
    name = "weights.safetensors"
    entry = {**entry, "bytes": manifest["files"][name]["bytes"]}
    manifest["files"][name] = entry
    (newest / MANIFEST_NAME).write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="diloco.server"):
        loaded = store.load_latest()
    assert loaded is not None and loaded.generation == 1
    assert f"entry for 'weights.safetensors' {problem}" in caplog.text


def test_missing_manifest_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = CheckpointStore(tmp_path)
    store.write(1, _tensors(1), {"round": 1})
    newest = store.write(2, _tensors(2), {"round": 2})
    (newest / MANIFEST_NAME).unlink()  # as if the crash came just before the manifest

    assert store.generations() == [1]
    with caplog.at_level(logging.WARNING, logger="diloco.server"):
        loaded = store.load_latest()
    assert loaded is not None and loaded.generation == 1
    assert any(MANIFEST_NAME in r.getMessage() for r in caplog.records)


def test_truncated_manifest_is_ignored(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.write(1, _tensors(1), {"round": 1})
    newest = store.write(2, _tensors(2), {"round": 2})
    manifest = newest / MANIFEST_NAME
    manifest.write_bytes(manifest.read_bytes()[:20])

    assert store.generations() == [1]
    loaded = store.load_latest()
    assert loaded is not None and loaded.generation == 1


def test_only_corrupt_generations_load_none(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    only = store.write(1, _tensors(1), {})
    (only / "outer_state.safetensors").write_bytes(b"garbage")
    assert store.load_latest() is None


def test_leftover_temp_dir_is_ignored_and_cleaned(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.write(1, _tensors(1), {"round": 1})
    leftover = tmp_path / "gen-000000000002.tmp-deadbeef"
    leftover.mkdir()
    (leftover / "weights.safetensors").write_bytes(b"half written")

    assert store.generations() == [1]
    loaded = store.load_latest()
    assert loaded is not None and loaded.generation == 1

    store.write(2, _tensors(2), {"round": 2})
    assert not leftover.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "gen-000000000001",
        "gen-000000000002",
    ]


def test_file_modes_default_and_survive(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    first = store.write(1, _tensors(1), {})
    assert stat.S_IMODE((first / "weights.safetensors").stat().st_mode) == 0o600
    assert stat.S_IMODE((first / MANIFEST_NAME).stat().st_mode) == 0o600

    (first / "weights.safetensors").chmod(0o640)
    second = store.write(2, _tensors(2), {})
    assert stat.S_IMODE((second / "weights.safetensors").stat().st_mode) == 0o640
    assert stat.S_IMODE((second / "outer_state.safetensors").stat().st_mode) == 0o600


def test_failed_write_leaves_previous_generation(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.write(1, _tensors(1), {"round": 1})
    bad = {"weights": {"w": torch.zeros(2, dtype=torch.complex64)}}
    with pytest.raises(ValueError):
        store.write(2, bad, {"round": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gen-000000000001"]
    with pytest.raises(TypeError):
        store.write(2, _tensors(2), {"not_json": object()})
    assert store.generations() == [1]


def test_a_group_is_written_byte_for_byte_as_encode_tensors_writes_it(tmp_path: Path) -> None:
    """Written straight from the tensors' memory (no body copy), the file is still exactly the
    safetensors body `encode_tensors` makes, and the manifest's XXH3-128 is that body's."""
    group = {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),  # strided: copied first
        "h": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
        "steps": torch.tensor(7, dtype=torch.int64),  # 0-dim
        "mask": torch.tensor([True, False, True]),
        "none": torch.zeros(0, 5),
    }
    store = CheckpointStore(tmp_path)
    path = store.write(0, {"weights": group}, {"round": 0})
    expected = bytes(encode_tensors(group))
    assert (path / "weights.safetensors").read_bytes() == expected
    manifest = json.loads((path / "manifest.json").read_text())
    entry = manifest["files"]["weights.safetensors"]
    assert entry == {"bytes": len(expected), "xxh3_128": xxhash.xxh3_128(expected).hexdigest()}
    loaded = store.load_latest()
    assert loaded is not None
    for name, tensor in group.items():
        assert torch.equal(loaded.tensors["weights"][name], tensor), name


def test_a_generation_hashed_when_made_durable_keeps_what_was_staged(tmp_path: Path) -> None:
    """The step log's way (`hash_when_durable`): once `stage` returns, the tensors' memory may
    move (the outer step divides the sums in place) while another thread hashes each file
    from the page cache and syncs it; the generation holds the staged values, and its
    manifest the XXH3-128 of the bytes encode_tensors makes of them (the xxhash package's)."""
    sums = {"a": torch.arange(3 * (9 << 20) // 4, dtype=torch.float32), "b": torch.ones(5)}
    staged = {name: tensor.clone() for name, tensor in sums.items()}
    store = CheckpointStore(tmp_path)
    durable = store.stage(0, {"steps": sums}, {"round": 0}, hash_when_durable=True)
    for tensor in sums.values():
        tensor.mul_(-3.0)  # the step, after stage: the files no longer read this memory
    path = durable()
    expected = bytes(encode_tensors(staged))
    assert len(expected) > 8 << 20  # read back in more than one 8 MiB read
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["files"]["steps.safetensors"] == {
        "bytes": len(expected),
        "xxh3_128": xxhash.xxh3_128(expected).hexdigest(),
    }
    loaded = store.load_latest()
    assert loaded is not None
    for name, tensor in staged.items():
        assert torch.equal(loaded.tensors["steps"][name], tensor), name


def test_a_recycling_store_writes_over_the_files_it_dropped(tmp_path: Path) -> None:
    """`recycle`: a dropped generation's files wait in `recycled/` (up to the limit) and the
    next generations are written over them, the same inode, cut to their own size; what
    they read back is what was written, checked against the manifest's checksum."""
    store = CheckpointStore(tmp_path, keep=1, recycle=2)
    big = {f"g{i}": {"t": torch.arange(1000, dtype=torch.float32) + i} for i in range(3)}
    store.write(0, big, {"round": 0}, prune=False)
    inodes = {(tmp_path / "gen-000000000000" / f"g{i}.safetensors").stat().st_ino for i in range(3)}
    store.drop(last=0)
    pooled = sorted((tmp_path / RECYCLED_NAME).iterdir())
    assert len(pooled) == 2 and {p.stat().st_ino for p in pooled} < inodes  # 2 of the 3
    small = {"g0": {"t": torch.tensor([7.0, 8.0])}}
    path = store.write(1, small, {"round": 1})
    written = path / "g0.safetensors"
    assert written.stat().st_ino in inodes
    assert written.stat().st_size == len(encode_tensors(small["g0"]))  # the old tail is cut
    assert len(list((tmp_path / RECYCLED_NAME).iterdir())) == 1
    loaded = store.load(1)
    assert loaded is not None and torch.equal(loaded.tensors["g0"]["t"], small["g0"]["t"])


def test_a_store_without_recycle_deletes_what_it_drops(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=1)
    store.write(0, {"g": {"t": torch.ones(4)}}, {"round": 0})
    store.write(1, {"g": {"t": torch.ones(4)}}, {"round": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gen-000000000001"]


def test_the_step_logs_way_over_a_recycled_file_and_a_pool_cut_at_start(tmp_path: Path) -> None:
    """`hash_when_durable` (the step log's stage) over a recycled file: the manifest's hash is
    that of the new bytes, read back from the file. A pool larger than a restarted store's
    limit is cut to it."""
    store = CheckpointStore(tmp_path, keep=1, recycle=3)
    store.write(0, {"steps": {"s": torch.arange(5000, dtype=torch.float32)}}, {"round": 0})
    store.drop(last=0)
    assert len(list((tmp_path / RECYCLED_NAME).iterdir())) == 1
    sums = {"s": torch.full((10,), 2.5)}
    durable = store.stage(1, {"steps": sums}, {"round": 1}, hash_when_durable=True)
    sums["s"].mul_(-1)  # the step, after stage
    durable()
    expected = bytes(encode_tensors({"s": torch.full((10,), 2.5)}))
    manifest = json.loads((tmp_path / "gen-000000000001" / MANIFEST_NAME).read_text())
    assert manifest["files"]["steps.safetensors"] == {
        "bytes": len(expected),
        "xxh3_128": xxhash.xxh3_128(expected).hexdigest(),
    }
    for i in range(5):
        (tmp_path / RECYCLED_NAME / f"extra-{i}.safetensors").write_bytes(b"x" * 10)
    CheckpointStore(tmp_path, keep=1, recycle=2)
    assert len(list((tmp_path / RECYCLED_NAME).iterdir())) == 2


def _direct_switches(monkeypatch: pytest.MonkeyPatch, refuse: bool) -> list[bool]:
    """Record each switch of a descriptor to O_DIRECT, and whether it took; `refuse`: the
    file system refuses it (EINVAL, as some do). Skips where O_DIRECT is missing or the test's
    file system really refuses it (the direct path would not be tested)."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        pytest.skip("no O_DIRECT on this platform")
    switched: list[bool] = []
    real_fcntl = fcntl.fcntl

    def recording_fcntl(fd, command, *args):
        if command == fcntl.F_SETFL and args[0] & direct:
            if refuse:
                switched.append(False)
                raise OSError(errno.EINVAL, "Invalid argument")
            try:
                result = real_fcntl(fd, command, *args)
            except OSError as exc:
                if exc.errno == errno.EINVAL:
                    pytest.skip("the test's file system refuses O_DIRECT")
                raise
            switched.append(True)
            return result
        return real_fcntl(fd, command, *args)

    monkeypatch.setattr(fcntl, "fcntl", recording_fcntl)
    return switched


def _direct_writes_refused(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every write on a descriptor in O_DIRECT refused with EINVAL (a file system that wants
    a larger alignment); the offsets refused, in order."""
    refused: list[int] = []
    real_pwrite = os.pwrite

    def picky_pwrite(fd, data, offset) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(checkpoints.os, "pwrite", picky_pwrite)
    return refused


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("refused", [False, True], ids=["o_direct", "refused"])
def test_the_step_logs_direct_write_is_the_body_byte_for_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused: bool
) -> None:
    """`direct` (the step log's stage): written around the page cache through one aligned
    buffer (here of 8 KiB, so the body spans many, and ends in a padded tail cut back to its
    size), over a recycled file longer than it, hashed as it goes: the file is exactly
    encode_tensors' body, the manifest has the xxhash package's XXH3-128 of it, and the
    sums may move once `stage` returns. A file system that refuses O_DIRECT gets the same
    bytes through the page cache."""
    monkeypatch.setattr(checkpoints, "_DIRECT_CHUNK", 8192)
    store = CheckpointStore(tmp_path, keep=1, recycle=1)
    store.write(0, {"steps": {"s": torch.ones(50_000)}}, {"round": 0})  # 200 KB, recycled
    store.drop(last=0)
    sums = {"a": torch.arange(10_007, dtype=torch.float32), "b": torch.full((3,), -0.5)}
    staged = {name: tensor.clone() for name, tensor in sums.items()}
    switched = _direct_switches(monkeypatch, refuse=refused)
    durable = store.stage(1, {"steps": sums}, {"round": 1}, direct=True)
    for tensor in sums.values():
        tensor.mul_(-3.0)  # the step, after stage
    path = durable()
    expected = bytes(encode_tensors(staged))
    assert len(expected) % 4096 and len(expected) > 4 * 8192
    written = path / "steps.safetensors"
    assert written.read_bytes() == expected
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["files"]["steps.safetensors"] == {
        "bytes": len(expected),
        "xxh3_128": xxhash.xxh3_128(expected).hexdigest(),
    }
    assert list((tmp_path / RECYCLED_NAME).iterdir()) == []  # written over the recycled file
    assert switched == [not refused]  # one file, switched or (refused) not
    loaded = store.load_latest()
    assert loaded is not None
    for name, tensor in staged.items():
        assert torch.equal(loaded.tensors["steps"][name], tensor), name


def test_a_direct_write_that_fails_part_way_leaves_no_generation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that fails the second of a file's writes (EIO): `stage` raises it, nothing is
    staged, and no descriptor is left open."""
    monkeypatch.setattr(checkpoints, "_DIRECT_CHUNK", 8192)
    switched = _direct_switches(monkeypatch, refuse=False)
    store = CheckpointStore(tmp_path)
    writes = []
    real_pwrite = os.pwrite

    def failing_pwrite(fd, data, offset) -> int:
        writes.append(offset)
        if len(writes) == 2:
            raise OSError(errno.EIO, "Input/output error")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(checkpoints.os, "pwrite", failing_pwrite)
    before = _open_descriptors()
    with pytest.raises(OSError, match="Input/output error"):
        store.stage(0, {"steps": {"s": torch.ones(10_000)}}, {"round": 0}, direct=True)
    assert switched == [True] and writes == [0, 8192]
    assert list(tmp_path.iterdir()) == [] and _open_descriptors() == before


def test_a_direct_write_the_file_system_refuses_goes_on_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system that takes the O_DIRECT switch but refuses its writes (EINVAL: it wants
    a larger alignment): the descriptor is switched back and the same bytes are written
    through the page cache, the first refused buffer again at its offset; the checksum is
    still that of the file's bytes."""
    monkeypatch.setattr(checkpoints, "_DIRECT_CHUNK", 8192)
    switched = _direct_switches(monkeypatch, refuse=False)
    refused = _direct_writes_refused(monkeypatch)
    sums = {"s": torch.arange(10_000, dtype=torch.float32)}
    store = CheckpointStore(tmp_path)
    path = store.stage(0, {"steps": sums}, {"round": 0}, direct=True)()
    expected = bytes(encode_tensors(sums))
    assert switched == [True] and refused == [0]
    assert (path / "steps.safetensors").read_bytes() == expected
    entry = json.loads((path / MANIFEST_NAME).read_text())["files"]["steps.safetensors"]
    assert entry["xxh3_128"] == xxhash.xxh3_128(expected).hexdigest()


def test_a_direct_write_of_whole_buffers_has_no_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body of exactly four 8 KiB buffers: four writes, no padded tail, nothing to cut."""
    monkeypatch.setattr(checkpoints, "_DIRECT_CHUNK", 8192)
    switched = _direct_switches(monkeypatch, refuse=False)
    count = next(n for n in range(8000, 8200) if len(encode_tensors({"s": torch.ones(n)})) == 32768)
    sums = {"s": torch.full((count,), 0.25)}
    writes = []
    real_pwrite = os.pwrite

    def counted(fd, data, offset) -> int:
        writes.append((offset, len(data)))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(checkpoints.os, "pwrite", counted)
    path = CheckpointStore(tmp_path).stage(0, {"steps": sums}, {"round": 0}, direct=True)()
    assert switched == [True] and writes == [(at, 8192) for at in range(0, 32768, 8192)]
    assert (path / "steps.safetensors").read_bytes() == bytes(encode_tensors(sums))


def copied_directly(source: Path, target: Path, size: int) -> str:
    """`copy_file_direct` from `source`'s file into `target`'s (made if missing)."""
    read_fd = os.open(source, os.O_RDONLY)
    write_fd = os.open(target, os.O_CREAT | os.O_RDWR)
    try:
        return checkpoints.copy_file_direct(read_fd, write_fd, size)
    finally:
        os.close(read_fd)
        os.close(write_fd)


@pytest.mark.parametrize("refused", [False, True], ids=["o_direct", "refused"])
def test_a_file_copied_around_the_page_cache_is_its_source_byte_for_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused: bool
) -> None:
    """`copy_file_direct` (a spooled upload into the state dir): the source's first `size`
    bytes (here 6 buffers of 8 KiB and a tail, the source longer than that) over a recycled
    file longer still, read through one aligned buffer and written with O_DIRECT: the target
    is exactly those bytes, cut to their size, and the returned checksum is the xxhash
    package's XXH3-128 of them. Refused O_DIRECT: the same bytes through the page cache."""
    monkeypatch.setattr(checkpoints, "_DIRECT_CHUNK", 8192)
    switched = _direct_switches(monkeypatch, refuse=refused)
    data = bytes(range(256)) * 200 + b"tail"  # 51,204 bytes
    size = len(data) - 4
    source, target = tmp_path / "spooled", tmp_path / "copy"
    source.write_bytes(data)
    target.write_bytes(b"\xff" * 90_000)  # a recycled file's longer old bytes
    digest = copied_directly(source, target, size)
    assert target.read_bytes() == data[:size]
    assert digest == xxhash.xxh3_128(data[:size]).hexdigest()
    assert switched == [not refused]


def test_a_file_copy_whose_direct_writes_are_refused_goes_on_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The O_DIRECT switch taken, its writes refused (EINVAL): the first buffer is written
    again through the page cache at its offset, and so is the rest; the copy and its
    checksum are the source's bytes all the same."""
    monkeypatch.setattr(checkpoints, "_DIRECT_CHUNK", 8192)
    switched = _direct_switches(monkeypatch, refuse=False)
    refused = _direct_writes_refused(monkeypatch)
    data = bytes(range(251)) * 100  # 25,100 bytes: 3 buffers and a tail
    source, target = tmp_path / "spooled", tmp_path / "copy"
    source.write_bytes(data)
    digest = copied_directly(source, target, len(data))
    assert switched == [True] and refused == [0]
    assert target.read_bytes() == data
    assert digest == xxhash.xxh3_128(data).hexdigest()


def test_a_file_copy_from_a_source_shorter_than_told_is_an_error(tmp_path: Path) -> None:
    source, target = tmp_path / "spooled", tmp_path / "copy"
    source.write_bytes(b"x" * 1000)
    with pytest.raises(OSError, match="the file ended after 1000 of 5000 bytes"):
        copied_directly(source, target, 5000)


def test_direct_and_hash_when_durable_are_refused_together(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="hashed as they are written"):
        CheckpointStore(tmp_path).stage(
            0, {"g": {"t": torch.ones(2)}}, {}, direct=True, hash_when_durable=True
        )
    assert list(tmp_path.iterdir()) == []
