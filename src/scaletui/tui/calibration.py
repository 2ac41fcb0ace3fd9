"""The controller's calibration children: `scaletui calibrate --quick`, this host's `local`
hardware spec (once, when it is missing, before the server so they do not compete), and
`scaletui calibrate --model M ...`, the cost-model fit of our server's configuration (once per
configuration, while the server idles before a load). Each runs in its own process group with
its log in the controller's log folder and the server's virtual devices; what happens is an
event on the controller's queue, never an exception. `Controller` (controller.py) holds the
state these read: knobs, commands, timeouts, log folder, process groups.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

from scaletui import specs
from scaletui.procs import signal_group
from scaletui.roofline.fitstore import load_fit
from scaletui.tui.expect import fit_label
from scaletui.tui.host import (
    calibrate_env,
    calibration_skip,
    fit_command,
    fit_lookup,
    run_calibrate,
)


class Calibrations:
    """`Controller`'s calibrate and fit runs (a mixin: the controller holds the state)."""

    async def calibrate_host(self) -> bool:
        """When predictions would use `local` and it does not exist: run `scaletui calibrate
        --quick` (its own process group) and wait. True when `local` exists afterwards. A failure
        or a timeout is an event, and predictions fall back to a built-in spec; never raises."""
        skip = calibration_skip(self.knobs.hardware, self.calibrate, self.attached, self.url)
        if skip is not None:
            if skip.text:
                self.event(skip.text, "warning", calibration=skip.state)
            return skip.state == "done"
        cmd = self.calibrate_cmd
        self.event(
            f"calibrating this host for predictions: {' '.join(cmd[1:])} (log calibrate.log)",
            server="calibrating this host…",
            phase="calibrating",
            calibration="running",
        )
        t0 = time.monotonic()

        def started(proc: asyncio.subprocess.Process) -> None:
            self.calibrator = proc
            self.groups.add(proc.pid)  # quit, SIGHUP and a lost TTY stop it like the others

        try:
            why, summary = await run_calibrate(
                cmd,
                calibrate_env(self.calibrate_devices),
                self.log_dir / "calibrate.log",
                self.calibrate_timeout,
                started,
                lambda: "local" in specs.hardware_names(),
            )
        finally:
            if self.calibrator is not None and self.calibrator.returncode is not None:
                self.groups.discard(self.calibrator.pid)
        if why is not None:
            self.event(
                f"calibrate failed ({why}); predictions use a built-in spec, not this host",
                "error",
                server="starting",
                phase="starting",
                calibration=f"calibrate failed: {why[:80]}",
            )
            return False
        self.event(
            f"calibrated this host in {time.monotonic() - t0:.1f} s"
            f"{': ' + summary if summary else ''}; predictions use 'local' "
            f"({specs.local_hardware_path()})",
            server="starting",
            phase="starting",
            calibration="done",
        )
        return True

    async def fit_server(self, config: dict | None = None, force: bool = False) -> bool:
        """When our server's configuration (its /stats `config`, fetched when None) has no fitted
        cost model on this host, or `force`: run `scaletui calibrate --model M --slots S ...
        --weight-dtype W --kv-dtype K --quick` (its own process group, log fit.log, the
        server's virtual devices) and wait, before the load starts so the two do not compete.
        True when a fit exists afterwards; an event with `fit="done"` says so either way (fitted
        now, or stored already).
        Skipped for an attached server (another host's, or one holding the devices), with
        --no-calibrate, or a what-if --hardware. A failure or a timeout is an event and the
        expectation stays on assumed efficiencies (a failed configuration is not retried until
        `force`); never raises."""
        if self.attached or not self.calibrate:
            return False
        if not force and self.knobs.hardware not in ("", "local"):
            return False
        if config is None:
            config = await self.client.config()
        try:
            key = fit_lookup(config)
            cmd = fit_command(self.fit_cmd, config)
        except (KeyError, TypeError, ValueError) as exc:
            self.event(f"no cost-model fit: the server's config lacks {exc}", "warning")
            return False
        stored = None if force else key.find()
        if stored is not None:  # said as a fit that is done, so the state reads "fit ready"
            self.event(f"cost model: stored fit {stored.name} (no fit needed)", fit="done")
            return True
        if not force and key in self._fit_failed:
            return False
        shown = "scaletui calibrate " + " ".join(cmd[len(self.fit_cmd) :])
        self.event(
            f"fitting this server's cost model: {shown} (log fit.log)",
            phase="fitting",
            fit="running",
        )
        t0 = time.monotonic()
        self.fitter = None

        def started(proc: asyncio.subprocess.Process) -> None:
            self.fitter = proc
            self.groups.add(proc.pid)

        try:
            why, _ = await run_calibrate(
                cmd,
                calibrate_env(self.calibrate_devices),
                self.log_dir / "fit.log",
                self.fit_timeout,
                started,
                lambda: key.find() is not None,
            )
        finally:  # also when cancelled (quit): the child does not outlive its wait
            proc = self.fitter
            if proc is not None:
                if proc.returncode is None:
                    signal_group(proc.pid, signal.SIGKILL)
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(proc.wait(), 3)
                self.groups.discard(proc.pid)
        path, label = key.find(), ""
        if why is None and path is None:
            why = "it wrote no fit"
        if why is None:
            try:
                label = fit_label(load_fit(path))
            except ValueError as exc:
                why = str(exc)
        if why is not None:
            self._fit_failed.add(key)
            self.event(
                f"cost-model fit failed ({why}); expected stays on assumed efficiencies",
                "error",
                phase="idle",
                fit=f"failed: {why[:80]}",
            )
            return False
        self._fit_failed.discard(key)
        self.event(
            f"fitted {label} in {time.monotonic() - t0:.0f} s; expected now uses it",
            phase="idle",
            fit="done",
        )
        return True
