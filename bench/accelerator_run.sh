#!/usr/bin/env bash
# The accelerator run kit (issue 15): everything the first minutes on a GPU host should measure,
# in one command, each stage under its own time limit, all results under $OUT (10 files).
#
#   bench/accelerator_run.sh                on the GPU host (llama3-8b, limits add up to 9 min)
#   bench/accelerator_run.sh --dry-run      here, on CPU: tiny/small models, short sweeps, in a
#                                           Python 3.12 env holding only the GPU image's packages
#                                           ($PYTHON instead, when set), and the wheels it
#                                           fetches when .whl/ has none
#   bench/accelerator_run.sh --check        imports and every stage's arguments, nothing heavy
#   bench/accelerator_run.sh --plan         each stage's limit and command line; runs nothing
#                                           (with --dry-run: the dry run's)
#   bench/accelerator_run.sh --make-dry-env (re)create that env in .dryenv/
#   ... --only decode,serving               run only these stages (wheels and env always run;
#                                           decode: all three decode stages)
#   MODEL=llama3.2-1b HARDWARE=tpu-v5e ...  another model and hardware spec (default llama3-8b,
#                                           h200; bench/tpu_decode.sh sets both for a TPU)
#
# Stages: wheels (install the carried .whl/ with --no-index --target, bench/fetch_gpu_wheels.sh
# fetches them; the dry run fetches them itself when there are none), env (versions, nvidia-smi,
# every import), calibrate (`scaletui calibrate`),
# greedy (bench/greedy_check.py), ragged (bench/ragged_check.py: the mixed step's ragged
# paged-attention kernel against XLA's, right and timed), decode-f32, decode, decode-int8
# (bench/decode_roofline.py vs the h200 spec and the calibrated one, with decode attention on JAX's Pallas paged-attention
# kernel (the engine's auto on GPU/TPU; the bf16 sweep also times XLA's attention at batch 64),
# in three precisions so that one run records them all:
# f32 compute and weights, then bf16 compute and weights (the full sweep), then bf16 compute
# with int8 weights; the extra two time fewer batches, calls and prompts in less time), serving
# (bench/accelerator_serving.py: loadgen against `scaletui serve`, which starts in the
# background right after env, so that its minutes of host-side weight generation and compiles
# overlap calibrate, greedy and decode). A failed or timed-out stage does not stop the next;
# summary.txt gets one line per stage. The project runs from src/ on PYTHONPATH: the GPU host
# has no registry, so nothing is pip-installed there but the wheels.
# Files in $OUT: summary.txt log.txt env.txt calibrate.yaml greedy.json ragged.json
# decode-f32.json decode.json decode-int8.json serving.json
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MODE=real ONLY= PLAN=
while (($#)); do
  case $1 in
    --dry-run) MODE=dry ;;
    --check) MODE=check ;;
    --plan) PLAN=1 ;;
    --make-dry-env) MODE=make-env ;;
    --only) ONLY=,$2, && shift ;;
    -h | --help) sed -n '2,35p' "$0" | cut -c3- && exit 0 ;;
    *) echo "accelerator_run: unknown argument $1 (see --help)" >&2 && exit 2 ;;
  esac
  shift
done

MODEL=${MODEL:-llama3-8b} HARDWARE=${HARDWARE:-h200}
DRYENV=$ROOT/.dryenv
WHL=${WHL:-$ROOT/.whl}
# the packages of the JAX CUDA image the kit targets that the project or textual needs
IMAGE_PACKAGES=(jax==0.11.2 jaxlib==0.11.2 numpy aiohttp pyyaml prometheus-client tokenizers
                safetensors psutil uvloop rich pygments markdown-it-py mdurl typing-extensions)

# A Python 3.12 that runs: $PY312, else python3.12 on PATH (a pyenv shim only works when 3.12
# is selected, so it is tried, not trusted), else pyenv's own 3.12 install.
find_py312() {
  local c
  for c in "${PY312:-}" "$(command -v python3.12)" \
           "$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")"/versions/3.12*/bin/python3.12; do
    [[ -n $c ]] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null \
      && { echo "$c"; return 0; }
  done
  echo "accelerator_run: no Python 3.12 found (set PY312=/path/to/python3.12)" >&2
  return 1
}

