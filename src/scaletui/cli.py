"""`scaletui`: the TUI by default; subcommands `serve`, `roofline`, `calibrate`, `simulate`,
`build-kernels`, `doctor`.

Each subcommand's module is imported only when chosen, so `scaletui roofline` never loads JAX.
"""

from __future__ import annotations

import importlib
import sys

from scaletui import compile_cache

SUBCOMMANDS = {
    "serve": ("scaletui.commands.serve", "run the JAX inference server (OpenAI-compatible HTTP)"),
    "roofline": ("scaletui.commands.roofline", "print the book's roofline estimates for a config"),
    "calibrate": (
        "scaletui.commands.calibrate",
        "measure this host's devices; write the 'local' spec",
    ),
    "simulate": (
        "scaletui.commands.simulate",
        "predict what loadgen would measure (simulated server)",
    ),
    "build-kernels": ("scaletui.commands.build_kernels", "compile and cache the native kernels"),
    "doctor": (
        "scaletui.commands.doctor",
        "say what this host has: JAX, devices, kernels, calibration",
    ),
    "tui": ("scaletui.commands.tui", "the interactive lab bench (default)"),
}

USAGE = f"usage: scaletui [{'|'.join(SUBCOMMANDS)}] [options]   (scaletui SUBCOMMAND -h)\n\n" + (
    "\n".join(f"  {name:<14} {help}" for name, (_, help) in SUBCOMMANDS.items())
)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help") and len(args) == 1:
        print(USAGE)
        return 0
    name = args[0] if args and args[0] in SUBCOMMANDS else "tui"
    if args and args[0] == name:
        args = args[1:]
    compile_cache.enable()  # before any subcommand imports jax; its children inherit it
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
