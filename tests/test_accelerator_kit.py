"""The accelerator run kit's `--check`: every import and every stage's arguments, nothing heavy.

`bench/accelerator_run.sh --check` runs in the dry run's Python 3.12 env (JAX 0.11, the GPU
image's packages and the carried wheels) when `--make-dry-env` has made it, else, as on a fresh
clone in CI, with this interpreter and its own packages. It installs only wheels already on
disk (`--no-index`), so the test downloads nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "bench" / "accelerator_run.sh"


@pytest.mark.slow
def test_kit_check_parses_every_stage_and_imports_everything(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    env.pop("PYTHON", None)
    if not (ROOT / ".dryenv" / "bin" / "python").exists():
        env["PYTHON"] = sys.executable  # no 3.12 env here: check with the test's interpreter
    proc = subprocess.run(
        ["bash", str(KIT), "--check"], env=env, capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "imports: all ok" in proc.stdout
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    stages = {line.split()[0]: line.split()[1] for line in summary}
    for mode in ("real", "dry"):
        for stage in ("calibrate", "greedy", "decode-f32", "decode", "decode-int8", "serving"):
            assert stages.get(f"{stage}-{mode}") == "ok", summary
    assert stages["wheels"] == stages["env"] == "ok", summary


def test_kit_rejects_unknown_arguments():
    proc = subprocess.run(["bash", str(KIT), "--dry-rum"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "unknown argument --dry-rum" in proc.stderr


def _plan(*args: str) -> dict[str, tuple[int, str]]:
    """`--plan`: {stage: (limit in s, command line)}, in order, and the total."""
    proc = subprocess.run(["bash", str(KIT), "--plan", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": "python3", "OUT": "/out"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = {}
    for line in proc.stdout.splitlines():
        name, limit, *command = line.split(maxsplit=2)
        rows[name] = (int(limit.rstrip("s")), command[0] if command else "")
    return rows


def test_the_decode_stages_record_f32_bf16_and_int8_weights_inside_nine_minutes():
    plan = _plan()
    decode = [name for name in plan if name.startswith("decode")]
    assert decode == ["decode-f32", "decode", "decode-int8"]  # f32 -> bf16 -> int8, in order
    f32, bf16, int8 = (plan[name][1].split() for name in decode)
    assert f32[f32.index("--dtype") + 1] == "f32" and "--weight-dtype" not in f32
    assert bf16[bf16.index("--dtype") + 1] == "bf16" and "--weight-dtype" not in bf16
    assert int8[int8.index("--dtype") + 1] == "bf16"
    assert int8[int8.index("--weight-dtype") + 1] == "int8"
    assert all("--model llama3-8b" in plan[name][1] for name in decode)
    outs = {cmd[cmd.index("--json-out") + 1] for cmd in (f32, bf16, int8)}
    assert outs == {"/out/decode-f32.json", "/out/decode.json", "/out/decode-int8.json"}
    # the extra precisions time fewer batches in less time than the full bf16 sweep
    assert "--batches" in f32 and "--batches" in int8 and "--batches" not in bf16
    assert plan["decode-f32"][0] < plan["decode"][0] and plan["decode-int8"][0] < plan["decode"][0]
    stages = {name: limit for name, (limit, _) in plan.items() if name != "total"}
    assert sum(stages.values()) == plan["total"][0] <= 9 * 60
    assert {"wheels", "env", "calibrate", "greedy", "serving"} <= set(stages)


def test_only_decode_selects_the_three_decode_stages_and_h200_decode_runs_them():
    assert list(_plan("--only", "decode")) == ["wheels", "env", "decode-f32", "decode",
                                               "decode-int8", "total"]  # fmt: skip
    assert list(_plan("--only", "decode-int8")) == ["wheels", "env", "decode-int8", "total"]
    dry = _plan("--dry-run")
    int8 = dry["decode-int8"][1]
    assert "--model tiny" in int8 and "--weight-dtype int8" in int8
    proc = subprocess.run(["bash", str(ROOT / "bench" / "h200_decode.sh"), "--plan"],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    names = [line.split()[0] for line in proc.stdout.splitlines()]
    assert names == ["wheels", "env", "calibrate", "decode-f32", "decode", "decode-int8", "total"]


def test_decode_runs_pallas_with_an_xla_baseline_and_the_tpu_variant_fits_a_v5e():
    """The bf16 sweep times XLA's attention beside the Pallas kernel at batch 64; the TPU script
    runs the same stages against the tpu-v5e spec with a model whose pool fits one chip."""
    h200 = _plan("--only", "decode")["decode"][1]
    assert "--baseline-batches 64" in h200 and "--hardware h200" in h200
    assert "--kernels" not in h200  # auto: Pallas on GPU/TPU, as the server runs
    proc = subprocess.run(["bash", str(ROOT / "bench" / "tpu_decode.sh"), "--plan"],
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHON": "python3", "OUT": "/out"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()}
    assert list(rows) == ["wheels", "env", "calibrate", "decode-f32", "decode", "decode-int8",
                          "total"]  # fmt: skip
    for stage in ("decode-f32", "decode", "decode-int8"):
        assert "--hardware tpu-v5e" in rows[stage] and "--model llama3.2-1b" in rows[stage]


# A stand-in for the dry run's Python 3.12: it says it is 3.12, answers `pip download` by writing
# an empty wheel per requirement (or, OFFLINE=1, fails as pip does with no registry), and logs
# every other call (pip install, accelerator_check.py) without running it.
FAKE_PY312 = r"""#!/usr/bin/env bash
echo "$*" >>"$FAKE_LOG"
[[ $1 == -c ]] && exit 0
if [[ "$1 $2 $3" == "-m pip download" ]]; then
  [[ -n ${OFFLINE:-} ]] && { echo "ERROR: network is unreachable" >&2 && exit 1; }
  shift 3
  while (($#)); do
    case $1 in
      -d) dest=$2 && shift ;;
      *==*) name=${1%%==*} && touch "$dest/${name//-/_}-${1##*==}-cp312-none-any.whl" ;;
    esac
    shift
  done
