"""The frontier as a picture: iteration time against per-GPU memory, the proven-bound band beneath,
the peers as labelled points (PNG or SVG bytes, same Agg/no-pyplot style as planner.render)."""

from __future__ import annotations

import io
from typing import Any

from matplotlib import rc_context
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

GIB = 1024.0
CURVE = "#0072B2"  # Okabe-Ito blue, planner.render's F colour
BAND = "#56B4E9"
PEER = "#D55E00"
MARKERS = "osD^v<>ph*XP"


def frontier_figure(doc: dict[str, Any], title: str | None = None) -> Figure:
    """Step curve (a plan found at a budget holds for every larger one), the band between each point's
    proven bound and its plan, and each peer at its own peak memory."""
    points = sorted(doc["points"], key=lambda p: p["factor"])
    x = [p["budget_mib"] / GIB for p in points]
    ms = [p["makespan_ms"] for p in points]
    lb = [p["bound_ms"] for p in points]
    fig = Figure(figsize=(9.5, 5.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    peers = doc.get("peers", [])
    right = max(x + [p["budget_mib"] / GIB for p in peers]) * 1.03
    xs, ys, bs = x + [right], ms + [ms[-1]], lb + [lb[-1]]
    ax.fill_between(xs, bs, ys, step="post", color=BAND, alpha=0.35, lw=0, label="gap to the proven bound")
    ax.step(xs, bs, where="post", color=BAND, lw=1.0, ls="--", label="proven lower bound")
    ax.step(xs, ys, where="post", color=CURVE, lw=2.0, label="pipeplan frontier")
    ax.plot(x, ms, "o", color=CURVE, ms=5)
    seen: dict[str, str] = {}
    for peer in peers:
        name = peer["name"]
        marker = seen.setdefault(name, MARKERS[len(seen) % len(MARKERS)])
        ax.plot(peer["budget_mib"] / GIB, peer["makespan_ms"], marker, color=PEER, ms=7, mfc="none", mew=1.5,
                label=name)  # repeated names collapse in the legend below
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8, loc="upper right", ncol=2, frameon=False)
    top = max([p["makespan_ms"] for p in peers if p["budget_mib"] / GIB <= right] + ms)
    ax.set_ylim(min(lb) * 0.97, min(top, max(ms) * 1.6) * 1.03)
    ax.set_xlim(min(x) * 0.97, right)
    ax.set_xlabel("memory budget per GPU (GiB, largest device limit)")
    ax.set_ylabel("iteration time (ms)")
    ax.set_title(title or f"time-memory frontier: {len(points)} points, key {doc['problem_key'][:12]}…",
                 fontsize=10, loc="left")
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)
    ax.grid(alpha=0.25)
    fig.tight_layout()
    return fig


def render_frontier(doc: dict[str, Any], fmt: str = "png", title: str | None = None, dpi: int = 150) -> bytes:
    fmt = fmt.lower().lstrip(".")
    if fmt not in ("png", "svg"):
        raise ValueError(f"format: expected png or svg, got {fmt!r}")
    with rc_context({"svg.fonttype": "none", "svg.hashsalt": "pipeplan"}):
        fig = frontier_figure(doc, title)
        buffer = io.BytesIO()
        fig.savefig(buffer, format=fmt, dpi=dpi, metadata={"Software": None} if fmt == "png" else {"Date": None})
    return buffer.getvalue()
