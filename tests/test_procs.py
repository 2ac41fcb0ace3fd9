"""Stopping a child's process group: an exited child that nobody has reaped yet is gone."""

from __future__ import annotations

import subprocess
import sys
import time

from scaletui.procs import group_alive, stop_groups


def test_a_child_that_exits_on_sigterm_stops_at_once_not_after_the_grace() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    assert group_alive(child.pid)
    t0 = time.monotonic()
    stop_groups([child.pid], grace_s=10)  # the child is a zombie until wait() reaps it
    assert time.monotonic() - t0 < 5
    assert not group_alive(child.pid)
    assert child.wait(timeout=5) == -15  # SIGTERM ended it; nothing needed SIGKILL


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    code = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    code += "print('ready', flush=True); time.sleep(60)"
    child = subprocess.Popen(
        [sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE
    )
    assert child.stdout.readline() == b"ready\n"
    t0 = time.monotonic()
    stop_groups([child.pid], grace_s=0.5)
    assert 0.4 < time.monotonic() - t0 < 5
    assert child.wait(timeout=5) == -9
