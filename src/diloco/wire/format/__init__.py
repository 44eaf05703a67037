"""Tensor bodies: safetensors frames, early headers, spooled bodies, dtypes, specs and their
checks."""