make_dry_env() {
  local py312
  py312=$(find_py312) || return 1
  echo "accelerator_run: creating $DRYENV with $py312 and the GPU image's packages"
  rm -rf "$DRYENV"
  "$py312" -m venv "$DRYENV" && "$DRYENV/bin/python" -m pip install -q "${IMAGE_PACKAGES[@]}"
}

# --- the stages' command lines, per mode -----------------------------------------------------
plan() {  # $1: real | dry
  if [[ $1 == real ]]; then
    CALIBRATE=(--out "$OUT/calibrate.yaml")
    GREEDY=(--model small --dtype bf16 --new-tokens 32)
    # decode: f32 -> bf16 -> int8 weights (bf16 compute); the full sweep in bf16, the other two
    # at the ends of it (batch 1: the weight read; 64: with the KV) and one prompt length
    local sweep=(--model "$MODEL" --context 1024 --max-seq-len 2048 --steps 8)
    local short=(--batches 1 64 --calls 3 --repeats 1 --prompt-lens 512)
    DECODE_F32=("${sweep[@]}" --dtype f32 "${short[@]}")
    DECODE=("${sweep[@]}" --dtype bf16 --slots 64 --calls 5 --repeats 2 --prompt-lens 128 512 2048
            --baseline-batches 64)
    DECODE_INT8=("${sweep[@]}" --dtype bf16 --weight-dtype int8 "${short[@]}")
    SERVING=(--model "$MODEL" --dtype bf16 --slots 64 --concurrency 1 8 64 --qps 20
             --poisson-requests 200 --input-len 128 --output-len 128)
    RAGGED=(--model "$MODEL")
    LIMITS=(wheels=30 env=45 calibrate=45 greedy=75 ragged=30 decode-f32=55 decode=120
            decode-int8=55 serving=85)
  else
    CALIBRATE=(--quick --out "$OUT/calibrate.yaml")
    GREEDY=(--model small --dtype bf16 --new-tokens 32)
    local sweep=(--model tiny --context 64 --max-seq-len 256 --steps 4)
    local short=(--batches 1 4 --calls 2 --repeats 1 --prompt-lens 64)
    DECODE_F32=("${sweep[@]}" --dtype f32 "${short[@]}")
    DECODE=("${sweep[@]}" --dtype bf16 --slots 4 --calls 2 --repeats 1 --prompt-lens 16 64 128
            --baseline-batches 4)
    DECODE_INT8=("${sweep[@]}" --dtype bf16 --weight-dtype int8 "${short[@]}")
    SERVING=(--model tiny --dtype bf16 --slots 8 --concurrency 1 2 8 --requests-per-stream 2
             --qps 4 --poisson-requests 8 --input-len 32 --output-len 16)
    RAGGED=(--model tiny --interpret --rows 4 --chunk 32 --context 64 --calls 2)
    LIMITS=(wheels=90 env=60 calibrate=45 greedy=240 ragged=90 decode-f32=60 decode=120
            decode-int8=60 serving=90)
  fi
  local compare=(--hardware "$HARDWARE" --compare "$OUT/calibrate.yaml" --no-floor --weights device)
  DECODE_F32+=("${compare[@]}" --json-out "$OUT/decode-f32.json")
  DECODE+=("${compare[@]}" --json-out "$OUT/decode.json")
  DECODE_INT8+=("${compare[@]}" --json-out "$OUT/decode-int8.json")
  GREEDY+=(--json-out "$OUT/greedy.json")
  RAGGED+=(--json-out "$OUT/ragged.json")
}

selected() {  # is stage $1 to run? wheels and env always; --only decode names decode-*
  [[ -z $ONLY || $1 == wheels || $1 == env || $ONLY == *,$1,* || $ONLY == *,${1%%-*},* ]]
}

limit_of() {  # stage $1's limit in seconds (120 when LIMITS leaves it out)
  local kv
  for kv in "${LIMITS[@]}"; do [[ ${kv%%=*} == "$1" ]] && echo "${kv#*=}" && return; done
  echo 120
}

