"""The JAX engine: `engine_api.Engine` over one mesh, every shape compiled ahead of time.

Each hot verb is one ahead-of-time compiled executable per shape: prefill per power-of-two
prompt bucket (plus one chunk shape for prompts past the largest bucket), insert per prefix
length, generate per KV-length bucket. `warmup()` compiles them all; afterwards a request can
only reuse them (a new shape would show in `compile_count()`). `generate` runs k decode steps in
one `fori_loop`, donates the decode state and copies one packed int32 array to the host. The
bucket is picked on the host from a mirror of the slot lengths, so no device sync picks it.
Unsharded f32 engines on CPU hold their weights in the native layout and run the native C++
kernels for matmuls and decode attention (`serve/native`, `--kernels`); others run XLA ops.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property, partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scaletui.serve import kv_cache, model, native, sampling, sharding, weights
from scaletui.serve.config import ConfigError, ServeConfig
from scaletui.serve.engine_api import Prefix, SamplingParams, StepOutput

JNP_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


@dataclass
class SlotState:
    """Decode state: device arrays (donated into each call) and a host mirror of two vectors."""

    arrays: dict
    lengths: np.ndarray  # int32 [slots], tokens in each slot's cache
    active: np.ndarray  # bool [slots]


def _pow2_buckets(lo: int, top: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < top:
        out.append(b)
        b *= 2
    return (*out, top)


def _spec(x: jax.Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


class JaxEngine:
    """One compiled model on one device mesh. role: 'both' | 'prefill' | 'generate'."""

    def __init__(
        self,
        config: ServeConfig,
        host_params: dict,
        devices: list[jax.Device],
        *,
        dp: int,
        tp: int,
        role: str = "both",
        vocab_size: int | None = None,
        eos_id: int = -1,
    ) -> None:
        m = config.model
        sharding.validate(m, tp=tp, dp=dp, n_devices=len(devices))
        self.config, self.model, self.role = config, m, role
        self.slots, self.max_seq_len = config.slots, config.max_seq_len
        # device rows: one spare, never-active row when slots == 1, because XLA drops a size-1
        # slot axis and then copies every cache chunk per step instead of updating in place
        self.rows = max(self.slots, 2)
        self.vocab_size = vocab_size or m.vocab_size  # sampling never goes beyond
        self.eos_id = eos_id
        self.devices = list(devices)
        self.mesh = sharding.make_mesh(self.devices, dp, tp)
        self.dtype = JNP_DTYPES[config.dtype]
        why_not = None  # --kernels xla: not even a compile
        if config.kernels != "xla":
            why_not = native.unusable(config, self.devices, dp=dp, tp=tp)
        if config.kernels == "native" and why_not:
            raise ValueError(f"kernels='native' is not usable here: {why_not}")
        self.native = config.kernels != "xla" and why_not is None
        if self.native:  # fused, packed weights for the native dense kernel
            self.params = jax.device_put(native.pack_params(host_params), self.mesh.devices.flat[0])
        else:
            self.params = weights.place(host_params, m, self.mesh)
        buckets = tuple(b for b in config.prefill_buckets if b <= self.max_seq_len)
        self.prefill_buckets = buckets or (self.max_seq_len,)
        self.chunk = self.prefill_buckets[-1]
        n_chunks = -(-self.max_seq_len // self.chunk)
        self.chunked_len = n_chunks * self.chunk if self.chunk < self.max_seq_len else 0
        # the cache is n_chunks chunks of kv_chunk positions (128, or a quarter of a short
        # cache); a decode bucket is 2^i leading chunks
        self.kv_chunk = min(128, max(8, 1 << (max(self.max_seq_len // 4, 1).bit_length() - 1)))
        self.n_chunks = -(-self.max_seq_len // self.kv_chunk)
        self.decode_buckets = tuple(b * self.kv_chunk for b in _pow2_buckets(1, self.n_chunks))
        self._rep = sharding.replicated(self.mesh)
        self._state_sh = kv_cache.state_shardings(
            m, self.mesh, self.rows, self.kv_chunk, self.n_chunks
        )
        self._exes: dict[tuple, object] = {}
        # (steps, vocab_size, eos_id) -> their device copies, placed once instead of every step
        self._step_args: dict[tuple[int, int, int], tuple[jax.Array, jax.Array]] = {}
        self.compile_seconds = 0.0
        self.last_step_stats: dict = {}

    # --- bookkeeping for /stats ---------------------------------------------------------------

    @property
    def mesh_shape(self) -> dict[str, int]:
        return {name: int(n) for name, n in self.mesh.shape.items()}

    @cached_property  # the weights never change; /stats asks on every poll
    def weight_bytes(self) -> int:
        """Weight bytes summed over this engine's devices (replicas counted on each)."""
        leaves = jax.tree.leaves(self.params)
        return sum(sh.data.nbytes for x in leaves for sh in x.addressable_shards)

    @cached_property
    def weight_bytes_per_device(self) -> int:
        return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(self.params))

    @property
    def kv_cache_bytes_per_device(self) -> int:
        shape = (self.rows, self.model.n_kv_heads, self.model.head_dim, self.kv_chunk + 1)
        shardings = jax.tree.leaves(self._state_sh["cache"])  # k and v chunks: same bytes
        per = sum(int(np.prod(s.shard_shape(shape))) for s in shardings)
        return per * jnp.dtype(self.dtype).itemsize

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache_bytes_per_device * len(self.devices)

    def compile_count(self) -> int:
        return len(self._exes)

    # --- compilation ----------------------------------------------------------------------------

    def _exe(self, key: tuple, fn, args: tuple, out_shardings, donate: tuple = ()) -> object:
        exe = self._exes.get(key)
        if exe is None:
            t0 = time.perf_counter()
            specs = jax.tree.map(
                lambda a: a if isinstance(a, jax.ShapeDtypeStruct) else _spec(a), args
            )
            jitted = jax.jit(fn, out_shardings=out_shardings, donate_argnums=donate)
            exe = jitted.lower(*specs).compile()
            self._exes[key] = exe
            self.compile_seconds += time.perf_counter() - t0
        return exe

    def _small(self, shape: tuple[int, ...], dtype: object) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self._rep)

    def _put(self, x: np.ndarray) -> jax.Array:
        return jax.device_put(x, self._rep)

    def _prefill_exe(self, t: int) -> object:
        if ("prefill", t) in self._exes:  # the request path: no spec building
            return self._exes[("prefill", t)]
        fn = partial(_prefill_fn, m=self.model)
        args = (
            self.params,
            self._small((t,), jnp.int32),
            self._small((4,), jnp.int32),
            self._small((2,), jnp.float32),
        )
        out = (kv_cache.prefix_shardings(self.model, self.mesh, t), self._rep)
        return self._exe(("prefill", t), fn, args, out)

    def _chunk_exes(self) -> tuple[object, object]:
        if ("chunk", self.chunk) in self._exes:
            return self._exes[("chunk_zeros", self.chunked_len)], self._exes[("chunk", self.chunk)]
        n, sh = self.chunked_len, kv_cache.prefix_shardings(self.model, self.mesh, self.chunked_len)
        shape = (n, self.model.n_kv_heads, self.model.head_dim)
        zeros = self._exe(
            ("chunk_zeros", n),
            partial(_zeros_prefix, n_layers=self.model.n_layers, shape=shape, dtype=self.dtype),
            (),
            sh,
        )
        prior = [tuple(jax.ShapeDtypeStruct(shape, self.dtype, sharding=s) for s in p) for p in sh]
        args = (
            self.params,
            self._small((self.chunk,), jnp.int32),
            self._small((5,), jnp.int32),
            self._small((2,), jnp.float32),
            prior,
        )
        step = self._exe(
            ("chunk", self.chunk),
            partial(_chunk_fn, m=self.model),
            args,
            (sh, self._rep),
            donate=(4,),
        )
        return zeros, step

    def _state_spec(self) -> dict:
        shapes = jax.eval_shape(self._empty_state)
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            shapes,
            self._state_sh,
        )

    def _empty_state(self) -> dict:
        return kv_cache.empty_state(self.model, self.rows, self.kv_chunk, self.n_chunks, self.dtype)

    def _insert_exe(self, t: int) -> object:
        if ("insert", t) in self._exes:
            return self._exes[("insert", t)]
        kv = [
            tuple(
                jax.ShapeDtypeStruct(
                    (t, self.model.n_kv_heads, self.model.head_dim), self.dtype, sharding=s
                )
                for s in p
            )
            for p in kv_cache.prefix_shardings(self.model, self.mesh, t)
        ]
        args = (
            self._state_spec(),
            kv,
            self._small((len(kv_cache.INT_FIELDS),), jnp.int32),
            self._small((2,), jnp.float32),
        )
        return self._exe(("insert", t), kv_cache.insert, args, self._state_sh, donate=(0,))

    def _generate_exe(self, bucket: int) -> object:
        if ("generate", bucket) in self._exes:
            return self._exes[("generate", bucket)]
        fn = partial(
            _generate_fn,
            m=self.model,
            n_live=bucket // self.kv_chunk,
            max_steps=self.config.decode_steps,
            max_len=self.max_seq_len,
            slots=self.slots,
            native=self.native,
        )
        args = (
            self.params,
            self._state_spec(),
            self._small((), jnp.int32),
            self._small((2,), jnp.int32),
        )
        return self._exe(("generate", bucket), fn, args, (self._state_sh, self._rep), donate=(1,))

    def _misc_exes(self) -> tuple[object, object]:
        if ("release",) in self._exes:
            return self._exes[("init",)], self._exes[("release",)]
        init = self._exe(("init",), self._empty_state, (), self._state_sh)
        rel = self._exe(
            ("release",),
            kv_cache.release,
            (self._state_spec(), self._small((), jnp.int32)),
            self._state_sh,
            donate=(0,),
        )
        return init, rel

    def _warmup_jobs(self) -> list[Callable[[], object]]:
        """One call per shape (or pair of shapes) this engine's role serves, in compile order."""
        jobs: list[Callable[[], object]] = []
        if self.role in ("both", "prefill"):
            jobs += [partial(self._prefill_exe, t) for t in self.prefill_buckets]
            jobs += [self._chunk_exes] if self.chunked_len else []
        if self.role in ("both", "generate"):
            jobs.append(self._misc_exes)
            inserts = self.prefill_buckets + ((self.chunked_len,) if self.chunked_len else ())
            jobs += [partial(self._insert_exe, t) for t in inserts]
            jobs += [partial(self._generate_exe, b) for b in self.decode_buckets]
        return jobs

    @property
    def warmup_total(self) -> int:
        """Steps `warmup` reports progress in."""
        return len(self._warmup_jobs())

    def warmup(self, progress: Callable[[int, int], None] | None = None) -> float:
        """Compile every shape this engine's role serves; returns seconds spent. `progress`
        is called with (done, total) after each step."""
        t0 = time.perf_counter()
        jobs = self._warmup_jobs()
        for i, job in enumerate(jobs, 1):
            job()
            if progress is not None:
                progress(i, len(jobs))
        return time.perf_counter() - t0

    # --- the verbs ------------------------------------------------------------------------------

    def init_decode_state(self) -> SlotState:
        init, _ = self._misc_exes()
        return SlotState(init(), np.zeros(self.rows, np.int32), np.zeros(self.rows, bool))

    def _check(self, tokens: list[int], params: SamplingParams) -> None:
        n = len(tokens)
        if not 1 <= n < self.max_seq_len:
            raise ValueError(f"prompt length must be in [1, {self.max_seq_len - 1}], got {n}")
        bad = [t for t in tokens if not 0 <= t < self.model.vocab_size]
        if bad:
            raise ValueError(f"token ids must be in [0, {self.model.vocab_size}), got {bad[:5]}")
        if params.temperature < 0 or params.top_k < 0 or not 0 < params.top_p <= 1:
            raise ValueError(
                f"need temperature >= 0, top_k >= 0, 0 < top_p <= 1; got temperature="
                f"{params.temperature} top_k={params.top_k} top_p={params.top_p}"
            )
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")

    def prefill(self, tokens: list[int], params: SamplingParams) -> Prefix:
        self._check(tokens, params)
        n = len(tokens)
        floats = self._put(np.array([params.temperature, params.top_p], np.float32))
        head = [n, params.seed % 2**31, params.top_k, self.vocab_size]
        if n <= self.chunk:
            t = next(b for b in self.prefill_buckets if b >= n)
            padded = np.zeros(t, np.int32)
            padded[:n] = tokens
            ints = self._put(np.array(head, np.int32))
            kv, tok = self._prefill_exe(t)(self.params, self._put(padded), ints, floats)
        else:
            zeros, step = self._chunk_exes()
            kv = zeros()
            padded = np.zeros(self.chunked_len, np.int32)
            padded[:n] = tokens
            for start in range(0, n, self.chunk):
                ints = self._put(np.array([*head, start], np.int32))
                chunk = self._put(padded[start : start + self.chunk])
                kv, tok = step(self.params, chunk, ints, floats, kv)
        first = int(tok)
        eos = first == self.eos_id and params.min_tokens == 0 and not params.ignore_eos
        return Prefix(kv, n, first, params, done=eos or params.max_tokens <= 1)

    def transfer(self, prefix: Prefix, to: JaxEngine) -> Prefix:
        if to is self:
            return prefix
        t = prefix.kv[0][0].shape[0]
        kv = jax.device_put(prefix.kv, kv_cache.prefix_shardings(to.model, to.mesh, t))
        return replace(prefix, kv=kv)

    def insert(self, state: SlotState, prefix: Prefix, slot: int) -> SlotState:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot must be in [0, {self.slots}), got {slot}")
        if prefix.length >= self.max_seq_len:
            raise ValueError(f"prefix length {prefix.length} >= max_seq_len {self.max_seq_len}")
        active = not prefix.done
        ints, floats = kv_cache.pack_insert_args(
            slot, prefix.length, prefix.first_token, active, prefix.params
        )
        exe = self._insert_exe(prefix.kv[0][0].shape[0])
        arrays = exe(state.arrays, prefix.kv, self._put(ints), self._put(floats))
        lengths, act = state.lengths.copy(), state.active.copy()
        lengths[slot], act[slot] = prefix.length, active
        return SlotState(arrays, lengths, act)

    def release(self, state: SlotState, slot: int) -> SlotState:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot must be in [0, {self.slots}), got {slot}")
        _, rel = self._misc_exes()
        act = state.active.copy()
        act[slot] = False
        return SlotState(rel(state.arrays, self._put(np.int32(slot))), state.lengths, act)

    def pick_bucket(self, lengths: np.ndarray, active: np.ndarray, steps: int) -> int:
        need = int(lengths[active].max(initial=0)) + steps
        return next((b for b in self.decode_buckets if b >= need), self.decode_buckets[-1])

    def generate(self, state: SlotState, steps: int) -> tuple[SlotState, StepOutput]:
        if not 1 <= steps <= self.config.decode_steps:
            raise ValueError(f"steps must be in [1, {self.config.decode_steps}], got {steps}")
        bucket = self.pick_bucket(state.lengths, state.active, steps)
        exe = self._generate_exe(bucket)
        key = (steps, self.vocab_size, self.eos_id)
        args = self._step_args.get(key)
        if args is None:
            consts = np.array([self.vocab_size, self.eos_id], np.int32)
            args = self._step_args[key] = (self._put(np.int32(steps)), self._put(consts))
        arrays, packed = exe(self.params, state.arrays, *args)
        host = np.asarray(packed)  # the one host sync
        out = host[:-1].reshape(self.config.decode_steps, 3, self.rows)[:steps]
        lengths = host[-1].copy()
        done = out[:, 2].astype(bool)
        active = state.active & ~done.any(axis=0)
        self.last_step_stats = {"bucket": bucket, "steps": steps, "active": int(state.active.sum())}
        n = self.slots
        result = StepOutput(
            out[:, 0, :n].copy(), out[:, 1, :n].astype(bool), done[:, :n], lengths[:n].copy()
        )
        return SlotState(arrays, lengths, active), result


