"""Durable checkpoint generations of the coordinator's tensors (weights, outer optimizer state).

One generation is a directory `gen-<generation:012d>` holding one safetensors file per tensor
group (and, in a step log, the upload bodies the step folded: `*.body` files written before it
and moved in, see `AdoptedFile`) and a `manifest.json` with each file's size and checksum
(XXH3-128, see "checksums" below; a generation written before names SHA-256, verified as such).
A generation is built in a temporary directory, every file written and fsynced, the manifest
last (temp file, fsync, os.replace, directory fsync), and only then renamed to its final name:
a crash at any point leaves the previous complete generations, or those plus the new one,
never a half-written one under a final name. Loading verifies checksums before decoding and
falls back to older generations.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import mmap
import os
import re
import secrets
import shutil
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy
import torch
import xxhash

from diloco import faults
from diloco.wire import WireError, decode_tensors
from diloco.wire.format.layout import FrameLayout

__all__ = [
    "BODY_SUFFIX",
    "DIGEST",
    "FORMAT_VERSION",
    "AdoptedFile",
    "CheckpointStore",
    "LoadedCheckpoint",
    "descriptor_digest",
    "digest_of",
    "digest_problem",
    "file_digest",
    "named_digest",
]

# A manifest's format: 2 names XXH3-128 checksums, 1 (read still) SHA-256. A later version
# that changes what a manifest holds raises it; this one keeps such generations, never prunes
# them, so going back a version loses nothing the later one would read (`_newer_format`).
FORMAT_VERSION = 2
_READ_FORMATS = (1, 2)
MANIFEST_NAME = "manifest.json"
_SUFFIX = ".safetensors"
BODY_SUFFIX = ".body"  # a file a generation adopts as it was written, verified, never decoded
_DEFAULT_FILE_MODE = 0o600
_DEFAULT_DIR_MODE = 0o700
_FINAL_DIR = re.compile(r"gen-(\d{12})")
RECYCLED_NAME = "recycled"  # data files of dropped generations, to be written over
_TEMP_DIR = re.compile(r"gen-\d{12}\.tmp-[0-9a-f]+")
_GROUP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")

logger = logging.getLogger("diloco.server")


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A verified generation: tensors by group then name, the metadata it was written with."""

    generation: int
    tensors: dict[str, dict[str, torch.Tensor]]
    metadata: dict[str, Any]
    path: Path
    bodies: dict[str, Path] = field(default_factory=dict)  # adopted files, verified, by name


class AdoptedFile(Protocol):
    """A file written before its generation (an upload's body, copied into the state dir as
    it came) and moved into it by `stage`: `durable` waits for its fsync and returns its size
    and checksum (both computed as it was written, off the step's path)."""

    path: Path

    def durable(self) -> tuple[int, str]: ...


class _Unusable(Exception):
    """A generation on disk that cannot be loaded; the message says which file and why."""


