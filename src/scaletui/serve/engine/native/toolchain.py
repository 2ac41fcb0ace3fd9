"""Build the native kernels ahead of use: find the compiler, compile `kernels.cc`, cache, prune.

A build is keyed by the source, the jaxlib version, the CPU's flags, the compiler and
$SCALETUI_CXXFLAGS, and cached as `$XDG_CACHE_HOME/scaletui/kernels/kernels-KEY.so`. A build
logs a line before it starts and one when it is done (logger `scaletui.serve.native`, INFO, which
`scaletui serve` prints), so start-up never waits on a compiler silently; afterwards the cache
keeps the newest KEEP builds of other keys and drops the rest. Processes that start together
(a server and a fit, test workers) build once: the first holds the cache's lock while it
compiles, the others wait for it and load its file. `scaletui build-kernels` runs it ahead of
time (`scaletui.commands.build_kernels`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("scaletui.serve.native")

SOURCE = Path(__file__).with_name("kernels.cc")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
TIMEOUT_S = 300  # a compiler that takes longer is stuck; the engine then runs XLA's ops
KEEP = 3  # cached builds of other keys (another jaxlib, compiler, CPU) kept after a build
# CPU flags that decide what -march=native emits for the kernels (shown, not the whole list)
_FEATURES = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
)
_FEATURES += ("asimd", "asimddp", "sve", "sve2")


class BuildError(RuntimeError):
    """No compiler, or it failed; the message says which and carries its last error lines."""


@dataclass(frozen=True)
class Plan:
    """How this host's kernels are built and where they are cached."""

    cxx: str  # the compiler command as found ($CXX, else g++ or c++ on PATH)
    flags: tuple[str, ...]  # FLAGS and $SCALETUI_CXXFLAGS
    include: str  # jaxlib's XLA FFI headers
    path: Path  # the cached shared library for this key

    def command(self, out: str | Path) -> list[str]:
        return [
            *shlex.split(self.cxx),
            *self.flags,
            "-I",
            self.include,
            str(SOURCE),
            "-o",
            str(out),
        ]

    @property
    def cached(self) -> bool:
        return self.path.exists()


@dataclass(frozen=True)
class Built:
    path: Path  # the shared library to load
    compiled: bool  # False: it was in the cache already
    seconds: float  # spent compiling (0 on a cache hit)
    pruned: tuple[Path, ...]  # old builds removed after compiling


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "scaletui" / "kernels"


def compiler() -> str | None:
    """The C++ compiler command: $CXX when its program exists, else g++ or c++ on PATH."""
    cxx = os.environ.get("CXX")
    if cxx:
        words = shlex.split(cxx)
        return cxx if words and shutil.which(words[0]) else None
    return shutil.which("g++") or shutil.which("c++")


