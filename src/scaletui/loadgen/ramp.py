"""--ramp-up S: the offered rate grows linearly from 0 to the stage's rate over S seconds before
the measured window, so that the server meets the full rate warm and already loaded.

The ramp's arrivals are the stage's own arrival law (Poisson, gamma, constant) run at unit rate
and mapped through the inverse of the cumulative rate Lambda(t) = R t^2 / (2 S) (time
rescaling): the k-th arrival of a unit-rate process at e_k goes at t_k = sqrt(2 S e_k / R), for
every t_k < S. Constant arrivals give t_k = sqrt(2 S k / R), k = 1, 2, ...; about R S / 2
requests in all. Ramp requests are sent like any other and excluded from every statistic (as
--warmup's); the measured window's schedule starts at S.
"""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import islice

import numpy as np

from scaletui.loadgen.request_spec import RequestSpec
from scaletui.loadgen.workload import Workload, iter_gaps, iter_requests

RAMP_SEED = 2_000_003  # the ramp's requests and arrivals: their own random streams


def ramp_offsets(
    rate: float, ramp_s: float, arrival: str = "poisson", burstiness: float = 1.0, seed: int = 0
) -> np.ndarray:
    """Send offsets (s after t0) of the ramp's requests: all < ramp_s, increasingly dense."""
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"--ramp-up needs a finite --qps rate, got {rate}")
    if ramp_s <= 0:
        return np.zeros(0)
    gaps = iter_gaps(1.0, arrival, burstiness, seed + RAMP_SEED)
    total = rate * ramp_s / 2  # Lambda(S): the ramp's expected number of requests
    out, e = [], 0.0
    while True:
        e += next(gaps)
        t = math.sqrt(2 * ramp_s * e / rate)
        if t >= ramp_s or e >= total:
            return np.array(out)
        out.append(t)


def ramp_specs(w: Workload, ramp_s: float) -> list[RequestSpec]:
    """The ramp's requests (own seed, no cancels) at the ramp's offsets, up to w.qps."""
    offsets = ramp_offsets(w.qps, ramp_s, w.arrival, w.burstiness, w.seed)
    seed_w = replace(w, seed=w.seed + RAMP_SEED, cancel_rate=0.0)
    specs = islice(iter_requests(seed_w), len(offsets))
    return [replace(s, offset=float(t)) for s, t in zip(specs, offsets, strict=False)]
