"""`scaletui calibrate --model M`: build this server shape's engine, time it over
engine_fit's grid, and store the fitted cost model beside `local`."""

from __future__ import annotations

import sys
from dataclasses import replace

from scaletui import engine_fit, xla_env
from scaletui.engine_fit import grid_for, stderr_log
from scaletui.roofline.costmodel import CostModel
from scaletui.shape import ServerShape
from scaletui.shape_flags import add_flags


def _base_hardware(host_devices: int):
    """The `local` spec when calibrated, else a stand-in whose roofs the fit replaces (only the
    hand-over bandwidth of a disaggregated server is not fitted)."""
    from scaletui.specs import HardwareSpec, SpecError, load_hardware

    try:
        return load_hardware("local"), None
    except SpecError:
        stand_in = HardwareSpec(
            name="local-unmeasured",
            kind="cpu",
            flops_per_s={"f32": 5e10, "bf16": 5e10},
            hbm_bytes=16e9,
            hbm_bw=2e10,
            ici_bw=5e9,
            ici_bidirectional=False,
            dcn_bw=5e9,
            chips_per_host=host_devices,
        )
        return stand_in, "no 'local' spec: the KV hand-over bandwidth is a stand-in 5 GB/s"


# the server flags that change nothing the grid times (the scheduler's queue, real weights)
NOT_TIMED = ("weights", "tokenizer", "max_waiting", "max_waiting_tokens")
FIT_HELP = {
    "mode": "recorded with the fit (the grid times the generate engine)",
    "dtype": "compute; default: the server's (bf16 on GPU/TPU and on a CPU whose native kernels "
    "multiply bf16, else f32)",
}


def build_parser():
    import argparse

    p = argparse.ArgumentParser(
        prog="scaletui calibrate --model",
        description="Time this server configuration's engine over a small grid of batch x "
        "context x prompt length and store the fitted cost model beside 'local' (what `scaletui "
        "simulate`, `scaletui roofline --fit` and the TUI's expected column use).",
    )
    add_flags(p, omit=NOT_TIMED, helps=FIT_HELP)  # `scaletui serve`'s, for the engine timed
    a = p.add_argument
    a("--host-devices", type=int, help="JAX CPU: virtual devices (default: tp * dp)")
    a("--quick", action="store_true", help="3 passes of 2 calls (about two thirds of the time)")
    a("--out", help="write here instead of the fit store")
    a("--no-write", action="store_true", help="print the fit only")
    return p


def main(argv: list[str] | None = None) -> int:
    """`scaletui calibrate --model M ...`: exit 0 with the fit written (YAML also on stdout),
    2 for a configuration that cannot be built here (the reason on stderr)."""
    from pathlib import Path

    import yaml

    args = build_parser().parse_args(argv)
    devices_needed = args.host_devices or args.tp * args.dp
    if devices_needed > 1:  # a count the user set stays
        xla_env.set_host_devices(devices_needed, keep=True)
    import jax

    from scaletui.roofline.fitstore import fit_path_for, save_fit
    from scaletui.serve.engine.build import default_compute_dtype
    from scaletui.shape import ConfigError
    from scaletui.specs import SpecError, load_model

    backend = jax.default_backend()
    dtype = args.dtype or default_compute_dtype(
        args.kernels, args.tp, args.dp, args.weight_dtype, args.kv_dtype
    )
    try:
        model = load_model(args.model)
        config = ServerShape.from_args(args, NOT_TIMED, model=model, dtype=dtype)
    except (SpecError, ConfigError, ValueError) as exc:
        print(f"calibrate --model: {exc}", file=sys.stderr)
        return 2
    devices = jax.devices()
    if len(devices) < args.tp * args.dp:
        print(
            f"calibrate --model: tp * dp = {args.tp * args.dp} devices needed, "
            f"{len(devices)} available ({backend}); on a CPU host pass --host-devices "
            f"{args.tp * args.dp}",
            file=sys.stderr,
        )
        return 2
    devices = devices[: args.tp * args.dp]
    hardware, note = _base_hardware(len(jax.devices()))
    from scaletui.serve.engine.build import build_engines
    from scaletui.serve.weights import quant, weights

    p = config.precision
    host_params = weights.dummy_params(model, config.seed, dtype)
    host_params = quant.convert_params(host_params, p.compute, p.weights)  # once for every engine
    _, probe = build_engines(replace(config, slots=config.dp), devices, host_params=host_params)
    kernels = probe.describe().kernels  # what auto resolved to: fits are per kernels
    grid = grid_for(config, probe.decode_buckets, probe.prefill_buckets, args.quick)
    del probe
    base = CostModel.assumed(
        model,
        hardware,
        dtype=p.compute,
        weight_dtype=p.weights,
        kv_dtype=p.kv,
        tp=args.tp,
        dp=args.dp,
        kernels=kernels,
        host_devices=len(jax.devices()) if hardware.kind == "cpu" else None,
    )
    n = len(grid.decode) + len(grid.prefill)
    stderr_log(
        f"calibrate --model {model.name} ({p.describe()}): {n} points x {grid.rounds} "
        f"passes on {len(devices)} {backend} device(s), kernels {kernels}"
    )
    cost = engine_fit.fit_engine(
        config, devices, base, grid=grid, host_params=host_params, log=stderr_log
    )
    if note:
        cost = replace(cost, info={**cost.info, "notes": [*cost.info.get("notes", []), note]})
    i = cost.info
    stderr_log(
        f"fit: decode rms error {i['decode_rms_rel_error']:.1%} (max "
        f"{i['decode_max_rel_error']:.1%}; one straight line in the batch: "
        f"{i['linear_decode_rms_rel_error']:.1%}), {i['seconds']} s"
    )
    if cost.call_spread:
        q = cost.call_spread
        stderr_log(
            f"fit: one call over its median: x{q[len(q) // 10]:.2f} at p10, "
            f"x{q[len(q) * 9 // 10]:.2f} at p90, x{q[-1]:.2f} at the top "
            "(the simulator draws each call's from these)"
        )
    for kind, r in (i.get("residual_spread") or {}).items():
        stderr_log(
            f"fit: {kind} measured / model x{r['p10']:.3f} at p10, x{r['p90']:.3f} at p90 "
            f"over {r['n']} points (a band's fit part: scaletui simulate)"
        )
    text = yaml.safe_dump(cost.to_dict(), sort_keys=False)
    if not args.no_write:
        # stored under the shape's fit key, with the kernels that `auto` resolved to
        key = {**config.fit_key(), "kernels": kernels}
        path = Path(args.out) if args.out else fit_path_for(key)
        save_fit(cost, path)
        stderr_log(f"calibrate --model: wrote {path}")
    sys.stdout.write(text)
    return 0
