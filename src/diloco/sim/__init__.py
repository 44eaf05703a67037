"""In-process simulator: K replicas trained through the same algorithm code as the server."""

from diloco.sim.config import MODES, SimConfig
from diloco.sim.runner import SimResult, prepare, run, simulate, total_inner_steps

__all__ = ["MODES", "SimConfig", "SimResult", "prepare", "run", "simulate", "total_inner_steps"]
