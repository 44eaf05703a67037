"""Models used by the demo, the tests and the benchmarks."""

from diloco.models.gpt import GPT, GPTConfig, block_prefixes

__all__ = ["GPT", "GPTConfig", "block_prefixes"]
