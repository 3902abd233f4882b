"""Pure renderers for the dashboard: plan v1 (+ its problem) in, SVG / display strings out.

No I/O and no web framework here, so the charts are testable (and timeable) on their own and the
router only fetches data. SVGs are built as joined strings, not through a template or a DOM: a
10,000-op Gantt is one `<rect>` per op and building it this way takes milliseconds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from html import escape

from pipeplan.planner.contract import Plan, Problem
from pipeplan.planner.memory import TimedOp, memory_curve
from pipeplan.planner.ops import Kind, Lane, choices_from_ops, lane_of, op_of

# Colour per op kind: the same table drives the SVG classes (CSS) and the legend.
KIND_COLOURS: dict[str, str] = {
    "F": "#4e79a7",
    "B": "#59a14f",
    "W": "#9fd38f",
    "BW": "#2f8f83",
    "RECOMPUTE": "#e15759",
    "OFFLOAD": "#f28e2b",
    "RELOAD": "#d4a017",
}
KIND_LABELS: dict[str, str] = {
    "F": "forward",
    "B": "backward (input)",
    "W": "backward (weight)",
    "BW": "backward (full)",
    "RECOMPUTE": "recompute",
    "OFFLOAD": "offload (D2H)",
    "RELOAD": "reload (H2D)",
}

LABEL_W = 78  # left column of row labels, px
CHART_W = 1100  # drawing width of the time axis, px
AXIS_H = 22
COMPUTE_H = 22
COPY_H = 10
DEVICE_GAP = 8
MIN_BAR_W = 0.35  # a 1 µs op on a 100 ms plan still shows as a hairline
LABEL_MIN_W = 13  # write the microbatch number inside bars at least this wide
MAX_LABELLED_OPS = 3000  # beyond this, text labels cost more than they tell


def _n(value: float) -> str:
    """Shortest readable coordinate (2 decimals): keeps a 10k-op SVG small."""
    text = f"{value:.2f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _t(value: float) -> str:
    """Time in ms for data attributes / tooltips, µs precision."""
    text = f"{value:.3f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


# -- display formatting ------------------------------------------------------------------------------

def fmt_ms(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if value >= 10_000:
        return f"{value / 1000:.2f} s"
    if value >= 100:
        return f"{value:.1f} ms"
    return f"{value:.3g} ms" if value < 1 else f"{value:.2f} ms"


def fmt_mib(value: float | None) -> str:
    if value is None or math.isinf(value):
        return "unlimited"
    if value >= 1024:
        return f"{value / 1024:.1f} GiB"
    return f"{value:.0f} MiB"


def fmt_pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def fmt_age(when: datetime | None, now: datetime) -> str:
    """'42 s ago', '3 min ago', … — what an operator scanning a table wants."""
    if when is None:
        return "—"
    if when.tzinfo is None and now.tzinfo is not None:
        now = now.replace(tzinfo=None)
    seconds = max(0.0, (now - when).total_seconds())
    if seconds < 60:
        return f"{seconds:.0f} s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 86400:
        return f"{seconds / 3600:.1f} h ago"
    return f"{seconds / 86400:.0f} d ago"


def memory_limit_summary(problem: Problem) -> str:
    """One limit for the whole pipeline when the devices agree, else the range."""
    limits = [d.memory_limit_mib for d in problem.devices]
    if all(lim is None for lim in limits):
        return "unlimited"
    finite = [lim for lim in limits if lim is not None]
    lo, hi = min(finite), max(finite)
    if lo == hi and len(finite) == len(limits):
        return fmt_mib(lo)
    return f"{fmt_mib(lo)}–{fmt_mib(hi)}" + ("" if len(finite) == len(limits) else " / unlimited")


def config_summary(problem: Problem) -> dict[str, str | int]:
    """The model/hardware facts the overview shows per cached configuration."""
    opts = problem.options
    freedoms = [name for name, on in (("split", opts.split_backward), ("offload", opts.offload),
                                      ("recompute", opts.recompute)) if on]
    model = problem.metadata.get("model") if isinstance(problem.metadata, dict) else None
    return {
        "devices": problem.num_devices,
        "microbatches": problem.num_microbatches,
        "chunks": problem.chunks,
        "memory": memory_limit_summary(problem),
        "options": ", ".join(freedoms) or "none",
        "model": str(model.get("name", "")) if isinstance(model, dict) else (str(model) if model else ""),
    }


_NEEDS = re.compile(r"need[s]?\D{0,20}?([0-9][0-9.]*)\s*MiB", re.IGNORECASE)
_LIMIT = re.compile(r"limit\D{0,10}?([0-9][0-9.]*)\s*MiB", re.IGNORECASE)


def short_reason(reason: str, width: int = 90) -> str:
    """One line for a baseline that has no plan: 'does not fit: needs 13.8 GiB, limit 10.3 GiB'."""
    needs = [float(x) for x in _NEEDS.findall(reason)]
    limits = [float(x) for x in _LIMIT.findall(reason)]
    if needs and ("fit" in reason.lower() or "memory" in reason.lower()):
        text = f"does not fit: needs up to {fmt_mib(max(needs))}"
        return text + (f", limit {fmt_mib(min(limits))}" if limits else "")
    return reason if len(reason) <= width else reason[: width - 1].rstrip() + "…"


def speedup_over(baseline_ms: float | None, makespan_ms: float) -> float | None:
    if baseline_ms is None or makespan_ms <= 0:
        return None
    return baseline_ms / makespan_ms


# -- axis helpers ------------------------------------------------------------------------------------

def nice_step(span: float, target_ticks: int = 8) -> float:
    """1/2/5 × 10^k step giving about `target_ticks` ticks over `span`."""
    if span <= 0:
        return 1.0
    raw = span / target_ticks
    mag = 10 ** math.floor(math.log10(raw))
    for mult in (1, 2, 5, 10):
        if mult * mag >= raw:
            return mult * mag
    return 10 * mag


def _ticks(lo: float, hi: float, target: int = 8) -> list[float]:
    step = nice_step(hi - lo, target)
    if step <= abs(hi) * 1e-9:  # a span lost in float noise: one tick, never an endless loop
        return [lo]
    first = math.ceil(lo / step) * step
    out = []
    for i in range(4 * target + 2):  # by index: adding a tiny step to a big float can stall
        t = first + i * step
        if t > hi + 1e-9 * max(1.0, abs(hi)):
            break
        out.append(round(t, 10))
    return out


def _tick_label(value: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step))) if step < 1 else 0
    return f"{value:.{decimals}f}"


# -- Gantt ---------------------------------------------------------------------------------------------
# Each chart is two SVGs with the same rows: a narrow label column (sticky on the page) and the plot.
# The plot is drawn at an exact pixel width and never scaled by the browser, so zooming (a server
# re-render at a wider width inside a scrolling box) stretches time only, never text.

PAD_L, PAD_R = 8, 16  # room for the first and last tick labels


@dataclass(frozen=True)
class GanttLayout:
    """Vertical layout shared by the label column and the plot."""

    show_copy_lanes: bool
    device_h: int
    height: int


def gantt_layout(problem: Problem, plan: Plan) -> GanttLayout:
    has_copies = problem.options.offload or any(
        op.kind in ("OFFLOAD", "RELOAD") for dp in plan.devices for op in dp.ops)
    device_h = COMPUTE_H + (2 * COPY_H + 2 if has_copies else 0)
    height = AXIS_H + problem.num_devices * (device_h + DEVICE_GAP) + 4
    return GanttLayout(has_copies, device_h, height)


def _time_span(plan: Plan) -> tuple[float, float]:
    starts = [op.start_ms for dp in plan.devices for op in dp.ops]
    ends = [op.end_ms for dp in plan.devices for op in dp.ops]
    if not starts:
        return 0.0, 1.0
    t0, t1 = min(starts), max(ends)
    return t0, (t1 if t1 > t0 else t0 + 1.0)


def _axis(t0: float, t1: float, chart_w: float, top: float, bottom: float, label_y: float) -> list[str]:
    target = max(4, int(chart_w / 120))
    step = nice_step(t1 - t0, target)
    scale = chart_w / (t1 - t0)
    parts = ['<g class="axis">']
    for t in _ticks(t0, t1, target):
        x = _n(PAD_L + (t - t0) * scale)
        parts.append(f'<line class="grid" x1="{x}" x2="{x}" y1="{_n(top)}" y2="{_n(bottom)}"/>'
                     f'<text class="tick" x="{x}" y="{_n(label_y)}">{_tick_label(t, step)}</text>')
    parts.append("</g>")
    return parts


def _svg_open(cls: str, width: float, height: float, extra: str = "") -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="{cls}" viewBox="0 0 {_n(width)} {height}"'
            f' width="{_n(width)}" height="{height}"{extra}>')


def gantt_labels_svg(problem: Problem, plan: Plan) -> str:
    """The Gantt's row labels (GPU n, D2H, H2D), aligned with `gantt_svg`'s rows."""
    layout = gantt_layout(problem, plan)
    parts = [_svg_open("row-labels", LABEL_W, layout.height, ' aria-hidden="true"'),
             f'<text class="unit" x="{LABEL_W - 8}" y="{AXIS_H - 8}">time (ms)</text>']
    for d in range(problem.num_devices):
        y0 = AXIS_H + d * (layout.device_h + DEVICE_GAP)
        parts.append(f'<text class="row-label" x="{LABEL_W - 8}" y="{_n(y0 + COMPUTE_H / 2 + 4)}">GPU {d}</text>')
        if layout.show_copy_lanes:
            parts.append(
                f'<text class="lane-label" x="{LABEL_W - 8}" y="{_n(y0 + COMPUTE_H + 2 + COPY_H - 2)}">D2H</text>'
                f'<text class="lane-label" x="{LABEL_W - 8}" y="{_n(y0 + COMPUTE_H + 3 + 2 * COPY_H - 2)}">H2D</text>')
    parts.append("</svg>")
    return "".join(parts)


def gantt_svg(problem: Problem, plan: Plan, chart_w: float = CHART_W) -> str:
    """The schedule as SVG: per device a compute lane (and D2H / H2D copy lanes when the problem can
    offload), exactly one `<rect class="op KIND">` per op, each carrying
    `data-o="kind,stage,mb,start,end"` for the page's single delegated tooltip handler."""
    layout = gantt_layout(problem, plan)
    t0, t1 = _time_span(plan)
    scale = chart_w / (t1 - t0)
    n_ops = sum(len(dp.ops) for dp in plan.devices)
    label_bars = n_ops <= MAX_LABELLED_OPS
    lane_y = {Lane.COMPUTE: 0, Lane.D2H: COMPUTE_H + 2, Lane.H2D: COMPUTE_H + 3 + COPY_H}
    lane_h = {Lane.COMPUTE: COMPUTE_H, Lane.D2H: COPY_H, Lane.H2D: COPY_H}
    width = PAD_L + chart_w + PAD_R
    parts = [_svg_open("gantt", width, layout.height,
                       f' data-ops="{n_ops}" data-t0="{_t(t0)}" data-t1="{_t(t1)}" role="img"'
                       f' aria-label="Gantt chart of plan revision {plan.revision}"')]
    parts += _axis(t0, t1, chart_w, AXIS_H - 4, layout.height - 4, AXIS_H - 8)
    by_device = {dp.device: dp for dp in plan.devices}
    # With several stages per device (interleaved / V), later chunks are drawn a shade lighter.
    chunk_class = {}
    if problem.chunks > 1:
        for d in range(problem.num_devices):
            for c, k in enumerate(problem.stages_of(d)):
                chunk_class[k] = f" c{min(c, 3)}" if c else ""
    for d in range(problem.num_devices):
        y0 = AXIS_H + d * (layout.device_h + DEVICE_GAP)
        parts.append(f'<g class="device" data-device="{d}">'
                     f'<rect class="row-bg" x="{PAD_L}" y="{y0}" width="{_n(chart_w)}" height="{layout.device_h}"/>')
        labels: list[str] = []
        dp = by_device.get(d)
        for op in dp.ops if dp is not None else ():
            lane = lane_of(Kind(op.kind))
            if lane is not Lane.COMPUTE and not layout.show_copy_lanes:
                lane = Lane.COMPUTE  # defensive: never drop an op
            x = PAD_L + (op.start_ms - t0) * scale
            w = max(MIN_BAR_W, (op.end_ms - op.start_ms) * scale)
            y = y0 + lane_y[lane]
            parts.append(
                f'<rect class="op {op.kind}{chunk_class.get(op.stage, "")}" x="{_n(x)}" y="{y}" width="{_n(w)}"'
                f' height="{lane_h[lane]}"'
                f' data-o="{op.kind},{op.stage},{op.mb},{_t(op.start_ms)},{_t(op.end_ms)}"/>')
            if label_bars and lane is Lane.COMPUTE and w >= LABEL_MIN_W:
                labels.append(f'<text class="mb" x="{_n(x + w / 2)}" y="{y + 15}">{op.mb}</text>')
        parts.extend(labels)
        parts.append("</g>")
    parts.append("</svg>")
    return "".join(parts)


