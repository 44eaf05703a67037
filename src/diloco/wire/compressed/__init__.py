"""Compressed bodies: a codec's parts as safetensors entries, checked and decoded span by span."""
