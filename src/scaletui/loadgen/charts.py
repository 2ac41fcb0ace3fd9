"""The report's figures, drawn with matplotlib into a Figure or SubFigure that the caller owns.

Each `draw_*` fills the (sub)figure it is given, so the HTML (one Figure per chart, as inline
SVG) and the PNG (every chart as a SubFigure of one tall Figure) draw the same thing. No pyplot:
Figure objects carry no global state and need no display. Latencies are in ms, rates in req/s.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import matplotlib
import numpy as np
from matplotlib.figure import Figure, SubFigure

from scaletui.loadgen.results import Samples

PANEL_W, PANEL_H = 10.0, 3.8  # inches of one chart (two panels side by side)
X_KEYS = {"throughput": "request_throughput", "rate": "requested_rate"}
X_LABELS = {"throughput": "achieved throughput (completed req/s)", "rate": "offered rate (req/s)"}
METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"))
STYLES = ("-", "--", ":", "-.")  # one per percentile


@dataclass(frozen=True)
class Curve:
    """One line set on the latency-vs-rate chart: a result file's stages, in stage order."""

    name: str  # the legend's name
    stages: Sequence[dict]  # loadgen summaries
    predicted: bool = False  # from `scaletui simulate`: drawn grey, square markers
    max_rate: float | None = None  # an SLO search's answer, marked as a vertical line


Draw = Callable[[Figure | SubFigure], None]


def percentile_key(metric: str, p: float) -> str:
    """The summary key of a latency percentile: p50 -> median_ttft_ms (vLLM's name)."""
    return f"median_{metric}_ms" if p == 50 else f"p{p:g}_{metric}_ms"


def curve_points(stages: Sequence[dict], x: str, key: str) -> tuple[list[float], list[float]]:
    """(x, y) of the stages that have both, sorted by x."""
    pts = sorted(
        (s[X_KEYS[x]], s[key])
        for s in stages
        if s.get(X_KEYS[x]) is not None and s.get(key) is not None
    )
    return [p[0] for p in pts], [p[1] for p in pts]


def draw_latency(curves: Sequence[Curve], x: str, percentiles: Sequence[float]) -> Draw:
    """TTFT and TPOT percentiles against throughput or offered rate, one point per stage."""

    def draw(fig: Figure | SubFigure) -> None:
        axes = fig.subplots(1, 2)
        colors = iter(f"C{i}" for i in range(100))
        for c in curves:
            color = "0.45" if c.predicted else next(colors)
            for ax, (metric, _) in zip(axes, METRICS, strict=True):
                for p, style in zip(percentiles, STYLES, strict=False):
                    xs, ys = curve_points(c.stages, x, percentile_key(metric, p))
                    if xs:
                        ax.plot(
                            xs,
                            ys,
                            linestyle=style,
                            marker="s" if c.predicted else "o",
                            color=color,
                            label=f"{c.name} p{p:g}",
                        )
                if c.max_rate is not None:
                    ax.axvline(c.max_rate, color=color, linewidth=1, alpha=0.7)
                    ax.annotate(
                        f" max_rate {c.max_rate:.3g}",
                        (c.max_rate, 1),
                        xycoords=("data", "axes fraction"),
                        va="top",
                        fontsize=8,
                        color=color,
                    )
        for ax, (_, title) in zip(axes, METRICS, strict=True):
            ax.set_title(f"{title} vs {x}")
            ax.set_xlabel(X_LABELS[x])
            ax.set_ylabel(f"{title} (ms)")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.suptitle("Latency against load (one point per stage)")

    return draw


def cdf(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted values and their empirical CDF (i / n for the i-th smallest)."""
    v = np.sort(values)
    return v, np.arange(1, v.size + 1) / v.size


def draw_cdfs(samples: Sequence[Samples]) -> Draw:
    """TTFT and TPOT CDFs, one line per stage of each per-request file."""

    def draw(fig: Figure | SubFigure) -> None:
        axes = fig.subplots(1, 2)
        for ax, (metric, title) in zip(axes, METRICS, strict=True):
            for s in samples:
                values = s.ttft_ms if metric == "ttft" else s.tpot_ms
                if values.size:
                    ax.step(*cdf(values), where="post", label=f"{s.name} (n={values.size})")
            ax.set_title(f"{title} CDF")
            ax.set_xlabel(f"{title} (ms)")
            ax.set_ylabel("fraction of requests")
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.suptitle("Latency distributions (per-request records)")

    return draw


def draw_per_turn(rows_by_name: Sequence[tuple[str, list[dict]]]) -> Draw:
    """TTFT p50 and p99 by conversation turn, one line set per result stage with turns."""

    def draw(fig: Figure | SubFigure) -> None:
        ax = fig.subplots(1, 1)
        for i, (name, rows) in enumerate(rows_by_name):
            turns = [r["turn"] for r in rows]
            for p, style in ((50, "-"), (99, "--")):
                ys = [r.get(percentile_key("ttft", p)) for r in rows]
                ys = [np.nan if y is None else y for y in ys]
                ax.plot(turns, ys, style, marker="o", color=f"C{i}", label=f"{name} p{p}")
        ax.set_title("TTFT by conversation turn")
        ax.set_xlabel("turn (0 = first)")
        ax.set_ylabel("TTFT (ms)")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)

    return draw


def figure(draw: Draw, height: float = PANEL_H) -> Figure:
    fig = Figure(figsize=(PANEL_W, height), layout="constrained")
    draw(fig)
    return fig


def svg(draw: Draw) -> str:
    """The chart as an inline <svg> element: no XML prolog, no DOCTYPE, no metadata (they name
    URLs; nothing in the SVG loads anything), text as <text> in the page's sans-serif font
    (searchable, and a tenth of the size of glyph paths)."""
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        figure(draw).savefig(buf, format="svg", metadata={"Date": None}, bbox_inches="tight")
    text = buf.getvalue()
    text = text[text.index("<svg") :]
    return re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.DOTALL)


def png(draws: Sequence[Draw], dpi: int = 100) -> bytes:
    """Every chart stacked in one PNG."""
    fig = Figure(figsize=(PANEL_W, PANEL_H * len(draws)), layout="constrained")
    subs = fig.subfigures(len(draws), 1, squeeze=False)[:, 0]
    for draw, sub in zip(draws, subs, strict=True):
        draw(sub)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
