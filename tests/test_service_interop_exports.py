"""The service offers the stack exports beside torch.csv, against a real `pipeplan serve` process:
runtimes.json, torchtitan.args and megatron.args of a plan made from a spec, torch.csv as torch's
stock runtime runs it, and a 409 naming the memory when a plan needs its offloads."""

from __future__ import annotations

import httpx
import pytest
from core_schedules import problem_doc
from pipeplan.client.api import PlanClient
from pipeplan.client.errors import PlanRequestError
from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.exports import torch_schedule
from pipeplan.planner.megatron_args import megatron_export
from pipeplan.planner.torchtitan_args import torchtitan_export
from service_support import start_server

pytestmark = pytest.mark.integration

SPEC = {"model": {"name": "interop", "layers": 6, "hidden": 256, "heads": 8, "vocab": 1024, "seq_len": 512},
        "hardware": "H100-80GB", "partition": "uniform",
        "training": {"devices": 2, "chunks": 2, "microbatches": 4}}


@pytest.fixture
def server(tmp_path):
    proc, base = start_server(tmp_path, data_dir=tmp_path, embedded_workers=0)
    yield base
    proc.stop()


def _stored(base: str, key: str) -> tuple[Problem, Plan]:
    problem = Problem.model_validate_json(httpx.get(f"{base}/v1/plans/{key}/problem", timeout=30).text)
    return problem, Plan.model_validate_json(httpx.get(f"{base}/v1/plans/{key}/revisions/1", timeout=30).text)


def test_stack_exports_of_a_spec_plan(server):
    base = server
    body = httpx.post(f"{base}/v1/plans", json={"spec": SPEC}, timeout=60).json()
    key = body["problem_key"]
    problem, plan = _stored(base, key)
    url = f"{base}/v1/plans/{key}/export"
    runtimes = httpx.get(f"{url}/runtimes.json?revision=1", timeout=30).json()
    assert [r["runtime"] for r in runtimes["runtimes"]] == ["pipeplan", "torch", "torchtitan", "megatron"]
    assert runtimes["runtimes"][2]["runs"]
    csv = httpx.get(f"{url}/torch.csv?revision=1", timeout=30).text
    assert csv == torch_schedule(problem, plan).csv(problem)
    args = httpx.get(f"{url}/torchtitan.args?revision=1", timeout=30)
    assert args.status_code == 200
    assert args.text == torchtitan_export(problem, plan, "schedule.csv").args_text()
    megatron = httpx.get(f"{url}/megatron.args?revision=1", timeout=30).text
    assert megatron.splitlines() == megatron_export(problem, plan).lines()
    with PlanClient(base) as client:
        assert client.export(key, "megatron.args", revision=1) == megatron


def test_a_plan_that_needs_its_offloads_is_409_for_torch_and_says_so(server):
    """V placement, 100 MiB per stage and microbatch, 80 of it offloadable, 150 MiB per device: a
    device's two stages hold 200 MiB without offload, so every plan offloads and no compute order
    alone fits."""
    base = server
    doc = problem_doc(p=2, m=3, chunks=2, placement="v", offload=True, limit=150.0)
    key = httpx.post(f"{base}/v1/plans", json={"problem": doc}, timeout=60).json()["problem_key"]
    _, plan = _stored(base, key)
    assert any(p.kind == "OFFLOAD" for d in plan.devices for p in d.ops)
    refused = httpx.get(f"{base}/v1/plans/{key}/export/torch.csv", timeout=30)
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"] == "not_exportable" and "would need" in refused.json()["message"]
    runtimes = httpx.get(f"{base}/v1/plans/{key}/export/runtimes.json", timeout=30).json()
    runs = [(r["runtime"], r["runs"]) for r in runtimes["runtimes"]]
    assert runs[:2] == [("pipeplan", True), ("torch", False)]
    refused = httpx.get(f"{base}/v1/plans/{key}/export/megatron.args", timeout=30)
    assert refused.status_code == 409 and "loop placement" in refused.json()["message"]
    with PlanClient(base) as client, pytest.raises(PlanRequestError) as caught:
        client.torch_csv(key)
    assert caught.value.status == 409
    refused = httpx.get(f"{base}/v1/plans/{key}/export/torchtitan.args", timeout=30)
    assert refused.status_code == 409 and "metadata.partition" in refused.json()["message"]