stages() {  # $1 (run_stage | show_stage) for each one-command stage between env and serving
  "$1" calibrate "$PYTHON" -m scaletui.cli calibrate "${CALIBRATE[@]}"
  "$1" greedy "$PYTHON" bench/greedy_check.py "${GREEDY[@]}"
  "$1" ragged "$PYTHON" bench/ragged_check.py "${RAGGED[@]}"
  "$1" decode-f32 "$PYTHON" bench/decode_roofline.py "${DECODE_F32[@]}"
  "$1" decode "$PYTHON" bench/decode_roofline.py "${DECODE[@]}"
  "$1" decode-int8 "$PYTHON" bench/decode_roofline.py "${DECODE_INT8[@]}"
}

PLAN_TOTAL=0
show_stage() {  # one line of --plan: name, limit, command
  selected "$1" || return 0
  local limit
  limit=$(limit_of "$1")
  PLAN_TOTAL=$((PLAN_TOTAL + limit))
  printf '%-12s %4ss  %s\n' "$1" "$limit" "${*:2}"
}

if [[ -n $PLAN ]]; then  # what a run would do, stage by stage; nothing runs, nothing is written
  PYTHON=${PYTHON:-python3} OUT=${OUT:-'$OUT'}
  plan "$([[ $MODE == dry ]] && echo dry || echo real)"
  show_stage wheels "pip install --no-index --target \$SITE $WHL/*.whl"
  show_stage env "$PYTHON bench/accelerator_check.py (and nvidia-smi)"
  stages show_stage
  show_stage serving "$PYTHON" bench/accelerator_serving.py "${SERVING[@]}" --out "$OUT/serving.json"
  printf '%-12s %4ss\n' total "$PLAN_TOTAL"
  exit 0
fi

case $MODE in
  make-env) make_dry_env; exit ;;
  dry) [[ -n ${PYTHON:-} || -x $DRYENV/bin/python ]] || make_dry_env || exit 1
       PYTHON=${PYTHON:-$DRYENV/bin/python} ;;
  check) [[ -x $DRYENV/bin/python ]] && PYTHON=${PYTHON:-$DRYENV/bin/python}
         PYTHON=${PYTHON:-python3} ;;
  real) PYTHON=${PYTHON:-python3} ;;
esac
OUT=${OUT:-$ROOT/results/accelerator-$MODE-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SERVER_PID= TMP_SITE=
if [[ $MODE == real ]]; then
  SITE=${SITE:-/tmp/site}
else
  SITE=$(mktemp -d) TMP_SITE=1
fi
stop_server() {  # SIGTERM (a clean shutdown), SIGKILL after 30 s
  [[ -n $SERVER_PID ]] || return 0
  kill "$SERVER_PID" 2>/dev/null
  for _ in {1..30}; do kill -0 "$SERVER_PID" 2>/dev/null && sleep 1; done
  kill -9 "$SERVER_PID" 2>/dev/null
  wait "$SERVER_PID"
  local rc=$?
  SERVER_PID=
  return $rc
}
trap 'stop_server; [[ -n $TMP_SITE ]] && rm -rf "$SITE"' EXIT
export PYTHON OUT SITE WHL MODE PYTHONUNBUFFERED=1
export PYTHONPATH=$ROOT/src:$SITE${PYTHONPATH:+:$PYTHONPATH}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$SITE/jax-cache}
# two JAX processes share the GPU while the server warms up: no process takes 75% up front
export XLA_PYTHON_CLIENT_PREALLOCATE=false
LOG=$OUT/log.txt SUMMARY=$OUT/summary.txt
: >"$SUMMARY"

# --- stages that are not one command ---------------------------------------------------------
stage_wheels() {
  local wheels=("$WHL"/*.whl)
  if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
    echo "skipped: the carried wheels are cp312 and $PYTHON is $("$PYTHON" -V 2>&1)"
    return 0
  fi
  if [[ ! -e ${wheels[0]} && $MODE == dry ]]; then  # here the registry may be reachable
    echo "no wheels in $WHL: fetching them (bench/fetch_gpu_wheels.sh)"
    if ! PIP_RETRIES=${PIP_RETRIES:-1} PIP_TIMEOUT=${PIP_TIMEOUT:-10} DEST=$WHL \
         bash bench/fetch_gpu_wheels.sh; then
      echo "accelerator_run: the dry run needs the wheels bench/fetch_gpu_wheels.sh names:" \
        "without them every stage fails to import. Run it where the package registry is" \
        "reachable and copy .whl/ here"
      return 1
    fi
    wheels=("$WHL"/*.whl)
  fi
  if [[ ! -e ${wheels[0]} ]]; then
    echo "no wheels in $WHL: run bench/fetch_gpu_wheels.sh and carry .whl (docs/benchmarks.md)"
    [[ $MODE == check ]] && return 0 || return 1
  fi
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "${wheels[@]}" && printf '  %s\n' "${wheels[@]##*/}"
}

stage_env() {
  echo "date $(date -u +%FT%TZ), host $(hostname), $(uname -srm), mode $MODE"
  echo "PYTHONPATH=$PYTHONPATH"
  if command -v nvidia-smi >/dev/null; then
    timeout 20 nvidia-smi
    timeout 20 nvidia-smi --format=csv --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.memory,power.limit
  else
    echo "nvidia-smi: not on PATH"
  fi
  "$PYTHON" bench/accelerator_check.py
}
export -f stage_wheels stage_env

run_stage() {  # name command...: under its limit, output to the console and log.txt
  local name=$1 limit t0=$SECONDS rc status
  shift
  selected "$name" || return 0
  limit=$(limit_of "$name")
  echo -e "\n=== $name (limit ${limit}s): ${*##"$ROOT"/}" | tee -a "$LOG"
  timeout --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) status=ok ;;
    124 | 137) status="timed out" ;;
    *) status="failed (exit $rc)" ;;
  esac
  printf '%-10s %-18s %5ds of %ds\n' "$name" "$status" $((SECONDS - t0)) "$limit" | tee -a "$SUMMARY"
  [[ $status == ok ]]
}

if [[ $MODE == check ]]; then  # imports, then the real and the dry run's arguments, parsed
  plan real
  LIMITS=(wheels=120 env=180)  # a loaded CI box: the other checks get run_stage's default
  run_stage wheels bash -c stage_wheels
  run_stage env "$PYTHON" bench/accelerator_check.py
  for m in real dry; do
    plan "$m"
    run_stage "calibrate-$m" "$PYTHON" -m scaletui.cli calibrate --help
    run_stage "greedy-$m" "$PYTHON" bench/greedy_check.py "${GREEDY[@]}" --check
    run_stage "ragged-$m" "$PYTHON" bench/ragged_check.py "${RAGGED[@]}" --check
    run_stage "decode-f32-$m" "$PYTHON" bench/decode_roofline.py "${DECODE_F32[@]}" --check
    run_stage "decode-$m" "$PYTHON" bench/decode_roofline.py "${DECODE[@]}" --check
    run_stage "decode-int8-$m" "$PYTHON" bench/decode_roofline.py "${DECODE_INT8[@]}" --check
    run_stage "serving-$m" "$PYTHON" bench/accelerator_serving.py "${SERVING[@]}" --out x --check
  done
else
  plan "$MODE"
  if ! run_stage wheels bash -c stage_wheels && [[ $MODE == dry ]]; then
    echo "accelerator_run: the dry run stops: no stage can run without the wheels" | tee -a "$LOG"
    exit 1
  fi
  run_stage env bash -c 'set -o pipefail; stage_env 2>&1 | tee "$OUT/env.txt"'
  if [[ -z $ONLY || $ONLY == *,serving,* ]]; then  # started now, used last (see the top)
    PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    SERVER_LOG=$SITE/server.log
    echo "=== server: started in the background on port $PORT, log at the end" | tee -a "$LOG"
    "$PYTHON" bench/accelerator_serving.py "${SERVING[@]}" --serve-only --port "$PORT" \
      >"$SERVER_LOG" 2>&1 &
    SERVER_PID=$!
  fi
  stages run_stage
  limit=$(limit_of serving)
  run_stage serving "$PYTHON" bench/accelerator_serving.py "${SERVING[@]}" --out \
    "$OUT/serving.json" --url "http://127.0.0.1:${PORT:-0}" --server-timeout $((limit - 45))
  if [[ -n $SERVER_PID ]]; then
    stop_server
    echo -e "\n=== server log (exit $?)" >>"$LOG"
    cat "$SERVER_LOG" >>"$LOG"
  fi
fi
echo -e "\n=== summary ($MODE, $SECONDS s; files in $OUT)" | tee -a "$LOG"
cat "$SUMMARY"
cat "$SUMMARY" >>"$LOG"
! grep -qv ' ok ' "$SUMMARY"
