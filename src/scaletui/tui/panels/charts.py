"""Charts behind one small adapter (`Chart.draw`), so textual-plotext can be swapped out:
the latency time series (the expectation as a flat line), the log-log roofline (log10 taken here,
ticks labelled 10^k, because plotext's own log scale breaks on rebuild), the sweep chart
(measured points, the floor, and the expected curve), and the sparkline strips.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from textual.app import ComposeResult
from textual.containers import Grid
from textual.widgets import Label, Sparkline
from textual_plotext import PlotextPlot

from scaletui.tui.panels.fmt import num
from scaletui.tui.views import View

MARKERS = {"braille": "braille", "block": "hd", "ascii": "*"}


@dataclass(frozen=True)
class Series:
    label: str
    xs: tuple[float, ...]
    ys: tuple[float, ...]
    color: str
    scatter: bool = False


class Chart(PlotextPlot):
    """The adapter: one `draw` call replaces everything on the plot and repaints once."""

    symbols = "braille"

    def draw(
        self,
        series: list[Series],
        *,
        title: str = "",
        xlabel: str = "",
        ylabel: str = "",
        xticks: tuple[list[float], list[str]] | None = None,
        yticks: tuple[list[float], list[str]] | None = None,
        xlim: tuple[float, float] | None = None,
        ylim: tuple[float, float] | None = None,
        texts: list[tuple[str, float, float, str]] | None = None,
    ) -> None:
        plt = self.plt
        plt.clear_figure()
        marker = MARKERS.get(self.symbols, "braille")
        for s in series:
            if not s.xs:
                continue
            label = s.label or None
            if s.scatter:
                plt.scatter(list(s.xs), list(s.ys), label=label, color=s.color, marker="o")
            else:
                plt.plot(list(s.xs), list(s.ys), label=label, color=s.color, marker=marker)
        for text, x, y, color in texts or ():
            plt.text(f" {text}", x, y, color=color)
        plt.title(title)
        plt.xlabel(xlabel)
        plt.ylabel(ylabel)
        if xticks:
            plt.xticks(*xticks)
        if yticks:
            plt.yticks(*yticks)
        if xlim:
            plt.xlim(*xlim)
        if ylim:
            plt.ylim(*ylim)
        self.refresh()


class LatencyChart(Chart):
    """TTFT and TPOT over time, log10 y (TTFT is often 10-100x TPOT: on a linear axis TPOT and
    both expectations sat on the bottom row), with the expected p50s as flat lines."""

    def show(self, v: View) -> None:
        xs = v.xs
        measured = [
            ("TTFT p50", v.ttft_p50, "cyan"),
            ("TTFT p99", v.ttft_p99, "blue"),
            ("TPOT p50", v.tpot_p50, "green"),
        ]
        series, ys = [], []
        for label, values, color in measured:
            points = [(x, _log(y)) for x, y in zip(xs, values, strict=True) if y > 0]
            if points:
                series.append(Series(label, *zip(*points, strict=True), color))
                ys += [y for _, y in points]
        if xs:
            span = (xs[0], xs[-1] if xs[-1] > xs[0] else xs[0] + 1)
            for label, value, color in (
                ("exp TTFT", v.exp_ttft_ms, "magenta"),
                ("exp TPOT", v.exp_tpot_ms, "orange"),
            ):
                if value is not None and value > 0:
                    series.append(Series(label, span, (_log(value),) * 2, color))
                    ys.append(_log(value))
        if not ys:
            self.draw(series, xlabel="s", ylabel="ms (log)")
            return
        y_lo, y_hi = math.floor(min(ys)), math.ceil(max(ys) + 1e-9)
        self.draw(
            series,
            xlabel="s",
            ylabel="ms (log)",
            yticks=_decade_ticks(y_lo, y_hi, self.size.height - 4, 2),
            ylim=(y_lo, y_hi),
        )


def _log(x: float) -> float:
    return math.log10(max(x, 1e-30))


def _decade_ticks(lo: float, hi: float, cells: int, per_tick: int) -> tuple[list, list]:
    """Ticks at powers of ten, thinned so that no two land on the same row/column (plotext
    would pick the label that wins a collision in hash order, which differs run to run)."""
    ks = list(range(math.floor(lo), math.ceil(hi) + 1))
    step = max(1, math.ceil(len(ks) / max(1, cells // per_tick)))
    ks = ks[::step]
    return [float(k) for k in ks], [num(10.0**k) for k in ks]


class RooflineChart(Chart):
    """FLOP/s per chip vs arithmetic intensity (FLOPs/byte), both log10."""

    def show(self, v: View) -> None:
        p = v.prediction
        if p is None:
            self.draw([], title="roofline: no prediction (see KPIs)")
            return
        ridge = p.peak_flops / p.hbm_bw
        ai = max(p.intensity, 1e-3)
        x_lo = math.floor(_log(min(ai, ridge) / 10))
        x_hi = math.ceil(_log(max(ai, ridge) * 10))
        xs = [x_lo + (x_hi - x_lo) * i / 40 for i in range(41)]
        roof = [_log(min(p.peak_flops, p.hbm_bw * 10.0**x)) for x in xs]
        points = [Series("", (_log(ai),), (_log(p.flops_per_s_per_chip),), "magenta", True)]
        ys = [*roof, _log(p.flops_per_s_per_chip)]
        if v.meas_flops_per_chip:
            points.append(Series("", (_log(ai),), (_log(v.meas_flops_per_chip),), "cyan", True))
            ys.append(_log(v.meas_flops_per_chip))
        y_lo, y_hi = math.floor(min(ys)), math.ceil(max(ys))
        self.draw(
            [
                Series("", tuple(xs), tuple(roof), "yellow"),
                Series("", (_log(ridge),) * 2, (y_lo, y_hi), "gray"),
                *points,
            ],
            xlabel="FLOPs/byte",
            ylabel="FLOP/s",
            xticks=_decade_ticks(x_lo, x_hi, self.size.width - 8, 8),
            yticks=_decade_ticks(y_lo, y_hi, self.size.height - 4, 2),
            xlim=(x_lo, x_hi),
            ylim=(y_lo, y_hi),
        )


class SweepChart(Chart):
    """Latency vs throughput across a sweep: measured points (cyan, labelled s4 / 2qps), the
    floor for the same knobs (magenta) and the expected curve, simulated on a finer grid
    across the sweep's range (yellow)."""

    def show(self, v: View) -> None:
        meas = sorted((p.tok_s, p.tpot_ms, p.label) for p in v.sweep if p.tok_s and p.tpot_ms)
        pred = sorted(
            (p.pred_tok_s, p.pred_tpot_ms, p.label)
            for p in v.sweep
            if p.pred_tok_s and p.pred_tpot_ms
        )
        curve = sorted((x, y, "") for x, y in v.sweep_curve if x > 0 and y > 0)
        if not meas and not pred:
            self.draw([], title="no sweep yet: ^p → sweep slots 1,2,4,8 (or qps 1,2,4)")
            return
        # log-log: on a small CPU model the roofline is often 10-100x off, and all must show
        series = []
        for name, points, color, marks in (
            ("expected", curve, "yellow", False),
            ("floor", pred, "magenta", True),
            ("measured", meas, "cyan", True),
        ):
            xs = tuple(_log(x) for x, _, _ in points)
            ys = tuple(_log(y) for _, y, _ in points)
            series.append(Series(name, xs, ys, color))
            if marks:
                series.append(Series("", xs, ys, color, scatter=True))
        all_x = [_log(x) for x, _, _ in meas + pred + curve]
        all_y = [_log(y) for _, y, _ in meas + pred + curve]
        x_lo, x_hi = math.floor(min(all_x)), math.ceil(max(all_x) + 1e-9)
        y_lo, y_hi = math.floor(min(all_y)), math.ceil(max(all_y) + 1e-9)
        self.draw(
            series,
            xlabel="output tok/s (log)",
            ylabel="TPOT p50 ms",
            texts=[(label, _log(x), _log(y), "cyan") for x, y, label in meas],
            xticks=_decade_ticks(x_lo, x_hi, self.size.width - 8, 8),
            yticks=_decade_ticks(y_lo, y_hi, self.size.height - 4, 2),
            xlim=(x_lo, x_hi),
            ylim=(y_lo, y_hi),
        )


class Strips(Grid):
    """Sparklines: throughput, queue, slot occupancy, KV use, with their latest value."""

    NAMES = (("tok_s", "tok/s"), ("queue", "queue"), ("occupancy", "slots"), ("kv", "KV"))

    def compose(self) -> ComposeResult:
        for key, label in self.NAMES:
            yield Label(label, id=f"lbl-{key}", classes="strip-label")
            yield Sparkline([], id=f"spark-{key}", summary_function=max)

    def show(self, v: View) -> None:
        data = {
            "tok_s": v.spark_tok_s,
            "queue": v.spark_queue,
            "occupancy": v.spark_occupancy,
            "kv": v.spark_kv,
        }
        for key, label in self.NAMES:
            values = list(data[key])
            last = values[-1] if values else None
            if key in ("occupancy", "kv"):
                text = "—" if last is None else f"{last * 100:.0f}%"
            else:
                text = num(last)
            self.query_one(f"#lbl-{key}", Label).update(f"{label:<6}{text:>6}")
            self.query_one(f"#spark-{key}", Sparkline).data = values
