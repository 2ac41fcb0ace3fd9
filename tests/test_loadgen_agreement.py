"""bench/loadgen_agreement.py without a server or a peer: the server-histogram maths on
hand-computed numbers, and each client's result format read from a recorded real run
(tests/fixtures/loadgen_agreement, made by tests/fixtures/make_loadgen_agreement.sh), checked
against the per-request records the same files hold."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import orjson
import pytest
from bench_modules import bench_module
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import Histogram as PromHistogram

FIXTURES = Path(__file__).parent / "fixtures" / "loadgen_agreement"
INF = math.inf
LE = (0.1, 0.25, 0.5, INF)


@pytest.fixture(scope="module")
def bench():
    with bench_module("loadgen_agreement") as module:
        yield module


@pytest.fixture(scope="module")
def ag(bench):
    """bench/_agreement.py, the pure parts, as the bench imports it."""
    return bench.ag


def _hist(ag, cumulative, total=0.0, le=LE):
    return ag.Histogram(le, tuple(float(c) for c in cumulative), total, float(cumulative[-1]))


# -- the server's histograms ----------------------------------------------------------------------


def test_quantile_interpolates_inside_the_bucket_of_the_deltas(ag):
    before, after = _hist(ag, [1, 2, 3, 3], 0.5), _hist(ag, [3, 8, 13, 13], 3.1)
    d = after.minus(before)
    assert d.cumulative == (2, 6, 10, 10) and d.count == 10 and d.mean == pytest.approx(0.26)
    # rank 5 of 10: the (0.1, 0.25] bucket holds ranks 3..6; 3 of its 4 -> 0.1 + 0.15 * 3/4
    p50 = ag.quantile(0.5, d)
    assert (p50.value, p50.lo, p50.hi) == (pytest.approx(0.2125), 0.1, 0.25)
    # the first bucket starts at 0: rank 1 of its 2 -> 0.05
    assert ag.quantile(0.1, d).value == pytest.approx(0.05)


def test_quantile_in_the_inf_bucket_is_the_highest_finite_bound_and_empty_is_none(ag):
    q = ag.quantile(0.5, _hist(ag, [0, 0, 0, 4]))
    assert (q.value, q.lo, q.hi) == (0.5, 0.5, INF)
    assert ag.quantile(0.5, _hist(ag, [0, 0, 0, 0])) is None


def test_a_p50_is_known_only_to_its_bucket(ag):
    """Three requests at 300 ms and one at 700 ms: the true median is 300 ms, the histogram's
    (0.25, 0.5] bucket holds it, and the interpolation says 0.25 + 0.25 * 2/3 = 417 ms."""
    reg = CollectorRegistry()
    h = PromHistogram("scaletui:x_seconds", "x", buckets=(0.25, 0.5, 0.75, 1.0), registry=reg)
    before = generate_latest(reg).decode()
    for v in (0.3, 0.3, 0.3, 0.7):
        h.observe(v)
    d = ag.histogram(generate_latest(reg).decode(), "scaletui:x_seconds").minus(
        ag.histogram(before, "scaletui:x_seconds")
    )
    p50 = ag.quantile(0.5, d)
    assert (p50.lo, p50.hi) == (0.25, 0.5) and p50.lo < 0.3 <= p50.hi
    assert p50.value == pytest.approx(0.25 + 0.25 * 2 / 3)
    assert d.mean == pytest.approx(1.6 / 4)  # _sum / _count is exact


def test_changed_buckets_and_a_missing_histogram_are_errors(ag):
    with pytest.raises(ag.AgreementError, match="bucket bounds changed"):
        _hist(ag, [1, 1, 1, 1]).minus(_hist(ag, [1, 1, 1], le=(0.1, 0.5, INF)))
    with pytest.raises(ag.AgreementError, match="no histogram scaletui:nope"):
        ag.histogram("# TYPE a counter\na_total 1\n", "scaletui:nope")


def test_a_client_agrees_within_five_percent_of_the_server(ag):
    # server: TTFT p50 0.2125 s (as above), ITL 2 s over 20 gaps = 100 ms
    ttft = _hist(ag, [2, 6, 10, 10], 2.6)
    itl = ag.Histogram(LE, (0.0, 20.0, 20.0, 20.0), 2.0, 20.0)
    fig = ag.ClientFigures("x", 223.125, 260.0, 105.0, 10, 128.0, 3.0)  # +5% and +5%
    row = ag.compare(fig, ttft, itl, prefix=(1280.0, 320.0))
    assert row["ttft_ratio"] == pytest.approx(1.05) and row["ttft_ok"] and row["ttft_in_bucket"]
    assert row["itl_ratio"] == pytest.approx(1.05) and row["itl_ok"]
    assert row["server_output_tokens"] == 3.0  # 20 gaps + 10 first tokens over 10 requests
    assert row["server_prompt_tokens"] == 128.0 and row["server_prefix_hit_rate"] == 0.25
    late = ag.compare(ag.ClientFigures("x", 230.0, 260.0, 106.0, 10, None, None), ttft, itl)
    assert not late["ttft_ok"] and not late["itl_ok"] and late["ttft_in_bucket"]
    assert ag.table([late]).splitlines()[1].split().count("n") == 2  # both marked not ok


# -- the clients' recorded result files -----------------------------------------------------------


def test_aiperf_figures_are_its_per_request_records_summarized(ag):
    fig = ag.read_aiperf(FIXTURES / "aiperf")
    records = [orjson.loads(x)["metrics"] for x in
               (FIXTURES / "aiperf" / "profile_export.jsonl").read_text().splitlines()]  # fmt: skip
    assert fig.requests == len(records) == 3
    ttft = [r["time_to_first_token"]["value"] for r in records]
    itl = [r["inter_token_latency"]["value"] for r in records]
    assert fig.ttft_p50_ms == pytest.approx(statistics.median(ttft))
    assert fig.itl_mean_ms == pytest.approx(statistics.mean(itl))


def test_guidellm_figures_are_its_request_timings_summarized(ag):
    fig = ag.read_guidellm(FIXTURES / "guidellm.json")
    doc = orjson.loads((FIXTURES / "guidellm.json").read_bytes())
    reqs = doc["benchmarks"][0]["requests"]["successful"]
    t = [r["info"]["timings"] for r in reqs]
    out = [r["output_metrics"]["text_tokens"] for r in reqs]
    ttft = [(x["first_token_iteration"] - x["request_start"]) * 1e3 for x in t]
    decode = sum(x["last_token_iteration"] - x["first_token_iteration"] for x in t)
    assert fig.requests == len(reqs) == 3 and fig.output_tokens == 8
    assert fig.ttft_p50_ms == pytest.approx(statistics.median(ttft), rel=1e-6)
    # token-weighted: all decode time over all tokens after the first
    assert fig.itl_mean_ms == pytest.approx(decode * 1e3 / sum(n - 1 for n in out), rel=1e-6)


def test_the_recorded_run_agrees_with_its_server_by_mean_and_itl(bench):
    """Right fields, right units: each client's mean TTFT and mean ITL in the recorded run are
    within 5% of the server's exact _sum/_count deltas, over the same requests and tokens."""
    rows = bench.report(FIXTURES)
    assert [r["client"] for r in rows] == ["loadgen", "aiperf", "guidellm"]
    for r in rows:
        assert r["server_requests"] == r["requests"] == 3 and r["server_output_tokens"] == 8
        assert abs(r["ttft_mean_ratio"] - 1) < 0.05 and r["itl_ok"], r
        lo, hi = r["server_ttft_bucket_ms"]
        assert lo <= r["server_ttft_p50_ms"] <= hi


