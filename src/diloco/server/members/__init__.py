"""Who trains and who may act: registrations, liveness, evictions and credentials."""
