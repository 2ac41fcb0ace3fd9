#!/usr/bin/env bash
# Issue 6's H200 decode run, now the decode stages of the accelerator run kit: llama3-8b with
# random weights in three precisions (f32; bf16; int8 weights under bf16 compute), decode at
# batch 1..64 (bf16; batch 1 and 64 for the other two) and prefill, against the built-in `h200`
# spec and a freshly calibrated one. Nothing is pip-installed on the GPU host (it has no
# registry): the kit installs the wheels copied there with the repository
# (`bench/fetch_gpu_wheels.sh` makes them) and runs from src/. `--plan` prints what it would run. See
# docs/benchmarks.md.
exec "$(dirname "$0")/accelerator_run.sh" --only calibrate,decode "$@"
