"""What a worker keeps across its own restarts: checkpoints, and resuming from them."""
