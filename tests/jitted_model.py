"""The model's functions (serve/engine/model.py) compiled whole, once per shape, for tests that
call them directly: called eagerly, JAX compiles each of their ops apart, which for the tiny
test models costs several times the one compile (test_model.py: 50 s against 6 s). The spec,
the ops and the other Python-valued arguments are static."""

from __future__ import annotations

import inspect

import jax

from scaletui.serve.engine import model

_STATIC = ("m", "ops", "kv_dtype", "hidden", "n_rows")


def _jit(fn):
    names = inspect.signature(fn).parameters
    return jax.jit(fn, static_argnames=[a for a in _STATIC if a in names])


forward = _jit(model.forward)
prefill = _jit(model.prefill)
prefill_paged = _jit(model.prefill_paged)
decode = _jit(model.decode)
