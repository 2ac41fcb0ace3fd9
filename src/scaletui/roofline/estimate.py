"""`estimate()`: every roofline number for one serving config (model, hardware, sharding, batch).

One replica holds the model on `chips` chips: tensor parallelism `tp` shards the weights, data
parallelism `dp` (tp * dp == chips) replicates them and splits the batch. Per chip: weights / tp,
KV cache / chips. Decode step = KV time + max(weight-load, matmul), the book's form, with the TP
all-reduces (2 per layer of the B*D activations) reported as `decode_comm_s` and bounding the step
only when larger. Prefill runs one prompt on one tp group; `prefill_s` adds causal attention
FLOPs and a memory floor to the book's 2*P*T/(N*C*MFU), which `prefill_matmul_s` keeps exact.
With a `placement` over hosts (`scaletui.placement.place`), every axis that leaves a slice is
priced at the spec's DCN bandwidth (`roofline.dcn`): the tp all-reduces' DCN part beside their
ICI part (`decode_comm_dcn_s`), the KV hand-over when prefill and generate sit on different
hosts (`kv_transfer_link`); dp across hosts costs nothing per step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from scaletui.placement import Placement
from scaletui.roofline import basics, costs
from scaletui.roofline.collectives import (
    Link,
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    point_to_point_s,
)
from scaletui.roofline.dcn import activation_bytes, tp_comms, transfer_link
from scaletui.specs import HardwareSpec, ModelSpec, SpecError

__all__ = ["Estimate", "estimate", "full_hbm_step_s"]


@dataclass(frozen=True)
class Estimate:
    """Roofline figures, SI units (bytes, seconds, FLOPs). Times are per replica's chips."""

    config: dict  # the inputs: model, hardware, batch, context, prompt_len, chips, tp, dp, ...
    params: int  # total parameters P (norms included)
    params_by_part: dict  # attention, mlp, norms, embed, unembed
    param_bytes: float  # P * weight_bytes
    flops_per_token: float  # 2 * P (activated P for an MoE)
    kv_bytes_per_token: float  # 2 * L * K * H * kv_bytes
    kv_bytes_per_seq: float  # at `context` tokens
    memory_bytes: float  # weights once + KV of the batch, whole replica
    memory_per_chip_bytes: float
    weight_bytes_per_chip: float  # param_bytes / tp
    kv_bytes_per_chip: float  # batch * kv_bytes_per_seq / chips
    hbm_bytes_per_chip: float
    fits: bool  # memory_per_chip_bytes <= hbm_bytes_per_chip
    max_batch: int  # sequences of `context` tokens that fit beside the weights
    min_chips: int  # power of two whose HBM holds weights + this batch's KV
    critical_batch: float  # (C/W_hbm) * weight_bytes/2 (* E/k for an MoE)
    arithmetic_intensity: float  # decode step FLOPs / HBM bytes
    critical_intensity: float  # C / W_hbm of the hardware
    decode_weight_s: float
    decode_kv_s: float
    decode_matmul_s: float
    decode_comm_s: float  # 2 all-reduces of B/dp*D activations per layer over tp chips
    decode_comm_dcn_s: float  # their part between hosts (slices) at DCN speed; 0 within one
    decode_step_s: float  # max(kv + max(weight, matmul), comm)
    decode_bound: str  # memory | compute | comms
    decode_tokens_per_s: float  # batch / step
    decode_tokens_per_s_per_chip: float
    queries_per_s_per_chip: float  # batch / (step * decode_len * chips)
    prefill_flops: float  # 2*P*T + causal attention 2*T^2*N*H*L
    prefill_s: float  # max(compute at mfu, weight + KV-write memory time, TP comms)
    prefill_matmul_s: float  # the book's 2*P*T / (tp * C * mfu)
    prefill_comm_s: float
    prefill_comm_dcn_s: float  # its part between hosts (slices) at DCN speed
    prefill_tokens_per_s: float  # dp groups each prefilling one prompt
    ttft_s: float  # = prefill_s (no queueing)
    kv_transfer_s: float  # one prompt's KV over ICI/NVLink, tp shards in parallel
    kv_transfer_dcn_s: float | None  # the same over DCN (None: the spec's dcn_bw is unknown)
    kv_transfer_link: str  # ici | dcn: the one the placement's hand-over meets
    prefill_generate_ratio: float  # prefill replicas per generate replica (disaggregated)
    collective_bytes: float  # one decode TP all-reduce: B/dp * D * activation bytes
    all_gather_s: float  # of collective_bytes over tp chips on ICI
    all_reduce_s: float
    all_to_all_s: float
    placement: dict | None  # the placement's view (Placement.to_dict); None: all on one host

    def to_dict(self) -> dict:
        """Plain JSON-able dict: the `scaletui roofline --json` object."""
        return asdict(self)


