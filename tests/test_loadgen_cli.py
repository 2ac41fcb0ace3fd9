"""The `loadgen` command: outputs, sweeps, the embedded server, and one-line errors."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import orjson
import pytest
from mock_openai import MockConfig, MockServer

from scaletui.loadgen.cli import main
from scaletui.loadgen.embedded import EmbeddedServer
from scaletui.loadgen.results import load_requests

pytestmark = pytest.mark.timeout(120)
MOCK = Path(__file__).with_name("mock_openai.py")
MOCK_CMD = f"{{python}} {MOCK} --port {{port}} --ttft 0.005 --gap 0.001"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_error_line(capsys, needle: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("loadgen: error:") and needle in err[0], err


def test_dead_port_is_one_line_and_nonzero(capsys):
    port = free_port()
    assert main(["--url", f"http://127.0.0.1:{port}", "--qps", "5", "--num-requests", "2"]) == 2
    one_error_line(capsys, "cannot reach")


def test_wrong_urls_and_bad_flags_are_one_line(capsys):
    with MockServer(MockConfig(ttft=0.001, gap=0.001)) as srv:
        assert main(["--url", srv.url + "/nope", "--qps", "5"]) == 2
        one_error_line(capsys, "/v1/models")
        argv = ["--url", srv.url + "/nope", "--model", "m", "--qps", "50", "--num-requests", "2"]
        assert main([*argv, "--quiet"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "no request completed" in err[0] and "404" in err[0]
    assert main(["--url", "localhost:8000", "--qps", "5"]) == 2
    one_error_line(capsys, "http://")
    assert main(["--url", "http://x", "--qps", "5", "--arrival", "gamma", "--burstiness", "0"]) == 2
    one_error_line(capsys, "burstiness must be > 0")
    assert main(["--url", "http://x"]) == 2
    one_error_line(capsys, "--qps")


def test_outputs_json_jsonl_csv_requests(tmp_path, capsys):
    out, live, rows, reqs = (tmp_path / n for n in ("r.json", "l.jsonl", "r.csv", "q.jsonl"))
    with MockServer(MockConfig(ttft=0.005, gap=0.002, tokens_per_chunk=2)) as srv:
        argv = ["--url", srv.url, "--qps", "40", "--num-requests", "12", "--output-len", "8",
                "--slo", "ttft=1000", "--out", str(out), "--jsonl", str(live), "--csv", str(rows),
                "--save-requests", str(reqs)]  # fmt: skip
        assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Median TTFT (ms):" in printed
    summary = orjson.loads(out.read_bytes())
    assert summary["completed"] == 12 and summary["total_output_tokens"] == 96
    assert summary["request_goodput"] == summary["request_throughput"]
    assert summary["server_stats_before"]["state"] == "serving"
    assert summary["server_stats_after"]["requests"]["finished"] == 12
    assert summary["config"]["workload"]["qps"] == 40.0
    lines = [orjson.loads(x) for x in live.read_bytes().splitlines()]
    assert lines[0]["type"] == "start" and lines[0]["model"] == "mock-model"
    assert lines[-1]["type"] == "summary" and lines[-1]["completed"] == 12
    assert all(x["type"] == "window" for x in lines[1:-1])
    per_request = load_requests(str(reqs))
    assert len(per_request) == 12 and all(r["outcome"] == "ok" for r in per_request)
    assert all(sum(r["chunk_tokens"]) == 8 for r in per_request)
    csv_lines = rows.read_text().splitlines()
    assert len(csv_lines) == 2 and "median_ttft_ms" in csv_lines[0].split(",")


def test_sweep_prints_a_latency_throughput_table(tmp_path, capsys):
    with MockServer(MockConfig(ttft=0.005, gap=0.002)) as srv:
        argv = ["--url", srv.url, "--sweep", "20,60", "--num-requests", "8", "--output-len", "4",
                "--csv", str(tmp_path / "s.csv"), "--jsonl", str(tmp_path / "s.jsonl")]  # fmt: skip
        assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "ttft p50" in printed and "out tok/s" in printed
    table_rows = [x for x in printed.splitlines() if x.strip().startswith(("20.0 ", "60.0 "))]
    assert len(table_rows) == 2
    assert len((tmp_path / "s.csv").read_text().splitlines()) == 3
    live = [orjson.loads(x) for x in (tmp_path / "s.jsonl").read_bytes().splitlines()]
    summaries = [x for x in live if x["type"] == "summary"]
    assert [s["requested_rate"] for s in summaries] == [20.0, 60.0]


@pytest.mark.slow  # starts a server process
def test_embedded_server_starts_answers_and_stops(tmp_path):
    with EmbeddedServer(MOCK_CMD, timeout=60, verbose=False) as srv:
        with urllib.request.urlopen(srv.url + "/health", timeout=10) as resp:
            assert resp.status == 200
        proc = srv.proc
    assert proc.poll() is not None
    cmd = f"{sys.executable} -c 'raise SystemExit(3)'"
    failing = EmbeddedServer(cmd, verbose=False, log=str(tmp_path / "failing.log"))
    with pytest.raises(RuntimeError, match="exited with status"), failing:
        pass


@pytest.mark.slow  # starts a server process
def test_no_url_runs_against_the_embedded_server(tmp_path, monkeypatch):
    monkeypatch.setenv("LOADGEN_SERVER_CMD", MOCK_CMD)
    out = tmp_path / "r.json"
    argv = [
        "--qps",
        "50",
        "--num-requests",
        "40",
        "--output-len",
        "8",
        "--out",
        str(out),
        "--quiet",
    ]
    assert main(argv) == 0
    summary = orjson.loads(out.read_bytes())
    assert summary["completed"] == 40 and summary["config"]["run"]["url"].startswith("http://")


def test_ctrl_c_writes_the_partial_summary(tmp_path):
    out, live = tmp_path / "r.json", tmp_path / "l.jsonl"
    with MockServer(MockConfig(ttft=0.005, gap=0.05)) as srv:
        argv = [sys.executable, "-m", "scaletui.loadgen.cli", "--url", srv.url, "--qps", "20",
                "--num-requests", "1000", "--out", str(out), "--jsonl", str(live)]  # fmt: skip
        proc = subprocess.Popen([*argv, "--quiet"], stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while b'"window"' not in (live.read_bytes() if live.exists() else b""):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    assert b"Traceback" not in proc.stderr.read()
    summary = orjson.loads(out.read_bytes())
    assert summary["partial"] is True and 0 < summary["sent"] < 1000
    last = orjson.loads(live.read_bytes().splitlines()[-1])
    assert last["type"] == "summary" and last["partial"] is True


def test_jsonl_to_stdout_stays_pure_json(capsys):
    with MockServer(MockConfig(ttft=0.005, gap=0.002)) as srv:
        argv = ["--url", srv.url, "--qps", "40", "--num-requests", "5", "--jsonl", "-"]
        assert main(argv) == 0
    captured = capsys.readouterr()
    lines = [orjson.loads(x) for x in captured.out.splitlines()]
    assert lines[0]["type"] == "start" and lines[-1]["type"] == "summary"
    assert "Serving Benchmark Result" in captured.err  # the table moved to stderr


def test_odd_or_silent_model_list_is_one_line(capsys, monkeypatch):
    import scaletui.loadgen.cli as cli

    async def odd(session, url, timeout=5.0):
        return {"object": "list", "data": [{"object": "model"}]}  # no "id"

    async def silent(session, url, timeout=5.0):
        raise TimeoutError

    argv = ["--url", "http://127.0.0.1:9", "--qps", "5", "--num-requests", "1"]
    monkeypatch.setattr(cli, "get_json", odd)
    assert main(argv) == 2
    one_error_line(capsys, "no model list at /v1/models")
    monkeypatch.setattr(cli, "get_json", silent)
    assert main(argv) == 2
    one_error_line(capsys, "no answer from /v1/models")


@pytest.mark.slow  # starts a server process
def test_embedded_server_that_failed_is_reported_at_once(tmp_path):
    script = tmp_path / "failed_server.py"
    script.write_text(
        "import http.server, sys\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        '        body = b\'{"status": "failed", "error": "out of device memory"}\'\n'
        "        self.send_response(500)\n"
        "        self.send_header('Content-Length', str(len(body)))\n"
        "        self.end_headers()\n"
        "        self.wfile.write(body)\n"
        "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
    )
    failed = EmbeddedServer(
        f"{{python}} {script} {{port}}", timeout=60, verbose=False, log=str(tmp_path / "s.log")
    )
    with pytest.raises(RuntimeError, match="failed: .*out of device memory"), failed:
        pass  # at once, not "not healthy after 60 s"
    assert failed.proc.poll() is not None
