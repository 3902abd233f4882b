"""`pipeplan configure`: choose the parallel layout, the microbatching and the schedule of a whole run.

    pipeplan configure SPEC --gpus 64 --gpus-per-node 8 --global-batch 256 --top 10 --out configs.json

The spec gives the model, hardware, precision, sequence and framework settings; its layout fields
(parallel degrees, training.devices / microbatches / placement / chunks, micro-batch size) are what
the search replaces (docs/configure.md). Progress goes to stderr as candidates are scored, the ranked
table to stdout; --out writes the configurations document (docs/formats.md) and, beside it, the best
configuration's spec (`<stem>.best.spec.json`) and plan (`<stem>.best.plan.json`).
Exit codes: 0 success, 2 bad input or an impossible request (the message names the field and the
nearest valid global batch, or the least memory per GPU).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from pipeplan.io import bad_input, infeasible, read_json, write_json
from pipeplan.settings import get_settings

GIB = 1024.0


def _progress(started: float):
    def report(event: dict[str, Any]) -> None:
        t = f"[{time.monotonic() - started:7.2f}s]"
        kind = event["event"]
        if kind == "space":
            typer.echo(f"{t} {event['layouts']} layouts", err=True)
        elif kind == "bounded":
            typer.echo(f"{t} {event['fitting']} may fit in memory, {event['out_of_memory']} cannot", err=True)
        elif kind == "scored":
            typer.echo(f"{t} #{event['index']} {event['candidate']}: {event['tokens_per_s_per_gpu']:,.0f} tok/s/GPU"
                       f" (rank {event['rank']}; best {event['best']}, {event['best_tokens_per_s_per_gpu']:,.0f})",
                       err=True)
        elif kind == "refined":
            said = "improved" if event["improved"] else "no shorter iteration"
            typer.echo(f"{t} solved {event['candidate']}: {event['tokens_per_s_per_gpu']:,.0f} tok/s/GPU"
                       f" ({said}; {event['method']})", err=True)
        elif kind == "done":
            typer.echo(f"{t} done: {event['scheduled']} scheduled; best {event['best']},"
                       f" {event['tokens_per_s_per_gpu']:,.0f} tok/s/GPU", err=True)
    return report


def table(doc: dict[str, Any]) -> str:
    """The ranked candidates as a Markdown table, then why the other layout families lost."""
    lines = [("| # | layout | tok/s/GPU | MFU | iteration ms | bound ms | peak GiB | bubble | TP ms | EP ms | CP ms"
              " | DP tail ms | schedule |"),
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in doc["candidates"]:
        b = c["breakdown"]
        lines.append(f"| {c['rank']} | {c['name']} | {c['tokens_per_s_per_gpu']:,.0f} | {c['mfu']:.1%} |"
                     f" {c['iteration_ms']:,.1f} | {c['lower_bound_ms']:,.1f} | {c['peak_memory_mib'] / GIB:.1f} |"
                     f" {c['bubble_ratio']:.1%} | {b['tp_ms']:,.0f} | {b['ep_ms']:,.0f} | {b['cp_ms']:,.0f} |"
                     f" {b.get('tail_ms', 0.0):,.0f} | {c['method']} |")
    stats = doc["stats"]
    lines.append("")
    lines.append(f"{stats['layouts']} layouts: {stats['scheduled']} scheduled, {stats['bounded']} cut by their bound,"
                 f" {stats['out_of_memory']} out of memory; {stats['elapsed_s']:.1f} s"
                 + ("" if stats["complete"] else " (stopped by the budget of scheduled layouts)"))
    if doc["rejected_families"]:
        lines.append("")
        lines.append("Layout families not in the ranking:")
        for f in doc["rejected_families"]:
            lines.append(f"- {f['family']}: {f['why']} (best of the family: {f['best']})")
    return "\n".join(lines)


def configure_cmd(
    spec_path: Annotated[Path, typer.Argument(metavar="SPEC", help="A model spec (its layout is replaced).")],
    gpus: Annotated[int, typer.Option("--gpus", min=1, help="GPUs of the job.")],
    global_batch: Annotated[int, typer.Option("--global-batch", min=1, help="Sequences per iteration.")],
    gpus_per_node: Annotated[int | None, typer.Option(
        "--gpus-per-node", min=1, help="Default: the spec's cluster (8 on DGX nodes).")] = None,
    top: Annotated[int, typer.Option("--top", min=1, max=1000, help="Candidates ranked and reported.")] = 10,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the configurations document here.")] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", min=1, help="Tokens per sequence (default: the spec's).")
                       ] = None,
    max_tp: Annotated[int | None, typer.Option("--max-tp", min=1, help="Largest tensor-parallel degree.")] = None,
    max_cp: Annotated[int, typer.Option("--max-cp", min=1, help="Largest context-parallel degree.")] = 8,
    pp: Annotated[int | None, typer.Option("--pp", min=1, help="Fix the pipeline-parallel degree.")] = None,
    micro_batch_sizes: Annotated[str, typer.Option(
        "--micro-batch-sizes", help="Comma-separated sizes to try.")] = "1,2,4",
    precisions: Annotated[str | None, typer.Option(
        "--precisions", help="Comma-separated: bf16, fp8 (default: the spec's).")] = None,
    headroom_gib: Annotated[float, typer.Option("--headroom-gib", min=0.0, help="Memory kept free per GPU.")] = 0.0,
    offload: Annotated[bool | None, typer.Option("--offload/--no-offload", help="Schedules may offload.")] = None,
    recompute: Annotated[bool | None, typer.Option("--recompute/--no-recompute", help="Schedules may recompute.")
                         ] = None,
    max_scheduled: Annotated[int, typer.Option(
        "--max-scheduled", min=1, help="Most layouts given a plan (the bound usually stops sooner).")] = 200,
    refine_s: Annotated[float, typer.Option(
        "--refine-s", min=0.0, help="Then solve each ranked candidate this long with the solver (0: no).")] = 0.0,
    refine_top: Annotated[int, typer.Option("--refine-top", min=1, help="How many ranked candidates to solve.")] = 5,
) -> None:
    """Rank the layouts of a model on a cluster by predicted speed."""
    from pydantic import ValidationError

    from pipeplan.planner.configure import ConfigureError, configure, refine
    from pipeplan.planner.configure_space import ConfigureRequest
    from pipeplan.planner.contract import error_messages
    from pipeplan.planner.spec import check_spec_size, spec_from_document

    doc = read_json(spec_path)
    if not isinstance(doc, dict) or "stages" in doc:
        bad_input(f"{spec_path}: expected a model spec (the search builds the problems)")
    try:
        check_spec_size(doc, get_settings().limits)
        spec = spec_from_document(doc)
        sizes = [int(x) for x in micro_batch_sizes.split(",") if x.strip()]
        request = ConfigureRequest(
            gpus=gpus, gpus_per_node=gpus_per_node, global_batch=global_batch, seq_len=seq_len, max_tp=max_tp,
            max_cp=max_cp, pp=pp, micro_batch_sizes=sizes, top=top, memory_headroom_gib=headroom_gib,
            precisions=[p.strip() for p in precisions.split(",")] if precisions else None,
            offload=offload, recompute=recompute)
    except (ValidationError, ValueError) as exc:
        bad_input(f"{spec_path}: " + "; ".join(error_messages(exc)))
    started = time.monotonic()
    try:
        result = configure(spec, request, on_progress=_progress(started), limits=get_settings().limits,
                           max_scheduled=max_scheduled)
    except ConfigureError as exc:
        infeasible(str(exc))
    if refine_s > 0:
        refine(result, refine_s, refine_top, on_progress=_progress(started))
    doc = result.to_document()
    typer.echo(table(doc))
    if out is not None:
        write_json(doc, out)
        stem = out.with_suffix("")
        write_json(result.best.spec, stem.with_name(stem.name + ".best.spec.json"))
        write_json(result.best.plan, stem.with_name(stem.name + ".best.plan.json"))
        typer.echo(f"wrote {out}, {stem.name}.best.spec.json and {stem.name}.best.plan.json", err=True)


def register(app: typer.Typer) -> None:
    app.command("configure")(configure_cmd)


__all__ = ["register", "table"]
