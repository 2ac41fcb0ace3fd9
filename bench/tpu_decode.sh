#!/usr/bin/env bash
# The TPU variant of bench/h200_decode.sh: the same calibrate and decode stages on one TPU chip,
# decode attention on JAX's Pallas TPU paged-attention kernel (the engine's auto on TPU; the
# bf16 sweep also times XLA's attention at batch 64), predicted with the tpu-v5e spec and the
# calibrated one. llama3.2-1b by default: its weights and a 64 x 2048-token KV pool fit a v5e's
# 16 GB (llama3-8b's do not). MODEL=... HARDWARE=tpu-v6e ... to change either; `--plan` prints
# what it would run. The kit has only run on CPU (--dry-run) so far: see docs/benchmarks.md.
export MODEL=${MODEL:-llama3.2-1b} HARDWARE=${HARDWARE:-tpu-v5e}
exec "$(dirname "$0")/accelerator_run.sh" --only calibrate,decode "$@"
