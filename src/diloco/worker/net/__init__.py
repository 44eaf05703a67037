"""The worker's side of the wire protocol: the client, its transport, retries, auth and TLS,
sharded servers."""
