"""Test setup: JAX on the CPU with 8 virtual devices, set before anything imports jax, and a
private config and cache for every test, so a test never reads or writes the user's `local`
hardware spec or kernel cache (a `scaletui` run before the tests must not change their results).
"""

import os
import tempfile
from pathlib import Path

import pytest

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One cache for the whole run (the native kernels compile once, ~3 s), never the user's.
_CACHE = tempfile.TemporaryDirectory(prefix="scaletui-test-cache-")
os.environ["XDG_CACHE_HOME"] = _CACHE.name


@pytest.fixture(autouse=True)
def private_config(tmp_path_factory, monkeypatch) -> Path:
    """An empty $XDG_CONFIG_HOME per test: no `local` spec unless the test writes one."""
    config = tmp_path_factory.mktemp("xdg-config")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config))
    monkeypatch.setenv("XDG_CACHE_HOME", _CACHE.name)
    return config
