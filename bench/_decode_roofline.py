"""bench/decode_roofline.py past `--check`: the engine timed against the roofline, in JAX.

Apart from the parser so that `--check` (bench/accelerator_run.sh --check) imports no JAX. The
weights-only floor and the inline probe live here (bench/serving.py probes with it).
"""

from __future__ import annotations

import copy
import math
import statistics
import sys
import time
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import orjson
from jax import lax

from scaletui import roofline
from scaletui.dtypes import DTYPE_BYTES
from scaletui.roofline.costinputs import kv_token_bytes
from scaletui.serve.engine import model as llama
from scaletui.serve.engine.build import build_engines
from scaletui.serve.engine.engine_api import SamplingParams
from scaletui.serve.scheduling.paging import fixed_table
from scaletui.serve.weights import quant
from scaletui.serve.weights.weights import dummy_params, layer_shapes
from scaletui.shape import ServerShape
from scaletui.specs import HardwareSpec, SpecError, load_hardware


def probe_hardware(seconds: float = 1.0) -> HardwareSpec:
    """Quick inline calibration: f32 GEMV-like weight reads (bytes/s) and a 2048^3 matmul.

    Takes the fastest run, not the median: on a shared machine that is the closest to the
    hardware's roof, so efficiencies against it err low. The reads cover 1 GiB (past any CPU's
    cache), 64 MiB when `seconds` < 1 (a smoke run's probe).
    """
    matrices = 16 if seconds >= 1 else 1  # 64 MiB each
    w = [jnp.full((2048, 8192), 0.5, jnp.float32) for _ in range(matrices)]  # "weights"
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


def device_params(m, dtype: str) -> dict:
    """Random weights made on the default device: dummy_params' shapes and scales, other values.

    Speed does not depend on the values (as long as they are not all zero), so the GPU run
    skips generating 8B normals with numpy on the host.
    """
    keys = iter(jax.random.split(jax.random.key(0), 3 + 9 * m.n_layers))
    dt = {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype]

    def normal(shape: tuple[int, ...], fan_in: int) -> jax.Array:
        return (jax.random.normal(next(keys), shape, jnp.float32) * fan_in**-0.5).astype(dt)

    d = m.d_model
    params: dict = {"embed": normal((m.vocab_size, d), d), "norm": jnp.ones(d, dt)}
    if not m.tied_embeddings:
        params["lm_head"] = normal((m.vocab_size, d), d)
    params["layers"] = [
        {
            name: jnp.ones(shape, dt) if len(shape) == 1 else normal(shape, math.prod(shape[:-1]))
            for name, shape in layer_shapes(m).items()
        }
        for _ in range(m.n_layers)
    ]
    return params


def _hardware(ref: str, probe_s: float = 1.0) -> tuple[HardwareSpec, str]:
    try:
        return load_hardware(ref), ref
    except SpecError as exc:
        if ref != "local":
            raise
        print(f"note: {exc}; probing bandwidth and FLOP/s inline instead", file=sys.stderr)
        return probe_hardware(probe_s), "inline probe (run `scaletui calibrate` for a saved spec)"


def _estimate(model, hw, args, *, batch: int, context: int, prompt_len: int = 16):
    """The roofline in the run's precision: weights and KV bytes in their storage dtypes (int8
    KV with its scales, spread over the elements), the FLOP roof of the compute dtype."""
    m = model
    kv_elements = 2 * m.n_layers * m.n_kv_heads * m.head_dim  # per token
    return roofline.estimate(
        model,
        hw,
        batch=batch,
        context=context,
        prompt_len=prompt_len,
        chips=1,
        weight_bytes=DTYPE_BYTES[args.weight_dtype],
        kv_bytes=kv_token_bytes(model, args.kv_dtype) / kv_elements,
        compute_dtype=args.dtype,
    )


