"""A logged step's inputs made durable as they arrive, instead of its sums at the commit.

With `durability="round"` a single server logs each outer step's input before the step moves
anything (state/journal.py). Logging the round's fp32 sums puts one model-sized write, its
hashing and its fsync between the last upload and the published result. Here each upload's
body, as it came, is made durable in `<state-dir>/inputs/`, fsynced beside its checksum while
the round waits for the other workers (for the last body: beside its fold and the step).
Uploads are spooled there in the first place (`InputSpool`: named files, written over a
dropped step's file where the step log holds one, pages already cached), so a body its step
logs is adopted where it lies, no copy; a body spooled elsewhere (`--spool-dir`) is copied
in on a thread beside its scan or fold. The commit then moves the round's bodies into its step log
generation, in the order they were folded, with a small record (CheckpointStore.stage's
`adopted` files), and waits only for what is left of their fsyncs. A restart folds them again
in the same order, through the same checks and fold, and replays the step as before: the same
sums, bit for bit (`Intake.refold`).

Only bodies that together hold at most 3/4 of the sums' bytes are copied (`Intake._copy`:
coded uploads with few workers). Copying fp32 bodies, one worker's or two, made rounds at 85M
parameters 50 % slower on this machine, not faster: a copy into new pages and its fsync cost
more than the sums' write into recycled ones (benchmarks/results/model_scale-step-inputs/).
Written over recycled pages, two fp32 bodies still made rounds 21 % slower (their fsyncs
wait on the disk), where int8 rounds got 8-16 % shorter
(benchmarks/results/model_scale-recycled-copies/).

What this store holds between a copy and its step's commit is never needed after a restart
(the round it belonged to was open: its workers send again), so it is emptied at start.
Rounds that fold a body without a working copy (one not copied, kept in memory, or whose copy
failed; robust aggregation, sparse means, async windows) log their sums as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from diloco import faults
from diloco.checkpoints import BODY_SUFFIX, CheckpointStore, descriptor_digest, open_over
from diloco.server.settings import ServerSettings
from diloco.server.state.held_slices import copy_prefix
from diloco.wire.format.spool import SPOOL_FILES_KEPT, SpooledTensors, SpoolFiles

log = logging.getLogger("diloco.server")
# Each body's copy, then its fsync beside its hash. A write waits on the disk most of its time
# (its fsync), so enough of them run at once that a body's copy, which its request waits for,
# does not queue behind other bodies' fsyncs; the hashes (a core each) two at a time.
_WRITES = ThreadPoolExecutor(8, thread_name_prefix="diloco-step-input")
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
    """One upload's body in the inputs directory: copied there on a thread (once `copied` the
    upload's own file may go), or spooled there already (`adopted`); then its fsync runs
    beside its checksum (read back from the page cache through the copy's own descriptor, so a
    rename into the step's generation does not disturb either)."""

    def __init__(self, path: Path, body: SpooledTensors, fd: int, adopted: bool = False) -> None:
        """`fd`: the file at `path`, this copy's to close; `adopted`: it is the body's own
        spool file, so nothing is copied."""
        self.path = path
        self.size = body.size
        self.owned = False  # a round folded it: its step adopts the file
        self.sender: tuple[str, int, int] = ("", 0, 0)  # worker, round, tokens (once folded)
        self.checked = False  # folded by a reader that checked its values (not after a scan)
        self.copied: Future[None] = Future()
        self._fd = fd
        self._written: Future[str] = Future()  # adopted: replaced by `start`'s
        self._started = not adopted
        if adopted:
            self.copied.set_result(None)
        else:
            self._written = _WRITES.submit(self._write, body.file.fileno())

    def start(self) -> None:
        """Its round has folded it: an adopted file's fsync and hash start now, not beside
        its fold, which they slowed (the fold reads the pages their writeback locks); a copy
        has started long ago. Called once, with the round's lock held."""
        if self._started or self._written.done():  # (a discarded one's was cancelled)
            return
        self._started = True
        self._written = _WRITES.submit(self._write, None)

    def _write(self, source: int | None) -> str:
        """The copy (from `source`; None: adopted), then its fsync beside its hash: the
        checksum (the fd closes after)."""
        try:
            try:
                if source is not None:
                    copy_prefix(source, self._fd, self.size)
                os.ftruncate(self._fd, self.size)  # a recycled file's longer tail goes
            except BaseException as exc:
                if not self.copied.done():  # (an adopted file's was set at the start)
                    self.copied.set_exception(exc)
                raise
            if not self.copied.done():
                self.copied.set_result(None)
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
        """Until the upload's file has been read (whether or not the copy worked)."""
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
        self.spool = InputSpool(self)  # where uploads are spooled unless --spool-dir says

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

    def new_file(self) -> tuple[Path, int]:
        """A new body file here (a dropped step's, renamed, where the log has one): its path
        and a read-write descriptor. OSError when it cannot be made."""
        path = self.directory / f"{secrets.token_hex(8)}{BODY_SUFFIX}"
        recycled = self.steps is not None and self.steps.take_recycled(path)
        return path, open_over(path, recycled, os.O_RDWR, 0o600)

    def copy(self, body: SpooledTensors) -> InputCopy | None:
        """`body` kept here for its step's log: its spool file adopted where it lies when it
        is one of `spool`'s, else its bytes copied into a new file, on a thread (in the kernel
        where it can). None when the file cannot be made (a full disk: its round logs its
        sums)."""
        adopted = self.spool.adopt(body.file)
        if adopted is not None:
            try:
                return InputCopy(adopted, body, os.dup(body.file.fileno()), adopted=True)
            except OSError as exc:
                adopted.unlink(missing_ok=True)
                log.warning(
                    "an upload could not be kept in the state dir (%s); its round's step "
                    "logs its sums instead",
                    exc.strerror or exc,
                )
                return None
        try:
            path, fd = self.new_file()
        except OSError as exc:
            log.warning(
                "an upload could not be copied into the state dir (%s); its round's step logs "
                "its sums instead",
                exc.strerror or exc,
            )
            return None
        return InputCopy(path, body, fd)


class InputSpool(SpoolFiles):
    """Uploads spooled into the inputs directory as named files (not the temp dir's unlinked
    ones), so that `StepInputs.copy` adopts a body its step logs where it lies: at 350M
    parameters the step log's copy of one worker's fp32 sums was 1 s of a 3.3 s round.

    A file not adopted goes back to the pool as any spool file does (kept for the next upload,
    or deleted); an adopted one belongs to its `InputCopy` from then on (closing the body
    only closes it). A restart empties the directory, spooled files with the rest."""

    def __init__(self, inputs: StepInputs, keep: int = SPOOL_FILES_KEPT) -> None:
        super().__init__(str(inputs.directory), keep)
        self._inputs = inputs
        self._paths: dict[BinaryIO, Path] = {}  # each file of ours not adopted: its name

    def take(self) -> BinaryIO:
        with self._lock:
            file = self._idle.pop() if self._idle else None
        if file is not None:
            file.seek(0)
            return file
        path, fd = self._inputs.new_file()
        try:
            file = os.fdopen(fd, "r+b")
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        with self._lock:
            self._paths[file] = path
        return file

    def give_back(self, file: BinaryIO) -> None:
        with self._lock:
            path = self._paths.get(file)
            if path is not None and len(self._idle) < self.keep:
                self._idle.append(file)
                return
            self._paths.pop(file, None)
        file.close()
        if path is not None:
            path.unlink(missing_ok=True)

    def adopt(self, file: BinaryIO) -> Path | None:
        """`file`'s name if it is one of ours, now the caller's (None: it is not)."""
        with self._lock:
            return self._paths.pop(file, None)


def _fsync(fd: int) -> None:
    os.fsync(fd)
    faults.crash_point("step_input_durable")  # a body on the disk, its step not logged
