"""Plots drawn with matplotlib (the ``plot`` extra), PNG, SVG or PDF by the path's extension: busbw against
message size from ``torchhpc bench`` points (one panel per collective and rank count, one line per
implementation), and per-call costs as grouped bars (``bench/accl_overhead.py``)."""

from __future__ import annotations

from .report import human
from .results import COLLECTIVES, LABELS, Point

__all__ = ["PlotUnavailableError", "figure", "write_cost_plot", "write_plot"]

COLORS = {"accl": "#d62728", "mpi-upstream": "#1f77b4", "gloo": "#2ca02c", "mpi4py": "#222222",
          "mpi4py-numpy": "#8c8c8c"}
STYLES = {"mpi4py": "--", "mpi4py-numpy": ":"}  # the raw MPI lines are dashed


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed (it is an optional extra)."""


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on a compute or login node
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailableError(
            "torchhpc bench --plot needs matplotlib: pip install 'torchhpc[plot]' (or matplotlib); "
            "the tables and --json need nothing more") from None
    return plt


def _panel(ax, points: list[Point], impls: list[str], n: int, coll: str) -> None:
    """One panel: ``coll`` at ``n`` ranks, a log-log busbw line per implementation that has points there."""
    for impl in impls:
        pts = sorted((p for p in points if (p.ranks, p.collective, p.impl) == (n, coll, impl) and p.busbw() > 0),
                     key=lambda p: p.size)
        if pts:
            ax.plot([p.size for p in pts], [p.busbw() for p in pts], STYLES.get(impl, "-"), marker=".",
                    color=COLORS.get(impl), label=LABELS.get(impl, impl), linewidth=1.4)
    ax.set(xscale="log", yscale="log", title=f"{coll}, {n} ranks")
    ax.grid(True, which="major", color="#e5e5e5")


def figure(points: list[Point], impls: list[str], title: str = ""):
    """The matplotlib Figure of ``points``: a panel per (rank count, collective), log-log busbw vs size, one
    line per implementation of ``impls`` that has points there (legend once, above the panels, every entry with
    its line; ``title`` above it: what the run was, e.g. the link)."""
    plt = _pyplot()
    impls = [i for i in impls if any(p.impl == i for p in points)]
    colls = [c for c in COLLECTIVES if any(p.collective == c for p in points)]
    ranks = sorted({p.ranks for p in points})
    fig, axes = plt.subplots(len(ranks), len(colls), figsize=(3.2 * len(colls), 2.6 * len(ranks) + 0.5),
                             sharex=True, sharey=True, squeeze=False)
    for row, n in enumerate(ranks):
        for col, coll in enumerate(colls):
            _panel(axes[row][col], points, impls, n, coll)
    _axis_labels(axes, sorted({p.size for p in points}))
    _legend_and_title(fig, impls, title)
    return fig


def _axis_labels(axes, sizes: list[int]) -> None:
    """Size ticks in words along the bottom row, busbw along the left column."""
    ticks = [s for s in (8, 1 << 10, 1 << 20, 1 << 30) if sizes and sizes[0] <= s <= sizes[-1]]
    for ax in axes[-1]:
        ax.set_xlabel("message size")
        ax.set_xticks(ticks, [human(s).replace(" ", "") for s in ticks])
    for ax in axes[:, 0]:
        ax.set_ylabel("busbw (GB/s)")


def _legend_and_title(fig, impls: list[str], title: str) -> None:
    """One legend entry per implementation, drawn as its lines are (a panel's own handles miss what it lacks),
    above the panels, and the title above the legend."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], linestyle=STYLES.get(i, "-"), marker=".", color=COLORS.get(i), linewidth=1.4)
               for i in impls]
    top = 1 - (0.4 + (0.3 if title else 0)) / fig.get_figheight()
    fig.legend(handles, [LABELS.get(i, i) for i in impls], loc="upper center", ncol=max(1, len(impls)),
               frameon=False, bbox_to_anchor=(0.5, top + 0.4 / fig.get_figheight()))
    if title:
        fig.suptitle(title, y=1 - 0.05 / fig.get_figheight(), va="top", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, top))


def write_plot(path: str, points: list[Point], impls: list[str], title: str = "") -> None:
    """Draw :func:`figure` into ``path`` (the format from its extension: .png, .svg, .pdf)."""
    _save(_pyplot(), figure(points, impls, title), path)


def write_cost_plot(path: str, costs: dict[str, dict[str, tuple[float, float, float]]], title: str) -> None:
    """Per-call costs as horizontal grouped bars: ``costs[case][series] = (median, min, max)`` in µs, one group
    per case, one bar per series with its min-max range as an error bar; a log axis, since they span decades."""
    plt = _pyplot()
    cases = list(costs)
    series = list(dict.fromkeys(k for row in costs.values() for k in row))
    fig, ax = plt.subplots(figsize=(9, 1.4 + 0.22 * len(cases) * len(series)))
    height = 0.8 / max(1, len(series))
    for j, name in enumerate(series):
        ys = [i + (j - (len(series) - 1) / 2) * height for i, case in enumerate(cases) if name in costs[case]]
        meds = [costs[case][name] for case in cases if name in costs[case]]
        err = [[m - lo for m, lo, _ in meds], [hi - m for m, _, hi in meds]]
        ax.barh(ys, [m for m, _, _ in meds], height, xerr=err, label=name, color=COLORS.get(name),
                error_kw={"lw": 0.8})
    ax.set_yticks(range(len(cases)), cases)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("µs per call (median, min-max of the rounds)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, frameon=False, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    _save(plt, fig, path)


def _save(plt, fig, path: str) -> None:
    # text stays text in an SVG (small, searchable); a fixed id salt and no date make the same data draw the
    # same file, so a plot redrawn from unchanged data leaves the checkout unchanged
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "torchhpc"}):
        meta = {"Date": None} if path.endswith((".svg", ".pdf")) else {}
        fig.savefig(path, dpi=120, metadata=meta, bbox_inches="tight")  # nothing cut at the edges
    plt.close(fig)