# -- memory --------------------------------------------------------------------------------------------

MEM_H = 64
MEM_GAP = 16  # room for the caption under each strip (static, limit)


def memory_curves(problem: Problem, plan: Plan) -> list[list[tuple[float, float]]]:
    """planner.memory.memory_curve for every device of the plan (choices read back from its ops)."""
    all_ops = [op_of(o) for dp in plan.devices for o in dp.ops]
    choices, _ = choices_from_ops(problem, all_ops)
    by_device = {dp.device: dp for dp in plan.devices}
    curves = []
    for d in range(problem.num_devices):
        dp = by_device.get(d)
        timed = [TimedOp(op_of(o), o.start_ms, o.end_ms)
                 for o in (dp.ops if dp else [])]
        curves.append(memory_curve(problem, d, timed, choices) if timed else [(0.0, problem.devices[d].static_mib)])
    return curves


def _step_path(points: Sequence[tuple[float, float]], x_of, y_of, x_end: float) -> str:
    """Step path; points closer than half a pixel merge keeping their maximum, so peaks survive."""
    merged: list[tuple[float, float]] = []
    for t, level in points:
        x = round(x_of(t) * 2) / 2
        if merged and merged[-1][0] == x:
            merged[-1] = (x, max(merged[-1][1], level))
        else:
            merged.append((x, level))
    if not merged:
        return ""
    out = [f"M{_n(merged[0][0])} {_n(y_of(merged[0][1]))}"]
    for x, level in merged[1:]:
        out.append(f"H{_n(x)}V{_n(y_of(level))}")
    out.append(f"H{_n(x_end)}")
    return "".join(out)


@dataclass(frozen=True)
class DeviceMemory:
    device: int
    curve: list[tuple[float, float]]
    static: float
    limit: float
    peak: float

    @property
    def over(self) -> bool:
        return math.isfinite(self.limit) and self.peak > self.limit + 1e-6


def device_memories(problem: Problem, plan: Plan) -> list[DeviceMemory]:
    t0, _ = _time_span(plan)
    out = []
    for d, curve in enumerate(memory_curves(problem, plan)):
        static = problem.devices[d].static_mib
        if curve[0][0] > t0:  # the device idles (at its static memory) until its first op
            curve = [(t0, static), *curve]
        out.append(DeviceMemory(d, curve, static, problem.limit_of(d), max(level for _, level in curve)))
    return out


def _mem_height(problem: Problem) -> int:
    return AXIS_H + problem.num_devices * (MEM_H + MEM_GAP) + 4


def memory_labels_svg(problem: Problem, plan: Plan, memories: list[DeviceMemory] | None = None) -> str:
    memories = memories if memories is not None else device_memories(problem, plan)
    parts = [_svg_open("row-labels", LABEL_W, _mem_height(problem), ' aria-hidden="true"'),
             f'<text class="unit" x="{LABEL_W - 8}" y="{AXIS_H - 8}">time (ms)</text>']
    for m in memories:
        y0 = AXIS_H + m.device * (MEM_H + MEM_GAP)
        parts.append(f'<text class="row-label" x="{LABEL_W - 8}" y="{y0 + 14}">GPU {m.device}</text>'
                     f'<text class="lane-label" x="{LABEL_W - 8}" y="{y0 + 28}">peak</text>'
                     f'<text class="lane-label{" over" if m.over else ""}" x="{LABEL_W - 8}" y="{y0 + 39}">'
                     f'{escape(fmt_mib(m.peak))}</text>')
    parts.append("</svg>")
    return "".join(parts)


