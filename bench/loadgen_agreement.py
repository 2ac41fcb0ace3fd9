"""Agreement with the anchors (issue 41, item 8): loadgen, aiperf and guidellm against one
server, one workload, one tokenizer, each checked against the server's own histograms.

The server is `scaletui serve --model llama-1b` (the 1.1B shape: slow enough on 2 cores that the
multi-process clients do not take its CPU) with the peers' tokenizer.json, so a prompt of N
tokens to a client is N tokens to the server. Each client runs alone, in a subprocess, in a
closed loop of --concurrency streams, --input-len prompt and exactly --output-len output tokens
(ignore_eos). The server's `/metrics` is scraped just before and after each client, and the
deltas of its TTFT and ITL histograms are the reference:
- server TTFT p50: the quantile of the bucket deltas, interpolated linearly inside the bucket as
  Prometheus' histogram_quantile does. It is known only to its bucket: [lo, hi] is printed, and
  within it the interpolation assumes observations spread evenly.
- server mean ITL: delta _sum / delta _count, exact (the server counts (t_last - t_first) over
  n - 1 tokens per request, the token-weighted mean that all three clients report).
A client agrees when its TTFT p50 and mean ITL are within 5% of the server's. Warm-up requests
are sent by loadgen before the first scrape, so each delta holds exactly one client's requests.

Clients' own result files, by the fields their docs define:
- loadgen: the summary JSON's `median_ttft_ms`, `mean_ttft_ms`, `mean_itl_ms`, `completed`.
- aiperf: profile_export_aiperf.json's `time_to_first_token.p50|avg`, `inter_token_latency.avg`
  (ms, as their `unit` says), `request_count.avg`, `input_sequence_length.avg`,
  `output_sequence_length.avg`.
- guidellm: the benchmarks JSON's `benchmarks[0].metrics.time_to_first_token_ms.successful.
  median|mean`, `inter_token_latency_ms.successful.mean`, `request_totals.successful`,
  `prompt_token_count.successful.mean`, `output_token_count.successful.mean`.

    python bench/loadgen_agreement.py                      # starts the server, all three clients
    python bench/loadgen_agreement.py --keep DIR           # and keep every file it compared
    python bench/loadgen_agreement.py --report DIR         # the table again from a kept DIR

Exit status: 0 every client agreed, 1 one did not (or could not run: its row says why), 2 an
error (the server did not start, a file that is not what it should be).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import _agreement as ag
import orjson
from _smoke import shrink

from scaletui.loadgen.embedded import EmbeddedServer

CLIENTS = ("loadgen", "aiperf", "guidellm")
RESULT = {"loadgen": "loadgen.json", "aiperf": "aiperf", "guidellm": "guidellm.json"}
TTFT, ITL = "scaletui:time_to_first_token_seconds", "scaletui:inter_token_latency_seconds"
QUERIES, HITS = "scaletui:prefix_cache_queries_total", "scaletui:prefix_cache_hits_total"
LOG_TAIL = 2000  # characters of a failed client's output in the error


def log(msg: str) -> None:
    print(f"loadgen_agreement: {msg}", file=sys.stderr, flush=True)


# -- the clients' command lines -------------------------------------------------------------------


def client_cmd(client: str, args: argparse.Namespace, url: str, out: Path) -> list[str]:
    """One client's argv: the same workload for each (flags as ../shared/peers/run_*.sh give
    them, less aiperf's warm-up: every request a client measures must be in the server's
    delta, and the bench warms the server up itself)."""
    c, n, i, o = map(str, (args.concurrency, args.num_requests, args.input_len, args.output_len))
    tok = str(args.tokenizer)
    if client == "loadgen":
        exe = Path(sys.executable).with_name("loadgen")
        return [str(exe), "--url", url, "--model", args.model, "--concurrency", c,
                "--num-requests", n, "--input-len", i, "--output-len", o, "--tokenizer", tok,
                "--out", str(out), "--quiet", "--read-timeout", "900", "--timeout", "1800",
                *args.loadgen_args]  # fmt: skip
    if client == "aiperf":
        return [str(args.peers / "aiperf" / "bin" / "aiperf"), "profile", "--model", args.model,
                "--url", url, "--endpoint-type", "completions", "--streaming", "--tokenizer", tok,
                "--prompt-input-tokens-mean", i, "--prompt-input-tokens-stddev", "0",
                "--prompt-output-tokens-mean", o, "--prompt-output-tokens-stddev", "0",
                "--extra-inputs", "ignore_eos:true", "--concurrency", c, "--request-count", n,
                "--ui-type", "none", "--workers-max", "1", "--record-processors", "1",
                "--no-gpu-telemetry", "--no-server-metrics", "--output-artifact-dir", str(out),
                *args.aiperf_args]  # fmt: skip
    assert client == "guidellm", client
    return [str(args.peers / "guidellm" / "bin" / "guidellm"), "run",
            "--backend", f"kind=openai_http,target={url},model={args.model},"
            "request_format=/v1/completions",
            "--tokenizer", f"kind=hf_auto,model={tok}",
            "--data", f"kind=synthetic_text,prompt_tokens={i},output_tokens={o}",
            "--profile", "kind=concurrent", "--override", "profile.streams", c,
            "--constraint", f"kind=max_requests,count={n}",
            "--output", f"kind=json,path={out}", "--disable-progress",
            *args.guidellm_args]  # fmt: skip


def client_env(client: str) -> dict[str, str]:
    env = dict(os.environ)
    if client == "guidellm":  # as run_guidellm.sh: offline, one worker process (not 10)
        env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "GUIDELLM__MAX_WORKER_PROCESSES": "1"}  # fmt: skip
    if client == "aiperf":  # offline mode makes aiperf 0.13 fail on a local tokenizer directory
        env.pop("HF_HUB_OFFLINE", None)
        env.pop("TRANSFORMERS_OFFLINE", None)
        env["HF_HUB_DISABLE_TELEMETRY"] = "1"
    return env


def installed(client: str, peers: Path) -> str | None:
    """None, or why the client cannot run."""
    if client == "loadgen":
        return None
    exe = peers / client / "bin" / client
    if not exe.exists():
        return f"{exe} does not exist: install it with ../shared/peers/install_loadgens.sh"
    return None


# -- the server -----------------------------------------------------------------------------------


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return resp.read().decode()


def proc_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of a process (Linux /proc), None elsewhere."""
    with contextlib.suppress(OSError, TypeError, IndexError, ValueError):
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return None


