"""Floor | expected | measured in the TUI model: the floor shares a CPU host's roofs among its
virtual devices, the expectation simulates our scheduler on a stored fit (or says it assumed),
measured / expected is the ratio shown, the status names the fit, and a sweep gets an expected
curve. Plain Python, no Textual; the fits are written into the test's private XDG config."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest
from fake_specs import CPU

from scaletui.records import Record
from scaletui.roofline.costmodel import CostModel
from scaletui.roofline.fitstore import save_fit
from scaletui.specs import load_hardware, load_model
from scaletui.tui import expect as tui_expect
from scaletui.tui import views
from scaletui.tui.expect import expect, fit_label, server_shape, sweep_grid
from scaletui.tui.knobs import Knobs
from scaletui.tui.predict import predict
from scaletui.tui.state import SessionState

KNOBS = Knobs(slots=4, input_len=32, output_len=32, length_spread=0)  # lengths by hand
CONFIG = {  # the /stats "config" of a tiny server
    "model": "tiny",
    "slots": 4,
    "max_seq_len": 256,
    "decode_steps": 4,
    "tp": 1,
    "dp": 1,
    "mode": "interleaved",
    "prefill_devices": 0,
    "dtype": "f32",
    "kernels": "auto",
}
INFO = {"date": "2026-12-01T02:08:11+00:00", "host": "testhost", "seconds": 41.2}


def hand_fit(tp: int = 1, dp: int = 1, kernels: str = "xla", **precision: str) -> CostModel:
    """A fit whose times are computable by hand: 1 ms per decode step, 2 ms per generate call
    (host sync), and bytes, FLOPs and prefill all but free. `precision`: weight_dtype,
    kv_dtype (default f32, as the compute dtype)."""
    base = CostModel.assumed(load_model("tiny"), CPU, dtype="f32", tp=tp, dp=dp, **precision)
    return replace(
        base,
        step_overhead_s=1e-3,
        sync_s=2e-3,
        read_bw=1e18,
        decode_flops_per_s=1e30,
        prefill_overhead_s=0.0,
        prefill_flops_per_s=1e30,
        kernels=kernels,
        source="fit",
        info=dict(INFO),
    )


def stats(step_ms: float | None = None, **config: object) -> Record:
    model = {k: v for k, v in dataclasses.asdict(load_model("tiny")).items() if k != "extra"}
    data = {"state": "serving", "backend": "cpu", "model": model, "config": CONFIG | config}
    if step_ms is not None:
        data["step_times_ms"] = {"generate": {"per_token_mean": step_ms}}
    return Record(1.0, "stats", data)


def serving(knobs: Knobs = KNOBS, step_ms: float | None = None) -> SessionState:
    m = SessionState(knobs, "tiny")
    m.add(stats(step_ms))
    return m


def kpis(m: SessionState) -> dict[str, views.Kpi]:
    return {k.key: k for k in views.build_view(m).kpis}


def test_floor_on_cpu_shares_the_host_among_virtual_devices():
    """Two virtual CPU devices are one host: each gets half its bandwidth, and tp 2 does not
    double the floor's tokens/s (it was x62 the measured rate before)."""
    model = load_model("small")
    one = predict(model, CPU, Knobs(slots=8, tp=1))
    two = predict(model, CPU, Knobs(slots=8, tp=2))
    assert one.hbm_bw == CPU.hbm_bw and two.hbm_bw == CPU.hbm_bw / 2
    assert two.peak_flops == CPU.flops("f32") / 2
    assert two.tok_s <= one.tok_s * 1.001  # weights per device halve, and so does bandwidth
    assert two.weight_bytes_per_chip == pytest.approx(one.weight_bytes_per_chip / 2, rel=0.05)
    # a GPU spec is per chip already: tp 2 keeps each chip's bandwidth
    h100 = load_hardware("h100")
    assert predict(model, h100, Knobs(slots=8, tp=2)).hbm_bw == h100.hbm_bw


