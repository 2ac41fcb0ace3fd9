"""`scaletui calibrate --quick` on the 8 virtual CPU devices: it writes a `local` spec that loads,
prints the same YAML on stdout with progress on stderr, and feeds an f32 roofline estimate; the
working-set rule and the bandwidth picker on a mocked cache listing and a mocked probe. Runs at
TINY sizes (a few MB), never the real 1 GiB stream. Speeds are not asserted
(bench/calibrate_check.py measures them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from scaletui import calibrate as cal
from scaletui import roofline
from scaletui.calibrate import Sizes, read, timing
from scaletui.calibrate import spread as spread_mod
from scaletui.commands.calibrate import main
from scaletui.serve.engine import native
from scaletui.specs import load_hardware, load_model, local_hardware_path

GiB = 1 << 30
# What the tests measure with: a 4 MB read stream, 2 MB copy, 64x128 matmuls.
TINY = Sizes(
    read_bytes=4 << 20,
    copy_bytes=2 << 20,
    d=64,
    f=128,
    thin_batches=(2, 8),
    prefill_t=32,
    allreduce_bytes=1 << 20,
    reps=2,
    dispatch_calls=5,
)


@pytest.fixture(autouse=True)
def _config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


@pytest.fixture
def tiny_sizes(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """`main` measures at TINY sizes; returns the `quick` flags it asked for."""
    asked: list[bool] = []

    def for_backend(backend: str, *, quick: bool = False, **_: object) -> Sizes:
        asked.append(quick)
        return TINY

    monkeypatch.setattr(cal.Sizes, "for_backend", staticmethod(for_backend))
    return asked


def _cache_listing(root: Path, caches: list[tuple[int, str]]) -> Path:
    """A fake /sys/devices/system/cpu/cpu0/cache: index<i>/{level,size}."""
    for i, (level, size) in enumerate(caches):
        (root / f"index{i}").mkdir(parents=True)
        (root / f"index{i}" / "level").write_text(f"{level}\n")
        (root / f"index{i}" / "size").write_text(f"{size}\n")
    return root


def test_llc_is_the_largest_cache_listed(tmp_path: Path) -> None:
    root = _cache_listing(tmp_path, [(1, "32K"), (1, "32K"), (2, "512K"), (3, "32768K")])
    assert cal.last_level_cache_bytes(root) == 32 << 20
    assert cal.last_level_cache_bytes(tmp_path / "missing") is None


@pytest.mark.parametrize(
    ("llc", "want"),
    [(32 << 20, GiB), (256 << 20, 2 * GiB), (None, GiB), (2 << 20, GiB)],
)
def test_working_set_is_past_the_cache(tmp_path: Path, llc: int | None, want: int) -> None:
    assert cal.read_working_set("cpu", llc) == want
    root = _cache_listing(tmp_path, [(2, "1M"), (3, f"{llc >> 10}K")] if llc else [])
    for quick in (False, True):  # --quick keeps the working set, times fewer runs
        sizes = Sizes.for_backend("cpu", quick=quick, cache_dir=root)
        assert sizes.read_bytes == want >= 8 * (llc or 0)
        assert min(sizes.read_points) >= 2 * (llc or 0)  # every curve point is past the LLC
    assert (
        Sizes.for_backend("cpu", quick=True, cache_dir=root).reps
        < Sizes.for_backend("cpu", cache_dir=root).reps
    )


def test_working_set_on_accelerators_is_2gib_capped_by_free_memory() -> None:
    assert cal.read_working_set("gpu", None) == 2 * GiB
    assert cal.read_working_set("tpu", None, free_bytes=64 * GiB) == 2 * GiB
    assert cal.read_working_set("gpu", None, free_bytes=GiB) == GiB // 2


def test_roofs_fall_as_the_working_set_leaves_the_cache() -> None:
    llc = 32 << 20
    # A mocked probe: in-cache sizes stream fast, then the curve falls to DRAM's plateau.
    probe = {1 << 20: 200e9, 8 << 20: 120e9, 32 << 20: 60e9, 256 << 20: 30e9, GiB: 29e9}
    probe[512 << 20] = 31e9
    curve = [{"bytes": b, "bw": probe[b]} for b in sorted(probe)]
    in_cache = [p["bw"] for p in curve if p["bytes"] <= llc]
    assert min(in_cache) > max(p["bw"] for p in curve if p["bytes"] > llc)  # it falls
    assert cal.pick_read_bw(curve, llc) == 30e9  # the median past 8x LLC, no in-cache figure
    assert cal.pick_read_bw(curve, None) == pytest.approx(45.5e9)  # unknown LLC: all points
    assert cal.pick_read_bw(curve[:3], llc) == 60e9  # nothing past: the largest size


@pytest.mark.timeout(120)
def test_calibrate_writes_a_loadable_local_spec(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_sizes: list[bool]
) -> None:
    import jax

    assert main(["--quick", "--window", "0.2"]) == 0
    assert tiny_sizes == [True]
    out = capsys.readouterr()
    path = local_hardware_path()
    assert path == tmp_path / "config" / "scaletui" / "hardware" / "local.yaml"
    assert yaml.safe_load(out.out) == yaml.safe_load(path.read_text())
    assert "[1/5] memory bandwidth" in out.err and f"wrote {path}" in out.err

    hw = load_hardware("local")
    n = len(jax.devices())
    assert (hw.name, hw.kind, hw.chips_per_host) == ("local", "cpu", n)
    assert hw.hbm_bw > 0 and hw.flops("f32") > 0 and hw.flops("bf16") > 0
    assert hw.hbm_bytes > 1e9  # host RAM on a CPU
    measured = hw.extra["measured"]
    # hbm_bw is the read stream's plateau; the copy (read + write) stays for reference.
    assert hw.hbm_bw == pytest.approx(measured["memory"]["bw"])
    assert measured["memory"]["working_set_bytes"] == TINY.read_points[-1]
    assert [p["bytes"] for p in measured["memory"]["curve"]] == TINY.read_points
    # read through XLA and, where it runs, the server's native kernel: the faster one counts
    curves = measured["memory"]["curves"]
    assert set(curves) == ({"xla", "native"} if native.available() else {"xla"})
    assert measured["memory"]["curve"] == curves[measured["memory"]["kernel"]]
    assert measured["memory_copy"]["bytes_moved"] == 2 * TINY.copy_bytes  # read + write
    for dtype in ("f32", "bf16"):  # flops_per_s is the prefill GEMM; thin ones beside it
        assert measured["matmul"][dtype]["shape"] == [TINY.prefill_t, TINY.d, TINY.f]
        assert hw.flops(dtype) == pytest.approx(measured["matmul"][dtype]["flops_per_s"])
        # on CPU the roof is the faster of XLA's matmul and the server's own native kernel
        ways = [measured["matmul_xla"][dtype], measured["matmul_native"].get(dtype)]
        ways = [w for w in ways if w is not None]
        assert len(ways) == 1 + native.available()
        assert hw.flops(dtype) == pytest.approx(max(w["flops_per_s"] for w in ways))
        assert all(w["shape"] == [TINY.prefill_t, TINY.d, TINY.f] for w in ways)
        assert set(measured["matmul_thin"][dtype]) == set(TINY.thin_batches)
        for b, thin in measured["matmul_thin"][dtype].items():
            assert thin["shape"] == [b, TINY.d, TINY.f] and thin["flops_per_s"] > 0
            assert f"[{b}, {TINY.d}] x [{TINY.d}, {TINY.f}] {dtype}" in thin["method"]
    assert 0 < measured["dispatch_s"] < 1
    assert "jit" in measured["dispatch_method"]
    # The host's spread over the window: p10 <= p50 <= p90 of each figure, and a verdict.
    spread = measured["spread"]
    for key in ("read_bw", "flops_per_s", "dispatch_s"):
        got = spread[key]
        assert 0 < got["p10"] <= got["p50"] <= got["p90"] and got["n"] >= 4  # 4 parts, >= 1 each
        assert len(spread["samples"][key]) == got["n"]
    assert isinstance(spread["noisy"], bool) and "p90 / p10 > 1.2" in spread["noisy_rule"]
    assert "spread over" in out.err and ("quiet" in out.err or "NOISY" in out.err)
    # Every figure says how it was measured.
    methods = hw.extra["methods"]
    assert str(TINY.read_points[-1]) in methods["hbm_bw"] and "read-only" in methods["hbm_bw"]
    assert f"[{TINY.prefill_t}, {TINY.d}]" in methods["flops_per_s"]["bf16"]
    assert all(m["method"] for m in (measured["memory"], measured["memory_copy"]))
    if n > 1:  # conftest gives 8 virtual devices: the all-reduce path runs
        assert measured["all_reduce"]["devices"] == n
        assert hw.ici_bw == pytest.approx(measured["all_reduce"]["bw"])
        assert hw.ici_latency_s > 0
        assert "psum" in methods["ici_bw"] and measured["all_reduce"]["method"]
    assert hw.dcn_bw == hw.ici_bw
    assert "date" in hw.extra

    # The server's CPU config predicts from it: f32 weights and KV, batch = slots.
    est = roofline.estimate(
        load_model("small"), hw, batch=4, chips=1, weight_bytes=4, kv_bytes=4, compute_dtype="f32"
    )
    assert est.decode_step_s > 0 and est.fits


@pytest.mark.timeout(120)
def test_calibrate_out_and_no_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_sizes: list[bool]
) -> None:
    assert main(["--quick", "--no-write", "--window", "0.2"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["name"] == "local"
    assert not local_hardware_path().exists()
    out = tmp_path / "elsewhere" / "mine.yaml"
    copy = tmp_path / "printed.yaml"
    copy.write_text(yaml.safe_dump(printed))
    assert load_hardware(copy).kind == "cpu"  # what --no-write prints is a valid spec too
    assert main(["--quick", "--out", str(out), "--window", "0.2"]) == 0
    assert load_hardware(out).name == "local"
    assert not local_hardware_path().exists()


@pytest.mark.timeout(120)
def test_calibrate_one_device_uses_memory_bandwidth_for_ici() -> None:
    import jax

    from scaletui.calibrate import calibrate

    spec = calibrate(sizes=TINY, devices=jax.devices()[:1], log=lambda msg: None, window_s=0.2)
    assert spec["measured"]["all_reduce"] is None
    assert spec["ici_bw"] == spec["hbm_bw"] == spec["dcn_bw"]
    assert "ici_latency_s" not in spec
    assert spec["chips_per_host"] == 1
    assert any("one device" in note for note in spec["notes"])


def test_a_roof_is_the_fastest_pass_so_a_slow_spell_costs_one_pass_of_each(monkeypatch):
    """Two figures timed round robin in 3 passes on a fake clock: the host runs 2x slow during
    the middle pass of `a` and the first of `b`; each figure is its fastest pass's median."""
    clock = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    calls = {"a": 0, "b": 0}
    # each name's cost per call, by pass (the warm-up call is pass 0)
    cost = {"a": [9.0, 1.0, 2.0, 1.0], "b": [9.0, 4.0, 2.0, 2.0]}
    runs_per_pass = 2  # reps 6 over 3 passes, no minimum time

    def timed(name):
        def run():
            n = calls[name]
            calls[name] += 1
            p = 0 if n == 0 else 1 + (n - 1) // runs_per_pass
            clock[0] += cost[name][p]

        return run

    got = timing._fastest_window({"a": timed("a"), "b": timed("b")}, windows=3, reps=6)
    assert got["a"][0] == 1.0 and got["a"][2] == [1.0, 2.0, 1.0]
    assert got["b"][0] == 2.0 and got["b"][2] == [4.0, 2.0, 2.0]
    assert len(got["a"][1]) == len(got["b"][1]) == 6  # every run kept, the warm-up left out