class CheckpointStore:
    """Writes and reads checkpoint generations under one directory, keeping the newest `keep`.

    Assumes a single writer (the coordinator); readers never see a generation before it is
    complete because the final directory name appears only after its manifest is durable.
    """

    def __init__(self, directory: Path, keep: int = 3, recycle: int = 0) -> None:
        """`recycle`: up to this many data files of dropped generations wait in `recycled/`
        to be written over by the next generations instead of being deleted. Filling a new
        file takes pages the page cache must grow for (on this VM 0.30-0.40 s for an 85M
        model's 340 MB, against 0.05 s right after a drop freed as many, and 0.02-0.04 s to
        write over a cached file: benchmarks/results/model_scale-recycled/README.md). The
        disk then holds up to `recycle` dropped files more between a drop and the next
        generations, which take them in place of new ones; a pool left larger (a lower
        limit at a restart) is cut to it here. `stage` and `drop` of one store must not run
        at once (the server settles a checkpoint before it stages a step): the lock guards
        only the pool."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an integer >= 1, got {keep!r}")
        self.directory = Path(directory)
        self.keep = keep
        self.recycle = recycle
        self._recycled = self.directory / RECYCLED_NAME
        self._pool_lock = threading.Lock()  # the pool's files, taken and given back
        self.directory.mkdir(mode=_DEFAULT_DIR_MODE, parents=True, exist_ok=True)
        if self._recycled.is_dir():
            for extra in sorted(self._recycled.iterdir())[recycle:]:
                extra.unlink(missing_ok=True)

    def generations(self) -> list[int]:
        """Complete generations on disk (manifest parses, every file has its size), sorted."""
        return sorted(g for g, path in self._final_dirs().items() if _is_complete(path))

    def write(
        self,
        generation: int,
        tensors: Mapping[str, Mapping[str, torch.Tensor]],
        metadata: Mapping[str, object],
        prune: bool = True,
    ) -> Path:
        """Durably write `generation` and return its directory; then prune old generations
        (unless told not to: a caller that drops them later itself, off its critical path)."""
        final = self.stage(generation, tensors, metadata)()
        if prune:
            self._prune(keep_dir=final)
        return final

    def stage(
        self,
        generation: int,
        tensors: Mapping[str, Mapping[str, torch.Tensor]],
        metadata: Mapping[str, object],
        *,
        hash_when_durable: bool = False,
        direct: bool = False,
        adopted: Mapping[str, AdoptedFile] | None = None,
    ) -> Callable[[], Path]:
        """Write `generation`'s files (and hash them, from memory, as they are written); the
        function returned makes them durable and the generation visible (fsyncs, manifest,
        rename) and returns its directory.

        Once `stage` returns the files no longer need the tensors' memory, so the rest can
        run on another thread while the caller moves that memory (the step log: see
        server/state/journal.py). `hash_when_durable`: `stage` only writes, and the returned
        function hashes each file by reading it back (from the page cache) before its fsync,
        so the hashing leaves the caller's critical path for that thread; each file's fsync runs
        beside its hashing, and the manifest follows both. `direct` (not with
        `hash_when_durable`): each file is written around the page cache where the file
        system allows it, and hashed as it goes (`_write_direct`), so the fsyncs have little
        left to write. A generation staged and never made durable is a temporary directory,
        removed by the next prune or drop.

        `adopted`: files already written elsewhere in the store's file system (names ending in
        `BODY_SUFFIX`), renamed into the generation here; the function returned waits for
        each one's `durable` before the manifest, which lists them with their hashes."""
        if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
            raise ValueError(f"generation must be an integer >= 0, got {generation!r}")
        if direct and hash_when_durable:
            raise ValueError("direct files are hashed as they are written, not when durable")
        existing = self.generations()
        if existing and generation <= existing[-1]:
            raise ValueError(
                f"generation {generation} is not newer than the newest on disk, {existing[-1]}"
            )
        for group in tensors:
            if not isinstance(group, str) or not _GROUP_NAME.fullmatch(group):
                raise ValueError(f"tensor group name {group!r} is not a safe file name")
        adopted = dict(adopted or {})
        for name in adopted:
            if not name.endswith(BODY_SUFFIX) or not _GROUP_NAME.fullmatch(name):
                raise ValueError(f"adopted file name {name!r} is not a safe {BODY_SUFFIX} name")
        # Serialise the metadata first so that a non-JSON value fails before touching the disk.
        metadata_json = dict(metadata)
        json.dumps(metadata_json, allow_nan=False)

        previous = self.directory / _dir_name(existing[-1]) if existing else None
        final = self.directory / _dir_name(generation)
        temp = self.directory / f"{_dir_name(generation)}.tmp-{secrets.token_hex(8)}"
        temp.mkdir(mode=_DEFAULT_DIR_MODE)
        files: dict[str, dict[str, Any]] = {}
        try:
            os.chmod(temp, _mode_of(previous, _DEFAULT_DIR_MODE))
            # Every group's file is written, and hashed, at once: writes into the page
            # cache and hashing release the GIL, so the threads overlap. The directory is
            # invisible until its rename, so the files go straight under their own names.
            with ThreadPoolExecutor(2 * max(1, len(tensors))) as pool:
                pending = {
                    group + _SUFFIX: _write_tensors(
                        temp / (group + _SUFFIX),
                        group_tensors,
                        _file_mode(previous, group + _SUFFIX),
                        pool,
                        hash_memory=not hash_when_durable,
                        over=self.take_recycled(temp / (group + _SUFFIX)),
                        direct=direct,
                    )
                    for group, group_tensors in tensors.items()
                }
                for name, written in pending.items():
                    size, digest = written.result()
                    files[name] = {"bytes": size, DIGEST: digest}
                    faults.crash_point("checkpoint_file")
            for name, file in adopted.items():  # a rename: the bytes stay where they are
                os.rename(file.path, temp / name)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise

        def durable() -> Path:
            def hashed(name: str) -> None:  # from the page cache, as written
                files[name][DIGEST] = file_digest(temp / name)

            try:
                # each file's fsync (the disk's time) beside its hashing (a core's), not
                # after it: nothing is visible before the manifest, written once both are done
                unhashed = [name for name in files if files[name][DIGEST] is None]
                with ThreadPoolExecutor(max(1, len(files) + len(unhashed))) as pool:
                    work = [pool.submit(_fsync_file, temp / name) for name in files]
                    work += [pool.submit(hashed, name) for name in unhashed]
                    for done in work:
                        done.result()
                for name, file in adopted.items():
                    size, digest = file.durable()
                    files[name] = {"bytes": size, DIGEST: digest}
                    if named_digest(files[name]) is None:  # (its own hash: never a manifest's)
                        raise ValueError(f"adopted file {name!r}: {digest!r} is no {DIGEST}")
                manifest = {
                    "format": FORMAT_VERSION,
                    "generation": generation,
                    "metadata": metadata_json,
                    "files": files,
                }
                raw = json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False).encode()
                _write_atomic(temp / MANIFEST_NAME, raw, _file_mode(previous, MANIFEST_NAME))
                faults.crash_point("checkpoint_rename")
                if final.exists():  # an incomplete leftover under the final name: garbage
                    shutil.rmtree(final)
                os.rename(temp, final)
                _fsync_dir(self.directory)
            except BaseException:
                shutil.rmtree(temp, ignore_errors=True)
                raise
            return final

        return durable

    def load_latest(self) -> LoadedCheckpoint | None:
        """The newest generation that verifies, falling back past corrupt ones; None if none."""
        for generation, path in sorted(self._final_dirs().items(), reverse=True):
            try:
                return _load(generation, path)
            except _Unusable as error:
                logger.warning(
                    "checkpoint %s is unusable (%s); trying an older generation", path, error
                )
        return None

    def load(self, generation: int) -> LoadedCheckpoint | None:
        """Generation `generation` if it is on disk and verifies; None (with a warning for
        one that does not verify) otherwise: a step log's chain is read one step at a time."""
        path = self._final_dirs().get(generation)
        if path is None:
            return None
        try:
            return _load(generation, path)
        except _Unusable as error:
            logger.warning("checkpoint %s is unusable (%s)", path, error)
            return None

    def drop(self, first: int = 0, last: int | None = None) -> None:
        """Remove the generations numbered `first` to `last` (None: every later one), and any
        temporary leftover, durably: a step log's steps once their checkpoints are written,
        or steps that no longer apply."""
        for entry in self.directory.iterdir():
            match = _FINAL_DIR.fullmatch(entry.name)
            found = int(match.group(1)) if match else None
            dropped = found is not None and found >= first and (last is None or found <= last)
            if (dropped or _TEMP_DIR.fullmatch(entry.name)) and entry.is_dir():
                self._remove(entry)
        _fsync_dir(self.directory)

    def _remove(self, generation_dir: Path) -> None:
        """A generation (or a temporary leftover) gone: its data files (and the bodies it
        adopted) into `recycled/` while it holds fewer than `recycle`, the rest deleted."""
        if self.recycle:
            with self._pool_lock:
                self._recycled.mkdir(mode=_DEFAULT_DIR_MODE, exist_ok=True)
                pooled = sum(1 for _ in self._recycled.iterdir())
                kinds = (_SUFFIX, BODY_SUFFIX)
                for file in sorted(f for k in kinds for f in generation_dir.glob(f"*{k}")):
                    if pooled >= self.recycle:
                        break
                    with contextlib.suppress(OSError):  # deleted below instead
                        os.rename(file, self._recycled / f"{secrets.token_hex(8)}{_SUFFIX}")
                        pooled += 1
        shutil.rmtree(generation_dir, ignore_errors=True)

    def take_recycled(self, path: Path) -> bool:
        """A recycled file renamed to `path` (a new generation's file, or a body a later one
        adopts), to be written over; False when the pool has none or the rename fails (a new
        file is made)."""
        if not self.recycle:
            return False
        with self._pool_lock:
            try:
                pooled = sorted(self._recycled.iterdir())
                if not pooled:
                    return False
                os.rename(pooled[0], path)
            except OSError:
                return False
            return True

    def set_aside(self, first: int, into: Path) -> list[Path]:
        """Move the generations numbered `first` and later into the directory `into` (made
        if needed), durably, instead of deleting them: what a restart cannot use but an
        operator may still want (a step log's steps past one that did not read back)."""
        moved = []
        for generation, path in sorted(self._final_dirs().items()):
            if generation >= first:
                into.mkdir(mode=_DEFAULT_DIR_MODE, parents=True, exist_ok=True)
                target = into / f"{path.name}-{secrets.token_hex(4)}"
                os.rename(path, target)
                moved.append(target)
        if moved:
            _fsync_dir(into)
            _fsync_dir(self.directory)
        return moved

    def _final_dirs(self) -> dict[int, Path]:
        """Every directory with a final generation name, complete or not."""
        found: dict[int, Path] = {}
        for entry in self.directory.iterdir():
            match = _FINAL_DIR.fullmatch(entry.name)
            if match and entry.is_dir():
                found[int(match.group(1))] = entry
        return found

    def _prune(self, keep_dir: Path) -> None:
        """Drop all but the newest `keep` complete generations, incomplete ones and temp dirs."""
        complete = [g for g, path in self._final_dirs().items() if _is_complete(path)]
        kept = {self.directory / _dir_name(g) for g in sorted(complete)[-self.keep :]}
        kept.add(keep_dir)
        for entry in self.directory.iterdir():
            stale_final = _FINAL_DIR.fullmatch(entry.name) and entry not in kept
            if stale_final and _newer_format(entry):
                continue  # a later version's: not ours to drop
            if (stale_final or _TEMP_DIR.fullmatch(entry.name)) and entry.is_dir():
                self._remove(entry)
        _fsync_dir(self.directory)


