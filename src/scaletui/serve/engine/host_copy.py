"""An engine's results on the host of every process, where its devices are another process's.

A multi-process server runs every engine call on every process in the same order (lock step).
Interleaved, each engine's mesh spans every process and its outputs are replicated, so each
process reads them itself. Disaggregated across processes, the prefill engine's mesh can lie on
one process and the generate engine's on another: a process holding none of an engine's devices
runs its calls as no-ops and has nothing to read. `host_copy` then broadcasts what the host
needs (sampled tokens, logprobs, a prompt's K/V for the hand-over) from the first process that
holds the engine's devices, with JAX's `multihost_utils.broadcast_one_to_all` (a psum over one
device per process): every process makes the same call at the same point, so it is one more
collective in the same order. JAX's own cross-process `device_put` needs a transfer server that
did not move data between CPU processes here (it waited forever); the psum runs on gloo.
"""

from __future__ import annotations

import jax
import numpy as np


def source_process(devices: list) -> int | None:
    """The process that sends an engine's results to the others: the first holding one of its
    `devices`, when some process holds none of them; None when every process can read them."""
    if jax.process_count() == 1:
        return None
    held = {d.process_index for d in devices}
    return min(held) if len(held) < jax.process_count() else None


def host_copy(tree: object, source: int | None) -> object:
    """`tree`'s arrays as numpy on this process: read here (`source` None), or sent by process
    `source` to every process (each calls this at the same point, in the same order)."""
    if source is None:
        return jax.tree.map(np.asarray, tree)
    from jax.experimental import multihost_utils

    mine = jax.process_index() == source
    host = jax.tree.map(lambda a: np.asarray(a) if mine else np.zeros(a.shape, a.dtype), tree)
    return multihost_utils.broadcast_one_to_all(host, is_source=mine)
