"""The CPU's multiply-add ceiling: what its vector units do with no memory traffic at all.

A small C++ loop (compiled here with the native kernels' compiler and -march=native) keeps 24
independent accumulators busy: `vdpbf16ps` where the CPU has AVX512_BF16 (what the pairs kernel
runs), else f32 FMAs on AVX-512 or AVX2. Run on 1..N threads at once, it gives the GFLOP/s a
dense kernel can at best reach, so a kernel's figure reads as a fraction of the hardware, not of
another kernel (`scaletui calibrate` times a real matmul: the roof the roofline uses).
"""

from __future__ import annotations

import shlex
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
#if defined(__AVX512BF16__)
typedef __m512 acc_t; typedef __m512bh arg_t;
#define KIND "bf16 pairs (vdpbf16ps)"
#define FLOPS_PER_OP 64
static inline acc_t step(acc_t a, arg_t x, arg_t w) { return _mm512_dpbf16_ps(a, x, w); }
static inline arg_t arg(int i) { return (arg_t)_mm512_set1_epi32(0x3f803f80 + i); }
static inline acc_t zero() { return _mm512_setzero_ps(); }
static inline float total(acc_t a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX512F__)
typedef __m512 acc_t; typedef __m512 arg_t;
#define KIND "f32 FMA (AVX-512)"
#define FLOPS_PER_OP 32
static inline acc_t step(acc_t a, arg_t x, arg_t w) { return _mm512_fmadd_ps(x, w, a); }
static inline arg_t arg(int i) { return _mm512_set1_ps(1.0f + i * 1e-7f); }
static inline acc_t zero() { return _mm512_setzero_ps(); }
static inline float total(acc_t a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 acc_t; typedef __m256 arg_t;
#define KIND "f32 FMA (AVX2)"
#define FLOPS_PER_OP 16
static inline acc_t step(acc_t a, arg_t x, arg_t w) { return _mm256_fmadd_ps(x, w, a); }
static inline arg_t arg(int i) { return _mm256_set1_ps(1.0f + i * 1e-7f); }
static inline acc_t zero() { return _mm256_setzero_ps(); }
static inline float total(acc_t a) { float v[8]; _mm256_storeu_ps(v, a); return v[0]; }
#else
#define KIND ""
#endif

#ifdef FLOPS_PER_OP
// 6 x 4 accumulators, as the kernels' micro-tile: each takes one multiply-add per iteration
static float run(long iters) {
  acc_t acc[24];
  for (int i = 0; i < 24; ++i) acc[i] = zero();
  arg_t x = arg(0), w[4];
  for (int c = 0; c < 4; ++c) w[c] = arg(c + 1);
  for (long k = 0; k < iters; ++k) {
    for (int r = 0; r < 6; ++r)
      for (int c = 0; c < 4; ++c) acc[r * 4 + c] = step(acc[r * 4 + c], x, w[c]);
    __asm__ volatile("" : "+v"(x));  // x "changes": the loop cannot be folded away
  }
  float s = 0;
  for (int i = 0; i < 24; ++i) s += total(acc[i]);
  return s;
}
#endif

int main(int argc, char** argv) {
#ifndef FLOPS_PER_OP
  std::printf("none\n");
  return 0;
#else
  const int threads = std::atoi(argv[1]);
  const long iters = std::atol(argv[2]);
  std::vector<float> sink(threads);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { sink[t] = run(iters); });
  for (auto& t : pool) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%s\t%.3f\n", KIND, threads * double(iters) * 24 * FLOPS_PER_OP / s / 1e9);
  return sink[0] == 12345.0f;  // keeps the sums alive
#endif
}
"""


def build(workdir: Path) -> Path:
    """The probe compiled into `workdir`; raises RuntimeError with the compiler's words."""
    from scaletui.serve.engine.native import toolchain

    cxx = toolchain.compiler()
    if cxx is None:
        raise RuntimeError(toolchain.missing_compiler())
    src, exe = workdir / "dot_ceiling.cc", workdir / "dot_ceiling"
    src.write_text(SOURCE)
    flags = ["-O3", "-march=native", "-std=c++17", "-pthread"]
    cmd = [*shlex.split(cxx), *flags, str(src), "-o", str(exe)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()[-400:]}")
    return exe


def ceilings(threads: list[int], iters: int) -> tuple[str, dict[int, float]]:
    """(what the loop multiplies, {threads: GFLOP/s}), best of 3 runs each; ("", {}) where the
    CPU has none of the vector units above."""
    with tempfile.TemporaryDirectory(prefix="scaletui-ceiling-") as tmp:
        exe = build(Path(tmp))
        kind, best = "", {}
        for n in threads:
            for _ in range(3):
                out = subprocess.run([str(exe), str(n), str(iters)], capture_output=True,
                                     text=True, timeout=120, check=True).stdout.strip()  # fmt: skip
                if out == "none":
                    return "", {}
                kind, rate = out.split("\t")
                best[n] = max(best.get(n, 0.0), float(rate))
        return kind, best
