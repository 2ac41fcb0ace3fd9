"""Engine building, one pass in one direction: shape -> plan -> params -> engine.

1. The shape: a `ServerShape` (the caller's).
2. The plan (`plan_engines`): which engines the shape builds on these devices, each an
   `EnginePlan` (its devices, mesh, kernels), checked without building anything (a sharding
   the devices cannot hold, native kernels that cannot run raise ConfigError).
3. The params: made or read once on the host (`make_host_params`: dummy, safetensors or the
   caller's, then cast or quantized to the weight precision), then laid out and placed for
   each plan (`place_params`: packed for the native kernels, or sharded on the mesh), with the
   op set that reads them (`ops_for`). A safetensors checkpoint on a mesh (not the native
   kernels) skips the host copy: each device reads its own shard (`read_placed`).
4. The engine: `JaxEngine` over the placed params and the plan's mesh.

`build_engines` runs the four in order; `JaxEngineFactory` is the `engine_api.EngineFactory`
the scheduler drives (build, and check before a drain, memory included).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from scaletui.dtypes import default_compute_dtype as dtype_rule
from scaletui.serve.engine import memory, model, native, pallas_attention
from scaletui.serve.engine.engine_api import PROCESSED, Engine, distinct
from scaletui.serve.engine.jax_engine import JaxEngine
from scaletui.serve.weights import checkpoint, quant, sharding, weights
from scaletui.shape import ConfigError, ServerShape

log = logging.getLogger("scaletui.serve")

# the note for bf16 on XLA's CPU ops; its figures: docs/history/benchmarks-2026-12.md,
# "Held-out engine calls on Zen 4, the server's precision at each tp"
XLA_CPU_BF16 = (
    "bf16 compute on XLA's CPU ops, whose bf16 matmuls run several times slower "
    "than its f32 ones (small, tp 2, a 1-step call at batch 1: 85 ms in bf16, 14 "
    "in f32); --dtype f32 is faster here"
)


@dataclass(frozen=True)
class EnginePlan:
    """One engine of a plan."""

    role: str  # "both" (interleaved) | "prefill" | "generate"
    devices: list
    dp: int
    kernels: str  # "native" (CPU kernels) | "pallas" (JAX's paged attention) | "xla"
    note: str | None = None  # why XLA's ops run (kernels auto|native), or a native fallback
    tp: int = 1
    mesh: Mesh | None = None  # (data=dp, model=tp) over `devices`

    @property
    def platform(self) -> str:
        return self.devices[0].platform

    @property
    def native(self) -> bool:
        return self.kernels == "native"


def default_compute_dtype(
    kernels: str = "auto",
    tp: int = 1,
    dp: int = 1,
    weight_dtype: str | None = None,
    kv_dtype: str | None = None,
) -> str:
    """`dtypes.default_compute_dtype` on JAX's default backend, with the native kernels asked
    (they build on first use) whether they multiply bf16 pairs."""
    pairs = lambda: native.available() and native.bf16_dot_products()  # noqa: E731
    return dtype_rule(jax.default_backend(), pairs, kernels, tp, dp, weight_dtype, kv_dtype)


def plan_engines(config: ServerShape, devices: list) -> list[EnginePlan]:
    """The engines `config` builds on `devices`, checked without building them: a sharding the
    devices cannot hold, or kernels='native' where the native kernels cannot run, raises
    ConfigError naming the value and the fix (start-up and reconfigure ask before anything is
    bound, drained or built).
    """
    m, tp, dp = config.model, config.tp, config.dp
    pre, gen = sharding.split_devices(devices, config.mode, config.prefill_devices)
    if config.mode == "disaggregated" and len(pre) % tp:
        raise ConfigError(
            "prefill_devices",
            config.prefill_devices,
            f"prefill devices ({len(pre)}) must be a multiple of tp={tp}",
            f"use a multiple of {tp} below {len(devices)}",
        )
    platform = devices[0].platform if devices else ""
    sharding.validate(m, tp=tp, dp=dp, n_devices=len(gen), platform=platform)
    if config.mode == "interleaved":
        roles = [("both", gen[: tp * dp], dp)]
    else:
        roles = [("prefill", pre, len(pre) // tp), ("generate", gen[: tp * dp], dp)]
    plan = []
    for role, devs, d in roles:
        kernels, note = _kernels(config, devs, d, platform)
        mesh = sharding.make_mesh(devs, d, tp)
        plan.append(EnginePlan(role, devs, d, kernels, note, tp, mesh))
    return plan


def _kernels(config: ServerShape, devs: list, dp: int, platform: str) -> tuple[str, str | None]:
    """(the kernels an engine on `devs` runs, a note saying why or how) for config.kernels."""
    pallas = pallas_attention.kernel_for(platform)
    if config.kernels == "pallas":
        if pallas:
            return "pallas", f"decode attention: JAX's Pallas {pallas.upper()} paged attention"
        return "pallas", (
            "decode attention: JAX's Pallas GPU paged attention in interpret mode "
            f"on {platform or 'this platform'} (for tests: slow)"
        )
    if config.kernels == "auto" and pallas:
        return "pallas", f"decode attention: JAX's Pallas {pallas.upper()} paged attention"
    why_not = None
    if config.kernels != "xla":
        why_not = native.unusable(config, devs, dp=dp, tp=config.tp)
    if config.kernels == "native" and why_not:
        raise ConfigError(
            "kernels",
            "native",
            f"kernels='native' is not usable here: {why_not}",
            "use kernels auto or xla",
        )
    if config.kernels == "auto" and why_not is None:
        why_not = native.slower_here()  # they run, but are not tuned for this CPU
    use = config.kernels != "xla" and why_not is None
    note = f"native kernels not used: {why_not}" if why_not and not use else None
    if use and config.dtype == "bf16" and not native.bf16_dot_products():
        note = (
            "native bf16 matmuls widen to f32 FMAs (this CPU has no AVX512_BF16): "
            "the same results at f32's multiply rate"
        )
    if not use and platform == "cpu" and config.dtype == "bf16":
        note = f"{note}; {XLA_CPU_BF16}" if note else XLA_CPU_BF16
    return ("native" if use else "xla"), note


def make_host_params(config: ServerShape, given: dict | None = None) -> dict:
    """The weights on the host, once, in the config's weight precision: `given` (any float
    dtype), else read from `config.weights` (safetensors) or seeded dummies, then cast or
    quantized (`quant.convert_params`), so every mesh and mode computes with identical values."""
    m, p = config.model, config.precision
    if given is None:
        made = "f32" if p.weights == "int8" else p.weights  # int8 is quantized from f32
        if config.weights:
            given = checkpoint.load_safetensors(config.weights, m, made)
        else:
            given = weights.dummy_params(m, config.seed, made)
    return quant.convert_params(given, p.compute, p.weights)


def ops_for(plan: EnginePlan, config: ServerShape) -> model.Ops:
    """The op set an engine of `plan` runs: the native kernels (their packed layout), XLA's
    ops with decode attention on Pallas' kernel (a head-major pool; on CPU interpreted), or
    XLA's ops (on CPU unsharded, int8 / cast weights converted a panel at a time)."""
    compute = jnp.dtype(quant.JNP[config.precision.compute])
    if plan.native:
        return model.native_ops_for(compute)
    cpu = plan.platform == "cpu"
    panel = cpu and plan.tp == 1
    if plan.kernels == "pallas":  # on CPU the GPU kernel, interpreted (tests)
        kernel = pallas_attention.kernel_for(plan.platform) or "gpu"
        return model.pallas_ops(plan.mesh, kernel, compute, panel, interpret=cpu)
    return model.xla_ops(compute=compute, panel=panel, replicas=plan.dp)


