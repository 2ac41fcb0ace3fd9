"""`scaletui build-kernels` and the kernel cache: one real compile, then a stand-in compiler
(a shell script that writes the output file) for forcing, failing and pruning."""

from __future__ import annotations

import ctypes
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from scaletui import cli
from scaletui.commands import build_kernels
from scaletui.serve.engine.native import toolchain

COMPILING = "compiling native CPU kernels"


def _fake_compiler(tmp_path, body: str = 'echo built > "$out"') -> str:
    """A `CXX` that finds the argument after -o and runs `body` with it as $out."""
    script = tmp_path / "fake-cxx"
    script.write_text(
        f'#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done\n{body}\n'
    )
    script.chmod(0o755)
    return str(script)


def _compiling_lines(caplog) -> int:
    return sum(COMPILING in r.getMessage() for r in caplog.records)


@pytest.fixture
def cache(tmp_path, monkeypatch, caplog):
    """A fresh $XDG_CACHE_HOME; kernel log lines captured from DEBUG up."""
    home = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    caplog.set_level(logging.DEBUG, logger="scaletui.serve.native")
    return home / "scaletui" / "kernels"


@pytest.mark.skipif(toolchain.compiler() is None, reason=toolchain.missing_compiler())
@pytest.mark.slow  # one real compile (at -O0, a third of -O3's time: later flags win)
def test_build_kernels_compiles_once_then_hits_the_cache(cache, caplog, capsys, monkeypatch):
    monkeypatch.setenv("SCALETUI_CXXFLAGS", "-O0")
    assert cli.main(["build-kernels"]) == 0
    first = capsys.readouterr().out
    built = list(cache.glob("kernels-*.so"))
    assert len(built) == 1 and str(built[0]) in first
    assert "compiler:" in first and "-march=native" in first and "built in" in first
    lib = ctypes.CDLL(str(built[0]))  # a real library with the kernels' entry points
    assert lib.ScaletuiDenseF32 and lib.ScaletuiDecodeAttentionF32

    assert cli.main(["build-kernels"]) == 0
    assert "cached:" in capsys.readouterr().out
    assert _compiling_lines(caplog) == 1
    assert list(cache.glob("kernels-*.so")) == built


def test_force_rebuilds(cache, caplog, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path))
    assert build_kernels.main([]) == 0
    assert build_kernels.main([]) == 0
    assert _compiling_lines(caplog) == 1
    assert build_kernels.main(["--force"]) == 0
    assert _compiling_lines(caplog) == 2
    assert "built in" in capsys.readouterr().out.split("cache:")[-1]


def test_failing_compiler_exits_1_with_its_last_lines(cache, capsys, monkeypatch, tmp_path):
    body = 'echo "kernels.cc:1:1: error: the first" >&2; echo "the last error line" >&2; exit 3'
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path, body))
    assert build_kernels.main([]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("scaletui build-kernels: error: compiling kernels.cc failed")
    assert "exit 3" in err[0] and err[-1] == "the last error line"
    assert not list(cache.glob("*.so"))  # neither a library nor a half-written temporary


def test_no_compiler_is_one_line(cache, capsys, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert build_kernels.main([]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["scaletui build-kernels: error: no C++ compiler: $CXX='/nonexistent/c++' "
                   "is not an executable"]  # fmt: skip


def _entry(folder, name: str, age_s: float):
    path = folder / name
    path.write_text(name)
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def test_prune_keeps_the_newest_n_and_the_current_one(tmp_path):
    current = _entry(tmp_path, "kernels-current.so", age_s=1000)  # the oldest, still kept
    others = [_entry(tmp_path, f"kernels-old{i}.so", age_s=10 * (i + 1)) for i in range(5)]
    stale_tmp = _entry(tmp_path, "building-dead.so", age_s=toolchain.TIMEOUT_S + 60)
    live_tmp = _entry(tmp_path, "building-live.so", age_s=1)  # another process compiling now
    removed = toolchain.prune(current, keep=3)
    assert sorted(removed) == sorted([*others[3:], stale_tmp])
    assert sorted(tmp_path.iterdir()) == sorted([current, *others[:3], live_tmp])


def test_a_build_prunes_old_builds_and_says_so(cache, caplog, monkeypatch, tmp_path):
    cache.mkdir(parents=True)
    old = [_entry(cache, f"kernels-old{i}.so", age_s=10 * (i + 1)) for i in range(4)]
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path))
    built = toolchain.ensure(keep=2)
    assert built.compiled and built.pruned == tuple(old[2:])
    assert sorted(cache.glob("*.so")) == sorted([built.path, *old[:2]])
    assert any("pruned 2 old build(s)" in r.getMessage() for r in caplog.records)


def test_processes_that_start_together_build_once(cache, caplog, monkeypatch, tmp_path):
    """Two first uses at once (a server and its fit, two test workers): one compiles while
    the other waits on the cache's lock, then loads that build."""
    calls = tmp_path / "calls"
    body = f'echo call >> "{calls}"; sleep 0.5; echo built > "$out"'
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path, body))
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda _: toolchain.ensure(), range(2))
    assert calls.read_text().splitlines() == ["call"]
    assert a.path == b.path and sorted([a.compiled, b.compiled]) == [False, True]


def test_an_unwritable_cache_still_builds_for_this_process(monkeypatch, tmp_path):
    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache folder would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path))
    built = toolchain.ensure()
    assert built.compiled and built.path.exists() and not str(built.path).startswith(str(blocked))


def test_auto_prefers_xla_ops_only_on_a_cpu_without_avx2(monkeypatch):
    """The kernels are tuned for AVX2 and AVX-512 (measured faster than XLA's ops on both);
    elsewhere `auto` keeps XLA's ops."""
    monkeypatch.setattr(toolchain, "_cpu_line", lambda: "flags : fpu sse4_2 avx")
    assert "AVX2" in toolchain.slower_here() and "sse4_2" in toolchain.slower_here()
    for flags in ("fpu sse4_2 avx avx2 fma", "avx2 fma avx512f avx512bw"):
        monkeypatch.setattr(toolchain, "_cpu_line", lambda f=flags: f"flags : {f}")
        assert toolchain.slower_here() is None
