"""`scaletui` (no subcommand) / `scaletui tui`: parse the flags, build the Textual app
(`scaletui.tui.app`), run it, and stop the server it started."""

from __future__ import annotations

import atexit
import sys

from scaletui.tui import app as app_module


def main(argv: list[str] | None = None) -> int:
    args = app_module.parser().parse_args(argv)
    try:
        app, controller, state = app_module.build(args)
    except ValueError as exc:
        print(f"scaletui: {exc}", file=sys.stderr)
        return 2
    if controller is not None:
        atexit.register(controller.kill_children)
    try:
        code = app.run(mouse=not args.no_mouse)
    finally:
        if controller is not None:
            controller.kill_children()
            failed = any(e.level == "error" for e in state.events)
            kept = controller.remove_logs(keep=failed)
            if kept is not None:
                print(f"scaletui: logs in {kept}", file=sys.stderr)
    return int(code or 0)
