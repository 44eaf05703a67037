"""Compression math: the codecs (codecs.py) and the opt-in compiled kernels for int8's CPU
loops (fused_int8.py). Pure torch, no bytes: the wire format is wire/compressed/."""
