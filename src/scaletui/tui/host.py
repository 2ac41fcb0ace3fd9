"""This host, as the TUI's children see it: the default number of virtual JAX CPU devices, and
running `scaletui calibrate` as a child (own process group, bounded in time): `--quick` for the
`local` hardware spec the floor for "this machine" needs, `--model M ...` for the fitted cost
model of one server configuration (mesh and precision) the expectation needs. No events here:
the controller reports what these return.
"""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from scaletui import specs, xla_env
from scaletui.procs import is_loopback_host, signal_group
from scaletui.roofline.fitstore import find_fit
from scaletui.shape import FIT_KEYS, ServerShape, flag
from scaletui.tui.knobs import SERVER_KEYS, Knobs

MAX_DEFAULT_HOST_DEVICES = 8
ACCELERATOR_DEVICES = ("/dev/nvidia[0-9]*", "/dev/accel[0-9]*", "/dev/kfd", "/dev/vfio/[0-9]*")


def default_host_devices() -> int | None:
    """Virtual JAX CPU devices for the embedded server when the user named none: one per usable
    core, at most 8, on a host where JAX will run on the CPU, so that the tp/dp knobs have devices
    to shard over. None where JAX_PLATFORMS or a device node says an accelerator will be used
    (the XLA flag only affects the CPU platform, so a wrong guess costs nothing)."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        if platforms.split(",")[0].strip() != "cpu":
            return None
    elif any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICES):
        return None
    return max(1, min(MAX_DEFAULT_HOST_DEVICES, usable_cores()))


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity API (macOS)
        return os.cpu_count() or 1


def process_host_devices(processes: int) -> int:
    """Virtual CPU devices for each process of a `--processes N` server (always on the CPU):
    the default's one per core, at most 8 in all, shared among the processes, at least 1 each."""
    return max(1, min(MAX_DEFAULT_HOST_DEVICES, usable_cores()) // processes)


def is_loopback(url: str) -> bool:
    return is_loopback_host(urlsplit(url).hostname)


@dataclass(frozen=True)
class Skip:
    state: str  # the calibration state: done | off | remote | "" (an explicit spec)
    text: str  # the warning to show, if any


def calibration_skip(hardware: str, calibrate: bool, attached: bool, url: str) -> Skip | None:
    """Why this session runs no calibration (None: it should run one)."""
    if hardware not in ("", "local"):
        return Skip("", "")  # an explicit what-if spec: nothing to measure
    if "local" in specs.hardware_names():
        return Skip("done", "")
    if not calibrate:
        return Skip(
            "off",
            "no calibrated 'local' spec (--no-calibrate): predictions use a built-in spec, "
            "not this host; run `scaletui calibrate`",
        )
    if attached and not is_loopback(url):
        return Skip(
            "remote",
            f"{url} is remote: not calibrating this host for it; predictions use a built-in "
            "spec (pass --hardware NAME, or calibrate on the server's host)",
        )
    return None


def serve_command(
    python: str,
    model: str,
    port: int,
    knobs: Knobs,
    host_devices: int | None,
    extra: list[str],
) -> list[str]:
    """`scaletui serve` for the embedded server in the shape of `knobs` (their server keys and a
    --max-seq-len for their lengths, spelled by `ServerShape.to_flags`; a storage dtype left ""
    is the server's own), but for the flags the user passed in `extra`, which win."""
    cmd = [python, "-m", "scaletui", "serve", "--model", model, "--port", str(port)]
    try:
        spec = specs.load_model(model)  # tiny: max_seq_len 256
    except specs.SpecError:  # a bad model: the server names it
        return cmd + extra
    shape = knobs.shape(ServerShape(spec, max_seq_len=serve_max_seq_len(knobs, spec.max_seq_len)))
    keys = [k for k in ("max_seq_len", *SERVER_KEYS) if flag(k) not in extra]
    cmd += shape.to_flags(keys)
    if host_devices:
        cmd += ["--host-devices", str(host_devices)]
    return cmd + extra


def serve_max_seq_len(knobs: Knobs, model_max: int | None) -> int:
    """The embedded server's --max-seq-len: fewer prompt buckets to compile than the server's
    1024 default, room for 512 tokens, or the next power of two above the longest input + output
    + 1 (the tokenizer's BOS), capped at the model's own limit."""
    need = 512
    while need < knobs.longest + 1:
        need *= 2
    return min(need, model_max) if model_max else need


@dataclass(frozen=True)
class FitKey:
    """One server configuration as `fitstore.find_fit` looks its fit up: model, precision
    (compute, weight and KV-cache dtypes), mesh and kernels."""

    model: str
    dtype: str  # compute
    tp: int
    dp: int
    kernels: str = "auto"
    weight_dtype: str | None = None  # None: as dtype (fitstore names both alike)
    kv_dtype: str | None = None

    def find(self) -> Path | None:
        """The stored fit for this configuration, or None."""
        return find_fit(
            self.model,
            self.dtype,
            self.tp,
            self.dp,
            self.kernels,
            weight_dtype=self.weight_dtype,
            kv_dtype=self.kv_dtype,
        )


def kernels_of(config: dict) -> str:
    """The kernels a /stats "config" runs (`kernels_running`: native | pallas | xla), else what
    it asks for: a fit made with XLA's ops does not describe a server that `auto` put on the native
    kernels (nor the other way round), so fits are looked up by what runs."""
    running = config.get("kernels_running")
    known = ("native", "pallas", "xla")
    return str(running) if running in known else str(config.get("kernels", "auto"))


def running_shape(config: dict) -> ServerShape:
    """The server a /stats "config" object describes, at the kernels it runs (`kernels_of`):
    KeyError when it names no model, ValueError (SpecError, ConfigError) for one that is not
    a shape here."""
    return replace(ServerShape.from_json(config), kernels=kernels_of(config))


def fit_lookup(config: dict) -> FitKey:
    """The fit key of a /stats "config" object (its shape's `fit_key()`; errors as
    `running_shape`'s)."""
    return FitKey(**running_shape(config).fit_key())


# What `scaletui calibrate --model` is told: the fit's keys, and the sizes its grid times.
FIT_FLAGS = (*FIT_KEYS, "slots", "max_seq_len", "decode_steps")


def fit_command(prefix: list[str], config: dict) -> list[str]:
    """`scaletui calibrate --model M ... --quick` (after `prefix`, the python -m scaletui
    calibrate part) for the server configuration of a /stats "config" object, its precision
    spelled out and the kernels that run (the fit is looked up by them); KeyError naming a key
    it lacks."""
    missing = [k for k in ("model", "slots", "max_seq_len") if k not in config]
    if missing:
        raise KeyError(missing[0])
    shape = running_shape(config)
    p = shape.precision
    shape = replace(shape, weight_dtype=p.weights, kv_dtype=p.kv)
    return [*prefix, *shape.to_flags(FIT_FLAGS), "--quick"]


def calibrate_env(host_devices: int | None) -> dict[str, str]:
    """The environment for calibrate: the server's virtual device count (so the all-reduce is
    measured over the same devices), no preallocation (an attached server may hold the memory)."""
    return xla_env.child_env(host_devices, preallocate=False)


async def run_calibrate(
    cmd: list[str],
    env: dict[str, str],
    log_path: Path,
    timeout: float,
    started: Callable[[asyncio.subprocess.Process], None],
    local_exists: Callable[[], bool],
) -> tuple[str | None, str]:
    """Run calibrate (stderr to `log_path`); `started(proc)` lets the caller track its process
    group; `local_exists()` says whether it wrote what it should. Returns (None, summary of the
    spec) on success, else (why it failed, "")."""
    with log_path.open("ab") as log:
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
                env=env,
            )
        except OSError as exc:
            return f"cannot start {cmd[0]}: {exc}", ""
    started(proc)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        signal_group(proc.pid, signal.SIGKILL)
        await proc.wait()
        return f"no result after {timeout:.0f} s", ""
    if proc.returncode != 0 or not local_exists():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-2:]
        return f"exit code {proc.returncode}: {' | '.join(tail)}", ""
    return None, spec_summary(out)


def spec_summary(yaml_text: bytes | str) -> str:
    """'25.0 GB/s, 120 GFLOP/s f32; over 10 s read 22.1-27.0 GB/s (p10-p90), quiet' from
    calibrate's YAML (the spread part only where it has one), or '' when it lacks the roofs."""
    try:
        got = yaml.safe_load(yaml_text) or {}
        text = f"{got['hbm_bw'] / 1e9:.1f} GB/s, {got['flops_per_s']['f32'] / 1e9:.0f} GFLOP/s f32"
    except (yaml.YAMLError, KeyError, TypeError):
        return ""
    spread = (got.get("measured") or {}).get("spread")
    try:
        r, f = spread["read_bw"], spread["flops_per_s"]
        return text + (
            f"; over {spread['window_s']:g} s read {r['p10'] / 1e9:.1f}-{r['p90'] / 1e9:.1f} GB/s, "
            f"{f['p10'] / 1e9:.0f}-{f['p90'] / 1e9:.0f} GFLOP/s (p10-p90), "
            + ("NOISY: predictions carry a wide band" if spread["noisy"] else "quiet")
        )
    except (KeyError, TypeError):  # calibrated before the spread: the roofs alone
        return text + "; no spread measured (an older calibrate)"
