"""The dashboard's frontier page (/dashboard/frontiers/{key}): the curve with its bound band, the peers,
each point linked to its plan page; server-rendered SVG like the other charts, no JavaScript needed.

`frontier_svg` is pure (document in, SVG out); the route only reads the curve from SQL.
"""

from __future__ import annotations

from html import escape
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse
from pipeplan.planner.frontier import chart_window, off_chart_note, x_label

from ..frontier_store import FrontierStore
from .deps import gated, repo_of
from .templating import PREFIX, context, templates
from .views import _n, _tick_label, _ticks, nice_step

router = APIRouter(prefix=PREFIX, tags=["dashboard"], include_in_schema=False)

GIB = 1024.0
CURVE, BAND, PEER, BEYOND = "#4e79a7", "#a0cbe8", "#e15759", "#b07aa1"
SHAPES = ("circle", "square", "diamond", "triangle")


def _marker(shape: str, x: float, y: float, tip: str) -> str:
    common = f' fill="none" stroke="{PEER}" stroke-width="1.8"><title>{escape(tip)}</title>'
    if shape == "circle":
        return f'<circle cx="{_n(x)}" cy="{_n(y)}" r="5"{common}</circle>'
    if shape == "square":
        return f'<rect x="{_n(x - 4.5)}" y="{_n(y - 4.5)}" width="9" height="9"{common}</rect>'
    pts = [(x, y - 6), (x + 6, y), (x, y + 6), (x - 6, y)] if shape == "diamond" else \
        [(x, y - 6), (x + 6, y + 5), (x - 6, y + 5)]
    return f'<polygon points="{" ".join(f"{_n(a)},{_n(b)}" for a, b in pts)}"{common}</polygon>'


