"""One schedule over several loadgen processes: --workers N, --shard I/N --start-at EPOCH and
`loadgen merge` give one process's schedule and summary, and refuse what does not fit."""

from __future__ import annotations

import asyncio
import math
import socket
import time

import orjson
import pytest
from mock_openai import MockConfig, MockServer

from scaletui.loadgen import cli
from scaletui.loadgen.cli import main
from scaletui.loadgen.flags import build_parser
from scaletui.loadgen.results import load_blocks

pytestmark = pytest.mark.timeout(60)
COUNTS = ("num_prompts", "sent", "completed", "failed", "total_input_tokens",
          "total_output_tokens", "requested_rate")  # fmt: skip


def base(url: str, seed: int = 0, quiet: bool = True) -> list[str]:
    """Poisson at 400 req/s, 40 requests of uniform prompt lengths: the schedule to split."""
    return ["--url", url, "--qps", "400", "--num-requests", "40", "--output-len", "3",
            "--input-len", "32", "--input-dist", "uniform", "--input-spread", "16",
            "--seed", str(seed), "--slo", "ttft=2000"] + ["--quiet"] * quiet  # fmt: skip


def schedule(paths) -> list[tuple]:
    """(index, intended send offset, prompt length, max_tokens) of every measured request."""
    rows = [r for p in paths for b in load_blocks(str(p)) for r in b.records if not r["warmup"]]
    return sorted((r["index"], r["t_sched"], r["input_len"], r["max_tokens"]) for r in rows)


def same_schedule(got: list[tuple], want: list[tuple]) -> None:
    assert [g[0] for g in got] == [w[0] for w in want] == list(range(40))
    assert [g[2:] for g in got] == [w[2:] for w in want]
    assert max(abs(g[1] - w[1]) for g, w in zip(got, want, strict=True)) < 1e-6


def one_process(url: str, tmp_path) -> tuple[dict, list[tuple]]:
    out, reqs = tmp_path / "one.json", tmp_path / "one.jsonl"
    assert main([*base(url), "--out", str(out), "--save-requests", str(reqs)]) == 0
    return orjson.loads(out.read_bytes()), schedule([reqs])


def test_four_workers_send_one_processs_schedule_and_summary(tmp_path, capsys):
    """Spawns 4 processes: the one test that does."""
    out, reqs = tmp_path / "w.json", tmp_path / "w.jsonl"
    with MockServer(MockConfig(ttft=0.002, gap=0.001)) as srv:
        single, want = one_process(srv.url, tmp_path)
        argv = [*base(srv.url, quiet=False), "--workers", "4", "--out", str(out)]
        assert main([*argv, "--save-requests", str(reqs)]) == 0
        assert srv.requests == 80
    same_schedule(schedule([reqs]), want)
    merged = orjson.loads(out.read_bytes())
    assert {k: merged[k] for k in COUNTS} == {k: single[k] for k in COUNTS}
    assert merged["scheduled_rate"] == pytest.approx(single["scheduled_rate"], rel=1e-9)
    assert merged["command"][-2:] == ["--save-requests", str(reqs)]
    rows = merged["workers"]
    assert [r["shard"] for r in rows] == ["0/4", "1/4", "2/4", "3/4"]
    assert sum(r["sent"] for r in rows) == 40 and len({r["pid"] for r in rows}) == 4
    assert all(r["schedule_delay_ms"]["p99"] is not None for r in rows)
    assert merged["clock_skew"]["skew_ms"] == 0.0 and len(merged["clock_skew"]["hosts"]) == 1
    printed = capsys.readouterr().out
    assert "Workers: 4 shards of one schedule" in printed and "3/4" in printed
    # --save-requests holds the 4 shards: `loadgen merge` gives the same summary back
    again = tmp_path / "again.json"
    assert main(["merge", str(reqs), "--out", str(again), "--quiet"]) == 0
    back = orjson.loads(again.read_bytes())
    assert back["p99_ttft_ms"] == pytest.approx(merged["p99_ttft_ms"])


async def _shards(url: str, tmp_path, n: int, seeds: list[int]) -> list:
    """n shards run side by side as `loadgen --shard I/N --start-at EPOCH` does, in one loop."""
    epoch = time.time() + 1.0
    files = [tmp_path / f"s{i}.jsonl" for i in range(n)]
    runs = []
    for i, path in enumerate(files):
        argv = [*base(url, seeds[i]), "--shard", f"{i}/{n}", "--start-at", repr(epoch),
                "--save-requests", str(path)]  # fmt: skip
        args = build_parser().parse_args(argv)
        args.command = ["loadgen", *argv]
        cli.check_usage(args)
        runs.append(cli.run(args, url))
    assert await asyncio.gather(*runs) == [0] * n
    return files


