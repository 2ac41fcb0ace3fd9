#!/usr/bin/env bash
# Issue 6's accelerator run, prepared for a host with one NVIDIA H200 and a CUDA JAX installed
# (`pip install -e '.[cuda]'`): llama3-8b with seeded dummy bf16 weights, decode at batch 1..64
# and prefill at 128/512/2048 tokens, against the built-in `h200` spec. Writes the JSON and the
# printed table under $OUT (default /tmp). Not run yet: no H200 has been lent to this project.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${OUT:-/tmp}
"$PYTHON" -c 'import jax; d = jax.devices()[0]; print(jax.__version__, d.platform, d.device_kind)'
common=(--model llama3-8b --hardware h200 --dtype bf16 --slots 64 --max-seq-len 2048
        --context 1024 --steps 8 --calls 5 --repeats 2 --prompt-lens 128 512 2048)
"$PYTHON" bench/decode_roofline.py "${common[@]}" | tee "$OUT/decode_h200.txt"
"$PYTHON" bench/decode_roofline.py "${common[@]}" --json > "$OUT/decode_h200.json"