def test_expected_simulates_the_scheduler_on_a_stored_fit(monkeypatch):
    """4 slots, closed loop at 4, 32 tokens out, 4 steps per call on the hand fit: 7 calls of
    2 + 4 x 1 ms and one of 2 + 3 ms = 47 ms per request, all four in lockstep (with no intake
    time and no host gap between calls: both are tested in test_simulate). The decode step is
    a call's time over its steps averaged over the calls, as /stats per_token_mean is."""
    monkeypatch.setattr(tui_expect, "INTAKE_S", 0.0)
    monkeypatch.setattr(tui_expect, "HOST_GAP_S", 0.0)
    monkeypatch.setattr(tui_expect, "HOST_GAP_PER_ROW_S", 0.0)
    save_fit(hand_fit())
    m = serving()
    e = m.expectation()
    assert e is not None and e.fit.source == "fit" and e.fit.note is None
    step = (7 * (2 + 4 * 1) / 4 + (2 + 3 * 1) / 3) / 8
    assert e.decode_step_ms == pytest.approx(step, rel=1e-6)
    assert e.tpot_p50_ms == pytest.approx(47 / 31, rel=1e-6)
    assert e.tok_s == pytest.approx(4 * 32 / 0.047, rel=1e-6)
    assert e.ttft_p50_ms == pytest.approx(0, abs=1e-6)
    kpi = kpis(m)
    assert kpi["decode_step"].expected == pytest.approx(step)
    assert kpi["tok_s"].expected == pytest.approx(e.tok_s)


def test_ratio_is_measured_over_expected(monkeypatch):
    monkeypatch.setattr(tui_expect, "INTAKE_S", 0.0)
    save_fit(hand_fit())
    m = serving(step_ms=3.0)  # the server times 3 ms per decode step; the fit says ~1.52 ms
    kpi = kpis(m)["decode_step"]
    expected = (7 * (2 + 4 * 1) / 4 + (2 + 3 * 1) / 3) / 8  # as in the test above
    assert kpi.measured == 3.0 and kpi.ratio == pytest.approx(3.0 / expected)
    assert views.Kpi("x", "x", "ms", 1.0, None, 3.0).ratio is None


def test_a_note_says_when_the_engine_runs_far_off_its_fit(monkeypatch):
    """The server's own decode step more than 15 % off the fit's: the KPI panel says the
    host's speed moved (every m/e carries it); within 15 %, or on assumed efficiencies, or for
    pending knobs (their expectation is not what runs), no note."""
    monkeypatch.setattr(tui_expect, "INTAKE_S", 0.0)
    expected = (7 * (2 + 4 * 1) / 4 + (2 + 3 * 1) / 3) / 8  # the hand fit's step, as above
    save_fit(hand_fit())
    slow = views.build_view(serving(step_ms=1.25 * expected)).speed_note
    assert slow is not None and "×1.25 its fit" in slow and "slower" in slow
    fast = views.build_view(serving(step_ms=0.8 * expected)).speed_note
    assert fast is not None and "×0.80" in fast and "faster" in fast
    assert views.build_view(serving(step_ms=1.1 * expected)).speed_note is None
    assert views.build_view(serving()).speed_note is None  # nothing measured yet
    m = serving(step_ms=1.25 * expected)
    m.edit(output_len=64)
    assert m.pending and views.build_view(m).speed_note is None
    far = views.Kpi("decode_step", "decode step", "ms", 1.0, 1.0, 2.0)
    assert views.speed_note(far, fitted=False) is None  # assumed efficiencies say so already


def test_status_names_the_fit_in_use():
    save_fit(hand_fit())
    v = views.build_view(serving())
    assert v.fit == "testhost tiny f32 xla tp1 (2026-12-01 02:08, 41 s)"
    assert fit_label(hand_fit(tp=2, dp=2)).startswith("testhost tiny f32 xla tp2 dp2 (")


def test_without_a_fit_expected_says_it_assumed():
    m = serving()
    e = m.expectation()
    assert e is not None and e.fit.source == "assumed"
    v = views.build_view(m)
    assert v.fit == "none (assumed efficiencies)"
    assert v.expected_note == "expected: assumed efficiencies, no fit for this configuration yet"
    assert all(k.expected is not None for k in v.kpis)
    # a what-if spec never takes this host's fit
    save_fit(hand_fit())
    m.edit(hardware="h100")
    assert "what-if spec h100" in views.build_view(m).expected_note


def test_new_configuration_uses_its_own_fit_once_written():
    save_fit(hand_fit(tp=1))
    m = serving()
    m.edit(tp=2)  # pending: the tp 2 server has no fit yet
    assert m.expectation().fit.source == "assumed"
    assert "no fit for this configuration yet" in views.build_view(m).expected_note
    save_fit(hand_fit(tp=2))
    assert m.expectation().fit.source == "assumed"  # memoized until a fit event
    m.add(Record(2.0, "event", {"text": "fitted", "fit": "done"}))
    got = m.expectation()
    assert got.fit.source == "fit" and "tp2" in got.fit.label
    assert views.build_view(m).expected_note is None