def frontier_svg(doc: dict[str, Any], width: int = 1000, height: int = 460) -> str:
    """Step curve of makespan against GiB per GPU, the band down to each point's proven bound, the
    GPU's memory as a line with the points beyond it flagged, the peers near the curve as hollow
    markers (hover: name and figures; the others are listed by the page); each point links to its
    plan page. Axes: planner.frontier.chart_window, as the CLI's plot."""
    points = sorted(doc["points"], key=lambda p: p["factor"])
    win = chart_window(doc)
    peers = win.peers
    xs = [p["budget_mib"] / GIB for p in points]
    x_lo, x_hi = win.x_mib[0] / GIB, win.x_mib[1] / GIB
    ms = [p["makespan_ms"] for p in points]
    lb = [p["bound_ms"] for p in points]
    y_lo, y_hi = win.y_ms
    left, right, top, bottom = 70, 230, 20, 42
    cw, ch = width - left - right, height - top - bottom

    def x_of(v: float) -> float:
        return left + (v - x_lo) / (x_hi - x_lo) * cw

    def y_of(v: float) -> float:
        return top + ch - (min(v, y_hi) - y_lo) / (y_hi - y_lo) * ch

    parts = [f'<svg class="frontier" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}"'
             f' viewBox="0 0 {width} {height}" role="img" aria-label="Time-memory frontier">']
    ystep, xstep = nice_step(y_hi - y_lo, 6), nice_step(x_hi - x_lo, 8)
    for v in _ticks(y_lo, y_hi, 6):
        y = _n(y_of(v))
        parts.append(f'<line class="grid" x1="{left}" x2="{left + cw}" y1="{y}" y2="{y}"/>'
                     f'<text class="ytick" x="{left - 6}" y="{_n(y_of(v) + 4)}" text-anchor="end">'
                     f'{_tick_label(v, ystep)}</text>')
    for v in _ticks(x_lo, x_hi, 8):
        parts.append(f'<text class="tick" x="{_n(x_of(v))}" y="{height - 24}">{_tick_label(v, xstep)}</text>')
    parts.append(f'<text class="unit" x="{left + cw}" y="{height - 6}" text-anchor="end">{escape(x_label(doc))}'
                 f'</text><text class="unit" x="{left - 6}" y="{top - 6}" text-anchor="end">ms</text>')
    if win.hbm_mib is not None:
        hx = _n(x_of(win.hbm_mib / GIB))
        label = f"GPU memory {win.hbm_mib / GIB:.1f} GiB ({doc.get('hbm_of')})"
        parts.append(f'<g class="hbm"><rect x="{hx}" y="{top}" width="{_n(left + cw - x_of(win.hbm_mib / GIB))}"'
                     f' height="{ch}" fill="#888" fill-opacity="0.08"/><line x1="{hx}" x2="{hx}" y1="{top}"'
                     f' y2="{top + ch}" stroke="#444" stroke-width="1.2" stroke-dasharray="2 3"/>'
                     f'<text class="unit" style="text-anchor:end" x="{_n(x_of(win.hbm_mib / GIB) - 4)}"'
                     f' y="{top + ch - 6}">{escape(label)}</text></g>')
    edges = [x_of(x) for x in xs] + [left + cw]
    step = [f"M{_n(edges[0])},{_n(y_of(ms[0]))}"]
    for i in range(len(points)):
        step.append(f"H{_n(edges[i + 1])}" + (f"V{_n(y_of(ms[i + 1]))}" if i + 1 < len(points) else ""))
    back = [f"V{_n(y_of(lb[i]))}H{_n(edges[i])}" for i in range(len(points) - 1, -1, -1)]
    # the band: along the curve, then back along the bounds
    parts.append(f'<path class="frontier-band" d="{"".join(step + back)}Z" fill="{BAND}" fill-opacity="0.45"'
                 f' stroke="none"><title>gap to the proven lower bound</title></path>')
    parts.append(f'<path class="frontier-curve" d="{"".join(step)}" fill="none" stroke="{CURVE}"'
                 f' stroke-width="2.5"/>')
    shapes: dict[str, str] = {}
    for q in peers:
        shape = shapes.setdefault(q["name"], SHAPES[len(shapes) % len(SHAPES)])
        tip = f'{q["name"]}: {q["makespan_ms"]:.2f} ms at {q["budget_mib"] / GIB:.2f} GiB per GPU ({q["method"]})'
        parts.append(f'<g class="peer" data-peer="{escape(q["name"], quote=True)}">'
                     + _marker(shape, x_of(q["budget_mib"] / GIB), y_of(q["makespan_ms"]), tip) + "</g>")
    for i, p in enumerate(points):
        beyond = p.get("beyond_hbm")
        tip = (f'point {i + 1}: {p["makespan_ms"]:.2f} ms (bound {p["bound_ms"]:.2f}) at'
               f' {p["budget_mib"] / GIB:.2f} GiB per GPU{", beyond the GPU" + chr(39) + "s memory" if beyond else ""},'
               f' {p.get("method", "")}')
        look = f'fill="white" stroke="{BEYOND}" stroke-width="2.5"' if beyond else f'fill="{CURVE}"'
        parts.append(f'<a class="point{" beyond-hbm" if beyond else ""}" href="/dashboard/plans/{p["problem_key"]}">'
                     f'<circle cx="{_n(edges[i])}" cy="{_n(y_of(ms[i]))}" r="5.5" {look}><title>{escape(tip)}'
                     '</title></circle></a>')
    lx, ly = left + cw + 16, top + 8  # the legend beside the plot, never over a point
    start = 'class="unit" style="text-anchor:start"'
    parts.append(f'<rect x="{lx}" y="{ly - 6}" width="14" height="10" fill="{BAND}"/><text {start}'
                 f' x="{lx + 20}" y="{ly + 3}">gap to the proven bound</text>'
                 f'<line x1="{lx}" x2="{lx + 14}" y1="{ly + 19}" y2="{ly + 19}" stroke="{CURVE}" stroke-width="2.5"/>'
                 f'<text {start} x="{lx + 20}" y="{ly + 23}">pipeplan frontier (click a point)</text>')
    keys = [(_marker(shape, lx + 7, 0, name), name) for name, shape in shapes.items()]
    if any(p.get("beyond_hbm") for p in points):
        keys.insert(0, (f'<circle cx="{lx + 7}" cy="0" r="5" fill="white" stroke="{BEYOND}" stroke-width="2.5"/>',
                        "beyond the GPU's memory"))
    for j, (mark, name) in enumerate(keys):
        y = ly + 40 + 16 * j
        parts.append(f'<g transform="translate(0,{y - 3})">{mark}</g><text {start} x="{lx + 20}" y="{y + 1}">'
                     f'{escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


@router.get("/frontiers/{key}", response_class=HTMLResponse, dependencies=gated)
def frontier_page(request: Request, key: str) -> HTMLResponse:
    doc = FrontierStore.of(repo_of(request)).curve(key) if len(key) == 64 else None
    if doc is None:
        raise HTTPException(404, f"no frontier {key}")
    rows = sorted(doc["points"], key=lambda p: p["factor"])
    return templates.TemplateResponse(request, "dashboard/frontier.html", context(
        request, key=key, doc=doc, points=rows, svg=frontier_svg(doc), gib=GIB,
        off_chart=off_chart_note(chart_window(doc).off_chart),
        dominated=sum(1 for d in doc["dominance"] if d["dominated"]), dominance=doc["dominance"]))
