"""Every bench/*.py and bench/*.sh on the code path of its default options, shrunk: with
SCALETUI_BENCH_SMOKE=1 (bench/_smoke.py) each picks the `tiny` model and a short sweep. A test
fails on an exception or an exit status that is not the bench's verdict. What needs a peer (vLLM)
or a GPU runs the part that does not and skips the rest, saying why.

Benches run in this process through their `main(argv)` where that is cheaper than a subprocess
(imports and compiled programs are shared), in a subprocess where a bench pins its CPU, sets
signal handlers or runs an app. Outputs go to a temporary directory. The longest, the TUI's
first screen (the app calibrates the host, starts a server and fits it), starts as the module
begins and runs beside the others; its test, near the end, waits for it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from bench_modules import BENCH_DIR, bench_module

from scaletui import policy

pytestmark = [
    pytest.mark.slow,  # they build engines and start servers
    pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning"),
    pytest.mark.xdist_group("bench-smoke"),  # one worker: the TUI's first screen runs once
]

SMOKE = "SCALETUI_BENCH_SMOKE"
# a `scaletui calibrate` result of the 2-vCPU test box, rounded (any plausible roofs will do)
LOCAL_SPEC = """\
name: local
kind: cpu
flops_per_s: {f32: 2.0e+11, bf16: 3.5e+11}
hbm_bytes: 2.5e+10
hbm_bw: 2.8e+10
ici_bw: 2.8e+10
ici_bidirectional: false
dcn_bw: 2.8e+10
chips_per_host: 1
"""


@pytest.fixture
def smoke(monkeypatch, tmp_path) -> Path:
    """The smoke variable set, the working directory a temporary one (for benches that write
    beside them by default); that directory."""
    monkeypatch.setenv(SMOKE, "1")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="module", autouse=True)
def tui_run(request, tmp_path_factory):
    """bench/tui_first_screen.py in the background from the start, when its test is selected:
    (the process, its directory), stopped at the end if still running."""
    if "test_tui_first_screen" not in {item.name for item in request.session.items}:
        yield None
        return
    tmp = tmp_path_factory.mktemp("tui-first-screen")
    env = {**os.environ, SMOKE: "1", "TMPDIR": str(tmp)}
    # a host calibrated and fitted already (the app's first-start calibration is test_tui_app's
    # and test_calibrate's, the fit test_engine_fit's; here they would be most of the bench's
    # CPU time): the app finds the fit, starts its server, loads it and shows the three columns
    hardware = tmp / "config" / "scaletui" / "hardware"
    hardware.mkdir(parents=True)
    (hardware / "local.yaml").write_text(LOCAL_SPEC)
    _store_tiny_fits(hardware / "local.yaml", hardware / "fits")
    cmd = [sys.executable, str(BENCH_DIR / "tui_first_screen.py"), "--json", "--log-dir", "logs"]
    cmd += ["--config-dir", str(tmp / "config")]
    with open(tmp / "stdout", "w") as out, open(tmp / "stderr", "w") as err:
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=out, stderr=err)
    yield proc, tmp
    if proc.poll() is None:
        proc.terminate()  # it stops the app's children on SIGTERM
        proc.wait(60)


def _store_tiny_fits(spec: Path, folder: Path) -> None:
    """Stored fits of `tiny` at tp 1 on `spec`'s roofs, for each precision and kernels the
    app's server can start with (its default dtype depends on the CPU)."""
    import dataclasses

    from scaletui.roofline.costmodel import CostModel
    from scaletui.roofline.fitstore import fit_path, save_fit
    from scaletui.specs import load_hardware, load_model

    local = load_hardware(spec)
    for dtype in ("f32", "bf16"):
        for kernels in ("native", "xla"):
            cost = CostModel.assumed(load_model("tiny"), local, dtype=dtype, kernels=kernels,
                                     efficiency=0.3, overhead_s=1e-3)  # fmt: skip
            path = folder / fit_path("tiny", dtype, kernels, 1, 1).name
            save_fit(dataclasses.replace(cost, source="fit"), path)


