"""Continuous-batching gain of `scaletui serve` beside the roofline's prediction.

Starts the real engine server in-process (default model `small`, dummy weights), saturates it
with a closed loop of streaming requests (2 x slots in flight, ignore_eos, fixed lengths) at
1 slot and then at 8 slots (switched live through POST /admin/config), and prints measured
output tokens/s and TPOT beside the roofline's decode tokens/s and step time for the same
batch and context, and the host work per engine call: the worker's gap between calls
(/stats `host_gap`) and the CPU per generate call of the worker and of the HTTP thread.
Hardware: the `local` spec from `scaletui calibrate`, else a short inline probe
(bench/decode_roofline.py's). `--json` prints one JSON object.

    python bench/serving.py --model small --seconds 20
    python bench/serving.py --model small --streams-per-slot 1 --prompt-len 64 --max-seq-len 1024
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import aiohttp  # noqa: E402
import orjson  # noqa: E402
from _smoke import shrink  # noqa: E402

from scaletui import roofline  # noqa: E402
from scaletui.serve.engine.build import JaxEngineFactory  # noqa: E402
from scaletui.serve.http.api import ApiSettings, create_app  # noqa: E402
from scaletui.serve.http.testing import serve_in_thread  # noqa: E402
from scaletui.serve.http.tokenizer import load_tokenizer  # noqa: E402
from scaletui.serve.scheduling.scheduler import Scheduler  # noqa: E402
from scaletui.shape import ServerShape  # noqa: E402
from scaletui.specs import SpecError, load_hardware, load_model  # noqa: E402


async def saturate(
    url: str, concurrency: int, warmup: float, seconds: float, prompt_len: int, out: int
) -> dict:
    """Closed loop: `concurrency` streams always in flight for warmup + seconds.

    Throughput counts the tokens that arrive inside the measured window (steady state, no
    edge effects from requests cut off at either end); TPOT comes from requests that ended.
    """
    prompt = list(range(1, prompt_len + 1))
    body = {"prompt": prompt, "max_tokens": out, "ignore_eos": True, "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    arrivals: list[tuple[float, int]] = []  # (arrival time, tokens the chunk carries)
    tpots: list[float] = []
    t0 = time.perf_counter()
    t_begin, t_end = t0 + warmup, t0 + warmup + seconds

    async def worker(session: aiohttp.ClientSession) -> None:
        # A chunk carries one host sync's tokens: count them from the running usage.
        while time.perf_counter() < t_end:
            chunks, seen = [], 0
            async with session.post(url + "/v1/completions", json=body) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        t = time.perf_counter()
                        frame = orjson.loads(line[6:])
                        total = frame["usage"]["completion_tokens"]
                        if frame["choices"] and total > seen:
                            chunks.append((t, total - seen))
                            seen = total
            arrivals.extend(chunks)
            if seen > 1 and chunks[-1][0] <= t_end:
                tpots.append((chunks[-1][0] - chunks[0][0]) / (seen - 1))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        tasks = [asyncio.create_task(worker(session)) for _ in range(concurrency)]
        await asyncio.sleep(t_end - time.perf_counter())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    counted = sum(n for t, n in arrivals if t_begin <= t <= t_end)
    return {
        "output_tokens_per_s": counted / seconds,
        "requests": len(tpots),
        "tpot_ms": 1e3 * statistics.median(tpots) if tpots else None,
    }


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of the scheduler's worker and the HTTP event loop's thread."""
    names = ("scaletui-interleaved", "scaletui-generate", "scaletui-test-server")
    return {
        t.name: time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        for t in threading.enumerate()
        if t.name in names
    }


def host_work(window: dict, cpu: dict[str, float], run: dict) -> dict:
    """The worker's host gap (GapClock: /stats `host_gap`) per engine call and as a share of
    the worker's busy time; the CPU per generate call of the worker (its gap plus the Python
    inside each engine call) and of the event loop (detokenizing, SSE), over the whole run."""
    t = {k: v["count"] * v["mean"] for k, v in window.items() if k in ("generate", "prefill")}
    gap = window.get("host_gap", {"count": 0, "mean": 0.0})
    gap_ms = gap["count"] * gap["mean"]
    calls = run["step_times_ms"]["generate"]["count"]
    worker = cpu.get("scaletui-interleaved", cpu.get("scaletui-generate", 0.0))
    return {
        "host_gap_ms": gap["mean"],
        "host_gap_share": gap_ms / (gap_ms + sum(t.values())),
        "worker_cpu_ms_per_call": 1e3 * worker / calls,
        "http_cpu_ms_per_call": 1e3 * cpu.get("scaletui-test-server", 0.0) / calls,
    }


