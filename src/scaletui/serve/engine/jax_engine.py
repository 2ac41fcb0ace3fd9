"""The JAX engine: `engine_api.Engine` over one mesh, every shape compiled ahead of time.

Each hot verb is one ahead-of-time compiled executable per shape: prefill per power-of-two
prompt bucket (plus one chunk shape for prompts past the largest bucket), insert per prefix
length, generate per KV-length bucket (a power-of-two number of pages). `warmup()` compiles
them all and runs each once (warm.py); afterwards a request can only reuse them (a new shape
would show in `compile_count()`). `generate` runs k decode steps in one `fori_loop`, donates
the decode state and copies one packed int32 array to the host. The bucket is picked on the
host from a mirror of the slot lengths, so no device sync picks it. The KV cache is paged
(kv_cache.py): the scheduler owns the page tables (pages.py) and hands each insert its pages
and each generate call every row's table.
An engine built with `kernels="native"` (build.py decides from `--kernels`: unsharded, on CPU)
holds its weights in the native layout and runs the native C++ kernels for matmuls and decode
attention (`serve/engine/native`); `kernels="pallas"` runs XLA ops with decode attention on JAX's
Pallas paged-attention kernel over a head-major pool (GPU/TPU); others run XLA ops, over
weights stored as the config's precision says (f32, bf16, or int8 with per-channel scales:
quant.py) and a KV cache likewise (int8 with a scale per position and KV head). The jitted
bodies live in steps.py; compiling them per shape, and `warmup()`, in programs.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import cached_property

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from scaletui.serve.engine import host_copy, kv_cache, model, native, slot_state
from scaletui.serve.engine.chunks import ChunkCalls
from scaletui.serve.engine.engine_api import (
    LOGPROBS_MODES,
    PROCESSED,
    EngineInfo,
    Prefix,
    SamplingParams,
    StepOutput,
    check_request,
)
from scaletui.serve.engine.programs import EnginePrograms
from scaletui.serve.engine.slot_state import SlotState
from scaletui.serve.engine.steps import PrefillArgs, StepConsts, eos_row
from scaletui.serve.weights import quant, sharding
from scaletui.shape import ServerShape

JNP_DTYPES = quant.JNP


class JaxEngine(EnginePrograms, ChunkCalls):
    """One compiled model on one device mesh. role: 'both' | 'prefill' | 'generate'."""

    def __init__(
        self,
        config: ServerShape,
        params: dict,
        ops: model.Ops,
        mesh: Mesh,
        *,
        role: str = "both",
        vocab_size: int | None = None,
        eos_ids: tuple[int, ...] = (),
        kernels: str = "xla",
        kernels_note: str | None = None,
        logprobs_mode: str = PROCESSED,
    ) -> None:
        """`params` placed on `mesh` (data=dp, model=tp) in the layout `ops` reads: the last
        stage of build.py's pass (plan, then params, then this)."""
        m = config.model
        self.config, self.model, self.role = config, m, role
        self.slots, self.max_seq_len = config.slots, config.max_seq_len
        # device rows: one spare, never-active row when slots == 1, because XLA drops a size-1
        # slot axis and then copies every cache chunk per step instead of updating in place
        self.rows = max(self.slots, 2)
        dp = mesh.shape["data"]
        self.replicas = dp  # each data-parallel replica has its own rows and its own pages
        self.page_size, self.pages = config.page_size, config.pages  # pages: per replica
        self.pages_per_seq = config.pages_per_seq  # a page table row's width
        self.vocab_size = vocab_size or m.vocab_size  # sampling never goes beyond
        self.eos_ids = tuple(eos_ids)  # sampling any of them ends a sequence ("stop")
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}"
            )
        # logprobs of the logits sampled rows draw from (vLLM's processed_logprobs), or raw ones
        self.logprobs_processed = logprobs_mode == PROCESSED
        self.mesh = mesh
        self.devices = list(mesh.devices.flat)
        # multi-process, disaggregated: the process that sends this engine's results to the
        # processes holding none of its devices (host_copy.py); None: every process reads them
        self.source = host_copy.source_process(self.devices)
        self.precision = p = config.precision
        self.dtype = jnp.dtype(JNP_DTYPES[p.compute])  # activations
        self.kv_dtype = jnp.dtype(JNP_DTYPES[p.kv])  # KV-cache storage (int8: with scales)
        # build.plan_engines checked the kernels can run here: "native" (CPU), "pallas" (decode
        # attention on JAX's Pallas kernels: GPU/TPU, or interpreted on CPU) or "xla"
        self.kernels = kernels
        self.native = kernels == "native"
        # mixed batches: the longest prompt chunk a generate call takes along (0: none)
        self.mix_tokens = config.mixing if role == "both" else 0
        self.kernels_note = kernels_note  # why not native (kernels != xla, XLA runs), or a fallback
        # the native dense kernel's panels and products (native.dense_path), for /stats
        self.kernels_dense = native.dense_path(p.weights, p.compute) if self.native else None
        self.ops, self.params = ops, params
        platform = self.devices[0].platform
        # a bf16 pool as its bits on CPU (kv_cache: XLA CPU would rewrite the whole pool per page
        # written); Pallas' kernels, interpreted on CPU as well, read bf16
        self.kv_bits = platform == "cpu" and kernels != "pallas"
        self.prefill_buckets = config.prefill_buckets  # powers of two up to max_seq_len
        self.chunk = self.prefill_buckets[-1]
        n_chunks = -(-self.max_seq_len // self.chunk)
        self.chunked_len = n_chunks * self.chunk if self.chunk < self.max_seq_len else 0
        # decode buckets: KV lengths of 2^i pages (a row's table is sliced to the bucket)
        self.decode_buckets = config.decode_buckets
        self._rep = sharding.replicated(self.mesh)
        self._state_sh = kv_cache.state_shardings(
            m, self.mesh, self.rows, dp * self.pages, self.page_size, self.kv_dtype, self.ops.layout
        )
        self._exes: dict[tuple, object] = {}
        # (steps, vocab_size, eos_ids) -> their device copies, placed once instead of every step
        self._consts: dict[tuple[int, int, tuple[int, ...]], StepConsts] = {}
        self.compile_seconds = 0.0
        self.warm_runs: list[tuple[str, int]] = []  # what warmup ran once (warm.py)
        self.warm_run_seconds = 0.0
        self.last_step_stats: dict = {}  # the last generate call's bucket (bench/)
        self._last_table: tuple[np.ndarray, jax.Array] | None = None  # (host, device) pages

    # --- what this engine is (for /stats and the memory check) ---------------------------------

    @property
    def mesh_shape(self) -> dict[str, int]:
        return {name: int(n) for name, n in self.mesh.shape.items()}

    @cached_property  # the weights never change; /stats asks on every poll
    def weight_bytes(self) -> int:
        """Weight bytes summed over this engine's devices (replicas counted on each)."""
        leaves = jax.tree.leaves(self.params)
        return sum(_shard_bytes(x) * len(x.sharding.device_set) for x in leaves)

    @cached_property
    def weight_bytes_per_device(self) -> int:
        return sum(_shard_bytes(x) for x in jax.tree.leaves(self.params))

    @cached_property
    def kv_cache_bytes_per_device(self) -> int:
        """K/V pages (and int8 scales) on the busiest device, in their storage dtypes."""
        return sum(_shard_bytes(a) for a in jax.tree.leaves(self._state_spec().cache))

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache_bytes_per_device * len(self.devices)

    def describe(self) -> EngineInfo:
        shape = self.mesh_shape
        return EngineInfo(
            data=shape["data"],
            model=shape["model"],
            devices=tuple(int(d.id) for d in self.mesh.devices.flat),
            kernels=self.kernels,
            weight_bytes=self.weight_bytes,
            kv_cache_bytes=self.kv_cache_bytes,
            weight_bytes_per_device=self.weight_bytes_per_device,
            kv_cache_bytes_per_device=self.kv_cache_bytes_per_device,
            warmup_total=len(self._warmup_jobs()),
            dtype=self.precision.compute,
            weight_dtype=self.precision.weights,
            kv_dtype=self.precision.kv,
            kernels_note=self.kernels_note,
            kernels_dense=self.kernels_dense,
            page_size=self.page_size,
            kv_pages=self.pages,
        )

    def compile_count(self) -> int:
        return len(self._exes)

    # --- the verbs ------------------------------------------------------------------------------

    def init_decode_state(self) -> SlotState:
        init, _ = self._misc_exes()
        return SlotState(init(), np.zeros(self.rows, np.int32), np.zeros(self.rows, bool))

    def prefill(self, tokens: list[int], params: SamplingParams) -> Prefix:
        check_request(tokens, params, self.max_seq_len, self.model.vocab_size)
        n, rows = len(tokens), []  # rows: the chunks' prompt logprobs, when asked
        args = lambda start, nxt: self._put(
            PrefillArgs.of(n, params, self.vocab_size, start, nxt, self.logprobs_processed)
        )
        if n <= self.chunk:
            t = next(b for b in self.prefill_buckets if b >= n)
            padded = np.zeros(t, np.int32)
            padded[:n] = tokens
            kv, tok, lp = self._prefill_exe(t)(self.params, self._put(padded), args(0, 0))
            rows.append(lp)
        else:
            zeros, step = self._chunk_exes()
            kv = zeros()
            padded = np.zeros(self.chunked_len, np.int32)
            padded[:n] = tokens
            for start in range(0, n, self.chunk):
                chunk = self._put(padded[start : start + self.chunk])
                end = start + self.chunk
                kv, tok, lp = step(self.params, chunk, args(start, padded[min(end, n - 1)]), kv)
                rows.append(lp)
        if self.source is not None:
            tok, lp, rows = host_copy.host_copy((tok, lp, rows), self.source)
        return Prefix.of_prompt(kv, tokens, int(tok), params, self.eos_ids, lp, rows)

    def prefill_pages(
        self,
        state: SlotState,
        tokens: list[int],
        params: SamplingParams,
        slot: int,
        pages: Sequence[int],
        start: int = 0,
        stop: int | None = None,
    ) -> tuple[SlotState, Prefix | None]:
        """Prefill tokens[start:stop] of a prompt straight into `slot`'s pages (ids in its
        replica, covering the prompt; positions before `start`, earlier chunks or a cached
        prefix, are already there), in chunks of the largest bucket. -> (state, the Prefix to
        `insert` (kv None: it is in the pages) once `stop` reaches the prompt's end, else
        None)."""
        stop, size = len(tokens) if stop is None else stop, self.page_size
        self._check_chunk(tokens, params, start, stop, pages, slot)
        row, scratch = self._chunk_row(slot, pages)
        arrays, tok, step = state.arrays, None, max(size, self.chunk // size * size)
        rows = self._prompt_rows(state, slot, params, start)
        if step > self.chunk and stop - start > self.chunk:
            raise ValueError(
                f"a {stop - start}-token prompt runs in pieces of whole pages "
                f"({size} tokens), longer than the largest prefill bucket "
                f"({self.chunk}): start the server with max_prefill_bucket >= "
                f"page_size"
            )
        for cur in range(start, stop, step):  # chunks from page boundaries
            c = min(stop - cur, step)
            t = next(b for b in self.prefill_buckets if b >= c)
            padded, args = self._chunk_args(tokens, params, cur, c, t)
            prior = self._gather_exe()(arrays.cache, row) if cur else self._no_prior
            exe = self._paged_prefill_exe(t)
            arrays, tok, lp = exe(self.params, arrays, padded, args, row, scratch, prior)
            if params.prompt_logprobs is not None:  # the chunk's c positions, and the last row
                rows.append(np.asarray(lp)[np.r_[:c, -1]])
        state = state.replaced(arrays)
        return state, self._chunk_end(state, tokens, params, slot, stop, tok, lp)

    def transfer(self, prefix: Prefix, to: JaxEngine) -> Prefix:
        if to is self:
            return prefix
        t = prefix.kv[0][0].shape[0]
        kv = prefix.kv
        if self.source is not None or to.source is not None:  # across processes: via the host
            kv = host_copy.host_copy(kv, self.source)
        return replace(prefix, kv=jax.device_put(kv, to._prefix_sh(t)))

    def insert(
        self, state: SlotState, prefix: Prefix, slot: int, pages: Sequence[int]
    ) -> SlotState:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot must be in [0, {self.slots}), got {slot}")
        if prefix.length >= self.max_seq_len:
            raise ValueError(f"prefix length {prefix.length} >= max_seq_len {self.max_seq_len}")
        need = -(-prefix.length // self.page_size)
        if len(pages) < need or not all(0 < p < self.pages for p in pages):
            raise ValueError(
                f"a {prefix.length}-token prefix needs {need} pages in [1, "
                f"{self.pages}), got {list(pages)}"
            )
        # global page ids in the slot's replica; the bucket's padding past the prefix's pages
        # goes to the replica's scratch page
        active = not prefix.done
        ints, floats = slot_state.pack_insert_args(
            slot, prefix.length, prefix.first_token, active, prefix.params, self.logprobs_processed
        )
        ints, floats = self._put(ints), self._put(floats)
        if prefix.kv is None:  # prefill_pages wrote its K/V into the pages already
            arrays = self._activate_exe()(state.arrays, ints, floats)
        else:
            t = prefix.kv[0][0].shape[0]
            base = slot // (self.rows // self.replicas) * self.pages
            ids = np.full(-(-t // self.page_size), base, np.int32)
            n = min(len(pages), ids.size)
            ids[:n] += np.asarray(pages[:n], np.int32)
            arrays = self._insert_exe(t)(state.arrays, prefix.kv, ints, floats, self._put(ids))
        lengths, act, wants = state.lengths.copy(), state.active.copy(), state.logprobs.copy()
        lengths[slot], act[slot] = prefix.length, active
        wants[slot] = prefix.params.logprobs is not None
        return state.replaced(arrays, lengths=lengths, active=act, logprobs=wants)

    def release(self, state: SlotState, slot: int) -> SlotState:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot must be in [0, {self.slots}), got {slot}")
        _, rel = self._misc_exes()
        act = state.active.copy()
        act[slot] = False
        state.prompt_rows.pop(slot, None)  # released mid-prompt (cancelled)
        return state.replaced(rel(state.arrays, self._put(np.int32(slot))), active=act)

    def pick_bucket(self, lengths: np.ndarray, active: np.ndarray, steps: int) -> int:
        need = int(lengths[active].max(initial=0)) + steps
        return next((b for b in self.decode_buckets if b >= need), self.decode_buckets[-1])

    def generate(
        self, state: SlotState, steps: int, pages: np.ndarray
    ) -> tuple[SlotState, StepOutput]:
        """`pages` [slots, >= W]: each slot's page table (local ids, 0 where it holds none),
        covering every position this call writes (lengths + steps)."""
        bucket, table, consts = self._step_inputs(state, steps, pages)
        arrays, packed, lps = self._generate_exe(bucket)(self.params, state.arrays, consts, table)
        return self._step_output(state, arrays, packed, lps, steps, bucket)

    def _step_inputs(self, state: SlotState, steps: int, pages: np.ndarray) -> tuple:
        """A generate call's (KV bucket, page table on the devices, StepConsts)."""
        if not 1 <= steps <= self.config.decode_steps:
            raise ValueError(f"steps must be in [1, {self.config.decode_steps}], got {steps}")
        bucket = self.pick_bucket(state.lengths, state.active, steps)
        table = np.zeros((self.rows, bucket // self.page_size), np.int32)
        w = min(table.shape[1], pages.shape[1])
        table[: pages.shape[0], :w] = pages[:, :w]
        key = (steps, self.vocab_size, self.eos_ids)
        consts = self._consts.get(key)
        if consts is None:
            values = StepConsts(np.int32(steps), np.int32(self.vocab_size), eos_row(self.eos_ids))
            consts = self._consts[key] = self._put(values)
        return bucket, self._device_table(table), consts

    def _step_output(self, state: SlotState, arrays, packed, lps, steps: int, bucket: int):
        """(state, StepOutput) from a generate call's packed outputs: the one host sync."""
        n = self.slots
        asked = (state.active & state.logprobs).any()  # else the logprobs stay on the device
        host, lps = host_copy.host_copy((packed, lps if asked else None), self.source)
        lp = lps[:steps, :, :n].copy() if asked else None
        out = host[:-1].reshape(self.config.decode_steps, 3, self.rows)[:steps]
        lengths = host[-1].copy()
        done = out[:, 2].astype(bool)
        active = state.active & ~done.any(axis=0)
        self.last_step_stats = {"bucket": bucket, "steps": steps, "active": int(state.active.sum())}
        result = StepOutput(
            out[:, 0, :n].copy(), out[:, 1, :n].astype(bool), done[:, :n], lengths[:n].copy(), lp
        )
        return state.replaced(arrays, lengths=lengths, active=active), result


def _shard_bytes(a) -> int:
    """Bytes of one device's shard of `a` (an array or its spec), whichever process holds it."""
    return int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize
