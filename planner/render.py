"""Gantt chart of a plan with the memory curve of every device beneath it (SVG or PNG bytes).

Pure: builds a matplotlib `Figure` (no pyplot, no global state, Agg canvas) and returns bytes; the
caller decides where they go. Bars are drawn as one PolyCollection per (op kind, chunk), not one
patch per op, so plans with tens of thousands of ops render in about a second.
"""

from __future__ import annotations

import io
import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from matplotlib import rc_context
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PolyCollection
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from .contract import Plan, Problem
from .memory import TimedOp, memory_curve
from .ops import Kind, Lane, choices_from_ops, lane_of, op_of

# Okabe-Ito / Tol colour-blind-safe palette, one colour per op kind everywhere pipeplan draws.
PALETTE: dict[Kind, str] = {
    Kind.F: "#0072B2",
    Kind.B: "#009E73",
    Kind.W: "#E69F00",
    Kind.BW: "#44AA99",
    Kind.RECOMPUTE: "#CC79A7",
    Kind.OFFLOAD: "#D55E00",
    Kind.RELOAD: "#882255",
}
LABELS: dict[Kind, str] = {
    Kind.F: "F forward", Kind.B: "B input grad", Kind.W: "W weight grad", Kind.BW: "BW full backward",
    Kind.RECOMPUTE: "recompute", Kind.OFFLOAD: "offload (D2H)", Kind.RELOAD: "reload (H2D)",
}
LIGHT_TEXT_KINDS = frozenset({Kind.W})  # kinds whose colour is light enough for dark labels

# Lane heights in y units; a device's row group is its lanes stacked top to bottom.
LANE_HEIGHT = {Lane.COMPUTE: 1.0, Lane.D2H: 0.42, Lane.H2D: 0.42}
LANE_GAP = 0.08
GROUP_GAP = 0.45
MAX_LABELS = 4000  # beyond this many bar labels the chart is unreadable anyway (and SVGs get big)
RASTERIZE_OVER = 4000  # bars above this count are rasterized inside an SVG to keep the file small


@dataclass(frozen=True)
class RenderOptions:
    width_in: float = 13.0
    dpi: int = 150
    title: str | None = None  # None: method and metrics
    copy_lanes: str = "auto"  # "auto": only when the plan has copies; "always"; "never"
    memory: bool = True


def _lighten(color: str, amount: float) -> tuple[float, float, float]:
    r, g, b = to_rgb(color)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


def _ops_by_device(plan: Plan, problem: Problem) -> dict[int, list[TimedOp]]:
    out: dict[int, list[TimedOp]] = defaultdict(list)
    for dp in plan.devices:
        for pop in dp.ops:
            op = op_of(pop)
            if op.stage < problem.num_stages and op.mb < problem.num_microbatches:
                out[dp.device].append(TimedOp(op, pop.start_ms, pop.end_ms))
    return out


def _unit(peak_mib: float) -> tuple[str, float]:
    return ("GiB", 1024.0) if peak_mib >= 4096 else ("MiB", 1.0)


def _title(problem: Problem, plan: Plan) -> str:
    bound = max(plan.lower_bound_ms, plan.solver_bound_ms or 0.0)
    gap = (plan.makespan_ms - bound) / plan.makespan_ms if plan.makespan_ms > 0 else 0.0
    return (f"{plan.method}: {problem.num_devices} devices × {problem.chunks} stage(s), "
            f"{problem.num_microbatches} microbatches — makespan {plan.makespan_ms:.4g} ms, "
            f"bubble {plan.bubble_ratio:.1%}, lower bound {bound:.4g} ms (gap {gap:.1%})")


