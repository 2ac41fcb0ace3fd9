"""Help: the keys (built from the active bindings, so it cannot drift) and a glossary."""

from __future__ import annotations

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import DataTable, Markdown

GLOSSARY = """\
## How to read this screen
Every number comes in three levels, **floor | exp | meas**, then **m/e** = measured ÷ expected:
- **floor**: the book's roofline on this host's calibrated roofs (the `local` spec, or the spec
  the knobs name). The best any server could do: no overheads, no queueing, one number for p50
  and p99. On a CPU the tp × dp devices are virtual and share the host's roofs, so tp 2 does not
  double the floor.
- **expected** (exp): our own scheduler simulated on a cost model fitted by timing this server's
  engine (`scaletui calibrate --model M`, run for you once per server configuration). It
  includes the per-step overheads, padding to slots and KV buckets, batching and queueing, so
  it is what this server should measure. Latency and tok/s are the simulated run's same part
  as measured: its completions (and its seconds) that the last 5 s hold, so a closed loop's
  first wave, slow in both, is compared with itself. Without a fit for the configuration it
  uses assumed efficiencies on the spec's roofs, and says so. The status bar names the fit in use.
- **measured** (meas): what loadgen saw over the run's last 5 s (its last five 1 s windows,
  pooled); the decode step from the server's /stats.
- **m/e** near ×1.00 (green) means the cost model and the simulation explain the server. Far
  from 1, either way, something is not modelled: a ratio above 1 on latency (or below 1 on
  tok/s) is time the server spends that the fit never timed (a new shape, interference, a
  stale or assumed fit: try `refit`); the other way, the fit was timed on a slower moment.
  A big gap between floor and expected is overhead the roofline ignores. A yellow note under
  the KPIs says when the server's own decode step runs more than 15 % off its fit: the host's
  speed moved since the fit (shared hosts drift 10-20 % in minutes) or the slots are a batch
  the fit did not time, and every m/e carries that, not the scheduling.
- **run**: when the server prices its calls by this host's fit, a green line gives its speed
  factor (its calls' time ÷ the fit's, per kind) and the `run` column is exp simulated again
  at that speed ("as run"): meas near run means the host was slow, not the model wrong.
`*` after floor / exp means both are for **pending** knobs not yet applied (`a` applies them).

## Glossary
- **TTFT** time to first token: request sent → first token received (client side, loadgen).
  Floor: prefill time of one prompt (compute-bound matmuls + causal attention).
- **TPOT** time per output token after the first: (E2E latency − TTFT) / (tokens − 1).
  Floor: the decode step time.
- **p50 / p99** median and 99th percentile over requests finished in the run's last 5 s (each
  1 s window's percentile counted once per request it finished; the newest window with
  requests when none finished in those 5 s).
- **decode step** one generate step for all slots (/stats generate call time ÷ its steps).
  Floor: KV load time + max(weight load time, matmul time). Expected: the cost model's generate
  call over every slot row at the KV bucket the longest request reaches, ÷ its steps.
- **output tok/s** generated tokens per second over all chips (mean of the last 5 windows).
- **mem/chip** weights + KV cache bytes per device (floor and expected: weights / tp, plus KV
  for every slot at the server's max_seq_len, / chips), at the shown precision.
- **predict on** the hardware spec of the floor: `local` is this host, measured by `scaletui
  calibrate` (run once at start when missing); otherwise a built-in spec, named in the KPI panel.
  With another spec chosen as a what-if, expected uses assumed efficiencies on it too.
- **weights / KV cache** (`w` / `k`, f32 → bf16 → int8) how the server stores them: 4, 2 or
  1 byte a value (int8 adds f32 scales). The decode step reads every weight once, so int8
  weights halve bf16's weight read; a narrower KV cache fits more slots (**max slots** in the
  memory panel: slots of max_seq_len tokens that fit beside the weights; **at ctx**: sequences
  whose KV pages fit at the load's own prompt + output length, what the paged cache can run
  when --max-running allows; then pages held / all, cached prefix pages, the prefix-cache hit
  rate and preemptions, as the server counts them). The status bar shows
  what runs: `f32`, or `f32·w int8·kv bf16`; compute stays in the server's --dtype, and the
  server refuses storage wider than it (e.g. f32 weights on a bf16 server).
- **slots** the decode batch size (KV-cache slots). **tp** tensor parallelism (shards heads and
  d_ff; weights per chip ÷ tp). **dp** data parallelism (shards slots). **mode** interleaved
  (prefill and decode share devices) or disaggregated (prefill on its own devices).
- **page size** KV positions per page of the server's paged cache (`:page 32`); smaller pages
  waste less at a sequence's end and share prefixes more finely. **tok budget** prompt tokens
  the server runs between two generate calls (`:budget 256`, 0 = whole prompts): a long prompt
  runs in pieces so the other streams keep decoding (ITL falls, its own TTFT rises).
- **arithmetic intensity** FLOPs per byte moved from HBM. Below the **ridge point**
  (peak FLOP/s ÷ HBM bandwidth) a step is memory-bound, above it compute-bound.
- **roofline chart** log-log: the yellow roof is min(peak, bandwidth × intensity); ○ floor
  (magenta), ○ measured (cyan) FLOP/s per chip at the decode step's intensity.
- **Runs** each run's expected / measured TTFT, TPOT and tok/s, and tok/s measured ÷ expected.
- **queue** requests waiting at the server; **KV** tokens held ÷ (slots × max_seq_len).
- **sweep** runs the load at a list of slot counts or rates; the Sweep tab plots TPOT vs tok/s
  (log-log): measured points (cyan), the floor for the same knobs (magenta) and the expected
  curve, simulated across the sweep's range on a finer grid (yellow).
- **refit** (palette) times this server's engine again and refits its cost model.
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