def server_cmd(args: argparse.Namespace) -> str:
    tok = args.tokenizer / "tokenizer.json"
    seq = 1 << (args.input_len + args.output_len + 8 - 1).bit_length()  # prompt + output + slack
    return (f"{{python}} -m scaletui serve --model {args.server_model} --tokenizer {tok} "
            f"--weight-dtype {args.weight_dtype} --slots {args.concurrency} --max-seq-len {seq} "
            f"--port {{port}} --log-interval 0")  # fmt: skip


# -- one client's run -----------------------------------------------------------------------------


def run_client(
    client: str, args: argparse.Namespace, url: str, work: Path, server_pid: int | None
) -> dict:
    """Scrape, run the client, scrape; the row (or the error) with what was measured around."""
    why = installed(client, args.peers)
    if why:
        return {"client": client, "error": why}
    out = work / RESULT[client]
    cmd = client_cmd(client, args, url, out)
    log(f"{client}: {shlex.join(cmd)}")
    before_text, load0, srv0 = scrape(url), os.getloadavg(), proc_cpu_s(server_pid)
    ru0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    done = subprocess.run(cmd, env=client_env(client), cwd=work, capture_output=True, text=True)
    wall = time.monotonic() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    after_text, load1, srv1 = scrape(url), os.getloadavg(), proc_cpu_s(server_pid)
    (work / f"{client}.log").write_text(done.stdout + done.stderr)
    (work / f"{client}.metrics_before.txt").write_text(before_text)
    (work / f"{client}.metrics_after.txt").write_text(after_text)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    around = {"command": cmd, "wall_s": wall, "client_cpu_s": cpu,
              "server_cpu_s": None if srv0 is None or srv1 is None else srv1 - srv0,
              "loadavg_before": load0[0], "loadavg_after": load1[0]}  # fmt: skip
    (work / f"{client}.run.json").write_bytes(orjson.dumps(around))
    if done.returncode:
        tail = (done.stdout + done.stderr)[-LOG_TAIL:]
        return {"client": client, "error": f"exit status {done.returncode}:\n{tail}", **around}
    return {**row_from(client, work), **around}


def row_from(client: str, folder: Path) -> dict:
    """The comparison row for a client from its files in `folder` (a run's or a kept one)."""
    figures = ag.read_result(client, folder / RESULT[client])
    before = (folder / f"{client}.metrics_before.txt").read_text()
    after = (folder / f"{client}.metrics_after.txt").read_text()
    ttft = ag.histogram(after, TTFT).minus(ag.histogram(before, TTFT))
    itl = ag.histogram(after, ITL).minus(ag.histogram(before, ITL))
    queries, hits = (ag.counter(after, k) - ag.counter(before, k) for k in (QUERIES, HITS))
    return ag.compare(figures, ttft, itl, prefix=(queries, hits))