def gantt_figure(problem: Problem, plan: Plan, options: RenderOptions = RenderOptions()) -> Figure:
    """The chart as a matplotlib Figure (Agg canvas attached), for callers that want to adjust it."""
    by_device = _ops_by_device(plan, problem)
    all_ops = [t for ops in by_device.values() for t in ops]
    has_copies = any(lane_of(t.op.kind) is not Lane.COMPUTE for t in all_ops)
    lanes = [Lane.COMPUTE]
    if options.copy_lanes == "always" or (options.copy_lanes == "auto" and has_copies):
        lanes += [Lane.D2H, Lane.H2D]
    p = problem.num_devices
    group = sum(LANE_HEIGHT[lane] for lane in lanes) + LANE_GAP * (len(lanes) - 1)

    # y of each (device, lane): device 0 on top
    lane_y: dict[tuple[int, Lane], float] = {}
    y = 0.0
    for d in range(p):
        for lane in lanes:
            lane_y[(d, lane)] = y
            y += LANE_HEIGHT[lane] + LANE_GAP
        y += GROUP_GAP - LANE_GAP
    total_y = y - GROUP_GAP

    gantt_h = max(1.6, 0.42 * group * p + 0.9)
    mem_h = 0.55 if p <= 16 else 0.4
    heights = [gantt_h] + ([mem_h] * p if options.memory else [])
    fig = Figure(figsize=(options.width_in, sum(heights) + 1.3), dpi=options.dpi, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(heights), 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": heights, "hspace": 0.02})[:, 0]
    ax = axes[0]

    t0 = min((t.start for t in all_ops), default=0.0)
    t1 = max((t.end for t in all_ops), default=1.0)
    span = max(t1 - t0, 1e-9)

    # -- bars: one collection per (kind, chunk) ---------------------------------------------------------
    chunk_of = {k: problem.stages_of(problem.stages[k].device).index(k) for k in range(problem.num_stages)}
    buckets: dict[tuple[Kind, int], list[tuple[float, float, float, float]]] = defaultdict(list)
    labels: list[tuple[float, float, float, int, Kind]] = []
    for d, ops in by_device.items():
        for t in ops:
            lane = lane_of(t.op.kind)
            if (d, lane) not in lane_y:
                continue
            h = LANE_HEIGHT[lane]
            y0 = lane_y[(d, lane)]
            buckets[(t.op.kind, chunk_of[t.op.stage])].append((t.start, t.end, y0, h))
            labels.append((t.start, t.end, y0 + h / 2, t.op.mb, t.op.kind))
    n_bars = sum(len(v) for v in buckets.values())
    axis_px = options.width_in * options.dpi * 0.88
    px_per_ms = axis_px / span
    widths = [e - s for bars in buckets.values() for s, e, _, _ in bars]
    median_px = float(np.median(widths)) * px_per_ms if widths else 0.0
    edge = 0.4 if median_px >= 4 else 0.0
    for (kind, chunk), bars in sorted(buckets.items(), key=lambda kv: (list(PALETTE).index(kv[0][0]), kv[0][1])):
        arr = np.asarray(bars, dtype=float)
        s, e, y0, h = arr.T
        verts = np.stack([np.stack([s, y0], 1), np.stack([e, y0], 1),
                          np.stack([e, y0 + h], 1), np.stack([s, y0 + h], 1)], axis=1)
        color = _lighten(PALETTE[kind], min(0.6, 0.38 * chunk))
        coll = PolyCollection(verts, facecolors=[color], edgecolors="white", linewidths=edge)
        if n_bars > RASTERIZE_OVER:
            coll.set_rasterized(True)
        ax.add_collection(coll)

    # microbatch labels: one font size for the whole chart, fitted so the widest label fits the typical
    # compute bar; a bar narrower than its label stays unlabelled
    digits = len(str(max(problem.num_microbatches - 1, 0)))
    compute_px = sorted((e - s) * px_per_ms for s, e, _, _, kind in labels if lane_of(kind) is Lane.COMPUTE)
    typical_px = compute_px[len(compute_px) // 2] if compute_px else 0.0
    char_px = 0.62  # digit width per px of font size (DejaVu Sans)
    font_px = min(6.5 * options.dpi / 72, (typical_px - 2) / (char_px * digits + 0.2) if typical_px > 2 else 0)
    font = font_px * 72 / options.dpi
    if font >= 3.5:
        shown = [lab for lab in labels
                 if (lab[1] - lab[0]) * px_per_ms >= char_px * font_px * len(str(lab[3])) + 2]
        for s, e, yc, mb, kind in shown[:MAX_LABELS]:
            copy = lane_of(kind) is not Lane.COMPUTE
            ax.text((s + e) / 2, yc, str(mb), ha="center", va="center", fontsize=font * (0.85 if copy else 1.0),
                    color="#222222" if kind in LIGHT_TEXT_KINDS else "white", clip_on=True)

    for d in range(1, p, 2):  # faint bands tell the row groups apart
        top_y = lane_y[(d, lanes[0])] - GROUP_GAP / 2
        ax.axhspan(top_y, top_y + group + GROUP_GAP, color="#f4f4f4", zorder=0, linewidth=0)
    ax.set_ylim(total_y + 0.15, -0.15)
    ax.set_xlim(t0, t0 + span)
    ticks, tick_labels = [], []
    for d in range(p):
        for lane in lanes:
            ticks.append(lane_y[(d, lane)] + LANE_HEIGHT[lane] / 2)
            tick_labels.append(f"dev {d}" if lane is Lane.COMPUTE else lane.value.upper())
    ax.set_yticks(ticks, tick_labels)
    for tick, lane in zip(ax.get_yticklabels(), lanes * p):
        if lane is not Lane.COMPUTE:
            tick.set_fontsize(6)
            tick.set_color("#666666")
    ax.tick_params(axis="y", length=0)
    for spine in ("top", "right", "left"):
        ax.spines[spine].set_visible(False)
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)

    kinds = [k for k in PALETTE if any(key[0] is k for key in buckets)]
    handles = [Patch(facecolor=PALETTE[k], label=LABELS[k]) for k in kinds]
    if problem.chunks > 1:
        handles.append(Patch(facecolor=_lighten("#777777", 0.38), label="lighter: later chunk"))
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=len(handles),
              frameon=False, fontsize=8, handlelength=1.2, columnspacing=1.2, borderaxespad=0.2)
    fig.suptitle(options.title if options.title is not None else _title(problem, plan), fontsize=10)

    # -- memory beneath: one strip per device, limit dashed ----------------------------------------------
    if options.memory:
        choices, _ = choices_from_ops(problem, [t.op for t in all_ops])
        curves = [memory_curve(problem, d, by_device.get(d, []), choices) for d in range(p)]
        limits = [problem.limit_of(d) for d in range(p)]
        top = max(max(m for _, m in c) for c in curves)
        finite = [lim for lim in limits if math.isfinite(lim)]
        unit, scale = _unit(max([top] + finite))
        ymax = max([top] + finite) / scale * 1.08 or 1.0
        for d, (mem_ax, curve, limit) in enumerate(zip(axes[1:], curves, limits)):
            static = problem.devices[d].static_mib / scale
            xs = [t0] + [t for t, _ in curve] + [t0 + span]
            ys = [static] + [m / scale for _, m in curve] + [curve[-1][1] / scale]
            raster = len(xs) > 1000  # long curves as pixels inside an SVG, or it grows to megabytes
            mem_ax.fill_between([t0, t0 + span], 0, static, color="#d9d9d9", linewidth=0, step=None)
            mem_ax.fill_between(xs, static, ys, step="post", color="#9ecae1", linewidth=0, rasterized=raster)
            mem_ax.step(xs, ys, where="post", color="#08519c", linewidth=0.8, rasterized=raster)
            if math.isfinite(limit):
                mem_ax.axhline(limit / scale, color="#cb181d", linestyle="--", linewidth=0.9)
            peak = max(m for _, m in curve)
            over = math.isfinite(limit) and peak > limit + 1e-6
            text = f"peak {peak / scale:.4g}" + (f" / limit {limit / scale:.4g}" if math.isfinite(limit) else "")
            # beside the strip, not on it: inside, the box hid the curve where memory peaks (top right)
            mem_ax.text(1.005, 0.5, text + f" {unit}", transform=mem_ax.transAxes, ha="left", va="center",
                        fontsize=6.5, color="#cb181d" if over else "#333333")
            mem_ax.grid(axis="x", color="#eeeeee", linewidth=0.6)
            mem_ax.set_axisbelow(True)
            mem_ax.set_ylim(0, ymax)
            mem_ax.set_ylabel(f"dev {d}", rotation=0, ha="right", va="center", fontsize=8)
            mem_ax.tick_params(axis="y", labelsize=6, length=2)
            mem_ax.locator_params(axis="y", nbins=2)
            for spine in ("top", "right"):
                mem_ax.spines[spine].set_visible(False)
        axes[1].set_title(f"memory per device ({unit}; grey: static, dashed: limit)", fontsize=8, loc="left")
    axes[-1].set_xlabel("time (ms)")
    return fig


def render(problem: Problem, plan: Plan, fmt: str = "png", options: RenderOptions = RenderOptions()) -> bytes:
    """The chart as PNG or SVG bytes."""
    fmt = fmt.lower().lstrip(".")
    if fmt not in ("png", "svg"):
        raise ValueError(f"format: expected png or svg, got {fmt!r}")
    # SVG text stays text (searchable, editable in a paper's figure), not glyph outlines; the salt
    # keeps most element ids stable between runs (clip-path ids still follow object identity)
    with rc_context({"svg.fonttype": "none", "svg.hashsalt": "pipeplan"}):
        fig = gantt_figure(problem, plan, options)
        buffer = io.BytesIO()
        fig.savefig(buffer, format=fmt, dpi=options.dpi,
                    metadata={"Software": None} if fmt == "png" else {"Date": None})
    return buffer.getvalue()
