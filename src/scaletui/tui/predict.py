"""Roofline predictions for the knobs, via `scaletui.roofline.estimate` (never a copy of it).

Inputs: the server's model spec (the /stats "model" fields, or a spec loaded by name), a hardware
spec (`local` when calibrated; otherwise a fallback named in the events log), and the knobs:
batch = slots, chips = tp * dp, prompt_len = input_len, context = input_len + output_len / 2,
weight/KV bytes from the server dtype (f32 -> 4, bf16 -> 2). The roofline has no queueing, so its
one TTFT/TPOT number is the floor for both p50 and p99.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from scaletui import specs
from scaletui.tui.knobs import Knobs

DTYPE_BYTES = {"f32": 4, "bf16": 2, "fp8": 1, "int8": 1}


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

    @property
    def mem_per_chip(self) -> float:
        return self.weight_bytes_per_chip + self.kv_bytes_per_chip

    @property
    def flops_per_s_per_chip(self) -> float:
        return self.flops_per_token * self.tok_s_per_chip


def pick_hardware(requested: str, backend: str | None) -> tuple[str, str | None]:
    """(spec name, note): the requested spec, else `local`, else a built-in of the backend kind."""
    if requested:
        return requested, None
    names = specs.hardware_names()
    if "local" in names:
        return "local", None
    kind = backend or "cpu"
    same_kind = [n for n in names if _kind(n) == kind]
    fallback = (same_kind or [n for n in ("h100", *names) if n in names] or ["?"])[0]
    return fallback, (
        f"no calibrated 'local' spec: predictions are for '{fallback}', not this {kind} host "
        "(run `scaletui calibrate`)"
    )


def _kind(name: str) -> str:
    try:
        return specs.load_hardware(name).kind
    except specs.SpecError:
        return "?"


def model_spec_from(data: dict) -> specs.ModelSpec:
    """A ModelSpec from the /stats "model" object (unknown keys ignored)."""
    names = {f.name for f in dataclasses.fields(specs.ModelSpec)} - {"extra"}
    missing = sorted(
        n for n in names if n not in data and n not in ("n_experts", "experts_per_token")
    )
    if missing:
        raise ValueError(f"/stats model is missing {missing}")
    return specs.ModelSpec(**{k: v for k, v in data.items() if k in names})


def predict(
    model: specs.ModelSpec, hardware: specs.HardwareSpec, knobs: Knobs, dtype: str = "f32"
) -> Prediction:
    """One roofline estimate for these knobs (raises ImportError until the roofline lands)."""
    from scaletui.roofline import estimate  # lazy: the TUI must start even without it

    nbytes = DTYPE_BYTES.get(dtype, 2)
    compute = dtype if dtype in hardware.flops_per_s and hardware.flops_per_s[dtype] else "bf16"
    if not hardware.flops_per_s.get(compute):
        compute = next(k for k, v in hardware.flops_per_s.items() if v)
    est = estimate(
        model,
        hardware,
        batch=knobs.slots,
        context=knobs.input_len + knobs.output_len // 2,
        prompt_len=knobs.input_len,
        chips=knobs.chips,
        tp=knobs.tp,
        dp=knobs.dp,
        weight_bytes=nbytes,
        kv_bytes=nbytes,
        compute_dtype=compute,
    ).to_dict()
    return Prediction(
        hardware=hardware.name,
        ttft_ms=est["ttft_s"] * 1e3,
        tpot_ms=est["decode_step_s"] * 1e3,
        tok_s=est["decode_tokens_per_s"],
        tok_s_per_chip=est["decode_tokens_per_s_per_chip"],
        weight_bytes_per_chip=est["weight_bytes_per_chip"],
        kv_bytes_per_chip=est["kv_bytes_per_chip"],
        fits=bool(est["fits"]),
        bound=str(est["decode_bound"]),
        intensity=est["arithmetic_intensity"],
        flops_per_token=est["flops_per_token"],
        peak_flops=hardware.flops(compute),
        hbm_bw=hardware.hbm_bw,
        hbm_bytes=hardware.hbm_bytes,
    )
