"""loadgen against our server (FakeEngine, a real socket): exact prompt lengths with the server's
tokenizer, and a Mooncake-style trace whose shared hash_ids hit the server's prefix cache."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from pathlib import Path

import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from scaletui.loadgen.cli import main
from scaletui.loadgen.report import summarize
from scaletui.loadgen.results import load_requests
from scaletui.loadgen.run_config import RunConfig, make_session
from scaletui.loadgen.runner import Runner
from scaletui.loadgen.tokens import WORDS
from scaletui.loadgen.workload import Lengths, Workload
from scaletui.serve.engine.fake_engine import FakeEngineFactory
from scaletui.serve.http.api import ApiSettings, create_app
from scaletui.serve.http.testing import serve_in_thread
from scaletui.serve.http.tokenizer import load_tokenizer
from scaletui.serve.scheduling.scheduler import Scheduler
from scaletui.shape import ServerShape
from scaletui.specs import load_model

pytestmark = pytest.mark.timeout(120)
MOONCAKE = "src/scaletui/loadgen/traces/mooncake_style.jsonl"


def make_tokenizer(folder) -> str:
    """A small byte-level BPE tokenizer.json; its only special token is an EOS, so the server
    adds no BOS and its prompt count is the tokenizer's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = [" ".join(WORDS[i : i + 12]) for i in range(0, len(WORDS), 3)] * 10
    hf.train_from_iterator(text, trainer)
    hf.save(str(folder / "tokenizer.json"))
    return str(folder / "tokenizer.json")


def add_tokenize(app: web.Application, tok) -> None:
    """vLLM's POST /tokenize and /detokenize, which our server lacks, for --tokenizer server."""

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        ids = ([tok.bos_id] if body.get("add_special_tokens") and tok.bos_id >= 0 else []) + (
            tok.encode(body["prompt"])
        )
        return web.json_response({"count": len(ids), "tokens": ids, "max_model_len": 256})

    async def detokenize(request: web.Request) -> web.Response:
        return web.json_response({"prompt": tok.decode((await request.json())["tokens"])})

    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)


@contextlib.contextmanager
def our_server(tokenizer: str | None = None, tokenize: bool = False, **shape):
    tok = load_tokenizer(tokenizer, 512)
    config = ServerShape(load_model("tiny"), **{"max_seq_len": 256, "page_size": 16, **shape})
    factory = FakeEngineFactory(vocab_limit=tok.vocab_size, eos_ids=(tok.eos_id,))
    sched = Scheduler(config, factory)
    app = create_app(sched, tok, ApiSettings(log_interval_s=0))
    if tokenize:
        add_tokenize(app, tok)
    with serve_in_thread(app) as url:
        deadline = time.monotonic() + 30
        while sched.state != "serving" and time.monotonic() < deadline:
            time.sleep(0.01)
        yield url


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not in /metrics")


async def run(url: str, workload: Workload, n: int, api: str = "completions"):
    cfg = RunConfig(url=url, model="tiny", num_requests=n, api=api)
    async with make_session() as session:
        result = await Runner(cfg, workload).run(session)
    config = {"run": {"api": api}}
    s = summarize(
        result.records, t_start=result.t_start, tokenizer=workload.tokenizer, config=config
    )
    return result.records, s


def test_exact_lengths_synthetic_dataset_and_first_turns(tmp_path):
    tok = make_tokenizer(tmp_path)
    data = [
        {"conversations": [{"value": " ".join(WORDS[i : i + 9 + i % 7])}, {"value": "fine " * 5}]}
        for i in range(20)
    ]
    (tmp_path / "sg.json").write_bytes(orjson.dumps(data))
    shapes = {
        "synthetic": dict(input=Lengths(40, "uniform", 25), prefix_len=8, prefix_groups=2),
        "dataset measured": dict(dataset=str(tmp_path / "sg.json")),
        "dataset fit": dict(
            dataset=str(tmp_path / "sg.json"), dataset_fit=True, input=Lengths(30, "uniform", 20)
        ),
        "conversation": dict(input=Lengths(24, "uniform", 10), turns=Lengths(3)),
    }
    with our_server(tok) as url:
        for name, kw in shapes.items():
            w = Workload(**{"qps": 50.0, "output": Lengths(4), "tokenizer": tok, "seed": 1, **kw})
            records, s = asyncio.run(run(url, w, 12))
            assert s["completed"] == len(records), (name, s["errors"])
            firsts = [r for r in records if not r.turn]
            assert len({r.input_len for r in firsts}) > 1, name  # the lengths vary ...
            assert all(r.prompt_tokens == r.input_len for r in firsts), (  # ... and are exact
                name,
                [(r.input_len, r.prompt_tokens) for r in firsts],
            )
            lengths = s["prompt_lengths"]
            assert lengths["exact"] and lengths["tokenizer"] == tok
            if name == "conversation":
                later = [r for r in records if r.turn]
                assert later and all(r.prompt_tokens == r.input_len for r in later)
                assert [t["turn"] for t in s["per_turn"]] == [0, 1, 2]
            else:
                assert lengths["mismatched"] == 0 and s["warnings"] == []


