"""`scaletui build-kernels`: compile and cache the native CPU kernels ahead of use, saying what
it does (the build itself: `scaletui.serve.engine.native.toolchain`)."""

from __future__ import annotations

import argparse
import shlex
import sys

from scaletui.serve.engine.native import toolchain


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="scaletui build-kernels",
        description="Compile and cache the native CPU kernels (scaletui serve's decode ops).",
    )
    ap.add_argument("--force", action="store_true", help="rebuild even when cached")
    ap.add_argument(
        "--keep", type=int, default=toolchain.KEEP, help="old builds to keep (default %(default)s)"
    )
    args = ap.parse_args(argv)
    if args.keep < 0:
        ap.error(f"--keep must be >= 0, got {args.keep}")
    try:
        p = toolchain.plan()
    except toolchain.BuildError as e:
        print(f"scaletui build-kernels: error: {e}", file=sys.stderr)
        return 1
    print(f"compiler:  {p.cxx} ({toolchain.compiler_version(p.cxx)})")
    print(f"flags:     {shlex.join(p.flags)} -I {p.include}")
    print(f"cpu:       {toolchain.cpu_features()}")
    print(f"cache:     {p.path}")
    try:
        built = toolchain.ensure(force=args.force, keep=args.keep)
    except toolchain.BuildError as e:
        head, _, tail = str(e).partition("\n")
        print(f"scaletui build-kernels: error: {head}", file=sys.stderr)
        if tail:
            print(tail, file=sys.stderr)
        return 1
    if not built.compiled:
        print("cached:    already built (--force rebuilds)")
        return 0
    if built.path != p.path:
        print(f"built:     {built.path} (the cache is not writable: this build is not kept)")
    print(f"built in   {built.seconds:.1f} s")
    if built.pruned:
        print(f"pruned:    {len(built.pruned)} old build(s)")
    return 0
