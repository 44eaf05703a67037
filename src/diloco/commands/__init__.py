"""The `diloco` subcommands, one module each; `diloco.cli` assembles them."""
