"""The `/stats` JSON snapshot for the TUI (docs/interfaces.md), built from the scheduler's state.

Devices, meshes and memory come from the engines where they expose them (`mesh`,
`weight_bytes`, `kv_cache_bytes`) and from the config otherwise (the fake engine).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time

from scaletui.serve.scheduler import Scheduler

log = logging.getLogger("scaletui.serve")


def _devices() -> tuple[str, list[dict]]:
    if "jax" not in sys.modules:  # the fake engine never loads JAX; do not load it for a poll
        return "none", []
    import jax

    rows = []
    for d in jax.devices():
        try:
            stats = d.memory_stats()
        except Exception:  # backends without memory stats (CPU)
            stats = None
        memory = (
            {"bytes_in_use": int(stats.get("bytes_in_use", 0)),
             "bytes_limit": int(stats.get("bytes_limit", 0))}
            if stats else None
        )  # fmt: skip
        rows.append({"id": d.id, "kind": d.device_kind, "platform": d.platform, "memory": memory})
    return jax.default_backend(), rows


def _mesh(engine: object, tp: int, dp: int, first: int) -> dict:
    mesh = getattr(engine, "mesh", None)
    if mesh is not None and hasattr(mesh, "shape") and hasattr(mesh, "devices"):
        shape = dict(mesh.shape)
        return {
            "data": int(shape.get("data", 1)),
            "model": int(shape.get("model", 1)),
            "devices": [int(d.id) for d in mesh.devices.flat],
            "kernels": "native" if getattr(engine, "native", False) else "xla",
        }
    devices = list(range(first, first + tp * dp))
    return {"data": dp, "model": tp, "devices": devices, "kernels": "none"}  # no JAX engine


def _bytes(engine: object, key: str) -> int | None:
    """An engine's byte count, or None where it has none or fails to compute it."""
    try:
        value = getattr(engine, key, None)
    except Exception:  # a broken property must not break the TUI's poll
        log.warning("engine.%s failed", key, exc_info=True)
        return None
    return int(value) if value is not None else None


def _memory(engines: tuple[object, object] | None) -> dict:
    if engines is None:
        return {"weight_bytes": 0, "kv_cache_bytes": 0, "weight_bytes_per_device": 0,
                "kv_cache_bytes_per_device": 0}  # fmt: skip
    prefill, generate = engines
    unique = [prefill] if prefill is generate else [prefill, generate]
    out = {}
    for key in ("weight_bytes", "kv_cache_bytes"):
        out[key] = sum(_bytes(e, key) or 0 for e in unique)
        per = _bytes(generate, key + "_per_device")
        mesh = getattr(generate, "mesh", None)
        n = mesh.devices.size if hasattr(mesh, "devices") else 1
        out[key + "_per_device"] = per if per is not None else (_bytes(generate, key) or 0) // n
    return out


def build_stats(sched: Scheduler, window_s: float = 5.0) -> dict:
    c = sched.config
    now = sched.update_gauges()
    backend, devices = _devices()
    engines = sched.engines
    meshes = {}
    if engines is not None:
        p_mesh = _mesh(engines[0], c.tp, c.dp, 0)
        g_first = p_mesh["devices"][-1] + 1 if c.mode == "disaggregated" else 0
        meshes = {"prefill": p_mesh, "generate": _mesh(engines[1], c.tp, c.dp, g_first)}
    model = {k: v for k, v in dataclasses.asdict(c.model).items() if k != "extra"}
    return {
        "time": time.time(),
        "uptime_s": time.perf_counter() - sched.started,
        "state": sched.state,
        "error": sched.error,
        "config": c.public(),
        "model": model,
        "backend": backend,
        "devices": devices,
        "mesh": meshes,
        "memory": _memory(engines),
        "slots": {"total": now["slots_total"] or c.slots, "used": now["slots_used"]},
        "kv_cache_usage_perc": now["kv_cache_usage_perc"],
        "requests": {
            "waiting": now["waiting"],
            "running": now["running"],
            "transfer_backlog": now["transfer_backlog"],
            **sched.counts,
        },
        "tokens": {
            "prompt_total": int(sched.metrics.counter_value(sched.metrics.prompt_tokens)),
            "generation_total": int(sched.metrics.counter_value(sched.metrics.generation_tokens)),
        },
        **sched.metrics.window(window_s),
        "compile": {**sched.compile, "buckets": list(c.prefill_buckets)},
    }