def memory_svg(problem: Problem, plan: Plan, chart_w: float = CHART_W,
               memories: list[DeviceMemory] | None = None) -> str:
    """Per device: memory over time (static included) against its limit, on the Gantt's time axis."""
    memories = memories if memories is not None else device_memories(problem, plan)
    t0, t1 = _time_span(plan)
    scale = chart_w / (t1 - t0)
    height = _mem_height(problem)
    parts = [_svg_open("memory", PAD_L + chart_w + PAD_R, height,
                       ' role="img" aria-label="Memory per device over time"')]
    parts += _axis(t0, t1, chart_w, AXIS_H - 4, height - 4, AXIS_H - 8)
    right = PAD_L + chart_w

    def x_of(t: float) -> float:
        return PAD_L + (t - t0) * scale

    for m in memories:
        y0 = AXIS_H + m.device * (MEM_H + MEM_GAP)
        # The floor is the static memory: what moves (activations) is what the chart must show.
        top = max(m.peak, m.limit if math.isfinite(m.limit) else 0.0)
        floor = m.static if top > m.static else 0.0
        top = top + (top - floor) * 0.1 or 1.0

        def y_of(level: float, y0: float = y0, top: float = top, floor: float = floor) -> float:
            return y0 + MEM_H - (level - floor) / (top - floor) * MEM_H

        parts.append(f'<g class="mem-device" data-device="{m.device}" data-peak="{_n(m.peak)}">'
                     f'<rect class="row-bg" x="{PAD_L}" y="{y0}" width="{_n(chart_w)}" height="{MEM_H}"/>')
        path = _step_path(m.curve, x_of, y_of, right)
        if path:
            parts.append(f'<path class="mem-area" d="{path}V{_n(y0 + MEM_H)}H{_n(x_of(m.curve[0][0]))}Z"/>'
                         f'<path class="mem-line" d="{path}"/>')
        # static and limit are named in the gap under the strip: drawn on it, they hid the curves
        caption = f"static {fmt_mib(m.static)}"
        if math.isfinite(m.limit):
            ly = _n(y_of(m.limit))
            parts.append(f'<line class="mem-limit" x1="{PAD_L}" x2="{_n(right)}" y1="{ly}" y2="{ly}"/>')
            caption += f" · limit {fmt_mib(m.limit)} (dashed)"
        parts.append(f'<text class="floor-label" x="{PAD_L + 4}" y="{y0 + MEM_H + MEM_GAP - 4}">'
                     f'{escape(caption)}</text></g>')
    parts.append("</svg>")
    return "".join(parts)


