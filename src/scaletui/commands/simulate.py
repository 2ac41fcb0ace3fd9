"""`scaletui simulate`: what loadgen would measure, predicted by simulating our scheduler.

The workload flags are loadgen's, and loadgen's own `iter_requests` draws the request list, so
the same flags and seed give the same offsets and lengths as a real run. The cost of each step
comes from a fitted cost model (`--fit FILE`, else the stored fit for this server configuration
and precision when `--hardware local`) or from the spec's roofs times assumed efficiencies, with
weights and KV read in `--weight-dtype` and `--kv-dtype` (default: `--dtype`). Each figure comes
with its p10-p90 band over the measured spread (the hardware spec's `measured.spread`, the fit's
`info.residual_spread`; roofline/band.py): the same request list simulated at the spread's fast
and slow ends. Prints loadgen's table with the band beside each figure, or (`--json`, `--out
FILE`) loadgen's summary JSON keys plus `band: {key: [p10, p90]}`.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import orjson

from scaletui.commands.layout_flags import add_layout_flags, placement_from
from scaletui.dtypes import cpu_bf16_pairs, default_compute_dtype
from scaletui.loadgen import flags as loadgen_flags
from scaletui.loadgen.output import table
from scaletui.loadgen.workload import PROMPT_FORMATS, Workload, schedule
from scaletui.roofline import speedlog, speedtrace
from scaletui.roofline.band import SpeedFactors, SpeedSpread
from scaletui.roofline.costmodel import CostModel
from scaletui.roofline.dcn import with_dcn
from scaletui.roofline.fitstore import load_fit, stored_fits_for
from scaletui.roofline.simband import simulate_at, simulate_band
from scaletui.roofline.simrecords import (
    BOS_TOKENS,
    HOST_GAP_PER_ROW_S,
    HOST_GAP_S,
    INTAKE_S,
    Load,
    SimResult,
    SimTiming,
)
from scaletui.roofline.speedtrace import SpeedTrace
from scaletui.shape import ConfigError, ServerShape
from scaletui.shape_flags import add_flags
from scaletui.specs import ModelSpec, SpecError, load_hardware, load_model

MAX_REQUESTS = 1_000_000  # a --duration run draws at most this many
SIM_HELP = {  # where the simulator reads a server flag otherwise than `scaletui serve` does
    "prefill_devices": "disaggregated: prefill devices (0 = as many as generate has)",
    "dtype": "compute; default: a --fit's, with --hardware local the server's here, else f32 on "
    "a CPU spec, else bf16",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scaletui simulate", description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--model", required=True, help="model spec name, YAML path or HF checkpoint dir")
    a("--hardware", help="hardware spec ('local', a name, a YAML path); optional with --fit")
    a("--fit", help="cost model YAML (default: the stored fit for this config on --hardware local)")
    a("--no-fit", action="store_true", help="ignore stored fits: use assumed efficiencies")
    a("--efficiency", type=float, default=1.0, help="assumed: fraction of the spec's bandwidth")
    a("--flops-efficiency", type=float, help="assumed: fraction of peak FLOP/s (default: same)")
    a("--overhead-ms", type=float, default=0.0, help="assumed: fixed ms per step and per prefill")
    s = p.add_argument_group("server (scaletui serve's flags)")
    add_flags(s, omit=("model", "weights", "tokenizer", "seed"), helps=SIM_HELP)
    s.add_argument(
        "--intake-ms",
        type=float,
        default=INTAKE_S * 1e3,
        help="a request's HTTP + tokenizer time before it queues, one request at a time",
    )
    s.add_argument(
        "--gap-ms",
        type=float,
        default=HOST_GAP_S * 1e3,
        help="the scheduler's host time before each engine call while busy (/stats host_gap)",
    )
    s.add_argument(
        "--gap-per-row-ms",
        type=float,
        default=HOST_GAP_PER_ROW_S * 1e3,
        help="and its growth per running request",
    )
    add_layout_flags(p.add_argument_group("layout over hosts (priced at the spec's DCN bandwidth)"))
    g = p.add_argument_group("workload (loadgen's flags)")
    g.add_argument("--qps", type=float, help="offered request rate (req/s)")
    loadgen_flags.add_arrival_flags(g)
    loadgen_flags.add_request_flags(g)
    g.add_argument(
        "--prompt-format",
        choices=PROMPT_FORMATS,
        default="text",
        help="text: the server prefills one BOS token more; ids: none",
    )
    a("--no-band", action="store_true", help="the point alone: no p10-p90 band (one simulation)")
    a(
        "--as-run",
        metavar="FACTORS",
        help="simulate at a run's measured speed factors, e.g. decode=1.12,prefill=0.95,host=1.0 "
        "(time multipliers; one left out is 1): the 'as run' figure, no band",
    )
    a(
        "--as-run-from",
        metavar="RESULT[:STAGE]",
        help="simulate at the speeds a loadgen run met (its result JSON's server_metrics: the "
        "stage's speed factors, each call at its moment's speed from the speed timeline); a "
        "file of several stages needs :STAGE (from 0). No band",
    )
    a(
        "--draws",
        type=_draws,
        default=1,
        help="N: each figure the median over N draws of the engine calls' variation (a fitted "
        "model's call_spread; seeds --seed, --seed + 1, ...; the request list the same), the "
        "band's ends too: a steadier point for N x the time (default 1)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the summary JSON on stdout")
    o.add_argument("--out", help="write the summary JSON here")
    return p


def _draws(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 99:
        raise argparse.ArgumentTypeError(f"should be a whole number of draws 1..99, got {text!r}")
    return int(text)


def workload_from(args: argparse.Namespace) -> Workload:
    """loadgen's own Workload for these flags, drawn as ids prompts: the lengths come from
    their own random stream, so the prompt format changes nothing but the drawing time (the
    BOS a text prompt gains is added by `run`)."""
    as_loadgen = argparse.Namespace(
        **{**vars(args), "prompt_format": "text" if args.dataset else "ids"},
        sweep=None,
        cancel_rate=0.0,
    )
    return loadgen_flags.workload_from(as_loadgen)


def server_shape(args: argparse.Namespace, model: ModelSpec) -> ServerShape:
    """The simulated server's shape from the flags. Without --dtype the precision is a --fit's;
    with --hardware local the one `scaletui serve` starts with here (as `calibrate --model`
    fits it: bf16 on GPU/TPU and where the CPU's native kernels multiply bf16 pairs, read
    from /proc/cpuinfo, not JAX); else f32 on a CPU spec, bf16 on an accelerator's."""
    dtype, weights, kv = args.dtype, args.weight_dtype, args.kv_dtype
    if dtype is None and args.fit:
        fit = load_fit(args.fit)
        dtype, weights, kv = fit.dtype, weights or fit.weight_dtype, kv or fit.kv_dtype
    elif dtype is None and args.hardware:
        hw = load_hardware(args.hardware)
        local = args.hardware == "local"  # a CPU spec's own flags are not this CPU's
        pairs = lambda: local and cpu_bf16_pairs()  # noqa: E731
        dtype = default_compute_dtype(hw.kind, pairs, args.kernels, args.tp, args.dp, weights, kv)
    elif dtype is None:
        raise ValueError("give --hardware (a spec) or --fit FILE")
    omit = ("weights", "tokenizer", "seed")
    storage = {"weight_dtype": weights or "", "kv_dtype": kv or ""}
    return ServerShape.from_args(args, omit, model=model, dtype=dtype, **storage)