def weights_floor(eng, batch: int, steps: int, calls: int, repeats: int) -> float:
    """Seconds per decode step of the weights-only stand-in (see the module docstring), run
    with the engine's own op set over its own params: the native kernels read the packed,
    fused layout (`native.pack_params`), XLA's and Pallas' the layout of weights.py."""
    m, ops = eng.model, eng.ops

    def stand_in(i, q, k, v):  # the attention's stand-in: no cache read
        return q + jnp.repeat(k + v, q.shape[1] // k.shape[1], axis=1), None

    def run(params, tok, n):
        def step(i, tok):
            x = ops.embed(params, tok, m)  # [B, D]
            cos, sin = llama.rope(jnp.full(tok.shape, i), m.head_dim, m.rope_theta, m.rope_scaling)
            x, _ = llama.layers(params, x, cos, sin, m, ops, stand_in)
            return jnp.argmax(ops.logits(params, x, m), axis=-1).astype(jnp.int32)

        return lax.fori_loop(0, n, step, tok)

    fn = jax.jit(run)
    params, tok, n = eng.params, jnp.arange(batch, dtype=jnp.int32), jnp.int32(steps)
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


def time_decode_step(args, base: ServerShape, host_params, batch: int, kernels: str):
    """(seconds per decode step, engine): best over repeats of the median generate call."""
    model = base.model
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, model.vocab_size, args.context)]
    params = SamplingParams(max_tokens=args.max_seq_len, ignore_eos=True)
    cfg = replace(
        base, slots=batch, max_seq_len=args.max_seq_len, decode_steps=args.steps, kernels=kernels
    )
    eng, _ = build_engines(cfg, jax.devices()[:1], host_params=host_params)
    prefix = eng.prefill(prompt, params)
    for b in eng.decode_buckets:  # every bucket the timed calls can reach: no compile inside
        if b > args.context:
            eng._generate_exe(b)
    medians, table = [], fixed_table(eng)
    for _ in range(args.repeats):
        state = eng.init_decode_state()
        for slot in range(batch):
            state = eng.insert(state, prefix, slot, table[slot])
        state, _ = eng.generate(state, args.steps, table)  # compiles the bucket on first use
        times = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            state, _ = eng.generate(state, args.steps, table)
            times.append((time.perf_counter() - t0) / args.steps)
        medians.append(statistics.median(times))
    return min(medians), eng


def batches(args) -> list[int]:
    """`--batches`, else 1, 2, 4, ... up to `--slots`."""
    if args.batches:
        return sorted(set(args.batches))
    return [1 << i for i in range(args.slots.bit_length()) if 1 << i <= args.slots]


def bench_decode(args, base: ServerShape, hw, host_params, rows: list, save) -> list[dict]:
    model = base.model
    for batch in batches(args):
        step, eng = time_decode_step(args, base, host_params, batch, args.kernels)
        floor = None
        if args.floor:
            floor = weights_floor(eng, batch, args.steps, args.calls, args.repeats)
        baseline = None
        wanted = args.baseline_batches is None or batch in args.baseline_batches
        if eng.kernels != "xla" and args.baseline and wanted:  # XLA's ops, in the same run
            baseline, _ = time_decode_step(args, base, host_params, batch, "xla")
        ctx = args.context + args.steps * (1 + args.calls / 2)  # mean live context measured
        est = _estimate(model, hw, args, batch=batch, context=int(ctx))
        kv_read = batch * est.kv_bytes_per_token * ctx
        rows.append(
            {
                "batch": batch,
                "context": int(ctx),
                "bucket": eng.last_step_stats["bucket"],
                "kernels": eng.kernels,
                "kernels_dense": eng.describe().kernels_dense,  # /stats' config.kernels_dense
                "measured_ms": step * 1e3,
                "predicted_ms": est.decode_step_s * 1e3,
                "bound": est.decode_bound,
                "gb_per_s": (est.param_bytes + kv_read) / step / 1e9,
                "gflop_per_s": est.flops_per_token * batch / step / 1e9,
                "tokens_per_s": batch / step,
                "efficiency": est.decode_step_s / step,
                "floor_ms": floor * 1e3 if floor else None,
                "floor_efficiency": est.decode_step_s / floor if floor else None,
                "xla_ms": baseline * 1e3 if baseline else None,
                "speedup_vs_xla": baseline / step if baseline else None,
            }
        )
        # one line as each batch ends: a run stopped at its time limit still shows these
        print(f"decode batch {batch}: {step * 1e3:.3f} ms per step, predicted "
              f"{est.decode_step_s * 1e3:.3f} ms", file=sys.stderr, flush=True)  # fmt: skip
        save()
        eng = None  # free this engine's weights and cache before the next one is built
    return rows


def with_xla_prefill_attention(eng):
    """The same engine (weights, config) with XLA's prefill attention (`model._attend_chunk`) in
    place of the native kernel: a copy with its own compiled programs, for an A/B in one run."""
    alt = copy.copy(eng)
    alt._exes = {}
    alt.ops = eng.ops._replace(prefill_attention=None)
    return alt


