"""The expectation (docs/roofline.md, the "expected" level): step times for one server
configuration, from the roofline's bytes and FLOPs over fitted (or assumed) rates plus fixed
costs, or, once fitted on this host, from the measured step times themselves. Pure arithmetic
and numpy; no JAX.

The physical form (what `assumed` builds, and what a fit reports as rates):

    generate call  = sync_s + steps * decode step
    decode step    = step_overhead_s + (weights + KV read) / read_bw + FLOPs / decode_flops_per_s
    prefill call   = prefill_overhead_s + (weights + KV written) / read_bw
                     + FLOPs / prefill_flops_per_s

Bytes and FLOPs are per device and come from `costs` (weights / tp, KV and FLOPs / (tp * dp) for
a decode batch, a prompt on one tp group), in the server's precision: weights and KV bytes in
their storage dtypes (`weight_dtype`, `kv_dtype`; int8 KV with its scales), FLOPs at the compute
`dtype`'s roof. On a GPU/TPU a step's cost is close to linear in the
batch, and this form is the book's. On a CPU it is not: XLA's dot runs a matrix-vector kernel at
one row and a packed GEMM above it, whose FLOP rate rises with the rows, so a step is concave
in the batch, and its KV read gets cheaper per position as the context grows (concave in the
context); one plane through those errs by tens of percent (docs/roofline.md, "Three levels of
prediction", for the measured table). A fit therefore keeps,
beside the rates, the table it measured (`costfit.fit`, from `samples`' timed calls; `knots`
interpolates it):

    decode_knots = ((batch, context, step_s), ...): the decode step at measured (batch, KV
                   bucket) cells, piecewise linear in the context for each batch and then a
                   power law in the batch between batches (the server only runs KV buckets and
                   its slots)

and answers decode from it when it is there. Prefill keeps the physical form, with the causal
attention's (query, key) pairs given their own fitted rate (`prefill_attn_flops_per_s`): XLA
materialises the [T, T] scores, so attention costs far more per FLOP than the dense GEMMs and
a prompt's time is overhead + a T term + a T^2 term.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

from scaletui.dtypes import DTYPES, STORAGE_DTYPES
from scaletui.roofline.costinputs import cost_inputs, describe_precision, share_host
from scaletui.roofline.knots import along, decode_at
from scaletui.specs import HardwareSpec, ModelSpec

__all__ = ["CostModel"]


@dataclass(frozen=True)
class CostModel:
    """Expected step times for one server configuration (model, hardware, precision, tp, dp).

    Build it with `assumed(...)` (spec roofs times efficiencies) or `fit(...)` (measured steps);
    `to_dict`/`from_dict` round-trip it through YAML.
    """

    model: str
    hardware: str
    dtype: str  # f32 | bf16: the compute dtype (its FLOP roof); weights and KV unless set below
    tp: int
    dp: int
    weight_bytes: float  # the whole model's weights, bytes (param_count * weight_dtype bytes)
    kv_bytes_per_token: float  # K and V of one token, all layers, bytes (int8: with scales)
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
    decode_knots: tuple = ()  # fitted: ((batch, context, step_s), ...)
    prefill_attn_flops_per_s: float = 0.0  # fitted: attention FLOP/s in prefill (0: as dense)
    prefill_knots: tuple = ()  # fitted: ((prompt tokens, seconds), ...) timed from position 0
    weight_dtype: str = ""  # f32 | bf16 | int8: weight storage; "" = dtype (resolved at init)
    kv_dtype: str = ""  # f32 | bf16 | int8: KV-cache storage; "" = dtype (resolved at init)
    # fitted: a call's time over its expected (median) time, at evenly spaced quantiles of
    # every timed call; the simulator draws each call's from it. Empty: calls take their
    # expected time
    call_spread: tuple = ()
    # the DCN term (roofline.dcn): a tp group over hosts all-reduces across them every step,
    # which no one-host fit holds: seconds per decode step, fixed and per row of a replica
    dcn_step_s: float = 0.0
    dcn_row_s: float = 0.0
    info: dict = field(default_factory=dict, compare=False)  # fit quality, date, host, notes

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype should be one of {DTYPES}, got {self.dtype!r}")
        object.__setattr__(self, "weight_dtype", self.weight_dtype or self.dtype)
        object.__setattr__(self, "kv_dtype", self.kv_dtype or self.dtype)
        for name in ("weight_dtype", "kv_dtype"):
            if vars(self)[name] not in STORAGE_DTYPES:
                raise ValueError(
                    f"{name} should be one of {STORAGE_DTYPES} (or empty: "
                    f"dtype), got {vars(self)[name]!r}"
                )
        for name in ("read_bw", "decode_flops_per_s", "prefill_flops_per_s", "transfer_bw"):
            if not vars(self)[name] > 0:
                raise ValueError(f"{name} should be > 0, got {vars(self)[name]!r}")
        for name in ("step_overhead_s", "sync_s", "prefill_overhead_s"):
            if vars(self)[name] < 0:
                raise ValueError(f"{name} should be >= 0, got {vars(self)[name]!r}")
        if self.tp < 1 or self.dp < 1:
            raise ValueError(f"tp and dp should be >= 1, got tp={self.tp} dp={self.dp}")
        knots = tuple(sorted(tuple(map(float, k)) for k in self.decode_knots))
        if any(len(k) != 3 or k[0] < 1 or k[1] < 0 or k[2] < 0 for k in knots):
            raise ValueError(
                f"decode_knots should be rows of (batch >= 1, context >= 0, "
                f"step_s >= 0), got {self.decode_knots}"
            )
        object.__setattr__(self, "decode_knots", knots)  # YAML gives lists: sorted tuples
        pknots = tuple(sorted(tuple(map(float, k)) for k in self.prefill_knots))
        if any(len(k) != 2 or k[0] < 1 or not k[1] > 0 for k in pknots):
            raise ValueError(
                f"prefill_knots should be rows of (tokens >= 1, seconds > 0), got "
                f"{self.prefill_knots}"
            )
        object.__setattr__(self, "prefill_knots", pknots)
        spread = tuple(sorted(map(float, self.call_spread)))
        if any(not x > 0 for x in spread):
            raise ValueError(f"call_spread should be ratios > 0, got {self.call_spread}")
        object.__setattr__(self, "call_spread", spread)
        if self.prefill_attn_flops_per_s < 0:
            raise ValueError(
                f"prefill_attn_flops_per_s should be >= 0 (0: as dense), got "
                f"{self.prefill_attn_flops_per_s}"
            )

    def describe_precision(self) -> str:
        """'f32' when compute, weights and KV agree, else 'bf16 compute, int8 weights, bf16 KV'."""
        return describe_precision(self.dtype, self.weight_dtype, self.kv_dtype)

    # -- what one step moves and computes, per device ------------------------------------------

    def decode_bytes(self, batch: float, context: float) -> float:
        return (self.weight_bytes + batch * context * self.kv_bytes_per_token / self.dp) / self.tp

    def decode_flops(self, batch: float, context: float) -> float:
        per_row = self.flops_per_token + context * self.attn_flops_per_pair
        return batch * per_row / (self.tp * self.dp)

    def prefill_bytes(self, tokens: float) -> float:
        return (self.weight_bytes + tokens * self.kv_bytes_per_token) / self.tp

    def prefill_flops(self, tokens: float, start: float = 0) -> float:
        return self.prefill_dense_flops(tokens) + self.prefill_attn_flops(tokens, start)

    def prefill_dense_flops(self, tokens: float) -> float:
        return self.flops_per_token * tokens / self.tp

    def prefill_attn_flops(self, tokens: float, start: float = 0) -> float:
        pairs = tokens * start + tokens * tokens / 2  # causal over the new tokens
        return pairs * self.attn_flops_per_pair / self.tp

    # -- expected times ------------------------------------------------------------------------

    def decode_step_s(self, batch: float, context: float) -> float:
        """One decode step of `batch` rows reading `context` KV positions each."""
        base = (
            decode_at(self.decode_knots, batch, context)
            if self.decode_knots
            else self.linear_decode_step_s(batch, context)
        )
        return base + self.dcn_decode_s(batch)

    def dcn_decode_s(self, batch: float) -> float:
        """The decode step's DCN term: 0 unless a tp group spans hosts (`with_dcn`)."""
        return self.dcn_step_s + batch / self.dp * self.dcn_row_s

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
        (a later chunk of a long prompt attends to the `start` cached positions too). With
        `prefill_knots` the physical form is scaled by measured / form at the timed lengths
        (between two, straight in log tokens; flat past the ends): exact where timed, the
        form's shape between them and for `start`."""
        s = self.linear_prefill_s(prompt_len, start)
        if not self.prefill_knots:
            return s
        ratios = [(math.log(n), t / self.linear_prefill_s(n)) for n, t in self.prefill_knots]
        return s * along(ratios, math.log(max(prompt_len, 1.0)), flat_past=True)

    def linear_prefill_s(self, prompt_len: float, start: float = 0) -> float:
        """The physical form's prefill call (the fitted or assumed rates, no knots)."""
        attn_rate = self.prefill_attn_flops_per_s or self.prefill_flops_per_s
        return (
            self.prefill_overhead_s
            + self.prefill_bytes(prompt_len) / self.read_bw
            + self.prefill_dense_flops(prompt_len) / self.prefill_flops_per_s
            + self.prefill_attn_flops(prompt_len, start) / attn_rate
        )

    def transfer_s(self, prompt_len: float) -> float:
        """Disaggregated: one prompt's KV to the generate devices (tp shards in parallel)."""
        return prompt_len * self.kv_bytes_per_token / self.tp / self.transfer_bw

    def scaled(self, decode: float, prefill: float) -> CostModel:
        """The same model on a host `decode` (`prefill`) times slower at generate (prefill)
        calls: every decode time scales exactly; a prefill scales exactly at its timed lengths
        (its knots) and where the form has no weight-read term. Used to ask what the simulator
        says at the engine speed a run measured, apart from the speed the fit saw."""
        if not (decode > 0 and prefill > 0):
            raise ValueError(f"scale factors should be > 0, got decode={decode} prefill={prefill}")
        return replace(
            self,
            step_overhead_s=self.step_overhead_s * decode,
            sync_s=self.sync_s * decode,
            read_bw=self.read_bw / decode,
            decode_flops_per_s=self.decode_flops_per_s / decode,
            decode_knots=tuple((b, c, s * decode) for b, c, s in self.decode_knots),
            prefill_overhead_s=self.prefill_overhead_s * prefill,
            prefill_flops_per_s=self.prefill_flops_per_s / prefill,
            prefill_attn_flops_per_s=self.prefill_attn_flops_per_s / prefill,
            prefill_knots=tuple((n, s * prefill) for n, s in self.prefill_knots),
            info={**self.info, "scaled": {"decode": decode, "prefill": prefill}},
        )

    # -- construction and storage --------------------------------------------------------------

    @classmethod
    def assumed(
        cls,
        model: ModelSpec,
        hardware: HardwareSpec,
        *,
        dtype: str = "bf16",
        weight_dtype: str | None = None,
        kv_dtype: str | None = None,
        tp: int = 1,
        dp: int = 1,
        efficiency: float = 1.0,
        flops_efficiency: float | None = None,
        overhead_s: float = 0.0,
        kernels: str = "auto",
        host_devices: int | None = None,
    ) -> CostModel:
        """What-if hardware with no fit: the spec's roofs times `efficiency` (bandwidth;
        `flops_efficiency` defaults to the same), `overhead_s` per step and per prefill. Bytes
        in `weight_dtype` and `kv_dtype` (None: `dtype`), FLOPs at the `dtype` roof. On a
        CPU spec the devices are virtual and share the host's roofs (`share_host`): tp * dp of
        them unless `host_devices` says more (disaggregated prefill devices on the same host)."""
        if not 0 < efficiency <= 1 or not 0 < (flops_efficiency or efficiency) <= 1:
            raise ValueError(
                f"efficiencies should be in (0, 1], got {efficiency}, {flops_efficiency}"
            )
        weight_dtype, kv_dtype = weight_dtype or dtype, kv_dtype or dtype
        shape = cost_inputs(model, dtype, weight_dtype, kv_dtype)  # checks the dtypes first
        hw = share_host(hardware, host_devices or tp * dp)
        peak = hw.flops(dtype) * (flops_efficiency or efficiency)
        return cls(
            **shape,
            hardware=hardware.name,
            dtype=dtype,
            weight_dtype=weight_dtype,
            kv_dtype=kv_dtype,
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
        d["call_spread"] = list(self.call_spread)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        names = {f.name for f in fields(cls)}
        optional = {
            "kernels",
            "source",
            "info",
            "decode_knots",
            "prefill_attn_flops_per_s",
            "weight_dtype",
            "kv_dtype",
            "prefill_knots",
            "call_spread",
            "dcn_step_s",
            "dcn_row_s",
        }
        missing = names - set(d) - optional
        if missing:
            raise ValueError(f"cost model is missing {sorted(missing)}")
        return cls(**{k: v for k, v in d.items() if k in names})
