"""Problem v1 validation messages, normalization and the canonical key (docs/formats.md)."""

from __future__ import annotations

import copy
import hashlib
import json
import math

import pytest
from pipeplan.planner.contract import Limits, Plan, Problem, error_messages
from pydantic import ValidationError

# A fixed problem written out literally, so the pinned key below depends on nothing else in the repo.
FIXED = {
    "format": "pipeplan.problem/v1",
    "num_devices": 2,
    "num_microbatches": 4,
    "p2p_ms": 0.05,
    "options": {"split_backward": True, "offload": True, "recompute": False},
    "stages": [
        {"device": 0, "forward_ms": 1.0, "backward_input_ms": 1.1, "backward_weight_ms": 0.9,
         "offload_ms": 0.6, "activation_mib": 512.0, "weight_grad_mib": 128.0, "checkpoint_mib": 16.0},
        {"device": 1, "forward_ms": 1.2, "backward_input_ms": 1.3, "backward_weight_ms": 1.0,
         "offload_ms": 0.6, "reload_ms": 0.7, "activation_mib": 600.0, "offloadable_mib": 500.0},
    ],
    "devices": [{"memory_limit_mib": 20000.0, "static_mib": 12000.0},
                {"memory_limit_mib": None, "static_mib": 11000.0}],
}
FIXED_KEY = "8cd8f2aa298a1d46497c39c63a3d38426dfeb32c11d8d5c512349d809087782f"


def messages(doc: dict) -> list[str]:
    with pytest.raises(ValidationError) as info:
        Problem.model_validate(doc)
    return error_messages(info.value)


def doc_with(change) -> dict:
    doc = copy.deepcopy(FIXED)
    change(doc)
    return doc