def test_without_a_tokenizer_the_report_says_estimates():
    with our_server() as url:
        _, s = asyncio.run(run(url, Workload(qps=50.0, input=Lengths(20), output=Lengths(2)), 3))
    assert not s["prompt_lengths"]["exact"] and "estimates" in s["prompt_lengths"]["note"]


def test_mooncake_trace_keeps_its_times_and_hits_the_prefix_cache(tmp_path):
    rows = [json.loads(x) for x in Path(MOONCAKE).read_text().splitlines()[:120]]
    trace = tmp_path / "mc.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    speedup = 4.0
    with our_server(slots=16) as url:
        hits0 = metric(url, "scaletui:prefix_cache_hits_total")
        w = Workload(trace=str(trace), trace_block=16, trace_speedup=speedup, seed=2)
        records, s = asyncio.run(run(url, w, len(rows)))
        hits = metric(url, "scaletui:prefix_cache_hits_total") - hits0
        out = tmp_path / "mc.json"
        args = ["--url", url, "--trace", str(trace), "--trace-block-size", "16", "--quiet"]
        assert main([*args, "--trace-speedup", "8", "--num-requests", "40", "--out", str(out)]) == 0
    result = orjson.loads(out.read_bytes())  # the result JSON has the server's counts too
    before, after = result["server_stats_before"], result["server_stats_after"]
    assert after["kv_pages"]["prefix_cache_hits"] > before["kv_pages"]["prefix_cache_hits"]
    assert result["sent"] == 40 and result["config"]["workload"]["trace_block"] == 16
    assert s["completed"] == len(rows)
    t0 = min(r.t_sched for r in records)
    intended = [(x["timestamp"] - rows[0]["timestamp"]) / 1e3 / speedup for x in rows]
    assert [r.t_sched - t0 for r in records] == pytest.approx(intended, abs=1e-6)
    assert s["median_schedule_delay_ms"] < 5  # the p99 is the bench's: this box is shared
    assert [r.input_len for r in records] == [x["input_length"] for x in rows]
    assert [r.max_tokens for r in records] == [x["output_length"] for x in rows]
    assert hits > 16 * 20  # whole 16-token pages of shared documents were reused


def test_tokenizer_server_without_tokenize_is_an_error_before_any_request(capsys):
    with our_server() as url:
        args = ["--url", url, "--qps", "5", "--num-requests", "2", "--tokenizer", "server"]
        assert main(args) == 2
        assert metric(url, "scaletui:prompt_tokens_total") == 0
    err = capsys.readouterr().err
    assert "/tokenize answered HTTP 404" in err and "--tokenizer PATH" in err


def test_tokenizer_server_counts_with_the_servers_tokenize(tmp_path):
    tok = make_tokenizer(tmp_path)
    out = tmp_path / "r.jsonl"
    with our_server(tok, tokenize=True) as url:
        args = ["--url", url, "--qps", "50", "--num-requests", "6", "--tokenizer", "server"]
        args += ["--input-len", "40", "--input-dist", "uniform", "--input-spread", "20"]
        assert main([*args, "--output-len", "3", "--turns", "2", "--save-requests", str(out)]) == 0
    rows = load_requests(str(out))
    assert len(rows) == 12 and len({r["input_len"] for r in rows}) > 2
    assert all(r["prompt_tokens"] == r["input_len"] for r in rows)
