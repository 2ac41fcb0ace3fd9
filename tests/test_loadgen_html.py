"""`loadgen report`: the HTML report from hand-made results (summarize() on records whose
latencies are known), its PNG, its errors, and the command that a run now records."""

from __future__ import annotations

import io
import re

import orjson
import pytest
from mock_openai import MockConfig, MockServer
from PIL import Image

from scaletui.loadgen import output
from scaletui.loadgen.cli import main
from scaletui.loadgen.client import RequestRecord
from scaletui.loadgen.report import summarize

RATES = (1.0, 2.0, 4.0)
SWEEP = ["loadgen", "--url", "http://h:8000", "--sweep", "1,2,4", "--num-requests", "10"]
NAMESPACES = {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}


def rec(i: int, rate: float, ttft: float, gap: float, turn: int) -> RequestRecord:
    """Request i of a stage at `rate`: 5 one-token chunks, TTFT `ttft` s, then `gap` s apart."""
    r = RequestRecord(i, i / rate, input_len=32, max_tokens=5)
    r.t_send, r.outcome, r.status = i / rate, "ok", 200
    r.chunk_times = [r.t_send + ttft + k * gap for k in range(5)]
    r.chunk_tokens = [1] * 5
    r.output_tokens, r.prompt_tokens, r.tokens_from_usage = 5, 33, True
    r.t_done, r.session, r.turn = r.chunk_times[-1], i // 2, turn
    return r


def stage_records(stage: int, rate: float) -> list[RequestRecord]:
    # TTFT (50 (stage + 1) + 10 i) ms for i = 0..9, TPOT 20 (stage + 1) ms; turn = i % 2
    return [
        rec(i, rate, 0.05 * (stage + 1) + 0.01 * i, 0.02 * (stage + 1), i % 2) for i in range(10)
    ]


@pytest.fixture
def files(tmp_path):
    """A 3-stage sweep with server_metrics/client_overhead, its per-request JSONL, and two
    simulate files (TTFT 40 ms x rate)."""
    stages = []
    with open(tmp_path / "sweep.jsonl", "wb") as f:
        for stage, rate in enumerate(RATES):
            records = stage_records(stage, rate)
            s = summarize(records, t_start=0.0, requested_rate=rate)
            s["command"] = SWEEP
            s["server_metrics"] = {"prefix_cache": {"hits": 12 + stage, "queries": 40}}
            s["client_overhead"] = {"loop_lag_ms": {"p99": 0.25}}
            stages.append(s)
            output.write_requests_to(f, records, 0.0, stage)
    sweep = {"stages": stages, "command": SWEEP, "search": {"max_rate": 3.0}}
    (tmp_path / "sweep.json").write_bytes(orjson.dumps(sweep))
    for rate in (1.0, 4.0):
        s = summarize([rec(i, rate, 0.04 * rate, 0.01, 0) for i in range(10)], requested_rate=rate)
        s["config"] = {"simulated": True}
        s["command"] = ["scaletui", "simulate", "--model", "small", "--qps", f"{rate:g}"]
        (tmp_path / f"sim{rate:g}.json").write_bytes(orjson.dumps(s))
    return tmp_path


def report(tmp_path, *args: str) -> tuple[int, str]:
    out = tmp_path / "out.html"
    code = main(["report", *args, "--html", str(out)])
    return code, out.read_text() if code == 0 else ""


