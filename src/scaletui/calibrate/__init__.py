"""`scaletui calibrate`: measure this host's JAX devices and write the `local` hardware spec.

Measures, on device 0 unless stated, each figure from several timed runs after a warm-up
(compile) run (the roofs, read bandwidth and prefill GEMMs: the fastest of 3 passes' medians;
the rest: the median), and writes beside each how it was measured (`method`):
1. `hbm_bw`: the READ bandwidth a decode step meets: `h[1, D] @ W[D, F]` over a list of
   weight-shaped matrices (the decode step's own GEMVs, D x F = 2048 x 8192) in one jitted call,
   working sets past the last-level cache (>= 1 GiB and 8x the LLC on CPU, 2 GiB on GPU/TPU), the
   plateau past the cache, its passes spread over the run; the old in-place scale (read +
   write) stays as `measured.memory_copy`;
2. matmul FLOP/s at serving shapes: thin [B, D] x [D, F] (decode, B = 16/64/256) and a
   prefill-sized [T, D] x [D, F] GEMM in f32 and bf16; `flops_per_s` is the prefill GEMM, through
   XLA or, on CPU, the server's native dense kernel, whichever is faster, those GEMMs timed
   round robin in 3 passes and each the fastest pass's median (a roof: what the device does
   when the host's other load leaves it alone);
3. the dispatch floor: one tiny jitted call plus its host sync (`measured.dispatch_s`);
4. with more than one device: all-reduce (psum under shard_map) bandwidth over all of them, as
   the ring's bus bandwidth 2*V*(n-1)/(n*t), and a per-hop latency from a tiny all-reduce.
The spec goes to `scaletui.specs.local_hardware_path()` (XDG) and to stdout as YAML; progress to
stderr. Predictions for "this machine" then use `--hardware local`.

The package: timing.py (sizes, timed passes), read.py (`hbm_bw`), probes.py (FLOP/s, dispatch,
all-reduce, memory) and host.py (`calibrate()`, the spec); the command is
`scaletui.commands.calibrate`. The engine fit, `scaletui calibrate --model M`, is engine_fit.py.
"""

from __future__ import annotations

from scaletui.calibrate.host import calibrate
from scaletui.calibrate.read import ReadStream, read_spread_note
from scaletui.calibrate.timing import (
    Sizes,
    last_level_cache_bytes,
    pick_read_bw,
    read_working_set,
)

__all__ = [
    "ReadStream",
    "Sizes",
    "calibrate",
    "last_level_cache_bytes",
    "pick_read_bw",
    "read_spread_note",
    "read_working_set",
]
