"""Sharding picker (`s`): mesh presets (tp × dp, interleaved or disaggregated) with the predicted
memory per chip and whether it fits; choosing one stages it as pending."""

from __future__ import annotations

from dataclasses import replace

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from scaletui.tui.knobs import Knobs, check_mesh
from scaletui.tui.panels.fmt import nbytes
from scaletui.tui.predict import Prediction


def presets(knobs: Knobs, n_devices: int) -> list[Knobs]:
    """Valid meshes for this host: tp, dp powers of two; disaggregated splits the devices."""
    n = max(1, n_devices)
    out = []
    for mode in ("interleaved", "disaggregated"):
        tp = 1
        while tp <= n:
            dp = 1
            while tp * dp <= n:
                pf = 0
                if mode == "disaggregated":
                    pf = tp * dp
                cand = replace(knobs, tp=tp, dp=dp, mode=mode, prefill_devices=pf)
                if knobs.slots % dp == 0 and check_mesh(cand, n_devices) is None:
                    out.append(cand)
                dp *= 2
            tp *= 2
    return out


class ShardingScreen(ModalScreen[Knobs | None]):
    BINDINGS = [Binding("escape", "dismiss_none", "Close", id="sharding.close")]

    def __init__(self, choices: list[tuple[Knobs, Prediction | None]]) -> None:
        super().__init__()
        self.choices = choices

    def compose(self) -> ComposeResult:
        options = []
        for k, p in self.choices:
            mem = "?" if p is None else nbytes(p.mem_per_chip)
            fit = "" if p is None or p.fits else "  DOES NOT FIT"
            step = "" if p is None else f"  step {p.tpot_ms:.3g} ms"
            options.append(Option(f"{k.mode:<13} {k.mesh_label():<18} mem/chip {mem}{step}{fit}"))
        with Vertical(id="sharding-body"):
            yield Label("Pick a mesh (enter stages it as pending; a applies)")
            yield OptionList(*options, id="sharding-list")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.choices[event.option_index][0])

    def action_dismiss_none(self) -> None:
        self.dismiss(None)
