"""Which samples a worker trains: leased work units, their record, token counts."""
