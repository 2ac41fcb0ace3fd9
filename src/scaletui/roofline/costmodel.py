"""The expectation (DESIGN.md §4, level 2): step times for one server configuration, from the
roofline's bytes and FLOPs over fitted (or assumed) rates plus fixed costs, or, once fitted on
this host, from the measured step times themselves. Pure arithmetic and numpy; no JAX.

The physical form (what `assumed` builds, and what a fit reports as rates):

    generate call  = sync_s + steps * decode step
    decode step    = step_overhead_s + (weights + KV read) / read_bw + FLOPs / decode_flops_per_s
    prefill call   = prefill_overhead_s + (weights + KV written) / read_bw
                     + FLOPs / prefill_flops_per_s

Bytes and FLOPs are per device and come from `costs` (weights / tp, KV and FLOPs / (tp * dp) for
a decode batch, a prompt on one tp group). On a GPU/TPU a step's cost is close to linear in the
batch, and this form is the book's. On a CPU it is not: XLA's dot runs a matrix-vector kernel at
one row and a packed GEMM above it, whose FLOP rate rises with the rows, so a step costs 9 ms at
batch 1, 18 at 4 and 46 at 32 for `small` on a 2-core EPYC (concave in the batch), and one
straight line through those errs by 20-30 % (docs/roofline.md). A fit therefore keeps, beside the
rates, the knots it measured (`costfit.fit`):

    decode_knots   = ((batch, step_s, kv_s), ...): decode step = step_s + batch * context * kv_s
                     at a measured batch; step_s and batch * kv_s linear in the batch between
                     knots
    prefill_knots  = ((tokens, seconds), ...): a prefill call at a measured bucket, interpolated
                     log-log between buckets, scaled by FLOPs past the last

and answers from them when they are there (the physical rates still say what the engine reaches,
and carry the what-ifs: other hardware, chunked prefill's attention).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

from scaletui.roofline import costs
from scaletui.specs import HardwareSpec, ModelSpec

__all__ = ["DTYPE_BYTES", "CostModel", "DecodeSample", "PrefillSample", "share_host"]

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
    decode_knots: tuple = ()  # fitted: ((batch, step_s, kv_s per row and KV position), ...)
    prefill_knots: tuple = ()  # fitted: ((tokens, seconds), ...)
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
        decode = tuple(sorted(tuple(map(float, k)) for k in self.decode_knots))
        prefill = tuple(sorted(tuple(map(float, k)) for k in self.prefill_knots))
        rows = (("decode_knots", decode, "batch, step_s, kv_s"),
                ("prefill_knots", prefill, "tokens, seconds"))  # fmt: skip
        for name, knots, columns in rows:
            width = columns.count(",") + 1
            if any(len(k) != width or k[0] < 1 or min(k[1:]) < 0 for k in knots):
                raise ValueError(f"{name} should be rows of ({columns}), sizes >= 1 and times "
                                 f">= 0, got {knots}")  # fmt: skip
        object.__setattr__(self, "decode_knots", decode)  # YAML gives lists: store sorted tuples
        object.__setattr__(self, "prefill_knots", prefill)

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
        if self.decode_knots:
            step_s, per_position_s = _decode_at(self.decode_knots, batch)
            return step_s + context * per_position_s
        return self.linear_decode_step_s(batch, context)

    def linear_decode_step_s(self, batch: float, context: float) -> float:
        """The physical form's decode step (the fitted or assumed rates, no knots)."""
        return (
            self.step_overhead_s
            + self.decode_bytes(batch, context) / self.read_bw
            + self.decode_flops(batch, context) / self.decode_flops_per_s
        )

    def decode_call_s(self, batch: float, context: float, steps: int) -> float:
        """One generate call: `steps` steps and one host sync."""
        return self.sync_s + steps * self.decode_step_s(batch, context)

    def prefill_s(self, prompt_len: float, start: float = 0) -> float:
        """One prefill call of `prompt_len` positions (pass the padded bucket) after `start`
        (a later chunk of a long prompt: its attention over the `start` cached positions is
        added at the fitted prefill FLOP/s)."""
        if not self.prefill_knots:
            return self.linear_prefill_s(prompt_len, start)
        seconds = _prefill_at(self.prefill_knots, prompt_len, self.prefill_flops)
        extra = self.prefill_flops(prompt_len, start) - self.prefill_flops(prompt_len)
        return seconds + extra / self.prefill_flops_per_s

    def linear_prefill_s(self, prompt_len: float, start: float = 0) -> float:
        """The physical form's prefill call."""
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
        d = asdict(self)
        d["decode_knots"] = [list(k) for k in self.decode_knots]
        d["prefill_knots"] = [list(k) for k in self.prefill_knots]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        names = {f.name for f in fields(cls)}
        missing = names - set(d) - {"kernels", "source", "info", "decode_knots", "prefill_knots"}
        if missing:
            raise ValueError(f"cost model is missing {sorted(missing)}")
        return cls(**{k: v for k, v in d.items() if k in names})


def _decode_at(knots: tuple, batch: float) -> tuple[float, float]:
    """(step_s, s per KV position of the whole batch) at `batch`. Between measured batches both
    are linear in the batch (exact where the cost is linear in it, as on GPUs; on a CPU's
    concave curve the chord errs a few % low between knots a factor 4 apart), so a step between
    two knots costs between their steps at any context; below the first knot, the first; past
    the last, the last segment's per-row slope continues and the KV cost grows with the rows
    (one knot: its per-row costs)."""
    b = max(batch, 1.0)
    b0, s0, k0 = knots[0]
    if b <= b0:
        return s0, b0 * k0
    b1, s1, k1 = knots[-1]
    if b >= b1:
        slope = 0.0 if len(knots) == 1 else max(s1 - knots[-2][1], 0.0) / (b1 - knots[-2][0])
        return s1 + (b - b1) * slope, b * k1
    hi = next(i for i, k in enumerate(knots) if k[0] >= b)
    (b0, s0, k0), (b1, s1, k1) = knots[hi - 1], knots[hi]
    t = (b - b0) / (b1 - b0)
    return s0 + t * (s1 - s0), b0 * k0 + t * (b1 * k1 - b0 * k0)


def _prefill_at(knots: tuple, tokens: float, flops) -> float:
    """Seconds at `tokens`: log-log between measured buckets, the first below them, and past the
    last the last one scaled by the FLOPs (`flops(tokens)`: compute grows faster than bytes)."""
    t = max(tokens, 1.0)
    if t <= knots[0][0]:
        return knots[0][1]
    if t >= knots[-1][0]:
        return knots[-1][1] * flops(t) / flops(knots[-1][0])
    hi = next(i for i, k in enumerate(knots) if k[0] >= t)
    (t0, s0), (t1, s1) = knots[hi - 1], knots[hi]
    if s0 <= 0 or s1 <= 0:
        return s0 + (s1 - s0) * (t - t0) / (t1 - t0)
    return s0 * (s1 / s0) ** (math.log(t / t0) / math.log(t1 / t0))


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
