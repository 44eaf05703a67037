"""Adapters that make a training framework's run one DiLoCo worker (each imports its framework)."""
