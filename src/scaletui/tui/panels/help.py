"""Help: the keys (built from the active bindings, so it cannot drift) and a glossary."""

from __future__ import annotations

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import DataTable, Markdown

GLOSSARY = """\
## How to read this screen
Every number is shown as **pred | meas | Δ**: the roofline prediction (a floor: no queueing,
no overhead), what was measured, and Δ = (measured − predicted) / predicted. `pred*` means the
prediction is for **pending** knobs not yet applied (`a` applies them).

## Glossary
- **TTFT** time to first token: request sent → first token received (client side, loadgen).
  Predicted: prefill time of one prompt (compute-bound matmuls + causal attention).
- **TPOT** time per output token after the first: (E2E latency − TTFT) / (tokens − 1).
  Predicted: the decode step time.
- **p50 / p99** median and 99th percentile over requests finished in the last 1 s window.
- **decode step** one generate step for all slots (/stats generate per-token mean). Roofline:
  KV load time + max(weight load time, matmul time).
- **output tok/s** generated tokens per second over all chips (mean of the last 5 windows).
- **mem/chip** weights + KV cache bytes per device (predicted: weights / tp, plus KV for
  every slot at the server's max_seq_len, / chips).
- **predicted on** the hardware spec: `local` is this host, measured by `scaletui calibrate`
  (run once at start when missing); otherwise a built-in spec, named in the KPI panel.
- **slots** the decode batch size (KV-cache slots). **tp** tensor parallelism (shards heads and
  d_ff; weights per chip ÷ tp). **dp** data parallelism (shards slots). **mode** interleaved
  (prefill and decode share devices) or disaggregated (prefill on its own devices).
- **arithmetic intensity** FLOPs per byte moved from HBM. Below the **ridge point**
  (peak FLOP/s ÷ HBM bandwidth) a step is memory-bound, above it compute-bound.
- **roofline chart** log-log: the yellow roof is min(peak, bandwidth × intensity); ○ predicted,
  ○ measured (cyan) FLOP/s per chip at the decode step's intensity.
- **efficiency** measured tok/s ÷ predicted tok/s for a run.
- **queue** requests waiting at the server; **KV** tokens held ÷ (slots × max_seq_len).
- **sweep** runs the load at a list of slot counts or rates; the Sweep tab plots TPOT vs tok/s
  (log-log), measured against predicted. Open-loop rates are predicted at the batch that carries
  the offered load.
"""


def key_rows(app: App) -> list[tuple[str, str, bool]]:
    """(key as typed, what it does, available now) for the App's own active bindings (not the
    focused widget's cursor keys), so the table cannot drift from the bindings."""
    rows = []
    for active in app.active_bindings.values():
        if active.node is app:
            b = active.binding
            rows.append((app.get_key_display(b), b.description or b.action, bool(active.enabled)))
    return rows


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape,q,question_mark,f1", "dismiss", "Close", id="help.close"),
    ]

    def __init__(self, bindings: list[tuple[str, str, bool]]) -> None:
        super().__init__()
        self._rows = bindings

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-body"):
            table = DataTable(id="help-keys", cursor_type="none", show_cursor=False)
            table.add_columns("key", "action", "now")
            for key, desc, enabled in self._rows:
                table.add_row(key, desc, "" if enabled else "unavailable")
            yield table
            yield Markdown(GLOSSARY, id="help-glossary")

    def action_dismiss(self) -> None:
        self.dismiss(None)
