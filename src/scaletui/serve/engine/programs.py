"""The JAX engine's compiled programs: one ahead-of-time executable per verb and shape.

`EnginePrograms` is the half of `JaxEngine` (jax_engine.py) that lowers and caches: each `_*_exe`
builds its program from the jitted bodies in steps.py, kv_cache.py and slot_state.py, with this
engine's shapes (buckets, rows, pages) and shardings, compiles it once and keeps it by (verb,
shape); `warmup()` compiles every shape the engine's role serves and runs each once (warm.py).
It reads the attributes `JaxEngine.__init__` sets (config, model, mesh, ops, params, buckets,
dtypes).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import cached_property, partial

import jax
import jax.numpy as jnp
import numpy as np

from scaletui import policy
from scaletui.serve.engine import kv_cache, model, slot_state, steps, warm
from scaletui.serve.engine.slot_state import DecodeState
from scaletui.serve.engine.steps import PrefillArgs, StepConsts
from scaletui.serve.weights import sharding


class EnginePrograms:
    """The compiled programs of one `JaxEngine` (a mixin: the engine holds the state)."""

    def _exe(self, key: tuple, fn, args: tuple, out_shardings, donate: tuple = ()) -> object:
        exe = self._exes.get(key)
        if exe is None:
            t0 = time.perf_counter()
            spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
            specs = jax.tree.map(
                lambda a: a if isinstance(a, jax.ShapeDtypeStruct) else spec(a), args
            )
            jitted = jax.jit(fn, out_shardings=out_shardings, donate_argnums=donate)
            exe = jitted.lower(*specs).compile()
            self._exes[key] = exe
            self.compile_seconds += time.perf_counter() - t0
        return exe

    def _small(self, shape: tuple[int, ...], dtype: object) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self._rep)

    def _put(self, x: object) -> object:
        return jax.device_put(x, self._rep)

    def _device_table(self, table: np.ndarray) -> jax.Array:
        """The device copy of `table`: the last call's when it is the same (tables change
        only as sequences cross a page boundary, join or leave), so most calls copy none."""
        last = self._last_table
        if last is None or last[0].shape != table.shape or not np.array_equal(last[0], table):
            last = self._last_table = (table, jax.device_put(table, self._table_sh(table.shape)))
        return last[1]

    def _prefill_exe(self, t: int) -> object:
        if ("prefill", t) in self._exes:  # the request path: no spec building
            return self._exes[("prefill", t)]
        fn = partial(steps.prefill, m=self.model, ops=self.ops, kv_dtype=self.kv_dtype)
        args = (self.params, self._small((t,), jnp.int32), self._args_spec())
        out = (self._prefix_sh(t), self._rep, self._rep)
        return self._exe(("prefill", t), fn, args, out)

    def _chunk_exes(self) -> tuple[object, object]:
        if ("chunk", self.chunk) in self._exes:
            return self._exes[("chunk_zeros", self.chunked_len)], self._exes[("chunk", self.chunk)]
        n, sh = self.chunked_len, self._prefix_sh(self.chunked_len)
        fn = partial(kv_cache.zeros_prefix, self.model, n, self.kv_dtype)
        zeros = self._exe(("chunk_zeros", n), fn, (), sh)
        args = (
            self.params,
            self._small((self.chunk,), jnp.int32),
            self._args_spec(),
            self._kv_spec(n),
        )
        fn = partial(steps.prefill_chunk, m=self.model, ops=self.ops, kv_dtype=self.kv_dtype)
        out = (sh, self._rep, self._rep)
        step = self._exe(("chunk", self.chunk), fn, args, out, donate=(3,))
        return zeros, step

    def _table_sh(self, shape: tuple[int, int]) -> object:
        """Page tables [rows, W]: each replica's rows beside its pages."""
        return sharding.named(self.mesh, ("slots", None), shape)

    def _prefix_sh(self, t: int) -> list:
        return kv_cache.prefix_shardings(self.model, self.mesh, t, self.kv_dtype)

    def zero_kv(self, t: int) -> list:
        """A prefix's K/V of `t` rows, all zeros, placed as a prefill would leave it."""
        return jax.tree.map(
            lambda s: jax.device_put(np.zeros(s.shape, s.dtype), s.sharding), self._kv_spec(t)
        )

    def _kv_spec(self, t: int) -> list:
        """A prefix's per-layer (k, v) [t, K, H] (int8: and scales [t, K]) as shape specs."""
        return [
            tuple(
                jax.ShapeDtypeStruct(shape, dt, sharding=sh)
                for (shape, dt), sh in zip(layer, shs, strict=True)
            )
            for layer, shs in zip(
                kv_cache.prefix_spec(self.model, t, self.kv_dtype), self._prefix_sh(t), strict=True
            )
        ]

    def _args_spec(self, shape: tuple[int, ...] = ()) -> PrefillArgs:
        i32, f32 = self._small(shape, jnp.int32), self._small(shape, jnp.float32)
        return PrefillArgs(i32, i32, i32, f32, f32, i32, i32, i32, i32, i32)

    def _state_spec(self) -> DecodeState:
        shapes = jax.eval_shape(self._empty_state)
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            shapes,
            self._state_sh,
        )

    def _empty_state(self) -> DecodeState:
        pages = self.replicas * self.pages
        return kv_cache.empty_state(
            self.model,
            self.rows,
            pages,
            self.page_size,
            self.kv_dtype,
            self.ops.layout,
            self.kv_bits,
        )

    def _insert_exe(self, t: int) -> object:
        if ("insert", t) in self._exes:
            return self._exes[("insert", t)]
        ints = self._small((len(slot_state.INT_FIELDS),), jnp.int32)
        floats = self._small((len(slot_state.FLOAT_FIELDS),), jnp.float32)
        pages = self._small((-(-t // self.page_size),), jnp.int32)
        args = (self._state_spec(), self._kv_spec(t), ints, floats, pages)
        fn = partial(kv_cache.insert, layout=self.ops.layout)
        return self._exe(("insert", t), fn, args, self._state_sh, donate=(0,))

    def _step_fn_and_args(self, step: Callable, bucket: int) -> tuple[Callable, tuple]:
        """A generate program's function (`steps.generate` or `generate_mixed`) and its first
        arguments at KV bucket `bucket`: params, state, step constants, page table."""
        fn = partial(
            step,
            m=self.model,
            ops=self.ops,
            max_steps=self.config.decode_steps,
            max_len=self.max_seq_len,
            slots=self.slots,
        )
        i32 = self._small((), jnp.int32)
        shape = (self.rows, bucket // self.page_size)
        table = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self._table_sh(shape))
        eos = self._small(steps.eos_row(self.eos_ids).shape, jnp.int32)
        return fn, (self.params, self._state_spec(), StepConsts(i32, i32, eos), table)

    def _generate_exe(self, bucket: int) -> object:
        if ("generate", bucket) in self._exes:
            return self._exes[("generate", bucket)]
        fn, args = self._step_fn_and_args(steps.generate, bucket)
        out = (self._state_sh, self._rep, self._rep)
        return self._exe(("generate", bucket), fn, args, out, donate=(1,))

    def _mixed_exe(self, bucket: int) -> object:
        """generate at KV bucket `bucket` with up to MIX_PIECES prompt pieces packed in
        `mix_tokens` rows in its first step."""
        if ("mixed", bucket) in self._exes:
            return self._exes[("mixed", bucket)]
        fn, args = self._step_fn_and_args(steps.generate_mixed, bucket)
        p = policy.MIX_PIECES
        args += (
            self._small((self.mix_tokens,), jnp.int32),
            self._args_spec((p,)),
            self._small((p,), jnp.int32),
            self._small((p,), jnp.int32),
            self._small((p, self.pages_per_seq), jnp.int32),
            self._small((p,), jnp.int32),
            self._prior_spec(),
        )
        out = (self._state_sh, self._rep, self._rep, self._rep, self._rep)
        return self._exe(("mixed", bucket), fn, args, out, donate=(1,))

    def _paged_prefill_exe(self, t: int) -> object:
        if ("prefill_paged", t) in self._exes:
            return self._exes[("prefill_paged", t)]
        fn = partial(steps.prefill_paged, m=self.model, ops=self.ops)
        i32 = self._small((), jnp.int32)
        pages = self._small((self.pages_per_seq,), jnp.int32)
        args = (
            self.params,
            self._state_spec(),
            self._small((t,), jnp.int32),
            self._args_spec(),
            pages,
            i32,
            self._prior_spec(),
        )
        out = (self._state_sh, self._rep, self._rep)
        return self._exe(("prefill_paged", t), fn, args, out, donate=(1,))

    def _prior_spec(self) -> list:
        """A sequence's pages of every layer (model.gather_pages), replicated."""
        w = self.pages_per_seq
        shapes = kv_cache.pool_shapes(
            self.model, w, self.page_size, self.kv_dtype, bits=self.kv_bits
        )  # as the pool stores them
        layer = {name: self._small(shape, dt) for name, (shape, dt) in shapes.items()}
        return [dict(layer) for _ in range(self.model.n_layers)]

    def _gather_exe(self) -> object:
        """Reads a sequence's pages out of the pool, for a chunk that starts past 0: a separate
        call, so the prefill that writes the pool does not also read it (XLA then copied it)."""
        if ("gather",) in self._exes:
            return self._exes[("gather",)]
        pages = self._small((self.pages_per_seq,), jnp.int32)
        args = (self._state_spec().cache, pages)
        fn = partial(model.gather_pages, layout=self.ops.layout)
        return self._exe(("gather",), fn, args, self._rep)

    @cached_property
    def _no_prior(self) -> list:
        """The `prior` of a chunk at position 0 (nothing earlier to read): zeros, placed once."""
        return jax.tree.map(lambda s: self._put(np.zeros(s.shape, s.dtype)), self._prior_spec())

    def _activate_exe(self) -> object:
        if ("activate",) in self._exes:
            return self._exes[("activate",)]
        ints = self._small((len(slot_state.INT_FIELDS),), jnp.int32)
        floats = self._small((len(slot_state.FLOAT_FIELDS),), jnp.float32)
        args = (self._state_spec(), ints, floats)
        return self._exe(("activate",), slot_state.activate, args, self._state_sh, donate=(0,))

    def _misc_exes(self) -> tuple[object, object]:
        if ("release",) in self._exes:
            return self._exes[("init",)], self._exes[("release",)]
        init = self._exe(("init",), self._empty_state, (), self._state_sh)
        args = (self._state_spec(), self._small((), jnp.int32))
        rel = self._exe(("release",), slot_state.release, args, self._state_sh, donate=(0,))
        return init, rel

    def _warmup_jobs(self) -> list[Callable[[], object]]:
        """One call per shape (or pair of shapes) this engine's role serves, in compile order."""
        jobs: list[Callable[[], object]] = []
        if self.role == "both":  # prefill writes into the pages (prefill_pages), then activate
            jobs += [partial(self._paged_prefill_exe, t) for t in self.prefill_buckets]
            jobs += [self._misc_exes, self._activate_exe, self._gather_exe]
            jobs += [partial(self._generate_exe, b) for b in self.decode_buckets]
            return jobs + [
                partial(self._mixed_exe, b) for b in self.decode_buckets if self.mix_tokens
            ]
        if self.role == "prefill":
            jobs += [partial(self._prefill_exe, t) for t in self.prefill_buckets]
            jobs += [self._chunk_exes] if self.chunked_len else []
        if self.role == "generate":
            jobs.append(self._misc_exes)
            inserts = self.prefill_buckets + ((self.chunked_len,) if self.chunked_len else ())
            jobs += [partial(self._insert_exe, t) for t in inserts]
            jobs += [partial(self._generate_exe, b) for b in self.decode_buckets]
        return jobs

    def warmup(self, progress: Callable[[int, int], None] | None = None) -> float:
        """Compile every shape this engine's role serves, then run each once (warm.py: a
        first run costs more); returns seconds spent. `progress` is called with (done,
        total) after each compile."""
        t0 = time.perf_counter()
        jobs = self._warmup_jobs()
        for i, job in enumerate(jobs, 1):
            job()
            if progress is not None:
                progress(i, len(jobs))
        t1 = time.perf_counter()
        self.warm_runs = warm.run_each_shape(self)
        self.warm_run_seconds = time.perf_counter() - t1
        return time.perf_counter() - t0
