#!/usr/bin/env bash
# Download, here, the wheels the GPU host's image lacks (docs/benchmarks.md, "Accelerator run
# kit"): cp312 manylinux x86_64 builds, one version each, into .whl/ (ignored by git; copy it
# to the GPU host with the repository). bench/accelerator_run.sh installs them there with
# `pip install --no-index --no-deps --target`.
#
# The JAX CUDA image the kit targets already holds numpy, jax 0.11, aiohttp, pyyaml,
# prometheus-client, tokenizers, safetensors, psutil, uvloop, rich, pygments, markdown-it-py,
# mdurl and typing-extensions. Missing, with the missing parts of their Requires-Dist:
#   orjson; textual -> platformdirs, mdit-py-plugins, markdown-it-py[linkify] -> linkify-it-py;
#   textual-plotext -> plotext.
# Versions are the ones the CI venv runs.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${DEST:-.whl}
PYTHON=${PYTHON:-python3}
WHEELS=(orjson==3.13.0 textual==8.2.8 textual-plotext==1.0.1 plotext==5.3.2
        platformdirs==4.14.9 mdit-py-plugins==0.7.0 linkify-it-py==2.2.0)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
mkdir -p "$DEST"
if ! "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$DEST" "${WHEELS[@]}"; then
  echo "fetch_gpu_wheels: could not download ${WHEELS[*]} into $DEST (is the package" \
    "registry reachable? pip's error is above)" >&2
  exit 1
fi
# keep one version of each: two versions of one name stop the install on the GPU host
names=$(ls "$DEST"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort)
dups=$(uniq -d <<<"$names")
if [[ -n $dups ]]; then
  echo "fetch_gpu_wheels: more than one version of: $dups (delete the old ones in $DEST)" >&2
  exit 1
fi
ls -1 "$DEST"
du -sh "$DEST"