def time_prefill(eng, prompt: list[int], calls: int) -> list[float]:
    """Seconds of `calls` prefills of `prompt` straight into slot 0's pages (what the server runs
    for a new request), after one that compiles."""
    pages = fixed_table(eng)[0][: -(-len(prompt) // eng.page_size)]
    state, times = eng.init_decode_state(), []
    for _ in range(calls + 1):
        t0 = time.perf_counter()
        state, _prefix = eng.prefill_pages(state, prompt, SamplingParams(), 0, pages)
        times.append(time.perf_counter() - t0)
    return times[1:]


def bench_prefill(args, base: ServerShape, hw, host_params, rows: list, save) -> list[dict]:
    model = base.model
    # a prompt must leave one position free: room for the longest asked for
    seq = max(args.max_seq_len, max(args.prompt_lens) + 1)
    cfg = replace(base, slots=1, max_seq_len=seq)
    eng, _ = build_engines(cfg, jax.devices()[:1], host_params=host_params)
    # XLA's prefill attention beside the native kernel's, alternating call by call
    base = with_xla_prefill_attention(eng) if eng.ops.prefill_attention and args.baseline else None
    rng = np.random.default_rng(1)
    roof = hw.flops(args.dtype)
    for n in args.prompt_lens:
        prompt = [int(t) for t in rng.integers(0, model.vocab_size, n)]
        times, base_times = [], []
        for _ in range(args.repeats):
            times += time_prefill(eng, prompt, args.calls)
            if base is not None:
                base_times += time_prefill(base, prompt, args.calls)
        t = statistics.median(times)
        tb = statistics.median(base_times) if base_times else None
        est = _estimate(model, hw, args, batch=1, context=n, prompt_len=n)
        print(f"prefill {n}: {t * 1e3:.2f} ms", file=sys.stderr, flush=True)
        rows.append(
            {
                "prompt_len": n,
                "measured_ms": t * 1e3,
                "predicted_ms": est.prefill_s * 1e3,
                "gflop_per_s": est.prefill_flops / t / 1e9,
                "efficiency": est.prefill_s / t,
                "flops_efficiency": est.prefill_flops / t / roof,  # achieved / calibrated FLOP/s
                "xla_attention_ms": tb * 1e3 if tb else None,
                "xla_attention_flops_efficiency": est.prefill_flops / tb / roof if tb else None,
                "speedup_vs_xla_attention": tb / t if tb else None,
            }
        )
        save()
    return rows


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}ms"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def compare(other: HardwareSpec, name: str, model, args, decode: list, prefill: list) -> dict:
    """The same measured rows against a second hardware spec's predictions."""
    out: dict = {"hardware": name, "hbm_bw": other.hbm_bw, "flops": other.flops(args.dtype)}
    out["decode"] = []
    for r in decode:
        est = _estimate(model, other, args, batch=r["batch"], context=r["context"])
        pred = est.decode_step_s * 1e3
        eff = pred / r["measured_ms"]
        row = {"batch": r["batch"], "predicted_ms": pred, "efficiency": eff}
        out["decode"].append({**row, "bound": est.decode_bound})
    out["prefill"] = []
    for r in prefill:
        n = r["prompt_len"]
        est = _estimate(model, other, args, batch=1, context=n, prompt_len=n)
        pred = est.prefill_s * 1e3
        eff = pred / r["measured_ms"]
        out["prefill"].append({"prompt_len": n, "predicted_ms": pred, "efficiency": eff})
    return out


def print_tables(result: dict, hw: HardwareSpec, args) -> None:
    meta, decode, prefill = result["meta"], result["decode"], result["prefill"]
    print(
        f"{meta['model']} ({meta['precision']}) on {meta['hardware']} ({meta['device']}): "
        f"{hw.hbm_bw / 1e9:.1f} GB/s, {hw.flops(args.dtype) / 1e9:.0f} GFLOP/s {args.dtype}; "
        f"{args.steps} steps per call; {meta['kernels']} kernels"
        + (f" ({meta['kernels_dense']})" if meta.get("kernels_dense") else "")
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
            f"{r['tokens_per_s']:>7.0f} {r['efficiency']:>5.2f} {_ms(r['floor_ms']):>8} "
            f"{_x(r['floor_efficiency']):>5} {_ms(r['xla_ms']):>8} {_x(r['speedup_vs_xla']):>5}  "
            f"{r['bound']}"
        )
    if prefill:
        roof = hw.flops(args.dtype) / 1e9
        print(f"\nprefill into the pages (efficiency = achieved / calibrated {roof:.0f} "
              "GFLOP/s; xla attn: the same on XLA's prefill attention)")  # fmt: skip
        print(
            f"{'prompt':>6} {'measured':>10} {'predicted':>10} {'GFLOP/s':>8} {'eff':>5} "
            f"{'xla attn':>10} {'x.eff':>5} {'x':>5}"
        )
        for r in prefill:
            print(
                f"{r['prompt_len']:>6} {r['measured_ms']:>8.1f}ms {r['predicted_ms']:>8.1f}ms "
                f"{r['gflop_per_s']:>8.1f} {r['flops_efficiency']:>5.2f} "
                f"{_ms(r['xla_attention_ms']):>10} {_x(r['xla_attention_flops_efficiency']):>5} "
                f"{_x(r['speedup_vs_xla_attention']):>5}"
            )
    if c := result.get("compare"):
        print(f"\nagainst {c['hardware']}: {c['hbm_bw'] / 1e9:.1f} GB/s, "
              f"{c['flops'] / 1e9:.0f} GFLOP/s {args.dtype}")  # fmt: skip
        print(f"{'batch':>6} {'measured':>9} {'predicted':>9} {'eff':>5}  bound")
        for r, cr in zip(decode, c["decode"], strict=True):
            print(f"{r['batch']:>6} {r['measured_ms']:>7.2f}ms {cr['predicted_ms']:>7.2f}ms "
                  f"{cr['efficiency']:>5.2f}  {cr['bound']}")  # fmt: skip
        for r, cr in zip(prefill, c["prefill"], strict=True):
            print(f"{'p' + str(r['prompt_len']):>6} {r['measured_ms']:>7.2f}ms "
                  f"{cr['predicted_ms']:>7.2f}ms {cr['efficiency']:>5.2f}")  # fmt: skip


def _compare_spec(ref: str | None) -> tuple[HardwareSpec, str] | None:
    if ref is None:
        return None
    try:
        return load_hardware(ref), ref
    except SpecError as exc:  # e.g. calibrate failed before: measure anyway
        print(f"note: --compare {ref}: {exc}; comparing with nothing", file=sys.stderr)
        return None


def run(args, base: ServerShape) -> int:
    """The bench past `--check`: `base` is the engine's config in the run's precision."""
    model, p = base.model, base.precision
    hw, hw_name = _hardware(args.hardware, args.probe_seconds)
    other = _compare_spec(args.compare)
    made = p.compute if p.weights == "int8" else p.weights  # int8 is quantized from these
    if args.weights == "device":
        host_params = device_params(model, made)
    else:
        host_params = dummy_params(model, 0, made)
    host_params = quant.convert_params(host_params, p.compute, p.weights)  # once, every engine
    meta = {
        "model": model.name,
        "hardware": hw_name,
        "hbm_bw": hw.hbm_bw,
        "flops": hw.flops(args.dtype),
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "dtype": args.dtype,
        "weight_dtype": args.weight_dtype,
        "kv_dtype": args.kv_dtype,
        "precision": p.describe(),
        "steps": args.steps,
        "kernels": args.kernels,
        "complete": False,  # True once every row is in; the file is rewritten after each row
    }
    result: dict = {"meta": meta, "decode": [], "prefill": []}

    def save() -> None:
        if result["decode"]:
            meta["kernels"] = result["decode"][0]["kernels"]
            meta["kernels_dense"] = result["decode"][0]["kernels_dense"]
        if other is not None:
            result["compare"] = compare(*other, model, args, result["decode"], result["prefill"])
        if args.json_out:
            with open(args.json_out, "wb") as f:
                f.write(orjson.dumps(result, option=orjson.OPT_INDENT_2) + b"\n")

    if not args.prefill_only:
        bench_decode(args, base, hw, host_params, result["decode"], save)
    if args.prompt_lens:
        bench_prefill(args, base, hw, host_params, result["prefill"], save)
    meta["complete"] = True
    save()
    if args.json:
        print(orjson.dumps(result).decode())
    else:
        print_tables(result, hw, args)
    return 0
