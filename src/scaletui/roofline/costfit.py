"""Fit a CostModel to timed engine calls (`scaletui calibrate --model M` times them; see
engine_fit.py). numpy least squares only.

Two decode fits from the same samples:
1. the physical rates (`costmodel`'s linear form: overheads, read bandwidth, FLOP/s), which say
   what the engine reaches and carry what-ifs;
2. the table: the step at each measured (batch, context) cell, with one host sync per call
   shared by all (`CostModel.decode_knots`). It answers for the configuration that was
   measured and its neighbours.
Prefill: overhead + the weight read + dense FLOPs and attention pairs at their own rates.
Both are least squares on relative error (a 5 ms step counts as much as a 50 ms one), with every
coefficient >= 0: a term that would come out negative is dropped (0 s), which reads as "not
measurable here" rather than as a negative cost.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from scaletui.roofline.band import Spread
from scaletui.roofline.costmodel import CostModel
from scaletui.roofline.samples import DecodeSample, PrefillSample

__all__ = ["fit"]


def _lstsq_subsets(
    a: np.ndarray, y: np.ndarray, prefer: Sequence[int] = ()
) -> tuple[np.ndarray, np.ndarray]:
    """Least squares on relative error (rows divided by y), every coefficient >= 0, for a few
    columns: numpy.linalg.lstsq over each subset of the columns, the full-rank non-negative
    subset with the smallest error winning (ties: more columns, then those in `prefer`). With at
    most four physical terms that is 15 solves. Returns (coefficients, relative residuals)."""
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


def _lstsq_drop_negative(a: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least squares on relative error for many columns: solve, drop the most negative
    coefficient's column (that term is 0), solve again, until none is negative. Columns without
    rank are dropped first. Returns (coefficients, relative residuals)."""
    rel = a / y[:, None]
    ones = np.ones_like(y)
    keep = [j for j in range(a.shape[1]) if np.any(rel[:, j])]
    while keep:
        coef, *_ = np.linalg.lstsq(rel[:, keep], ones, rcond=None)
        if (coef >= 0).all():
            full = np.zeros(a.shape[1])
            full[keep] = coef
            return full, rel @ full - 1
        keep.pop(int(np.argmin(coef)))
    raise ValueError("no non-negative fit: are the measured times positive and varied?")


def _quality(name: str, res: np.ndarray) -> dict:
    return {
        f"{name}_rms_rel_error": float(np.sqrt(np.mean(res**2))),
        f"{name}_max_rel_error": float(np.abs(res).max()),
    }


def _linear_decode(base: CostModel, decode: Sequence[DecodeSample]) -> tuple[dict, np.ndarray]:
    a = np.array(
        [
            [
                s.steps,
                1.0,
                s.steps * base.decode_bytes(s.batch, s.context),
                s.steps * base.decode_flops(s.batch, s.context),
            ]
            for s in decode
        ]
    )
    y = np.array([s.seconds for s in decode])
    c, res = _lstsq_subsets(a, y, prefer=(0,))
    rates = {
        "step_overhead_s": float(c[0]),
        "sync_s": float(c[1]),
        "read_bw": float(1 / c[2]) if c[2] > 0 else math.inf,  # inf: time not set by bytes
        "decode_flops_per_s": float(1 / c[3]) if c[3] > 0 else math.inf,
    }
    return rates, res


def _decode_table(decode: Sequence[DecodeSample]) -> tuple[tuple, float]:
    """(knots, sync_s): call = sync + steps * step[batch, context], one step per cell."""
    cells = sorted({(s.batch, s.context) for s in decode})
    vary_steps = len({s.steps for s in decode}) > 1
    rows = [
        [1.0 if vary_steps else 0.0]
        + [s.steps if (s.batch, s.context) == c else 0.0 for c in cells]
        for s in decode
    ]
    a, y = np.array(rows), np.array([s.seconds for s in decode])
    coef, _ = _lstsq_drop_negative(a, y)
    if not (coef[1:] > 0).all():  # noise (a longer call timed faster) pushed a step to 0 under
        # the shared sync term: without it each step is a weighted mean of seconds / steps
        coef[0], coef[1:] = 0.0, _lstsq_drop_negative(a[:, 1:], y)[0]
    knots = tuple((float(b), float(c), float(coef[1 + i])) for i, (b, c) in enumerate(cells))
    return knots, float(coef[0])


def _prefill_table(prefill: Sequence[PrefillSample]) -> tuple:
    """((tokens, seconds), ...): the median time of each prompt length timed from position 0
    (the buckets the server pads to; the physical form fills in between and for later chunks)."""
    by_len: dict[int, list[float]] = {}
    for s in prefill:
        if s.start == 0:
            by_len.setdefault(s.tokens, []).append(s.seconds)
    return tuple((float(n), float(np.median(t))) for n, t in sorted(by_len.items()))