def test_four_shards_merged_equal_one_process(tmp_path):
    with MockServer(MockConfig(ttft=0.002, gap=0.001)) as srv:
        single, want = one_process(srv.url, tmp_path)
        files = asyncio.run(_shards(srv.url, tmp_path, 4, [0] * 4))
    same_schedule(schedule(files), want)
    heads = [load_blocks(str(f))[0].header for f in files]
    assert {h["t_start_epoch"] for h in heads} == pytest.approx([heads[0]["start_at"]])
    out = tmp_path / "m.json"
    assert main(["merge", *map(str, files[::-1]), "--out", str(out), "--quiet"]) == 0
    merged = orjson.loads(out.read_bytes())
    assert {k: merged[k] for k in COUNTS} == {k: single[k] for k in COUNTS}
    assert merged["config"]["workload"] == single["config"]["workload"]
    judged = ("passed", "slo_ms", "percentile", "min_completed")  # as one process
    check, one = merged["slo_check"], single["slo_check"]
    assert {k: check[k] for k in judged} == {k: one[k] for k in judged}
    # whether the server kept up is each run's own timing (two runs on a busy box may differ);
    # the rest of the verdict is the same rule over the same schedule
    ruled = lambda c: [r for r in c["reasons"] if not r.startswith("saturated")]  # noqa: E731
    assert ruled(check) == ruled(one) == ["only 40 completed; p99 needs 500"]
    rows = merged["workers"]
    assert [r["sent"] for r in rows] == [10, 10, 10, 10]  # index % 4
    assert all(r["start_late_ms"] == 0.0 for r in rows)  # ready before the start
    # percentiles of all records, never an average of the shards'
    recs = [r for f in files for b in load_blocks(str(f)) for r in b.records]
    delay = [(r["t_send"] - r["t_sched"]) * 1e3 for r in recs]
    assert merged["p99_schedule_delay_ms"] == pytest.approx(float(_p99(delay)))


def _p99(xs: list[float]) -> float:
    import numpy as np

    return float(np.percentile(xs, 99))


def test_merge_refuses_other_schedules_and_missing_shards(tmp_path, capsys):
    with MockServer(MockConfig(ttft=0.001, gap=0.001)) as srv:
        files = asyncio.run(_shards(srv.url, tmp_path, 2, [0, 1]))
        one = tmp_path / "one.jsonl"
        assert main([*base(srv.url), "--save-requests", str(one)]) == 0
    assert main(["merge", *map(str, files), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert str(files[1]) in err and "another schedule" in err and "workload.seed 1 vs 0" in err
    assert main(["merge", str(files[0]), "--quiet"]) == 2
    assert "shard 1/2 is missing" in capsys.readouterr().err
    assert main(["merge", str(files[0]), str(files[0]), "--quiet"]) == 2
    assert "shard 0/2 again" in capsys.readouterr().err
    old = tmp_path / "old.jsonl"  # a file from before the header line
    old.write_bytes(b"\n".join(one.read_bytes().splitlines()[1:]))
    assert main(["merge", str(old), "--quiet"]) == 2
    assert f"{old}: no run header line" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--shard", "3/2", "--start-at", "now"], "--shard 3/2: want I/N with 0 <= I < N"),
        (["--shard", "x"], "--shard wants I/N such as 0/4, got 'x'"),
        (["--shard", "0/2", "--start-at", "5"], "--start-at 5 is not a wall-clock time"),
        (["--workers", "0"], "--workers wants a whole number >= 1, got '0'"),
    ],
)
def test_bad_shard_flags_are_clear_errors(flags, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--url", "http://x", "--qps", "5", *flags])
    assert exc.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--shard", "1/2", "--save-requests", "f"], "--shard needs --start-at EPOCH"),
        (["--shard", "0/2", "--start-at", "T"], "give --save-requests FILE"),
        (["--start-at", "T"], "--start-at is when a --shard starts"),
        (["--workers", "2", "--shard", "0/2", "--start-at", "T"], "give one"),
        (["--workers", "2", "--concurrency", "4"], "drop it"),
        (["--workers", "2", "--sweep", "1,2"], "drop --sweep"),
        (["--workers", "2", "--repeat", "2"], "drop --repeat"),
    ],
)
def test_flags_that_do_not_go_with_shards_are_one_line(flags, needle, capsys):
    now = repr(time.time() + 60)
    argv = ["--url", "http://127.0.0.1:9", "--qps", "5"] + [now if f == "T" else f for f in flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("loadgen: error:") and needle in err[0], err


def test_records_convert_to_the_wall_clock(tmp_path):
    """A single run's file has its header too: t_start_epoch + a record's time is when it
    happened on the wall clock."""
    reqs = tmp_path / "r.jsonl"
    with MockServer(MockConfig(ttft=0.001, gap=0.001)) as srv:
        before = time.time()
        assert main([*base(srv.url), "--save-requests", str(reqs)]) == 0
        after = time.time()
    (block,) = load_blocks(str(reqs))
    assert block.header["shard"] == "0/1" and block.header["start_at"] is None
    sends = [block.header["t_start_epoch"] + r["t_send"] for r in block.records]
    assert before <= min(sends) and max(sends) <= after and not math.isnan(sum(sends))


def test_a_worker_that_cannot_start_stops_the_run_with_its_error(capsys):
    """Spawns 2 processes: a dead port fails each worker before the start."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["--url", f"http://127.0.0.1:{port}", "--qps", "5", "--workers", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("loadgen: error: worker "), err
    assert "exited 2 before the start" in err[0] and "cannot reach" in err[0]
