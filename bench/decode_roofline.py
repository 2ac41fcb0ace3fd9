"""Measure the engine's decode step and prefill against the roofline on the local hardware.

For a model spec (default `small`) and a hardware spec (default `local`, from `scaletui
calibrate`; when missing, a short inline probe measures weight-read bandwidth and matmul FLOP/s
and says so), runs the real engine's `generate` at batch 1, 2, 4, ... up to --slots with every
slot at the stated context, and prints measured vs predicted step time, achieved bandwidth and
FLOP/s and efficiency = predicted / measured; then prefill (straight into a slot's pages, as the
server runs it) for a few prompt lengths, with its efficiency = achieved FLOP/s / the calibrated
FLOP/s of the compute dtype, and where the native prefill attention runs the same prefill on XLA's
attention beside it (`xla attn`, alternating repeat by repeat). `--json` prints one JSON object
instead.

The engine runs with `--kernels` (default auto, as the server does: the native CPU kernels of
`serve/engine/native` where they build; on GPU/TPU decode attention on JAX's Pallas paged-attention
kernels). When that is native or pallas, the same step is also timed on XLA's own ops in the
same run (`xla`, and the speedup `x`; `--baseline-batches` only at those batches,
`--no-baseline` never). `--weight-dtype` and
`--kv-dtype` store weights and KV narrower than `--dtype` computes (int8: with scales), as
`scaletui serve` does; the predictions read those bytes. `--batches` measures those batches
instead of 1, 2, 4, ... `--slots`. `--compare SPEC`
adds the predictions of a second hardware spec (say the one `scaletui calibrate` just wrote)
beside the first; `--json-out FILE` writes the JSON and still prints the tables;
`--prefill-only` skips the decode steps; `--check` parses the arguments and loads the specs,
then exits (bench/accelerator_run.sh --check) without importing JAX: the run is in
bench/_decode_roofline.py.

Beside each decode step it times a weights-only floor: the same weights and projections (q/k/v,
o, SwiGLU MLP, norms, lm head, argmax) through the same kernels in the same `fori_loop`, with
attention replaced by a shape-preserving stand-in and no KV cache. It is what the matmuls alone
cost at that batch, so predicted / floor bounds what any attention or cache design could reach.

    python bench/decode_roofline.py --model small --context 448 --slots 16
"""

from __future__ import annotations

import argparse
import sys

from _smoke import shrink

from scaletui.dtypes import DTYPES, STORAGE_DTYPES
from scaletui.shape import KERNELS, ConfigError, ServerShape
from scaletui.specs import load_hardware, load_model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--hardware", default="local")
    p.add_argument("--compare", help="a second hardware spec (name or YAML path) to predict with")
    p.add_argument("--context", type=int, default=448, help="KV tokens per slot at the start")
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--slots", type=int, default=16, help="largest batch measured")
    p.add_argument("--batches", type=int, nargs="*", help="these batches (default: 1, 2, 4, "
                   "... --slots)")  # fmt: skip
    p.add_argument("--steps", type=int, default=8, help="decode steps per generate call")
    p.add_argument("--calls", type=int, default=6, help="timed generate calls per repeat")
    p.add_argument("--repeats", type=int, default=3, help="best median of this many repeats")
    p.add_argument("--prompt-lens", type=int, nargs="*", default=[64, 256, 512])
    p.add_argument("--prefill-only", action="store_true", help="skip the decode steps")
    p.add_argument("--dtype", default="f32", choices=DTYPES, help="compute dtype")
    p.add_argument("--weight-dtype", choices=STORAGE_DTYPES, help="weight storage (int8: "
                   "per-channel scales; default: --dtype)")  # fmt: skip
    p.add_argument("--kv-dtype", choices=STORAGE_DTYPES, help="KV-cache storage (int8: a scale "
                   "per position and KV head; default: --dtype)")  # fmt: skip
    p.add_argument("--kernels", default="auto", choices=list(KERNELS))
    p.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="skip timing the XLA-ops engine beside the native or Pallas one",
    )
    p.add_argument("--baseline-batches", type=int, nargs="*",
                   help="time the XLA-ops baseline only at these batches")  # fmt: skip
    p.add_argument(
        "--no-floor", dest="floor", action="store_false", help="skip the weights-only floor"
    )
    p.add_argument(
        "--weights",
        choices=["host", "device"],
        default="host",
        help="seeded numpy weights (dummy_params), or random ones made on the device (seconds "
        "for an 8B model, where numpy takes minutes)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object, no tables")
    p.add_argument("--json-out", help="also write the JSON object to this file")
    p.add_argument("--check", action="store_true", help="parse, load the specs, and exit")
    p.add_argument(
        "--probe-seconds",
        type=float,
        default=1.0,
        help="the inline probe's time per figure, without a `local` spec (under 1: it reads "
        "64 MiB, not 1 GiB)",
    )
    # a smoke run (bench/_smoke.py): one batch, short calls, two KV buckets
    smoke = dict(context=32, max_seq_len=64, slots=1, steps=2, calls=1, repeats=1)
    return shrink(p, model="tiny", prompt_lens=[16], probe_seconds=0.05, **smoke)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.weight_dtype = args.weight_dtype or args.dtype
    args.kv_dtype = args.kv_dtype or args.dtype
    model = load_model(args.model)
    try:  # the precision as the server checks it (no wider storage than compute)
        seq = min(args.max_seq_len, model.max_seq_len)
        base = ServerShape(
            model=model,
            dtype=args.dtype,
            weight_dtype=args.weight_dtype,
            kv_dtype=args.kv_dtype,
            kernels=args.kernels,
            max_seq_len=seq,
        )
    except ConfigError as exc:
        print(f"decode_roofline: {exc.flag_line()}", file=sys.stderr)
        return 2
    if args.check:
        load_hardware(args.hardware)
        p = base.precision.describe()
        print(f"decode_roofline: arguments ok ({model.name}, {p}, on {args.hardware})")
        return 0
    import _decode_roofline  # JAX and the engine: only past --check

    return _decode_roofline.run(args, base)


if __name__ == "__main__":
    raise SystemExit(main())
