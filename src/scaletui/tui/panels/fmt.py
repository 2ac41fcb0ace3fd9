"""Number formatting shared by the panels (fixed widths, SI suffixes, ratios)."""

from __future__ import annotations


def num(x: float | None, unit: str = "") -> str:
    """3 significant digits with an SI suffix: 1234 -> 1.23k; None -> '—'."""
    if x is None:
        return "—"
    if unit == "B":
        return nbytes(x)
    ax = abs(x)
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if ax >= div:
            return f"{x / div:.3g}{suffix}"
    if ax >= 100:
        return f"{x:.0f}"
    if 0 < ax < 0.01:
        return f"{x:.0e}"
    return f"{x:.3g}"


def nbytes(x: float | None, sep: str = " ") -> str:
    """1.63 MiB (`sep` "" for narrow columns: 1.63MiB)."""
    if x is None:
        return "—"
    for div, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(x) >= div:
            return f"{x / div:.3g}{sep}{suffix}"
    return f"{x:.0f}{sep}B"


def ratio(r: float | None) -> str:
    """measured / expected as a factor in at most 5 cells: 'x1.07', 'x62', 'x3k', '÷15',
    '÷3k'; None -> '—'."""
    if r is None or r <= 0:
        return "—"
    if r >= 10:
        return f"×{r / 1e3:.0f}k" if r >= 999.5 else f"×{r:.0f}"
    if r >= 0.1:
        return f"×{r:.2f}"
    inv = 1 / r
    return f"÷{inv / 1e3:.0f}k" if inv >= 999.5 else f"÷{inv:.0f}"


def ratio_style(r: float | None) -> str:
    """Green within 25% of 1 either way, yellow within 2x, red beyond: a ratio far from 1,
    above or below, means the cost model or the simulation misses something."""
    if r is None or r <= 0:
        return "dim"
    off = max(r, 1 / r)
    if off <= 1.25:
        return "green"
    if off <= 2.0:
        return "yellow"
    return "red"
