"""A record of which samples each submission trained, for audits of the data's exactness.

With DILOCO_TRACE_SAMPLES=FILE a worker appends one JSON line per submission *before* sending
it: {"worker": id, "round": r, "samples": [[epoch, index], ...]}. Joined with the server's
submissions table (which (worker, round) pseudo-gradients an outer step applied), it shows
how often each sample of an epoch went into the global model: the end-to-end tests check it
is exactly once under kills, resumes and evictions. Off (the default), it costs nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TRACE_ENV_VAR = "DILOCO_TRACE_SAMPLES"


class SampleTrace:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @classmethod
    def from_env(cls) -> SampleTrace | None:
        path = os.environ.get(TRACE_ENV_VAR)
        return cls(path) if path else None

    def record(self, worker_id: str, round_number: int, samples: list[tuple[int, int]]) -> None:
        line = json.dumps({"worker": worker_id, "round": round_number, "samples": samples})
        with self.path.open("a") as out:
            out.write(line + "\n")
            out.flush()
            os.fsync(out.fileno())  # written before the submission leaves: a kill keeps it
