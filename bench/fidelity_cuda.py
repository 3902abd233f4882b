"""`bench/fidelity.py --cuda`: one Llama-like stage on one GPU, measured against its prediction.

Run:  python bench/fidelity.py --cuda --iterations 5 --json fidelity_cuda.json      (one H100: ~1-2 min)
      python bench/fidelity.py --cuda --device cpu --width 256 --seq 256 --blocks 2 --iterations 2
                                                  (the same path at a tiny width on CPU: CPU figures)

1. Profile: `--blocks` Llama-like blocks (bench/llama_stage.py: width `--width`, sequence `--seq`,
   bf16 on CUDA, flash attention through torch's SDPA) through `client.profiler.profile_stack`, the
   library function of `pipeplan profile`: F, B, W and saved activations per block.
2. Predict: a pipeline of `--devices` such stages and `--microbatches` microbatches; copies and links
   timed with the `--hardware` preset (planner.spec.HARDWARE: host link, inter-stage link), each
   device limited halfway between the least memory any plan needs and 1F1B's peak, offload allowed
   (recompute not), solved by CP-SAT. Where the solver's plan offloads nothing (a copy outlasting a
   microbatch's compute, as at width 4096 on an H100 or H200 at 50 GB/s, it throttles instead) the
   copies are measured on the fastest offloading baseline that fits the same limit (PipeOffload's),
   and the solver's plan runs too. The rank with the most offloads (not rank 0 on ties) runs its
   part alone, its neighbours emulated (client.emulated_neighbours: receives arrive when planned),
   for `--iterations` traced iterations after one warm-up; then the same plan with synchronous
   copies; then ZB-H1 (no offload) on the same rank.
3. Compare: per op kind, measured (median) vs planned duration (on CUDA also the whole stage's B
   and W alone, queued behind the pass before and started on an idle GPU); the rank's iteration
   with copy lanes and with synchronous copies vs `predicted_rank_end` of each, and their difference (the
   overlap the copies buy); the peak memory (CUDA: the caching allocator's high-water mark above
   what the iteration started with; CPU: the saved-tensor bytes the executor holds) vs the plan's
   predicted peak and vs that peak with activations held until W and the profiled output gradients
   beside them, as torch's split backward holds them (planner.runtimes.torch_peaks), with offload
   and without. Weight gradients are zeroed, not freed, between iterations: static memory
   (Device.static_mib), which a plan's peak is above. On CUDA also what B leaves for W for one
   microbatch (the allocator's growth across B, against the profile's output_grad_mib) and B's and
   W's working memory beyond it, which no plan counts.
4. Presets: achieved TFLOP/s of F, B and W (bench/llama_stage.py's FLOPs over the profiled times;
   the profile times torch's split backward's own two passes) and of F and B+W in the run,
   beside the preset's calibrated rate (peak x bf16_efficiency), and the host link's GB/s each way
   (pinned buffers, copies on their own stream while matrix products run on the compute stream)
   beside the preset's host_link_gbps.

Prints one Markdown table (section | quantity | predicted or preset | measured | measured/predicted)
headed by the device and the shapes; `--json PATH` writes the same rows and the details beside it.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from llama_stage import block_flops, make_stage, weight_grad_bytes
from pipeplan.client.emulated_neighbours import one_rank_schedule, predicted_rank_end, single_process_group
from pipeplan.client.profiler import profile_stack
from pipeplan.planner.baselines import run_baseline
from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.runtimes import torch_peaks
from pipeplan.planner.spec import HARDWARE, Hardware
from pipeplan.planner.trace import DeviceTrace

from bench.fidelity import limited

MIB = float(1 << 20)
KINDS = ("F", "B", "W", "OFFLOAD", "RELOAD")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/fidelity.py --cuda", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (cpu: the same path, CPU figures)")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--devices", type=int, default=4, help="pipeline devices the plan is made for")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--iterations", type=int, default=3, help="traced iterations per run, after one warm-up")
    p.add_argument("--repeats", type=int, default=3, help="profiled runs per block (median)")
    p.add_argument("--solve-s", type=float, default=10.0)
    p.add_argument("--limit-fraction", type=float, default=0.5,
                   help="memory limit: this far from the least feasible memory to 1F1B's peak")
    p.add_argument("--hardware", choices=sorted(HARDWARE), default=None,
                   help="the preset the plan is timed with (default: the one named after the GPU;"
                        " H100-80GB on CPU)")
    p.add_argument("--rank", type=int, default=None,
                   help="the rank to run (default: the one offloading most)")
    p.add_argument("--link-mib", type=int, default=None,
                   help="bytes per host-link measurement, MiB (default: 1024 on CUDA, 64 on CPU)")
    p.add_argument("--json", type=Path, default=None, help="write the rows and details here")
    return p.parse_args(argv)


# -- 1. profile ---------------------------------------------------------------------------------------
def profile(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> tuple[list, list[dict]]:
    blocks = make_stage(args.width, args.blocks, dtype, device)
    example = torch.randn(1, args.seq, args.width, device=device, dtype=dtype)
    groups = profile_stack([("dense", b) for b in blocks], example, repeats=args.repeats)
    return blocks, groups


# -- 2. predict ---------------------------------------------------------------------------------------
def stage_problem(args: argparse.Namespace, groups: list[dict], hw: Hardware, element_size: int) -> Problem:
    """`--devices` stages, each the profiled blocks; copies and links timed with the preset."""
    act_mib = sum(g["activation_mib"] for g in groups)
    boundary = args.seq * args.width * element_size
    wg_mib = min(args.blocks * weight_grad_bytes(args.width, args.seq, element_size) / MIB, act_mib)
    copy_ms = act_mib * MIB / (hw.host_link_gbps * 1e6)
    stage = {"forward_ms": sum(g["forward_ms"] for g in groups),
             "backward_input_ms": sum(g["backward_input_ms"] for g in groups),
             "backward_weight_ms": sum(g["backward_weight_ms"] for g in groups),
             "offload_ms": copy_ms, "activation_mib": act_mib, "weight_grad_mib": wg_mib,
             "checkpoint_mib": min(boundary / MIB, act_mib)}
    return Problem.model_validate({
        "num_devices": args.devices, "num_microbatches": args.microbatches,
        "p2p_ms": boundary / (hw.link_gbps * 1e6) + hw.link_latency_us / 1000.0,
        "options": {"split_backward": True, "offload": True, "recompute": False},
        "stages": [{**stage, "device": d} for d in range(args.devices)],
        "devices": [{"memory_limit_mib": None} for _ in range(args.devices)],
        "metadata": {"bench": "fidelity --cuda", "width": args.width, "blocks": args.blocks,
                     "seq": args.seq}})


def with_stage_fields(problem: Problem, **fields: float | None) -> Problem:
    """`problem` with `fields` set on every stage (the stages are identical), validated again."""
    doc = problem.model_dump(mode="json")
    for stage in doc["stages"]:
        stage.update(fields)
    return Problem.model_validate(doc)


def plans(problem: Problem, seconds: float) -> tuple[Plan, Plan, int]:
    """The solver's plan; the plan whose copies are measured (the solver's when it offloads, else the
    fastest offloading baseline that fits: where a copy takes longer than a microbatch's compute the
    solver rightly throttles instead, and the copy lanes would go unmeasured); and the rank to run:
    the one offloading most, a rank other than 0 on ties (torch runs rank 0's whole backward in W,
    so its B measures nothing and its op times say less)."""
    from pipeplan.planner.solver import solve

    solved = solve(problem, seconds, workers=4, seed=0).plan
    offloading = solved if _offloads(solved) else min(
        (p for name in ("pipeoffload", "adaoffload") if (p := _fitting(problem, name)) and _offloads(p)),
        key=lambda p: p.makespan_ms, default=solved)
    counts = _offloads(offloading) or [0] * problem.num_devices
    return solved, offloading, max(range(problem.num_devices), key=lambda d: (counts[d], d != 0, -d))


def _offloads(plan: Plan) -> list[int]:
    """OFFLOAD ops per device ([] when there are none)."""
    counts = [sum(p.kind == "OFFLOAD" for p in d.ops) for d in sorted(plan.devices, key=lambda d: d.device)]
    return counts if any(counts) else []


def _fitting(problem: Problem, name: str) -> Plan | None:
    from pipeplan.planner.baselines import DoesNotFit, NotApplicable

    try:
        return run_baseline(problem, name)
    except (DoesNotFit, NotApplicable):
        return None


# -- 3. run -------------------------------------------------------------------------------------------
def run_rank(problem: Problem, plan: Plan, rank: int, blocks: list, example: torch.Tensor, iterations: int,
             *, synchronous: bool = False) -> tuple[list[DeviceTrace], list[float], list[str]]:
    """`iterations` traced iterations after one warm-up: the traces, the peak memory above each
    iteration's start (MiB), and what ran late."""
    cuda = example.is_cuda
    stage = torch.nn.Sequential(*blocks)
    traces, peaks = [], []
    run = one_rank_schedule(problem, plan, rank, {k: stage for k in problem.stages_of(rank)}, example,
                            synchronous_copies=synchronous)
    try:
        for n in range(iterations + 1):
            # zeroed, not freed: weight gradients are static memory (Device.static_mib), which a
            # plan's peak is above; the warm-up allocates them
            stage.zero_grad(set_to_none=False)
            if cuda:  # CUDA only: what the iteration starts with, after the previous one's frees
                torch.cuda.synchronize(example.device)
            base = torch.cuda.memory_allocated(example.device) / MIB if cuda else 0.0
            run.step()
            trace = run.schedule.local_trace()
            if n:
                traces.append(trace)
                peaks.append(trace.peak_memory_mib - base)
        return traces, peaks, list(run.schedule.executor.stats.late)
    finally:
        run.close()
        gc.collect()  # the next run starts from this one's memory returned
        if cuda:
            torch.cuda.empty_cache()


