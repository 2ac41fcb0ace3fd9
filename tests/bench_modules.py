"""Import a script of bench/ (not a package) as a module, for the tests of its pure parts."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH_DIR) not in sys.path:  # as when a bench runs as a script: its helpers (_smoke.py)
    sys.path.append(str(BENCH_DIR))


@contextmanager
def bench_module(name: str) -> Iterator[ModuleType]:
    """bench/<name>.py as module `<name>_bench`, registered while in use (dataclasses look
    their module up in sys.modules)."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
