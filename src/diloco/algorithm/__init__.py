"""Pure DiLoCo math on name->tensor dicts: no I/O, no threads, no HTTP.

The server and the simulator both call `outer_step` for a round, so they apply the same update.
"""

from diloco.algorithm.arrivals import STALENESS_WEIGHTINGS, GraceWindow, staleness_scale
from diloco.algorithm.contributions import (
    WEIGHTINGS,
    Contribution,
    RunningMean,
    average_contributions,
    is_finite_contribution,
)
from diloco.algorithm.delayed_nesterov import ARRIVALS_KEY, DelayedNesterov
from diloco.algorithm.dylu import dylu_local_steps
from diloco.algorithm.fragments import (
    StreamingSchedule,
    alpha_merge,
    block_prefixes_from_names,
    plan_fragments,
)
from diloco.algorithm.outer import (
    APPLY_POLICIES,
    OuterStepResult,
    UpdateRule,
    apply_mean,
    apply_running_mean,
    outer_step,
    pseudo_gradient,
)
from diloco.algorithm.outer_optimizer import OUTER_KINDS, OuterOptimizer
from diloco.algorithm.tensors import TensorDict, TensorKind, classify_tensors, to_fp32_masters

__all__ = [
    "APPLY_POLICIES",
    "ARRIVALS_KEY",
    "OUTER_KINDS",
    "STALENESS_WEIGHTINGS",
    "WEIGHTINGS",
    "Contribution",
    "DelayedNesterov",
    "GraceWindow",
    "OuterOptimizer",
    "OuterStepResult",
    "RunningMean",
    "StreamingSchedule",
    "TensorDict",
    "TensorKind",
    "UpdateRule",
    "alpha_merge",
    "apply_mean",
    "apply_running_mean",
    "average_contributions",
    "block_prefixes_from_names",
    "classify_tensors",
    "dylu_local_steps",
    "is_finite_contribution",
    "outer_step",
    "plan_fragments",
    "pseudo_gradient",
    "staleness_scale",
    "to_fp32_masters",
]
