"""Number formatting shared by the panels (fixed widths, SI suffixes, signed deltas)."""

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


def nbytes(x: float | None) -> str:
    if x is None:
        return "—"
    for div, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(x) >= div:
            return f"{x / div:.3g} {suffix}"
    return f"{x:.0f} B"


def delta(d: float | None) -> str:
    if d is None:
        return "—"
    ratio = 1 + d
    if ratio >= 10:
        return f"×{num(ratio)}"
    if 0 < ratio <= 0.1:
        return f"÷{num(1 / ratio)}"
    return f"{d * 100:+.0f}%"


def delta_style(d: float | None, higher_is_better: bool = False) -> str:
    """Theme-friendly colour by how far measured is from the roofline (nvitop-style bands)."""
    if d is None:
        return "dim"
    worse = -d if higher_is_better else d
    if worse <= 0.25:
        return "green"
    if worse <= 1.0:
        return "yellow"
    return "red"
