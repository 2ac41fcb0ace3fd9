"""The pure parts of bench/loadgen_agreement.py: a server histogram from Prometheus text, its
quantile as Prometheus' histogram_quantile computes it, each client's result file read by its
documented fields, and the comparison row."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import orjson
from prometheus_client.parser import text_string_to_metric_families

TOLERANCE = 0.05  # a client agrees when within 5% of the server


class AgreementError(Exception):
    """A file that is missing or does not say what it should; one message naming it."""


# -- the server's side ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram: cumulative counts by upper bound (the last +Inf), _sum, _count."""

    le: tuple[float, ...]  # upper bounds, ascending, ending in inf
    cumulative: tuple[float, ...]  # observations <= each bound
    sum: float
    count: float

    def minus(self, before: Histogram) -> Histogram:
        """The observations made between two scrapes of one histogram."""
        if self.le != before.le:
            raise AgreementError(f"bucket bounds changed between scrapes: {before.le} -> {self.le}")
        deltas = tuple(a - b for a, b in zip(self.cumulative, before.cumulative, strict=True))
        return Histogram(self.le, deltas, self.sum - before.sum, self.count - before.count)

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None


def histogram(text: str, name: str) -> Histogram:
    """`name`'s buckets, _sum and _count in Prometheus exposition text (unlabelled)."""
    buckets: dict[float, float] = {}
    total = count = None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name + "_bucket":
                buckets[float(s.labels["le"])] = s.value
            elif s.name == name + "_sum":
                total = s.value
            elif s.name == name + "_count":
                count = s.value
    if not buckets or total is None or count is None or math.inf not in buckets:
        raise AgreementError(f"no histogram {name} (buckets with +Inf, _sum, _count) in the text")
    le = tuple(sorted(buckets))
    return Histogram(le, tuple(buckets[b] for b in le), total, count)


def counter(text: str, name: str) -> float:
    """A counter sample's value (0 when absent: a counter not yet incremented)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                return s.value
    return 0.0


@dataclass(frozen=True)
class Quantile:
    value: float  # interpolated as histogram_quantile does
    lo: float  # the bucket it lies in: all the histogram can say is lo < x <= hi
    hi: float


def quantile(q: float, h: Histogram) -> Quantile | None:
    """Prometheus' histogram_quantile (promql/quantile.go, bucketQuantile) on one histogram:
    rank = q * total; the first bucket whose cumulative count reaches it; linear interpolation
    from its lower bound (0 for the first bucket) to its upper bound, by the rank's position in
    the bucket's own count. In the +Inf bucket: the highest finite bound. None when empty."""
    total = h.cumulative[-1]
    if total <= 0:
        return None
    rank = q * total
    b = next(i for i, c in enumerate(h.cumulative) if c >= rank)
    if b == len(h.le) - 1:
        return Quantile(h.le[-2], h.le[-2], math.inf)
    lo = h.le[b - 1] if b else 0.0
    below = h.cumulative[b - 1] if b else 0.0
    inside = h.cumulative[b] - below
    return Quantile(lo + (h.le[b] - lo) * (rank - below) / inside, lo, h.le[b])


# -- the clients' result files --------------------------------------------------------------------


@dataclass(frozen=True)
class ClientFigures:
    """What a client reported for its run, in ms."""

    client: str
    ttft_p50_ms: float
    ttft_mean_ms: float
    itl_mean_ms: float
    requests: int  # completed, measured
    prompt_tokens: float | None  # mean per request, as the client counted them
    output_tokens: float | None


def _load(path: Path) -> dict:
    try:
        return orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise AgreementError(f"{path}: {exc}") from None


def _get(doc: dict, path: Path, *keys: str | int) -> float:
    node: object = doc
    for k in keys:
        try:
            node = node[k]  # type: ignore[index]
        except (KeyError, IndexError, TypeError):
            where = ".".join(map(str, keys))
            raise AgreementError(f"{path}: no field {where}") from None
    return node  # type: ignore[return-value]


def read_loadgen(path: Path) -> ClientFigures:
    """loadgen's summary JSON (docs/loadgen.md, Metric definitions)."""
    d = _load(path)
    n = _get(d, path, "completed")
    return ClientFigures("loadgen", _get(d, path, "median_ttft_ms"), _get(d, path, "mean_ttft_ms"),
                         _get(d, path, "mean_itl_ms"), n,
                         _get(d, path, "total_input_tokens") / n if n else None,
                         _get(d, path, "total_output_tokens") / n if n else None)  # fmt: skip


def read_aiperf(folder: Path) -> ClientFigures:
    """aiperf's profile_export_aiperf.json in its artifact folder: per metric tag a dict of
    `unit`, `avg`, `p50`, ...; ITL is (request latency - TTFT) / (OSL - 1) per request."""
    path = folder / "profile_export_aiperf.json"
    d = _load(path)
    for tag in ("time_to_first_token", "inter_token_latency"):
        if _get(d, path, tag, "unit") != "ms":
            raise AgreementError(f"{path}: {tag}.unit is {d[tag]['unit']!r}, not 'ms'")
    return ClientFigures("aiperf", _get(d, path, "time_to_first_token", "p50"),
                         _get(d, path, "time_to_first_token", "avg"),
                         _get(d, path, "inter_token_latency", "avg"),
                         int(_get(d, path, "request_count", "avg")),
                         _get(d, path, "input_sequence_length", "avg"),
                         _get(d, path, "output_sequence_length", "avg"))  # fmt: skip


