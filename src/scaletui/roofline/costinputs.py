"""What a CostModel is built from: a model's bytes and FLOPs per token in a precision, and a
CPU host's roofs shared among its virtual devices. Pure arithmetic; no JAX."""

from __future__ import annotations

from dataclasses import replace

from scaletui.dtypes import DTYPE_BYTES, DTYPES, SCALE_BYTES, STORAGE_DTYPES, Precision
from scaletui.roofline import costs
from scaletui.specs import HardwareSpec, ModelSpec


def describe_precision(dtype: str, weight_dtype: str = "", kv_dtype: str = "") -> str:
    """'f32' when all three agree, else 'f32 compute, int8 weights, bf16 KV' (shape.Precision's
    `describe`; "" storage dtypes follow `dtype`)."""
    return Precision(dtype, weight_dtype or dtype, kv_dtype or dtype).describe()


def kv_token_bytes(model: ModelSpec, kv_dtype: str) -> float:
    """K and V bytes of one token, all layers, stored in `kv_dtype`; int8 adds its f32 scales,
    one per (layer, KV head) for K and one for V (what serve.memory sizes the cache by)."""
    if kv_dtype not in STORAGE_DTYPES:
        raise ValueError(f"kv_dtype should be one of {STORAGE_DTYPES}, got {kv_dtype!r}")
    scales = 2.0 * model.n_layers * model.n_kv_heads * SCALE_BYTES if kv_dtype == "int8" else 0
    return costs.kv_bytes_per_token(model, DTYPE_BYTES[kv_dtype]) + scales


def cost_inputs(model: ModelSpec, dtype: str, weight_dtype: str, kv_dtype: str) -> dict:
    """The model's bytes and FLOPs per token, from `costs` (never re-derived here): weights in
    `weight_dtype` (int8: one byte a parameter; its per-channel scales, ~0.1 % more, left out),
    KV in `kv_dtype`; FLOPs do not depend on the precision (`dtype` sets their roof)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype should be one of {DTYPES}, got {dtype!r}")
    if weight_dtype not in STORAGE_DTYPES:
        raise ValueError(f"weight_dtype should be one of {STORAGE_DTYPES}, got {weight_dtype!r}")
    return {
        "model": model.name,
        "weight_bytes": float(costs.param_count(model) * DTYPE_BYTES[weight_dtype]),
        "kv_bytes_per_token": kv_token_bytes(model, kv_dtype),
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
