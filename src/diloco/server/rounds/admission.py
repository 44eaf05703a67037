"""The intake of pseudo-gradients: admit a submission, scan its values, fold it.

Everything about a submission but its values is decided under the coordinator's lock before
a byte of it is folded; the values are scanned for NaN/Inf outside the lock (so one upload's
scan overlaps another's fold); a spooled first contribution of its round is checked while it
is folded, in one read of its file. A refusal at any point raises `Rejection` and changes
nothing. When the pseudo-gradients combine into a step is the round engine's decision.

A body's layout is checked against the server's upload codec (`UploadFormat`, below); a
compressed body is then read as decoded pieces (wire/compressed/pieces.py), scanned and folded
exactly like a spooled plain one, whether it sits in a file or in memory.

What a submission's body must hold under the server's upload codec (`UploadFormat`), and the
body a round folds from it:

- Plain codecs (fp32, bf16): the fragment's tensors by name; floating ones in the upload dtype,
  int and bool ones in their own dtype, int64 or fp32 (wire/format/checks.py). A body whose header
  names a codec (`diloco.*` metadata) is 422 codec_mismatch: the worker and the server
  disagree on the codec, and reading its parts as tensors would only say "unknown tensor".
- Compressed codecs (int8, int4, int2, top-k): the header's metadata must name the server's
  codec, block, chunk and k exactly (else 422 codec_mismatch); every trainable tensor comes as
  the codec's parts (`NAME#codes`, `#scales`, `#indices`, of the exact dtypes and lengths), and
  every other tensor of the fragment (frozen, float, int and bool buffers) as a plain entry
  under the same dtype rule as in a plain body, so a worker sends its buffers exactly as it
  does without compression.

`check` reads only the header (names, shapes, dtypes, metadata), so the server runs it as soon
as a body's header has arrived. `open` turns an admitted body into what the round folds: a
plain body as it is, a compressed one as `CompressedPieces`, whose values are checked and
decoded span by span when the round scans or folds it, never decoded whole.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from diloco import faults
from diloco.algorithm import RunningMean, TensorKind
from diloco.algorithm.tensors import finite_bound
from diloco.server.errors import Rejection, rejection_of
from diloco.server.members.membership import Membership, WorkerRecord
from diloco.server.model.footprint import model_bytes
from diloco.server.model.global_model import GlobalModel
from diloco.server.ops.metrics import Traffic
from diloco.server.rounds.engine import RoundEngine
from diloco.server.rounds.round import FoldTorn, Round, Submission, ValueScan, fold
from diloco.server.settings import ServerSettings
from diloco.server.shards.sync_decisions import session_digest
from diloco.server.state.held_slices import HeldSlices, PreparedSlice, StoredSlice
from diloco.server.state.journal import LoggedStep, logged_around_page_cache
from diloco.server.state.step_inputs import InputCopy, StepInputs
from diloco.wire import (
    MAX_COUNT,
    SpooledTensors,
    TensorSpec,
    WireError,
    check_finite,
    check_tensors,
)
from diloco.wire.compressed.header import (
    SEPARATOR,
    CompressedHeader,
    check_compressed_header,
    echo_metadata,
)
from diloco.wire.compressed.pieces import CompressedPieces
from diloco.wire.format.spool import CheckedPieces, PieceBody, open_spooled

Tensors = Mapping[str, torch.Tensor] | PieceBody
log = logging.getLogger("diloco.server")
_CODEC_PREFIX = "diloco."


class UploadFormat:
    """The server's upload codec, applied to submissions' headers and bodies."""

    def __init__(self, settings: ServerSettings) -> None:
        self.codec = settings.upload if settings.compressed_uploads else None
        self.codec_name = settings.upload_codec
        self.float_dtype = settings.upload_dtype

    def check(
        self,
        entries: Mapping[str, Any],
        metadata: Mapping[str, str] | None,
        expected: Mapping[str, TensorSpec],
    ) -> CompressedHeader | None:
        """A body's header (entries with a shape and a dtype: header entries, meta tensors or
        tensors) against the fragment's `expected` specs; WireError(422) naming the tensor.
        Returns the sorted-out header of a compressed body, None for a plain one."""
        if self.codec is None:
            self._refuse_codec(metadata or {})
            check_tensors(entries, expected, float_dtype=self.float_dtype, scan_values=False)
            return None
        exact = {name for name, spec in expected.items() if spec.kind != TensorKind.TRAINABLE.value}
        # An exact tensor is given its entry's own dtype here, so that the dtype rule of plain
        # bodies (checked below, with its wording) decides it rather than an exact match.
        shapes = {
            name: (
                tuple(spec.shape),
                entries[name].dtype if name in exact and name in entries else spec.dtype,
            )
            for name, spec in expected.items()
        }
        header = check_compressed_header(entries, metadata, shapes, self.codec, exact=exact)
        plain_specs = {name: expected[name] for name in header.plain}
        check_tensors(
            header.plain,
            plain_specs,
            float_dtype=self.float_dtype,
            require_all=False,
            scan_values=False,
        )
        return header

    def open(
        self,
        tensors: Mapping[str, torch.Tensor] | SpooledTensors,
        metadata: Mapping[str, str] | None,
        expected: Mapping[str, TensorSpec],
    ) -> Tensors:
        """`check` the body, then the body a round folds: a plain one as it is; a compressed
        one as decoded pieces read from its file or its buffer (no value is read yet)."""
        if isinstance(tensors, SpooledTensors):
            header = self.check(tensors.entries, metadata, expected)
            return tensors if header is None else CompressedPieces.spooled(header, tensors)
        header = self.check(tensors, metadata, expected)
        return tensors if header is None else CompressedPieces.in_memory(header)

    def _refuse_codec(self, metadata: Mapping[str, str]) -> None:
        """422 codec_mismatch for a coded body sent to a server that takes plain tensors."""
        got = {key: value for key, value in metadata.items() if key.startswith(_CODEC_PREFIX)}
        if not got:
            return
        got = echo_metadata(got)
        coded = got.get("diloco.codec", "an unnamed codec")
        raise WireError(
            422,
            "codec_mismatch",
            f"the body is coded as {coded!r}; this server takes plain tensors (upload codec "
            f"{self.codec_name}), with no diloco.* metadata",
            expected={},
            got=got,
            codec=self.codec_name,
        )


def scan_values(tensors: Tensors, norm_of: Collection[str] | None = None) -> ValueScan:
    """Rejection (422) for NaN or Inf; else a bound of the values' magnitude and the tensor
    that sets it, which lets a round refuse what could overflow its sums and know them
    finite without scanning them again. With `norm_of` (robust aggregation), also the L2
    norm over those tensors, in the same pass."""
    measured = norm_of or ()
    squares = 0.0
    try:
        if isinstance(tensors, PieceBody) and norm_of is None:
            scan = ValueScan(tensors.check_values(), tensors.largest)
        elif isinstance(tensors, PieceBody):
            checked = tensors.checked_pieces()
            for name, _, piece in checked:
                squares += _squares(piece) if name in measured else 0.0
            tensors.largest = checked.largest
            scan = ValueScan(checked.bound, checked.largest)
        else:
            scan = ValueScan(0.0)
            for name, tensor in tensors.items():
                bound = finite_bound(tensor)
                if bound is None:
                    check_finite(name, tensor)  # raises, naming the tensor and the count
                    bound = math.inf
                if bound > scan.bound or scan.largest is None:
                    scan = ValueScan(max(bound, scan.bound), name)
                squares += _squares(tensor) if name in measured else 0.0
    except WireError as error:
        raise rejection_of(error) from None
    return scan if norm_of is None else replace(scan, norm=math.sqrt(squares))


def _squares(values: torch.Tensor) -> float:
    """The sum of squares of `values`, accumulated in fp64."""
    return float(torch.linalg.vector_norm(values, dtype=torch.float64)) ** 2


class Intake:
    """Admits, scans and folds submissions into the engine's open round or window."""

    def __init__(
        self,
        lock: threading.Condition,
        settings: ServerSettings,
        model: GlobalModel,
        membership: Membership,
        engine: RoundEngine,
        traffic: Traffic,
        closing: Callable[[], bool],
        held_slices: HeldSlices | None = None,
        step_inputs: StepInputs | None = None,
    ) -> None:
        """`held_slices`: a follower shard's store, where each slice it holds is made
        durable before the answer says so (None: nothing is written); `step_inputs`: one
        server's, where each spooled body is copied before it is folded, to be made durable
        as it comes (state/step_inputs.py)."""
        self.lock = lock
        self.settings = settings
        self.model = model
        self.membership = membership
        self.engine = engine
        self.traffic = traffic
        self.closing = closing
        self.format = UploadFormat(settings)
        self.robust = settings.robust.screens
        self.held_slices = held_slices
        self.step_inputs = step_inputs

    def submit(
        self,
        worker_id: str,
        round_number: int,
        tensors: Mapping[str, torch.Tensor] | SpooledTensors,
        *,
        fragment: int = 0,
        tokens: int = 0,
        units: Sequence[int] = (),
        progress: Mapping[int, int] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> dict:
        """Fold one pseudo-gradient in; idempotent on (worker, round, fragment).

        `units` are the work units the worker finished since its last submission, `progress`
        those it trained in part; they complete in the transaction of the outer step that
        uses it (journal.commit). `metadata` is the body header's `__metadata__` (a compressed
        body's codec); a spooled body carries its own. `tensors` are only read.
        """
        if metadata is None and isinstance(tensors, SpooledTensors):
            metadata = tensors.metadata
        key = (worker_id, round_number, fragment)
        rest = (tokens, sorted(set(units)), dict(progress or {}))
        copy: InputCopy | None = None
        try:  # (`_let_go` once the lock is released)
            with self.lock:
                submission = self._admit(*key, tensors, *rest, metadata=metadata)
                if not isinstance(submission, Submission):
                    return submission  # nothing to fold: the answer
                body = submission.tensors  # a compressed body opened as decoded pieces
                # one server logging its steps: the body copied into the state dir, on a thread
                copy = self._copy(tensors, fragment)
                if isinstance(body, PieceBody) and self.engine.folds_first(fragment):
                    # The first contribution of its round: its sums are new, so it can be
                    # checked while it is folded, in one read of the file; a refusal half way
                    # changes nothing.
                    if copy is not None:
                        submission = replace(submission, copy=copy)
                    return self._accept(submission, body.checked_pieces())
            scanning = time.perf_counter()
            scan = scan_values(body, self._norm_names(fragment))  # outside the lock
            self.traffic.metrics.round_part_seconds.labels(part="scan").observe(
                time.perf_counter() - scanning
            )
            return self._fold_scanned(submission, key, rest, tensors, metadata, scan, copy)
        finally:
            self._let_go(copy)

    def _fold_scanned(
        self,
        submission: Submission,
        key: tuple[str, int, int],
        rest: tuple[int, list[int], dict[int, int]],
        tensors: Mapping[str, torch.Tensor] | SpooledTensors,
        metadata: Mapping[str, str] | None,
        scan: ValueScan,
        copy: InputCopy | None,
    ) -> dict:
        """A scanned body admitted again and folded (a follower's slice on its disk first)."""
        body = submission.tensors
        # a follower's slice is on its disk before the round holds it (outside the lock)
        prepared = self._prepare(tensors, metadata, submission)
        try:
            with self.lock:
                # The state may have moved on during the scan (a commit, a retry that won);
                # the layout (names, shapes, dtypes against fixed specs) cannot have.
                submission = self._admit(*key, body, *rest, check_layout=False)
                if not isinstance(submission, Submission):
                    return submission
                if copy is not None:
                    submission = replace(submission, copy=copy)
                stored = None if prepared is None else self._keep(prepared, submission)
                prepared = None
                try:
                    return self._accept(submission, scan)
                except BaseException:
                    if stored is not None:
                        self.held_slices.forget(stored)  # type: ignore[union-attr]
                    raise
        finally:
            if prepared is not None:
                self.held_slices.discard(prepared)  # type: ignore[union-attr]

    def _copy(
        self, tensors: Mapping[str, torch.Tensor] | SpooledTensors, fragment: int
    ) -> InputCopy | None:
        """The body's copy for the step log, started (None: its round logs its sums): a
        spooled body whose round's bodies, one per live member, hold at most 3/4 of the fp32
        sums' bytes (coded uploads with few workers). Measured at 85M and 350M parameters
        (benchmarks/results/model_scale-step-inputs/): int8 bodies of 0.26x and 0.52x the
        sums made rounds 10-15 % shorter; fp32 bodies of 1x (one worker) and 2x (two)
        made them 50 % longer, a copy into new pages and its fsync being slower than
        the sums' write into recycled ones; over recycled pages two fp32 bodies still made
        them 21 % longer (benchmarks/results/model_scale-recycled-copies/). From
        `DIRECT_STEP_LOG_BYTES` of sums on (350M), where the log would be written around the
        page cache, the body of a round of one sender (an fp32 one: the sums' bytes) is
        copied around it too: a 350M fp32 round of one worker 2.66-3.04 s -> 2.49-2.69 s in
        four pairs (benchmarks/results/model_scale-direct-input-copy/). Such a copy is
        mostly still being written when the round commits: the commit waits for it, and one
        that fails there stops the server (503 until restarted, as a failed fsync does)
        instead of leaving the step to log its sums."""
        if self.step_inputs is None or not isinstance(tensors, SpooledTensors):
            return None
        followed = tensors.follower  # a direct copy begun as the body came (`follow`)
        rule = self._copy_rule(tensors.nbytes, fragment)
        if isinstance(followed, InputCopy) and rule == "direct":
            return followed  # (else its body's close lets it go)
        if rule is None:
            return None
        return self.step_inputs.copy(tensors, direct=rule == "direct")

    def follow(self, fragment: int, source: int, nbytes: int, size: int) -> InputCopy | None:
        """A direct copy of an upload's body (`nbytes` of data, `size` in all, being spooled
        to descriptor `source`) begun as it arrives, where `_copy` would copy it around the
        page cache once whole: most of the copy is then written while the body comes,
        instead of after it (benchmarks/results/model_scale-follow-spool/). None otherwise."""
        if self.step_inputs is None:
            return None
        with self.lock:
            plan = self.model.plan
            if self.model.specs is None or plan is None or not 0 <= fragment < len(plan):
                return None  # (the submission is refused by name once it is whole)
            if self._copy_rule(nbytes, fragment) != "direct":
                return None
        return self.step_inputs.follow(source, size)

    def _copy_rule(self, nbytes: int, fragment: int) -> str | None:
        """How a body of `nbytes` for `fragment` is copied for the step log: "cached"
        (through the page cache), "direct" (around it), or None (its round logs its sums);
        see `_copy`."""
        senders = max(len(self.membership.live_ids()), self.settings.min_workers, 1)
        specs, plan = self.model.specs, self.model.plan
        assert specs is not None and plan is not None
        sums = model_bytes([specs[name] for name in plan[fragment]])  # the log's otherwise
        if 4 * nbytes * senders <= 3 * sums:
            return "cached"
        if logged_around_page_cache(sums) and senders == 1 and nbytes <= sums:
            return "direct"
        return None

    @staticmethod
    def _let_go(copy: InputCopy | None) -> None:
        """Before the request lets its body's file go: the copy has read it, and goes too if
        the round did not fold it (refused, a duplicate, a failed scan: `InputCopy.release`,
        which stops a direct copy at its next write)."""
        if copy is not None:
            copy.release()

    def _prepare(
        self,
        tensors: Mapping[str, torch.Tensor] | SpooledTensors,
        metadata: Mapping[str, str] | None,
        submission: Submission,
    ) -> PreparedSlice | None:
        """A follower's slice written to its state dir and fsynced (None: nothing to write);
        a disk that fails is 503 `spool_unavailable`, which the worker retries."""
        if self.held_slices is None:
            return None
        with _storage_failure():
            return self.held_slices.prepare(
                tensors,
                metadata,
                worker_id=submission.worker_id,
                session=submission.record.session,
                round_number=submission.round,
                fragment=submission.fragment,
                tokens=submission.tokens,
                units=submission.units,
                progress=submission.progress,
            )

    def _keep(self, prepared: PreparedSlice, submission: Submission) -> StoredSlice:
        """A prepared slice into the follower's store (lock held: renames and a directory
        fsync), under the session the round will note for it; the slices the engine no longer
        holds go (folded by a committed step, or passed: an async worker's older anchors)."""
        store = self.held_slices
        assert store is not None
        with _storage_failure():
            store.retain(self._still_held)
            return store.keep(prepared, submission.record.session)

    def _still_held(self, stored: StoredSlice) -> bool:
        """Whether the follower still holds a slice (lock held): among its held slices, or
        in a step being made from them."""
        worker_id, number = stored.worker_id, stored.round
        if self.engine.holds(worker_id, number, session_digest(stored.session)) is not None:
            return True
        window = self.engine.open_round()
        return window is not None and any(
            held.worker_id == worker_id and held.round == number for held, _ in window.held
        )

    def take_back(self, stored: StoredSlice, body: SpooledTensors, now: float) -> dict:
        """A slice a follower held durably before it restarted, taken as its upload was
        (before the server serves): admitted under the session it came from, scanned, held.
        A worker that left since is no reason to drop it (shard 0 may have decided the round
        with it, as a running follower keeps a departed worker's slice). A refusal raises
        Rejection (the round moved on, say) and changes nothing."""
        key = (stored.worker_id, stored.round, stored.fragment)
        rest = (stored.tokens, stored.units, stored.progress)
        known = self.membership.get_live(stored.worker_id)
        record = replace(
            known or WorkerRecord(stored.worker_id, now, now, live=False),
            session=stored.session,  # the process it came from, maybe an older one
        )
        with self.lock:
            submission = self._admit(*key, body, *rest, metadata=body.metadata, record=record)
            if not isinstance(submission, Submission):
                return submission
        scan = scan_values(submission.tensors, self._norm_names(stored.fragment))
        with self.lock:
            return self._accept(submission, scan)

    def refold(self, step: LoggedStep) -> RunningMean:
        """A logged step's running mean, from its bodies (a restart: see Coordinator._replay):
        each opened, scanned and folded in the order the round folded it, as `submit` did,
        so the sums come out the same, bit for bit. ValueError when they do not agree with
        what the log says the step's sums held."""
        record = step.record
        fragment = record.fragment
        plan = self.model.plan
        assert plan is not None
        target = Round(record.round, set(), step.weighting, opened_at=0.0)
        storage = (
            self.model.sums_storage()
            if len(plan) == 1
            else self.model.fragment_sums_storage(plan[fragment], fresh=True)
        )
        for item in step.inputs:
            body = open_spooled(item.path)
            try:
                opened = self._open(fragment, body, body.metadata)
                sender = WorkerRecord(item.worker_id, 0.0, 0.0, live=False)
                submission = Submission(sender, item.round, fragment, opened, item.tokens, [])
                if item.checked and isinstance(opened, PieceBody):  # as the round folded it
                    checked: CheckedPieces | ValueScan = opened.checked_pieces()
                else:
                    checked = scan_values(opened, self._norm_names(fragment))
                fold(target, submission, checked, storage, 0.0)  # (storage: when it opens)
            finally:
                body.close()
        running = target.running or RunningMean(step.weighting)
        folded = (running.count, running.totals, running.bound)
        if folded != (step.count, step.totals, step.bound):
            raise ValueError(
                f"its {len(step.inputs)} bodies fold to {running.count} contribution(s) with "
                f"totals {running.totals} and bound {running.bound}, where the log says "
                f"{step.count} with {step.totals} and {step.bound}"
            )
        return running

    def _admit(
        self,
        worker_id: str,
        round_number: int,
        fragment: int,
        tensors: Tensors,
        tokens: int,
        units: list[int],
        progress: dict[int, int],
        *,
        check_layout: bool = True,
        metadata: Mapping[str, str] | None = None,
        record: WorkerRecord | None = None,
    ) -> Submission | dict:
        """Everything about a submission but its values (lock held); changes nothing.

        Returns the answer when there is nothing to fold ("committed", "duplicate": the only
        outcomes that touch state, the worker's last_seen), the Submission when it should be
        folded, its body opened for the fold (`UploadFormat.open`) when `check_layout`; a
        refusal raises Rejection. `record`: the record to admit it under (a slice taken back
        after a restart); else the live worker's.
        """
        self.model.require_healthy()
        if record is None:
            record = self.membership.require_live(worker_id)
        if self.closing():
            raise Rejection(
                503,
                "shutting_down",
                "the server is shutting down; submit again once it is back",
                current_round=self.model.version,
            )
        if self.model.masters is None or self.model.plan is None:
            raise Rejection(409, "no_weights", "no global weights yet; nothing to submit to")
        self.require_round_and_fragment(round_number, fragment)
        if tokens <= 0 and self.settings.weighting == "tokens":
            # It would weigh nothing: a run whose workers all report none would never move.
            raise Rejection(
                422,
                "tokens_required",
                "the server weighs pseudo-gradients by tokens (--weighting tokens) and this "
                f"submission reports {tokens} tokens; send tokens=N, the tokens trained since "
                "the last submission",
                field="tokens",
                got=tokens,
            )
        submission = Submission(record, round_number, fragment, tensors, tokens, units, progress)
        answer = self.engine.admit(submission)
        if answer is not None:
            return answer
        if check_layout:
            opened = self._open(fragment, tensors, metadata)
            if opened is not tensors:
                submission = replace(submission, tensors=opened)
        return submission

    def _norm_names(self, fragment: int) -> set[str] | None:
        """The tensors a robust aggregation's norm is over (the fragment's trainable floats);
        None under the plain mean, which takes no norm."""
        if not self.robust:
            return None
        specs, plan = self.model.specs, self.model.plan
        assert specs is not None and plan is not None
        return {name for name in plan[fragment] if specs[name].trained}

    def require_round_and_fragment(self, round_number: int, fragment: int) -> None:
        """422 for a round outside [0, MAX_COUNT], or a fragment the plan does not have (once
        there is one)."""
        if not 0 <= round_number <= MAX_COUNT:
            raise Rejection(
                422,
                "invalid_request",
                f"field 'round' must be in [0, {MAX_COUNT}], got {round_number}",
                field="round",
                got=round_number,
            )
        plan = self.model.plan
        if plan is None:
            return
        if not 0 <= fragment < len(plan):
            allowed = "0 (one fragment)" if len(plan) == 1 else f"in [0, {len(plan) - 1}]"
            raise Rejection(
                422,
                "invalid_request",
                f"field 'fragment' must be {allowed} in {self.settings.mode} mode, got {fragment}",
                field="fragment",
                got=fragment,
                allowed=[0, len(plan) - 1],
            )
        _require_own_fragment(plan, fragment)

    def check_header(
        self, fragment: int, shapes: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
    ) -> None:
        """A submission's layout (its fragment's names, shapes, dtypes, and the codec its
        metadata names) from its header alone, before its values arrive, so that a body that
        will be refused is not read. Without the lock: the specs and the plan never change
        once set. Before they are, or for a fragment outside the plan, it says nothing
        (`submit` then gives the reason)."""
        plan = self.model.plan
        if self.model.specs is not None and plan is not None and 0 <= fragment < len(plan):
            _require_own_fragment(plan, fragment)
            try:
                self.format.check(shapes, metadata, self._expected(fragment, shapes))
            except WireError as error:
                raise rejection_of(error) from None

    def _open(
        self,
        fragment: int,
        tensors: Mapping[str, torch.Tensor] | SpooledTensors,
        metadata: Mapping[str, str] | None,
    ) -> Tensors:
        """Check the layout (names of this fragment, shapes, dtypes, codec; the values are
        scanned apart) and give the body the round folds."""
        names = tensors.entries if isinstance(tensors, SpooledTensors) else tensors
        try:
            return self.format.open(tensors, metadata, self._expected(fragment, names))
        except WireError as error:
            raise rejection_of(error) from None

    def _expected(self, fragment: int, names: Mapping[str, object]) -> dict:
        """The fragment's specs; 422 wrong_fragment for a tensor (or a compressed tensor's
        part) of another fragment."""
        specs, plan = self.model.specs, self.model.plan
        assert specs is not None and plan is not None
        if len(plan) > 1:
            for entry_name in names:
                name = entry_name
                if name not in self.model.owner and SEPARATOR in name:
                    name = name.rpartition(SEPARATOR)[0]  # NAME#codes belongs where NAME does
                owner = self.model.owner.get(name, fragment)
                if owner != fragment:
                    raise Rejection(
                        422,
                        "wrong_fragment",
                        f"tensor {name!r} belongs to fragment {owner}, not to fragment "
                        f"{fragment} of this submission",
                        tensor=name,
                        fragment=fragment,
                        belongs_to=owner,
                    )
        return {name: specs[name] for name in plan[fragment]}

    def _accept(self, submission: Submission, checked: CheckedPieces | ValueScan) -> dict:
        """Fold an admitted submission (lock held); `checked` is the bound of its values from
        their scan, or, for the first contribution of a round, a reader that checks them."""
        try:
            return self.engine.accept(submission, checked)
        except WireError as error:  # found by a checking reader: nothing was folded
            raise rejection_of(error) from None
        except FoldTorn as torn:  # the round's sums hold part of a body: serve nothing more
            raise self.model.stop_serving(str(torn)) from None


@contextlib.contextmanager
def _storage_failure() -> Iterator[None]:
    """A held slice the state dir cannot take: 503 `spool_unavailable` (the worker retries;
    a full or failing disk heals), nothing held."""
    try:
        yield
    except OSError as exc:
        raise Rejection(
            503,
            "spool_unavailable",
            f"the server could not write the upload to its state dir ({exc.strerror or exc})",
        ) from None


def _require_own_fragment(plan: Sequence[Sequence[str]], fragment: int) -> None:
    """409 for a fragment another shard owns (a streaming shard's plan leaves it empty)."""
    if not plan[fragment]:
        raise Rejection(
            409,
            "wrong_shard",
            f"fragment {fragment} lives on another shard (/v1/info names each shard's "
            "fragments under shards.fragments)",
            fragment=fragment,
        )


def record_folded(traffic: Traffic, submission: Submission, target: Round, now: float) -> None:
    """Record a folded submission (lock held): its worker's sign of life, the units it reports
    (they complete with the step that applies it), the bytes it brought."""
    submission.record.last_seen = now  # only now: a rejection leaves the state as it was
    target.add_units(submission.worker_id, submission.units)
    if submission.progress:
        target.add_progress(submission.worker_id, submission.progress)
    submission.record.rounds_contributed += 1
    traffic.received(submission.nbytes)
    faults.crash_point("submission_folded")
