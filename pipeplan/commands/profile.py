"""`pipeplan profile`: per-layer F, B, W times and activation bytes of a torch model -> a spec.

The model comes from a factory, `module:function`, returning (layers, example_input): layers as
[(type, nn.Module)] in model order (types as in a spec's stack: embedding, dense, moe, mamba,
attention, mlp, lm_head, mtp_head), example_input one microbatch for the first layer. The base spec
gives hardware, training and the model's shape; its `stack` is replaced by the profiled one.
Needs the `torch` extra. Exit codes: 0 success, 2 bad input.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Annotated

import typer

from pipeplan.io import bad_input, read_json, write_json


def profile_cmd(
    factory: Annotated[str, typer.Argument(metavar="MODULE:FUNCTION",
                                           help="Returns ([(type, module), ...], example_input).")],
    base: Annotated[Path, typer.Option(help="Spec whose hardware/training/model shape to keep.")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write here instead of stdout.")] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")] = "cpu",
    repeats: Annotated[int, typer.Option(help="Timed runs per layer (median).", min=1, max=1000)] = 5,
    as_problem: Annotated[bool, typer.Option("--problem", help="Write the problem v1 instead of the spec.")] = False,
) -> None:
    """Measure each layer's F, B, W and activations here.

    Writes a spec whose model is the profiled stack."""
    try:
        import torch

        from pipeplan.client.profiler import profile_stack
    except ModuleNotFoundError:
        bad_input("pipeplan profile needs torch: pip install -e '.[torch]'")
    from pydantic import ValidationError

    from pipeplan.planner.documents import problem_from_spec
    from pipeplan.planner.spec import Spec

    if ":" not in factory:
        bad_input(f"MODULE:FUNCTION: expected e.g. mymodels.small:layers, got {factory!r}")
    module_name, function = factory.split(":", 1)
    try:
        build = getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError) as exc:
        bad_input(f"MODULE:FUNCTION: cannot load {factory}: {exc}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        bad_input(f"--device: {device} requested but CUDA is not available here")
    target = torch.device(device)
    layers, example = build()
    layers = [(kind, module.to(target)) for kind, module in layers]
    groups = profile_stack(layers, example.to(target), repeats=repeats)
    doc = read_json(base)
    doc.setdefault("model", {})["stack"] = groups
    doc["model"].pop("layers", None)
    doc["model"].pop("pattern", None)
    if isinstance(doc.get("partition"), list):
        doc["partition"] = "balanced"
    try:
        spec = Spec.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        bad_input(f"{base}: the profiled spec is invalid: {'.'.join(map(str, first['loc']))}: {first['msg']}")
    write_json(problem_from_spec(spec) if as_problem else spec, out)
    if out is not None:
        typer.echo(f"wrote {out}: {len(groups)} layers profiled on {target}", err=True)


def register(app: typer.Typer) -> None:
    app.command("profile")(profile_cmd)
