"""`scaletui roofline`: the book's estimates for one config, as a table or (`--json`) for scripts.

The flag and JSON key names are a contract (docs/roofline.md); add, never rename.
"""

from __future__ import annotations

import argparse
import sys

import orjson

from scaletui.commands.layout_flags import add_layout_flags, placement_from
from scaletui.dtypes import DTYPE_BYTES
from scaletui.roofline.costinputs import describe_precision
from scaletui.roofline.costmodel import CostModel
from scaletui.roofline.estimate import Estimate, estimate
from scaletui.roofline.fitstore import load_fit
from scaletui.specs import SpecError, hardware_names, load_hardware, load_model, model_names


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scaletui roofline",
        description="Roofline estimates from 'How to Scale Your Model' for a serving config.",
    )
    p.add_argument("--model", help="model spec name, YAML path or HF checkpoint dir (required)")
    p.add_argument("--hardware", help="hardware spec name, 'local', or YAML path (required)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    p.add_argument(
        "--context",
        type=int,
        default=1024,
        help="KV tokens per sequence during decode (default 1024)",
    )
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens for prefill/TTFT")
    p.add_argument("--decode-len", type=int, default=512, help="generated tokens per request")
    p.add_argument("--chips", type=int, default=1, help="chips holding one replica (default 1)")
    p.add_argument("--tp", type=int, default=None, help="tensor parallelism (default chips / dp)")
    p.add_argument("--dp", type=int, default=1, help="data parallelism inside the replica")
    p.add_argument(
        "--prefill-devices",
        type=int,
        default=0,
        help="with --hosts: disaggregated prefill devices beside the replica (0: interleaved)",
    )
    add_layout_flags(p)
    p.add_argument("--weight-bytes", type=float, default=2, help="bytes per weight (int4: 0.5)")
    p.add_argument("--kv-bytes", type=float, default=2, help="bytes per KV cache element")
    p.add_argument("--compute-dtype", default="bf16", choices=tuple(DTYPE_BYTES))
    p.add_argument("--mfu", type=float, default=1.0, help="prefill efficiency, 0-1 (default 1.0)")
    p.add_argument("--fit", help="cost model YAML: print the expectation beside the floor")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--list", action="store_true", help="list the shipped model and hardware specs")
    return p


def _si(value: float, unit: str) -> str:
    """1.2e9, 'B' -> '1.20 GB'; seconds as s/ms/us."""
    if unit == "s":
        if value == 0:
            return "0 s"
        for scale, suffix in ((1, "s"), (1e-3, "ms"), (1e-6, "us")):
            if abs(value) >= scale:
                return f"{value / scale:.3g} {suffix}"
        return f"{value * 1e9:.3g} ns"
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}".rstrip()