def test_a_pending_precision_uses_its_own_fit_else_assumes_and_says_so():
    save_fit(hand_fit())
    m = serving()
    assert m.expectation().fit.source == "fit"
    m.edit(weight_dtype="int8")  # `w` to int8, not applied: f32 compute, int8 weights
    assert m.server_shape().weight_dtype == "int8"
    assert m.expectation().fit.source == "assumed"
    note = "expected: assumed efficiencies, no fit for this configuration (f32·w int8) yet"
    assert views.build_view(m).expected_note == note
    save_fit(hand_fit(weight_dtype="int8"))
    m.add(Record(2.0, "event", {"text": "fitted", "fit": "done"}))
    got = m.expectation()
    assert got.fit.source == "fit" and got.fit.label.startswith("testhost tiny f32·w int8 xla")
    m.discard()  # the f32 server's own fit again
    assert m.expectation().fit.label.startswith("testhost tiny f32 xla tp1")
    # without fits (a what-if spec) the assumed model reads the narrower weights too
    what_if = serving(replace(KNOBS, hardware="h100"))
    f32 = what_if.expectation().decode_step_ms
    what_if.edit(weight_dtype="int8")
    assert what_if.expectation().decode_step_ms < f32


def test_fit_in_progress_and_failure_are_said():
    m = serving()
    m.add(Record(2.0, "event", {"text": "fitting", "fit": "running", "phase": "fitting"}))
    v = views.build_view(m)
    assert v.fit.startswith("fitting") and "(fitting now)" in v.expected_note
    m.add(Record(3.0, "event", {"text": "failed", "fit": "failed: exit 3", "phase": "idle"}))
    assert views.build_view(m).fit == "failed (assumed efficiencies)"


def test_open_loop_below_capacity_carries_the_offered_load():
    save_fit(hand_fit())
    knobs = Knobs(slots=4, input_len=32, output_len=32, length_spread=0, load="qps", rate=2.0)
    e = expect(None, knobs, server_shape({"max_seq_len": 256}, knobs, load_model("tiny")))
    # 2 req/s x 32 tokens, far below the 2.7k tok/s the hand fit carries; one request at a
    # time: 47 ms of calls each and the scheduler's gap before each of its 8 calls
    assert e.tok_s == pytest.approx(64, rel=0.25)
    gap = tui_expect.HOST_GAP_S + tui_expect.HOST_GAP_PER_ROW_S  # with one request running
    assert e.tpot_p50_ms == pytest.approx((47 + 8 * gap * 1e3) / 31, rel=1e-6)


def test_sweep_gets_an_expected_curve_on_a_finer_grid():
    save_fit(hand_fit())
    m = serving()
    for i, rate in enumerate((1.0, 4.0)):
        knobs = replace(KNOBS, load="qps", rate=rate)
        m.add(Record(3.0 + i, "config", {"run": i + 1, "kind": "sweep", "first": i == 0,
                                         "knobs": knobs.to_dict()}))  # fmt: skip
        m.add(Record(4.0 + i, "summary", {"completed": 10, "output_throughput": 30.0 * rate,
                                          "median_tpot_ms": 1.6}))  # fmt: skip
    v = views.build_view(m)
    assert [p.label for p in v.sweep] == ["1qps", "4qps"]
    assert all(p.exp_tok_s and p.exp_tpot_ms for p in v.sweep)
    assert len(v.sweep_curve) >= 10
    tok = [x for x, _ in v.sweep_curve]
    assert tok == sorted(tok) and tok[0] == pytest.approx(32, rel=0.3)
    assert sweep_grid([1, 8], True) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert len(sweep_grid([1.0, 4.0], False)) == 10


def test_fits_are_looked_up_by_the_kernels_that_run():
    """`auto` resolves to native or xla in the server; /stats says which (kernels_running),
    and a fit of the other kernels does not describe it."""
    from scaletui.tui.host import fit_lookup

    config = {"model": "small", "dtype": "f32", "tp": 1, "dp": 1, "kernels": "auto",
              "kernels_running": "native"}  # fmt: skip
    assert fit_lookup(config).kernels == "native"
    small = load_model("small")
    assert server_shape(config, Knobs(), small).kernels == "native"
    # a staged mesh runs what auto resolves to there, not what runs now
    assert server_shape(config, Knobs(tp=2), small).kernels == "auto"
    assert fit_lookup({**config, "kernels_running": "none"}).kernels == "auto"