def with_op_times(problem: Problem, medians: dict[str, tuple[int, float]]) -> Problem:
    """The problem with the run's median op times in place of the profile's: what the rank's
    iteration comes to by the plan's own rules when its ops take what they took."""
    times = {"forward_ms": "F", "backward_input_ms": "B", "backward_weight_ms": "W", "offload_ms": "OFFLOAD",
             "reload_ms": "RELOAD"}
    return with_stage_fields(problem, **{field: medians[kind][1] for field, kind in times.items()
                                         if kind in medians})


def span(trace: DeviceTrace) -> float:
    """The rank's iteration: from the iteration's start to its last op's end (ms)."""
    return max(o.end_ms for o in trace.ops)


def op_medians(traces: list[DeviceTrace]) -> dict[str, tuple[int, float]]:
    """Per kind: ops per iteration and the median duration; "B+W": the median of B + W per microbatch
    (torch computes the first stage's whole backward in W, its input needing no gradient)."""
    out = {}
    for kind in KINDS:
        values = [o.end_ms - o.start_ms for t in traces for o in t.ops if o.kind == kind]
        if values:
            out[kind] = (len(values) // len(traces), statistics.median(values))
    pairs = [sum(o.end_ms - o.start_ms for o in t.ops if o.kind in ("B", "W") and o.mb == mb)
             for t in traces for mb in {o.mb for o in t.ops if o.kind == "W"}]
    if pairs:
        out["B+W"] = (len(pairs) // len(traces), statistics.median(pairs))
    return out


def stage_passes(blocks: list, example: torch.Tensor, repeats: int = 3
                 ) -> tuple[dict[str, float], dict[str, float]]:
    """CUDA: the whole stage's B and W alone (torch's split backward, the plan's op kinds).

    Times (median ms), each pass queued behind the one before (as the profile times them) and
    started on an idle GPU (as after a receive or a reload): torch walks the graph on the host before
    B's first kernel, which only the second shows. Memory (MiB, one microbatch, from the idle runs):
    what B and W allocate beyond the activations a plan counts, each pass's high-water mark above
    what it starts with, and what B leaves for W (the output gradients torch keeps for the weight
    gradients, beside the whole retained graph)."""
    from pipeplan.client.torch_internals import stage_backward_input, stage_backward_weight

    stage, device = torch.nn.Sequential(*blocks), example.device
    params = list(stage.parameters())
    samples: dict[str, list[float]] = {"B queued": [], "W queued": [], "B idle": [], "W idle": []}
    memory: dict[str, float] = {}
    for n in range(repeats + 1):
        for idle in (False, True):
            x = torch.randn_like(example).requires_grad_(True)
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            torch.cuda.synchronize(device)
            out = stage(x)
            if idle:
                torch.cuda.synchronize(device)
                before_b = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            marks[0].record()
            _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], iter(params))
            marks[1].record()
            if idle:
                torch.cuda.synchronize(device)
                b_peak = torch.cuda.max_memory_allocated(device)
                before_w = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            marks[2].record()
            stage_backward_weight(iter(params), groups)
            marks[3].record()
            torch.cuda.synchronize(device)
            if idle:
                memory = {"b_above_start": (b_peak - before_b) / MIB,
                          "w_above_start": (torch.cuda.max_memory_allocated(device) - before_w) / MIB,
                          "b_leaves": (before_w - before_b) / MIB}
            if n:
                how = "idle" if idle else "queued"
                samples[f"B {how}"].append(marks[0].elapsed_time(marks[1]))
                samples[f"W {how}"].append(marks[2].elapsed_time(marks[3]))
    return {name: statistics.median(values) for name, values in samples.items()}, memory


