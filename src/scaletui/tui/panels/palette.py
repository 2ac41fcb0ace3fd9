"""Command palette provider (ctrl+p or `:`): fixed actions plus typed commands such as
`slots 16`, `tp 2`, `qps 4`, `concurrency 8`, `input 256`, `output 64`, `hardware h100`,
`mode disaggregated`, `prefill 2`, `weights int8`, `kv bf16`, `page 32`, `budget 256`,
`sweep slots 1,2,4,8`,
`sweep qps 1,2,4`, `symbols block`; and the precisions by name ("Weights: int8").

The provider only posts what was chosen to the App (an action name, or a `PaletteCommand`);
`interpret` turns a typed command into what it asks for: knob changes, a sweep, or a chart
style."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

from scaletui import specs
from scaletui.tui.knobs import PRECISIONS
from scaletui.tui.messages import PaletteCommand

ACTIONS = (
    ("Apply pending config", "apply", "restart/reshard the server with the pending knobs"),
    ("Rerun load", "rerun", "start a new run with the applied config"),
    ("Discard pending edits", "discard", "drop knob edits not yet applied"),
    ("Sharding picker", "sharding", "choose tp x dp and mode with predicted memory per chip"),
    ("Export runs", "export", "write runs, last summary and /stats to JSON + CSV"),
    ("Restart server", "restart_server", "start the server child again after it died"),
    ("Refit the cost model", "refit", "time this server's engine again for the expected column"),
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
    "spread": ("length_spread", float),
    "prefill": ("prefill_devices", int),
    "page": ("page_size", int),
    "budget": ("max_batched_tokens", int),
}
PRECISION_KNOBS = {"weights": "weight_dtype", "kv": "kv_dtype"}  # typed command -> knob
PRECISION_HITS = tuple(  # (name shown, typed command, help)
    (f"{shown}: {dtype}", f"{typed} {dtype}", f"stage {what} stored in {dtype} (a applies)")
    for typed, shown, what in (
        ("weights", "Weights", "the weights"),
        ("kv", "KV cache", "the KV cache"),
    )
    for dtype in PRECISIONS
)
EXAMPLES = (
    "slots 16",
    "tp 2",
    "qps 4",
    "concurrency 8",
    "input 256",
    "output 64",
    "spread 0",
    "mode disaggregated",
    "budget 256",
    "page 32",
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
    if head in PRECISION_KNOBS:
        return (head, arg) if arg in PRECISIONS else None
    if head in ("mode", "hardware", "symbols"):
        return head, query.strip().split()[1]
    return None


@dataclass(frozen=True)
class Asked:
    """What a typed command asks for: knob `changes` (staged as pending), a `sweep` over
    (slots | qps, values), or chart `symbols`. Exactly one is set."""

    changes: dict | None = None
    sweep: tuple[str, list[float]] | None = None
    symbols: str | None = None


def interpret(text: str) -> Asked:
    """A typed command -> what it asks for; ValueError naming the problem when it is not one."""
    parsed = parse(text)
    if parsed is None:
        raise ValueError(f"unknown command {text!r}")
    name, value = parsed
    if name in ("sweep_slots", "sweep_qps"):
        return Asked(sweep=(name[6:], list(value)))  # type: ignore[arg-type]
    if name == "symbols":
        return Asked(symbols=str(value))
    if name == "qps":
        return Asked(changes={"load": "qps", "rate": value})
    if name == "concurrency":
        return Asked(changes={"load": "concurrency", "rate": float(value)})  # type: ignore[arg-type]
    if name == "hardware":
        specs.load_hardware(str(value))  # SpecError (a ValueError) names what is wrong
        return Asked(changes={"hardware": str(value)})
    key = TYPED[name][0] if name in TYPED else PRECISION_KNOBS.get(name, name)
    return Asked(changes={key: value})


class ScaleCommands(Provider):
    def _post(self, text: str) -> None:
        self.app.post_message(PaletteCommand(text))

    async def discover(self) -> Hits:
        for name, action, help_ in ACTIONS:
            yield DiscoveryHit(name, partial(self.app.run_action, action), help=help_)
        for name, typed, help_ in PRECISION_HITS:
            yield DiscoveryHit(name, partial(self._post, typed), help=help_)
        for example in EXAMPLES:
            yield DiscoveryHit(example, partial(self._post, example), help="typed command")

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        parsed = parse(query)
        if parsed is not None:
            yield Hit(1.0, f"{query.strip()}  ⏎", partial(self._post, query), help="set")
        for name, action, help_ in ACTIONS:
            score = matcher.match(name)
            if score > 0:
                yield Hit(
                    score, matcher.highlight(name), partial(self.app.run_action, action), help=help_
                )
        for name, typed, help_ in PRECISION_HITS:
            score = matcher.match(name)
            if score > 0 and parsed is None:
                yield Hit(score, matcher.highlight(name), partial(self._post, typed), help=help_)
        for example in EXAMPLES:
            score = matcher.match(example)
            if score > 0 and parsed is None:
                yield Hit(
                    score * 0.5,
                    matcher.highlight(example),
                    partial(self._post, example),
                    help="typed command (edit the number)",
                )