@pytest.mark.parametrize(
    "knobs",
    [
        Knobs(),
        Knobs(length_spread=0),
        Knobs(slots=4, load="qps", rate=3.0, input_len=64, output_len=32, length_spread=0.5),
    ],
    ids=["default", "fixed", "open-loop"],
)
def test_the_simulated_load_is_the_request_list_loadgen_sends(knobs):
    """The TUI's loadgen command, parsed as loadgen parses it, draws the very offsets and
    lengths the expectation simulates (+ the server's BOS on each prompt)."""
    from scaletui.loadgen import flags as loadgen_flags
    from scaletui.loadgen.workload import schedule
    from scaletui.tui.loadrun import LoadRunner

    cmd = LoadRunner("http://x", "py", None, lambda *_: None, set()).command(knobs, 30)
    sent = loadgen_flags.workload_from(loadgen_flags.build_parser().parse_args(cmd[3:]))
    shape = server_shape({"max_seq_len": 512}, knobs, load_model("small"))
    load = tui_expect.tui_load(knobs, shape)
    offsets, inp, out = schedule(sent, len(load.offsets))
    assert load.offsets.tolist() == pytest.approx(offsets.tolist())
    assert (load.input_len == inp + 1).all() and (load.output_len == out).all()
    assert load.closed_loop == (knobs.load == "concurrency")
    lo, hi = knobs.output_len - knobs.output_spread, knobs.output_len + knobs.output_spread
    assert out.min() >= lo and out.max() <= hi
    assert (out.min() < out.max()) == (knobs.length_spread > 0)  # spread only when asked
    assert inp.max() + 1 + out.max() <= knobs.longest + 1


def test_the_longest_request_must_fit_the_server():
    """A spread that takes the longest request past max_seq_len is refused, with the lengths."""
    save_fit(hand_fit())
    knobs = Knobs(slots=4, input_len=100, output_len=100)  # fixed: 201 fits 256, +-30%: 261 not
    tiny = server_shape({"max_seq_len": 256}, knobs, load_model("tiny"))
    assert expect(None, replace(knobs, length_spread=0), tiny).tok_s
    with pytest.raises(ValueError, match=r"261 \(in 100±30 out 100±30\).*max_seq_len 256"):
        expect(None, replace(knobs, length_spread=0.3), tiny)


def test_a_part_of_the_simulated_run_reads_as_the_pool_reads_the_measured_one():
    """Four requests by hand, sent at 0, 0, 1, 1; they finish at 0.9 (TTFT 200 ms), 1.0
    (100 ms), 2.0 and 2.1 (50 ms each). The last send is at 1 s, so the two after it are the
    closed loop's drain. Completions 0-1 in one window: median (200, 100) = 150; in two
    windows of one each: the same; a part past the steady completions reads the last part of
    its size before them. Tokens: first tokens at 0.1 and 0.2 and chunks of 3, 4 and 5 up to
    1 s: 14 in (0, 1]."""
    import numpy as np

    from scaletui.roofline.simrecords import SimResult
    from scaletui.tui.simrun import SimRun

    r = SimResult(
        t_sched=np.array([0.0, 0.0, 1.0, 1.0]),
        t_send=np.array([0.0, 0.0, 1.0, 1.0]),
        t_first=np.array([0.1, 0.2, 1.05, 1.05]),
        t_last=np.array([1.0, 0.9, 2.0, 2.1]),
        outcome=np.array(["ok"] * 4),
        summary={},
        chunk_t=np.array([0.5, 0.9, 1.0, 1.5, 2.0, 2.1]),
        chunk_n=np.array([3, 4, 5, 9, 9, 9]),
    )
    run = SimRun.of(r, np.array([10, 10, 10, 1]))
    assert run.steady == 2 and run.last_send == 1.0
    assert run.ttft_ms.tolist() == pytest.approx([200, 100, 50, 50])
    assert run.tpot_ms[0] == pytest.approx((0.9 - 0.2) / 9 * 1e3)
    assert np.isnan(run.tpot_ms[3])  # one token: no TPOT
    assert run.latency("ttft", 50, 0, [2]) == pytest.approx(150)
    assert run.latency("ttft", 50, 0, [1, 1]) == pytest.approx(150)
    assert run.latency("ttft", 99, 0, [1, 0, 1]) == pytest.approx(199)  # 100 + .99 x (200 - 100)
    assert run.latency("ttft", 50, 2, [2]) == pytest.approx(150)  # past the last send
    assert run.latency("ttft", 50, 0, [0, 0]) is None
    assert run.tok_s(0.0, 1.0) == pytest.approx(14)
    assert run.tok_s(1.0, 3.0) == pytest.approx(14)  # the same span ending at the last send


