"""Bodies built by hand for the tests of malformed input: exactly the entries and metadata
given, bypassing every check an encoder makes."""

from __future__ import annotations

import torch

from diloco.wire.format.layout import FrameLayout


def frame_of(entries: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> bytearray:
    """A safetensors body of exactly these entries (coded parts or plain tensors)."""
    plan = {name: (tuple(t.shape), t.dtype) for name, t in entries.items()}
    layout = FrameLayout.plan(plan, metadata=metadata)
    buffer = bytearray(layout.size)
    frame = torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0)
    layout.write_header(frame)
    for name, view in layout.views(frame).items():
        if view.numel():
            view.copy_(entries[name].reshape(view.shape))
    return buffer
