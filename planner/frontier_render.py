"""The frontier as a picture: iteration time against memory per GPU, the proven-bound band beneath,
the GPU's memory as a line with the points beyond it flagged, the peers as labelled points (PNG or
SVG bytes, same Agg/no-pyplot style as planner.render)."""

from __future__ import annotations

import io
import textwrap
from typing import Any

from matplotlib import rc_context
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .frontier import chart_window, off_chart_note, x_label

GIB = 1024.0
CURVE = "#0072B2"  # Okabe-Ito blue, planner.render's F colour
BAND = "#56B4E9"
PEER = "#D55E00"
BEYOND = "#CC79A7"  # Okabe-Ito reddish purple: points that need more memory than the GPU has
MARKERS = "osD^v<>ph*XP"


def frontier_figure(doc: dict[str, Any], title: str | None = None) -> Figure:
    """Step curve (a plan found at a budget holds for every larger one), the band between each point's
    proven bound and its plan, each peer at its own peak memory, and the GPU's memory."""
    points = sorted(doc["points"], key=lambda p: p["factor"])
    win = chart_window(doc)
    x = [p["budget_mib"] / GIB for p in points]
    ms = [p["makespan_ms"] for p in points]
    lb = [p["bound_ms"] for p in points]
    note = off_chart_note(win.off_chart)
    fig = Figure(figsize=(11.5, 5.6 if note else 5.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    left, right = win.x_mib[0] / GIB, win.x_mib[1] / GIB
    xs, ys, bs = x + [right], ms + [ms[-1]], lb + [lb[-1]]
    ax.fill_between(xs, bs, ys, step="post", color=BAND, alpha=0.35, lw=0, label="gap to the proven bound")
    ax.step(xs, bs, where="post", color=BAND, lw=1.0, ls="--", label="proven lower bound")
    ax.step(xs, ys, where="post", color=CURVE, lw=2.0, label="pipeplan frontier")
    inside = [i for i, p in enumerate(points) if not p.get("beyond_hbm")]
    beyond = [i for i, p in enumerate(points) if p.get("beyond_hbm")]
    ax.plot([x[i] for i in inside], [ms[i] for i in inside], "o", color=CURVE, ms=5)
    if win.hbm_mib is not None:
        hbm = win.hbm_mib / GIB
        ax.axvspan(hbm, right, color="0.5", alpha=0.08, lw=0)
        ax.axvline(hbm, color="0.25", lw=1.2, ls=":", label=f"GPU memory {hbm:.1f} GiB ({doc.get('hbm_of')})")
    if beyond:
        ax.plot([x[i] for i in beyond], [ms[i] for i in beyond], "o", color=BEYOND, ms=8, mfc="none", mew=2,
                label="point beyond the GPU's memory")
    seen: dict[str, str] = {}
    for peer in win.peers:
        name = peer["name"]
        marker = seen.setdefault(name, MARKERS[len(seen) % len(MARKERS)])
        ax.plot(peer["budget_mib"] / GIB, peer["makespan_ms"], marker, color=PEER, ms=7, mfc="none", mew=1.5,
                label=name)  # repeated names collapse in the legend below
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    # beside the axes, never over a point
    ax.legend(unique.values(), unique.keys(), fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              frameon=False)
    ax.set_xlim(left, right)
    ax.set_ylim(*win.y_ms)
    ax.set_xlabel(x_label(doc))
    ax.set_ylabel("iteration time (ms)")
    ax.set_title(title or f"time-memory frontier: {len(points)} points, key {doc['problem_key'][:12]}…",
                 fontsize=10, loc="left")
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)
    ax.grid(alpha=0.25)
    if note:
        fig.text(0.01, 0.01, textwrap.fill(note, 180), fontsize=7.5, color="0.3", va="bottom")
    fig.tight_layout(rect=(0, 0.05 if note else 0, 1, 1))
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