def test_expected_latency_follows_the_part_of_the_run_the_pool_measures():
    """A closed loop's first wave queues behind its own prefills (here 300 ms TTFT, 100 after
    it). The pool of the run's first windows holds only that wave, so its expectation is the
    same requests simulated, not the whole run's median (999 here, to tell them apart); five
    windows on, the pool and the expectation both read the later requests. Pending knobs show
    the whole run's numbers for those knobs."""
    import numpy as np

    from scaletui.tui.expect import Expectation, FitChoice
    from scaletui.tui.simrun import SimRun

    run = SimRun(
        ttft_ms=np.array([300.0, 300.0] + [100.0] * 8),
        tpot_ms=np.array([20.0, 20.0] + [10.0] * 8),
        steady=10,
        token_t=np.arange(0.5, 10.0, 1.0),
        token_n=np.full(10, 10),
        last_send=10.0,
    )
    whole = Expectation(999.0, 999.0, 99.0, 99.0, 5.0, 999.0, 4.0, FitChoice("fit", "hand"), run)
    m = SessionState(Knobs(slots=4), "tiny")
    m.expectation_or_error = lambda knobs=None, budget=0: whole
    m.add(Record(0.0, "config", {"run": 1}))
    m.add(window(1.0, 2, (310, 320)))
    kpi = kpis(m)
    assert kpi["ttft_p50"].expected == 300 and kpi["ttft_p50"].ratio == pytest.approx(310 / 300)
    assert kpi["tpot_p50"].expected == 20
    assert kpi["tok_s"].expected == pytest.approx(10)  # tokens in (0, 1] s of the run
    for t in range(2, 7):
        m.add(window(float(t), 1, (105, 105)))
    kpi = kpis(m)
    assert kpi["ttft_p50"].expected == 100 and kpi["ttft_p99"].expected == 100
    assert kpi["tok_s"].expected == pytest.approx(10)
    m.pending = replace(m.applied, slots=8)
    assert kpis(m)["ttft_p50"].expected == 999


def window(t: float, completed: int, ttft: tuple[float, float]) -> Record:
    """A loadgen window line: `completed` requests with this TTFT (p50, p99) and TPOT 20 ms."""
    data = {"type": "window", "t": t, "window_s": 1.0, "completed": completed}
    data |= {"output_tok_s": 10.0, "ttft_ms": {"p50": ttft[0], "p99": ttft[1]}}
    return Record(t, "window", data | {"tpot_ms": {"p50": 20.0, "p99": 20.0}})


def test_expected_carries_its_band_from_the_fits_residuals():
    """A fit whose calls ran 0.8-1.25x what it answers (its residual spread) and no host
    spread: every decode call of the band's ends scales by that, the scheduler's gaps do not,
    so TPOT's ends are computable from the point; the KPI shows the band and says whence."""
    residual = {"decode": {"p10": 0.8, "p50": 1.0, "p90": 1.25, "n": 9}}
    save_fit(replace(hand_fit(), info={**INFO, "residual_spread": residual}))
    knobs = Knobs(slots=4, input_len=32, output_len=32, length_spread=0, load="qps", rate=2.0)
    e = expect(None, knobs, server_shape({"max_seq_len": 256}, knobs, load_model("tiny")))
    gaps = 8 * (tui_expect.HOST_GAP_S + tui_expect.HOST_GAP_PER_ROW_S) * 1e3  # ms, 8 calls
    calls = e.tpot_p50_ms * 31 - gaps  # one request at a time: 31 tokens after the first
    lo, hi = e.band["median_tpot_ms"]
    assert (lo, hi) == pytest.approx(((0.8 * calls + gaps) / 31, (1.25 * calls + gaps) / 31))
    assert "fit residuals (measured / model) p10-p90: decode -20%..+25%" in e.band_note
    assert "host spread unknown" in e.band_note
    m = serving(knobs)
    tpot = kpis(m)["tpot_p50"]
    assert tpot.band is not None and tpot.band[0] < tpot.expected < tpot.band[1]
    assert kpis(m)["mem"].band is None  # memory is counted, not timed
    assert views.build_view(m).band_note.startswith("exp p10-p90: host spread unknown")
    # a sweep's curve asks for the point alone: no ends simulated
    assert m.expectation_or_error(knobs, band=False).ends is None


