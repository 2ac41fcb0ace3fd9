"""JAX's persistent compilation cache for every `scaletui` command (the server, fit and TUI
processes share it).

A server compiles one generate program per (KV bucket, steps) and one prefill program per prompt
bucket at start-up, and `scaletui calibrate --model` (the TUI runs it in the background right
after the server is up) compiles the same programs again in its own process, most of its time
on a small CPU. With the cache on disk, the second and later processes load those programs
instead (docs/benchmarks.md, "Compile cache and start-up", has the times).

`enable()` points JAX at `$XDG_CACHE_HOME/scaletui/jax` through the environment, before anything
imports jax, so the server and fit processes the TUI and loadgen start inherit it. A user's own
`JAX_COMPILATION_CACHE_DIR` wins; set it empty to turn the cache off. JAX keys an entry by the
program, the jax/jaxlib version, the XLA flags and the devices, so a change to any of them
compiles afresh. The native kernels are called by name, so a rebuilt kernel library is what a
cached program calls.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

__all__ = ["DIR_ENV", "MIN_COMPILE_S", "cache_dir", "default_dir", "enable", "usage"]

DIR_ENV = "JAX_COMPILATION_CACHE_DIR"
MIN_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
# JAX's default (1 s) skips most of ours: a `small` generate program compiles in 0.3-3 s here
MIN_COMPILE_S = 0.1


def default_dir(environ: MutableMapping[str, str] = os.environ) -> Path:
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "scaletui" / "jax"


def enable(environ: MutableMapping[str, str] = os.environ) -> Path | None:
    """Turn the cache on in `environ` unless the user chose (a dir, or empty: off) or the
    default dir cannot be written (JAX would warn at every compile); the dir in use, or None
    when off. Takes effect in processes that import jax after it."""
    if DIR_ENV not in environ:
        path = default_dir(environ)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError:
            return None
        if not os.access(path, os.W_OK):
            return None
        environ[DIR_ENV] = str(path)
        environ.setdefault(MIN_TIME_ENV, str(MIN_COMPILE_S))
    return cache_dir(environ)


def cache_dir(environ: MutableMapping[str, str] = os.environ) -> Path | None:
    """The cache JAX uses in a process started with `environ` (None: off)."""
    value = environ.get(DIR_ENV, "")
    return Path(value) if value else None


def usage(path: Path | None) -> tuple[int, int]:
    """(entries, bytes) held in the cache at `path` ((0, 0) when off or not made yet)."""
    if path is None or not path.is_dir():
        return 0, 0
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)