def compiler_version(cxx: str) -> str:
    """The first line of `cxx --version`, or why there is none."""
    try:
        proc = subprocess.run(
            [*shlex.split(cxx), "--version"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"
    return (proc.stdout.strip().splitlines() or ["unknown"])[0]


def missing_compiler() -> str:
    cxx = os.environ.get("CXX")
    if cxx:
        return f"no C++ compiler: $CXX={cxx!r} is not an executable"
    return "no C++ compiler (g++ or c++ on PATH, or $CXX)"


def _cpu_line() -> str:
    """The CPU's flags line from /proc/cpuinfo ("" where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")


def cpu_features() -> str:
    """The machine and the CPU flags the kernels care about, e.g. `x86_64: avx2 fma`."""
    have = set(_cpu_line().partition(":")[2].split())
    return f"{platform.machine()}: " + (" ".join(f for f in _FEATURES if f in have) or "-")


def _key(cxx: str, extra: str) -> str:
    import jaxlib

    key = hashlib.sha256(SOURCE.read_bytes())
    for part in (jaxlib.__version__, platform.machine() + _cpu_line(), cxx, extra):
        key.update(part.encode())
    return key.hexdigest()[:16]


def plan() -> Plan:
    """This host's build; raises BuildError when there is no compiler."""
    import jax

    cxx = compiler()
    if cxx is None:
        raise BuildError(missing_compiler())
    extra = os.environ.get("SCALETUI_CXXFLAGS", "")
    flags = (*FLAGS, *shlex.split(extra))
    return Plan(cxx, flags, jax.ffi.include_dir(), cache_dir() / f"kernels-{_key(cxx, extra)}.so")


def _compile(p: Plan, out: Path) -> None:
    """Compile into a temporary file next to `out`, then rename (atomic: concurrent first uses
    each compile, one file wins)."""
    fd, tmp = tempfile.mkstemp(prefix="building-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run(p.command(tmp), capture_output=True, text=True, timeout=TIMEOUT_S)
        if proc.returncode:
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])[-2000:]
            what = f"compiling {SOURCE.name} failed ({p.cxx}, exit {proc.returncode})"
            raise BuildError(f"{what}:\n{tail}" if tail else f"{what}, with no error output")
        os.replace(tmp, out)
    except subprocess.TimeoutExpired as e:
        raise BuildError(f"compiling {SOURCE.name} took over {TIMEOUT_S} s ({p.cxx})") from e
    except OSError as e:
        raise BuildError(f"compiling {SOURCE.name} with {p.cxx}: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def _build_lock(folder: Path):
    """The cache folder's build lock, held until the block ends (released if this process
    dies); nothing to hold where the folder cannot take the lock file."""
    try:
        fd = os.open(folder / ".build-lock", os.O_CREAT | os.O_RDWR, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def ensure(*, force: bool = False, keep: int = KEEP) -> Built:
    """The kernels' shared library, compiled now when it is not cached (or `force`)."""
    p = plan()
    out = p.path
    if out.exists() and not force:
        log.debug("native CPU kernels: cached %s", out)
        return Built(out, compiled=False, seconds=0.0, pruned=())
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        writable = os.access(out.parent, os.W_OK)
    except OSError:
        writable = False
    if not writable:  # build for this process only
        out = Path(tempfile.mkdtemp(prefix="scaletui-kernels-")) / out.name
        log.info("native CPU kernels: cache %s is not writable; building in %s", p.path, out)
        return _build(p, out, force, keep)
    with _build_lock(out.parent):
        if out.exists() and not force:  # another process built it while this one waited
            log.debug("native CPU kernels: built by another process, %s", out)
            return Built(out, compiled=False, seconds=0.0, pruned=())
        return _build(p, out, force, keep)


def _build(p: Plan, out: Path, force: bool, keep: int) -> Built:
    first = "" if force else "first use; "
    log.info(
        "compiling native CPU kernels (%s`scaletui build-kernels` does this ahead of time)...",
        first,
    )
    start = time.perf_counter()
    _compile(p, out)
    seconds = time.perf_counter() - start
    log.info("compiled native CPU kernels in %.1f s: %s", seconds, out)
    pruned = tuple(prune(out, keep)) if out.parent == p.path.parent else ()
    return Built(out, compiled=True, seconds=seconds, pruned=pruned)


def prune(current: Path, keep: int = KEEP) -> list[Path]:
    """Remove cached builds other than `current` past the newest `keep`, and temporary files
    that a killed build left (older than the build timeout); returns what was removed."""
    folder = current.parent
    now = time.time()
    others = []
    for f in folder.glob("kernels-*.so"):
        try:
            if f != current:
                others.append((f.stat().st_mtime, f))
        except OSError:  # removed meanwhile by another process's prune
            pass
    others.sort(reverse=True)
    stale = [f for _, f in others[keep:]]
    for f in folder.glob("building-*.so"):
        try:
            if now - f.stat().st_mtime > TIMEOUT_S:
                stale.append(f)
        except OSError:
            pass
    removed = []
    for f in stale:
        try:
            f.unlink()
            removed.append(f)
        except OSError:
            pass
    if removed:
        names = ", ".join(f.name for f in removed)
        log.debug(
            "native CPU kernels: pruned %d old build(s) from %s: %s", len(removed), folder, names
        )
    return removed


def slower_here() -> str | None:
    """Why `--kernels auto` keeps XLA's ops on this CPU, or None. The kernels are tuned for
    AVX-512 (16-lane vectors, 64-column panels) and AVX2 (8 lanes, 16 columns), and beat XLA's
    ops on both (docs/serve.md, "Native CPU kernels"). On a CPU with neither they have not been
    measured, so `auto` takes XLA's ops there; `--kernels native` still runs them (same tokens)."""
    flags = cpu_features().split()
    if "avx2" in flags or "avx512f" in flags:
        return None
    return (
        f"they are tuned for AVX2 and AVX-512 and this CPU has {cpu_features()}: "
        "auto keeps XLA's ops"
    )