def _main(name: str, argv: list[str]) -> int:
    with bench_module(name) as bench:
        return bench.main(argv)


def _run(cmd: list[str], tmp: Path, timeout: float, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, SMOKE: "1", "OUT": str(tmp / "out"), **env}
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return proc


def _script(name: str, tmp: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return _run([sys.executable, str(BENCH_DIR / f"{name}.py"), *args], tmp, timeout)


# -- in this process ------------------------------------------------------------------------------


def test_decode_roofline_defaults_print_a_row_per_batch_with_its_floor(smoke, capsys):
    """The README's command (`--json`, every other option at its default): the weights-only
    floor runs on the engine's own layout (the native kernels' packed params have no `embed`
    table for a tied model, and none of weights.py's names)."""
    assert _main("decode_roofline", ["--json"]) == 0
    result = orjson.loads(capsys.readouterr().out)
    assert result["meta"]["complete"] and result["meta"]["model"] == "tiny"
    assert [r["batch"] for r in result["decode"]] == [1]
    assert all(r["floor_ms"] > 0 for r in result["decode"])
    assert [r["prompt_len"] for r in result["prefill"]] == [16]
    # the kernel path that ran, as /stats names it: the dense layout only on the native kernels
    kernels, dense = result["meta"]["kernels"], result["meta"]["kernels_dense"]
    assert dense.startswith("f32 panels x") if kernels == "native" else dense is None


def test_the_weights_only_floor_runs_on_every_op_set(tiny):
    """weights_floor over each engine's own params: native (packed, fused, tied or not), XLA."""
    import dataclasses

    import jax

    from scaletui.serve.engine import native
    from scaletui.serve.engine.build import build_engines
    from scaletui.shape import ServerShape

    m, params = tiny
    kernels = ["xla", "native"] if native.available() else ["xla"]
    with bench_module("_decode_roofline") as bench:
        for tied in (False, True):
            spec = dataclasses.replace(m, tied_embeddings=tied)
            p = {k: v for k, v in params.items() if not (tied and k == "lm_head")}
            for k in kernels:
                cfg = ServerShape(spec, slots=2, max_seq_len=32, kernels=k)
                eng, _ = build_engines(cfg, jax.devices()[:1], host_params=p)
                assert eng.kernels == k
                assert bench.weights_floor(eng, 2, 2, 1, 1) > 0


def test_greedy_check(smoke):
    assert _main("greedy_check", ["--json-out", str(smoke / "greedy.json")]) == 0
    assert orjson.loads((smoke / "greedy.json").read_bytes())["model"] == "tiny"


def test_ragged_check(smoke):
    out = smoke / "ragged.json"
    argv = ["--model", "tiny", "--interpret", "--rows", "3", "--chunk", "20", "--context", "32",
            "--calls", "1", "--json-out", str(out)]  # fmt: skip
    assert _main("ragged_check", argv) == 0
    result = orjson.loads(out.read_bytes())
    assert result["ok"] and result["max_abs_error"] < 3e-2 and result["kernel_ms"] > 0


def test_sim_noise(smoke, capsys):
    """A fit whose calls vary 0.5x-1.5x: the median TTFT moves over the draws, by run length."""
    from test_serve_speed import fake_fit

    from scaletui.roofline.fitstore import save_fit

    fit = save_fit(fake_fit(spread=(0.5, 1.0, 1.5)), smoke / "fit.yaml")
    argv = ["--fit", str(fit), "--model", "tiny", "--slots", "2", "--max-seq-len", "256",
            "--requests", "8", "--arrivals", "1", "--draws", "4", "--", "--qps", "50",
            "--input-len", "32", "--output-len", "8", "--prompt-format", "ids"]  # fmt: skip
    assert _main("sim_noise", argv) == 0
    row = capsys.readouterr().out.splitlines()[-1].split()
    assert row[0] == "8" and row[2] != "[+0%,+0%]"  # the draws moved the median TTFT


def test_prefill_paths(smoke):
    assert _main("prefill_paths", ["--json-out", str(smoke / "paths.json")]) == 0
    assert orjson.loads((smoke / "paths.json").read_bytes())["paths_agree"] == [True]


def test_precision_agreement(smoke):
    assert _main("precision_agreement", ["--json-out", str(smoke / "precision.json")]) == 0
    result = orjson.loads((smoke / "precision.json").read_bytes())
    assert set(result["variants"]) == {"f32", "bf16"}
    assert result["variants"]["f32"]["agreement"] == 1.0  # the control: f32 against f32


def test_dense_kernels(smoke):
    from scaletui.serve.engine import native

    if not native.available():
        pytest.skip(f"no native kernels here: {native.unavailable_reason()}")
    assert _main("dense_kernels", []) == 0


def test_decode_attention(smoke, capsys):
    from scaletui.serve.engine import native

    if not native.available():
        pytest.skip(f"no native kernels here: {native.unavailable_reason()}")
    assert _main("decode_attention", []) == 0
    out = capsys.readouterr().out.splitlines()  # other lines (a kernel build's log) may come too
    header = next(i for i, line in enumerate(out) if line.split()[:2] == ["batch", "context"])
    row = out[header + 1].split()  # the one point: batch 2, context 20
    assert row[:2] == ["2", "20"] and len(row) == 5
    # ms/layer and the floor's ms measured and priced (floor / ms, two decimals, may read 0.00)
    assert float(row[2]) > 0 and float(row[3]) > 0


def test_calibrate_check(smoke, capsys):
    assert _main("calibrate_check", []) in (0, 1)  # 1: a check missed (small sizes: noise)
    out = capsys.readouterr().out
    assert "hbm_bw / numpy copy" in out and "engine batch-1 decode read (tiny" in out


def test_serving(smoke, capsys):
    assert _main("serving", ["--json"]) == 0
    result = orjson.loads(capsys.readouterr().out)
    assert result["model"] == "tiny" and set(result["rows"]) == {"1", "2"}


def test_paged_kv(smoke, capsys):
    assert _main("paged_kv", ["--json"]) == 0
    lines = [orjson.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["scenario"] for r in lines] == ["prefix", "budget", "memory"]


def test_mixed_batches(smoke, capsys):
    assert _main("mixed_batches", ["--json", "--one-piece"]) == 0
    result = orjson.loads(capsys.readouterr().out)
    assert set(result["ttft_p99_ms"]) == {"off", "on"} and result["ttft_p99_ratio"] > 0
    assert result["piece_ms"] > 0  # the off run's pieces were timed
    assert result["one_piece"]["tok_s"] > 0 and result["tok_s"]["on"] > 0
    assert policy.MIX_PIECES == 4  # put back after the one-piece run


def test_logprobs_cost(smoke, capsys):
    assert _main("logprobs_cost", ["--json"]) == 0
    result = orjson.loads(capsys.readouterr().out)
    assert set(result["step_ms"]) == {"none", "one", "all"} and result["conditionals"] >= 1


def test_fidelity(smoke, capsys):
    assert _main("fidelity", ["--json", "--out", str(smoke / "fidelity.jsonl")]) == 0
    lines = [orjson.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines[-1]["kind"] == "summary"
    assert {p["kind"] for p in lines[:-1]} >= {"decode", "serving"}


def test_peer_vllm_our_side_and_the_report(smoke, capsys):
    """Parsing and the report with made-up vLLM runs before and after ours; our server's side
    where the peers' scripts are (they build the shared model directory): its rows name the
    kernels /stats says ran; vLLM itself is not run."""
    with bench_module("peer_vllm") as bench:
        args = bench.parse([])
        assert (args.shape, args.precisions, args.concurrency) == ("tiny", ["f32"], [1])
        assert args.ttft_lens == [16]
        summary = {"median_tpot_ms": 2.0, "output_throughput": 100.0, "median_ttft_ms": 9.0}
        before = bench.Measured("vllm", "bf16", "tiny-llama", {1: summary}, {16: summary})
        after = bench.Measured("vllm", "bf16", "tiny-llama", {1: {**summary,
                               "median_tpot_ms": 6.0}}, {16: summary})  # fmt: skip
        ours = bench.Measured("ours", "f32", "tiny", {1: {**summary, "median_tpot_ms": 8.0}}, {})
        rows = bench.rows([before, after], [ours], "tiny", 16)
        tpot = next(r for r in rows if r["metric"] == "tpot_ms")
        assert (tpot["ratio"], tpot["ratio_runs"], tpot["vllm_drift"]) == (2.0, [4.0, 4 / 3], 2.0)
        assert next(r for r in rows if r["metric"] == "ttft_ms")["ratio"] is None
        assert "+200%" in bench.table(rows)
        try:
            bench.peers_dir()
        except bench.BenchError as exc:
            pytest.skip(f"our side needs the peers' model directory: {exc}")
        vllm_root = smoke / "peers"
        assert bench.main(["--skip-vllm", "--json", "--vllm-root", str(vllm_root)]) == 0
    rows = [orjson.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(r["metric"], r["streams"], r["prompt_len"]) for r in rows] == [
        ("tpot_ms", 1, 16), ("tok_s", 1, 16), ("ttft_ms", None, 16)]  # fmt: skip
    assert all(r["shape"] == "tiny" and r["ours"] > 0 and r["vllm"] == [] for r in rows)
    assert rows[0]["kernels_running"] in ("native", "xla")  # from our server's /stats
    assert (rows[0]["kernels_dense"] is None) == (rows[0]["kernels_running"] == "xla")


def test_loadgen_agreement_report_of_a_recorded_run(smoke, capsys):
    """The table from a kept run (tests/fixtures/make_loadgen_agreement.sh recorded it with
    the real clients); the run itself needs aiperf, guidellm and minutes, not done here."""
    kept = Path(__file__).parent / "fixtures" / "loadgen_agreement"
    code = _main("loadgen_agreement", ["--report", str(kept), "--json"])
    rows = [orjson.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["client"] for r in rows] == ["loadgen", "aiperf", "guidellm"]
    assert code == (0 if all(r["ttft_ok"] and r["itl_ok"] for r in rows) else 1)


def test_peer_vllm_vllm_side():
    pytest.skip(
        "vLLM's side needs vLLM installed and minutes; not run in the suite (its smoke "
        "run by hand: bench/peer_vllm.py --shape tiny --quick)"
    )


# -- in a subprocess ------------------------------------------------------------------------------


def test_loadgen_overhead(tmp_path):
    """A subprocess: it pins itself to one core."""
    proc = _script("loadgen_overhead", tmp_path, "--json", str(tmp_path / "o.json"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert orjson.loads((tmp_path / "o.json").read_bytes())["stages"]


def test_multihost_wire(tmp_path):
    """Two processes on jax.distributed (gloo): each channel's cost per pass is printed."""
    proc = _script("multihost_wire", tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("median") >= 2, proc.stdout


def test_loadgen_workers(tmp_path):
    """A subprocess: it starts a server and `loadgen --workers` processes."""
    proc = _script("loadgen_workers", tmp_path, "--json", str(tmp_path / "w.json"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = orjson.loads((tmp_path / "w.json").read_bytes())["stages"]
    assert [r["workers"] for r in rows] == [1, 2] and len(rows[1]["per_worker"]) == 2


def test_accelerator_serving(tmp_path):
    """A subprocess: its SIGTERM handler stays set."""
    out = tmp_path / "serving.json"
    proc = _script("accelerator_serving", tmp_path, "--out", str(out), timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = orjson.loads(out.read_bytes())["runs"]
    assert [r["exit"] for r in runs] == [0, 0]  # one closed loop, one Poisson run


def test_tui_first_screen(tui_run):
    """A subprocess (the `tui_run` fixture's): the real app, its children and signal handlers."""
    proc, tmp = tui_run
    rc = proc.wait(280)
    stdout, stderr = (tmp / "stdout").read_text(), (tmp / "stderr").read_text()
    # 1: a KPI missed its 1.3x, which tiny's sub-ms steps in seconds of samples do; 2: an error
    assert rc in (0, 1) and "Traceback" not in stderr, stdout[-2000:] + stderr[-3000:]
    doc = orjson.loads(stdout)
    assert doc["model"] == "tiny" and [t["tp"] for t in doc["tp"]] == [1]
    assert not doc["tp"][0]["error"] and doc["tp"][0]["kpis"]
    logs = tmp / "logs" / "tp1"  # the stored calibration and fit were used
    assert not (logs / "fit.log").exists() and not (logs / "calibrate.log").exists()


# -- the scripts ----------------------------------------------------------------------------------


def test_accelerator_run_dry_run_runs_its_stages_here(tmp_path):
    """The kit's dry run with this interpreter (no Python 3.12 env, so no wheels to install):
    the wheels and env stages; the other stages are each a bench tested above. Its real run
    needs a GPU host."""
    kit = ["bash", str(BENCH_DIR / "accelerator_run.sh"), "--dry-run", "--only", "none"]
    proc = _run(kit, tmp_path, 180, PYTHON=sys.executable)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "imports: all ok" in proc.stdout
    summary = (tmp_path / "out" / "summary.txt").read_text().split()
    assert summary[:2] == ["wheels", "ok"] and "env" in summary


@pytest.mark.parametrize("script", ["h200_decode.sh", "tpu_decode.sh"])
def test_the_decode_scripts_plan_their_stages(script, tmp_path):
    """They run the kit's decode stages on a GPU or TPU host: here, their plan (the kit's own
    dry run is tested above)."""
    proc = _run(["bash", str(BENCH_DIR / script), "--plan", "--dry-run"], tmp_path, 30)
    assert proc.returncode == 0, proc.stderr
    stages = [line.split()[0] for line in proc.stdout.splitlines()]
    assert stages == ["wheels", "env", "calibrate", "decode-f32", "decode", "decode-int8", "total"]
    assert "--model tiny" in proc.stdout


def test_fetch_gpu_wheels_with_a_stand_in_for_the_registry(tmp_path):
    """Nothing is downloaded: pip is a stand-in that writes empty wheels."""
    from test_accelerator_kit import FAKE_PY312

    fake = tmp_path / "python3"
    fake.write_text(FAKE_PY312)
    fake.chmod(0o755)
    (tmp_path / "log").touch()
    env = {"PYTHON": str(fake), "DEST": str(tmp_path / "whl"), "FAKE_LOG": str(tmp_path / "log")}
    proc = _run(["bash", str(BENCH_DIR / "fetch_gpu_wheels.sh")], tmp_path, 30, **env)
    assert proc.returncode == 0, proc.stderr
    assert len(list((tmp_path / "whl").glob("*.whl"))) == 7


# -- every bench has its smoke run ----------------------------------------------------------------


def test_every_bench_and_script_has_a_smoke_run():
    tested = {name.removeprefix("test_") for name in globals() if name.startswith("test_")}
    text = Path(__file__).read_text()
    benches = sorted(p.stem for p in BENCH_DIR.glob("[!_]*.py"))
    scripts = sorted(p.name for p in BENCH_DIR.glob("*.sh"))
    # accelerator_check.py is the kit's env stage, run by the dry run above
    missing = [
        b for b in benches if b != "accelerator_check" and not any(t.startswith(b) for t in tested)
    ]
    assert not missing, f"benches without a smoke run: {missing}"
    assert not [s for s in scripts if s not in text], "scripts without a smoke run"
