"""The persistent compilation cache every `scaletui` command turns on: where it points, that a
user's choice (a dir, or empty: off) wins, and that a process started after `enable` really
stores its compiled programs there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from scaletui import compile_cache


def test_enable_points_jax_at_the_scaletui_cache_unless_the_user_chose(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    assert compile_cache.enable(env) == tmp_path / "scaletui" / "jax"
    assert env[compile_cache.DIR_ENV] == str(tmp_path / "scaletui" / "jax")
    assert (tmp_path / "scaletui" / "jax").is_dir()
    assert float(env[compile_cache.MIN_TIME_ENV]) == compile_cache.MIN_COMPILE_S
    mine = {"XDG_CACHE_HOME": "/somewhere", compile_cache.DIR_ENV: "/mine"}
    assert compile_cache.enable(mine) == Path("/mine")
    assert compile_cache.MIN_TIME_ENV not in mine  # the user's cache, the user's settings
    off = {compile_cache.DIR_ENV: ""}
    assert compile_cache.enable(off) is None and off[compile_cache.DIR_ENV] == ""


def test_a_cache_home_that_cannot_be_written_leaves_the_cache_off(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    env = {"XDG_CACHE_HOME": str(blocked)}
    assert compile_cache.enable(env) is None and compile_cache.DIR_ENV not in env


def test_usage_counts_the_files_under_the_cache(tmp_path):
    assert compile_cache.usage(None) == (0, 0)
    assert compile_cache.usage(tmp_path / "not-yet") == (0, 0)
    (tmp_path / "a").write_bytes(b"12345")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"678")
    assert compile_cache.usage(tmp_path) == (2, 8)


def test_a_process_started_after_enable_stores_its_programs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != compile_cache.DIR_ENV}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    env[compile_cache.MIN_TIME_ENV] = "0"  # this program compiles in milliseconds
    compile_cache.enable(env)
    code = "import jax, jax.numpy as jnp; jax.jit(lambda x: x @ x + 1)(jnp.ones((32, 32))).block_until_ready()"  # noqa: E501
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    entries, nbytes = compile_cache.usage(compile_cache.cache_dir(env))
    assert entries >= 1 and nbytes > 0