# -- revision history -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class RevisionPoint:
    revision: int
    created_at: datetime
    makespan_ms: float
    lower_bound_ms: float
    method: str = ""


def history_svg(points: Sequence[RevisionPoint], width: int = 560, height: int = 190) -> str:
    """Makespan (steps) and the best bound over wall-clock time since revision 1."""
    if not points:
        return '<p class="muted">No revisions yet.</p>'
    pts = sorted(points, key=lambda p: p.revision)
    start = pts[0].created_at
    secs = [max(0.0, (p.created_at - start).total_seconds()) for p in pts]
    span_s = max(secs[-1], 1.0)
    values = [p.makespan_ms for p in pts] + [p.lower_bound_ms for p in pts]
    lo, hi = min(values), max(values)
    pad = max((hi - lo) * 0.15, hi * 0.02, 0.05)  # equal makespan and bound still get a visible band
    lo, hi = max(0.0, lo - pad), hi + pad
    left, right, top, bottom = 64, 16, 22, 30
    cw, ch = width - left - right, height - top - bottom

    def x_of(s: float) -> float:
        return left + s / span_s * cw

    def y_of(v: float) -> float:
        return top + ch - (v - lo) / (hi - lo) * ch

    parts = [_svg_open("history", width, height,
                       ' role="img" aria-label="Makespan and lower bound by revision"')]
    ystep = nice_step(hi - lo, 4)
    for v in _ticks(lo, hi, 4):
        y = _n(y_of(v))
        parts.append(f'<line class="grid" x1="{left}" x2="{left + cw}" y1="{y}" y2="{y}"/>'
                     f'<text class="ytick" x="{left - 6}" y="{_n(y_of(v) + 4)}">{_tick_label(v, ystep)}</text>')
    xstep = nice_step(span_s, 5)
    for s in _ticks(0.0, span_s, 5):
        x = _n(x_of(s))
        parts.append(f'<text class="tick" x="{x}" y="{height - 12}">{_tick_label(s, xstep)}</text>')
    parts.append(f'<text class="unit" x="{left + cw}" y="{height - 1}">seconds since revision 1</text>'
                 f'<text class="unit" x="{left - 6}" y="{top - 12}">ms</text>')
    mk = [(s, p.makespan_ms) for s, p in zip(secs, pts)]
    lb = [(s, p.lower_bound_ms) for s, p in zip(secs, pts)]
    end = left + cw
    parts.append(f'<path class="hist-bound" d="{_step_path(lb, x_of, y_of, end)}"/>'
                 f'<path class="hist-makespan" d="{_step_path(mk, x_of, y_of, end)}"/>')
    for s, p in zip(secs, pts):
        parts.append(f'<circle class="hist-pt" cx="{_n(x_of(s))}" cy="{_n(y_of(p.makespan_ms))}" r="3.5"'
                     f' data-o="rev {p.revision}: {_t(p.makespan_ms)} ms ({escape(p.method, quote=True)})"/>')
    parts.append("</svg>")
    return "".join(parts)


def legend_items(plan: Plan) -> list[tuple[str, str, str]]:
    """(kind, colour, label) for the kinds present in the plan, in a stable order."""
    present = {op.kind for dp in plan.devices for op in dp.ops}
    return [(k, c, KIND_LABELS[k]) for k, c in KIND_COLOURS.items() if k in present]