def place_params(plan: EnginePlan, config: ServerShape, host: dict) -> dict:
    """`make_host_params`' weights on the plan's devices: fused and packed for the native
    kernels (on its one device), else sharded on its mesh by the rules table."""
    if plan.native:
        packed = native.pack_params(host, pairs=native.pairs_for(config.precision.compute))
        return jax.device_put(packed, plan.mesh.devices.flat[0])
    return weights.place(host, config.model, plan.mesh)


def reads_direct(plan: EnginePlan, config: ServerShape) -> bool:
    """Whether `plan`'s weights come straight from the checkpoint into its mesh: a safetensors
    checkpoint on XLA's or Pallas' ops (the native kernels pack whole matrices on the host)."""
    return bool(config.weights) and not plan.native


def read_placed(plan: EnginePlan, config: ServerShape) -> dict:
    """The checkpoint's weights on the plan's mesh, each device reading only its shard; the
    storage `make_host_params` and `place_params` would give."""
    p = config.precision
    params = checkpoint.load_placed(config.weights, config.model, plan.mesh, p.weights)
    return quant.convert_params(params, p.compute, p.weights)  # norms: the compute dtype


def build_engines(
    config: ServerShape,
    devices: list[jax.Device] | None = None,
    *,
    vocab_size: int | None = None,
    eos_ids: tuple[int, ...] = (),
    host_params: dict | None = None,
    logprobs_mode: str = PROCESSED,
) -> tuple[JaxEngine, JaxEngine]:
    """(prefill engine, generate engine); the same object twice when interleaved: the plan,
    then the host weights once (`host_params` given, whatever float dtype they come in, or
    made), placed per engine, then the engines. `vocab_size` comes from the tokenizer,
    `eos_ids` from it or the checkpoint's generation_config.json (`serve.eos_ids_for`);
    `logprobs_mode` is one of engine_api.LOGPROBS_MODES.
    """
    plan = plan_engines(config, list(devices or jax.devices()))
    for e in plan:
        if e.note and XLA_CPU_BF16 in e.note:
            log.warning("%s engine: %s", e.role, XLA_CPU_BF16)
    direct = host_params is None and all(reads_direct(e, config) for e in plan)
    host = None if direct else make_host_params(config, host_params)
    engines = [
        JaxEngine(
            config,
            read_placed(e, config) if direct else place_params(e, config, host),
            ops_for(e, config),
            e.mesh,
            role=e.role,
            vocab_size=vocab_size,
            eos_ids=eos_ids,
            kernels=e.kernels,
            kernels_note=e.note,
            logprobs_mode=logprobs_mode,
        )
        for e in plan
    ]
    return (engines[0], engines[0]) if len(engines) == 1 else (engines[0], engines[1])