def test_read_stream_timed_between_other_work_is_judged_by_its_fastest_pass(monkeypatch):
    """`ReadStream` (what bench/calibrate_check.py interleaves with the engine's read): each
    `run` is one pass; `bw` is calibrate's hbm_bw over the passes so far, so a slow pass later
    does not pull it down and a faster one lifts it; `last_pass_bw` is the latest pass alone."""
    pass_seconds = iter([2.0, 1.0, 4.0])
    monkeypatch.setattr(timing, "_runs", lambda fn, reps, min_s: [next(pass_seconds)] * reps)
    monkeypatch.setattr(read, "_native_read", lambda *a: None)  # XLA's stream alone
    stream = cal.ReadStream(sizes=TINY)
    (working_set,) = TINY.read_points  # one READ_SHAPE matrix: TINY is smaller than one
    stream.run()
    assert stream.bw() == working_set / 2.0
    assert stream.last_pass_bw() == working_set / 2.0
    stream.run()
    assert stream.bw() == working_set / 1.0
    stream.run()
    assert stream.bw() == working_set / 1.0
    assert stream.last_pass_bw() == working_set / 4.0  # the pass alone: the slow one


def test_hbm_bw_is_the_faster_kernels_read_pass_by_pass_and_overall(monkeypatch):
    """On CPU the read stream runs through XLA's dot and the server's native kernel, round
    robin; hbm_bw is the faster one's plateau (a roof the engine's own kernel beats is no
    roof), and a pass alone is judged the same way."""
    seconds = iter([2.0, 1.6, 1.0, 1.2, 4.0, 5.0])  # per pass: XLA, then native
    monkeypatch.setattr(timing, "_runs", lambda fn, reps, min_s: [next(seconds)] * reps)
    own_calls: list[int] = []
    monkeypatch.setattr(read, "_native_read", lambda *a: own_calls.append)
    stream = cal.ReadStream(sizes=TINY)
    (n,) = TINY.read_points
    assert own_calls == [1]  # warmed up once: one matrix
    stream.run()
    assert stream.bw() == stream.last_pass_bw() == n / 1.6  # native faster in pass 1
    stream.run()
    assert stream.bw() == stream.last_pass_bw() == n / 1.0  # XLA faster in pass 2
    stream.run()
    assert stream.bw() == n / 1.0 and stream.last_pass_bw() == n / 4.0
    figure = read._read_figure(stream._passes, TINY)
    assert figure["kernel"] == "xla" and figure["bw"] == n / 1.0
    assert figure["curves"]["native"][0]["pass_bws"] == [n / 1.6, n / 1.2, n / 5.0]
    assert figure["curve"] is figure["curves"]["xla"]
    assert "native dense kernel" in figure["method"] and "(xla)" in figure["method"]


