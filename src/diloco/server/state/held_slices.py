"""A follower shard's held slices (sync or async), durable before it says it holds them.

Shard 0 decides a round from confirmations that say every shard holds the worker's slices;
a follower folds the decided slices when it learns the decision. If the follower restarts in
between, the slices it held in memory are gone, and a decided worker that died too can never
send its slice again: the follower would wait for good. So a follower with a state dir writes
each slice it takes to `<state-dir>/held-slices/` first, and a restart takes them back
(`Coordinator._take_back_held`), through the same intake as an upload.

Each slice is two files: the body exactly as it came (a safetensors file, coded or plain) and a
small JSON record (worker, session, round, fragment, tokens, units, the body's size and
checksum, see checkpoints.py). Both are written and fsynced under temporary names outside the
coordinator's lock (`prepare`), and renamed into place under it (`keep`) once the round takes
the slice, the record last: a body without a record is a crash's leftover, removed at start,
and a body whose hash is not its record's is dropped when it is taken back. Names sort in
arrival order, so the restart offers the slices in the order they came (a newer process's slice
replaces an older one as it did). The files of slices the follower no longer holds (a step
folded them; async: a later arrival passed their anchor) go as later slices come (`retain`); a
sync follower also drops those of committed rounds at start (`forget_before`). The store reads
the directory once, at start, and keeps its own index after.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from diloco.checkpoints import DIGEST, _fsync_dir, digest_problem, file_digest, named_digest
from diloco.wire.format.frames import encode_tensors
from diloco.wire.format.spool import SpooledTensors, open_spooled

COPY_BYTES = 8 * 1024 * 1024
_NO_KERNEL_COPY = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP}
_KEPT = re.compile(r"(\d{12})-(\d{12})\.json")


@dataclass(frozen=True)
class StoredSlice:
    """A held slice as its record on disk names it."""

    worker_id: str
    session: str | None
    round: int
    fragment: int
    tokens: int
    units: list[int]
    progress: dict[int, int]
    body: Path
    record: Path
    digest: tuple[str, str]  # (algorithm, hex digest) of the body (checkpoints.py)


@dataclass
class PreparedSlice:
    """A body and its record written and fsynced under temporary names, not yet kept."""

    body: Path
    record: Path
    fields: dict


class HeldSlices:
    """The held-slices directory of one follower's state dir."""

    def __init__(self, directory: Path) -> None:
        """Reads what the directory holds once (`stored`); later the store keeps its own
        index, so an upload's bookkeeping reads no directory and no record."""
        self.directory = directory
        directory.mkdir(mode=0o700, exist_ok=True)
        self._kept: dict[Path, StoredSlice] = {}  # by record, in the order they were taken
        self._problems = self._load()
        # record names are ROUND-SEQUENCE.json: the next sequence follows the largest kept
        self._sequence = 1 + max((int(r.stem.split("-")[1]) for r in self._kept), default=0)

    def prepare(
        self,
        tensors: Mapping[str, torch.Tensor] | SpooledTensors,
        metadata: Mapping[str, str] | None,
        *,
        worker_id: str,
        session: str | None,
        round_number: int,
        fragment: int,
        tokens: int,
        units: list[int],
        progress: Mapping[int, int],
    ) -> PreparedSlice:
        """The body and its record on disk and fsynced, under temporary names (outside the
        lock: a model-sized copy, and the body's checksum read back from the page cache)."""
        token = secrets.token_hex(8)
        body = self.directory / f".body.tmp-{token}"
        record = self.directory / f".record.tmp-{token}"
        try:
            with open(body, "wb") as out:
                if isinstance(tensors, SpooledTensors):
                    copy_prefix(tensors.file.fileno(), out.fileno(), tensors.size)
                    size = tensors.size
                else:
                    data = encode_tensors(tensors, metadata=metadata)
                    out.write(data)
                    size = len(data)
                out.flush()
                os.fsync(out.fileno())
            fields = {
                "worker_id": worker_id,
                "session": session,
                "round": round_number,
                "fragment": fragment,
                "tokens": tokens,
                "units": list(units),
                "progress": {str(k): v for k, v in progress.items()},
                "size": size,
                DIGEST: file_digest(body),
            }
            _write_record(record, fields)
        except BaseException:
            body.unlink(missing_ok=True)
            record.unlink(missing_ok=True)
            raise
        return PreparedSlice(body, record, fields)

    def keep(self, prepared: PreparedSlice, session: str | None) -> StoredSlice:
        """The prepared slice under its final names, the record last (lock held: the order
        of `keep` calls is the order the round took the slices). `session`: the one the
        round notes for it, which a re-registration may have changed since `prepare`."""
        fields = prepared.fields
        if session != fields["session"]:
            fields["session"] = session
            _write_record(prepared.record, fields)
        stem = f"{fields['round']:012d}-{self._sequence:012d}"
        self._sequence += 1
        body = self.directory / f"{stem}.body"
        record = self.directory / f"{stem}.json"
        os.rename(prepared.body, body)
        os.rename(prepared.record, record)
        _fsync_dir(self.directory)
        stored = self._kept[record] = _stored(fields, body, record)
        return stored

    def discard(self, prepared: PreparedSlice) -> None:
        prepared.body.unlink(missing_ok=True)
        prepared.record.unlink(missing_ok=True)

    def forget(self, stored: StoredSlice) -> None:
        """One slice gone (its record first, so a crash half way leaves a leftover body)."""
        self._kept.pop(stored.record, None)
        stored.record.unlink(missing_ok=True)
        stored.body.unlink(missing_ok=True)

    def forget_before(self, round_number: int) -> None:
        """Every slice of a round before `round_number` (committed: never needed again)."""
        self.retain(lambda stored: stored.round >= round_number)

    def retain(self, wanted: Callable[[StoredSlice], bool]) -> None:
        """Every slice gone but those `wanted` keeps (an async follower's go once a step
        folded them or passed their anchor)."""
        for stored in [s for s in self._kept.values() if not wanted(s)]:
            self.forget(stored)

    def stored(self) -> tuple[list[StoredSlice], list[str]]:
        """Every kept slice in the order it was taken, and what was wrong with the files
        removed at start instead (a crash's leftovers, a record that cannot be read, a body
        of another size than its record says)."""
        return list(self._kept.values()), list(self._problems)

    def _load(self) -> list[str]:
        """The index of what the directory holds; anything else in it removed, each problem
        said."""
        records = sorted(p for p in self.directory.iterdir() if _KEPT.fullmatch(p.name))
        bodies = {r.with_suffix(".body") for r in records}
        for path in self.directory.iterdir():
            if path in bodies or path in records:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)  # nothing of ours: not left to grow
            else:
                path.unlink(missing_ok=True)  # a temp file, or a body whose record never came
        problems: list[str] = []
        for record in records:
            body = record.with_suffix(".body")
            try:
                fields = json.loads(record.read_text())
                stored = _stored(fields, body, record)
                if body.stat().st_size != int(fields["size"]):
                    raise ValueError(
                        f"its body holds {body.stat().st_size} bytes, not {fields['size']}"
                    )
                self._kept[record] = stored
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                problems.append(f"{record.name}: {exc}")
                record.unlink(missing_ok=True)
                body.unlink(missing_ok=True)
        return problems

    def open(self, stored: StoredSlice) -> SpooledTensors:
        """The slice's body read back as an upload's spooled body, once its checksum is the
        one its record names (ValueError, or WireError when its header is not a body's)."""
        algorithm, expected = stored.digest
        digest = file_digest(stored.body, algorithm)
        if digest != expected:
            raise ValueError(f"its body's {algorithm} is {digest}, not {expected} as written")
        return open_spooled(stored.body)


