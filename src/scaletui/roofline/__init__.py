"""The book's roofline ("How to Scale Your Model"): pure arithmetic over specs, no JAX.

`estimate(model, hardware, ...)` answers a whole serving config (the floor); `costs` (params,
FLOPs, KV), `collectives` (all-gather, reduce-scatter, all-reduce, all-to-all) and `basics`
(T_math, critical batch, decode step, memory) are the pieces it is built from. `costmodel` is the
expectation (those bytes and FLOPs over fitted rates, `fitstore` keeps fits per host and config)
and `simulate` the prediction under load (our scheduler over a cost model).
"""

from __future__ import annotations

from scaletui.roofline.basics import (
    DecodeBreakdown,
    critical_batch,
    decode_step_breakdown,
    kv_tokens_evicted_per_step,
    matmul_crossover_batch,
    matmul_time_s,
    max_batch,
    min_chips,
    prefill_generate_ratio,
    queries_per_s_per_chip,
    t_comms,
    t_math,
)
from scaletui.roofline.collectives import (
    Link,
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    collective_intensity,
    generate_tp_limit,
    hierarchical_bw,
    latency_bound_bytes,
    point_to_point_s,
    reduce_scatter_s,
    tp_comms_limit,
)
from scaletui.roofline.costfit import fit
from scaletui.roofline.costinputs import share_host
from scaletui.roofline.costmodel import CostModel
from scaletui.roofline.costs import (
    active_param_count,
    attention_flops,
    dense_flops_per_token,
    flops_per_token,
    flops_per_token_by_part,
    kv_bytes_per_seq,
    kv_bytes_per_token,
    param_count,
    params_by_part,
)
from scaletui.roofline.estimate import Estimate, estimate, full_hbm_step_s
from scaletui.roofline.samples import DecodeSample, PrefillSample

__all__ = [
    "CostModel",
    "DecodeBreakdown",
    "DecodeSample",
    "Estimate",
    "Link",
    "PrefillSample",
    "active_param_count",
    "all_gather_s",
    "all_reduce_s",
    "all_to_all_s",
    "attention_flops",
    "collective_intensity",
    "critical_batch",
    "decode_step_breakdown",
    "dense_flops_per_token",
    "estimate",
    "fit",
    "flops_per_token",
    "flops_per_token_by_part",
    "full_hbm_step_s",
    "generate_tp_limit",
    "hierarchical_bw",
    "kv_bytes_per_seq",
    "kv_bytes_per_token",
    "kv_tokens_evicted_per_step",
    "latency_bound_bytes",
    "matmul_crossover_batch",
    "matmul_time_s",
    "max_batch",
    "min_chips",
    "param_count",
    "params_by_part",
    "point_to_point_s",
    "prefill_generate_ratio",
    "queries_per_s_per_chip",
    "reduce_scatter_s",
    "share_host",
    "t_comms",
    "t_math",
    "tp_comms_limit",
]