def report(folder: Path) -> list[dict]:
    """The rows of a kept run: each client whose result file is there, with its run.json."""
    rows = []
    for client in CLIENTS:
        if not (folder / RESULT[client]).exists():
            continue
        row = row_from(client, folder)
        with contextlib.suppress(OSError):
            row |= orjson.loads((folder / f"{client}.run.json").read_bytes())
        rows.append(row)
    if not rows:
        raise ag.AgreementError(f"{folder} holds none of {sorted(RESULT.values())}")
    return rows


# -- the command line -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    a = p.add_argument
    a("--url", help="a running server (ours, with the same tokenizer); default: start one")
    a("--server-model", default="llama-1b", help="our --model when the bench starts the server")
    a("--model", default="llama-1b", help="the model name the clients ask for")
    a("--weight-dtype", default="bf16", choices=("f32", "bf16", "int8"))
    a("--tokenizer", type=Path, default=Path("/tmp/peers/llama-1b"),
      help="an HF tokenizer directory for all three clients and the server (its "
      "tokenizer.json); make_tiny_llama.py --shape 1b --no-weights makes it")  # fmt: skip
    a("--peers", type=Path, default=Path(os.environ.get("PEERS") or "/tmp/peers"),
      help="where install_loadgens.sh put the aiperf/ and guidellm/ venvs")  # fmt: skip
    a("--clients", nargs="+", choices=CLIENTS, default=list(CLIENTS))
    a("--concurrency", type=int, default=2, help="closed-loop streams (and the server's slots)")
    a("--num-requests", type=int, default=15, help="measured requests per client")
    a("--input-len", type=int, default=128)
    a("--output-len", type=int, default=48, help="exact: ignore_eos")
    a("--warmup", type=int, default=2, help="loadgen requests before the first scrape")
    for name in ("loadgen", "aiperf", "guidellm"):
        a(f"--{name}-args", type=shlex.split, default=[], help=f"more {name} flags, one string")
    a("--server-timeout", type=float, default=900.0)
    a("--keep", type=Path, help="copy every compared file here (results, scrapes, logs)")
    a("--report", type=Path, help="no run: the table from a --keep folder")
    a("--json", action="store_true", help="one JSON row per client")
    return shrink(p, num_requests=3, output_len=8, warmup=1)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if min(args.concurrency, args.num_requests, args.input_len) < 1 or args.output_len < 2:
        p.error("--concurrency, --num-requests, --input-len must be >= 1, --output-len >= 2")
    if args.report is None and not (args.tokenizer / "tokenizer.json").is_file():
        p.error(f"--tokenizer {args.tokenizer} has no tokenizer.json: make it with "
                "python3 ../shared/peers/make_tiny_llama.py --shape 1b --no-weights")  # fmt: skip
    return args


def run(args: argparse.Namespace, work: Path) -> list[dict]:
    with contextlib.ExitStack() as stack:
        url, pid = args.url, None
        if url is None:
            srv = EmbeddedServer(server_cmd(args), timeout=args.server_timeout,
                                 log=str(work / "server.log"))  # fmt: skip
            try:
                stack.enter_context(srv)
            except RuntimeError as exc:
                raise ag.AgreementError(f"scaletui serve did not start: {exc}") from None
            url, pid = srv.url, srv.proc.pid
        if args.warmup:
            warm = argparse.Namespace(**{**vars(args), "num_requests": args.warmup,
                                         "loadgen_args": []})  # fmt: skip
            cmd = client_cmd("loadgen", warm, url, work / "warmup.json")
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                tail = done.stderr[-LOG_TAIL:]
                raise ag.AgreementError(f"the warm-up ({shlex.join(cmd)}) exited with status "
                                        f"{done.returncode}:\n{tail}")  # fmt: skip
        return [run_client(c, args, url, work, pid) for c in args.clients]


def box() -> str:
    load = os.getloadavg()
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        names = [x for x in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in x]
        cpu = f"{len(names)} x {names[0].partition(':')[2].strip()}"
    return f"{cpu}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        if args.report:
            rows = report(args.report)
        else:
            with tempfile.TemporaryDirectory(prefix="agreement-") as tmp:
                rows = run(args, Path(tmp))
                if args.keep:
                    shutil.copytree(tmp, args.keep, dirs_exist_ok=True)
    except ag.AgreementError as exc:
        print(f"loadgen_agreement: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write("".join(orjson.dumps(r).decode() + "\n" for r in rows))
    else:
        print(f"box: {box()}; tolerance {ag.TOLERANCE:.0%}")
        print(ag.table(rows))
    return 0 if all(r.get("ttft_ok") and r.get("itl_ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