def _stored(fields: Mapping, body: Path, record: Path) -> StoredSlice:
    session = fields["session"]
    return StoredSlice(
        str(fields["worker_id"]),
        None if session is None else str(session),
        int(fields["round"]),
        int(fields["fragment"]),
        int(fields["tokens"]),
        [int(u) for u in fields["units"]],
        {int(k): int(v) for k, v in fields["progress"].items()},
        body,
        record,
        _digest_of(fields),
    )


def _digest_of(fields: Mapping) -> tuple[str, str]:
    """The body's (algorithm, digest) its record names (a record written before XXH3-128
    names SHA-256); ValueError for a record that names none, or one not in hex."""
    named = named_digest(fields)
    if named is None:
        raise ValueError(f"the record {digest_problem(fields)}")
    return named


def _write_record(path: Path, fields: Mapping) -> None:
    with open(path, "w") as out:
        json.dump(fields, out)
        out.flush()
        os.fsync(out.fileno())


def copy_prefix(source: int, target: int, size: int) -> None:
    """The first `size` bytes of `source` into `target` (in the kernel where it can)."""
    offset, in_kernel = 0, True
    while offset < size:
        count = min(size - offset, COPY_BYTES)
        if in_kernel:
            try:
                copied = os.copy_file_range(source, target, count, offset, offset)
            except OSError as exc:
                if exc.errno not in _NO_KERNEL_COPY:
                    raise
                in_kernel = False
                continue
        else:
            copied = os.pwrite(target, os.pread(source, count, offset), offset)
        if copied == 0:
            raise OSError(f"the spooled body ended after {offset} of {size} bytes")
        offset += copied