def speed(fit: str | None, decode: float | None = None, prefill: float | None = None) -> dict:
    """/stats `speed` as the server writes it (serve/http/stats.py)."""
    out = {"fit": fit, "reason": None if fit else "--fit none", "window_calls": 256}
    for kind, f in (("decode", decode), ("prefill", prefill)):
        if f is not None:
            out[kind] = {"factor": f, "calls": 40, "seconds": f, "predicted_seconds": 1.0}
    return out


def test_the_kpis_show_the_servers_speed_factor_and_exp_as_run(monkeypatch):
    """/stats says the engine runs its generate calls 2x its fit's time: the run column is the
    same load simulated at that speed (on the hand fit, each request's 47 ms of calls becomes
    94 ms: TPOT doubles, tok/s halves), and the line under the table says the factor."""
    for name in ("INTAKE_S", "HOST_GAP_S", "HOST_GAP_PER_ROW_S"):
        monkeypatch.setattr(tui_expect, name, 0.0)
    path = save_fit(hand_fit())
    m = SessionState(KNOBS, "tiny")
    m.add(Record(1.0, "stats", stats().data | {"speed": speed(str(path), 2.0, 1.03)}))
    v = views.build_view(m)
    kpi = {k.key: k for k in v.kpis}
    assert kpi["tpot_p50"].as_run == pytest.approx(94 / 31, rel=1e-6)
    assert kpi["tpot_p50"].expected == pytest.approx(47 / 31, rel=1e-6)
    assert kpi["tok_s"].as_run == pytest.approx(4 * 32 / 0.094, rel=1e-6)
    assert kpi["decode_step"].as_run == pytest.approx(2 * kpi["decode_step"].expected)
    assert kpi["mem"].as_run is None
    assert v.speed_line == (
        "speed vs fit (last 256 calls): decode ×2.00, prefill ×1.03; run = exp simulated at "
        "that speed"
    )


def test_without_a_factor_the_kpis_say_why_and_show_no_run_column():
    path = save_fit(hand_fit())
    for got, line in (
        (speed(None), "speed vs fit: none (--fit none)"),
        (speed(str(path)), "speed vs fit: no engine call priced yet"),
        (speed("/elsewhere/other.yaml", 1.5), "no as-run: the server's fit is another one"),
    ):
        m = SessionState(KNOBS, "tiny")
        m.add(Record(1.0, "stats", stats().data | {"speed": got}))
        v = views.build_view(m)
        assert line in v.speed_line and all(k.as_run is None for k in v.kpis)
    assert views.build_view(serving()).speed_line is None  # a server that does not say


def test_tp_over_two_processes_adds_the_dcn_term_to_every_decode_step():
    """A server whose tp group spans 2 processes (/stats placement): the expected decode step is
    the one-host fit's plus the roofline's DCN term, as `scaletui simulate --hosts` prices it
    (here over a 1 MB/s link, so the term is milliseconds a step)."""
    from scaletui.placement import Layout, place
    from scaletui.roofline.dcn import with_dcn

    slow = replace(CPU, dcn_bw=1e6)
    knobs = replace(KNOBS, tp=2)
    shape = server_shape({"max_seq_len": 256}, knobs, load_model("tiny"))
    spanning = place(2, 1, Layout(2, 1), tp_over_hosts=True)
    assert spanning.crosses_hosts == ("model",)
    alone = expect(slow, knobs, shape, band=False)
    over = expect(slow, knobs, shape, band=False, placement=spanning)
    dcn = with_dcn(tui_expect.cost_models(slow, knobs, shape, None)[0], shape.model, slow, spanning)
    # a closed loop at concurrency = slots: nearly every step runs all 4 rows
    step_more_ms = (dcn.dcn_step_s + dcn.dcn_row_s * knobs.slots) * 1e3
    assert step_more_ms > 1 and over.tpot_p50_ms > alone.tpot_p50_ms + 1
    assert over.decode_step_ms - alone.decode_step_ms == pytest.approx(step_more_ms, rel=0.05)
