"""The server's side of a stage: its Prometheus `/metrics` scraped before, during and after,
read through one table of names (ours, vLLM's, SGLang's, TGI's), reduced to stage deltas.

Counters become deltas; gauges become peaks over the scrapes (every `interval` s during the
stage); histograms become quantiles of their bucket deltas, interpolated within a bucket as
Prometheus' histogram_quantile does (a rank in the +Inf bucket gets the highest finite bound).
Label sets (model_name, engine, ...) are summed, fractions averaged. Parsing is
prometheus_client's. A server without `/metrics`, or with none of these names, gives None.
Ours also gives the stage's speed factor (its step seconds over its fit's), and per scrape
interval its `speed_timeline`: the speeds the run met, for `scaletui simulate --as-run-from`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import dataclass, field, replace
from time import perf_counter

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

# canonical name -> (kind, how label sets combine, the servers' names in order of preference).
# Counters are matched with or without `_total`. Verified names: docs/loadgen.md.
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "prefix_cache_hits": (
        "counter",
        "sum",
        ("scaletui:prefix_cache_hits", "vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
    ),
    "prefix_cache_queries": (
        "counter",
        "sum",
        (
            "scaletui:prefix_cache_queries",
            "vllm:prefix_cache_queries",
            "vllm:gpu_prefix_cache_queries",
        ),
    ),
    # servers that export a hit rate, not hits and queries (SGLang; vLLM v0)
    "prefix_cache_hit_rate": ("gauge", "mean", ("sglang:cache_hit_rate",)),
    "kv_cache_usage": (
        "gauge",
        "mean",
        (
            "scaletui:kv_cache_usage_perc",
            "vllm:kv_cache_usage_perc",
            "vllm:gpu_cache_usage_perc",
            "sglang:token_usage",
        ),
    ),
    "running": (
        "gauge",
        "sum",
        (
            "scaletui:num_requests_running",
            "vllm:num_requests_running",
            "sglang:num_running_reqs",
            "tgi_batch_current_size",
        ),
    ),
    "waiting": (
        "gauge",
        "sum",
        (
            "scaletui:num_requests_waiting",
            "vllm:num_requests_waiting",
            "sglang:num_queue_reqs",
            "tgi_queue_size",
        ),
    ),
    "preemptions": (
        "counter",
        "sum",
        ("scaletui:num_preemptions", "vllm:num_preemptions", "sglang:num_retracted_requests"),
    ),
    "prompt_tokens": (
        "counter",
        "sum",
        ("scaletui:prompt_tokens", "vllm:prompt_tokens", "sglang:prompt_tokens"),
    ),
    "generation_tokens": (
        "counter",
        "sum",
        ("scaletui:generation_tokens", "vllm:generation_tokens", "sglang:generation_tokens"),
    ),
    "ttft": (
        "histogram",
        "sum",
        (
            "scaletui:time_to_first_token_seconds",
            "vllm:time_to_first_token_seconds",
            "sglang:time_to_first_token_seconds",
        ),
    ),
    "itl": (
        "histogram",
        "sum",
        (
            "scaletui:inter_token_latency_seconds",
            "vllm:inter_token_latency_seconds",
            "vllm:time_per_output_token_seconds",
            "sglang:inter_token_latency_seconds",
            "tgi_request_mean_time_per_token_duration",  # per request's mean: a TPOT
        ),
    ),
    "queue_time": (
        "histogram",
        "sum",
        (
            "scaletui:request_queue_time_seconds",
            "vllm:request_queue_time_seconds",
            "sglang:queue_time_seconds",
            "tgi_request_queue_duration",
        ),
    ),
    "e2el": (
        "histogram",
        "sum",
        (
            "scaletui:e2e_request_latency_seconds",
            "vllm:e2e_request_latency_seconds",
            "sglang:e2e_request_latency_seconds",
            "tgi_request_duration",
        ),
    ),
}
# ours alone: each engine call's seconds and the seconds the server's fit predicted for it, by
# `kind` (decode, prefill); a stage's ratio of their deltas is the server's speed against its
# fit over the stage (docs/serve.md, "The speed factor"), `speed_factor` in the result
BY_KIND = {
    "step_seconds": "scaletui:step_seconds",
    "step_predicted_seconds": "scaletui:step_predicted_seconds",
}
QUANTILES = (0.5, 0.9, 0.99)
FLAVOURS = {"scaletui:": "scaletui", "vllm:": "vllm", "sglang:": "sglang", "tgi_": "tgi"}


@dataclass(frozen=True)
class Histogram:
    buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count), +Inf last
    sum: float
    count: float


@dataclass(frozen=True)
class Snapshot:
    """One scrape, by canonical name: counter and gauge values, histograms, the names found."""

    values: dict[str, float] = field(default_factory=dict)
    hists: dict[str, Histogram] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)  # canonical -> the server's name
    t: float = 0.0  # perf_counter when scraped


# the scrapes during a stage are for the gauges' peaks and the speed timeline alone: their text
# is cut to those lines before parsing, since a server's whole exposition (ours has 300-bucket
# latency histograms) takes prometheus_client's parser ~10 ms, time it holds the GIL from the
# event loop that sends the requests on schedule
GAUGE_NAMES = tuple(n for kind, _, names in METRICS.values() if kind == "gauge" for n in names)
DURING_NAMES = GAUGE_NAMES + tuple(f"{n}_total" for n in BY_KIND.values())


def gauge_lines(text: str) -> str:
    """`text` with only the lines (samples, HELP and TYPE) of the gauges METRICS reads and of
    our step counters."""
    keep = DURING_NAMES + tuple(f"# {w} {n}" for w in ("HELP", "TYPE") for n in DURING_NAMES)
    return "\n".join(line for line in text.splitlines() if line.startswith(keep)) + "\n"


def parse(text: str) -> Snapshot:
    """The known metrics of one Prometheus text exposition."""
    families = {}
    for fam in text_string_to_metric_families(text):
        families.setdefault(fam.name, fam)
        families.setdefault(fam.name.removesuffix("_total"), fam)  # an untyped counter
    snap = Snapshot()
    for canon, (kind, how, sources) in METRICS.items():
        name = next((n for n in sources if n in families), None)
        if name is None:
            continue
        fam = families[name]
        snap.names[canon] = name
        if kind == "histogram":
            snap.hists[canon] = _histogram(fam.samples)
            continue
        keep = {fam.name, fam.name + "_total", name, name + "_total"}
        values = [s.value for s in fam.samples if s.name in keep]
        if values:
            snap.values[canon] = sum(values) / (len(values) if how == "mean" else 1)
    for canon, name in BY_KIND.items():
        fam = families.get(name)
        for sample in fam.samples if fam else ():
            if sample.name == name + "_total" and "kind" in sample.labels:
                key = f"{canon}.{sample.labels['kind']}"
                snap.values[key] = snap.values.get(key, 0.0) + sample.value
    return snap


def _histogram(samples) -> Histogram:
    buckets: dict[float, float] = {}
    total = count = 0.0
    for s in samples:
        if s.name.endswith("_bucket"):
            le = float(s.labels["le"])
            buckets[le] = buckets.get(le, 0.0) + s.value
        elif s.name.endswith("_sum"):
            total += s.value
        elif s.name.endswith("_count"):
            count += s.value
    return Histogram(tuple(sorted(buckets.items())), total, count)


def histogram_quantile(q: float, buckets: tuple[tuple[float, float], ...]) -> float | None:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) buckets."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def deltas(
    before: Snapshot, after: Snapshot, during: list[Snapshot], origin: float | None = None
) -> dict | None:
    """The stage's server figures (the summary's `server_metrics`), None if nothing known;
    `origin` (perf_counter of the stage's schedule start) times the speed timeline."""
    if not after.names:
        return None
    prefix = next(iter(after.names.values()))
    flavour = next((f for p, f in FLAVOURS.items() if prefix.startswith(p)), None)
    out: dict = {"flavour": flavour, "names": dict(after.names), "scrapes": 2 + len(during)}
    for canon, (kind, _, _) in METRICS.items():
        if kind == "counter" and canon in after.values:
            out[canon] = after.values[canon] - before.values.get(canon, 0.0)
        elif kind == "gauge" and canon in after.values:
            seen = [s.values[canon] for s in (before, *during, after) if canon in s.values]
            out[f"{canon}_peak"] = max(seen)
        elif kind == "histogram" and canon in after.hists:
            out[f"{canon}_ms"] = _histogram_delta(after.hists[canon], before.hists.get(canon))
    hits, queries = out.get("prefix_cache_hits"), out.get("prefix_cache_queries")
    if hits is not None and queries:
        out["prefix_cache_hit_rate"] = hits / queries
    elif "prefix_cache_hit_rate" in after.values:  # the server's own rate, at the end
        out["prefix_cache_hit_rate"] = after.values["prefix_cache_hit_rate"]
    out.pop("prefix_cache_hit_rate_peak", None)
    factors = {kind: s / p for kind, (s, p) in step_deltas(before, after).items()}
    if factors:
        out["speed_factor"] = factors
        if origin is not None:
            out["speed_timeline"] = speed_timeline([before, *during, after], origin)
    return out


def step_deltas(before: Snapshot, after: Snapshot, all_: bool = False) -> dict:
    """{kind: (step seconds, predicted seconds)} the server spent between two scrapes, for the
    kinds with a prediction (`all_`: also those whose predicted seconds did not move)."""
    out = {}
    for key, predicted in after.values.items():
        if key.startswith("step_predicted_seconds."):
            kind = key.split(".", 1)[1]
            spent = after.values.get(f"step_seconds.{kind}", 0.0)
            spent -= before.values.get(f"step_seconds.{kind}", 0.0)
            predicted -= before.values.get(key, 0.0)
            if predicted > 0 or (all_ and spent > 0):
                out[kind] = (spent, predicted)
    return out


def speed_timeline(snaps: list[Snapshot], origin: float) -> list[dict]:
    """Per interval between consecutive scrapes that saw priced calls: its end (`t_s`, seconds
    after `origin`), per kind the seconds spent, the seconds predicted and their ratio (how much
    to trust it: a 1-s interval may hold one prefill; and a scrape can fall between a call's
    two counter updates, its seconds in one interval and its prediction in the next, which a
    reader evens out by merging intervals: roofline/speedtrace.py). The speeds a run met."""
    rows = []
    for a, b in zip(snaps, snaps[1:], strict=False):
        got = step_deltas(a, b, all_=True)
        if got:
            rows.append({
                "t_s": round(b.t - origin, 3),
                "factor": {k: s / p for k, (s, p) in got.items() if p > 0},
                "seconds_s": {k: s for k, (s, _) in got.items()},
                "predicted_s": {k: p for k, (_, p) in got.items()},
            })  # fmt: skip
    return rows


def _histogram_delta(after: Histogram, before: Histogram | None) -> dict:
    """count, mean and quantiles (ms) of the observations made between two scrapes."""
    was = dict(before.buckets) if before else {}
    buckets = tuple((le, n - was.get(le, 0.0)) for le, n in after.buckets)
    count = after.count - (before.count if before else 0.0)
    total = after.sum - (before.sum if before else 0.0)
    out: dict = {"count": count, "mean": total / count * 1e3 if count > 0 else None}
    for q in QUANTILES:
        value = histogram_quantile(q, buckets) if count > 0 else None
        out[f"p{q * 100:g}"] = None if value is None else value * 1e3
    return out


class Scraper:
    """Scrapes a server's /metrics for one stage: `start()`, then `finish()` -> deltas."""

    def __init__(self, session: aiohttp.ClientSession, url: str, interval: float = 1.0) -> None:
        self.session, self.url, self.interval = session, url.rstrip("/") + "/metrics", interval
        self.absent = False  # no /metrics (or no known name): stop asking
        self._before: Snapshot | None = None
        self._during: list[Snapshot] = []
        self._task: asyncio.Task | None = None

    async def scrape(self, gauges_only: bool = False) -> Snapshot | None:
        if self.absent:
            return None
        try:
            timeout = aiohttp.ClientTimeout(total=5)
            async with self.session.get(self.url, timeout=timeout) as resp:
                if resp.status != 200:
                    self.absent = True
                    return None
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError):
            return None
        t = perf_counter()
        try:  # parsing is CPU: off the loop that times the requests
            snap = await asyncio.to_thread(parse, gauge_lines(text) if gauges_only else text)
        except ValueError:  # not Prometheus text
            self.absent = True
            return None
        return replace(snap, t=t)

    async def start(self) -> None:
        self._before, self._during = await self.scrape(), []
        if self._before is not None and self._before.names and self.interval > 0:
            self._task = asyncio.create_task(self._poll())
        elif self._before is not None and not self._before.names:
            self.absent = True

    async def _poll(self) -> None:
        next_t = perf_counter() + self.interval
        while True:
            await asyncio.sleep(max(0.0, next_t - perf_counter()))
            next_t += self.interval
            snap = await self.scrape(gauges_only=True)
            if snap is not None:
                self._during.append(snap)

    async def finish(self, origin: float | None = None) -> dict | None:
        """The stage's deltas; `origin`: perf_counter of its schedule start (the timeline's 0)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._before is None:
            return None
        after = await self.scrape()
        return None if after is None else deltas(self._before, after, self._during, origin)