def _dir_name(generation: int) -> str:
    return f"gen-{generation:012d}"


def _read_manifest(path: Path) -> dict[str, Any]:
    """The parsed, shape-checked manifest of generation directory `path`, or _Unusable."""
    try:
        manifest = json.loads((path / MANIFEST_NAME).read_bytes())
    except FileNotFoundError:
        raise _Unusable(f"{MANIFEST_NAME} is missing") from None
    except (OSError, ValueError) as error:
        raise _Unusable(f"{MANIFEST_NAME} does not parse: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in _READ_FORMATS:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise _Unusable(
            f"{MANIFEST_NAME} is format {found!r}, not one this version reads "
            f"({', '.join(map(str, _READ_FORMATS))})"
            + (": a later version wrote it; it is kept" if _is_newer(found) else "")
        )
    if not isinstance(manifest.get("metadata"), dict):
        raise _Unusable(f"{MANIFEST_NAME} has no metadata object")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise _Unusable(f"{MANIFEST_NAME} has no files object")
    for name, entry in files.items():
        valid_name = (name.endswith(_SUFFIX) and _GROUP_NAME.fullmatch(name[: -len(_SUFFIX)])) or (
            name.endswith(BODY_SUFFIX) and _GROUP_NAME.fullmatch(name)
        )
        size = entry.get("bytes") if isinstance(entry, dict) else None
        if not valid_name or isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise _Unusable(f"{MANIFEST_NAME} has a malformed entry for {name!r}")
        if named_digest(entry) is None:
            raise _Unusable(f"{MANIFEST_NAME}'s entry for {name!r} {digest_problem(entry)}")
    return manifest


