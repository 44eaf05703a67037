"""The global model: fp32 masters, the outer step, and the weights or deltas workers download."""
