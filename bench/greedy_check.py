"""Greedy correctness on the accelerator: its engine's tokens against an f32 CPU reference.

Runs the real serving engine (`serve.build.build_engines`) on the default device in `--dtype`
(bf16 on a GPU) over a few byte-tokenized prompts, greedy, then feeds each prompt plus the
tokens it produced through the pure reference model (`serve.model.forward`) in f32 on the host
CPU. Top-1 agreement = the share of generated tokens that are also the f32 model's argmax given
the same context (teacher forcing on the device's own output, so one early flip does not count
against every later token). The same engine in f32 on the CPU is checked the same way, as a
control. Dummy weights: every model reads identical seeded values, rounded to the dtype.
Exit 1 when agreement < --min-agreement. `--check` parses the arguments and loads the spec
without importing JAX: the check itself is in bench/_greedy_check.py.

    python bench/greedy_check.py --model small --dtype bf16 --json-out greedy.json
"""

from __future__ import annotations

import argparse
import sys

from _smoke import shrink

from scaletui.specs import load_model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--dtype", default="bf16", choices=["f32", "bf16"], help="the device's")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--min-agreement", type=float, default=0.95)
    p.add_argument("--json-out", help="write the result as JSON here")
    p.add_argument("--check", action="store_true", help="parse, load the spec, and exit")
    return shrink(p, model="tiny", new_tokens=4)  # a smoke run (bench/_smoke.py)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    m = load_model(args.model)
    if args.check:
        print(f"greedy_check: arguments ok ({m.name}, {args.dtype})")
        return 0
    import _greedy_check  # JAX and the engine: only past --check

    return _greedy_check.run(args, m)


if __name__ == "__main__":
    sys.exit(main())
