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
        for stage in ("calibrate", "greedy", "decode", "serving"):
            assert stages.get(f"{stage}-{mode}") == "ok", summary
    assert stages["wheels"] == stages["env"] == "ok", summary


def test_kit_rejects_unknown_arguments():
    proc = subprocess.run(["bash", str(KIT), "--dry-rum"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "unknown argument --dry-rum" in proc.stderr
