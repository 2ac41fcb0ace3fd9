"""Command palette provider (ctrl+p or `:`): fixed actions plus typed commands such as
`slots 16`, `tp 2`, `qps 4`, `concurrency 8`, `input 256`, `output 64`, `hardware h100`,
`mode disaggregated`, `prefill 2`, `sweep slots 1,2,4,8`, `sweep qps 1,2,4`, `symbols block`."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from textual.command import DiscoveryHit, Hit, Hits, Provider

if TYPE_CHECKING:
    from scaletui.tui.ui import ScaleTUI

ACTIONS = (
    ("Apply pending config", "apply", "restart/reshard the server with the pending knobs"),
    ("Rerun load", "rerun", "start a new run with the applied config"),
    ("Discard pending edits", "discard", "drop knob edits not yet applied"),
    ("Sharding picker", "sharding", "choose tp x dp and mode with predicted memory per chip"),
    ("Export runs", "export", "write runs, last summary and /stats to JSON + CSV"),
    ("Restart server", "restart_server", "start the server child again after it died"),
    ("Pause display", "pause", "freeze or resume the display (recording continues)"),
    ("Help and glossary", "help", "keys and what every metric means"),
)
TYPED = {
    "slots": ("slots", int),
    "tp": ("tp", int),
    "dp": ("dp", int),
    "qps": ("qps", float),
    "concurrency": ("concurrency", int),
    "input": ("input_len", int),
    "output": ("output_len", int),
    "prefill": ("prefill_devices", int),
}
EXAMPLES = (
    "slots 16",
    "tp 2",
    "qps 4",
    "concurrency 8",
    "input 256",
    "output 64",
    "mode disaggregated",
    "hardware h100",
    "sweep slots 1,2,4,8",
    "sweep qps 1,2,4",
    "symbols block",
)


def parse(query: str) -> tuple[str, object] | None:
    """A typed command -> (name, value); None when it is not one (bad numbers included)."""
    words = query.strip().lower().split()
    if len(words) == 3 and words[0] == "sweep" and words[1] in ("slots", "qps"):
        try:
            values = [float(x) for x in words[2].split(",") if x]
        except ValueError:
            return None
        return (f"sweep_{words[1]}", values) if values else None
    if len(words) != 2:
        return None
    head, arg = words
    if head in TYPED:
        try:
            return head, TYPED[head][1](arg)
        except ValueError:
            return None
    if head in ("mode", "hardware", "symbols"):
        return head, query.strip().split()[1]
    return None


class ScaleCommands(Provider):
    @property
    def tui(self) -> ScaleTUI:
        return self.app  # type: ignore[return-value]

    async def discover(self) -> Hits:
        for name, action, help_ in ACTIONS:
            yield DiscoveryHit(name, partial(self.tui.run_action, action), help=help_)
        for example in EXAMPLES:
            yield DiscoveryHit(example, partial(self.tui.command, example), help="typed command")

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        parsed = parse(query)
        if parsed is not None:
            yield Hit(1.0, f"{query.strip()}  ⏎", partial(self.tui.command, query), help="set")
        for name, action, help_ in ACTIONS:
            score = matcher.match(name)
            if score > 0:
                yield Hit(
                    score, matcher.highlight(name), partial(self.tui.run_action, action), help=help_
                )
        for example in EXAMPLES:
            score = matcher.match(example)
            if score > 0 and parsed is None:
                yield Hit(
                    score * 0.5,
                    matcher.highlight(example),
                    partial(self.tui.command, example),
                    help="typed command (edit the number)",
                )