@dataclass(frozen=True)
class JaxEngineFactory:
    """`engine_api.EngineFactory` for the JAX engine, told the tokenizer's vocabulary and EOS."""

    vocab_size: int | None = None  # sampling never goes beyond (default: the model's)
    eos_ids: tuple[int, ...] = ()  # sampling any of them ends a sequence
    logprobs_mode: str = PROCESSED  # what logprobs score (engine_api.LOGPROBS_MODES)
    # the devices a config's mesh takes, in mesh order (multi-process: placed over the
    # processes, serve/multihost/devices.py); None: jax.devices() in JAX's order
    devices_for: Callable[[ServerShape], list] | None = None

    def _devices(self, config: ServerShape) -> list:
        return self.devices_for(config) if self.devices_for else jax.devices()

    def build(self, config: ServerShape) -> tuple[Engine, Engine]:
        return build_engines(
            config,
            self._devices(config),
            vocab_size=self.vocab_size,
            eos_ids=self.eos_ids,
            logprobs_mode=self.logprobs_mode,
        )

    def check(self, config: ServerShape, current: tuple[Engine, Engine] | None = None) -> None:
        """The plan on these devices, then the memory it needs against what they have (on CPU
        counting the bytes the `current` engines hold, which a rebuild frees)."""
        devices = self._devices(config)
        plan = plan_engines(config, devices)
        held = sum(e.describe().held_bytes for e in distinct(current)) if current else 0
        cap = memory.capacity(devices, held)
        if cap is not None:
            memory.check_fits(config, sum(p.dp for p in plan), cap)