# -- bad inputs: each message names the field and the reason ------------------------------------------
BAD = {
    "negative duration": (lambda d: d["stages"][0].update(forward_ms=-1.0), "stages.0.forward_ms", ">= 0"),
    "zero forward": (lambda d: d["stages"][1].update(forward_ms=0), "stages.1.forward_ms", "> 0"),
    "NaN duration": (lambda d: d["stages"][1].update(backward_weight_ms=math.nan),
                     "stages.1.backward_weight_ms", "finite"),
    "infinite memory": (lambda d: d["stages"][0].update(activation_mib=math.inf),
                        "stages.0.activation_mib", "finite"),
    "negative p2p": (lambda d: d.update(p2p_ms=-0.1), "p2p_ms", ">= 0"),
    "negative limit": (lambda d: d["devices"][1].update(memory_limit_mib=-5), "devices.1.memory_limit_mib",
                       ">= 0"),
    "stage on a missing device": (lambda d: d["stages"][1].update(device=7), "stages[1].device", "only 2 devices"),
    "device with no stage": (lambda d: d["stages"][1].update(device=0), "device 1", "holds no stage"),
    "length mismatch": (lambda d: d["devices"].pop(), "devices has 1 entries", "num_devices is 2"),
    "uneven stages per device": (lambda d: d.update(num_devices=1, devices=d["devices"][:1]) or
                                 d["stages"].append(dict(d["stages"][0], device=0)), "", ""),
    "offloadable > activation": (lambda d: d["stages"][0].update(offloadable_mib=513.0),
                                 "offloadable_mib (513.0) exceeds activation_mib (512.0)", "stages.0"),
    "weight grad > activation": (lambda d: d["stages"][0].update(weight_grad_mib=600.0),
                                 "weight_grad_mib", "exceeds activation_mib"),
    "reload without offload": (lambda d: d["stages"][0].update(offload_ms=None, reload_ms=0.5),
                               "reload_ms", "offload_ms is missing"),
    "offload option without offload times": (
        lambda d: [s.update(offload_ms=0.0, reload_ms=0.0) for s in d["stages"]],
        "options.offload", "no stage gives offload_ms"),
    "unknown field": (lambda d: d["stages"][0].update(forward=1.0), "stages.0.forward", "not permitted"),
    "unknown option": (lambda d: d["options"].update(zero_bubble=True), "options.zero_bubble", "not permitted"),
    "wrong format": (lambda d: d.update(format="pipeplan.problem/v2"), "format", "pipeplan.problem/v1"),
    "no microbatches": (lambda d: d.update(num_microbatches=0), "num_microbatches", "greater than or equal to 1"),
    "not a number": (lambda d: d.update(num_devices="two"), "num_devices", "valid integer"),
    "missing field": (lambda d: d["stages"][0].pop("forward_ms"), "stages.0.forward_ms", "Field required"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_problem_names_field_and_reason(name):
    change, field, reason = BAD[name]
    lines = messages(doc_with(change))
    text = "\n".join(lines)
    assert field in text and reason in text, text


def test_uneven_stages_message():
    doc = doc_with(lambda d: d["stages"].append(dict(d["stages"][0])))
    assert any("same number of stages" in line and "[2, 1]" in line for line in messages(doc))


def test_every_error_is_reported():
    doc = doc_with(lambda d: (d["stages"][0].update(forward_ms=-1), d["stages"][1].update(reload_ms=math.nan)))
    text = "\n".join(messages(doc))
    assert "stages.0.forward_ms" in text and "stages.1.reload_ms" in text


def test_limits_name_the_field():
    problem = Problem.model_validate(FIXED)
    problem.check_limits(Limits())
    cases = [
        (Limits(max_devices=1), "num_devices: 2 exceeds the limit 1"),
        (Limits(max_microbatches=3), "num_microbatches: 4 exceeds the limit 3"),
        (Limits(max_ops=10), "exceeds the limit 10"),
        (Limits(max_duration_ms=1.0), "stages[0].backward_input_ms exceeds the limit 1.0"),
        (Limits(max_memory_mib=15000.0), "devices[0].memory_limit_mib exceeds the limit 15000.0"),
    ]
    for limits, expected in cases:
        with pytest.raises(ValueError, match=r".*") as info:
            problem.check_limits(limits)
        assert expected in str(info.value)


# -- normalization and the canonical key --------------------------------------------------------------
def test_defaults_filled():
    problem = Problem.model_validate(FIXED)
    s0, s1 = problem.stages
    assert s0.recompute_ms == 1.0 and s0.reload_ms == 0.6 and s0.offloadable_mib == 512.0
    assert s1.reload_ms == 0.7 and s1.offloadable_mib == 500.0 and s1.weight_grad_mib == 0.0
    assert s1.checkpoint_mib == 0.0


FIXED_CANONICAL = (
    '{"devices":[{"memory_limit_mib":20000.0,"static_mib":12000.0},{"memory_limit_mib":null,"static_mib":11000.0}],'
    '"format":"pipeplan.problem/v1","metadata":{},"num_devices":2.0,"num_microbatches":4.0,'
    '"options":{"offload":true,"recompute":false,"split_backward":true},"p2p_ms":0.05,"stages":['
    '{"activation_mib":512.0,"backward_input_ms":1.1,"backward_weight_ms":0.9,"checkpoint_mib":16.0,"device":0.0,'
    '"forward_ms":1.0,"offload_ms":0.6,"offloadable_mib":512.0,"recompute_ms":1.0,"reload_ms":0.6,'
    '"weight_grad_mib":128.0},'
    '{"activation_mib":600.0,"backward_input_ms":1.3,"backward_weight_ms":1.0,"checkpoint_mib":0.0,"device":1.0,'
    '"forward_ms":1.2,"offload_ms":0.6,"offloadable_mib":500.0,"recompute_ms":1.2,"reload_ms":0.7,'
    '"weight_grad_mib":0.0}]}'
)


def test_pinned_key():
    """The key of a fixed problem never changes: not across machines, versions or refactors."""
    problem = Problem.model_validate(FIXED)
    assert problem.canonical_json() == FIXED_CANONICAL
    assert hashlib.sha256(FIXED_CANONICAL.encode()).hexdigest() == FIXED_KEY
    assert problem.key() == FIXED_KEY


def test_canonical_json_is_compact_sorted_floats():
    text = Problem.model_validate(FIXED).canonical_json()
    assert " " not in text and "\n" not in text
    doc = json.loads(text)
    assert list(doc) == sorted(doc)
    assert doc["num_devices"] == 2.0 and isinstance(doc["num_devices"], float)
    assert '"num_devices":2.0' in text and '"device":0.0' in text


def _respelled() -> dict:
    """FIXED with integers for floats, reversed key order and every default spelled out."""
    doc = copy.deepcopy(FIXED)
    for s in doc["stages"]:
        s.setdefault("reload_ms", s["offload_ms"])
        s.setdefault("offloadable_mib", s["activation_mib"])
        s.setdefault("weight_grad_mib", 0)
        s.setdefault("checkpoint_mib", 0)
        s.setdefault("recompute_ms", s["forward_ms"])
    doc["stages"][0]["activation_mib"] = 512
    doc["stages"][0]["forward_ms"] = 1
    doc["devices"][0]["memory_limit_mib"] = 20000
    doc["num_devices"], doc["num_microbatches"], doc["stages"][1]["device"] = 2.0, 4.0, 1.0  # ints as floats
    doc["metadata"] = {}
    reverse = lambda d: {k: reverse(v) if isinstance(v, dict) else v for k, v in reversed(list(d.items()))}
    doc["stages"] = [reverse(s) for s in doc["stages"]]
    return reverse(doc)


def test_key_stable_across_spellings():
    respelled = _respelled()
    assert json.dumps(respelled) != json.dumps(FIXED)
    assert Problem.model_validate(respelled).key() == FIXED_KEY
    # and across a JSON round trip of its own canonical form
    again = Problem.model_validate_json(Problem.model_validate(respelled).canonical_json())
    assert again.key() == FIXED_KEY


def test_key_changes_with_meaning():
    keys = {Problem.model_validate(FIXED).key()}
    for change in (lambda d: d.update(num_microbatches=5),
                   lambda d: d["stages"][0].update(forward_ms=1.0000001),
                   lambda d: d["options"].update(recompute=True),
                   lambda d: d["devices"][1].update(memory_limit_mib=30000.0),
                   lambda d: d.update(metadata={"model": "x"})):
        keys.add(Problem.model_validate(doc_with(change)).key())
    assert len(keys) == 6


def test_plan_model_rejects_unknown_kind():
    with pytest.raises(ValidationError) as info:
        Plan.model_validate({"problem_key": "k", "makespan_ms": 1, "lower_bound_ms": 1, "bubble_ratio": 0,
                             "peak_memory_mib": [0], "method": "m",
                             "devices": [{"device": 0, "ops": [{"kind": "X", "stage": 0, "mb": 0,
                                                                 "start_ms": 0, "end_ms": 1}]}]})
    assert any(line.startswith("devices.0.ops.0.kind") for line in error_messages(info.value))
