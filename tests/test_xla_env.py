"""XLA's environment is set in one place (`scaletui.xla_env`): the virtual CPU device count
replaces an earlier one (or keeps it when asked), other XLA flags stay, and a child's
environment is a copy that leaves this process's alone."""

from __future__ import annotations

from scaletui import xla_env

FLAG = xla_env.HOST_DEVICES_FLAG


def test_set_host_devices_replaces_the_count_and_keeps_other_flags() -> None:
    env = {"XLA_FLAGS": f"--xla_cpu_foo=1 {FLAG}=8"}
    xla_env.set_host_devices(2, env)
    assert env["XLA_FLAGS"] == f"--xla_cpu_foo=1 {FLAG}=2"
    assert xla_env.host_devices(env) == 2
    xla_env.set_host_devices(4, env, keep=True)  # a count that is there stays
    assert xla_env.host_devices(env) == 2
    empty: dict[str, str] = {}
    assert xla_env.host_devices(empty) is None
    xla_env.set_host_devices(4, empty, keep=True)
    assert empty == {"XLA_FLAGS": f"{FLAG}=4"}


def test_child_env_is_a_copy() -> None:
    base = {"XLA_FLAGS": f"{FLAG}=8", "PATH": "/bin"}
    env = xla_env.child_env(3, preallocate=False, base=base)
    assert env["XLA_FLAGS"] == f"{FLAG}=3" and env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert env["PATH"] == "/bin" and base["XLA_FLAGS"] == f"{FLAG}=8"
    assert xla_env.child_env(None, base=base) == base  # None: as the parent says


def test_quick_compiles_switch_optimizations_off_once_and_keep_the_device_count() -> None:
    env = {"XLA_FLAGS": f"{FLAG}=8"}
    xla_env.set_quick_compiles(env)
    xla_env.set_quick_compiles(env)  # twice: the flag once
    assert env["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1"
    assert env["XLA_FLAGS"] == f"{FLAG}=8 {xla_env.QUICK_CPU_FLAG}"
    xla_env.set_host_devices(2, env)
    assert env["XLA_FLAGS"] == f"{xla_env.QUICK_CPU_FLAG} {FLAG}=2"


def test_this_jax_accepts_the_quick_compile_flags() -> None:
    """The test session runs under them (conftest): a jaxlib that dropped the CPU flag would
    refuse XLA_FLAGS at start-up, so say it here, by name."""
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    xla_env.set_quick_compiles(env)
    code = "import jax, jax.numpy as jnp; print(int(jax.jit(lambda x: x + 1)(jnp.int32(1))))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.stdout.strip() == "2", f"{xla_env.QUICK_CPU_FLAG}: {proc.stderr[-2000:]}"