# --- jitted bodies (pure) ---------------------------------------------------------------------


def _sample_one(logits: jax.Array, ints: jax.Array, floats: jax.Array) -> jax.Array:
    """ints: [true_len, seed, top_k, vocab_limit, ...]; the key position is the new token's."""
    one = lambda x: x[None]
    return sampling.sample(
        logits[None],
        one(ints[1]),
        one(ints[0]),
        one(floats[0]),
        one(ints[2]),
        one(floats[1]),
        ints[3],
    )[0]


def _prefill_fn(params: dict, tokens: jax.Array, ints: jax.Array, floats: jax.Array, *, m):
    logits, kv = model.prefill(params, tokens, ints[0], m)
    return kv, _sample_one(logits, ints, floats)


def _chunk_fn(params, tokens, ints, floats, prior, *, m):
    logits, kv = model.prefill(params, tokens, ints[0], m, start=ints[4], prior=prior)
    return kv, _sample_one(logits, ints, floats)


def _zeros_prefix(*, n_layers: int, shape: tuple[int, ...], dtype) -> list:
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(n_layers)]


def _generate_fn(
    params,
    state,
    n_steps,
    consts,
    *,
    m,
    n_live: int,
    max_steps: int,
    max_len: int,
    slots: int,
    native: bool,
):
    """Up to max_steps decode steps (n_steps of them run) -> (state, packed int32 array).

    packed rows: for each step s, [tokens, valid, done] (3 rows of [slots]), then lengths.
    """
    vocab_limit, eos_id = consts[0], consts[1]

    def step(i, carry):
        st, out = carry
        active = st["active"]
        pos = jnp.where(active, st["lengths"], 0)
        logits, cache = model.decode(
            params, st["cache"], st["tokens"], pos, n_live, m, slots, native=native
        )
        live = lambda a: a[:slots]
        tok = sampling.sample(
            logits,
            live(st["seed"]),
            live(pos + 1),
            live(st["temperature"]),
            live(st["top_k"]),
            live(st["top_p"]),
            vocab_limit,
        )
        tok = jnp.pad(tok, (0, pos.shape[0] - slots))  # spare rows (see JaxEngine.rows)
        lengths = st["lengths"] + active
        generated = st["generated"] + active
        eos = (tok == eos_id) & ~st["ignore_eos"] & (st["generated"] >= st["min_tokens"])
        done = active & (eos | (generated >= st["max_tokens"]) | (lengths >= max_len))
        st = dict(
            st,
            cache=cache,
            lengths=lengths,
            generated=generated,
            tokens=jnp.where(active, tok, st["tokens"]),
            active=active & ~done,
        )
        row = jnp.stack([tok, active.astype(jnp.int32), done.astype(jnp.int32)])
        return st, lax.dynamic_update_index_in_dim(out, row, i, 0)

    out = jnp.zeros((max_steps, 3, state["lengths"].shape[0]), jnp.int32)
    state, out = lax.fori_loop(0, n_steps, step, (state, out))
    return state, jnp.concatenate([out.reshape(max_steps * 3, -1), state["lengths"][None]])


def plan_engines(config: ServeConfig, devices: list) -> list[tuple[str, list, int]]:
    """[(role, devices, dp)] of the engines `config` builds on `devices`, checked without
    building them: a sharding the devices cannot hold, or kernels='native' where the native
    kernels cannot run, raises ConfigError naming the value and the fix (start-up and
    reconfigure ask before anything is bound, drained or built).
    """
    m, tp, dp = config.model, config.tp, config.dp
    pre, gen = sharding.split_devices(devices, config.mode, config.prefill_devices)
    if config.mode == "disaggregated" and len(pre) % tp:
        raise ConfigError(
            "prefill_devices", config.prefill_devices, f"prefill devices ({len(pre)}) must be "
            f"a multiple of tp={tp}", f"use a multiple of {tp} below {len(devices)}",
        )  # fmt: skip
    platform = devices[0].platform if devices else ""
    sharding.validate(m, tp=tp, dp=dp, n_devices=len(gen), platform=platform)
    if config.mode == "interleaved":
        plan = [("both", gen[: tp * dp], dp)]
    else:
        plan = [("prefill", pre, len(pre) // tp), ("generate", gen[: tp * dp], dp)]
    for _, devs, d in plan if config.kernels == "native" else ():
        why_not = native.unusable(config, devs, dp=d, tp=tp)
        if why_not:
            raise ConfigError("kernels", "native", f"kernels='native' is not usable here: "
                              f"{why_not}", "use kernels auto or xla")  # fmt: skip
    return plan


def build_engines(
    config: ServeConfig,
    devices: list[jax.Device] | None = None,
    *,
    vocab_size: int | None = None,
    eos_id: int = -1,
    host_params: dict | None = None,
) -> tuple[JaxEngine, JaxEngine]:
    """(prefill engine, generate engine); the same object twice when interleaved.

    Weights are made (or read) once on the host and placed on each mesh, so every mesh and
    mode computes with identical values. `vocab_size`/`eos_id` come from the tokenizer.
    """
    m = config.model
    plan = plan_engines(config, list(devices or jax.devices()))
    if host_params is None:
        if config.weights:
            host_params = weights.load_safetensors(config.weights, m, config.dtype)
        else:
            host_params = weights.dummy_params(m, config.seed, config.dtype)
    kw = {"vocab_size": vocab_size, "eos_id": eos_id}
    engines = [
        JaxEngine(config, host_params, devs, dp=dp, tp=config.tp, role=role, **kw)
        for role, devs, dp in plan
    ]
    return (engines[0], engines[0]) if len(engines) == 1 else (engines[0], engines[1])