def cost_models(
    args: argparse.Namespace, model: ModelSpec, shape: ServerShape
) -> tuple[CostModel, CostModel, str]:
    """(decode, prefill, words saying where the costs come from)."""
    path = Path(args.fit) if args.fit else None
    passed_over = ""  # a stored fit for this configuration that is no longer trusted, and why
    if path is None and not args.no_fit and args.hardware == "local":
        found = stored_fits_for(shape.fit_key())
        path = next((f for f, why in found if why is None), None)
        if path is None and found:  # each one there is stale
            passed_over = (
                f"; the stored fit {found[0][0]} was passed over ({found[0][1]}): "
                f"`scaletui calibrate --model {model.name}` fits again"
            )
    if path is not None:
        cost = load_fit(path)
        if (cost.model, cost.tp, cost.dp) != (model.name, args.tp, args.dp):
            print(
                f"scaletui simulate: warning: the fit is for {cost.model} tp {cost.tp} dp "
                f"{cost.dp}, not {model.name} tp {args.tp} dp {args.dp}",
                file=sys.stderr,
            )
        asked = {k: vars(args)[k] for k in ("dtype", "weight_dtype", "kv_dtype") if vars(args)[k]}
        if any(vars(cost)[k] != v for k, v in asked.items()):
            flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in asked.items())
            print(
                f"scaletui simulate: warning: the fit is for {cost.describe_precision()}, "
                f"not {flags}",
                file=sys.stderr,
            )
        made = cost.info.get("date", "an unknown date")
        return cost, cost, f"cost model: fit {path} ({cost.source}, {made})"
    if not args.hardware:
        raise ValueError("give --hardware (a spec) or --fit FILE")
    hw = load_hardware(args.hardware)
    p = shape.precision
    gen_devices = args.tp * args.dp
    pre_devices = args.prefill_devices or gen_devices
    host = gen_devices + (pre_devices if shape.mode == "disaggregated" else 0)
    kw = dict(
        dtype=p.compute,
        weight_dtype=p.weights,
        kv_dtype=p.kv,
        efficiency=args.efficiency,
        flops_efficiency=args.flops_efficiency,
        overhead_s=args.overhead_ms / 1e3,
        kernels=args.kernels,
    )
    decode = CostModel.assumed(model, hw, tp=args.tp, dp=args.dp, host_devices=host, **kw)
    prefill = CostModel.assumed(
        model, hw, tp=args.tp, dp=max(pre_devices // args.tp, 1), host_devices=host, **kw
    )
    eff = args.flops_efficiency or args.efficiency
    words = (
        f"cost model: assumed, {args.efficiency:.0%} of {hw.name}'s bandwidth, {eff:.0%} of "
        f"its FLOP/s, {args.overhead_ms:g} ms overhead (no fit)"
    )
    if hw.kind == "cpu" and host > 1:
        words += f"; {host} virtual devices share the host's roofs"
    return decode, prefill, words + passed_over


def speed_spread(args: argparse.Namespace, decode: CostModel) -> SpeedSpread:
    """The band's spread: the host's from the hardware spec (--hardware, else `local` for a fit
    made on it), a fitted model's residuals and past runs (speedlog.spread_of); unknown parts
    are said so."""
    name = args.hardware or ("local" if decode.hardware == "local" else None)
    host = None
    if name is not None:
        try:
            host = (load_hardware(name).extra.get("measured") or {}).get("spread")
        except SpecError:  # a --fit of a host whose spec is not here: the host part unknown
            host = None
    return speedlog.spread_of(host, decode)


def as_run_speeds(args: argparse.Namespace) -> tuple[SpeedFactors | None, SpeedTrace | None]:
    """--as-run's factors, or --as-run-from's factors and trace; (None, None) for neither.
    ValueError naming the flag's bad part."""
    if args.as_run and args.as_run_from:
        raise ValueError("--as-run and --as-run-from both give the run's speed: give one")
    if args.as_run:
        return SpeedFactors.parse(args.as_run), None
    if not args.as_run_from:
        return None, None
    factors, trace = speedtrace.read_result(args.as_run_from, "--as-run-from")
    return SpeedFactors(**factors), trace


def run(args: argparse.Namespace) -> tuple[SimResult, str, float]:
    model = load_model(args.model)
    shape = server_shape(args, model)
    ms = {"intake_s": args.intake_ms, "gap_s": args.gap_ms, "gap_per_row_s": args.gap_per_row_ms}
    timing = SimTiming(**{k: v / 1e3 for k, v in ms.items()})
    decode, prefill, words = cost_models(args, model, shape)
    placement = None
    if args.hosts is not None:  # the DCN term: what the layout sends across hosts, every step
        if not args.hardware:
            raise ValueError("--hosts needs --hardware (its dcn_bw and chips_per_host)")
        hw = load_hardware(args.hardware)
        pre = args.prefill_devices or args.tp * args.dp if shape.mode == "disaggregated" else 0
        placement = placement_from(args, hw, args.tp, args.dp, pre)
        decode, prefill = (with_dcn(c, model, hw, placement) for c in (decode, prefill))
    workload = workload_from(args)
    n = args.num_requests or (None if args.duration else 200)
    growing = n is None and workload.closed_loop  # how many a closed loop sends: run and see
    take = 1000 if growing else n
    bos = BOS_TOKENS if args.prompt_format == "text" or args.dataset else 0  # BOS, then the prompt
    as_run, trace = as_run_speeds(args)
    speed = as_run or SpeedFactors()
    t0 = time.perf_counter()
    while True:
        offsets, inp, out = schedule(workload, take, args.duration, MAX_REQUESTS)
        inp = inp + bos
        load = Load(
            offsets,
            inp,
            out,
            concurrency=args.concurrency,
            closed_loop=workload.closed_loop,
            duration=args.duration,
            requested_rate=args.qps,
            prefix_groups=args.prefix_groups,
            prefix_len=args.prefix_len and args.prefix_len + bos,
        )
        draws = (shape, decode, load, speed, prefill, args.seed, timing, trace, args.draws)
        result = simulate_at(*draws)
        if not growing or result.summary["sent"] < len(offsets) or take >= MAX_REQUESTS:
            break
        take = min(take * 4, MAX_REQUESTS)
    point_s = time.perf_counter() - t0
    banded = not (args.no_band or as_run)
    spread = speed_spread(args, decode) if banded else SpeedSpread()
    if banded:  # the ends on the point's request list and seeds
        got = simulate_band(shape, decode, load, spread, prefill, args.seed, timing, args.draws,
                            point=result)  # fmt: skip
        result.summary["band"] = got.band
    seconds = time.perf_counter() - t0
    result.summary["config"] = {
        "simulated": True,
        "server": {**shape.to_json(), **asdict(timing)},
        "tp": args.tp,
        "dp": args.dp,
        "workload": asdict(replace(workload, prompt_format=args.prompt_format)),
        "precision": decode.describe_precision(),
        "cost_model": decode.to_dict(),
        "cost_source": words,
        # the band's ends as speed factors (time multipliers) and where they came from
        "speed_spread": {**spread.to_dict(), "band": banded},
        # the speed factors simulated at (--as-run; None: the fit's own speed)
        "as_run": vars(as_run) if as_run else None,
        # --as-run-from: each kind's speed in time over the mean (None: the mean throughout)
        "as_run_trace": trace.to_dict() if trace else None,
        "draws": args.draws,  # each figure the median over this many draws
        "seconds": {"point": round(point_s, 3), "with_band": round(seconds, 3)},
        # the layout over hosts and the decode step's DCN term (None: one host)
        "placement": placement.to_dict() if placement else None,
        "dcn_step_s_at_slots": decode.dcn_decode_s(shape.slots) if placement else None,
    }
    return result, words, seconds


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        if args.qps is None and args.concurrency is None:
            raise ValueError("give --qps RATE and/or --concurrency N")
        result, words, seconds = run(args)
    except (SpecError, ValueError, OSError) as exc:
        said = exc.flag_line() if isinstance(exc, ConfigError) else exc  # names the flag
        print(f"scaletui simulate: error: {said}", file=sys.stderr)
        return 2
    s = result.summary
    s["command"] = ["scaletui", "simulate", *argv]  # as loadgen's summary records its own
    if args.out:
        Path(args.out).write_bytes(orjson.dumps(s, option=orjson.OPT_INDENT_2))
    if args.json:
        sys.stdout.write(orjson.dumps(s, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    print(
        f"simulated {s['num_prompts']} requests in {seconds:.2f} s at "
        f"{s['config']['precision']}; {words}"
    )
    if "band" in s:
        print(f"band: p10-p90 [in brackets] over the measured spread; {spread_words(s)}")
    if s["config"]["as_run"]:
        f, trace = s["config"]["as_run"], s["config"]["as_run_trace"]
        moving = ""
        if trace:
            parts = [f"{k} x{min(v['relative']):.2f}-x{max(v['relative']):.2f} over "
                     f"{len(v['relative'])} spells" for k, v in trace.items()]  # fmt: skip
            moving = f", moving in time as the run's: {', '.join(parts)} of the mean"
        print(
            f"as run: at speed factors decode x{f['decode']:.3g}, prefill x{f['prefill']:.3g}, "
            f"host x{f['host']:g}{moving} (no band)"
        )
    if p := s["config"]["placement"]:
        dcn_ms, rows = s["config"]["dcn_step_s_at_slots"] * 1e3, s["config"]["server"]["slots"]
        over = ", ".join(p["crosses_slices"]) or "nothing"
        print(f"layout: {p['hosts']} hosts x {p['devices_per_host']}, over DCN: {over}; DCN term "
              f"{dcn_ms:.3f} ms per decode step at {rows} rows")  # fmt: skip
    print(table(s))
    batch = s.get("mean_running_batch")
    print(
        f"mean running batch {batch:.2f} over {s['generate_calls']} generate calls"
        if batch is not None
        else "no generate call"
    )
    return 0


def spread_words(s: dict) -> str:
    """Where the band came from, for the line above the table."""
    sp = s["config"]["speed_spread"]
    fast, slow = sp["fast"], sp["slow"]
    if fast == slow:
        return f"no width: {sp['note']}"
    return (
        f"decode x{fast['decode']:.2f}-x{slow['decode']:.2f}, prefill x{fast['prefill']:.2f}-"
        f"x{slow['prefill']:.2f}, host x{fast['host']:.2f}-x{slow['host']:.2f} ({sp['note']})"
    )
