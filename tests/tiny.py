"""The tiny model every end-to-end test trains, as a config and as CLI options (one place)."""

from diloco.models import GPTConfig

TINY_MODEL = GPTConfig(context=32, width=32, depth=2, heads=2)
TINY_BATCH = 4
TINY_WARMUP = 2
TINY_CLI = [
    "--width", str(TINY_MODEL.width), "--depth", str(TINY_MODEL.depth),
    "--heads", str(TINY_MODEL.heads), "--seq-len", str(TINY_MODEL.context),
    "--batch-size", str(TINY_BATCH), "--warmup", str(TINY_WARMUP),
]  # fmt: skip

# A tiny Llama for --model-config (transformers builds it from this JSON)
LLAMA = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": None,
}
