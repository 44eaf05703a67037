"""What survives a restart: the state directory (SQLite in WAL mode, safetensors) and the round
journal."""
