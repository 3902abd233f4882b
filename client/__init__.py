"""pipeplan's training-job client: get a plan, follow improvements, run it in PyTorch.

Imports only httpx, pydantic, tenacity and the pure planner modules; `client.torch_runtime` needs the
`torch` extra and is imported explicitly.
"""

from .api import PlanClient, Submission, TracePosted
from .errors import PlanClientError, PlanNotFound, PlanRequestError, ServiceUnavailable, WaitTimeout
from .online import OnlinePlan, PlanStore

__all__ = [
    "OnlinePlan", "PlanClient", "PlanClientError", "PlanNotFound", "PlanRequestError", "PlanStore",
    "ServiceUnavailable", "Submission", "TracePosted", "WaitTimeout",
]
