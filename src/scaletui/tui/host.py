"""This host, as the TUI's children see it: the default number of virtual JAX CPU devices, and
running `scaletui calibrate` as a child (own process group, bounded in time): `--quick` for the
`local` hardware spec the floor for "this machine" needs, `--model M ...` for the fitted cost
model of one server configuration (mesh and precision) the expectation needs. No events here:
the controller reports what these return.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from scaletui import specs, xla_env
from scaletui.procs import is_loopback_host, signal_group
from scaletui.roofline.fitstore import find_fit
from scaletui.tui.knobs import Knobs

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
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API (macOS)
        cores = os.cpu_count()
    return max(1, min(MAX_DEFAULT_HOST_DEVICES, cores or 1))


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
    """`scaletui serve` for the embedded server in the shape of `knobs`."""
    k = knobs
    cmd = [python, "-m", "scaletui", "serve", "--model", model]
    cmd += ["--port", str(port), "--slots", str(k.slots), "--tp", str(k.tp)]
    cmd += ["--dp", str(k.dp), "--mode", k.mode]
    for flag, dtype in (("--weight-dtype", k.weight_dtype), ("--kv-dtype", k.kv_dtype)):
        if dtype and flag not in extra:  # "": the server's default (its --dtype)
            cmd += [flag, dtype]
    if "--max-seq-len" not in extra:
        model_max = None
        with contextlib.suppress(specs.SpecError):  # a bad model: the server names it
            model_max = specs.load_model(model).max_seq_len  # tiny: 256
        cmd += ["--max-seq-len", str(serve_max_seq_len(k, model_max))]
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


def fit_lookup(config: dict) -> FitKey:
    """The fit key of a /stats "config" object (KeyError naming a key it lacks)."""
    c = config
    dtype = str(c.get("dtype", "f32"))
    return FitKey(
        str(c["model"]),
        dtype,
        int(c.get("tp", 1)),
        int(c.get("dp", 1)),
        kernels_of(c),
        str(c.get("weight_dtype") or dtype),
        str(c.get("kv_dtype") or dtype),
    )


def fit_command(prefix: list[str], config: dict) -> list[str]:
    """`scaletui calibrate --model M ... --quick` (after `prefix`, the python -m scaletui
    calibrate part) for the server configuration of a /stats "config" object, its precision
    included; KeyError naming a key it lacks."""
    c = config
    dtype = c.get("dtype", "f32")
    flags = {
        "--model": c["model"],
        "--slots": c["slots"],
        "--max-seq-len": c["max_seq_len"],
        "--decode-steps": c.get("decode_steps", 4),
        "--tp": c.get("tp", 1),
        "--dp": c.get("dp", 1),
        "--dtype": dtype,
        "--weight-dtype": c.get("weight_dtype") or dtype,
        "--kv-dtype": c.get("kv_dtype") or dtype,
        "--kernels": kernels_of(c),  # what runs: the fit is looked up by it
    }
    return [*prefix, *(str(x) for kv in flags.items() for x in kv), "--quick"]


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
    """'25.0 GB/s, 120 GFLOP/s f32' from calibrate's YAML, or '' when it lacks them."""
    try:
        got = yaml.safe_load(yaml_text) or {}
        return f"{got['hbm_bw'] / 1e9:.1f} GB/s, {got['flops_per_s']['f32'] / 1e9:.0f} GFLOP/s f32"
    except (yaml.YAMLError, KeyError, TypeError):
        return ""
