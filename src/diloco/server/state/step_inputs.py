"""A logged step's inputs made durable as they arrive, instead of its sums at the commit.

With `durability="round"` a single server logs each outer step's input before the step moves
anything (state/journal.py). Logging the round's fp32 sums puts one model-sized write, its
hashing and its fsync between the last upload and the published result. Here each upload's
body, as it came, is copied into `<state-dir>/inputs/` on a thread beside its scan or fold
(over a file of a dropped step where the step log holds one: pages already cached),
and fsynced beside its checksum while the round waits for the other workers (for the last body:
beside its fold and the step). The commit then moves the round's bodies into its step log
generation, in the order they were folded, with a small record (CheckpointStore.stage's
`adopted` files), and waits only for what is left of their fsyncs. A restart folds them again
in the same order, through the same checks and fold, and replays the step as before: the same
sums, bit for bit (`Intake.refold`).

Only bodies that together hold at most 3/4 of the sums' bytes are copied (`Intake._copy`:
coded uploads with few workers), or, from DIRECT_STEP_LOG_BYTES of sums on (350M, where the
sums would be logged around the page cache), the body of a round of one sender, up to the
sums' bytes (one fp32 worker's), copied around the page cache too
(`checkpoints.copy_file_direct`: hashed from its buffer as it writes, so no checksum pass
follows; the upload's request waits for the whole write, not only its read of the spool, and
the commit for what is left of it): a 350M fp32 round of one worker 2.66-3.04 s -> 2.49-2.69
s (benchmarks/results/model_scale-direct-input-copy/). Over HTTP such a copy starts as the
upload's header is checked and follows its spool file as it is written (`StepInputs.follow`,
the spool's `SpoolFollower`), so the upload's request waits only for the last writes
(benchmarks/results/model_scale-follow-spool/). Copying fp32 bodies, one worker's or
two, through the page cache made rounds at 85M parameters 50 % slower on this machine, not
faster: a copy into new pages and its fsync cost more than the sums' write into recycled
ones (benchmarks/results/model_scale-step-inputs/). Written over recycled pages, two fp32
bodies still made rounds 21 % slower (their fsyncs wait on the disk), where int8 rounds got
8-16 % shorter (benchmarks/results/model_scale-recycled-copies/).

What this store holds between a copy and its step's commit is never needed after a restart
(the round it belonged to was open: its workers send again), so it is emptied at start.
Rounds that fold a body without a working copy (one not copied, kept in memory, or whose copy
had failed by the commit; robust aggregation, sparse means, async windows) log their sums as
before. A copy that fails after the commit began (most often the last body's, still being
written or fsynced beside the step) fails the step's log instead: the server answers 503
until restarted, as for a failed fsync of the sums (the sums are used up by then).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from diloco import faults
from diloco.checkpoints import (
    BODY_SUFFIX,
    CheckpointStore,
    copy_file_direct,
    descriptor_digest,
    open_over,
)
from diloco.server.settings import ServerSettings
from diloco.server.state.held_slices import copy_prefix
from diloco.wire.format.spool import SpooledTensors

log = logging.getLogger("diloco.server")
# Each body's copy, then its fsync beside its hash. A write waits on the disk most of its time
# (its fsync), so enough of them run at once that a body's copy, which its request waits for,
# does not queue behind other bodies' fsyncs; the hashes (a core each) two at a time.
_WRITES = ThreadPoolExecutor(8, thread_name_prefix="diloco-step-input")
# A copy that follows an upload gives up when no byte of it came for this long (a request
# that ended without telling it: e.g. cancelled at a forced shutdown), so its thread ends.
FOLLOW_STALL_SECONDS = 600.0
_HASHES = ThreadPoolExecutor(2, thread_name_prefix="diloco-step-input-hash")


def logs_bodies(settings: ServerSettings, logs_steps: bool) -> bool:
    """Whether a server's step log may hold each round's bodies: one server logging its
    steps, whose rounds are plain means of bodies folded as they come (not async windows,
    robust aggregation's held bodies, or sparse means' counts of senders)."""
    return (
        logs_steps
        and settings.shards == 1
        and settings.mode != "async"
        and settings.aggregation == "mean"
        and not settings.robust.screens
    )


class InputCopy:
    """One upload's body being copied into the inputs directory, on a thread: once `copied`
    the upload's own file may go; then its fsync runs beside its checksum (read back from the
    page cache through the copy's own descriptor, so a rename into the step's generation does
    not disturb either), or, `direct`, after a copy around the page cache hashed as it went."""

    def __init__(
        self,
        path: Path,
        source: int,
        size: int,
        fd: int,
        direct: bool = False,
        following: bool = False,
    ) -> None:
        """The first `size` bytes of descriptor `source` (an upload's spool file) into `fd`
        (at `path`). `following` (direct copies): the file is still being written, and the
        copy keeps behind what `written` reports (the upload's `SpoolFollower`)."""
        self.path = path
        self.direct = direct  # around the page cache, hashed as it is written
        self.size = size
        self.owned = False  # a round folded it: its step adopts the file
        self.sender: tuple[str, int, int] = ("", 0, 0)  # worker, round, tokens (once folded)
        self.checked = False  # folded by a reader that checked its values (not after a scan)
        self.copied: Future[None] = Future()
        self._fd = fd
        self._arrived = threading.Condition()
        self._available = size if not following else 0  # bytes the source holds so far
        self._complete: bool | None = None if following else True
        self._abandoned = False  # not to be folded: stop at the next write
        self._written: Future[str]
        if not following:
            self._written = _WRITES.submit(self._write, source)
            return
        # A thread of its own: it waits on the upload as long as that lasts, and the pool's
        # writers must stay free for the copies an upload's end waits for.
        self._written = Future()
        self._written.set_running_or_notify_cancel()  # (never cancelled: it has begun)
        threading.Thread(
            target=self._follow, args=(source,), name="diloco-step-input-follow", daemon=True
        ).start()

    def _follow(self, source: int) -> None:
        try:
            digest = self._write(source)
        except BaseException as exc:
            self._written.set_exception(exc)
        else:
            self._written.set_result(digest)

    # ------------------------------------------------------------ as the upload's follower

    def written(self, nbytes: int) -> None:
        with self._arrived:
            self._available = nbytes
            self._arrived.notify_all()

    def ended(self, complete: bool) -> None:
        with self._arrived:
            self._complete = complete
            self._arrived.notify_all()
        if not complete:
            self.wait_copied()

    def release(self) -> None:
        """The request that brought the body is over: unless a round folded it, a direct
        copy stops at its next write (every 8 MiB) and its file goes; either way the copy
        has stopped reading the upload's file when this returns."""
        if not self.owned:
            self.abandon()
        self.wait_copied()
        if not self.owned:
            self.discard()

    def abandon(self) -> None:
        """Not to be folded (refused, a duplicate, a failed scan): a direct copy stops at
        its next write instead of writing the rest of a body nobody will log."""
        with self._arrived:
            self._abandoned = True
            self._arrived.notify_all()

    def _wait_for(self, nbytes: int) -> None:
        """Until the source holds `nbytes` bytes; OSError if the upload ended short, the
        copy was abandoned, or no byte came for FOLLOW_STALL_SECONDS."""
        with self._arrived:
            while True:
                if self._abandoned:
                    raise OSError("the copy was abandoned: its body is not folded")
                if self._available >= nbytes:
                    return
                if self._complete is not None:
                    raise OSError(f"the upload ended after {self._available} bytes")
                if not self._arrived.wait(FOLLOW_STALL_SECONDS):
                    raise OSError(f"no byte of the upload came for {FOLLOW_STALL_SECONDS:g} s")

    def _write(self, source: int) -> str:
        """The copy, then its fsync beside its hash: the checksum (the fd closes after). A
        direct copy is hashed as it is written, and its fsync has little left to write."""
        try:
            written: str | None = None
            try:
                if self.direct:
                    written = copy_file_direct(source, self._fd, self.size, self._wait_for)
                else:
                    copy_prefix(source, self._fd, self.size)
                    os.ftruncate(self._fd, self.size)  # a recycled file's longer tail goes
            except BaseException as exc:
                self.copied.set_exception(exc)
                raise
            self.copied.set_result(None)
            with self._arrived:
                abandoned = self._abandoned
            if abandoned:  # refused while it copied: no fsync or hash for a file that goes
                raise OSError("the copy was abandoned: its body is not folded")
            if written is not None:
                _fsync(self._fd)
                return written
            hashing = _HASHES.submit(descriptor_digest, self._fd, self.size)
            failure: BaseException | None = None
            try:
                _fsync(self._fd)
            except BaseException as exc:
                failure = exc
            digest = hashing.result()  # (before the descriptor closes)
            if failure is not None:
                raise failure
            return digest
        finally:
            os.close(self._fd)

    def wait_copied(self) -> None:
        """Until the upload's file has been read (whether or not the copy worked); a direct
        copy reads and writes a buffer at a time, so this waits for its whole write."""
        with contextlib.suppress(Exception):
            self.copied.result()

    def durable(self) -> tuple[int, str]:
        """(size, checksum) once its bytes are on the disk; the copy's or fsync's error if
        either failed."""
        return self.size, self._written.result()

    @property
    def failed(self) -> bool:
        """Its copy, fsync or hash has already failed (its step logs its sums instead)."""
        written = self._written
        return written.done() and (written.cancelled() or written.exception() is not None)

    def discard(self) -> None:
        """Not folded (refused, a duplicate), or its round logs its sums: the file goes now
        (a copy not yet started never starts; one under way finishes on a name no longer
        there)."""
        if self._written.cancel():
            os.close(self._fd)
            self.copied.cancel()
        self.path.unlink(missing_ok=True)


def discard_all(copies: list[InputCopy] | None) -> None:
    """Copies a step will not log (its round logs its sums): their files go."""
    for copy in copies or ():
        copy.discard()


class StepInputs:
    """The inputs directory of a single server's state dir."""

    def __init__(self, directory: Path, steps: CheckpointStore | None = None) -> None:
        """Emptied first: a body left from before a restart belonged to a round that never
        committed (a committed one's bodies were moved into its step's generation). `steps`:
        the step log, whose dropped generations' files the copies write over."""
        self.directory = directory
        self.steps = steps
        if directory.is_dir():
            shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)

    @classmethod
    def beside(cls, directory: Path, steps: CheckpointStore) -> StepInputs | None:
        """The store at `directory`, if its files can be renamed into the step log `steps`
        (one file system); None where they cannot (the log then holds sums)."""
        store = cls(directory, steps)
        if os.stat(directory).st_dev != os.stat(steps.directory).st_dev:
            log.warning(
                "%s and %s are on different file systems: each step logs its sums, not its uploads",
                directory,
                steps,
            )
            shutil.rmtree(directory, ignore_errors=True)
            return None
        return store

    def copy(self, body: SpooledTensors, direct: bool = False) -> InputCopy | None:
        """`body`'s bytes into a new file here, on a thread (in the kernel where it can, or
        `direct`: around the page cache); None when the file cannot be made (a full disk:
        its round logs its sums)."""
        path, fd = self._new_file()
        if fd is None:
            return None
        return InputCopy(path, body.file.fileno(), body.size, fd, direct)

    def follow(self, source: int, size: int) -> InputCopy | None:
        """A direct copy of an upload's body of `size` bytes being spooled to descriptor
        `source`, written as the bytes come (the upload's `SpoolFollower`); None when the
        file cannot be made."""
        path, fd = self._new_file()
        if fd is None:
            return None
        return InputCopy(path, source, size, fd, direct=True, following=True)

    def _new_file(self) -> tuple[Path, int | None]:
        """A new body file here (over a dropped step's where the log holds one) and its
        descriptor; None for it where it cannot be made (a full disk: the round logs its
        sums)."""
        path = self.directory / f"{secrets.token_hex(8)}{BODY_SUFFIX}"
        try:
            recycled = self.steps is not None and self.steps.take_recycled(path)
            return path, open_over(path, recycled, os.O_RDWR, 0o600)
        except OSError as exc:
            log.warning(
                "an upload could not be copied into the state dir (%s); its round's step logs "
                "its sums instead",
                exc.strerror or exc,
            )
            return path, None


def _fsync(fd: int) -> None:
    os.fsync(fd)
    faults.crash_point("step_input_durable")  # a body on the disk, its step not logged