def read_guidellm(path: Path) -> ClientFigures:
    """guidellm's benchmarks JSON (one benchmark: one concurrency level); each metric has
    `successful` / `errored` / `incomplete` distributions with `mean`, `median`, `percentiles`.
    Its ITL distribution weights each request's (last - first token) / (tokens - 1) by its
    tokens - 1: the mean is token-weighted, as the server's."""
    d = _load(path)
    benches = _get(d, path, "benchmarks")
    if len(benches) != 1:
        raise AgreementError(f"{path}: {len(benches)} benchmarks, expected one")
    m = _get(d, path, "benchmarks", 0, "metrics")

    def ok(name: str, stat: str) -> float:
        return _get(m, path, name, "successful", stat)

    return ClientFigures("guidellm", ok("time_to_first_token_ms", "median"),
                         ok("time_to_first_token_ms", "mean"),
                         ok("inter_token_latency_ms", "mean"),
                         int(_get(m, path, "request_totals", "successful")),
                         ok("prompt_token_count", "mean"),
                         ok("output_token_count", "mean"))  # fmt: skip


READERS = {"loadgen": read_loadgen, "aiperf": read_aiperf, "guidellm": read_guidellm}


def read_result(client: str, path: Path) -> ClientFigures:
    return READERS[client](path)


# -- the comparison -------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ok(r: float | None) -> bool:
    return r is not None and abs(r - 1) <= TOLERANCE + 1e-12


def compare(
    c: ClientFigures, ttft: Histogram, itl: Histogram, prefix: tuple[float, float] | None = None
) -> dict:
    """One client's row against the server's deltas (seconds there, ms here); `prefix`: the
    deltas of the server's prefix-cache queries and hits (prompt tokens looked up, found)."""
    p50 = quantile(0.5, ttft)
    s_p50 = p50.value * 1e3 if p50 else None
    s_itl = itl.mean * 1e3 if itl.mean is not None else None
    s_ttft_mean = ttft.mean * 1e3 if ttft.mean is not None else None
    n = ttft.count
    row = {
        "client": c.client,
        "requests": c.requests,
        "server_requests": n,
        "prompt_tokens": c.prompt_tokens,
        "server_prompt_tokens": prefix[0] / n if prefix and n else None,
        "server_prefix_hit_rate": _ratio(prefix[1], prefix[0]) if prefix else None,
        "output_tokens": c.output_tokens,
        # the server counts n - 1 ITL samples and one TTFT per request
        "server_output_tokens": (itl.count + n) / n if n else None,
        "ttft_p50_ms": c.ttft_p50_ms,
        "server_ttft_p50_ms": s_p50,
        "server_ttft_bucket_ms": [p50.lo * 1e3, p50.hi * 1e3] if p50 else None,
        "ttft_ratio": _ratio(c.ttft_p50_ms, s_p50),
        "ttft_in_bucket": bool(p50 and p50.lo * 1e3 < c.ttft_p50_ms <= p50.hi * 1e3),
        "ttft_mean_ms": c.ttft_mean_ms,
        "server_ttft_mean_ms": s_ttft_mean,
        "ttft_mean_ratio": _ratio(c.ttft_mean_ms, s_ttft_mean),
        "itl_mean_ms": c.itl_mean_ms,
        "server_itl_mean_ms": s_itl,
        "itl_ratio": _ratio(c.itl_mean_ms, s_itl),
    }
    row["ttft_ok"] = _ok(row["ttft_ratio"])
    row["itl_ok"] = _ok(row["itl_ratio"])
    return row


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def table(rows: list[dict]) -> str:
    """Client vs server: TTFT p50 (with the server's bucket), TTFT mean, mean ITL; ratios are
    client / server, `ok` within the tolerance; output tokens per request, client / server."""
    head = (f"{'client':<9}{'n':>4} | {'TTFT p50 ms: client server [bucket]':<40}{'ratio':>6} ok "
            f"| {'TTFT mean ms':<15}{'ratio':>6} | {'ITL mean ms':<15}{'ratio':>6} ok")  # fmt: skip
    lines = [head]
    for r in rows:
        if "error" in r and "ttft_ratio" not in r:
            lines.append(f"{r['client']:<9}   - | error: {r['error'].splitlines()[0]}")
            continue
        lo, hi = r["server_ttft_bucket_ms"] or (None, None)
        bucket = f"[{_f(lo, '.0f')}, {_f(hi, '.0f')}]"
        lines.append(
            f"{r['client']:<9}{r['requests']:>4} | "
            f"{_f(r['ttft_p50_ms']):>8} {_f(r['server_ttft_p50_ms']):>8} {bucket:<22}"
            f"{_f(r['ttft_ratio'], '.3f'):>6} {'y' if r['ttft_ok'] else 'n':>2} | "
            f"{_f(r['ttft_mean_ms']):>7}{_f(r['server_ttft_mean_ms']):>8}"
            f"{_f(r['ttft_mean_ratio'], '.3f'):>6} | "
            f"{_f(r['itl_mean_ms']):>7}{_f(r['server_itl_mean_ms']):>8}"
            f"{_f(r['itl_ratio'], '.3f'):>6} {'y' if r['itl_ok'] else 'n':>2} | "
            f"{_f(r['output_tokens'], '.2f')}/{_f(r['server_output_tokens'], '.2f')}"
        )
    return "\n".join(lines)
