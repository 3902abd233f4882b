"""Problems from what users send: a problem v1 as it is, or a model spec through the cost model, its
"partition": "auto" through the adaptive search.

This sits above planner.costmodel (formulas, fixed partitions) and planner.adaptive (which searches
partitions with the cost model and the heuristics), so that the cost model never calls back up into
the search: imports point one way.
"""

from __future__ import annotations

from typing import Any

from .adaptive import adaptive_problem
from .contract import Limits, Problem
from .costmodel import build_problem, layer_costs, partition_for
from .spec import SPEC_FORMAT, Spec, check_spec_size, is_problem_document


def problem_from_spec(spec: Spec) -> Problem:
    """The problem for the spec's own partition strategy ("auto": planner.adaptive's search)."""
    if spec.partition == "auto":
        return adaptive_problem(spec)
    costs = layer_costs(spec)
    return build_problem(spec, partition_for(spec, spec.partition, costs=costs), costs=costs)


def problem_from_document(doc: Any, limits: Limits | None = None) -> Problem:
    """A problem v1 dict (has "format": "pipeplan.problem/v1" or "stages") or a model spec dict (has
    "model"), detected. Raises ValueError or pydantic's ValidationError naming the field."""
    if not isinstance(doc, dict):
        raise ValueError(f"document: expected a JSON object, got {type(doc).__name__}")  # noqa: TRY004
    if is_problem_document(doc):
        return Problem.model_validate(doc)
    if "model" in doc or doc.get("format") == SPEC_FORMAT:
        if limits is not None:  # the service's sizes, before any expensive step
            check_spec_size(doc, limits)
        return problem_from_spec(Spec.model_validate(doc))
    raise ValueError(
        "document: neither a problem v1 (needs \"format\": \"pipeplan.problem/v1\" or \"stages\") nor a"
        " model spec (needs \"model\", \"hardware\" and \"training\")")
