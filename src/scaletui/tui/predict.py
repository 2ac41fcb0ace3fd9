"""The floor: the book's roofline for the knobs, via `scaletui.roofline.estimate` (never a copy
of it). On a CPU spec the tp x dp devices are virtual and share one host, so its roofs are divided
among them (`roofline.share_host`) before the estimate: two virtual devices are not two chips.

Inputs: the server's model spec (the /stats "model" fields, or a spec loaded by name), a hardware
spec (`local` when calibrated; otherwise a fallback named in the events log), and the knobs:
chips = tp * dp, prompt_len = input_len, context = input_len + output_len / 2, weight and KV
bytes from the knobs' precision, else the server's (f32 -> 4, bf16 -> 2, int8 -> 1), and the
decode batch the load implies
(`decode_batch`: closed loop min(concurrency, slots); open loop the batch that carries the offered
rate). Memory per chip is for what the server allocates (all slots at its max_seq_len). The
roofline has no queueing, so its one TTFT/TPOT number is the floor for both p50 and p99.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

from scaletui import specs
from scaletui.dtypes import DTYPE_BYTES
from scaletui.placement import Layout, Placement, place
from scaletui.tui.knobs import Knobs


@dataclass(frozen=True)
class Prediction:
    hardware: str
    ttft_ms: float
    tpot_ms: float  # = the decode step (one token per slot per step)
    tok_s: float  # output tokens/s, all chips
    tok_s_per_chip: float
    weight_bytes_per_chip: float
    kv_bytes_per_chip: float
    fits: bool
    bound: str
    intensity: float  # FLOPs per byte of the decode step
    flops_per_token: float
    peak_flops: float  # per chip, compute dtype
    hbm_bw: float  # bytes/s per chip
    hbm_bytes: float  # capacity per chip
    batch: int = 0  # the decode batch the step is predicted at
    weight_read_ms: float = 0.0  # the step's weight-load time alone (weights / tp / bandwidth)
    kv_bytes_per_token: float = 0.0  # one token's KV, all layers and heads (whole replica)
    max_slots: int = 0  # the KV capacity: slots of max_seq_len tokens that fit beside the weights
    # the book's max batch at the workload's own context (prompt + output): sequences whose KV
    # pages fit beside the weights, the paged cache's bound (when --max-running allows)
    max_running: int = 0
    # over processes (hosts): the step's DCN term and the mesh axes that cross them; None: one
    dcn_ms: float | None = None
    crosses_hosts: tuple[str, ...] = ()

    @property
    def mem_per_chip(self) -> float:
        return self.weight_bytes_per_chip + self.kv_bytes_per_chip

    @property
    def flops_per_s_per_chip(self) -> float:
        return self.flops_per_token * self.tok_s_per_chip


CALIBRATION_NOTES = {
    "": "run `scaletui calibrate`",
    "running": "calibrating this host",
    "off": "--no-calibrate; run `scaletui calibrate`",
    "remote": "remote server: pass --hardware NAME, or calibrate on its host",
}


def pick_hardware(
    requested: str, backend: str | None, calibration: str = ""
) -> tuple[str, str | None]:
    """(spec name, note): the requested spec, else `local`, else a built-in of the backend kind
    (else h100) with a note saying why; `calibration` is the controller's calibrate state
    ("" unknown, running, done, off, remote, or "failed: why")."""
    if requested:
        return requested, None
    names = specs.hardware_names()
    if "local" in names:
        return "local", None
    kind = backend or "cpu"
    same_kind = [n for n in names if _kind(n) == kind]
    fallback = (same_kind or [n for n in ("h100", *names) if n in names] or ["?"])[0]
    why = CALIBRATION_NOTES.get(calibration, calibration or CALIBRATION_NOTES[""])
    return fallback, (
        f"no calibrated 'local' spec: predictions are for '{fallback}', not this {kind} host "
        f"({why})"
    )


def _kind(name: str) -> str:
    try:
        return specs.load_hardware(name).kind
    except specs.SpecError:
        return "?"


def model_spec_from(data: dict) -> specs.ModelSpec:
    """A ModelSpec from the /stats "model" object (unknown keys ignored)."""
    names = {f.name for f in dataclasses.fields(specs.ModelSpec)} - {"extra"}
    optional = ("n_experts", "experts_per_token", "qkv_bias", "rope_scaling")
    missing = sorted(n for n in names if n not in data and n not in optional)
    if missing:
        raise ValueError(f"/stats model is missing {missing}")
    values = {k: v for k, v in data.items() if k in names}
    if isinstance(values.get("rope_scaling"), dict):
        values["rope_scaling"] = specs.rope_scaling_from("/stats model", values["rope_scaling"])
    return specs.ModelSpec(**values)


def host_devices(knobs: Knobs) -> int:
    """Devices the server uses: tp x dp, plus the prefill devices when disaggregated (on a CPU
    spec these are virtual devices that share the host's roofs)."""
    if knobs.mode == "disaggregated":
        return knobs.chips + (knobs.prefill_devices or knobs.chips)
    return knobs.chips


def placement_of(knobs: Knobs, where: dict) -> Placement | None:
    """The knobs' mesh placed over the processes a /stats `placement` names, as the server
    places it (tp within a process where it fits, else spanning them); None on one process, or
    for a mesh that cannot be placed there (the server refuses it and says why)."""
    if not where:
        return None
    try:
        hosts, per = int(where["hosts"]), int(where["devices_per_host"])
        layout = Layout(hosts, per, int(where.get("hosts_per_slice", 1)))
        return place(knobs.tp, knobs.dp, layout, tp_over_hosts=True)
    except (KeyError, TypeError, ValueError):
        return None


def decode_batch(knobs: Knobs, tok_s_at: Callable[[int], float]) -> int:
    """The batch the decode step runs at under this load. Closed loop: min(concurrency, slots).
    Open loop at rate r: the smallest batch whose roofline throughput carries the offered
    r * output_len tokens/s (Little's law: fewer in flight than slots when the chips keep up),
    else all slots (saturated: the queue grows). `tok_s_at(b)` must grow with b."""
    if knobs.load != "qps":
        return max(1, min(knobs.concurrency, knobs.slots))
    offered = knobs.rate * knobs.output_len
    if tok_s_at(knobs.slots) <= offered:
        return knobs.slots
    lo, hi = 1, knobs.slots  # tok_s_at(hi) > offered
    while lo < hi:
        mid = (lo + hi) // 2
        if tok_s_at(mid) >= offered:
            hi = mid
        else:
            lo = mid + 1
    return lo


def predict(
    model: specs.ModelSpec,
    hardware: specs.HardwareSpec,
    knobs: Knobs,
    dtype: str = "f32",
    max_seq_len: int | None = None,
    weight_dtype: str | None = None,
    kv_dtype: str | None = None,
    placement: Placement | None = None,
) -> Prediction:
    """The roofline for these knobs (raises ImportError until the roofline lands): the decode
    step at the load's batch (`decode_batch`), the prompt's prefill as TTFT, and memory per chip
    for what the server allocates: KV for every slot at `max_seq_len` (its /stats config), or at
    the mean context when unknown. Bytes per weight and per KV entry follow the server's
    `weight_dtype` / `kv_dtype` (its /stats config; default: `dtype`, the compute dtype). With
    a `placement` over processes, the axes that cross them are priced at the spec's DCN
    bandwidth (`roofline.dcn`: the step's `dcn_ms`)."""
    from scaletui.roofline import estimate, share_host  # lazy: the TUI starts without them

    hardware = share_host(hardware, host_devices(knobs))
    nbytes = DTYPE_BYTES.get(dtype, 2)
    w_bytes = DTYPE_BYTES.get(weight_dtype or dtype, nbytes)
    kv_bytes = DTYPE_BYTES.get(kv_dtype or dtype, nbytes)
    compute = dtype if dtype in hardware.flops_per_s and hardware.flops_per_s[dtype] else "bf16"
    if not hardware.flops_per_s.get(compute):
        compute = next(k for k, v in hardware.flops_per_s.items() if v)
    context = knobs.input_len + knobs.output_len // 2

    @functools.cache
    def est(batch: int, ctx: int = context) -> dict:
        return estimate(
            model,
            hardware,
            batch=batch,
            context=ctx,
            prompt_len=knobs.input_len,
            chips=knobs.chips,
            tp=knobs.tp,
            dp=knobs.dp,
            weight_bytes=w_bytes,
            kv_bytes=kv_bytes,
            compute_dtype=compute,
            placement=placement,
        ).to_dict()

    batch = decode_batch(knobs, lambda b: est(b)["decode_tokens_per_s"])
    step = est(batch)
    memory = est(knobs.slots, max_seq_len) if max_seq_len else est(knobs.slots)
    tok_s = step["decode_tokens_per_s"]
    if knobs.load == "qps":
        tok_s = min(tok_s, knobs.rate * knobs.output_len)  # below capacity: what is offered
    return Prediction(
        hardware=hardware.name,
        ttft_ms=step["ttft_s"] * 1e3,
        tpot_ms=step["decode_step_s"] * 1e3,
        tok_s=tok_s,
        tok_s_per_chip=tok_s / knobs.chips,
        weight_bytes_per_chip=memory["weight_bytes_per_chip"],
        kv_bytes_per_chip=memory["kv_bytes_per_chip"],
        fits=bool(memory["fits"]),
        bound=str(step["decode_bound"]),
        intensity=step["arithmetic_intensity"],
        flops_per_token=step["flops_per_token"],
        peak_flops=hardware.flops(compute),
        hbm_bw=hardware.hbm_bw,
        hbm_bytes=hardware.hbm_bytes,
        batch=batch,
        weight_read_ms=step["decode_weight_s"] * 1e3,
        kv_bytes_per_token=step["kv_bytes_per_token"],
        max_slots=int(memory["max_batch"]),
        max_running=int(est(knobs.slots, knobs.input_len + knobs.output_len)["max_batch"]),
        dcn_ms=None if placement is None else step["decode_comm_dcn_s"] * 1e3,
        crosses_hosts=() if placement is None else placement.crosses_hosts,
    )


_MEMO: dict[tuple, Prediction | str] = {}


def predict_cached(
    model: specs.ModelSpec,
    hardware: specs.HardwareSpec,
    knobs: Knobs,
    dtype: str = "f32",
    max_seq_len: int | None = None,
    weight_dtype: str | None = None,
    kv_dtype: str | None = None,
    placement: Placement | None = None,
) -> Prediction | str:
    """`predict`, memoized on its inputs (the render tick asks for the same few every second),
    or the reason there is no prediction, in words."""
    key = (model, repr(hardware), knobs, dtype, max_seq_len, weight_dtype, kv_dtype, placement)
    if key not in _MEMO:  # (repr: HardwareSpec holds a dict)
        if len(_MEMO) > 1024:
            _MEMO.clear()
        try:
            _MEMO[key] = predict(
                model, hardware, knobs, dtype, max_seq_len, weight_dtype, kv_dtype, placement
            )
        except (ImportError, ValueError, KeyError, specs.SpecError) as exc:
            _MEMO[key] = f"no prediction: {exc}"
    return _MEMO[key]
