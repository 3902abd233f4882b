"""The Gantt renderer: every op drawn once in its lane and colour, memory strips with limits, scale."""

from __future__ import annotations

import time

import pytest
from core_schedules import make_problem, one_f_one_b, plan_of, serialized
from matplotlib.collections import PolyCollection
from pipeplan.planner.ops import Kind
from pipeplan.planner.render import PALETTE, RenderOptions, gantt_figure, render


def _bars(fig):
    return [c for c in fig.axes[0].collections if isinstance(c, PolyCollection)]


def test_png_and_svg_bytes():
    problem = make_problem(p=2, m=3)
    plan = plan_of(problem, one_f_one_b(problem))
    png = render(problem, plan, "png")
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert render(problem, plan, "png") == png  # no timestamps: the same plan gives the same file
    svg = render(problem, plan, ".SVG")
    assert b"<svg" in svg[:400] and b"<text" in svg  # labels stay text
    with pytest.raises(ValueError, match="format: expected png or svg"):
        render(problem, plan, "pdf")


def test_every_op_drawn_once_in_its_kind_colour():
    problem = make_problem(p=2, m=3, chunks=2, placement="v", offload=True, limit=700.0, static=500.0)
    plan = plan_of(problem, serialized(problem), "serialized")
    fig = gantt_figure(problem, plan)
    bars = _bars(fig)
    assert sum(len(c.get_paths()) for c in bars) == sum(len(d.ops) for d in plan.devices)
    assert len(fig.axes[0].patches) == problem.num_devices // 2  # only the row bands: bars are collections
    # chunk 0 of each kind uses the palette colour exactly
    colours = {tuple(round(x, 3) for x in c.get_facecolor()[0][:3]) for c in bars}
    from matplotlib.colors import to_rgb
    for kind in (Kind.F, Kind.B, Kind.W, Kind.OFFLOAD, Kind.RELOAD):
        assert tuple(round(x, 3) for x in to_rgb(PALETTE[kind])) in colours
    # lanes and legend
    ticks = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert ticks == ["dev 0", "D2H", "H2D", "dev 1", "D2H", "H2D"]
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend[:5] == ["F forward", "B input grad", "W weight grad", "offload (D2H)", "reload (H2D)"]
    assert "lighter: later chunk" in legend
    # microbatch labels on the bars
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert labels.count("2") >= 8


def test_memory_strips_with_limit_and_peak():
    problem = make_problem(p=3, m=4, static=400.0, limit=900.0)
    plan = plan_of(problem, one_f_one_b(problem))
    fig = gantt_figure(problem, plan)
    assert len(fig.axes) == 1 + 3
    for d, ax in enumerate(fig.axes[1:]):
        limit_lines = [line for line in ax.get_lines() if list(line.get_ydata()) == [900.0, 900.0]]
        assert len(limit_lines) == 1
        assert any(t.get_text() == f"peak {plan.peak_memory_mib[d]:.4g} / limit 900 MiB" for t in ax.texts)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["dev 0", "dev 1", "dev 2"]  # no copies
    without = gantt_figure(problem, plan, RenderOptions(memory=False, copy_lanes="always", title="x"))
    assert len(without.axes) == 1 and len(without.axes[0].get_yticklabels()) == 9
    assert without._suptitle.get_text() == "x"


def test_title_states_metrics():
    problem = make_problem(p=4, m=8, split=False)
    plan = plan_of(problem, one_f_one_b(problem), "1F1B")
    title = gantt_figure(problem, plan)._suptitle.get_text()
    assert "1F1B" in title and "makespan 33 ms" in title and "gap 0.0%" in title and "8 microbatches" in title


def test_ten_thousand_ops_render_fast():
    problem = make_problem(p=8, m=512, p2p=0.01)
    plan = plan_of(problem, one_f_one_b(problem))
    assert sum(len(d.ops) for d in plan.devices) > 12_000
    start = time.perf_counter()
    png = render(problem, plan, "png", RenderOptions(dpi=80))
    svg = render(problem, plan, "svg")
    elapsed = time.perf_counter() - start
    assert png.startswith(b"\x89PNG") and len(svg) < 3_000_000
    assert elapsed < 30, elapsed  # about 3 s on an idle 2-core machine
    fig = gantt_figure(problem, plan)
    assert len(_bars(fig)) == 3 and len(fig.axes[0].texts) <= 4000


def test_memory_labels_stay_off_the_curves():
    """Issue 38 point 6: the peak / limit label sits beside each memory strip, never on its curve."""
    problem = make_problem(p=3, m=6, static=400.0, limit=900.0)
    plan = plan_of(problem, one_f_one_b(problem))
    fig = gantt_figure(problem, plan)
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    for ax in fig.axes[1:]:
        strip = ax.get_window_extent(renderer)
        (label,) = [t for t in ax.texts if t.get_text().startswith("peak")]
        box = label.get_window_extent(renderer)
        assert box.x0 >= strip.x1 and box.x1 <= fig.bbox.x1, (box, strip, fig.bbox)