fi
exit 0
"""


def _dry_run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, str]:
    """`--dry-run --only none` (the wheels and env stages) from a checkout without .whl/, with
    FAKE_PY312 as the interpreter: (the process, every call it got)."""
    fake = tmp_path / "python3.12"
    fake.write_text(FAKE_PY312)
    fake.chmod(0o755)
    log = tmp_path / "calls.txt"
    log.write_text("")
    env = {
        **os.environ,
        "PYTHON": str(fake),
        "FAKE_LOG": str(log),
        "WHL": str(tmp_path / "whl"),
        "OUT": str(tmp_path / "out"),
        **env,
    }
    proc = subprocess.run(
        ["bash", str(KIT), "--dry-run", "--only", "none"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc, log.read_text()


def test_the_dry_run_fetches_the_wheels_itself_when_there_are_none(tmp_path):
    proc, calls = _dry_run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "-m pip download" in calls  # bench/fetch_gpu_wheels.sh, through the same interpreter
    install = next(line for line in calls.splitlines() if "-m pip install" in line)
    assert "--no-index" in install and "orjson-" in install and "textual-" in install
    assert "bench/accelerator_check.py" in calls  # the env stage ran after it
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert [line.split()[:2] for line in summary.splitlines()] == [["wheels", "ok"], ["env", "ok"]]
    # the next dry run finds them: nothing is downloaded again
    proc, calls = _dry_run(tmp_path)
    assert proc.returncode == 0 and "pip download" not in calls and "-m pip install" in calls


def test_the_dry_run_says_what_is_missing_when_the_registry_is_unreachable(tmp_path):
    proc, calls = _dry_run(tmp_path, OFFLINE="1")
    assert proc.returncode == 1
    assert "could not download orjson==" in proc.stdout and "registry reachable" in proc.stdout
    assert "without them every stage fails to import" in proc.stdout
    assert "the dry run stops" in proc.stdout
    assert "accelerator_check.py" not in calls  # no stage ran after the wheels
