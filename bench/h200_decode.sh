#!/usr/bin/env bash
# Issue 6's H200 decode run, now the decode stage of the accelerator run kit: llama3-8b with
# random bf16 weights, decode at batch 1..64 and prefill at 128/512/2048 tokens, against the
# built-in `h200` spec and a freshly calibrated one. Nothing is pip-installed on the GPU host
# (it has no registry): the kit installs the carried wheels (`bench/fetch_gpu_wheels.sh`, then
# the device tool's `carry: [".whl"]`) and runs from src/. See docs/benchmarks.md.
exec "$(dirname "$0")/accelerator_run.sh" --only calibrate,decode "$@"
