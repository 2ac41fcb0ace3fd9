"""bench/peer_vllm.py without vLLM: the flags, the rows and ratios on hand-made loadgen summaries,
the shape check of the llama-1b spec, and the errors a missing install or peers folder gives."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from bench_modules import bench_module

from scaletui.specs import load_model

BENCH = Path(__file__).resolve().parents[1] / "bench" / "peer_vllm.py"
# make_tiny_llama.py --shape 1b's config.json, the keys the spec is made from
PEERS_1B = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192,
            "vocab_size": 32000, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": False}  # fmt: skip


@pytest.fixture(scope="module")
def bench():
    with bench_module("peer_vllm") as module:
        yield module


def test_defaults_and_quick(bench):
    args = bench.parse([])
    assert (args.shape, args.precisions, args.concurrency) == ("1b", ["bf16"], [1, 4, 16, 64])
    assert (args.input_len, args.output_len, args.ttft_lens) == (128, 128, [128, 512, 2048])
    quick = bench.parse(["--shape", "tiny", "--quick", "--concurrency", "2"])
    assert quick.concurrency == [2]  # given on the command line: it wins over --quick
    assert (quick.requests_per_stream, quick.output_len, quick.ttft_requests) == (2, 32, 3)
    assert quick.ttft_lens == [128]
    assert bench.parse(["--vllm-args", "--max-num-seqs 32"]).vllm_args == ["--max-num-seqs", "32"]
    assert bench.parse(["--ttft-len", "64"]).ttft_lens == [64]  # the old flag's spelling


@pytest.mark.parametrize(
    "argv",
    [["--skip-vllm", "--skip-ours"], ["--concurrency", "0"], ["--output-len", "1"],
     ["--precisions", "fp8"], ["--shape", "7b"], ["--ttft-lens", "128", "0"]],
)  # fmt: skip
def test_bad_flags_exit_with_usage(bench, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse(argv)
    assert exc.value.code == 2


def _summary(tpot: float | None = None, tok_s: float | None = None, ttft: float = 0.0) -> dict:
    return {"median_tpot_ms": tpot, "output_throughput": tok_s, "median_ttft_ms": ttft}


def _by(rows: list[dict], precision: str | None, metric: str, at: int) -> dict:
    (row,) = [r for r in rows if r["precision"] == precision and r["metric"] == metric
              and (r["streams"] or r["prompt_len"]) == at]  # fmt: skip
    return row


def test_rows_bracket_ours_with_two_vllm_runs(bench):
    """Each figure: ours / the mean of vLLM's runs, ours / each run, and the second run's drift
    from the first; the kernels ours ran on each of its rows."""
    vllm1 = bench.Measured("vllm", "bf16", "tiny-llama", {1: _summary(2.0, 500.0),
                           4: _summary(5.0, 800.0)}, {128: _summary(ttft=10.0),
                           512: _summary(ttft=40.0)})  # fmt: skip
    vllm2 = bench.Measured("vllm", "bf16", "tiny-llama", {1: _summary(3.0, 300.0),
                           4: _summary(5.0, 800.0)}, {128: _summary(ttft=30.0),
                           512: _summary(ttft=40.0)})  # fmt: skip
    kernels = {"kernels_running": "native", "kernels_dense": "f32 panels x64, f32 products",
               "kernels_note": None}  # fmt: skip
    f32 = bench.Measured("ours", "f32", "tiny-llama", {1: _summary(4.0, 250.0),
                         4: _summary(5.0, 1000.0)}, {128: _summary(ttft=30.0)},
                         kernels)  # fmt: skip
    int8 = bench.Measured("ours", "int8", "tiny-llama", {1: _summary(1.0, 1000.0)}, {})
    rows = bench.rows([vllm1, vllm2], [f32, int8], "tiny", 128)
    # per precision: TPOT and tok/s at 1 and 4 streams, TTFT at 128 and 512 tokens
    assert len(rows) == 2 * (2 + 2 + 2)
    tpot = _by(rows, "f32", "tpot_ms", 1)
    assert (tpot["ours"], tpot["vllm"], tpot["vllm_mean"]) == (4.0, [2.0, 3.0], 2.5)
    assert tpot["ratio"] == 1.6 and tpot["ratio_runs"] == pytest.approx([2.0, 4 / 3])
    assert tpot["vllm_drift"] == pytest.approx(0.5)  # vLLM's 2nd run 50% slower than its 1st
    assert (tpot["streams"], tpot["prompt_len"], tpot["vllm_runs"]) == (1, 128, 2)
    assert (tpot["kernels_running"], tpot["kernels_dense"]) == ("native", kernels["kernels_dense"])
    tok = _by(rows, "f32", "tok_s", 1)
    assert tok["ratio"] == 0.625 and tok["ratio_runs"] == pytest.approx([0.5, 250 / 300])
    assert tok["vllm_drift"] == pytest.approx(-0.4)
    assert _by(rows, "f32", "tok_s", 4)["ratio"] == 1.25 and _by(rows, "f32", "tok_s", 4)[
        "vllm_drift"] == 0  # fmt: skip
    ttft = _by(rows, "f32", "ttft_ms", 128)
    assert (ttft["streams"], ttft["ratio"], ttft["ratio_runs"]) == (None, 1.5, [3.0, 1.0])
    assert _by(rows, "f32", "ttft_ms", 512)["ours"] is None  # vLLM's alone: no ratio
    assert _by(rows, "f32", "ttft_ms", 512)["ratio"] is None
    gap = _by(rows, "int8", "tpot_ms", 4)  # not run by ours
    assert gap["ours"] is None and gap["ratio_runs"] == [None, None]
    assert _by(rows, "int8", "tpot_ms", 1)["kernels_running"] is None  # no /stats read
    text = bench.table(rows)
    head, *lines = text.splitlines()
    assert "vLLM 1st" in head and "vLLM 2nd" in head and "drift" in head
    first = lines[0].split()
    assert first[:4] == ["f32", "TPOT", "p50", "ms"] and first[-4:] == [
        "1.60", "2.00", "1.33", "+50%"]  # fmt: skip
    assert lines[-1] == "ours f32: native kernels, dense f32 panels x64, f32 products"
    assert "2nd" in bench.legend(2) and bench.legend(0) == "no vLLM run: no ratios"


def test_rows_of_one_side_only(bench):
    vllm = bench.Measured("vllm", "bf16", "m", {1: _summary(2.0, 500.0)}, {})
    only_vllm = bench.rows([vllm], [], "1b", 128)
    assert [r["metric"] for r in only_vllm] == ["tpot_ms", "tok_s"]
    assert only_vllm[1]["precision"] is None and only_vllm[1]["vllm"] == [500.0]
    assert only_vllm[1]["ratio"] is None and only_vllm[1]["vllm_drift"] is None
    ours = bench.Measured("ours", "f32", "m", {1: _summary(3, 9)}, {})
    only_ours = bench.rows([], [ours], "1b", 128)
    assert only_ours[0]["ours"] == 3 and only_ours[0]["vllm"] == []
    assert only_ours[0]["ratio"] is None and only_ours[0]["ratio_runs"] == []
    text = bench.table(only_ours)  # no vLLM columns at all
    assert "vLLM" not in text and "ratio" not in text and "9.0" in text
    one_run = bench.rows([vllm], [ours], "1b", 128)  # --skip-ours is the only one-run case,
    assert one_run[0]["ratio"] == 1.5 and one_run[0]["vllm_drift"] is None  # but rows take it


def test_both_servers_hold_the_longest_ttft_prompt_and_ours_sizes_its_pool(bench):
    """A 2048-token TTFT prompt and its 2 tokens: 2,112 tokens (whole 64-token pages) on both;
    our pool holds the widest loop's streams (not slots x max_seq_len)."""
    args = bench.parse(["--shape", "1b"])
    assert bench.max_len(args) == 2112
    # 64 streams x 4 pages (128 + 128 tokens) + a page per slot to spare + the scratch page
    assert bench.kv_pages(args) == ["--kv-pages", str(64 * 4 + 64 + 1)]
    args = bench.parse(["--serve-args", "--page-size 16", "--concurrency", "1"])
    assert bench.kv_pages(args) == ["--kv-pages", str(-(-2050 // 16) + 1 + 1)]  # the TTFT prompt
    assert bench.kv_pages(bench.parse(["--serve-args", "--kv-pages 99"])) == []
    short = bench.parse(["--ttft-lens", "128", "--output-len", "64"])
    assert bench.max_len(short) == 192


def test_ours_gets_a_longer_spec_only_where_the_bench_needs_it(bench, tmp_path):
    import orjson

    model = tmp_path / "llama-1b"
    model.mkdir()
    (model / "config.json").write_bytes(orjson.dumps({**PEERS_1B, "max_position_embeddings": 4096}))
    short = bench.parse(["--ttft-lens", "128"])
    assert bench.our_spec(short, model, tmp_path) == "llama-1b"  # the shipped spec
    spec = bench.our_spec(bench.parse([]), model, tmp_path)  # 2048-token TTFT prompts
    assert spec.endswith(".yaml")
    made = load_model(spec)
    assert made.name == "llama-1b" and made.max_seq_len == 2112
    assert bench.shape_mismatches(made, bench.spec_from_config(PEERS_1B, "x", 2048)) == []


def test_vllm_runs_before_and_after_ours_on_fresh_servers(bench, monkeypatch, tmp_path):
    """The bracket: vLLM, every precision of ours, vLLM again (a server started anew); with
    --skip-ours one vLLM run, with --skip-vllm none."""
    order = []

    @contextlib.contextmanager
    def vllm_server(args, scripts, model):
        order.append("start")
        yield "http://vllm"
        order.append("stop")

    def measure(run, precision, url, args, work, expect):
        order.append(run)
        return bench.Measured(run.split("-")[0], precision, expect, {1: _summary(2.0, 9.0)}, {})

    def measure_ours(args, model, work):
        return [measure(f"ours-{p}", p, "http://ours", args, work, "m") for p in args.precisions]

    for name, fake in [("peers_dir", lambda: tmp_path), ("vllm_python", lambda *_: None),
                       ("model_dir", lambda *_: tmp_path / "m"), ("vllm_server", vllm_server),
                       ("measure", measure), ("measure_ours", measure_ours)]:  # fmt: skip
        monkeypatch.setattr(bench, name, fake)
    rows = bench.run(bench.parse(["--precisions", "bf16", "int8"]))
    assert order == ["start", "vllm-1", "stop", "ours-bf16", "ours-int8", "start", "vllm-2", "stop"]
    assert {r["vllm_runs"] for r in rows} == {2} and [r["precision"] for r in rows[::2]] == [
        "bf16", "int8"]  # fmt: skip
    order.clear()
    assert bench.run(bench.parse(["--skip-ours"]))[0]["vllm_runs"] == 1
    assert order == ["start", "vllm-1", "stop"]
    order.clear()
    assert bench.run(bench.parse(["--skip-vllm"]))[0]["vllm_runs"] == 0
    assert order == ["ours-bf16"]


def test_lengths_must_match_what_both_servers_counted(bench):
    ok = {"completed": 4, "failed": 0, "rejected": 0, "tokens_from_chunks": 0,
          "total_input_tokens": 4 * 128, "total_output_tokens": 4 * 32}  # fmt: skip
    bench.check_lengths(ok, 128, 32, "x")
    with pytest.raises(bench.BenchError, match="513 prompt"):  # a BOS added by one server
        bench.check_lengths({**ok, "total_input_tokens": 513}, 128, 32, "x")
    with pytest.raises(bench.BenchError, match="1 failed"):
        bench.check_lengths({**ok, "failed": 1, "errors": {"examples": {}}}, 128, 32, "x")


def test_llama_1b_spec_is_the_peers_shape(bench):
    want = bench.spec_from_config(PEERS_1B, "llama-1b", 2048)
    spec = load_model("llama-1b")
    assert bench.shape_mismatches(spec, want) == []
    assert spec.max_seq_len == 2048
    bad = bench.spec_from_config({**PEERS_1B, "intermediate_size": 5632}, "x", 2048)
    assert bench.shape_mismatches(spec, bad) == ["d_ff: 8192 != 5632"]


def test_missing_vllm_says_which_script_installs_it(bench, tmp_path, monkeypatch, capsys):
    scripts = tmp_path / "peers"
    scripts.mkdir()
    (scripts / "start_vllm.sh").write_text("")
    monkeypatch.setenv("PEERS_DIR", str(scripts))
    code = bench.main(["--shape", "tiny", "--vllm-root", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert code == 2
    assert "vLLM is not installed" in err and "install_vllm_cpu.sh" in err and "--skip-vllm" in err


def test_missing_peers_folder_names_the_env_override(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("PEERS_DIR", str(tmp_path / "no-peers"))
    with pytest.raises(bench.BenchError, match="set PEERS_DIR"):
        bench.peers_dir()
    default = BENCH.parents[2] / "shared" / "peers"  # beside the project root
    if (default / "start_vllm.sh").is_file():
        assert bench.peers_dir({}) == default
    else:  # a CI checkout without it
        with pytest.raises(bench.BenchError, match=str(default)):
            bench.peers_dir({})


def test_cpu_flags_read_from_cpuinfo(bench, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\nbugs\t: x\n")
    assert bench.cpu_flags(str(info)) == {"fpu", "avx2", "avx512_bf16"}
    assert bench.cpu_flags(str(tmp_path / "none")) == set()
