"""Our server beside vLLM-CPU (issues 13 and 43): the same workload, model shape and tokenizer.

One server at a time: build the peers' model directory (config + tokenizer.json, no weights) if
missing; start vLLM (`start_vllm.sh`: dummy weights, OMP_BIND=0-1 so it computes on both cores,
bf16 unless --vllm-dtype f32), drive it with our loadgen, stop it; start `scaletui serve` once
per --precisions (same shape, the same tokenizer.json, dummy weights) and drive it the same way;
then vLLM again, a fresh server, so the host's drift while ours ran shows. Each server runs
closed loops at 1, 4, 16 and 64 streams (TPOT p50, output tok/s) and a TTFT run per prompt
length, 128, 512 and 2048 tokens, sent alone. Each row is ours / the mean of vLLM's two runs,
with ours / each run and their drift (bench/_peer_report.py); the kernels ours ran come from
its /stats (kernels_running, kernels_dense).

Prompts are token-id lists (loadgen --prompt-format ids, ids 33..126, the same seed for both), so
no tokenizer touches them: a prompt of N ids is N tokens to both servers, neither adds a BOS to
an id prompt (the shared tokenizer.json only detokenizes the outputs). Each run checks that:
every completed request's usage.prompt_tokens must be the input length and its completion tokens
the output length (ignore_eos), else the bench fails. Every loadgen run has its own seed, the
same on both servers, so no run's prompts share a prefix with an earlier run's (both servers
cache prefixes). Both serve the same longest sequence: the longest TTFT prompt + 2 tokens,
vLLM with --max-model-len past start_vllm.sh's 2048, ours with a spec of that max_seq_len.

    python bench/peer_vllm.py --shape tiny --quick     # a smoke test, minutes
    python bench/peer_vllm.py --shape 1b --json --out peer_vllm.jsonl   # tens of minutes
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import orjson
import yaml
from _peer_report import KERNEL_KEYS, Measured, legend, rows, table
from _smoke import shrink

from scaletui.loadgen import cli as loadgen_cli
from scaletui.loadgen.embedded import EmbeddedServer
from scaletui.shape import ServerShape
from scaletui.specs import load_model

PEER_MODELS = {"tiny": "tiny-llama", "1b": "llama-1b"}  # shape: make_tiny_llama.py's dir name
OUR_SPECS = {"1b": "llama-1b"}  # shapes with a shipped spec; others are made from config.json
SPEC_KEYS = ("n_layers", "d_model", "d_ff", "n_heads", "n_kv_heads", "head_dim", "vocab_size",
             "tied_embeddings", "rope_theta", "norm_eps")  # fmt: skip
VLLM_DTYPES = {"bf16": "bfloat16", "f32": "float32"}  # --vllm-dtype: vllm serve --dtype
QUICK = dict(concurrency=[1, 4], requests_per_stream=2, output_len=32, ttft_lens=[128],
             ttft_requests=3)  # fmt: skip
PEER_MAX_LEN = 2048  # start_vllm.sh's --max-model-len, and our specs' max_seq_len at least
LOG_TAIL = 30


class BenchError(Exception):
    """A problem the user can fix (a missing install, a server that did not start); one message."""


# -- pure parts: where things are, the spec, the rows ---------------------------------------------


def peers_dir(env: dict[str, str] | None = None) -> Path:
    """The peers' scripts: $PEERS_DIR, else shared/peers beside the project root."""
    env = os.environ if env is None else env
    path = Path(env.get("PEERS_DIR") or Path(__file__).resolve().parents[2] / "shared" / "peers")
    if not (path / "start_vllm.sh").is_file():
        raise BenchError(f"the peers' scripts are not at {path} (no start_vllm.sh); set PEERS_DIR "
                         "to the folder with start_vllm.sh and make_tiny_llama.py")  # fmt: skip
    return path


