"""Sharded servers: each shard owns part of the model; shard 0 decides every step and the others
apply it."""
