"""Lower bounds on the makespan, and the least memory each device needs for any schedule at all.

Both are proofs, not estimates: no valid plan is faster than `lower_bound`, and a device whose limit
is below `min_memory` admits no valid plan, whatever the order, offload or recompute. Each makespan
bound is one named argument in `registry.ARGUMENTS`; `prove` says which of them is tight.
"""

from .least_memory import MemoryInfeasibleError, check_memory_feasible, min_memory
from .registry import ALL, ARGUMENTS, QUICK, Argument, Proof, known, lower_bound, prove

__all__ = [
    "ALL",
    "ARGUMENTS",
    "QUICK",
    "Argument",
    "MemoryInfeasibleError",
    "Proof",
    "check_memory_feasible",
    "known",
    "lower_bound",
    "min_memory",
    "prove",
]