def hardware(name: str, probe_s: float = 1.0):
    try:
        return load_hardware(name), name
    except SpecError:
        sys.path.insert(0, os.path.dirname(__file__))
        from _decode_roofline import probe_hardware

        return probe_hardware(probe_s), "inline probe (run `scaletui calibrate` for a better one)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--hardware", default="local")
    p.add_argument("--seconds", type=float, default=20.0, help="measured window per config")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--slots", type=int, nargs=2, default=(1, 8), metavar=("LOW", "HIGH"))
    p.add_argument("--streams-per-slot", type=int, default=2, help="closed-loop streams per slot")
    p.add_argument("--warmup", type=float, default=5.0, help="s of load before each window")
    p.add_argument(
        "--probe-seconds",
        type=float,
        default=1.0,
        help="without a `local` spec: decode_roofline's inline probe, this long per figure",
    )
    p.add_argument("--json", action="store_true")
    # a smoke run (bench/_smoke.py): tiny, 1 and 2 slots, a second each
    shrink(
        p,
        model="tiny",
        seconds=1.0,
        warmup=0.5,
        output_len=8,
        max_seq_len=64,
        slots=(1, 2),
        probe_seconds=0.05,
    )
    args = p.parse_args(argv)
    model = load_model(args.model)
    tok = load_tokenizer(None, model.vocab_size)
    low, high = args.slots
    config = ServerShape(model, slots=low, max_seq_len=args.max_seq_len,
                         decode_steps=args.decode_steps, max_prefill_bucket=64)  # fmt: skip
    sched = Scheduler(config, JaxEngineFactory(tok.vocab_size, (tok.eos_id,)))
    app = create_app(sched, tok, ApiSettings(log_interval_s=0))
    hw, hw_name = hardware(args.hardware, args.probe_seconds)
    context = args.prompt_len + args.output_len // 2
    rows = {}
    with serve_in_thread(app) as url:
        while sched.state != "serving":
            if sched.state == "failed":
                raise SystemExit(f"server failed: {sched.error}")
            time.sleep(0.2)
        for slots in (low, high):
            if sched.config.slots != slots:
                sched.reconfigure({"slots": slots})
            streams = args.streams_per_slot * slots
            cpu0 = thread_cpu()
            measured = asyncio.run(
                saturate(url, streams, args.warmup, args.seconds, args.prompt_len, args.output_len)
            )
            cpu = {k: v - cpu0.get(k, 0.0) for k, v in thread_cpu().items()}
            window = sched.metrics.window(args.seconds)["step_times_ms"]
            measured["generate_step_ms"] = window["generate"]["mean"]
            measured["prefill_step_ms"] = window["prefill"]["mean"]
            whole = sched.metrics.window(args.warmup + args.seconds)
            measured.update(host_work(window, cpu, whole))
            est = roofline.estimate(model, hw, batch=slots, context=context,
                                    prompt_len=args.prompt_len, weight_bytes=4, kv_bytes=4,
                                    compute_dtype="f32")  # fmt: skip
            rows[slots] = {**measured, "roofline_tokens_per_s": est.decode_tokens_per_s,
                           "roofline_step_ms": est.decode_step_s * 1e3,
                           "compile_s": sched.compile["seconds"]}  # fmt: skip
    lo, hi = rows[low], rows[high]
    result = {
        "model": model.name, "hardware": hw_name, "context": context, "rows": rows,
        "measured_gain": hi["output_tokens_per_s"] / lo["output_tokens_per_s"],
        "roofline_gain": hi["roofline_tokens_per_s"] / lo["roofline_tokens_per_s"],
    }  # fmt: skip
    if args.json:
        print(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode())
        return 0
    print(f"model {model.name}, hardware {hw_name}, prompt {args.prompt_len}, "
          f"output {args.output_len}, decode_steps {args.decode_steps}")  # fmt: skip
    print(f"{'slots':>5} {'out tok/s':>10} {'roofline':>10} {'TPOT ms':>8} {'roof step ms':>12}"
          f" {'gen call ms':>11} {'prefill ms':>10}")  # fmt: skip
    for slots, r in rows.items():
        print(f"{slots:>5} {r['output_tokens_per_s']:>10.1f} {r['roofline_tokens_per_s']:>10.1f} "
              f"{r['tpot_ms'] or float('nan'):>8.2f} {r['roofline_step_ms']:>12.2f} "
              f"{r['generate_step_ms']:>11.2f} {r['prefill_step_ms']:>10.2f}")  # fmt: skip
    for slots, r in rows.items():
        print(f"{slots:>5} slots: host gap {r['host_gap_ms']:.2f} ms/call, "
              f"{r['host_gap_share']:.1%} of the worker's time; CPU per generate call: "
              f"worker {r['worker_cpu_ms_per_call']:.2f} ms, "
              f"HTTP loop {r['http_cpu_ms_per_call']:.2f} ms")  # fmt: skip
    print(f"gain {high}/{low} slots: measured {result['measured_gain']:.2f}x, "
          f"roofline {result['roofline_gain']:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
