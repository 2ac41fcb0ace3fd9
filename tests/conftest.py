"""Test setup: JAX on the CPU with 8 virtual devices, set before anything imports jax, and a
private config and cache for every test, so a test never reads or writes the user's `local`
hardware spec or kernel cache (a `scaletui` run before the tests must not change their results).
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from scaletui.xla_env import set_host_devices, set_quick_compiles

set_host_devices(8)  # XLA's environment is set in one place (scaletui.xla_env)
set_quick_compiles()  # compiling is most of the suite's work: XLA's optimizations off
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One cache for the whole run, never the user's: the native kernels compile once, and every
# XLA program once. JAX's persistent compile cache is on for the test process itself (not only
# for the `scaletui` processes the tests start, which inherit the same directory), so an engine
# that a later test builds again with the same shapes loads its programs instead of compiling.
# SCALETUI_TEST_CACHE names a directory to keep instead (pytest-xdist workers share the
# controller's; a developer may keep one between runs: programs of unchanged code load).
_CACHE_ENV = "SCALETUI_TEST_CACHE"
if not os.environ.get(_CACHE_ENV):
    _OWN_CACHE = tempfile.TemporaryDirectory(prefix="scaletui-test-cache-")
    os.environ[_CACHE_ENV] = _OWN_CACHE.name
_CACHE_DIR = os.environ[_CACHE_ENV]
os.environ["XDG_CACHE_HOME"] = _CACHE_DIR
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(_CACHE_DIR, "scaletui", "jax")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


_KERNEL_BUILD: list[subprocess.Popen] = []


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The xdist groups first (the longest units of work: a module's shared servers and
    caches), then the rest in file order: under -n each worker starts on a long unit and the
    short tests fill in behind, so no worker is left alone with a long unit at the end."""
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)


def pytest_sessionstart(session: pytest.Session) -> None:
    """The native kernels' build (about 13 s of one core) starts at once, in the background,
    in the controller or the only process: the run's cache is empty. Tests that load the
    kernels before it is done wait on the cache's build lock, not compile again."""
    if hasattr(session.config, "workerinput") or os.environ.get("SCALETUI_NATIVE_KERNELS") == "0":
        return
    build = [sys.executable, "-m", "scaletui", "build-kernels"]
    _KERNEL_BUILD.append(
        subprocess.Popen(build, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    )


def pytest_sessionfinish(session: pytest.Session) -> None:
    for proc in _KERNEL_BUILD:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.fixture(autouse=True)
def private_config(tmp_path_factory, monkeypatch) -> Path:
    """An empty $XDG_CONFIG_HOME per test: no `local` spec unless the test writes one; and
    temporary files (log folders, server logs) under pytest's own temporary tree, not /tmp."""
    config = tmp_path_factory.mktemp("xdg-config")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config))
    monkeypatch.setenv("XDG_CACHE_HOME", _CACHE_DIR)
    scratch = tmp_path_factory.mktemp("tmp")
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    return config


TINY_SEED = 3  # the dummy-weight seed of the shared `tiny` fixture


@pytest.fixture(scope="session")
def tiny_seed() -> int:
    return TINY_SEED


@pytest.fixture(scope="session")
def tiny():
    """The `tiny` model spec and its seeded dummy weights (TINY_SEED)."""
    from scaletui.serve.weights import weights
    from scaletui.specs import load_model

    m = load_model("tiny")
    return m, weights.dummy_params(m, seed=TINY_SEED)


@pytest.fixture(scope="session")
def greedy_reference():
    """greedy_reference(spec, seed, prompt, n) -> the n greedy tokens after `prompt` from the
    full causal forward of the seeded dummy model (padded to 64 positions: causal, harmless)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from scaletui.serve.engine import model
    from scaletui.serve.weights import weights

    forwards = {}

    def run(spec, seed: int, prompt: list[int], n: int) -> list[int]:
        if (spec, seed) not in forwards:
            params = jax.device_put(weights.dummy_params(spec, seed))
            forwards[spec, seed] = jax.jit(lambda t: model.forward(params, t, spec)[0])
        fwd = forwards[spec, seed]
        seq, out = list(prompt), []
        for _ in range(n):
            padded = np.zeros(64, np.int32)
            padded[: len(seq)] = seq
            tok = int(jnp.argmax(fwd(jnp.asarray(padded)[None])[len(seq) - 1]))
            out.append(tok)
            seq.append(tok)
        return out

    return run