def test_read_passes_far_apart_get_a_note_naming_their_range():
    """The passes at the largest working set decide; 15 % apart is still quiet."""
    small = {"bytes": 1 << 20, "pass_bws": [10e9, 40e9]}  # inside the cache: not judged
    assert cal.read_spread_note([small, {"bytes": GiB, "pass_bws": [30e9, 34.5e9]}]) is None
    note = cal.read_spread_note([small, {"bytes": GiB, "pass_bws": [24e9, 33e9, 25e9]}])
    assert note is not None and "24.0-33.0 GB/s" in note
    assert cal.read_spread_note([{"bytes": GiB, "pass_bws": [20e9]}]) is None


def test_window_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--window", "0"])
    assert "--window should be > 0 seconds, got 0.0" in capsys.readouterr().err


def test_spread_samples_one_figure_per_slice_on_a_fake_clock(monkeypatch):
    """Slices of 1 s on a fake clock: a read of 1e9 B takes 0.1 s (10 GB/s), then 0.2 s in the
    second part of the window (5 GB/s); a 2e9-FLOP GEMM 0.1 s (20 GFLOP/s); a dispatch 1 ms.
    Each slice's sample is the median of its calls; p10/p50/p90 over the slices."""
    clock = [0.0]
    monkeypatch.setattr(spread_mod.time, "perf_counter", lambda: clock[0])

    def costs(seconds):
        return lambda: clock.__setitem__(0, clock[0] + seconds())

    slow = [False]
    read_s = lambda: 0.2 if slow[0] else 0.1  # noqa: E731
    sampler = spread_mod.SpreadSampler(
        costs(read_s), 10**9, costs(lambda: 0.1), 2 * 10**9, costs(lambda: 1e-3), "fake", 1.0
    )
    # from t = 0.301 (the warm-ups): rounds of a read, a GEMM and 20 dispatches, 0.22 s; a slice
    # ends at its first round past 1 s (1.1 s); a window stops when under half a slice is left
    sampler.run(4.0)  # slices end at 1.401, 2.501, 3.601, 4.701
    slow[0] = True  # rounds of 0.32 s, slices of 1.28 s: 5.981, 7.261, 8.541, 9.821
    sampler.run(5.0)
    got = sampler.result()
    reads = got["samples"]["read_bw"]
    assert reads == [10e9] * 4 + [5e9] * 4
    # numpy's percentiles of 4 x 5 and 4 x 10 GB/s: p10 at 5, p50 halfway, p90 at 10
    ends = (got["read_bw"]["p10"], got["read_bw"]["p50"], got["read_bw"]["p90"])
    assert ends == pytest.approx((5e9, 7.5e9, 10e9))
    assert got["flops_per_s"]["p10"] == pytest.approx(20e9)
    assert got["flops_per_s"]["p90"] == pytest.approx(20e9)
    assert got["dispatch_s"]["p50"] == pytest.approx(1e-3)
    assert got["noisy"] is True  # read p90 / p10 = 2 > 1.2
    assert "noisy host" in spread_mod.spread_note(got)
    quiet = {**got, "noisy": False}
    assert spread_mod.spread_note(quiet) is None
