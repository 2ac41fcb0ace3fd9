"""The `/stats` JSON snapshot for the TUI (docs/interfaces.md), built from the scheduler's state.

Meshes and memory come from the engines' own `describe()`; devices from JAX when it is loaded
(the fake engine never loads it).
"""

from __future__ import annotations

import dataclasses
import sys
import time

from scaletui.serve.engine.engine_api import Engine, distinct
from scaletui.serve.scheduling.scheduler import Scheduler


def _devices() -> tuple[str, list[dict], list[dict]]:
    """(backend, devices, processes: each JAX process's id and device ids)."""
    if "jax" not in sys.modules:  # the fake engine never loads JAX; do not load it for a poll
        return "none", [], []
    import jax

    rows, processes = [], {}
    for d in jax.devices():
        processes.setdefault(d.process_index, []).append(d.id)
        try:
            stats = d.memory_stats()
        except Exception:  # backends without memory stats (CPU)
            stats = None
        memory = (
            {
                "bytes_in_use": int(stats.get("bytes_in_use", 0)),
                "bytes_limit": int(stats.get("bytes_limit", 0)),
            }
            if stats
            else None
        )
        rows.append({"id": d.id, "kind": d.device_kind, "platform": d.platform, "memory": memory})
    procs = [{"id": p, "devices": ids} for p, ids in sorted(processes.items())]
    return jax.default_backend(), rows, procs


def _memory(engines: tuple[Engine, Engine] | None) -> dict:
    """Totals over the distinct engines; per device: the generate engine's."""
    if engines is None:
        return {
            "weight_bytes": 0,
            "kv_cache_bytes": 0,
            "weight_bytes_per_device": 0,
            "kv_cache_bytes_per_device": 0,
        }
    infos = [e.describe() for e in distinct(engines)]
    generate = engines[1].describe()
    return {
        "weight_bytes": sum(i.weight_bytes for i in infos),
        "kv_cache_bytes": sum(i.kv_cache_bytes for i in infos),
        "weight_bytes_per_device": generate.weight_bytes_per_device,
        "kv_cache_bytes_per_device": generate.kv_cache_bytes_per_device,
    }


def build_stats(sched: Scheduler, window_s: float = 5.0) -> dict:
    c = sched.config
    now = sched.update_gauges()
    backend, devices, processes = _devices()
    # a multi-process scheduler (multihost/lockstep.py) says where its mesh is over processes
    where = getattr(sched, "placement", None)
    placement = where() if where else None
    engines = sched.engines
    meshes, running = {}, {"kernels_running": None, "kernels_note": None, "kernels_dense": None}
    if engines is not None:
        meshes = {"prefill": engines[0].describe().mesh(), "generate": engines[1].describe().mesh()}
        gen = engines[1].describe()  # what decodes: the kernels and why, when not native
        running = {"kernels_running": gen.kernels, "kernels_note": gen.kernels_note,
                   "kernels_dense": gen.kernels_dense}  # fmt: skip
    model = {k: v for k, v in dataclasses.asdict(c.model).items() if k != "extra"}
    return {
        "time": time.time(),
        "uptime_s": time.perf_counter() - sched.started,
        "state": sched.state,
        "error": sched.error,
        "config": {**c.to_json(), **running},
        "model": model,
        "backend": backend,
        "devices": devices,
        "processes": processes,
        "placement": placement,
        "mesh": meshes,
        "memory": _memory(engines),
        "slots": {"total": now["slots_total"] or c.slots, "used": now["slots_used"]},
        "kv_cache_usage_perc": now["kv_cache_usage_perc"],
        "kv_pages": sched.kv_pages(),
        "requests": {
            "waiting": now["waiting"],
            "running": now["running"],
            "transfer_backlog": now["transfer_backlog"],
            **sched.metrics.request_counts(),
        },
        "tokens": {
            "prompt_total": int(sched.metrics.counter_value(sched.metrics.prompt_tokens)),
            "generation_total": int(sched.metrics.counter_value(sched.metrics.generation_tokens)),
        },
        **sched.metrics.window(window_s),
        "compile": {**sched.compile, "buckets": list(c.prefill_buckets)},
        "speed": speed(sched),
    }


def speed(sched: Scheduler) -> dict:
    """The engine's speed against its fit: per kind (decode, prefill) measured / predicted over
    the last `window_calls` calls of it, with which fit, or why none (then no kinds)."""
    sched.relook_fit()
    model = sched.speed
    return {
        "fit": model.fit,
        "reason": model.reason,
        "window_calls": sched.metrics.speed.calls,
        **(sched.metrics.speed.summary() if model.fit else {}),
    }