def format_table(e: Estimate) -> str:
    """The human view: grouped rows with units."""
    c = e.config
    rows: list[tuple[str, str]] = [
        (
            "config",
            f"{c['model']} on {c['chips']}x {c['hardware']} (tp={c['tp']}, dp={c['dp']}), "
            f"batch {c['batch']}, context {c['context']}, prompt {c['prompt_len']}",
        ),
        (
            "dtypes",
            f"weights {c['weight_bytes']:g} B/param, KV {c['kv_bytes']:g} B/element, "
            f"compute {c['compute_dtype']}",
        ),
        ("", ""),
        ("params", _si(e.params, "")),
        ("param bytes", _si(e.param_bytes, "B")),
        ("FLOPs / token", _si(e.flops_per_token, "FLOP")),
        ("KV / token", _si(e.kv_bytes_per_token, "B")),
        ("KV / sequence", _si(e.kv_bytes_per_seq, "B")),
        ("memory (replica)", _si(e.memory_bytes, "B")),
        (
            "memory / chip",
            f"{_si(e.memory_per_chip_bytes, 'B')} of {_si(e.hbm_bytes_per_chip, 'B')} "
            f"(weights {_si(e.weight_bytes_per_chip, 'B')}, KV {_si(e.kv_bytes_per_chip, 'B')}): "
            + ("fits" if e.fits else "DOES NOT FIT"),
        ),
        ("max batch", f"{e.max_batch} sequences at this context"),
        ("min chips", f"{e.min_chips} (power of two)"),
        ("critical batch", f"{e.critical_batch:.0f} tokens"),
        (
            "intensity",
            f"{e.arithmetic_intensity:.1f} FLOP/B (hardware {e.critical_intensity:.0f} FLOP/B)",
        ),
        ("", ""),
        (
            "decode step",
            f"{_si(e.decode_step_s, 's')} ({e.decode_bound}-bound): KV {_si(e.decode_kv_s, 's')}"
            f" + max(weights {_si(e.decode_weight_s, 's')}, matmul {_si(e.decode_matmul_s, 's')})",
        ),
        (
            "TP comms / step",
            f"{_si(e.decode_comm_s, 's')} (overlapped unless larger)"
            if c["tp"] > 1
            else "none (tp=1)",
        ),
        *_dcn_rows(e),
        (
            "decode tokens/s",
            f"{e.decode_tokens_per_s:,.1f} ({e.decode_tokens_per_s_per_chip:,.1f} / chip)",
        ),
        ("queries/s/chip", f"{e.queries_per_s_per_chip:.3g} at {c['decode_len']} tokens each"),
        ("", ""),
        (
            "prefill",
            f"{_si(e.prefill_s, 's')} with causal attention "
            f"(book matmul-only: {_si(e.prefill_matmul_s, 's')}, mfu {c['mfu']:g})",
        ),
        ("TTFT", _si(e.ttft_s, "s")),
        ("prefill tokens/s", f"{e.prefill_tokens_per_s:,.0f}"),
        (
            "KV transfer",
            f"{_si(e.kv_transfer_s, 's')} ICI/NVLink, "
            + (
                f"{_si(e.kv_transfer_dcn_s, 's')} DCN"
                if e.kv_transfer_dcn_s is not None
                else "DCN unknown"
            )
            + (
                f" (one prompt; the placement's: {e.kv_transfer_link})"
                if e.placement
                else " (one prompt)"
            ),
        ),
        ("prefill:generate", f"{e.prefill_generate_ratio:.2f} replicas (disaggregated)"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" if k else "" for k, v in rows)


def _dcn_rows(e: Estimate) -> list[tuple[str, str]]:
    """The placement and the DCN term of the step, when the estimate has a placement."""
    p = e.placement
    if p is None:
        return []
    crossing = ", ".join(p["crosses_slices"]) or "nothing"
    where = (
        f"{p['hosts']} hosts x {p['devices_per_host']} ({p['hosts'] // p['hosts_per_slice']} "
        f"slice(s)); tp spans {p['tp_hosts']} host(s); over DCN: {crossing}"
    )
    latency = "" if e.config["dcn_latency_known"] else " (bandwidth only: dcn_latency_s unknown)"
    return [
        ("placement", where),
        ("DCN / step", f"{_si(e.decode_comm_dcn_s, 's')} of the TP comms{latency}"),
    ]


FIT_CONFIG = ("model", "hardware", "dtype", "weight_dtype", "kv_dtype", "tp", "dp")


def expected(e: Estimate, cost: CostModel) -> dict:
    """The fitted expectation for this estimate's batch, context and prompt, beside the floor
    (the `expected` object of `--json`)."""
    c = e.config
    step = cost.decode_step_s(c["batch"], c["context"])
    prefill = cost.prefill_s(c["prompt_len"])
    return {
        "source": cost.source,
        "fit_config": {k: vars(cost)[k] for k in FIT_CONFIG},
        "decode_step_s": step,
        "decode_tokens_per_s": c["batch"] / step,
        "prefill_s": prefill,
        "ttft_s": prefill,
        "decode_step_over_floor": step / e.decode_step_s,
        "prefill_over_floor": prefill / e.prefill_s,
    }


def format_expected(x: dict) -> str:
    f = x["fit_config"]
    rows = [
        (
            "expected",
            f"{x['source']} cost model for {f['model']} on {f['hardware']} "
            f"({describe_precision(f['dtype'], f['weight_dtype'], f['kv_dtype'])}, "
            f"tp={f['tp']}, dp={f['dp']})",
        ),
        (
            "decode step",
            f"{_si(x['decode_step_s'], 's')} ({x['decode_step_over_floor']:.2f}x the floor)",
        ),
        ("decode tokens/s", f"{x['decode_tokens_per_s']:,.1f}"),
        (
            "prefill / TTFT",
            f"{_si(x['prefill_s'], 's')} ({x['prefill_over_floor']:.2f}x the floor)",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.list:
        print("models:   " + ", ".join(model_names()))
        print("hardware: " + ", ".join(hardware_names()))
        return 0
    if not args.model or not args.hardware:
        parser.error("--model and --hardware are required (see --list for the shipped specs)")
    try:
        model = load_model(args.model)
        hardware = load_hardware(args.hardware)
        tp = args.tp or args.chips // max(args.dp, 1)
        placement = placement_from(args, hardware, tp, args.dp, args.prefill_devices)
        est = estimate(
            model,
            hardware,
            batch=args.batch,
            context=args.context,
            prompt_len=args.prompt_len,
            decode_len=args.decode_len,
            chips=args.chips,
            tp=args.tp,
            dp=args.dp,
            weight_bytes=args.weight_bytes,
            kv_bytes=args.kv_bytes,
            compute_dtype=args.compute_dtype,
            mfu=args.mfu,
            placement=placement,
        )
        exp = expected(est, load_fit(args.fit)) if args.fit else None
    except (SpecError, ValueError) as exc:
        print(f"scaletui roofline: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = est.to_dict() | ({"expected": exp} if exp else {})
        sys.stdout.write(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(format_table(est))
        if exp:
            print("\n" + format_expected(exp))
    return 0