def vllm_python(root: Path, scripts: Path) -> Path:
    """The vLLM venv's python under `root`, or a BenchError saying how to install it."""
    python = root / "vllm" / "bin" / "python"
    if not python.exists() or not any(root.glob("vllm/lib/python*/site-packages/vllm/")):
        raise BenchError(f"vLLM is not installed: no {python} with vllm. Install it with "
                         f"`PEERS={root} {scripts / 'install_vllm_cpu.sh'}` (about 70 s, 3.5 GB), "
                         "or pass --skip-vllm")  # fmt: skip
    return python


def spec_from_config(cfg: dict, name: str, max_seq_len: int) -> dict:
    """Our model-spec keys for an HF LLaMA config.json."""
    return {
        "name": name,
        "n_layers": cfg["num_hidden_layers"],
        "d_model": cfg["hidden_size"],
        "d_ff": cfg["intermediate_size"],
        "n_heads": cfg["num_attention_heads"],
        "n_kv_heads": cfg["num_key_value_heads"],
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        "vocab_size": cfg["vocab_size"],
        "tied_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "rope_theta": float(cfg["rope_theta"]),
        "norm_eps": float(cfg["rms_norm_eps"]),
        "max_seq_len": max_seq_len,
        "source": "the peers' config.json",
    }


def shape_mismatches(spec: object, want: dict) -> list[str]:
    """`key: ours != peers'` for each shape key where our spec differs from the peers' config."""
    return [f"{k}: {getattr(spec, k)!r} != {want[k]!r}" for k in SPEC_KEYS
            if getattr(spec, k) != want[k]]  # fmt: skip


def check_lengths(summary: dict, input_len: int, output_len: int, where: str) -> None:
    """Every completed request had exactly input_len prompt and output_len output tokens (as the
    server's usage reports them); a failed request is an error too."""
    n = summary["completed"]
    if not n or summary["failed"] or summary["rejected"]:
        examples = summary["errors"]["examples"]
        raise BenchError(f"{where}: {n} completed, {summary['failed']} failed, "
                         f"{summary['rejected']} rejected: {examples}")  # fmt: skip
    got = (summary["total_input_tokens"], summary["total_output_tokens"])
    if summary["tokens_from_chunks"] or got != (n * input_len, n * output_len):
        raise BenchError(f"{where}: {n} requests carried {got[0]} prompt and {got[1]} output "
                         f"tokens by the server's usage, expected {n} x {input_len} and "
                         f"{n} x {output_len}")  # fmt: skip


# -- the servers and the load ---------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"peer_vllm: {msg}", file=sys.stderr, flush=True)