# -- 4. presets ---------------------------------------------------------------------------------------
def host_link_gbps(device: torch.device, mib: int, width: int, dtype: torch.dtype) -> dict[str, float]:
    """GB/s of a `mib` copy each way while matrix products run on the compute stream.

    CUDA: a pinned host buffer, the copy on its own stream, timed with events on it. CPU: a copy
    between two host buffers in a thread (what the CPU copy lanes do), timed with the wall clock."""
    n = mib << 20
    a = torch.randn(width, width, device=device, dtype=dtype)
    out: dict[str, float] = {}
    if device.type == "cuda":  # CUDA only: copy engines beside the SMs
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(n, dtype=torch.uint8, device=device)
        stream = torch.cuda.Stream(device)
        for name, (dst, src) in (("d2h", (host, dev)), ("h2d", (dev, host))):
            samples = []
            for _ in range(3):
                torch.cuda.synchronize(device)
                for _ in range(200):  # compute queued well past the copy's end
                    a = (a @ a) * (1.0 / math.sqrt(width))
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(stream):
                    start.record(stream)
                    dst.copy_(src, non_blocking=True)
                    end.record(stream)
                torch.cuda.synchronize(device)
                samples.append(n / (start.elapsed_time(end) * 1e6))
            out[name] = statistics.median(samples)
        return out
    src, dst = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    for name in ("d2h", "h2d"):
        samples = []
        for _ in range(3):
            took: list[float] = []

            def copy(took: list[float] = took) -> None:
                started = time.perf_counter()
                dst.copy_(src)
                took.append(time.perf_counter() - started)
            worker = threading.Thread(target=copy)
            worker.start()
            while worker.is_alive():
                a = (a @ a) * (1.0 / math.sqrt(width))
            worker.join()
            samples.append(n / took[0] / 1e9)
        out[name] = statistics.median(samples)
    return out


