"""XLA's environment for scaletui's processes, set in one place: the virtual CPU device count
(`XLA_FLAGS`), device-memory preallocation and, for test runs, quick compiles, in this process
before it imports jax or in a child's environment. The persistent compile cache's variables are
`compile_cache.enable()`'s, which `scaletui`'s entry point calls once for every command. Standard
library only, so the TUI sets up its children's environment without importing JAX.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping

__all__ = [
    "FLAGS_ENV",
    "HOST_DEVICES_FLAG",
    "child_env",
    "host_devices",
    "set_host_devices",
    "set_quick_compiles",
]

FLAGS_ENV = "XLA_FLAGS"
PREALLOCATE_ENV = "XLA_PYTHON_CLIENT_PREALLOCATE"
# JAX's switch for XLA's backend optimization level 0 and no expensive LLVM passes
QUICK_COMPILES_ENV = "JAX_DISABLE_MOST_OPTIMIZATIONS"
QUICK_CPU_FLAG = "--xla_cpu_use_fusion_emitters=false"  # XLA CPU's classic fusion codegen
# how many devices XLA's CPU platform shows; other platforms ignore it
HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"
_COUNT = re.compile(rf"{HOST_DEVICES_FLAG}=(\d+)")


def host_devices(environ: Mapping[str, str] = os.environ) -> int | None:
    """The virtual CPU device count `environ`'s XLA_FLAGS asks for (None: XLA's default, 1)."""
    counts = _COUNT.findall(environ.get(FLAGS_ENV, ""))
    return int(counts[-1]) if counts else None


def set_host_devices(
    n: int, environ: MutableMapping[str, str] = os.environ, *, keep: bool = False
) -> None:
    """Ask for `n` virtual CPU devices in `environ`'s XLA_FLAGS, in place of any count there
    (`keep`: leave a count that is there alone). Takes effect in a process that imports jax
    after it."""
    flags = environ.get(FLAGS_ENV, "")
    if keep and _COUNT.search(flags):
        return
    rest = _COUNT.sub("", flags).split()
    environ[FLAGS_ENV] = " ".join([*rest, f"{HOST_DEVICES_FLAG}={n}"])


def set_quick_compiles(environ: MutableMapping[str, str] = os.environ) -> None:
    """Compile quickly, in this process and the children that inherit `environ`: XLA's
    optimizations off and its CPU fusions through the classic emitters, not the newer fusion
    emitters. Together they take a third of the CPU time to compile a program of the tiny test
    models; the programs run slower. For test runs, where compiling is most of the work; never
    for serving or benchmarks (docs/benchmarks.md, 'Test suite', has the measurement)."""
    environ[QUICK_COMPILES_ENV] = "1"
    flags = environ.get(FLAGS_ENV, "").split()
    if QUICK_CPU_FLAG not in flags:
        environ[FLAGS_ENV] = " ".join([*flags, QUICK_CPU_FLAG])


def child_env(
    host_devices: int | None = None,
    *,
    preallocate: bool = True,
    base: Mapping[str, str] = os.environ,
) -> dict[str, str]:
    """A copy of `base` for a child JAX process: `host_devices` virtual CPU devices (None or 0:
    as `base` says) and, with `preallocate` False, no device memory taken at start-up (another
    process, a server, may hold it)."""
    env = dict(base)
    if not preallocate:
        env[PREALLOCATE_ENV] = "false"
    if host_devices:
        set_host_devices(host_devices, env)
    return env
