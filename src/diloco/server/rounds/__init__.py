"""When pseudo-gradients become an outer step: admission, the round engines (sync, streaming,
async), robust aggregation."""