def _prefill_rates(base: CostModel, prefill: Sequence[PrefillSample], per_byte: float) -> dict:
    """overhead + bytes * per_byte + dense FLOPs / rate + attention FLOPs / its own rate."""
    a = np.array(
        [
            [1.0, base.prefill_dense_flops(s.tokens), base.prefill_attn_flops(s.tokens, s.start)]
            for s in prefill
        ]
    )
    y = np.array([s.seconds for s in prefill])
    mem = np.array([base.prefill_bytes(s.tokens) * per_byte for s in prefill])
    c, _ = _lstsq_subsets(a, np.maximum(y - mem, 1e-12), prefer=(0,))
    dense = float(1 / c[1]) if c[1] > 0 else math.inf
    return {
        "prefill_overhead_s": float(c[0]),
        "prefill_flops_per_s": dense,
        "prefill_attn_flops_per_s": float(1 / c[2]) if c[2] > 0 else math.inf,
    }


SPREAD_QUANTILES = 32  # points of CostModel.call_spread


def call_spread(samples: Sequence[DecodeSample | PrefillSample]) -> tuple:
    """Every timed call over its point's median, pooled over the points, at SPREAD_QUANTILES
    evenly spaced quantiles (a call's variation on this host, whatever its shape); () with
    fewer than 3 calls a point on average."""
    ratios = [r for s in samples for r in s.spread]
    if len(ratios) < 3 * len(samples) or not ratios:
        return ()
    q = (np.arange(SPREAD_QUANTILES) + 0.5) / SPREAD_QUANTILES
    return tuple(round(float(x), 4) for x in np.quantile(ratios, q))


def residual_spread(residuals: dict[str, np.ndarray]) -> dict:
    """{step kind: Spread of measured / model} from relative residuals (model / measured - 1)
    per kind, as `info.residual_spread` stores them (the band's fit part, roofline/band.py).
    In-sample: the calls the fit was made from, so a floor on the model's error elsewhere."""
    return {k: Spread.of(1 / (1 + r)).to_dict() for k, r in residuals.items() if len(r)}


def fit(
    base: CostModel,
    decode: Sequence[DecodeSample],
    prefill: Sequence[PrefillSample] = (),
    *,
    knots: bool = True,
    **info: object,
) -> CostModel:
    """Fit `base`'s rates (its model, hardware, precision and mesh stay: the bytes are those
    the timed engine moved) and, with `knots`, its decode and prefill tables to timed calls.

    Decode needs >= 3 samples varying batch and context (and steps, to tell the per-call sync
    from the per-step cost; with one `steps` the sync is 0 and the step carries it). Prefill needs
    >= 2 prompt lengths; without them the prefill keeps `base`'s rates. `info` (host, date,
    notes) is stored with the fit quality in `CostModel.info`: `decode_*_error` and
    `prefill_*_error` are the errors of what the model answers with (the table when fitted),
    `linear_decode_*` those of the physical form alone; `residual_spread` the p10/p50/p90 of
    measured / model per step kind (`residual_spread`). The samples' spreads (each timed call
    over its median) make `call_spread`."""
    if len(decode) < 3:
        raise ValueError(f"fit needs >= 3 timed generate calls, got {len(decode)}")
    for s in (*decode, *prefill):
        if not s.seconds > 0:
            raise ValueError(f"measured time should be > 0 s, got {s}")
    got, lres = _linear_decode(base, decode)
    quality: dict = {"decode_samples": len(decode), **_quality("linear_decode", lres)}
    notes: list[str] = []
    if math.isinf(got["read_bw"]):
        notes.append(
            "decode time does not grow with the bytes read (fixed costs dominate): "
            "no read bandwidth fitted"
        )
    if knots:
        got["decode_knots"], got["sync_s"] = _decode_table(decode)  # the table's own sync
    if len({s.tokens for s in prefill}) >= 2:
        per_byte = 0.0 if math.isinf(got["read_bw"]) else 1 / got["read_bw"]
        got |= _prefill_rates(base, prefill, per_byte)
        quality["prefill_samples"] = len(prefill)
        if knots:
            got["prefill_knots"] = _prefill_table(prefill)
    else:
        notes.append("prefill not fitted (fewer than 2 prompt lengths): base rates kept")
    got["call_spread"] = call_spread([*decode, *prefill])
    cost = replace(base, **got, source="fit")
    dres = np.array(
        [cost.decode_call_s(s.batch, s.context, s.steps) / s.seconds - 1 for s in decode]
    )
    quality |= _quality("decode", dres)
    residuals = {"decode": dres}
    if "prefill_samples" in quality:
        pres = np.array([cost.prefill_s(s.tokens, s.start) / s.seconds - 1 for s in prefill])
        quality |= _quality("prefill", pres)
        residuals["prefill"] = pres
    quality["residual_spread"] = residual_spread(residuals)
    if notes:
        quality["notes"] = notes
    return replace(cost, info={**quality, **info})
