"""`scaletui doctor`: what this host has for serving, one line each (or one JSON object).

Reports versions, JAX's backend and devices, the native CPU kernels (cached, buildable or
unavailable and why; it never compiles), the `local` calibration, the config and cache paths and
the optional pieces. Exits 1 naming the problem when serving here would fail (JAX without a
device), else 0; what serves but slower (no native kernels on a CPU backend: a compiler is
missing or broken; `SCALETUI_NATIVE_KERNELS=0` says to do without) is a warning.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import os
import platform
import sys

import orjson

from scaletui import compile_cache, xla_env
from scaletui.specs import SpecError, load_hardware, local_hardware_path, user_config_dir

__all__ = ["facts", "main"]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cache_home() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "scaletui")


def _jax() -> dict:
    try:
        import jax

        devices = jax.devices()
    except Exception as e:  # any failure to bring up a backend is what doctor reports
        return {"version": _version("jax"), "backend": None, "error": f"{type(e).__name__}: {e}"}
    virtual = xla_env.host_devices()
    return {
        "version": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "backend": jax.default_backend(),
        "devices": len(devices),
        "kinds": sorted({d.device_kind for d in devices}),
        "virtual_cpu_devices": virtual or 1,
        "xla_flags": os.environ.get(xla_env.FLAGS_ENV, ""),
    }


def _kernels() -> dict:
    out: dict = {"compiler": None, "compiler_version": None, "cache_dir": None, "path": None}
    try:
        from scaletui.serve.engine.native import toolchain
    except ImportError as e:  # JAX itself is broken; _jax() says how
        return {**out, "status": "unavailable", "reason": f"cannot import JAX: {e}"}
    cxx = toolchain.compiler()
    out = {
        "compiler": cxx,
        "compiler_version": toolchain.compiler_version(cxx) if cxx else None,
        "cache_dir": str(toolchain.cache_dir()),
        "path": None,
        "reason": None,
    }
    if os.environ.get("SCALETUI_NATIVE_KERNELS", "1") == "0":
        return {**out, "status": "disabled", "reason": "SCALETUI_NATIVE_KERNELS=0"}
    try:
        p = toolchain.plan()
    except toolchain.BuildError as e:
        return {**out, "status": "unavailable", "reason": str(e)}
    header = os.path.join(p.include, "xla", "ffi", "api", "ffi.h")
    if not p.cached and not os.path.exists(header):
        reason = f"jaxlib ships no XLA FFI headers ({header} is missing)"
        return {**out, "status": "unavailable", "reason": reason}
    status = "cached" if p.cached else "buildable"
    return {**out, "status": status, "path": str(p.path), "slower_here": toolchain.slower_here()}


def _calibration() -> dict:
    path = local_hardware_path()
    if not path.exists():
        return {"status": "missing", "path": str(path)}
    written = dt.datetime.fromtimestamp(path.stat().st_mtime, dt.UTC)
    out = {"path": str(path), "written": written.isoformat(timespec="seconds")}
    try:
        hw = load_hardware(path)
    except SpecError as e:
        return {**out, "status": "invalid", "reason": str(e)}
    f32 = hw.flops_per_s.get("f32") or None
    return {
        **out,
        "status": "present",
        "kind": hw.kind,
        "hbm_bw": hw.hbm_bw,
        "f32_flops_per_s": f32,
    }


def facts() -> dict:
    """Everything doctor reports, as plain JSON-able data; `problems` empty means ready."""
    j = _jax()
    k = _kernels()
    problems, warnings = [], []
    if j["backend"] is None:
        problems.append(f"JAX has no usable backend: {j['error']}")
    elif j["backend"] == "cpu" and k["status"] == "unavailable":
        warnings.append(
            f"native CPU kernels unavailable ({k['reason'].splitlines()[0]}): `scaletui serve` "
            "falls back to XLA's ops, about 2x slower decode; install g++ (or set $CXX), or "
            "set SCALETUI_NATIVE_KERNELS=0 to do without"
        )
    return {
        "ok": not problems,
        "problems": problems,
        "warnings": warnings,
        "python": platform.python_version(),
        "scaletui": _version("scaletui"),
        "jax": j,
        "kernels": k,
        "calibration": _calibration(),
        "paths": {"config_dir": str(user_config_dir()), "cache_dir": _cache_home()},
        "compile_cache": _compile_cache(),
        "optional": {
            "uvloop": _version("uvloop"),
            "cxx": k["compiler"],
        },
    }


def _compile_cache() -> dict:
    path = compile_cache.cache_dir()
    entries, nbytes = compile_cache.usage(path)
    return {"dir": str(path) if path else None, "entries": entries, "bytes": nbytes}


def _lines(f: dict) -> list[str]:
    j, k, c = f["jax"], f["kernels"], f["calibration"]
    if j["backend"] is None:
        jax_line = f"{j['version'] or 'not installed'}, no backend: {j['error']}"
        dev_line = "none"
    else:
        jax_line = f"{j['version']} (jaxlib {j['jaxlib']}), backend {j['backend']}"
        dev_line = f"{j['devices']} x {', '.join(j['kinds'])}"
        if j["backend"] == "cpu":
            v = j["virtual_cpu_devices"]
            dev_line += (
                f" (virtual CPU devices: {v}, XLA_FLAGS --xla_force_host_platform_device_count)"
            )
    cxx = f"{k['compiler']} ({k['compiler_version']})" if k["compiler"] else "no C++ compiler"
    if k.get("slower_here"):
        kernels = f"not used by default: {k['slower_here']} (--kernels native forces them)"
    elif k["status"] == "cached":
        kernels = f"cached at {k['path']}; compiler {cxx}"
    elif k["status"] == "buildable":
        kernels = f"buildable (on first serve, or `scaletui build-kernels`) into {k['path']}; {cxx}"
    elif k["status"] == "disabled":
        kernels = "disabled by SCALETUI_NATIVE_KERNELS=0"
    else:
        kernels = f"unavailable: {k['reason'].splitlines()[0]}; cache {k['cache_dir']}"
    if c["status"] == "present":
        f32 = f"{c['f32_flops_per_s'] / 1e9:.1f} GFLOP/s" if c["f32_flops_per_s"] else "-"
        calib = (
            f"{c['path']} (written {c['written']}): hbm_bw {c['hbm_bw'] / 1e9:.1f} GB/s, f32 {f32}"
        )
    elif c["status"] == "invalid":
        calib = f"invalid: {c['reason']}"
    else:
        calib = f"none (`scaletui calibrate` writes {c['path']})"
    opt = f["optional"]
    uvloop = (
        f"uvloop {opt['uvloop']}" if opt["uvloop"] else "no uvloop (pip install scaletui[fast])"
    )
    paths = f"config {f['paths']['config_dir']}, cache {f['paths']['cache_dir']}"
    cc = f["compile_cache"]
    compiled = (
        f"{cc['dir']}: {cc['entries']} programs, {cc['bytes'] / 2**20:.1f} MiB"
        if cc["dir"]
        else f"off ({compile_cache.DIR_ENV} empty, or {compile_cache.default_dir()} not writable)"
    )
    verdict = "ready to serve" if f["ok"] else "; ".join(f["problems"])
    rows = [
        ("python", f["python"]),
        ("scaletui", f["scaletui"] or "not installed (running from a source tree)"),
        ("jax", jax_line),
        ("devices", dev_line),
        ("kernels", kernels),
        ("calibration", calib),
        ("paths", paths),
        ("compiled", compiled),
        ("optional", f"{uvloop}; {cxx}"),
        *(("warning", w) for w in f["warnings"]),
        ("ok" if f["ok"] else "problem", verdict),
    ]
    return [f"{name:<12} {text}" for name, text in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="scaletui doctor",
        description="Say what this host has for serving; exit 1 naming what is missing.",
    )
    ap.add_argument("--json", action="store_true", help="one JSON object with the same facts")
    args = ap.parse_args(argv)
    f = facts()
    if args.json:
        sys.stdout.write(orjson.dumps(f, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print("\n".join(_lines(f)))
    return 0 if f["ok"] else 1
