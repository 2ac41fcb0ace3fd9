"""Roofline building blocks on plain numbers: T_math, T_comms, one matmul, critical batch, and the
decode / memory / serving formulas of the book's Parts 1, 7 and 8 (docs/roofline.md).

These take counts and rates, not specs, so a case with an overridden parameter count or a KV size
given directly is computed by the same code that `estimate()` uses.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

__all__ = [
    "DecodeBreakdown",
    "critical_batch",
    "decode_step_breakdown",
    "kv_tokens_evicted_per_step",
    "matmul_crossover_batch",
    "matmul_time_s",
    "max_batch",
    "min_chips",
    "prefill_generate_ratio",
    "queries_per_s_per_chip",
    "t_comms",
    "t_math",
]


def t_math(flops: float, flops_per_s: float) -> float:
    """Time to do `flops` at peak: FLOPs / C."""
    return flops / flops_per_s


def t_comms(bytes_: float, bw: float) -> float:
    """Time to move `bytes_` at `bw` bytes/s."""
    return bytes_ / bw


def matmul_time_s(
    B: int, D: int, F: int, flops_per_s: float, bw: float, bytes_per_elem: float = 2
) -> float:
    """Roofline lower bound of [B,D]x[D,F]: max(2BDF/C, (BD + DF + BF)*bytes/W)."""
    flops = 2.0 * B * D * F
    moved = (B * D + D * F + B * F) * bytes_per_elem
    return max(flops / flops_per_s, moved / bw)


def matmul_crossover_batch(
    D: int, F: int, flops_per_s: float, bw: float, bytes_per_elem: float
) -> float:
    """B at which [B,D]x[D,F] turns compute-bound, counting every byte moved: solves
    (DF + BD + BF)*bytes/W = 2BDF/C (Part 2 Q4). inf when it never does."""
    denom = 2.0 * D * F / flops_per_s - (D + F) * bytes_per_elem / bw
    return math.inf if denom <= 0 else D * F * bytes_per_elem / bw / denom


def critical_batch(
    flops_per_s: float,
    hbm_bw: float,
    weight_bytes: float = 2,
    *,
    n_experts: int = 0,
    experts_per_token: int = 0,
) -> float:
    """Tokens per replica above which the weight matmuls are compute-bound:
    (C / W_hbm) * bytes_per_weight / 2 (240 on v5e bf16), times E/k for an MoE."""
    b = flops_per_s / hbm_bw * weight_bytes / 2
    if n_experts > 0:
        b *= n_experts / max(experts_per_token, 1)
    return b


@dataclass(frozen=True)
class DecodeBreakdown:
    """One decode step on one replica, per chip, in seconds (the book's Part 7 form)."""

    weight_s: float  # weights read from HBM once per step
    kv_s: float  # the batch's KV cache read from HBM
    matmul_s: float  # 2*B*P FLOPs at peak
    comm_s: float  # tensor-parallel collectives (assumed overlapped)
    step_s: float  # max(kv_s + max(weight_s, matmul_s), comm_s)
    bound: str  # memory | compute | comms

    def to_dict(self) -> dict[str, float | str]:
        return asdict(self)


def decode_step_breakdown(
    *,
    params: float,
    weight_bytes: float,
    kv_bytes_per_seq: float,
    batch: int,
    chips: int,
    flops_per_s: float,
    hbm_bw: float,
    tp: int | None = None,
    comm_s: float = 0.0,
    flops_per_token: float | None = None,
) -> DecodeBreakdown:
    """T_step = B*KV_seq/(N*W) + max(2*B*P/(N*C), P_bytes/(tp*W)), bounded below by the TP
    collectives. Weights are sharded tp ways (replicated over data parallelism); the KV cache and
    the FLOPs spread over all N chips. With tp = N this is exactly the book's formula."""
    tp = chips if tp is None else tp
    weight_s = params * weight_bytes / (tp * hbm_bw)
    kv_s = batch * kv_bytes_per_seq / (chips * hbm_bw)
    fpt = 2.0 * params if flops_per_token is None else flops_per_token
    matmul_s = batch * fpt / (chips * flops_per_s)
    step_s = kv_s + max(weight_s, matmul_s)
    if comm_s > step_s:
        bound = "comms"
    elif matmul_s > weight_s and matmul_s > kv_s:
        bound = "compute"
    else:
        bound = "memory"
    return DecodeBreakdown(weight_s, kv_s, matmul_s, comm_s, max(step_s, comm_s), bound)


def max_batch(
    hbm_bytes: float,
    chips: int,
    param_bytes: float,
    kv_bytes_per_seq: float,
    *,
    tp: int | None = None,
) -> int:
    """Most sequences whose KV fits beside the weights: floor(N*(HBM - P_bytes/tp) / KV_seq)."""
    if not kv_bytes_per_seq > 0:
        raise ValueError(f"max_batch needs KV bytes per sequence > 0, got {kv_bytes_per_seq!r}")
    tp = chips if tp is None else tp
    free = chips * (hbm_bytes - param_bytes / tp)
    return max(math.floor(free / kv_bytes_per_seq), 0)


def min_chips(bytes_needed: float, hbm_bytes: float) -> int:
    """Smallest power-of-two chip count whose HBM holds `bytes_needed` (the book's
    min_topology = 2**ceil(log2(bytes/HBM)))."""
    if bytes_needed <= hbm_bytes:
        return 1
    return 2 ** math.ceil(math.log2(bytes_needed / hbm_bytes))


def queries_per_s_per_chip(batch: int, step_s: float, decode_len: int, chips: int) -> float:
    """Requests finished per second per chip: B / (T_step * decode_len * N)."""
    return batch / (step_s * decode_len * chips)


def prefill_generate_ratio(prefill_s: float, step_s: float, batch: int, decode_len: int) -> float:
    """Prefill servers needed per generate server so neither waits (disaggregated serving):
    prefill_latency * B / (T_step * decode_len)."""
    return prefill_s * batch / (step_s * decode_len)


def kv_tokens_evicted_per_step(batch: int, prompt_len: int, decode_len: int) -> float:
    """KV tokens freed per generate step at steady state: B/G sequences end, each P+G long."""
    return batch * (prompt_len + decode_len) / decode_len
