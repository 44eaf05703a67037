"""diloco: Distributed Low-Communication training for PyTorch.

Workers train replicas for H optimizer steps, send pseudo-gradients (anchor - local) to a
coordinator, which applies an outer optimizer to fp32 master weights. See docs/architecture.md.
"""

__version__ = "0.1.0"
