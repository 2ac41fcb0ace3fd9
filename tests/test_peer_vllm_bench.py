"""bench/peer_vllm.py without vLLM: the flags, the rows and ratios on hand-made loadgen summaries,
the shape check of the llama-1b spec, and the errors a missing install or peers folder gives."""

from __future__ import annotations

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
    assert (args.shape, args.precisions, args.concurrency) == ("1b", ["f32", "bf16", "int8"],
                                                              [1, 4, 16])  # fmt: skip
    assert (args.input_len, args.output_len, args.ttft_len) == (128, 128, 128)
    quick = bench.parse(["--shape", "tiny", "--quick", "--concurrency", "2"])
    assert quick.concurrency == [2]  # given on the command line: it wins over --quick
    assert (quick.requests_per_stream, quick.output_len, quick.ttft_requests) == (2, 32, 3)
    assert bench.parse(["--vllm-args", "--max-num-seqs 32"]).vllm_args == ["--max-num-seqs", "32"]


@pytest.mark.parametrize(
    "argv",
    [["--skip-vllm", "--skip-ours"], ["--concurrency", "0"], ["--output-len", "1"],
     ["--precisions", "fp8"], ["--shape", "7b"]],
)  # fmt: skip
def test_bad_flags_exit_with_usage(bench, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse(argv)
    assert exc.value.code == 2


def _summary(tpot: float, tok_s: float, ttft: float = 0.0) -> dict:
    return {"median_tpot_ms": tpot, "output_throughput": tok_s, "median_ttft_ms": ttft}


def test_rows_pair_each_precision_and_concurrency_with_vllm(bench):
    vllm = bench.Measured("vllm", "bf16", "tiny-llama", {1: _summary(2.0, 500.0),
                          4: _summary(5.0, 800.0)}, _summary(0, 0, ttft=10.0))  # fmt: skip
    f32 = bench.Measured("ours", "f32", "tiny-llama", {1: _summary(4.0, 250.0),
                         4: _summary(5.0, 1000.0)}, _summary(0, 0, ttft=30.0))  # fmt: skip
    int8 = bench.Measured("ours", "int8", "tiny-llama", {1: _summary(1.0, 1000.0)}, None)
    rows = bench.rows(vllm, [f32, int8], "tiny")
    assert [(r["precision"], r["concurrency"]) for r in rows] == [
        ("f32", 1), ("f32", 4), ("int8", 1), ("int8", 4)]  # fmt: skip
    r = rows[0]
    assert (r["ours_tpot_ms"], r["vllm_tpot_ms"], r["tpot_ms_ratio"]) == (4.0, 2.0, 2.0)
    assert (r["ours_tok_s"], r["vllm_tok_s"], r["tok_s_ratio"]) == (250.0, 500.0, 0.5)
    assert (r["ours_ttft128_ms"], r["vllm_ttft128_ms"], r["ttft128_ratio"]) == (30.0, 10.0, 3.0)
    assert rows[1]["tok_s_ratio"] == 1.25 and rows[1]["tpot_ms_ratio"] == 1.0
    assert rows[2]["ttft128_ratio"] is None  # no TTFT run of ours
    assert rows[3]["ours_tpot_ms"] is None and rows[3]["tpot_ms_ratio"] is None  # c=4 not run
    text = bench.table(rows)
    assert "2.00" in text.splitlines()[2] and "1.25" in text.splitlines()[3]


def test_rows_of_one_side_only(bench):
    vllm = bench.Measured("vllm", "bf16", "m", {1: _summary(2.0, 500.0)}, None)
    (only_vllm,) = bench.rows(vllm, [], "1b")
    assert only_vllm["precision"] is None and only_vllm["vllm_tok_s"] == 500.0
    assert only_vllm["tok_s_ratio"] is None
    (only_ours,) = bench.rows(None, [bench.Measured("ours", "f32", "m", {1: _summary(3, 9)}, None)],
                              "1b")  # fmt: skip
    assert only_ours["ours_tpot_ms"] == 3 and only_ours["vllm_tpot_ms"] is None


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