def _is_newer(found: object) -> bool:
    return isinstance(found, int) and not isinstance(found, bool) and found > FORMAT_VERSION


def _newer_format(path: Path) -> bool:
    """Whether generation directory `path` has a manifest of a format above this version's:
    a later version wrote it (read as incomplete here, but kept)."""
    try:
        manifest = json.loads((path / MANIFEST_NAME).read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and _is_newer(manifest.get("format"))


def _is_complete(path: Path) -> bool:
    """A cheap check (no hashing): the manifest parses and every file it lists has its size."""
    try:
        manifest = _read_manifest(path)
        return all(
            (path / name).stat().st_size == entry["bytes"]
            for name, entry in manifest["files"].items()
        )
    except (_Unusable, OSError):
        return False


def _load(generation: int, path: Path) -> LoadedCheckpoint:
    """Verify every file's size and checksum, and only then decode its tensors (an adopted
    body is verified as it lies on disk, and named, not read into memory)."""
    manifest = _read_manifest(path)
    if manifest.get("generation") != generation:
        raise _Unusable(f"{MANIFEST_NAME} names generation {manifest.get('generation')!r}")
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    bodies: dict[str, Path] = {}
    for name, entry in manifest["files"].items():
        if name.endswith(BODY_SUFFIX):
            bodies[name] = _verified_body(path / name, entry["bytes"], _named(entry))
            continue
        data = _read_verified(path / name, entry["bytes"], _named(entry))
        try:
            tensors[name[: -len(_SUFFIX)]] = decode_tensors(data)
        except WireError as error:
            raise _Unusable(f"{name} does not decode: {error}") from None
    return LoadedCheckpoint(generation, tensors, manifest["metadata"], path, bodies)


def _named(entry: Mapping[str, Any]) -> tuple[str, str]:
    """(algorithm, digest) of a manifest entry `_read_manifest` has checked."""
    named = named_digest(entry)
    assert named is not None
    return named


def _verified_body(path: Path, size: int, digest: tuple[str, str]) -> Path:
    """`path` if it has the expected size and hash (read in pieces: a body may be large)."""
    try:
        actual = path.stat().st_size
        if actual != size:
            raise _Unusable(f"{path.name} has {actual} bytes, the manifest says {size}")
        if file_digest(path, digest[0]) != digest[1]:
            raise _Unusable(f"{path.name} fails its {digest[0]} check")
    except OSError as error:
        raise _Unusable(f"{path.name} cannot be read: {error}") from None
    return path


def _read_verified(path: Path, size: int, digest: tuple[str, str]) -> bytearray:
    """The bytes of `path`, read into one buffer, if they have the expected size and hash."""
    try:
        with path.open("rb") as handle:
            actual = os.fstat(handle.fileno()).st_size
            if actual != size:
                raise _Unusable(f"{path.name} has {actual} bytes, the manifest says {size}")
            data = bytearray(size)
            if handle.readinto(data) != size:
                raise _Unusable(f"{path.name} was shorter than {size} bytes when read")
    except OSError as error:
        raise _Unusable(f"{path.name} cannot be read: {error}") from None
    if digest_of(data, digest[0]) != digest[1]:
        raise _Unusable(f"{path.name} fails its {digest[0]} check")
    return data


def _mode_of(path: Path | None, default: int) -> int:
    """The permission bits of `path`, so a new generation keeps what an operator set."""
    if path is None:
        return default
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        return default


def _file_mode(previous: Path | None, name: str) -> int:
    return _mode_of(previous / name if previous else None, _DEFAULT_FILE_MODE)


def _write_atomic(path: Path, data: bytes | bytearray, mode: int) -> None:
    """Write `data` to `path` via a synced temp file in the same directory, then os.replace."""
    _write_pieces_atomic(path, [memoryview(data)], mode)


def open_over(path: Path, recycled: bool, access: int, mode: int) -> int:
    """A descriptor (`access`: os.O_WRONLY or os.O_RDWR) to write `path`: the recycled file
    `CheckpointStore.take_recycled` put there when `recycled`, else (or if it cannot be
    opened) a new file of `mode`. The caller cuts a recycled file's longer tail."""
    if recycled:
        try:
            return os.open(path, access)
        except OSError:  # not writable after all: a new file instead
            path.unlink(missing_ok=True)
    return os.open(path, access | os.O_CREAT | os.O_EXCL, mode)


def _write_tensors(
    path: Path,
    tensors: Mapping[str, torch.Tensor],
    mode: int,
    pool: Executor,
    hash_memory: bool = True,
    over: bool = False,
    direct: bool = False,
) -> _Written:
    """Write `tensors` as the safetensors file `encode_tensors` would make, byte for byte,
    straight from their memory: no model-sized body is allocated and copied first (at 85M
    parameters that copy and its page faults were about a quarter of a checkpoint's time).
    The file is written by one of `pool`'s threads (into the page cache: `_fsync_file` makes
    it durable) and, with `hash_memory`, its checksum computed by another from the same memory
    at the same time (else the digest is None: `file_digest` reads it back later). `over`:
    `path` is a recycled file, written over and cut to the new size, not a new one. `direct`:
    written around the page cache and hashed as it goes, by one thread (`_write_direct`)."""
    layout = FrameLayout.of(tensors)
    pieces = [memoryview(layout.header)]
    for name, slot in layout.slots.items():
        if slot.nbytes:
            pieces.append(_tensor_bytes(tensors[name]))
    if direct:
        hashed_as_written = pool.submit(_write_direct, path, pieces, layout.size, mode, over)
        return _Written(layout.size, hashed_as_written, hashed_as_written)

    def hashed() -> str:
        digest = digest_hasher()
        for piece in pieces:
            digest.update(piece)
        return digest.hexdigest()

    def written() -> None:
        fd = open_over(path, over, os.O_WRONLY, mode)
        os.fchmod(fd, mode)  # os.open's mode is filtered by the umask
        with os.fdopen(fd, "wb") as handle:
            for piece in pieces:
                handle.write(piece)
            handle.truncate()  # a recycled file's longer tail goes

    digest = pool.submit(hashed) if hash_memory else None
    return _Written(layout.size, pool.submit(written), digest)


_DIRECT_CHUNK = 8 << 20  # bytes per O_DIRECT write, from one page-aligned buffer
# offsets, lengths and memory of O_DIRECT writes: a page, what most devices and file systems
# ask (one that asks more refuses a write with EINVAL: the file is then written without it)
_DIRECT_ALIGN = 4096
_WRITE_AT_MOST = 1 << 30  # bytes per pwrite (some platforms refuse more than 2 GiB in one)
assert _DIRECT_CHUNK % _DIRECT_ALIGN == 0


def _write_direct(path: Path, pieces: list[memoryview], size: int, mode: int, over: bool) -> str:
    """Write `pieces` (`size` bytes) to `path` with O_DIRECT, through one aligned buffer, and
    return their checksum, computed from that buffer as it goes.

    A model-sized write into pages the page cache no longer holds costs a core more than the
    disk's own time (the 350M step log's 1.4 GB took 1.1 s here, around the cache 0.45-0.59 s:
    new pages, each allocated, locked and dirtied); around the cache it is one copy into the
    buffer and the disk's time, and what the file held leaves nothing cached. (Into pages still
    cached, as an 85M log's are here, the page cache is faster: see DIRECT_STEP_LOG_BYTES in
    server/state/journal.py.) The caller's fsync still makes the file's size and blocks
    durable. Where the platform or the file system has no O_DIRECT, or refuses a write with it
    (EINVAL: an alignment it wants larger), the same bytes go through the page cache."""
    fd = _open_direct(path, over, mode)
    try:
        os.fchmod(fd, mode)  # os.open's mode is filtered by the umask
        writer = _DirectWriter(fd)
        for piece in pieces:
            at = 0
            while at < len(piece):
                count = min(_DIRECT_CHUNK - writer.filled, len(piece) - at)
                _copy_bytes(writer.free[:count], piece[at : at + count])
                writer.filled += count
                at += count
                if writer.filled == _DIRECT_CHUNK:
                    writer.flush()
        return writer.finish(size)
    finally:
        os.close(fd)


def copy_file_direct(
    source: int, target: int, size: int, available: Callable[[int], None] | None = None
) -> str:
    """The first `size` bytes of descriptor `source` into descriptor `target` with O_DIRECT,
    through one aligned buffer that `source` is read into (from the page cache, where a
    spooled upload just written lies), and their checksum, computed from that buffer as it
    goes: `_write_direct` for a file's bytes. `target` is cut to `size`; the caller fsyncs
    it. Where O_DIRECT is missing or refused (EINVAL) the bytes go through the page cache.
    `available(n)`: returns once `source` holds its first n bytes (a file still being
    written: an upload as it arrives), or raises if it never will."""
    _direct_where_possible(target)
    writer = _DirectWriter(target)
    while writer.offset < size:
        want = min(_DIRECT_CHUNK, size - writer.offset)
        if available is not None:
            available(writer.offset + want)
        while writer.filled < want:  # (preadv lets the GIL go)
            at = writer.offset + writer.filled
            read = os.preadv(source, [writer.free[: want - writer.filled]], at)
            if read == 0:
                raise OSError(f"the file ended after {at} of {size} bytes")
            writer.filled += read
        writer.flush()
    return writer.finish(size)


class _DirectWriter:
    """One page-aligned buffer of `_DIRECT_CHUNK` bytes written to `fd` at its `offset` once
    `filled`, hashed as it goes (the page cache takes such writes as well). The buffer is
    unmapped once the last view of it goes (never by hand: an error's traceback may hold one).
    A second buffer, filled while the disk takes the first, did not make a write shorter
    here: the disk is what it waits on."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.view = memoryview(mmap.mmap(-1, _DIRECT_CHUNK))
        self.filled = self.offset = 0
        self.digest = digest_hasher()

    @property
    def free(self) -> memoryview:
        """The part of the buffer not filled yet."""
        return self.view[self.filled :]

    def flush(self) -> None:
        """Hash and write what is filled (a tail padded to the alignment: `finish` cuts the
        file back), then start the buffer again."""
        filled = self.filled
        if not filled:
            return
        self.digest.update(self.view[:filled])
        padded = -(-filled // _DIRECT_ALIGN) * _DIRECT_ALIGN
        self.view[filled:padded] = bytes(padded - filled)
        _pwrite_direct(self.fd, self.view[:padded], self.offset)
        self.offset += filled
        self.filled = 0

    def finish(self, size: int) -> str:
        """The last bytes written, the file cut to `size` (a recycled file's longer tail, or
        the tail's padding, goes): the checksum of what was written."""
        self.flush()
        os.ftruncate(self.fd, size)
        return self.digest.hexdigest()


def _copy_bytes(target: memoryview, source: memoryview) -> None:
    """`source` into `target` (of its length) by numpy, which lets the GIL go meanwhile: a
    slice assignment held it for the whole copy, and the other sums files' threads and the
    event loop waited (the 350M step log's write 0.64-0.67 s -> 0.52-0.55 s, its round 3.00-3.21
    s -> 2.48-2.60 s: benchmarks/results/model_scale-direct-step-log/, runs M and N)."""
    numpy.copyto(numpy.frombuffer(target, dtype=numpy.uint8), numpy.frombuffer(source, numpy.uint8))


def _open_direct(path: Path, over: bool, mode: int) -> int:
    """A descriptor to write `path` (see `open_over`), switched to O_DIRECT where the
    platform and the file system have it (where the switch is refused the descriptor writes
    through the page cache, and a recycled file is written over all the same)."""
    fd = open_over(path, over, os.O_WRONLY, mode)
    try:
        _direct_where_possible(fd)
    except OSError:
        os.close(fd)
        raise
    return fd


def _direct_where_possible(fd: int) -> None:
    """Switch `fd` to O_DIRECT where the platform has it; a file system that refuses the
    switch (EINVAL) leaves it writing through the page cache."""
    if not getattr(os, "O_DIRECT", 0):
        return
    try:
        _set_direct(fd, True)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise


def _set_direct(fd: int, on: bool) -> None:
    """Switch `fd`'s O_DIRECT on or off (Linux: fcntl's F_SETFL)."""
    import fcntl  # (here: where O_DIRECT exists; this module is a Windows worker's too)

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    flag = os.O_DIRECT
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | flag if on else flags & ~flag)


def _pwrite_direct(fd: int, data: memoryview, offset: int) -> None:
    """`_pwrite_all` on a descriptor `_open_direct` made; a write with O_DIRECT the file
    system refuses (EINVAL: it wants a larger alignment, or a short write left the rest
    unaligned) switches it off and is written again through the page cache (the same bytes
    at the same offset)."""
    try:
        _pwrite_all(fd, data, offset)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        _set_direct(fd, False)
        _pwrite_all(fd, data, offset)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """All of `data` at `offset`, in writes of at most `_WRITE_AT_MOST` bytes."""
    while len(data):
        written = os.pwrite(fd, data[:_WRITE_AT_MOST], offset)
        if written <= 0:
            raise OSError(errno.EIO, f"a write of {len(data)} bytes at {offset} wrote nothing")
        data, offset = data[written:], offset + written


@dataclass(frozen=True)
class _Written:
    """A file being written and hashed by a pool's threads."""

    size: int
    written: Future[Any]
    digest: Future[str] | None  # None: hashed from the file later

    def result(self) -> tuple[int, str | None]:
        """(size, checksum) once the file is written; the write's error if it failed."""
        self.written.result()
        return self.size, None if self.digest is None else self.digest.result()


# ------------------------------------------------------------------ checksums
# Of the files a server writes for itself: checkpoints, step logs, held slices. They catch a
# torn write, a truncated file or bit rot before a restart trusts the bytes; they are no
# defence against an adversary (whoever can write the state dir can rewrite a manifest too).
# So a fast non-cryptographic 128-bit hash does the job: XXH3-128 (the xxhash package)
# hashes about 23 GB/s on one core of this machine, SHA-256 1.7 GB/s even with SHA-NI. At 85M
# parameters a round's step log (342 MB) took 0.2 s of a core to hash beside the outer step
# and its fsync (benchmarks/results/model_scale-checksums/). What is written now names its
# hash ("xxh3_128": hex digest); files written before name "sha256", verified with it.


class Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


DIGEST = "xxh3_128"  # the checksum written now (see the section's comment)
# algorithm -> (new hasher, the form of its hex digest)
_KNOWN: dict[str, tuple[Callable[[], Hasher], re.Pattern[str]]] = {
    "xxh3_128": (xxhash.xxh3_128, re.compile(r"[0-9a-f]{32}")),
    "sha256": (hashlib.sha256, re.compile(r"[0-9a-f]{64}")),
}
_READ = 8 << 20  # bytes per read when a file is hashed from the disk or the page cache


def digest_hasher(algorithm: str = DIGEST) -> Hasher:
    """A new hasher of `algorithm` (ValueError naming the known ones if it is not)."""
    known = _KNOWN.get(algorithm)
    if known is None:
        raise ValueError(f"unknown digest {algorithm!r}; known: {', '.join(_KNOWN)}")
    return known[0]()


def digest_of(data: bytes | bytearray | memoryview, algorithm: str = DIGEST) -> str:
    """The hex digest of `data`."""
    h = digest_hasher(algorithm)
    h.update(data)
    return h.hexdigest()


def descriptor_digest(fd: int, size: int | None = None, algorithm: str = DIGEST) -> str:
    """The digest of an open file's first `size` bytes (None: all of them), read by offset:
    a rename of the file meanwhile does not disturb it. OSError if it ends before."""
    size = os.fstat(fd).st_size if size is None else size
    h = digest_hasher(algorithm)
    view = memoryview(bytearray(min(_READ, max(size, 1))))
    offset = 0
    while offset < size:
        read = os.preadv(fd, [view[: min(view.nbytes, size - offset)]], offset)
        if read == 0:
            raise OSError(f"the file ended after {offset} of {size} bytes")
        h.update(view[:read])
        offset += read
    return h.hexdigest()


def file_digest(path: Path, algorithm: str = DIGEST) -> str:
    """The digest of a file's bytes as they are now (from the page cache when just written)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return descriptor_digest(fd, algorithm=algorithm)
    finally:
        os.close(fd)


def named_digest(entry: Mapping[str, object]) -> tuple[str, str] | None:
    """(algorithm, hex digest) of a record that names exactly one known digest in a
    well-formed hex form (a manifest's file entry, a held slice's record); None otherwise."""
    found = _digest_or_problem(entry)
    return found if isinstance(found, tuple) else None


def digest_problem(entry: Mapping[str, object]) -> str:
    """Why `named_digest(entry)` is None, for an error message."""
    found = _digest_or_problem(entry)
    return "" if isinstance(found, tuple) else found


def _digest_or_problem(entry: Mapping[str, object]) -> tuple[str, str] | str:
    named = [name for name in _KNOWN if name in entry]
    if not named:
        return f"names no checksum (one of {', '.join(_KNOWN)})"
    if len(named) > 1:
        return f"names {len(named)} checksums ({', '.join(named)}), not one"
    algorithm, digest = named[0], entry[named[0]]
    if not isinstance(digest, str) or not _KNOWN[algorithm][1].fullmatch(digest):
        return f"has a {algorithm} that is not {algorithm}'s lower-case hex digest"
    return algorithm, digest


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of `tensor` in memory order (a CPU copy only when it is elsewhere or strided)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _write_pieces_atomic(path: Path, pieces: list[memoryview], mode: int) -> None:
    """Write `pieces` one after another to `path` via a synced temp file in the same
    directory, then os.replace."""
    temp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(8)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)  # os.open's mode is filtered by the umask
        with os.fdopen(fd, "wb") as handle:
            fd = -1
            for piece in pieces:
                handle.write(piece)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    _fsync_dir(path.parent)


def _fsync_file(path: Path) -> None:
    """Make a written file's data durable (fsync reaches every page of the file, whichever
    descriptor wrote it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    """Make renames and creations inside `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
