"""Memory per chip: a bar of weights, KV cache and free (measured), then the measured and the
predicted bytes side by side in fixed-width columns (the panel is 28 cells wide at its narrowest,
so nothing wraps), and the KV capacity: how many slots of max_seq_len tokens fit beside the
weights (it grows as the weights or the KV cache are stored narrower, `w`/`k`); then the paged
cache as the server counts it: pages held of all, pages cached, prefix hit rate, preemptions."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from scaletui.tui.panels.fmt import nbytes, num
from scaletui.tui.views import View


class MemoryBar(Static):
    def show(self, v: View) -> None:
        width = max(10, self.size.width - 4)
        w, kv, cap = v.mem_weights, v.mem_kv, v.mem_capacity
        p = v.prediction
        text = Text(no_wrap=True, overflow="ellipsis")
        if w is not None and kv is not None:
            total = cap if cap and cap >= w + kv else w + kv
            nw = round(width * w / total) if total else 0
            nk = round(width * kv / total) if total else 0
            text.append("█" * nw, "magenta")
            text.append("█" * nk, "cyan")
            text.append("░" * max(0, width - nw - nk), "dim")
        else:
            text.append("measured: waiting for /stats", "dim")
        text.append(f"\n{'':9} {'meas':>8} {'pred':>8}", "dim")
        rows = (
            ("■ weights", "magenta", w, p and p.weight_bytes_per_chip),
            ("■ KV", "cyan", kv, p and p.kv_bytes_per_chip),
        )
        for label, style, measured, predicted in rows:
            text.append("\n").append(f"{label:9}", style)
            text.append(f" {nbytes(measured):>8} {nbytes(predicted):>8}")
        if cap and w is not None and kv is not None:
            text.append(f"\n{'free':9} {nbytes(max(0.0, cap - w - kv)):>8}", "dim")
        max_slots = None if p is None else p.max_slots
        if v.mem_max_slots is not None or max_slots is not None:
            text.append(f"\n{'max slots':9}")
            for slots in (v.mem_max_slots, max_slots):
                text.append(f" {'—' if slots is None else num(slots):>8}")
        if p is not None and p.max_running:  # the pages a request holds at its own length
            text.append(f"\n{'at ctx':9} {'':>8} {num(p.max_running):>8}", "dim")
        if p is not None and not p.fits:
            text.append("  DOES NOT FIT", "bold red")
        pages = v.kv_pages
        if pages.get("pages_total"):
            text.append(f"\n{'pages':9} {pages.get('pages_used', 0):>6}/{pages['pages_total']}")
            text.append(f" cached {pages.get('pages_cached', 0)}", "dim")
            hit = pages.get("prefix_cache_hit_rate") or 0.0
            text.append(f"\n{'prefix':9} {100 * hit:>7.0f}%  preempt {pages.get('preemptions', 0)}")
        self.update(text)
