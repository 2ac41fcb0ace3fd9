"""Memory bar per chip: weights, KV cache, free (measured), with the prediction beside it."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from scaletui.tui.panels.fmt import nbytes
from scaletui.tui.views import View


class MemoryBar(Static):
    def show(self, v: View) -> None:
        width = max(10, self.size.width - 4)
        w, kv, cap = v.mem_weights, v.mem_kv, v.mem_capacity
        text = Text()
        if w is not None and kv is not None:
            total = cap if cap and cap >= w + kv else w + kv
            nw = round(width * w / total) if total else 0
            nk = round(width * kv / total) if total else 0
            text.append("█" * nw, "magenta")
            text.append("█" * nk, "cyan")
            text.append("░" * max(0, width - nw - nk), "dim")
            text.append("\n")
            text.append("■ weights ", "magenta").append(nbytes(w))
            text.append("  ■ KV ", "cyan").append(nbytes(kv))
            if cap:
                text.append("  free ", "dim").append(nbytes(max(0.0, cap - w - kv)))
        else:
            text.append("measured: waiting for /stats", "dim")
        p = v.prediction
        if p is not None:
            text.append("\npred ", "dim").append(
                f"weights {nbytes(p.weight_bytes_per_chip)} KV {nbytes(p.kv_bytes_per_chip)}"
            )
            if not p.fits:
                text.append("  DOES NOT FIT", "bold red")
        self.update(text)
