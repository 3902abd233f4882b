"""`pipeplan spec --from-hf config.json`: a spec document from a Hugging Face model configuration.

    pipeplan spec --from-hf Meta-Llama-3-8B/config.json --devices 8 --microbatches 32 --out spec.json
    pipeplan spec --from-hf config.json --devices 64 --tp 8 --microbatches 64 --precision fp8

The spec is written with its model fields spelled out (not the config), so what the mapping chose can
be read and edited; its notes (what the spec cannot express exactly) go to stderr. Exit codes: 0
success, 2 bad input (the message names the key or the option).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from pipeplan.io import bad_input, read_json, write_json

Positive = dict(min=1)


def _name_from_path(path: Path) -> str:
    """Hub downloads sit in a folder named after the model (Meta-Llama-3-8B/config.json)."""
    folder = path.resolve().parent.name
    return folder if path.name == "config.json" and folder else path.stem


def spec_cmd(
    from_hf: Annotated[Path, typer.Option("--from-hf", metavar="CONFIG.json", help=(
        "A Hugging Face config.json (or the folder holding it): Llama, Mistral, Mixtral, Qwen2/3 (and MoE),"
        " Gemma 1-3, DeepSeek-V2/V3, Phi-3, OLMo 2, Nemotron-H."))],
    devices: Annotated[int, typer.Option("--devices", help="GPUs in all; the pipeline gets what tp x cp leave,"
                                         " unless --pp says", **Positive)],
    microbatches: Annotated[int, typer.Option("--microbatches", help="microbatches per iteration", **Positive)],
    hardware: Annotated[str, typer.Option("--hardware", help="GPU preset: A100-40GB, A100-80GB, H100-80GB,"
                                          " H200-141GB")] = "H100-80GB",
    tp: Annotated[int, typer.Option("--tp", help="tensor parallel degree", **Positive)] = 1,
    cp: Annotated[int, typer.Option("--cp", help="context parallel degree", **Positive)] = 1,
    ep: Annotated[int, typer.Option("--ep", help="expert parallel degree", **Positive)] = 1,
    etp: Annotated[int | None, typer.Option("--etp", help="expert tensor parallel degree (default: tp)",
                                            **Positive)] = None,
    pp: Annotated[int | None, typer.Option("--pp", help="pipeline degree (default: devices / (tp x cp));"
                                           " data parallelism takes the rest", **Positive)] = None,
    precision: Annotated[Literal["bf16", "fp8"] | None, typer.Option(
        "--precision", help="selects the calibrated estimate (fp8: FP8 linear layers)")] = None,
    cluster: Annotated[str | None, typer.Option("--cluster", help="node preset: DGX-A100, DGX-H100,"
                                                " DGX-H200 (default: the GPU's)")] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="training sequence length (default 4096,"
                                                " capped at the config's max_position_embeddings)",
                                                **Positive)] = None,
    micro_batch_size: Annotated[int | None, typer.Option("--micro-batch-size", help="sequences per"
                                                         " microbatch (default 1)", **Positive)] = None,
    name: Annotated[str | None, typer.Option("--name", help="model name (default: the config's _name_or_path,"
                                             " else its folder)")] = None,
    placement: Annotated[Literal["loop", "v"] | None, typer.Option(
        "--placement", help="stage placement (default loop; `pipeplan plan` compares both)")] = None,
    chunks: Annotated[int | None, typer.Option("--chunks", help="stages per device (V: 2)", **Positive)] = None,
    partition: Annotated[Literal["balanced", "uniform", "auto"], typer.Option(
        "--partition", help="stage split strategy (a list of layers per stage goes in the spec file)")] = "balanced",
    memory_budget_gib: Annotated[float | None, typer.Option(
        "--memory-budget-gib", help="per-GPU limit (default: the GPU's memory)")] = None,
    recompute: Annotated[bool, typer.Option("--recompute", help="let plans recompute activations")] = False,
    offload: Annotated[bool, typer.Option("--offload", help="let plans offload activations to host")] = False,
    backward_frees: Annotated[Literal["at_b", "at_w"] | None, typer.Option(
        "--backward-frees", help="at_w for torch's PipelineStage (pipeplan's runtime, torch, torchtitan):"
        " a split backward frees activations at W, not B (default at_b, as Zero Bubble)")] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write here instead of stdout.")] = None,
) -> None:
    """Write a model spec from a Hugging Face config.json.

    The model comes from the config (docs/costmodel.md says how each key maps); the layout from the
    options: --devices GPUs, split into tensor (--tp), context (--cp) and pipeline (--pp) parallel
    groups, data parallel over what is left."""
    from pydantic import ValidationError

    from pipeplan.planner.contract import error_messages
    from pipeplan.planner.costmodel import layer_costs
    from pipeplan.planner.hf import HfConfigError, model_type_of, spec_document
    from pipeplan.planner.spec import Spec, check_spec_size
    from pipeplan.settings import get_settings

    path = from_hf / "config.json" if from_hf.is_dir() else from_hf
    config = read_json(path)
    try:  # a config asking for a billion layers is refused before any list of them is built
        check_spec_size({"hf_config": config}, get_settings().limits)
    except ValueError as exc:
        bad_input(f"{path}: {exc}")
    given = {"name": name, "seq_len": seq_len, "micro_batch_size": micro_batch_size}
    model = {k: v for k, v in given.items() if v is not None}
    if name is None and not (isinstance(config, dict) and config.get("_name_or_path")):
        model["name"] = _name_from_path(path)
    chosen = (("placement", placement), ("chunks", chunks), ("memory_budget_gib", memory_budget_gib),
              ("backward_frees", backward_frees))
    training = {k: v for k, v in chosen if v is not None}
    training.update({k: True for k, v in (("recompute", recompute), ("offload", offload)) if v})
    try:
        doc, notes = spec_document(config, gpus=devices, microbatches=microbatches, hardware=hardware,
                                   tp=tp, cp=cp, ep=ep, etp=etp, pp=pp, precision=precision, cluster=cluster,
                                   model=model, training=training, partition=partition)
    except HfConfigError as exc:
        bad_input(f"{path}: {exc}")
    except ValueError as exc:  # the GPUs do not split: name the option ("gpus" is --devices)
        bad_input(f"--{str(exc).replace('gpus:', 'devices:', 1)}")
    try:
        spec = Spec.model_validate(doc)
    except ValidationError as exc:
        bad_input(f"{path}: the spec it gives is not valid: " + "; ".join(error_messages(exc)))
    costs = layer_costs(spec)
    mtp = [c.params for c in costs if c.type == "mtp_head"]
    params = sum(c.params for c in costs) - sum(mtp) - (costs[0].params if spec.model.tie_embeddings else 0.0)
    write_json(doc, out)
    par = spec.parallel_or_default
    layout = (f"tp {par.tp} x cp {par.cp} x pp {spec.training.devices} x dp {par.dp_of(spec.training.devices)}"
              + (f", ep {par.ep}" if par.ep > 1 else ""))
    where = f"wrote {out}" if out is not None else "spec"
    blocks = sum(c.type not in ("embedding", "lm_head", "mtp_head") for c in costs)
    heads = f" (+ {len(mtp)} MTP head(s), {sum(mtp) / 1e9:.2f} B)" if mtp else ""
    typer.echo(f"{where}: {spec.model.name} ({model_type_of(config)}), {blocks} blocks, {params / 1e9:.2f} B"
               f" parameters{heads}, seq_len {spec.model.seq_len}; {devices} GPUs ({layout}), {microbatches}"
               " microbatches", err=True)
    for note in notes:
        typer.echo(f"note: {note}", err=True)


def register(app: typer.Typer) -> None:
    app.command("spec")(spec_cmd)


__all__ = ["register"]