# -- the table ----------------------------------------------------------------------------------------
def row(section: str, quantity: str, predicted: float, measured: float) -> dict:
    ratio = measured / predicted if predicted else None
    return {"section": section, "quantity": quantity, "predicted": predicted, "measured": measured,
            "ratio": ratio}


def markdown(header: list[str], rows: list[dict]) -> str:
    lines = [*header, "", "| section | quantity | predicted / preset | measured | measured / predicted |",
             "|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"| {r['section']} | {r['quantity']} | {r['predicted']:.3f} | {r['measured']:.3f}"
                     f" | {ratio} |")
    return "\n".join(lines)


def preset_of(device: torch.device) -> str:
    """The preset named after the GPU ("NVIDIA H200" -> H200-141GB; an A100 by its memory), so a run
    on any lent card is held against its own datasheet; H100-80GB on CPU and on cards without one."""
    if device.type != "cuda":
        return "H100-80GB"
    name = torch.cuda.get_device_name(device)
    gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    for preset in sorted(HARDWARE):
        model, _, memory = preset.partition("-")
        if model in name and (model != "A100" or abs(gib - int(memory.removesuffix("GB"))) < 8):
            return preset
    return "H100-80GB"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    threads = torch.get_num_threads()
    return f"CPU {platform.processor() or platform.machine()}, {threads} thread{'s' if threads > 1 else ''}"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"--device {args.device}: torch {torch.__version__} sees no CUDA GPU; --device cpu runs the"
              " same path at CPU speed", file=sys.stderr)
        return 2
    if device.type == "cpu":  # compute on one thread, the copy lanes on theirs (as the emulated ranks run)
        torch.set_num_threads(1)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    hw = HARDWARE[args.hardware or preset_of(device)]
    element_size = torch.empty((), dtype=dtype).element_size()
    started = time.perf_counter()

    blocks, groups = profile(args, device, dtype)
    base = stage_problem(args, groups, hw, element_size)
    problem = limited(base, args.limit_fraction)
    solved, plan, rank = plans(problem, args.solve_s)
    rank = rank if args.rank is None else args.rank
    plain = run_baseline(base, "zb-h1")
    example = torch.zeros(1, args.seq, args.width, device=device, dtype=dtype)
    with single_process_group():
        lanes, lanes_peaks, late = run_rank(problem, plan, rank, blocks, example, args.iterations)
        sync, _, sync_late = run_rank(problem, plan, rank, blocks, example, args.iterations, synchronous=True)
        dense, dense_peaks, _ = run_rank(base, plain, rank, blocks, example, args.iterations)
        own, own_peaks, own_late = (lanes, lanes_peaks, []) if solved is plan else \
            run_rank(problem, solved, rank, blocks, example, args.iterations)
    late += sync_late + own_late
    passes, working = stage_passes(blocks, example) if device.type == "cuda" else ({}, {})
    link = host_link_gbps(device, args.link_mib or (1024 if device.type == "cuda" else 64), args.width, dtype)

    rows = []
    durations = {"F": problem.stages[0].forward_ms, "B": problem.stages[0].backward_input_ms,
                 "W": problem.stages[0].backward_weight_ms, "OFFLOAD": problem.stages[0].offload_ms,
                 "RELOAD": problem.stages[0].reload_ms}
    durations["B+W"] = durations["B"] + durations["W"]
    measured_ops = op_medians(lanes)
    for kind, (count, ms) in measured_ops.items():
        rows.append(row("ops", f"{kind} (ms, median of {count} per iteration)", durations[kind], ms))
    where = {"queued": "queued behind the pass before", "idle": "on an idle GPU"}
    for name, ms in passes.items():  # CUDA only: which of the two the run's B and W look like
        kind, how = name.split()
        rows.append(row("ops", f"{kind} of the whole stage alone, {where[how]} (ms)", durations[kind], ms))
    lanes_pred = predicted_rank_end(problem, plan, rank)
    sync_pred = predicted_rank_end(problem, plan, rank, synchronous_copies=True)
    lanes_ms = statistics.median(span(t) for t in lanes)
    sync_ms = statistics.median(span(t) for t in sync)
    if solved is not plan:
        rows.append(row("iteration",
                        f"rank's iteration, the solver's plan ({solved.method}, no offload) (ms)",
                        predicted_rank_end(problem, solved, rank), statistics.median(span(t) for t in own)))
    rows += [row("iteration", "rank's iteration, copy lanes (ms)", lanes_pred, lanes_ms),
             row("iteration", "same order, synchronous copies (ms)", sync_pred, sync_ms),
             row("iteration", "overlap: synchronous minus lanes (ms)", sync_pred - lanes_pred,
                 sync_ms - lanes_ms)]
    timed = with_op_times(problem, measured_ops)  # separates the overlap model from the op times
    lanes_timed = predicted_rank_end(timed, plan, rank)
    sync_timed = predicted_rank_end(timed, plan, rank, synchronous_copies=True)
    rows += [row("iteration", "rank's iteration, copy lanes, predicted from the run's op times (ms)",
                 lanes_timed, lanes_ms),
             row("iteration", "same order, synchronous copies, predicted from the run's op times (ms)",
                 sync_timed, sync_ms),
             row("iteration", "overlap, predicted from the run's op times (ms)", sync_timed - lanes_timed,
                 sync_ms - lanes_ms)]
    peak, dense_peak = max(lanes_peaks), max(dense_peaks)
    runs = [(f"the solver's plan ({solved.method}, no offload)", problem, solved, max(own_peaks))] \
        if solved is not plan else []
    runs += [("the offload plan", problem, plan, peak), ("ZB-H1 without offload", base, plain, dense_peak)]
    # what B leaves for W, as profiled: torch's view of the plans, solved in Zero Bubble's model
    kept = sum(g.get("output_grad_mib", 0.0) for g in groups)
    for name, prob, ran, measured in runs:  # as planned, and as torch's split backward holds it
        rows += [row("memory", f"peak, {name} (MiB)", ran.peak_memory_mib[rank], measured),
                 row("memory", f"peak, {name}, held until W as torch does (MiB)",
                     (torch_peaks(with_stage_fields(prob, output_grad_mib=kept or None), ran)
                      or ran.peak_memory_mib)[rank],
                     measured)]
    if working:  # CUDA only: what the allocator saw B leave for W, and its transients beyond
        rows += [row("memory", "B leaves for W beside the graph, one microbatch (MiB; predicted: the"
                     " profile's output_grad_mib)", kept, working["b_leaves"]),
                 row("memory", "B's working memory beyond what it leaves, one microbatch (MiB; no plan"
                     " counts it)", 0.0, working["b_above_start"] - working["b_leaves"]),
                 row("memory", "W's working memory: its peak above its start, one microbatch (MiB; no"
                     " plan counts it)", 0.0, working["w_above_start"])]
    saved = plain.peak_memory_mib[rank] - plan.peak_memory_mib[rank]
    rows.append(row("memory", "saved by offload (MiB)", saved, dense_peak - peak))
    flops = {k: args.blocks * v for k, v in block_flops(args.width, args.seq).items()}
    flops["B+W"] = flops["B"] + flops["W"]
    preset_tflops = hw.peak_tflops * hw.bf16_efficiency
    for kind, ms, where in (("F", durations["F"], "profile"), ("B", durations["B"], "profile"),
                            ("W", durations["W"], "profile"), ("F", measured_ops["F"][1], "in the run"),
                            ("B+W", measured_ops["B+W"][1], "in the run")):
        rows.append(row("presets", f"{kind} achieved TFLOP/s ({where}; preset: peak x bf16_efficiency)",
                        preset_tflops, flops[kind] / (ms * 1e-3) / 1e12))
    for name, label in (("d2h", "device to host"), ("h2d", "host to device")):
        rows.append(row("presets", f"host link {label}, beside compute (GB/s)", hw.host_link_gbps,
                        link[name]))

    memory_source = "caching allocator above the iteration's start" if device.type == "cuda" \
        else "saved-tensor bytes the executor holds"
    header = [
        (f"**{device_name(device)}**, torch {torch.__version__}: {args.blocks} Llama-like blocks, width"
         f" {args.width}, seq {args.seq}, {str(dtype).removeprefix('torch.')}, attention:"
         f" {'flash (SDPA)' if device.type == 'cuda' else 'SDPA (CPU)'}."),
        (f"Plan: {problem.num_devices} devices x {problem.num_microbatches} microbatches, {plan.method},"
         f" memory limit {problem.devices[rank].memory_limit_mib:.0f} MiB on rank {rank}, run alone"
         f" (neighbours emulated), {(_offloads(plan) or [0] * problem.num_devices)[rank]}"
         f" offloads there; {args.iterations} traced iterations per run after one warm-up. Copies and links"
         f" predicted with the {hw.name} preset (host link {hw.host_link_gbps:g} GB/s)."
         f" Memory: {memory_source}."),
    ]
    if 0 in problem.stages_of(rank):
        header.append("Rank 0 holds the first stage, whose input needs no gradient: torch runs its whole"
                      " backward in W (B measures next to nothing; compare B+W).")
    if solved is not plan:
        copy_ms, compute_ms = problem.stages[0].offload_ms, durations["F"] + durations["B+W"]
        why = (f": a copy ({copy_ms:.1f} ms) outlasts a microbatch's compute ({compute_ms:.1f} ms), so it"
               " throttles instead" if copy_ms > compute_ms else "")
        header.append(f"The solver's plan ({solved.method}, {solved.makespan_ms:.1f} ms) offloads nothing at"
                      f" this limit{why}; the copies are measured on {plan.method}'s plan at the same limit"
                      f" ({plan.makespan_ms:.1f} ms).")
    if late:
        header.append(f"Ran late (plan/runtime mismatch): {sorted(set(late))}")
    print(markdown(header, rows))
    if args.json is not None:
        args.json.write_text(json.dumps({
            "device": device_name(device), "device_type": device.type, "torch": torch.__version__,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "dtype": str(dtype), "hardware": hw.model_dump(), "rank": rank, "plan_method": plan.method,
            "solver_plan": solved.model_dump(mode="json"),
            "rows": rows, "profile": groups, "flops": flops, "host_link_gbps": link, "late": late,
            "runs_ms": {"lanes": [span(t) for t in lanes], "synchronous": [span(t) for t in sync],
                        "zb-h1": [span(t) for t in dense], "solver": [span(t) for t in own]},
            "problem": problem.model_dump(mode="json"), "plan": plan.model_dump(mode="json"),
            "seconds": time.perf_counter() - started}, indent=2))
    return 0 if all(math.isfinite(r["measured"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
