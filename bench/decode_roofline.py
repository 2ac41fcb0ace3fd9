"""Measure the engine's decode step and prefill against the roofline on the local hardware.

For a model spec (default `small`) and a hardware spec (default `local`, from `scaletui
calibrate`; when missing, a short inline probe measures weight-read bandwidth and matmul FLOP/s
and says so), runs the real engine's `generate` at batch 1, 2, 4, ... up to --slots with every
slot at the stated context, and prints measured vs predicted step time, achieved bandwidth and
FLOP/s and efficiency = predicted / measured; then prefill time vs prediction for a few prompt
lengths. `--json` prints one JSON object instead.

The engine runs with `--kernels` (default auto: the native CPU kernels of `serve/native` where
they build, as the server does). When that is native, the same step is also timed on XLA's own
ops in the same run (`xla`, and the speedup `x`; `--no-baseline` skips it).

Beside each decode step it times a weights-only floor: the same weights and projections (q/k/v,
o, SwiGLU MLP, norms, lm head, argmax) through the same kernels in the same `fori_loop`, with
attention replaced by a shape-preserving stand-in and no KV cache. It is what the matmuls alone
cost at that batch, so predicted / floor bounds what any attention or cache design could reach.

    python bench/decode_roofline.py --model small --context 448 --slots 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orjson
from jax import lax

from scaletui import roofline
from scaletui.serve import model as llama
from scaletui.serve.config import ServeConfig
from scaletui.serve.engine import build_engines
from scaletui.serve.engine_api import SamplingParams
from scaletui.serve.weights import dummy_params
from scaletui.specs import HardwareSpec, SpecError, load_hardware, load_model


def probe_hardware(seconds: float = 1.0) -> HardwareSpec:
    """Quick inline calibration: f32 GEMV-like weight reads (bytes/s) and a 2048^3 matmul.

    Takes the fastest run, not the median: on a shared machine that is the closest to the
    hardware's roof, so efficiencies against it err low.
    """
    w = [jnp.full((2048, 8192), 0.5, jnp.float32) for _ in range(16)]  # 1 GiB of "weights"
    x = jnp.ones((1, 2048), jnp.float32)
    gemv = jax.jit(lambda x, w: [x @ wi for wi in w])
    a = jnp.ones((2048, 2048), jnp.float32)
    mm = jax.jit(lambda a: a @ a)

    def best(fn, *args) -> float:
        jax.block_until_ready(fn(*args))
        times, t_end = [], time.perf_counter() + seconds
        while time.perf_counter() < t_end or len(times) < 3:
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
        return min(times)

    bw = sum(wi.nbytes for wi in w) / best(gemv, x, w)
    flops = 2 * 2048**3 / best(mm, a)
    return HardwareSpec(
        name="inline-probe",
        kind="cpu",
        flops_per_s={"f32": flops},
        hbm_bytes=16e9,
        hbm_bw=bw,
        ici_bw=bw,
        ici_bidirectional=False,
        dcn_bw=1e9,
        chips_per_host=1,
    )


def _hardware(ref: str) -> tuple[HardwareSpec, str]:
    try:
        return load_hardware(ref), ref
    except SpecError as exc:
        if ref != "local":
            raise
        print(f"note: {exc}; probing bandwidth and FLOP/s inline instead", file=sys.stderr)
        return probe_hardware(), "inline probe (run `scaletui calibrate` for a saved spec)"


DTYPE_BYTES = {"f32": 4, "bf16": 2}


def _estimate(model, hw, *, batch: int, context: int, dtype: str, prompt_len: int = 16):
    return roofline.estimate(
        model,
        hw,
        batch=batch,
        context=context,
        prompt_len=prompt_len,
        chips=1,
        weight_bytes=DTYPE_BYTES[dtype],
        kv_bytes=DTYPE_BYTES[dtype],
        compute_dtype=dtype,
    )


def weights_floor(params: dict, m, batch: int, steps: int, calls: int, repeats: int) -> float:
    """Seconds per decode step of the weights-only stand-in (see the module docstring)."""

    def run(params, tok, n):
        def step(i, tok):
            x = llama.embed_tokens(params, tok)  # [B, D]
            cos, sin = llama.rope(jnp.full(tok.shape, i), m.head_dim, m.rope_theta)
            for p in params["layers"]:
                h = llama.rms_norm(x, p["attn_norm"], m.norm_eps)
                q, k, v = llama.qkv_proj(p, h, cos, sin, m)
                o = q + jnp.repeat(k + v, q.shape[1] // k.shape[1], axis=1)  # attention stand-in
                x = x + llama.out_proj(p, o, m)
                x = x + llama.mlp(p, llama.rms_norm(x, p["mlp_norm"], m.norm_eps), m)
            return jnp.argmax(llama.logits_of(params, x, m), axis=-1).astype(jnp.int32)

        return lax.fori_loop(0, n, step, tok)

    fn = jax.jit(run)
    tok, n = jnp.arange(batch, dtype=jnp.int32), jnp.int32(steps)
    jax.block_until_ready(fn(params, tok, n))
    medians = []
    for _ in range(repeats):
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(params, tok, n))
            times.append((time.perf_counter() - t0) / steps)
        medians.append(statistics.median(times))
    return min(medians)


def time_decode_step(args, model, host_params, batch: int, kernels: str) -> tuple[float, object]:
    """(seconds per decode step, engine): best over repeats of the median generate call."""
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, model.vocab_size, args.context)]
    params = SamplingParams(max_tokens=args.max_seq_len, ignore_eos=True)
    cfg = ServeConfig(
        model=model,
        slots=batch,
        max_seq_len=args.max_seq_len,
        decode_steps=args.steps,
        dtype=args.dtype,
        kernels=kernels,
    )
    eng, _ = build_engines(cfg, jax.devices()[:1], host_params=host_params)
    prefix = eng.prefill(prompt, params)
    for b in eng.decode_buckets:  # every bucket the timed calls can reach: no compile inside
        if b > args.context:
            eng._generate_exe(b)
    medians = []
    for _ in range(args.repeats):
        state = eng.init_decode_state()
        for slot in range(batch):
            state = eng.insert(state, prefix, slot)
        state, _ = eng.generate(state, args.steps)  # compiles the bucket on first use
        times = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            state, _ = eng.generate(state, args.steps)
            times.append((time.perf_counter() - t0) / args.steps)
        medians.append(statistics.median(times))
    return min(medians), eng


def bench_decode(args, model, hw, host_params) -> list[dict]:
    rows = []
    batch = 1
    while batch <= args.slots:
        step, eng = time_decode_step(args, model, host_params, batch, args.kernels)
        floor = weights_floor(eng.params, model, batch, args.steps, args.calls, args.repeats)
        baseline = None
        if eng.native and args.baseline:  # the same step on XLA's own ops, in the same run
            baseline, _ = time_decode_step(args, model, host_params, batch, "xla")
        ctx = args.context + args.steps * (1 + args.calls / 2)  # mean live context measured
        est = _estimate(model, hw, batch=batch, context=int(ctx), dtype=args.dtype)
        kv_read = batch * est.kv_bytes_per_token * ctx
        rows.append(
            {
                "batch": batch,
                "context": int(ctx),
                "bucket": eng.last_step_stats["bucket"],
                "kernels": "native" if eng.native else "xla",
                "measured_ms": step * 1e3,
                "predicted_ms": est.decode_step_s * 1e3,
                "bound": est.decode_bound,
                "gb_per_s": (est.param_bytes + kv_read) / step / 1e9,
                "gflop_per_s": est.flops_per_token * batch / step / 1e9,
                "tokens_per_s": batch / step,
                "efficiency": est.decode_step_s / step,
                "floor_ms": floor * 1e3,
                "floor_efficiency": est.decode_step_s / floor,
                "xla_ms": baseline * 1e3 if baseline else None,
                "speedup_vs_xla": baseline / step if baseline else None,
            }
        )
        batch *= 2
    return rows


def bench_prefill(args, model, hw, host_params) -> list[dict]:
    cfg = ServeConfig(
        model=model, slots=1, max_seq_len=args.max_seq_len, dtype=args.dtype, kernels=args.kernels
    )
    eng, _ = build_engines(cfg, jax.devices()[:1], host_params=host_params)
    rng = np.random.default_rng(1)
    rows = []
    for n in args.prompt_lens:
        prompt = [int(t) for t in rng.integers(0, model.vocab_size, n)]
        eng.prefill(prompt, SamplingParams())  # compile
        times = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            eng.prefill(prompt, SamplingParams())
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        est = _estimate(model, hw, batch=1, context=n, dtype=args.dtype, prompt_len=n)
        rows.append(
            {
                "prompt_len": n,
                "measured_ms": t * 1e3,
                "predicted_ms": est.prefill_s * 1e3,
                "gflop_per_s": est.prefill_flops / t / 1e9,
                "efficiency": est.prefill_s / t,
            }
        )
    return rows


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}ms"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--hardware", default="local")
    p.add_argument("--context", type=int, default=448, help="KV tokens per slot at the start")
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--slots", type=int, default=16, help="largest batch measured")
    p.add_argument("--steps", type=int, default=8, help="decode steps per generate call")
    p.add_argument("--calls", type=int, default=6, help="timed generate calls per repeat")
    p.add_argument("--repeats", type=int, default=3, help="best median of this many repeats")
    p.add_argument("--prompt-lens", type=int, nargs="*", default=[64, 256, 512])
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    p.add_argument("--kernels", default="auto", choices=["auto", "native", "xla"])
    p.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="skip timing the XLA-ops engine beside the native one",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    model = load_model(args.model)
    hw, hw_name = _hardware(args.hardware)
    host_params = dummy_params(model, 0, args.dtype)
    decode = bench_decode(args, model, hw, host_params)
    prefill = bench_prefill(args, model, hw, host_params) if args.prompt_lens else []
    meta = {
        "model": model.name,
        "hardware": hw_name,
        "hbm_bw": hw.hbm_bw,
        "flops": hw.flops(args.dtype),
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "dtype": args.dtype,
        "steps": args.steps,
        "kernels": decode[0]["kernels"] if decode else args.kernels,
    }
    if args.json:
        print(orjson.dumps({"meta": meta, "decode": decode, "prefill": prefill}).decode())
        return 0
    print(
        f"{model.name} on {hw_name} ({meta['device']}): {hw.hbm_bw / 1e9:.1f} GB/s, "
        f"{hw.flops(args.dtype) / 1e9:.0f} GFLOP/s {args.dtype}; {args.steps} steps per call; "
        f"{meta['kernels']} kernels"
    )
    print(
        f"{'batch':>5} {'ctx':>5} {'bucket':>6} {'measured':>9} {'predicted':>9} {'GB/s':>6} "
        f"{'GFLOP/s':>8} {'tok/s':>7} {'eff':>5} {'floor':>8} {'f.eff':>5} {'xla':>8} "
        f"{'x':>5}  bound"
    )
    for r in decode:
        print(
            f"{r['batch']:>5} {r['context']:>5} {r['bucket']:>6} {r['measured_ms']:>7.2f}ms "
            f"{r['predicted_ms']:>7.2f}ms {r['gb_per_s']:>6.1f} {r['gflop_per_s']:>8.1f} "
            f"{r['tokens_per_s']:>7.0f} {r['efficiency']:>5.2f} {r['floor_ms']:>6.2f}ms "
            f"{r['floor_efficiency']:>5.2f} {_ms(r['xla_ms']):>8} {_x(r['speedup_vs_xla']):>5}  "
            f"{r['bound']}"
        )
    if prefill:
        print(f"\n{'prompt':>6} {'measured':>9} {'predicted':>9} {'GFLOP/s':>8} {'eff':>5}")
        for r in prefill:
            print(
                f"{r['prompt_len']:>6} {r['measured_ms']:>7.2f}ms {r['predicted_ms']:>7.2f}ms "
                f"{r['gflop_per_s']:>8.1f} {r['efficiency']:>5.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
