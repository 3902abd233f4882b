"""The dashboard's configuration page (/dashboard/configurations/{key}): the ranked candidates, a chart
of tokens/s per GPU against peak memory per GPU with every scored candidate (each linked to its plan
page), and why the other layout families lost; server-rendered SVG, no JavaScript needed.

`configurations_svg` is pure (document in, SVG out); the route only reads the ranking from SQL.
"""

from __future__ import annotations

from html import escape
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse

from ..configure_store import ConfigurationStore
from .deps import gated, repo_of
from .templating import PREFIX, context, templates
from .views import _n, _tick_label, _ticks, nice_step

router = APIRouter(prefix=PREFIX, tags=["dashboard"], include_in_schema=False)

GIB = 1024.0
TOP, OTHER = "#4e79a7", "#bab0ac"


def configurations_svg(doc: dict[str, Any], width: int = 1000, height: int = 420) -> str:
    """Every scored candidate at (peak GiB per GPU, tokens/s per GPU): the ranked ones filled and
    numbered, the rest grey; hover: layout and figures; click: its plan page."""
    scored = doc["scored"]
    top = {c["problem_key"]: c["rank"] for c in doc["candidates"]}
    xs = [c["peak_memory_mib"] / GIB for c in scored]
    ys = [c["tokens_per_s_per_gpu"] for c in scored]
    x_lo, x_hi = 0.0, max(xs) * 1.08 or 1.0
    y_lo, y_hi = min(ys) * 0.95, max(ys) * 1.03 or 1.0
    if y_hi <= y_lo:
        y_lo, y_hi = y_lo * 0.9, y_hi * 1.1 + 1
    left, right, top_m, bottom = 80, 30, 28, 42
    cw, ch = width - left - right, height - top_m - bottom

    def x_of(v: float) -> float:
        return left + (v - x_lo) / (x_hi - x_lo) * cw

    def y_of(v: float) -> float:
        return top_m + ch - (v - y_lo) / (y_hi - y_lo) * ch

    parts = [(f'<svg class="configurations" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}"'
              f' viewBox="0 0 {width} {height}" role="img" aria-label="Throughput against memory per GPU">')]
    ystep, xstep = nice_step(y_hi - y_lo, 6), nice_step(x_hi - x_lo, 8)
    for v in _ticks(y_lo, y_hi, 6):
        y = _n(y_of(v))
        parts.append(f'<line class="grid" x1="{left}" x2="{left + cw}" y1="{y}" y2="{y}"/>'
                     f'<text class="ytick" x="{left - 6}" y="{_n(y_of(v) + 4)}" text-anchor="end">'
                     f'{_tick_label(v, ystep)}</text>')
    for v in _ticks(x_lo, x_hi, 8):
        parts.append(f'<text class="tick" x="{_n(x_of(v))}" y="{height - 24}">{_tick_label(v, xstep)}</text>')
    parts.append(f'<text class="unit" x="{left + cw}" y="{height - 6}" text-anchor="end">peak GiB per GPU</text>'
                 f'<text class="unit" x="4" y="{top_m - 6}" style="text-anchor:start">tokens/s per GPU</text>')
    # the ranked ones last (rank 1 on top), so they are drawn over the others; ranked points at the same
    # place share one label ("2, 3")
    labels: dict[tuple[str, str], list[int]] = {}
    for c in scored:
        if c["problem_key"] in top:
            at = (_n(x_of(c["peak_memory_mib"] / GIB)), _n(y_of(c["tokens_per_s_per_gpu"])))
            labels.setdefault(at, []).append(top[c["problem_key"]])
    for c in sorted(scored, key=lambda c: (c["problem_key"] in top, -top.get(c["problem_key"], 0))):
        rank = top.get(c["problem_key"])
        tip = (f'{c["name"]}: {c["tokens_per_s_per_gpu"]:,.0f} tokens/s/GPU, {c["iteration_ms"]:,.1f} ms per'
               f' iteration, {c["peak_memory_mib"] / GIB:.1f} GiB peak' + (f" (rank {rank})" if rank else ""))
        look = f'fill="{TOP}" r="6"' if rank else f'fill="{OTHER}" r="4"'
        x, y = x_of(c["peak_memory_mib"] / GIB), y_of(c["tokens_per_s_per_gpu"])
        label = ""
        ranks = labels.get((_n(x), _n(y)), [])
        if rank and rank == min(ranks):
            label = f'<text class="unit" x="{_n(x + 8)}" y="{_n(y - 6)}">{", ".join(map(str, sorted(ranks)))}</text>'
        attrs = f' data-rank="{rank}"' if rank else ""
        parts.append(f'<a class="candidate{" ranked" if rank else ""}"{attrs}'
                     f' href="/dashboard/plans/{c["problem_key"]}"><circle cx="{_n(x)}" cy="{_n(y)}" {look}>'
                     f'<title>{escape(tip)}</title></circle>{label}</a>')
    parts.append("</svg>")
    return "".join(parts)


@router.get("/configurations/{key}", response_class=HTMLResponse, dependencies=gated)
def configurations_page(request: Request, key: str) -> HTMLResponse:
    doc = ConfigurationStore.of(repo_of(request)).ranking(key) if len(key) == 64 else None
    if doc is None:
        raise HTTPException(404, f"no configuration search {key}")
    return templates.TemplateResponse(request, "dashboard/configurations.html", context(
        request, key=key, doc=doc, svg=configurations_svg(doc), gib=GIB))
