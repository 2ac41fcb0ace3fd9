"""Typed records for what crosses a process boundary as JSON: the server's `/stats` snapshot,
loadgen's 1 s windows and final summary, and the TUI's recorded session lines.

The producers keep writing the JSON shapes docs/interfaces.md fixes; readers turn a JSON object
into one of these with `from_json`, which never raises on a missing or mistyped field (a peer
server's /stats, an older recording): that field is None. Standard library only, so any part
(and any process) can import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


def number(obj: object, *path: str) -> float | None:
    """obj[path[0]][path[1]]... as a float, or None where a key is missing or not a number."""
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    if isinstance(obj, bool) or not isinstance(obj, (int, float)):
        return None
    return float(obj)


def _dict(obj: object, key: str) -> dict:
    got = obj.get(key) if isinstance(obj, dict) else None
    return got if isinstance(got, dict) else {}


@dataclass(frozen=True)
class Percentiles:
    p50: float | None = None
    p99: float | None = None

    @classmethod
    def from_json(cls, obj: object) -> Percentiles:
        return cls(number(obj, "p50"), number(obj, "p99"))


@dataclass(frozen=True)
class StatsSnapshot:
    """GET /stats, as the TUI reads it (`raw` keeps the whole object for export)."""

    state: str = "serving"
    error: str | None = None
    backend: str = "?"
    kernels: str | None = None  # the generate engine's: native | xla | none
    n_devices: int = 0
    device_bytes_limit: float | None = None  # memory of the first device
    model: dict = field(default_factory=dict)  # ModelSpec fields
    config: dict = field(default_factory=dict)  # ServerShape.to_json()
    slots_total: float | None = None
    slots_used: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # kv_cache_usage_perc, 0..1
    step_per_token_ms: float | None = None  # generate step / decode_steps
    weight_bytes_per_device: float | None = None
    kv_bytes_per_device: float | None = None
    kv_pages: dict = field(default_factory=dict)  # pages used / free / cached, prefix hits
    # the engine's speed against its fit: {fit, reason, window_calls, decode|prefill: {factor,
    # calls, seconds, predicted_seconds}}; {} from a server that does not say (not ours)
    speed: dict = field(default_factory=dict)
    processes: tuple[int, ...] = ()  # devices of each JAX process (a multi-process server)
    placement: dict = field(default_factory=dict)  # the mesh over them; {} on one process
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, obj: dict) -> StatsSnapshot:
        devices = obj.get("devices") if isinstance(obj.get("devices"), list) else []
        error = obj.get("error")
        return cls(
            state=str(obj.get("state") or "serving"),
            error=str(error) if error else None,
            backend=str(obj.get("backend") or "?"),
            kernels=_dict(_dict(obj, "mesh"), "generate").get("kernels"),
            n_devices=len(devices),
            device_bytes_limit=number(devices[0], "memory", "bytes_limit") if devices else None,
            model=_dict(obj, "model"),
            config=_dict(obj, "config"),
            slots_total=number(obj, "slots", "total"),
            slots_used=number(obj, "slots", "used"),
            waiting=number(obj, "requests", "waiting"),
            kv_usage=number(obj, "kv_cache_usage_perc"),
            step_per_token_ms=number(obj, "step_times_ms", "generate", "per_token_mean"),
            weight_bytes_per_device=number(obj, "memory", "weight_bytes_per_device"),
            kv_bytes_per_device=number(obj, "memory", "kv_cache_bytes_per_device"),
            kv_pages=_dict(obj, "kv_pages"),
            speed=_dict(obj, "speed"),
            processes=tuple(
                len(p["devices"])
                for p in (obj.get("processes") if isinstance(obj.get("processes"), list) else [])
                if isinstance(p, dict) and isinstance(p.get("devices"), list)
            ),
            placement=_dict(obj, "placement"),
            raw=obj,
        )

    @property
    def occupancy(self) -> float:
        """Slots in use as a fraction of all slots (0 when unknown)."""
        return (self.slots_used or 0.0) / max(1.0, self.slots_total or 1.0)


@dataclass(frozen=True)
class LoadWindow:
    """One loadgen `{"type": "window"}` line: the requests that finished in that second."""

    t: float | None = None  # seconds since the run started, at the window's end
    window_s: float = 1.0
    output_tok_s: float | None = None
    ttft_ms: Percentiles = Percentiles()
    tpot_ms: Percentiles = Percentiles()

    @classmethod
    def from_json(cls, obj: dict) -> LoadWindow:
        return cls(
            t=number(obj, "t"),
            window_s=number(obj, "window_s") or 1.0,
            output_tok_s=number(obj, "output_tok_s"),
            ttft_ms=Percentiles.from_json(obj.get("ttft_ms")),
            tpot_ms=Percentiles.from_json(obj.get("tpot_ms")),
        )


@dataclass(frozen=True)
class LoadSummary:
    """loadgen's last line, `{"type": "summary"}` (vLLM's key names); `raw` has every key."""

    completed: int = 0
    partial: bool = False
    median_ttft_ms: float | None = None
    p99_ttft_ms: float | None = None
    median_tpot_ms: float | None = None
    p99_tpot_ms: float | None = None
    output_throughput: float | None = None
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, obj: dict) -> LoadSummary:
        return cls(
            completed=int(number(obj, "completed") or 0),
            partial=bool(obj.get("partial")),
            median_ttft_ms=number(obj, "median_ttft_ms"),
            p99_ttft_ms=number(obj, "p99_ttft_ms"),
            median_tpot_ms=number(obj, "median_tpot_ms"),
            p99_tpot_ms=number(obj, "p99_tpot_ms"),
            output_throughput=number(obj, "output_throughput"),
            raw=obj,
        )


class RecordKind(StrEnum):
    """What a recorded session line carries."""

    STATS = "stats"  # a /stats snapshot
    WINDOW = "window"  # a loadgen window
    SUMMARY = "summary"  # a loadgen summary
    EVENT = "event"  # text for the events log and/or state changes (phase, applied knobs, ...)
    CONFIG = "config"  # a load run starts: its number, kind and knobs


@dataclass(frozen=True)
class Record:
    """One line of the TUI's session stream: `{"t", "kind", "data"}` (docs/tui.md)."""

    t: float  # seconds since the session started (arrival in the UI; pacing only)
    kind: RecordKind
    data: dict