def _on_term(*_: object) -> None:
    sys.exit(143)  # SIGTERM unwinds like Ctrl-C: the server in use is stopped on the way out


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (Linux; empty elsewhere)."""
    with contextlib.suppress(OSError):
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    return set()


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def served_model(url: str) -> str:
    """The first model id at GET /v1/models (what loadgen is then told to ask for)."""
    with urllib.request.urlopen(url + "/v1/models", timeout=15) as resp:
        data = orjson.loads(resp.read())["data"]
    if not data:
        raise BenchError(f"{url}/v1/models lists no model")
    return data[0]["id"]


def model_dir(args: argparse.Namespace, scripts: Path) -> Path:
    """The peers' model directory for --shape; built (config + tokenizer, no weights) if missing."""
    path = args.vllm_root / PEER_MODELS[args.shape]
    if not (path / "config.json").is_file() or not (path / "tokenizer.json").is_file():
        log(f"building {path} (make_tiny_llama.py --shape {args.shape} --no-weights) ...")
        cmd = [sys.executable, str(scripts / "make_tiny_llama.py"), "--shape", args.shape,
               "--no-weights", "--out", str(path)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise BenchError(f"{shlex.join(cmd)} failed:\n{(done.stdout + done.stderr)[-2000:]}")
    return path


def loadgen(url: str, model: str, flags: list[str], out: Path) -> dict:
    """One loadgen run (token-id prompts, ignore_eos); its summary."""
    # a burst of 16 prompts on a 1B model on 2 cores can keep the last one waiting for its first
    # token over loadgen's default 60 s of stream silence: TTFT is measured, not a failure here
    argv = ["--url", url, "--model", model, "--out", str(out), "--quiet",
            "--prompt-format", "ids", "--read-timeout", "900", "--timeout", "1800",
            *flags]  # fmt: skip
    code = loadgen_cli.main(argv)
    signal.signal(signal.SIGTERM, _on_term)  # loadgen's own handler is gone with its loop
    if code == loadgen_cli.EXIT_INTERRUPTED:
        raise KeyboardInterrupt
    if code == loadgen_cli.EXIT_FAILURES and out.exists():  # check_lengths names the errors
        return orjson.loads(out.read_bytes())
    if code != loadgen_cli.EXIT_OK:
        raise BenchError(f"loadgen {' '.join(flags)} against {url} exited with status {code}")
    return orjson.loads(out.read_bytes())


def measure(
    run: str, precision: str, url: str, args: argparse.Namespace, work: Path, expect: str
) -> Measured:
    """The closed loops at each concurrency, then a TTFT run per prompt length, against one
    server (`run`: vllm-1, ours-bf16, vllm-2, ...); each loadgen run with its own seed (the same
    sequence on every server)."""
    server = run.split("-")[0]
    model = served_model(url)
    if model != expect:  # another server on that port, or a start script that named it otherwise
        raise BenchError(f"{url}/v1/models says {model!r}, expected {expect!r}")
    log(f"{run}: model {model!r} at {url}")
    seeds = itertools.count(args.seed)
    closed = {}
    for c in args.concurrency:
        if server == "ours":  # our decode batch is `slots` rows, active or not: size it
            set_slots(url, c)
        n = c * args.requests_per_stream
        flags = ["--concurrency", str(c), "--num-requests", str(n), "--warmup", str(c),
                 "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                 "--seed", str(next(seeds))]  # fmt: skip
        s = loadgen(url, model, flags, work / f"{run}-c{c}.json")
        check_lengths(s, args.input_len, args.output_len, f"{run} c={c}")
        closed[c] = s
        tpot = "-" if s["median_tpot_ms"] is None else f"{s['median_tpot_ms']:.2f}"
        log(f"{run} c={c}: TPOT p50 {tpot} ms, {s['output_throughput']:.1f} tok/s")
    ttft = {}
    for n in args.ttft_lens if args.ttft_requests else []:
        flags = ["--concurrency", "1", "--num-requests", str(args.ttft_requests), "--warmup", "1",
                 "--input-len", str(n), "--output-len", "2", "--seed",
                 str(next(seeds))]  # fmt: skip
        ttft[n] = loadgen(url, model, flags, work / f"{run}-ttft{n}.json")
        check_lengths(ttft[n], n, 2, f"{run} TTFT@{n}")
        log(f"{run}: TTFT@{n} p50 {ttft[n]['median_ttft_ms']:.1f} ms")
    kernels = None
    if server == "ours":  # the kernel path that ran, as the server says it
        kernels = our_kernels(url)
        log(f"{run}: " + ", ".join(f"{k} {v}" for k, v in kernels.items()))
    return Measured(server, precision, model, closed, ttft, kernels)


def our_kernels(url: str) -> dict:
    """Our server's /stats config: the kernels running, the native dense layout and the note."""
    with urllib.request.urlopen(url + "/stats", timeout=30) as resp:
        config = orjson.loads(resp.read())["config"]
    return {k: config.get(k) for k in KERNEL_KEYS}


def max_len(args: argparse.Namespace) -> int:
    """The longest sequence a server must hold, in whole 64-token pages: a closed loop's prompt
    and output, or the longest TTFT prompt and its 2 tokens."""
    ttft = max(args.ttft_lens) + 2 if args.ttft_requests else 0
    return -(-max(args.input_len + args.output_len, ttft) // 64) * 64


def kv_pages(args: argparse.Namespace) -> list[str]:
    """Our --kv-pages: every stream of the widest loop at once, or the longest TTFT prompt, one
    page per slot to spare and the scratch page, in --serve-args' --page-size (none where
    --serve-args sets --kv-pages). The default, slots x max_seq_len, would hold 64 streams of
    2,112 tokens: 4.4 GB of bf16 KV on the 1.1B shape for 256-token sequences."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--page-size", type=int, default=ServerShape.page_size)
    p.add_argument("--kv-pages", type=int)
    given, _ = p.parse_known_args(args.serve_args)
    if given.kv_pages is not None:
        return []
    size, streams = given.page_size, max(args.concurrency)
    per_seq = -(-(args.input_len + args.output_len) // size)
    ttft = -(-(max(args.ttft_lens) + 2) // size) if args.ttft_requests else 0
    return ["--kv-pages", str(max(streams * per_seq, ttft) + streams + 1)]


def set_slots(url: str, slots: int) -> None:
    """Our server computes every slot's row each decode step (static shapes), where vLLM batches
    the running requests: before each closed loop, set `slots` to its concurrency through the
    live reconfiguration a user would make (POST /admin/config, the TUI's b/B)."""
    body = orjson.dumps({"slots": slots})
    req = urllib.request.Request(f"{url}/admin/config", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()
    except urllib.error.HTTPError as exc:
        raise BenchError(f"{url}/admin/config slots={slots}: {exc.code} {exc.read()!r}") from None
    log(f"ours: slots = {slots}")


def _tail(path: Path, n: int = LOG_TAIL) -> str:
    with contextlib.suppress(OSError):
        lines = path.read_text(errors="replace").strip().splitlines()[-n:]
        return "\n".join(f"  | {x}" for x in lines)
    return f"  ({path} cannot be read)"


@contextlib.contextmanager
def vllm_server(args: argparse.Namespace, scripts: Path, model: Path) -> Iterator[str]:
    """start_vllm.sh ... stop_vllm.sh, always; yields the base URL."""
    if _port_in_use(args.vllm_port):
        raise BenchError(f"something already listens on 127.0.0.1:{args.vllm_port}; stop it or "
                         "pass --vllm-port")  # fmt: skip
    env = {**os.environ, "PEERS": str(args.vllm_root), "NAME": model.name,
           "OMP_BIND": os.environ.get("OMP_BIND", "0-1")}  # fmt: skip
    # start_vllm.sh passes --dtype bfloat16 first: a later one wins (vLLM warns of the duplicate)
    dtype = ["--dtype", VLLM_DTYPES[args.vllm_dtype]] if args.vllm_dtype != "bf16" else []
    # and --max-model-len 2048: a 2048-token TTFT prompt and its 2 tokens need more (the peers'
    # config.json allows 4096 positions)
    longer = ["--max-model-len", str(max_len(args))] if max_len(args) > PEER_MAX_LEN else []
    start = [str(scripts / "start_vllm.sh"), str(model), str(args.vllm_port), *dtype, *longer,
             *args.vllm_args]  # fmt: skip
    stop = [str(scripts / "stop_vllm.sh"), str(args.vllm_port)]
    vlog = args.vllm_root / "logs" / f"vllm-{args.vllm_port}.log"
    log(f"starting vLLM: {shlex.join(start)} (OMP_BIND={env['OMP_BIND']}, log {vlog}) ...")
    try:
        done = subprocess.run(start, env=env, capture_output=True, text=True)
        if done.returncode:
            said = (done.stdout.strip().splitlines() or ["nothing"])[0]  # the tail follows it
            raise BenchError(f"vLLM did not start ({shlex.join(start)} exited "
                             f"{done.returncode}: {said}); its log {vlog} ends:\n"
                             f"{_tail(vlog)}")  # fmt: skip
        log(done.stdout.strip())
        yield f"http://127.0.0.1:{args.vllm_port}"
    finally:
        subprocess.run(stop, env=env, capture_output=True)
        log(f"stopped vLLM on port {args.vllm_port}")


def our_spec(args: argparse.Namespace, model: Path, work: Path) -> str:
    """Our --model for the peers' shape: the shipped spec, checked against their config.json,
    or one made from it (also where the bench needs a longer max_seq_len than the shipped)."""
    cfg = orjson.loads((model / "config.json").read_bytes())
    longest = max(PEER_MAX_LEN, max_len(args))
    want = spec_from_config(cfg, PEER_MODELS[args.shape], max_seq_len=longest)
    if args.shape in OUR_SPECS:
        shipped = load_model(OUR_SPECS[args.shape])
        bad = shape_mismatches(shipped, want)
        if bad:
            raise BenchError(f"spec {OUR_SPECS[args.shape]} differs from {model}/config.json: "
                             + "; ".join(bad))  # fmt: skip
        if shipped.max_seq_len >= longest:
            return OUR_SPECS[args.shape]
    path = work / f"{want['name']}.yaml"
    path.write_text(yaml.safe_dump(want, sort_keys=False))
    return str(path)


def measure_ours(args: argparse.Namespace, model: Path, work: Path) -> list[Measured]:
    spec = our_spec(args, model, work)
    spec_name = load_model(spec).name
    (args.vllm_root / "logs").mkdir(parents=True, exist_ok=True)
    out = []
    for precision in args.precisions:
        cmd = ["{python}", "-m", "scaletui", "serve", "--model", spec, "--tokenizer",
               str(model / "tokenizer.json"), "--weight-dtype", precision, "--slots",
               str(max(args.concurrency)), "--max-seq-len", str(max_len(args)), *kv_pages(args),
               "--kernels", args.kernels, "--port", "{port}", "--log-interval", "0",
               *args.serve_args]  # fmt: skip
        slog = args.vllm_root / "logs" / f"scaletui-{args.shape}-{precision}.log"
        srv = EmbeddedServer(" ".join(cmd), timeout=args.server_timeout, log=str(slog))
        if args.our_port:
            srv.port, srv.url = args.our_port, f"http://127.0.0.1:{args.our_port}"
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(srv)
            except RuntimeError as exc:  # it did not start; the message ends with its log's tail
                raise BenchError(f"scaletui serve ({precision}) did not start: {exc}") from None
            out.append(measure(f"ours-{precision}", precision, srv.url, args, work, spec_name))
            srv.finish(clean=True)
    return out


# -- the command line -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    a = p.add_argument
    a("--shape", choices=sorted(PEER_MODELS), default="1b", help="the peers' model shape")
    a("--precisions", nargs="+", choices=("f32", "bf16", "int8"), default=None,
      help="our --weight-dtype values, one server each, all between vLLM's two runs "
      "(default bf16)")  # fmt: skip
    a("--concurrency", nargs="+", type=int, default=None,
      help="closed loops (default 1 4 16 64)")  # fmt: skip
    a("--requests-per-stream", type=int, default=None,
      help="measured requests per stream (default 4), after one warm-up each")  # fmt: skip
    a("--input-len", type=int, default=128)
    a("--output-len", type=int, default=None, help="exact, ignore_eos (default 128)")
    a("--ttft-lens", nargs="+", type=int, default=None,
      help="prompt tokens of the TTFT runs, one prompt at a time "
      "(default 128 512 2048)")  # fmt: skip
    a("--ttft-requests", type=int, default=None,
      help="requests per TTFT run (default 8; 0: no TTFT runs)")  # fmt: skip
    a("--seed", type=int, default=0)
    a("--vllm-port", type=int, default=8100)
    a("--our-port", type=int, default=0, help="0: any free port")
    a("--vllm-root", type=Path, default=Path(os.environ.get("PEERS") or "/tmp/peers"),
      help="where the peers' scripts build: its vllm/ venv, model dirs, logs/ (default $PEERS "
      "or /tmp/peers)")  # fmt: skip
    a("--vllm-dtype", choices=sorted(VLLM_DTYPES), default="bf16",
      help="vLLM's --dtype (bf16 as in the peers' README; f32 where the CPU has no "
      "AVX512_BF16)")  # fmt: skip
    a(
        "--vllm-args",
        type=shlex.split,
        default=[],
        help="more `vllm serve` flags, one string: --vllm-args='--max-num-seqs 32'",
    )
    a(
        "--serve-args",
        type=shlex.split,
        default=[],
        help="more `scaletui serve` flags, one string: --serve-args='--decode-steps 8'",
    )
    a("--kernels", choices=("auto", "native", "xla"), default="auto", help="our --kernels")
    a("--server-timeout", type=float, default=900.0, help="wait for our /health (s)")
    a("--skip-vllm", action="store_true")
    a("--skip-ours", action="store_true")
    a("--quick", action="store_true", help="concurrency 1 4, 2 requests per stream, 32 output "
      "tokens, TTFT at 128 tokens, 3 TTFT requests (a smoke test; flags given still "
      "win)")  # fmt: skip
    a("--json", action="store_true", help="one JSON object per row")
    a("--out", help="write the JSON rows here too")
    # a smoke run (bench/_smoke.py): the tiny shape, one precision, a few short requests
    smoke = dict(concurrency=[1], requests_per_stream=1, output_len=4, ttft_requests=1)
    smoke["serve_args"] = ["--no-warmup"]  # each shape compiled when first run
    return shrink(p, shape="tiny", precisions=["f32"], input_len=16, ttft_lens=[16], **smoke)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    defaults = dict(precisions=["bf16"], concurrency=[1, 4, 16, 64], requests_per_stream=4,
                    output_len=128, ttft_lens=[128, 512, 2048], ttft_requests=8)  # fmt: skip
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, QUICK.get(k, v) if args.quick else v)
    if args.skip_vllm and args.skip_ours:
        p.error("--skip-vllm and --skip-ours leave nothing to run")
    if min(args.concurrency) < 1 or args.requests_per_stream < 1 or args.ttft_requests < 0:
        p.error("--concurrency and --requests-per-stream must be >= 1, --ttft-requests >= 0")
    if min(args.input_len, args.output_len, *args.ttft_lens) < 1:
        p.error("--input-len, --output-len and --ttft-lens must be >= 1")
    if args.output_len < 2:
        p.error("--output-len must be >= 2 (TPOT needs a second token)")
    return args


def run(args: argparse.Namespace) -> list[dict]:
    scripts = peers_dir()
    if not args.skip_vllm:
        vllm_python(args.vllm_root, scripts)  # before anything starts
        flags = cpu_flags()
        if args.vllm_dtype == "bf16" and flags and "avx512_bf16" not in flags:
            log(
                "warning: this CPU has no AVX512_BF16, so vLLM's bf16 runs on slow fallback "
                "kernels (the peers' README measured a Zen 4); --vllm-dtype f32 may be fairer"
            )
    model = model_dir(args, scripts)
    vllm, ours = [], []

    def measure_vllm(run: str) -> None:
        with vllm_server(args, scripts, model) as url:  # a fresh server each time
            vllm.append(measure(run, args.vllm_dtype, url, args, work, expect=model.name))

    with tempfile.TemporaryDirectory(prefix="peer-vllm-") as tmp:
        work = Path(tmp)
        if not args.skip_vllm:
            measure_vllm("vllm-1")
        if not args.skip_ours:
            ours = measure_ours(args, model, work)
            if not args.skip_vllm:  # again: how far the host moved while ours ran
                measure_vllm("vllm-2")
    return rows(vllm, ours, args.shape, args.input_len)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    before = signal.signal(signal.SIGTERM, _on_term)
    try:
        result = run(args)
    except BenchError as exc:
        print(f"peer_vllm: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        signal.signal(signal.SIGTERM, before)
    text = "".join(orjson.dumps(r).decode() + "\n" for r in result)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        sys.stdout.write(text)
        return 0
    runs = result[0]["vllm_runs"] if result else 0
    print(f"shape {args.shape}, closed loops of {args.input_len} in / {args.output_len} out; "
          f"vLLM {args.vllm_dtype if runs else '-'}, {runs} run(s); {legend(runs)}")  # fmt: skip
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
