"""The paged KV cache's three claims, measured on the real server (issue 14's acceptance).

1. prefix: loadgen with shared prefixes (default --prefix-len 512 --prefix-groups 4
   --input-len 64) against the server with and without the prefix cache: the hit rate from
   /stats and the median TTFT of each (the cache should cut it >= 3x).
2. budget: 8 streams decoding (closed loop) while a 2,048-token prompt arrives every few
   seconds: p99 ITL of the 8 streams with no token budget and with --max-batched-tokens (the
   long prompt runs in pieces between decode calls; should fall >= 2x).
3. memory: a 1 GiB pool of pages, short requests: how many run at once (the most /stats saw)
   against the slots a slot cache of max_seq_len rows fits in the same 1 GiB (should be >= 4x),
   and the pages /stats counts held against the pages those sequences need.

Each scenario starts the server in-process (model `small` by default, dummy weights) and drives
it with loadgen; nothing is timed against a constant, every result is a ratio of two runs here.

    python bench/paged_kv.py                 # all three, a table each
    python bench/paged_kv.py prefix --json   # one, as JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import orjson  # noqa: E402
from _smoke import NO_WARMUP, shrink  # noqa: E402

from scaletui.loadgen import cli as loadgen_cli  # noqa: E402
from scaletui.serve.engine import memory  # noqa: E402
from scaletui.serve.engine.build import JaxEngineFactory  # noqa: E402
from scaletui.serve.http.api import ApiSettings, create_app  # noqa: E402
from scaletui.serve.http.testing import serve_in_thread  # noqa: E402
from scaletui.serve.http.tokenizer import load_tokenizer  # noqa: E402
from scaletui.serve.scheduling.scheduler import Scheduler  # noqa: E402
from scaletui.shape import ServerShape  # noqa: E402
from scaletui.specs import load_model  # noqa: E402

GiB = 2**30


def median(xs: list[float]) -> float | None:
    return sorted(xs)[len(xs) // 2] if xs else None


def log(msg: str) -> None:
    print(f"[paged_kv] {msg}", file=sys.stderr, flush=True)


@contextmanager
def server(args: argparse.Namespace, **config):
    """An in-process server of `args`' model, dtype and warm-up on a free port: (url,
    scheduler)."""
    m = load_model(args.model)
    if config.get("max_seq_len", 0) > m.max_seq_len:  # dummy weights: any RoPE length works
        m = dataclasses.replace(m, max_seq_len=config["max_seq_len"])
    tok = load_tokenizer(None, m.vocab_size)
    cfg = ServerShape(m, dtype=args.dtype, **config)
    sched = Scheduler(cfg, JaxEngineFactory(tok.vocab_size, (tok.eos_id,)), warmup=args.warmup)
    app = create_app(sched, tok, ApiSettings(log_interval_s=0))
    t0 = time.perf_counter()
    with serve_in_thread(app) as url:
        while sched.state != "serving":
            if sched.state == "failed":
                raise SystemExit(f"server failed: {sched.error}")
            time.sleep(0.2)
        log(f"{cfg.to_json()['kv_pages']} pages of {cfg.page_size}, slots {cfg.slots}: up in "
            f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
        try:
            yield url, sched
        finally:
            sched.shutdown()


def loadgen(url: str, flags: list[str]) -> dict:
    """One loadgen run (token-id prompts, ignore_eos); its summary JSON."""
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "summary.json"
        argv = ["--url", url, "--out", str(out), "--quiet", "--prompt-format", "ids",
                "--read-timeout", "900", "--timeout", "1800", *flags]  # fmt: skip
        code = loadgen_cli.main(argv)
        if code not in (loadgen_cli.EXIT_OK, loadgen_cli.EXIT_FAILURES) or not out.exists():
            raise SystemExit(f"loadgen {' '.join(flags)} exited with status {code}")
        return orjson.loads(out.read_bytes())


def stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/stats", timeout=30) as r:
        return json.loads(r.read())


def prefix(args: argparse.Namespace) -> dict:
    flags = ["--prefix-len", str(args.prefix_len), "--prefix-groups", str(args.prefix_groups),
             "--input-len", str(args.input_len), "--output-len", "16", "--concurrency", "4",
             "--num-requests", str(args.requests), "--seed", "1"]  # fmt: skip
    rows = {}
    for cache in (False, True):
        with server(args, slots=8, max_seq_len=args.long_len // 2,
                    prefix_cache=cache) as (url, _):  # fmt: skip
            summary = loadgen(url, flags)
            pages = stats(url)["kv_pages"]
        rows["cache" if cache else "no_cache"] = {
            "median_ttft_ms": summary["median_ttft_ms"],
            "p99_ttft_ms": summary["p99_ttft_ms"],
            "hit_rate": pages["prefix_cache_hit_rate"],
            "hits": pages["prefix_cache_hits"],
            "queries": pages["prefix_cache_queries"],
        }
    ratio = rows["no_cache"]["median_ttft_ms"] / rows["cache"]["median_ttft_ms"]
    return {"scenario": "prefix", "flags": flags, "rows": rows, "ttft_ratio": ratio}


def _long_prompts(url: str, model, length: int, every: float, stop: threading.Event,
                  ttfts: list[float]) -> None:  # fmt: skip
    """A `length`-token prompt (1 output token) every `every` seconds until `stop`; each its
    own random tokens (ids within the model's vocabulary), so the prefix cache cannot skip
    it."""
    rng = random.Random(3)
    while not stop.wait(every):
        prompt = [rng.randrange(1, min(30000, model.vocab_size)) for _ in range(length)]
        body = json.dumps({"model": model.name, "prompt": prompt, "max_tokens": 1,
                           "ignore_eos": True}).encode()  # fmt: skip
        req = urllib.request.Request(url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})  # fmt: skip
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()
        ttfts.append(time.perf_counter() - t0)


def budget(args: argparse.Namespace) -> dict:
    flags = ["--concurrency", "8", "--input-len", str(args.input_len), "--output-len",
             str(args.output_len), "--seed", "2", "--duration", str(args.seconds),
             "--num-requests", "100000"]  # fmt: skip
    rows = {}
    for tokens in (0, args.max_batched_tokens):
        with server(args, slots=9, max_seq_len=args.long_len + 64,
                    max_batched_tokens=tokens) as (url, sched):  # fmt: skip
            warm = ["--concurrency", "8", "--input-len", str(args.input_len), "--output-len", "8"]
            loadgen(url, [*warm, "--num-requests", "8"])  # warm: every decode bucket compiled
            stop, long_ttfts = threading.Event(), []
            inject = threading.Thread(
                target=_long_prompts, daemon=True,
                args=(url, sched.config.model, args.long_len, args.every, stop, long_ttfts),
            )  # fmt: skip
            inject.start()
            summary = loadgen(url, flags)
            stop.set()
            inject.join()
        rows[f"budget_{tokens}" if tokens else "no_budget"] = {
            "p99_itl_ms": summary["p99_itl_ms"],
            "median_itl_ms": summary["median_itl_ms"],
            "median_tpot_ms": summary["median_tpot_ms"],
            "output_throughput": summary["output_throughput"],
            "long_prompts": len(long_ttfts),
            "long_prompt_median_s": median(long_ttfts),
        }  # fmt: skip
    on = rows[f"budget_{args.max_batched_tokens}"]
    return {"scenario": "budget", "every_s": args.every, "rows": rows,
            "p99_itl_ratio": rows["no_budget"]["p99_itl_ms"] / on["p99_itl_ms"]}  # fmt: skip


def _watch(url: str, stop: threading.Event, seen: list[dict]) -> None:
    while not stop.wait(0.1):
        s = stats(url)
        seen.append({"slots_used": s["slots"]["used"], **s["kv_pages"]})


def memory_(args: argparse.Namespace) -> dict:
    m = load_model(args.model)
    seq, page = args.long_len, 64
    probe = ServerShape(m, dtype=args.dtype, max_seq_len=seq, page_size=page)
    page_bytes = memory.footprint(probe).kv_page_bytes
    pages = int(args.pool_gib * GiB // page_bytes)
    slot_cache_slots = int(args.pool_gib * GiB // (page_bytes // page * seq))
    want = 5 * slot_cache_slots
    n_in, n_out = 96, 32
    with server(args, slots=want, max_seq_len=seq, page_size=page,
                kv_pages=pages, decode_steps=4, max_waiting=2 * want) as (url, _):  # fmt: skip
        stop, seen = threading.Event(), []
        watch = threading.Thread(target=_watch, args=(url, stop, seen), daemon=True)
        watch.start()
        summary = loadgen(url, ["--concurrency", str(want), "--num-requests", str(want),
                                "--input-len", str(n_in), "--output-len", str(n_out)])  # fmt: skip
        stop.set()
        watch.join()
    peak = max(seen, key=lambda s: s["slots_used"])
    per_seq = -(-(n_in + n_out) // page)
    return {
        "scenario": "memory", "pool_gib": args.pool_gib, "pages": pages, "page_size": page,
        "slot_cache_slots": slot_cache_slots, "max_running": peak["slots_used"],
        "ratio": peak["slots_used"] / slot_cache_slots,
        "pages_used_at_peak": peak["pages_used"],
        "pages_needed_at_peak_max": peak["slots_used"] * per_seq,
        "completed": summary.get("completed"), "failed": summary.get("failed"),
        "output_throughput": summary["output_throughput"],
    }  # fmt: skip


SCENARIOS = {"prefix": prefix, "budget": budget, "memory": memory_}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scenarios", nargs="*", metavar="SCENARIO",
                   help=f"any of {', '.join(SCENARIOS)} (default: all)")  # fmt: skip
    p.add_argument("--model", default="small")
    p.add_argument("--dtype", default="bf16", choices=("f32", "bf16"))
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--prefix-groups", type=int, default=4)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128, help="budget: the 8 streams' output")
    p.add_argument(
        "--long-len",
        type=int,
        default=2048,
        help="budget: the long prompt; memory: max_seq_len (prefix: half of it)",
    )
    p.add_argument("--requests", type=int, default=200, help="prefix: loadgen requests")
    p.add_argument("--seconds", type=float, default=30.0, help="budget: the 8 streams' run")
    p.add_argument("--every", type=float, default=3.0, help="budget: s between long prompts")
    p.add_argument("--max-batched-tokens", type=int, default=256)
    p.add_argument("--pool-gib", type=float, default=1.0, help="memory: the KV pool")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help=NO_WARMUP)
    # a smoke run (bench/_smoke.py): each scenario for a few requests and about a second, each
    # shape compiled when first run
    shrink(
        p,
        warmup=False,
        model="tiny",
        dtype="f32",
        prefix_len=32,
        prefix_groups=2,
        input_len=8,
        output_len=8,
        long_len=128,
        requests=4,
        seconds=1.0,
        every=0.5,
        max_batched_tokens=32,
        pool_gib=0.00025,  # 4 slot-cache slots of 128 tiny positions
    )
    args = p.parse_args(argv)
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")
    results = []
    for name in args.scenarios or SCENARIOS:
        log(f"scenario {name}")
        results.append(SCENARIOS[name](args))
        if args.json:
            print(orjson.dumps(results[-1]).decode(), flush=True)
        else:
            print(json.dumps(results[-1], indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
