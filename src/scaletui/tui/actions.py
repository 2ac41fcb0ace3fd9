"""The key actions of the TUI that stage knob edits and change the view: slots/tp/dp steps,
precision cycles, the sharding presets, discard, help, pause, panel toggles, zoom and export.
An edit is staged as pending (applied by the control worker, ui.py); a bad value or an impossible
mesh is a toast, not a change. `ScaleTUI` (ui.py) holds the state, bindings and workers.
"""

from __future__ import annotations

from dataclasses import replace

from scaletui.tui.knobs import Knobs, check_mesh, next_precision, step_pow2
from scaletui.tui.layout import PANELS
from scaletui.tui.panels.help import HelpScreen, key_rows
from scaletui.tui.panels.sharding import ShardingScreen, presets
from scaletui.tui.panels.status import StatusBar
from scaletui.tui.session import export


class KnobActions:
    """`ScaleTUI`'s knob and view actions (a mixin, listed before `App`: the app holds the
    state)."""

    def _edit(self, **changes: object) -> bool:
        """Stage edits as pending; a bad value or an impossible mesh is a toast, not a change."""
        try:
            new = replace(self.state.knobs, **changes)
        except ValueError as exc:
            self.notify(str(exc), severity="warning")
            return False
        problem = check_mesh(new, self.state.n_devices)
        if problem:
            self.notify(problem, severity="warning")
            self.state.log(f"rejected: {problem}", "warning")
            return False
        self.state.edit(**changes)
        self.render_tick()
        return True

    def action_slots(self, up: bool) -> None:
        k = self.state.knobs
        self._edit(slots=step_pow2(k.slots, up, max(1, k.dp), 1024))

    def action_tp(self, up: bool) -> None:
        self._edit(tp=step_pow2(self.state.knobs.tp, up, 1, 1024))

    def action_dp(self, up: bool) -> None:
        k = self.state.knobs
        dp = step_pow2(k.dp, up, 1, 1024)
        self._edit(dp=dp, slots=max(k.slots, dp))

    def action_weights(self) -> None:
        self._cycle_precision("weight_dtype", "weights")

    def action_kv(self) -> None:
        self._cycle_precision("kv_dtype", "kv")

    def _cycle_precision(self, key: str, part: str) -> None:
        """Stage the next storage dtype (f32 -> bf16 -> int8 -> f32) of the weights or KV."""
        self._edit(**{key: next_precision(getattr(self.state.precision(), part))})

    def action_discard(self) -> None:
        if self.state.pending is not None:
            self.state.discard()
            self.state.log("pending edits discarded")
            self.render_tick()

    def action_help(self) -> None:
        self.push_screen(HelpScreen(key_rows(self)))

    def action_sharding(self) -> None:
        m = self.state
        choices = [(k, m.prediction(k)) for k in presets(m.knobs, m.n_devices)]

        def chosen(k: Knobs | None) -> None:
            if k is not None:
                self._edit(tp=k.tp, dp=k.dp, mode=k.mode, prefill_devices=k.prefill_devices)

        self.push_screen(ShardingScreen(choices), chosen)

    def action_pause(self) -> None:
        self.paused = not self.paused
        self.query_one(StatusBar).set_class(self.paused, "-paused")
        self.notify("display paused (recording continues)" if self.paused else "display resumed")
        if not self.paused:
            self._drawn.clear()
            self.render_tick()

    def action_toggle_panel(self, n: int) -> None:
        widget = self.query_one(PANELS[n])
        widget.display = not widget.display
        self._drawn.clear()
        self.render_tick()

    def action_zoom(self) -> None:
        if self.screen.maximized is not None:
            self.screen.minimize()
            return
        target = self.focused or self.query_one("#latency")
        target.can_focus = True
        self.screen.maximize(target)

    def action_export(self) -> None:
        path = export(self.state, self.export_dir)
        self.state.log(f"exported {len(self.state.runs)} run(s) to {path}")
        self.notify(f"exported to {path}")