def test_a_result_without_a_field_names_the_file_and_the_field(ag, bench, tmp_path):
    doc = orjson.loads((FIXTURES / "aiperf" / "profile_export_aiperf.json").read_bytes())
    del doc["inter_token_latency"]
    (tmp_path / "profile_export_aiperf.json").write_bytes(orjson.dumps(doc))
    with pytest.raises(ag.AgreementError, match=r"profile_export_aiperf.json: no field "
                       r"inter_token_latency.unit"):  # fmt: skip
        ag.read_aiperf(tmp_path)
    with pytest.raises(ag.AgreementError, match="none of"):
        bench.report(tmp_path / "empty")


def test_every_client_is_given_the_same_workload(bench, tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    argv = ["--concurrency", "3", "--num-requests", "7", "--input-len", "64", "--output-len", "5"]
    args = bench.parse([*argv, "--tokenizer", str(tok), "--peers", str(tmp_path)])
    url, out = "http://h:1", tmp_path / "o"
    cmds = {c: " ".join(bench.client_cmd(c, args, url, out)) for c in bench.CLIENTS}
    assert "--concurrency 3 --num-requests 7 --input-len 64 --output-len 5" in cmds["loadgen"]
    assert "--prompt-input-tokens-mean 64 --prompt-input-tokens-stddev 0" in cmds["aiperf"]
    assert "--prompt-output-tokens-mean 5" in cmds["aiperf"]
    assert "--concurrency 3 --request-count 7" in cmds["aiperf"]
    assert "--warmup-request-count" not in cmds["aiperf"]  # its warm-up would be in the deltas
    assert "prompt_tokens=64,output_tokens=5" in cmds["guidellm"]
    assert "profile.streams 3" in cmds["guidellm"] and "count=7" in cmds["guidellm"]
    assert all(str(tok) in cmd for cmd in cmds.values())
    assert "install_loadgens.sh" in bench.installed("aiperf", tmp_path)  # no venv there
    assert bench.installed("loadgen", tmp_path) is None