def _check_int(name: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} should be an integer >= {low}, got {value!r}")


def _check_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} should be a number > 0, got {value!r}")


def estimate(
    model: ModelSpec,
    hardware: HardwareSpec,
    *,
    batch: int = 1,
    context: int = 1024,
    prompt_len: int = 1024,
    chips: int = 1,
    tp: int | None = None,
    dp: int = 1,
    weight_bytes: float = 2,
    kv_bytes: float = 2,
    compute_dtype: str = "bf16",
    mfu: float = 1.0,
    decode_len: int = 512,
    placement: Placement | None = None,
) -> Estimate:
    """Roofline estimate for decoding `batch` sequences holding `context` KV tokens each and
    prefilling `prompt_len`-token prompts, on one replica of `chips` chips (tp * dp), placed
    over hosts by `placement` (None: one host, every link ICI/NVLink)."""
    _check_int("batch", batch, 1)
    _check_int("context", context, 1)
    _check_int("prompt_len", prompt_len, 1)
    _check_int("chips", chips, 1)
    _check_int("dp", dp, 1)
    _check_int("decode_len", decode_len, 1)
    if tp is None:
        if chips % dp:
            raise ValueError(f"chips ({chips}) should be a multiple of dp ({dp})")
        tp = chips // dp
    _check_int("tp", tp, 1)
    if tp * dp != chips:
        raise ValueError(f"tp * dp should equal chips: {tp} * {dp} != {chips}")
    if placement is not None and (placement.tp, placement.dp) != (tp, dp):
        raise ValueError(
            f"placement is for tp={placement.tp} dp={placement.dp}, not tp={tp} dp={dp}"
        )
    _check_positive("weight_bytes", weight_bytes)
    _check_positive("kv_bytes", kv_bytes)
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu should be in (0, 1], got {mfu!r}")
    try:
        C = hardware.flops(compute_dtype)
    except SpecError as exc:
        raise ValueError(f"compute_dtype {compute_dtype!r}: {exc}") from exc
    W = hardware.hbm_bw
    D = model.d_model
    act_bytes = activation_bytes(compute_dtype)

    parts = costs.params_by_part(model)
    P = sum(parts.values())
    P_bytes = P * weight_bytes
    fpt = float(costs.flops_per_token(model))
    kv_tok = costs.kv_bytes_per_token(model, kv_bytes)
    kv_seq = kv_tok * context
    kv_batch = batch * kv_seq

    ici = Link.ici(hardware)
    coll_bytes = batch / dp * D * act_bytes
    decode_comm = tp_comms(model, hardware, batch / dp, tp, act_bytes, placement)
    comm_s = decode_comm.total_s
    step = basics.decode_step_breakdown(
        params=P,
        weight_bytes=weight_bytes,
        kv_bytes_per_seq=kv_seq,
        batch=batch,
        chips=chips,
        flops_per_s=C,
        hbm_bw=W,
        tp=tp,
        comm_s=comm_s,
        flops_per_token=fpt,
    )
    decode_flops = batch * (fpt + costs.attention_flops(model, 1, context, causal=False))
    decode_bytes = P_bytes + kv_batch

    T = prompt_len
    prefill_flops = fpt * T + costs.attention_flops(model, T, T, causal=True)
    prefill_matmul_s = fpt * T / (tp * C * mfu)
    prefill_comm = tp_comms(model, hardware, T, tp, act_bytes, placement)
    prefill_comm_s = prefill_comm.total_s
    prefill_mem_s = (P_bytes + T * kv_tok) / (tp * W)
    prefill_s = max(prefill_flops / (tp * C * mfu), prefill_mem_s, prefill_comm_s)
    prompt_kv = T * kv_tok
    hand_over, _ = transfer_link(hardware, placement)
    kv_dcn = (
        None if hardware.dcn_bw is None else point_to_point_s(prompt_kv / tp, Link.dcn(hardware))
    )

    weight_chip = P_bytes / tp
    kv_chip = kv_batch / chips
    return Estimate(
        config={
            "model": model.name,
            "hardware": hardware.name,
            "batch": batch,
            "context": context,
            "prompt_len": prompt_len,
            "decode_len": decode_len,
            "chips": chips,
            "tp": tp,
            "dp": dp,
            "weight_bytes": weight_bytes,
            "kv_bytes": kv_bytes,
            "compute_dtype": compute_dtype,
            "mfu": mfu,
            # whether the spec gives a DCN latency (else the DCN term is bandwidth only)
            "dcn_latency_known": hardware.extra.get("dcn_latency_s") is not None,
        },
        params=P,
        params_by_part=parts,
        param_bytes=P_bytes,
        flops_per_token=fpt,
        kv_bytes_per_token=kv_tok,
        kv_bytes_per_seq=kv_seq,
        memory_bytes=P_bytes + kv_batch,
        memory_per_chip_bytes=weight_chip + kv_chip,
        weight_bytes_per_chip=weight_chip,
        kv_bytes_per_chip=kv_chip,
        hbm_bytes_per_chip=hardware.hbm_bytes,
        fits=weight_chip + kv_chip <= hardware.hbm_bytes,
        max_batch=basics.max_batch(hardware.hbm_bytes, chips, P_bytes, kv_seq, tp=tp),
        min_chips=basics.min_chips(P_bytes + kv_batch, hardware.hbm_bytes),
        critical_batch=basics.critical_batch(
            C,
            W,
            weight_bytes,
            n_experts=model.n_experts,
            experts_per_token=model.experts_per_token,
        ),
        arithmetic_intensity=decode_flops / decode_bytes,
        critical_intensity=C / W,
        decode_weight_s=step.weight_s,
        decode_kv_s=step.kv_s,
        decode_matmul_s=step.matmul_s,
        decode_comm_s=step.comm_s,
        decode_comm_dcn_s=decode_comm.dcn_s,
        decode_step_s=step.step_s,
        decode_bound=step.bound,
        decode_tokens_per_s=batch / step.step_s,
        decode_tokens_per_s_per_chip=batch / step.step_s / chips,
        queries_per_s_per_chip=basics.queries_per_s_per_chip(batch, step.step_s, decode_len, chips),
        prefill_flops=prefill_flops,
        prefill_s=prefill_s,
        prefill_matmul_s=prefill_matmul_s,
        prefill_comm_s=prefill_comm_s,
        prefill_comm_dcn_s=prefill_comm.dcn_s,
        prefill_tokens_per_s=dp * T / prefill_s,
        ttft_s=prefill_s,
        kv_transfer_s=point_to_point_s(prompt_kv / tp, ici),
        kv_transfer_dcn_s=kv_dcn,
        kv_transfer_link=hand_over,
        prefill_generate_ratio=basics.prefill_generate_ratio(
            prefill_s, step.step_s, batch, decode_len
        ),
        collective_bytes=coll_bytes,
        all_gather_s=all_gather_s(coll_bytes, tp, ici),
        all_reduce_s=all_reduce_s(coll_bytes, tp, ici),
        all_to_all_s=all_to_all_s(coll_bytes, tp, ici),
        placement=placement.to_dict() if placement else None,
    )


def full_hbm_step_s(hardware: HardwareSpec) -> float:
    """Decode step floor when a chip's whole HBM is read each step: HBM / W_hbm (19.5 ms, v5e)."""
    return hardware.hbm_bytes / hardware.hbm_bw
