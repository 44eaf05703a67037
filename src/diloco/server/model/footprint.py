"""How much memory the global model takes on this server, and whether the machine has it.

A server holds, per model-sized fp32 tensor set: the masters (which are also the fp32 result),
the round's running sums, and the outer optimizer's momentum, plus one more for the bodies in
flight and the step's temporaries; with --download-codec, the published copy P as well
(issue 29's targets: at most 4x the model, 5x with delta downloads). Uploads held in RAM
(--memory-bodies) add a body each. A registration that would define a model this machine
cannot hold is refused then, naming the sizes, instead of the server being killed for memory
halfway through a round; so is one whose checkpoints and step log the state dir's disk
cannot hold, instead of the server stopping at a full disk (503 checkpoint_failed) later.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Sequence
from pathlib import Path

from diloco.algorithm import TensorKind
from diloco.server.settings import ServerSettings
from diloco.wire import TensorSpec

MEMINFO = Path("/proc/meminfo")


def model_bytes(specs: Sequence[TensorSpec]) -> int:
    """The model as the server keeps it: floating tensors in fp32, others in their dtype."""
    return sum(
        math.prod(spec.shape) * (4 if spec.dtype.is_floating_point else spec.dtype.itemsize)
        for spec in specs
    )


def model_size(specs: Sequence[TensorSpec]) -> str:
    """A model's size in words: "1,234,567 parameters in 26 tensors" (parameters: the trainable
    and frozen ones, buffers left out; the tensors: every state_dict entry)."""
    parameters = sum(
        math.prod(spec.shape)
        for spec in specs
        if spec.kind in (TensorKind.TRAINABLE.value, TensorKind.FROZEN.value)
    )
    tensors = len(specs)
    return f"{parameters:,} parameters in {tensors} tensor{'s' if tensors != 1 else ''}"


def bytes_needed(specs: Sequence[TensorSpec], settings: ServerSettings) -> int:
    """What the server will hold for this model: 4x it (5x with delta downloads, one more
    with sparse_mean's counts of senders), plus the uploads it keeps in RAM (each the model
    at the upload dtype, an upper bound for codecs)."""
    model = model_bytes(specs)
    copies = 5 if settings.delta_downloads else 4
    if settings.aggregation == "sparse_mean":
        copies += 1  # each element's count of senders, an fp32 model
    upload = model * settings.upload_dtype.itemsize // 4
    return copies * model + settings.memory_bodies * upload


def disk_bytes_needed(
    specs: Sequence[TensorSpec],
    settings: ServerSettings,
    keep_checkpoints: int,
    logged_steps: int,
    logs_bodies: bool = False,
) -> int:
    """The most a run's state dir holds for this model: `keep_checkpoints` checkpoint
    generations plus the one being written, each the masters, the outer optimizer's state (one
    model, an upper bound) and, with delta downloads, the published copy; and up to
    `logged_steps` steps of the step log, one model each (`--checkpoint-every`; a step that
    logs its uploads holds no more bytes than the sums, see server/state/step_inputs.py), and,
    where steps log their uploads, the open round's copies of them (at most one model more)."""
    model = model_bytes(specs)
    generation = model * (3 if settings.delta_downloads else 2)
    return (keep_checkpoints + 1) * generation + (logged_steps + int(logs_bodies)) * model


def free_disk_bytes(directory: Path) -> int | None:
    """Bytes free for this process on `directory`'s file system (None if it cannot be read)."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (memory the kernel can give without swapping), or None
    where there is no such file."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