def test_report_holds_every_part_inline(files, capsys):
    d = files
    code, page = report(
        d,
        str(d / "sweep.json"),
        *("--predicted", str(d / "sim1.json"), str(d / "sim4.json")),
        *("--requests", str(d / "sweep.jsonl")),
        *("--png", str(d / "out.png")),
    )
    assert code == 0, capsys.readouterr().err
    # three charts, each one inline <svg>: latency-vs-load, CDFs, TTFT by turn
    assert page.count("<svg") == 3 and page.count("</svg>") == 3
    # nothing is loaded: no script, stylesheet link, image or import; every href and url()
    # points inside the page; outside the commands' text the only URLs are the SVG's XML
    # namespace names
    assert not re.search(r"<script|<link|<img|<iframe|@import", page)
    assert all(v.startswith("#") for v in re.findall(r"(?:src|href)=\"([^\"]*)\"", page))
    assert all(v.startswith("#") for v in re.findall(r"url\(([^)]*)\)", page))
    text = re.sub(r"<pre>.*?</pre>", "", page, flags=re.DOTALL)
    assert set(re.findall(r"https?://[^\s\"'<>)]+", text)) == NAMESPACES
    # curves: the measured file by its name, the predicted curve, max_rate marked
    assert ">sweep p50<" in page and ">predicted p99<" in page and "max_rate 3" in page
    # the stage table: stage 1 at 2 req/s, TTFT p50 (100 + 10 * 4.5) ms
    assert "<td>1</td><td>2.0</td>" in page and "<td>145.0</td>" in page
    # server side, flattened to dotted names, per stage
    assert "<tr><td>prefix_cache.hits</td><td>14</td></tr>" in page
    assert "<tr><td>loop_lag_ms.p99</td><td>0.25</td></tr>" in page
    # the exact commands, the run's and simulate's
    assert "<pre>loadgen --url http://h:8000 --sweep 1,2,4 --num-requests 10</pre>" in page
    assert "<pre>scaletui simulate --model small --qps 4</pre>" in page
    # CDF table from the records: stage 0 TTFT 50..140 ms, p50 95, TPOT 20 ms
    assert "<td>sweep stage 0 (1 req/s)</td><td>10</td><td>95.00</td>" in page
    # per turn, stage 2: turn 0 has i = 0, 2, .., 8: TTFT 150 + 10 i, median 190; TPOT 60
    assert "<td>0</td><td>5</td><td>5</td><td>33.00</td><td>190.00</td>" in page
    png = (d / "out.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    image = Image.open(io.BytesIO(png))
    assert image.size == (1000, 3 * 380)  # three charts of 10 x 3.8 in at 100 dpi, stacked


def test_summary_only_says_what_is_missing(tmp_path):
    one = summarize(stage_records(0, 1.0), t_start=0.0, requested_rate=1.0)
    for r in ("per_turn", "server_stats_before"):
        one[r] = None
    (tmp_path / "one.json").write_bytes(orjson.dumps(one))
    code, page = report(tmp_path, str(tmp_path / "one.json"), "--x", "rate")
    assert code == 0
    assert page.count("<svg") == 1  # the curve only: no CDF is drawn from percentiles
    assert "No per-request file was given, so there is no CDF" in page
    assert "No stage ran conversations" in page
    assert "The command was not recorded" in page
    assert "offered rate (req/s)" in page


@pytest.mark.parametrize(
    "make, args, needle",
    [
        (None, ["missing.json"], "missing.json: no such file"),
        (b'{"foo": 1}', ["bad.json"], "bad.json: not a loadgen result"),
        (b'{"outcome": "ok"}\n{"outcome": "ok"}\n', ["bad.json"], "give it with --requests"),
        (b'{"stages": [{"completed": 1}]}', ["bad.json"], "'stages' entry 0 is not a summary"),
        (b"{}", ["sweep.json", "--requests", "bad.json"], "bad.json:1: no 'outcome'"),
        (None, ["sweep.json", "--predicted", "sweep.json"], "--predicted wants `scaletui simulate"),
        (None, ["sweep.json", "--percentiles", "50,75"], "--percentiles wants some of"),
    ],
)
def test_bad_inputs_are_one_line_naming_the_file(files, capsys, make, args, needle):
    if make is not None:
        (files / "bad.json").write_bytes(make)
    argv = [a if a.startswith("-") or a[0].isdigit() else str(files / a) for a in args]
    code, _ = report(files, *argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("loadgen report: error:") and needle in err[0], err
    assert not (files / "out.html").exists()


def test_a_run_records_its_command_and_reports(tmp_path, capsys):
    one, sweep = tmp_path / "one.json", tmp_path / "sweep.json"
    with MockServer(MockConfig(ttft=0.002, gap=0.001)) as srv:
        base = ["--url", srv.url, "--model", "m", "--num-requests", "4", "--quiet"]
        assert main([*base, "--qps", "100", "--out", str(one)]) == 0
        assert main([*base, "--sweep", "50,100", "--out", str(sweep)]) == 0
    argv = ["loadgen", *base, "--qps", "100", "--out", str(one)]
    assert orjson.loads(one.read_bytes())["command"] == argv
    got = orjson.loads(sweep.read_bytes())
    argv = ["loadgen", *base, "--sweep", "50,100", "--out", str(sweep)]
    assert got["command"] == argv and [s["command"] for s in got["stages"]] == [argv, argv]
    code, page = report(tmp_path, str(one), str(sweep))
    assert code == 0 and ">one p50<" in page and ">sweep p99<" in page
