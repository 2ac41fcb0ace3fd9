"""The expectation (DESIGN.md §4, level 2): step times as the roofline's bytes and FLOPs over
fitted (or assumed) rates, plus fixed costs. Pure arithmetic and numpy; no JAX.

    generate call  = sync_s + steps * decode step
    decode step    = step_overhead_s + (weights + KV read) / read_bw + FLOPs / decode_flops_per_s
    prefill call   = prefill_overhead_s + (weights + KV written) / read_bw
                     + FLOPs / prefill_flops_per_s

Bytes and FLOPs are per device and come from `costs` (weights / tp, KV and FLOPs / (tp * dp) for
a decode batch, a prompt on one tp group). The terms add, as a real step rarely overlaps them.
Weights and KV share one read bandwidth because a fit for one model cannot tell them apart: the
weight bytes are the same in every step, so a separate weight term would be collinear with the
overhead; the KV slope over batch x context fixes the bandwidth, and the weights then cost what
the KV read costs per byte. Prefill shares that bandwidth too (its memory term is the same weight
read), which leaves a well-conditioned 2-term prefill fit on a few prompt lengths.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from scaletui.roofline import costs
from scaletui.specs import HardwareSpec, ModelSpec

__all__ = [
    "DTYPE_BYTES",
    "CostModel",
    "DecodeSample",
    "PrefillSample",
    "fit",
    "share_host",
]

DTYPE_BYTES = {"f32": 4, "bf16": 2}  # the server's dtypes: weights, KV and compute alike


@dataclass(frozen=True)
class DecodeSample:
    """One timed generate call: `steps` decode steps of `batch` rows over `context` KV positions
    (what the step reads: the engine's KV bucket)."""

    batch: int
    context: int
    seconds: float  # the whole call, host sync included
    steps: int = 1


@dataclass(frozen=True)
class PrefillSample:
    """One timed prefill call of `tokens` query positions (the padded bucket) after `start`
    positions already in the cache (a chunk of a long prompt; 0 otherwise)."""

    tokens: int
    seconds: float
    start: int = 0


@dataclass(frozen=True)
class CostModel:
    """Expected step times for one server configuration (model, hardware, dtype, tp, dp).

    Build it with `assumed(...)` (spec roofs times efficiencies) or `fit(...)` (measured steps);
    `to_dict`/`from_dict` round-trip it through YAML.
    """

    model: str
    hardware: str
    dtype: str  # f32 | bf16: weight, KV and compute dtype
    tp: int
    dp: int
    weight_bytes: float  # the whole model's weights, bytes (costs.param_count * dtype bytes)
    kv_bytes_per_token: float  # K and V of one token, all layers, bytes
    flops_per_token: float  # costs.flops_per_token: 2 * P
    attn_flops_per_pair: float  # attention FLOPs per (query, key) pair, all layers
    step_overhead_s: float  # fixed cost per decode step
    sync_s: float  # fixed cost per generate call (dispatch + host copy)
    read_bw: float  # achieved read bandwidth per device, bytes/s
    decode_flops_per_s: float  # achieved decode FLOP/s per device (inf: no FLOP term fitted)
    prefill_overhead_s: float  # fixed cost per prefill call
    prefill_flops_per_s: float  # achieved prefill FLOP/s per device (inf: no FLOP term fitted)
    transfer_bw: float  # disaggregated KV hand-over, bytes/s per device
    kernels: str = "auto"  # native | xla | auto: how the engine ran (fits are per kernels)
    source: str = "assumed"  # assumed | fit
    info: dict = field(default_factory=dict, compare=False)  # fit quality, date, host, notes

    def __post_init__(self) -> None:
        for name in ("read_bw", "decode_flops_per_s", "prefill_flops_per_s", "transfer_bw"):
            if not vars(self)[name] > 0:
                raise ValueError(f"{name} should be > 0, got {vars(self)[name]!r}")
        for name in ("step_overhead_s", "sync_s", "prefill_overhead_s"):
            if vars(self)[name] < 0:
                raise ValueError(f"{name} should be >= 0, got {vars(self)[name]!r}")
        if self.tp < 1 or self.dp < 1:
            raise ValueError(f"tp and dp should be >= 1, got tp={self.tp} dp={self.dp}")

    # -- what one step moves and computes, per device ------------------------------------------

    def decode_bytes(self, batch: float, context: float) -> float:
        return (self.weight_bytes + batch * context * self.kv_bytes_per_token / self.dp) / self.tp

    def decode_flops(self, batch: float, context: float) -> float:
        per_row = self.flops_per_token + context * self.attn_flops_per_pair
        return batch * per_row / (self.tp * self.dp)

    def prefill_bytes(self, tokens: float) -> float:
        return (self.weight_bytes + tokens * self.kv_bytes_per_token) / self.tp

    def prefill_flops(self, tokens: float, start: float = 0) -> float:
        pairs = tokens * start + tokens * tokens / 2  # causal over the new tokens
        return (self.flops_per_token * tokens + pairs * self.attn_flops_per_pair) / self.tp

    # -- expected times ------------------------------------------------------------------------

    def decode_step_s(self, batch: float, context: float) -> float:
        """One decode step of `batch` rows reading `context` KV positions each."""
        return (
            self.step_overhead_s
            + self.decode_bytes(batch, context) / self.read_bw
            + self.decode_flops(batch, context) / self.decode_flops_per_s
        )

    def decode_call_s(self, batch: float, context: float, steps: int) -> float:
        """One generate call: `steps` steps and one host sync."""
        return self.sync_s + steps * self.decode_step_s(batch, context)

    def prefill_s(self, prompt_len: float, start: float = 0) -> float:
        """One prefill call of `prompt_len` positions (pass the padded bucket) after `start`."""
        return (
            self.prefill_overhead_s
            + self.prefill_bytes(prompt_len) / self.read_bw
            + self.prefill_flops(prompt_len, start) / self.prefill_flops_per_s
        )

    def transfer_s(self, prompt_len: float) -> float:
        """Disaggregated: one prompt's KV to the generate devices (tp shards in parallel)."""
        return prompt_len * self.kv_bytes_per_token / self.tp / self.transfer_bw

    # -- construction and storage --------------------------------------------------------------

    @classmethod
    def assumed(
        cls,
        model: ModelSpec,
        hardware: HardwareSpec,
        *,
        dtype: str = "bf16",
        tp: int = 1,
        dp: int = 1,
        efficiency: float = 1.0,
        flops_efficiency: float | None = None,
        overhead_s: float = 0.0,
        kernels: str = "auto",
        host_devices: int | None = None,
    ) -> CostModel:
        """What-if hardware with no fit: the spec's roofs times `efficiency` (bandwidth;
        `flops_efficiency` defaults to the same), `overhead_s` per step and per prefill. On a
        CPU spec the devices are virtual and share the host's roofs (`share_host`): tp * dp of
        them unless `host_devices` says more (disaggregated prefill devices on the same host)."""
        if not 0 < efficiency <= 1 or not 0 < (flops_efficiency or efficiency) <= 1:
            raise ValueError(f"efficiencies should be in (0, 1], got {efficiency}, "
                             f"{flops_efficiency}")  # fmt: skip
        hw = share_host(hardware, host_devices or tp * dp)
        peak = hw.flops(dtype) * (flops_efficiency or efficiency)
        return cls(
            **_shape(model, dtype),
            hardware=hardware.name,
            dtype=dtype,
            tp=tp,
            dp=dp,
            step_overhead_s=overhead_s,
            sync_s=0.0,
            read_bw=hw.hbm_bw * efficiency,
            decode_flops_per_s=peak,
            prefill_overhead_s=overhead_s,
            prefill_flops_per_s=peak,
            transfer_bw=hw.ici_bw,
            kernels=kernels,
            source="assumed",
            info={"efficiency": efficiency, "flops_efficiency": flops_efficiency or efficiency},
        )

    def to_dict(self) -> dict:
        """Plain YAML/JSON-able dict (`from_dict` reads it back)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        names = {f.name for f in fields(cls)}
        missing = names - set(d) - {"kernels", "source", "info"}
        if missing:
            raise ValueError(f"cost model is missing {sorted(missing)}")
        return cls(**{k: v for k, v in d.items() if k in names})


def _shape(model: ModelSpec, dtype: str) -> dict:
    """The model's bytes and FLOPs per token, from `costs` (never re-derived here)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype should be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    b = DTYPE_BYTES[dtype]
    return {
        "model": model.name,
        "weight_bytes": float(costs.param_count(model) * b),
        "kv_bytes_per_token": costs.kv_bytes_per_token(model, b),
        "flops_per_token": float(costs.flops_per_token(model)),
        "attn_flops_per_pair": costs.attention_flops(model, 1, 1, causal=False),
    }


def share_host(hardware: HardwareSpec, devices: int) -> HardwareSpec:
    """Per-device roofs when `devices` virtual CPU devices share one host: bandwidth, FLOP/s and
    memory divided among them (a GPU/TPU spec is per chip already and comes back unchanged)."""
    if devices < 1:
        raise ValueError(f"devices should be >= 1, got {devices}")
    if hardware.kind != "cpu" or devices == 1:
        return hardware
    return replace(
        hardware,
        flops_per_s={k: (v / devices if v else v) for k, v in hardware.flops_per_s.items()},
        hbm_bytes=hardware.hbm_bytes / devices,
        hbm_bw=hardware.hbm_bw / devices,
    )


# -- the fit ------------------------------------------------------------------------------------

_DECODE_TERMS = ("step_overhead_s", "sync_s", "per_byte", "per_flop")
_PREFILL_TERMS = ("prefill_overhead_s", "per_flop")


def _lstsq_nonneg(
    a: np.ndarray, y: np.ndarray, prefer: Sequence[int] = ()
) -> tuple[np.ndarray, np.ndarray]:
    """Least squares on relative error (rows divided by y) with every coefficient >= 0.

    numpy.linalg.lstsq over each subset of the columns, the full-rank, non-negative subset with
    the smallest error winning (ties: more columns, then those containing `prefer`). With at most
    four physical terms that is 15 solves, and a dropped term (0 s) is the answer a user can read:
    "no measurable overhead". Returns (coefficients, relative residuals)."""
    rel = a / y[:, None]
    ones = np.ones_like(y)
    n = a.shape[1]
    best: tuple[tuple, np.ndarray] | None = None
    for k in range(n, 0, -1):
        for cols in itertools.combinations(range(n), k):
            sub = rel[:, cols]
            if np.linalg.matrix_rank(sub) < k:
                continue
            coef, *_ = np.linalg.lstsq(sub, ones, rcond=None)
            if (coef < 0).any():
                continue
            err = float(np.sqrt(np.mean((sub @ coef - 1) ** 2)))
            key = (round(err, 9), -k, -sum(c in cols for c in prefer))
            if best is None or key < best[0]:
                full = np.zeros(n)
                full[list(cols)] = coef
                best = (key, full)
    if best is None:
        raise ValueError("no non-negative fit: are the measured times positive and varied?")
    coef = best[1]
    return coef, rel @ coef - 1


def fit(
    base: CostModel,
    decode: Sequence[DecodeSample],
    prefill: Sequence[PrefillSample] = (),
    **info: object,
) -> CostModel:
    """Fit `base`'s coefficients (its model, hardware, dtype and mesh stay) to timed calls.

    Decode needs >= 3 samples varying batch and context (and steps, to tell the per-call sync
    from the per-step overhead; with one `steps` the sync is 0 and the overhead carries it).
    Prefill needs >= 2 prompt lengths; without them the prefill keeps `base`'s rates.
    `info` (host, date, notes) is stored with the fit quality in `CostModel.info`."""
    if len(decode) < 3:
        raise ValueError(f"fit needs >= 3 timed generate calls, got {len(decode)}")
    for s in (*decode, *prefill):
        if not s.seconds > 0:
            raise ValueError(f"measured time should be > 0 s, got {s}")
    a = np.array(
        [
            [s.steps, 1.0, s.steps * base.decode_bytes(s.batch, s.context),
             s.steps * base.decode_flops(s.batch, s.context)]
            for s in decode
        ]
    )  # fmt: skip
    y = np.array([s.seconds for s in decode])
    dc, dres = _lstsq_nonneg(a, y, prefer=(0,))
    per_byte = dc[2]
    if per_byte <= 0:
        raise ValueError("fit: decode time does not grow with the bytes read; vary context")
    got = {
        "step_overhead_s": float(dc[0]),
        "sync_s": float(dc[1]),
        "read_bw": float(1 / per_byte),
        "decode_flops_per_s": float(1 / dc[3]) if dc[3] > 0 else math.inf,
    }
    quality: dict = {
        "decode_samples": len(decode),
        "decode_rms_rel_error": float(np.sqrt(np.mean(dres**2))),
        "decode_max_rel_error": float(np.abs(dres).max()),
    }
    if len({s.tokens for s in prefill}) >= 2:
        pa = np.array([[1.0, base.prefill_flops(s.tokens, s.start)] for s in prefill])
        py = np.array([s.seconds for s in prefill])
        mem = np.array([base.prefill_bytes(s.tokens) * per_byte for s in prefill])
        pc, _ = _lstsq_nonneg(pa, np.maximum(py - mem, 1e-12), prefer=(0,))
        got["prefill_overhead_s"] = float(pc[0])
        got["prefill_flops_per_s"] = float(1 / pc[1]) if pc[1] > 0 else math.inf
        pres = (pa @ pc + mem) / py - 1
        quality |= {
            "prefill_samples": len(prefill),
            "prefill_rms_rel_error": float(np.sqrt(np.mean(pres**2))),
            "prefill_max_rel_error": float(np.abs(pres).max()),
        }
    else:
        quality["notes"] = ["prefill not fitted (fewer than 2 prompt lengths): base rates kept"]
    return replace(base, **got, source="fit", info={**quality, **info})
