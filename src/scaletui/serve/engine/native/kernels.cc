// Native CPU kernels for the decode hot path, called from XLA through its FFI.
//
// XLA CPU runs thin matmuls ([B <= 16, D] x [D, F]) at a third to a half of this machine's
// memory bandwidth and far below its FLOP/s, converts a bf16 or int8 weight whole before using
// it, and runs decode attention as many tiny batched dots (docs/serve.md). These kernels
// do the same math the way the roofline assumes it:
//
//   scaletui_dense_{f32,bf16,i8}
//                        y[M, N] = x[M, D] @ W, with W pre-packed as panels [N/P, D, P] (P =
//                        kPanel) so each panel streams contiguously and every weight load feeds
//                        all rows. Weights stay as stored (f32, bf16, or int8 with an f32 scale
//                        per output column) and widen to f32 in registers: a bf16 step reads
//                        half the bytes, an int8 step a quarter. x and y are f32. From
//                        kPackRows rows (prompts) a blocked GEMM runs instead (gemm_panels).
//   scaletui_dense_bf16_dot
//                        bf16 x [M, D] @ bf16 W packed in pairs panels [N/P, D/2, 2P]
//                        (`--dtype bf16` where the CPU has AVX512_BF16): vdpbf16ps, twice
//                        the multiply-adds of an f32 FMA.
//   scaletui_dense_bf16_dot_swiglu
//                        the same on the MLP's [Wg | Wu], writing silu(x Wg) * (x Wu) in bf16.
//   scaletui_dense_i8_dot
//                        the same for int8 panels from native.I8_DOT_ROWS rows (prompts, batches):
//                        each k block converted to bf16 pairs once (exact), scales at the end.
//   scaletui_decode_attention_{f32,bf16,i8}
//                        one decode step of attention for every row: writes the step's K/V
//                        into the paged KV cache (in place: the pool buffers are aliased
//                        inputs/outputs) at the page its page table names for the position,
//                        and attends over exactly its positions 0..pos, page by page. The
//                        pool stays as stored (bf16, or int8 with an f32 scale per position
//                        and KV head, applied to the scores and the probabilities) and widens
//                        to f32 in registers, like the weights.
//   scaletui_prefill_attention_{f32,bf16_bits,bf16_dot}
//                        a prompt chunk's causal attention over its earlier pages and its own
//                        K/V (flash attention's online softmax), f32 FMAs; bf16_dot: a bf16 q
//                        over a bf16 pool on vdpbf16ps, the probabilities rounded to bf16.
//
// Work is split over XLA's intra-op thread pool. Written with GCC vector extensions and
// compiled with -march=native: with AVX-512 a vector is 16 floats and a dense panel 64 columns
// (a 6 x 4 block of accumulators in 24 of its 32 registers); without it (AVX2) a vector is 8
// floats and a panel 16 columns (6 x 2 accumulators in 12 of its 16 registers), so nothing
// spills. `scaletui_panel_width()` tells the packer which.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
#define SCALETUI_LANES 16
constexpr int kVecs = 4;  // vectors per panel row
#else
#define SCALETUI_LANES 8
constexpr int kVecs = 2;
#endif
constexpr int kLanes = SCALETUI_LANES;
typedef float vf __attribute__((vector_size(4 * SCALETUI_LANES)));
typedef float vf_u __attribute__((vector_size(4 * SCALETUI_LANES), aligned(4)));  // unaligned
typedef int32_t vi __attribute__((vector_size(4 * SCALETUI_LANES)));
typedef uint32_t vu32 __attribute__((vector_size(4 * SCALETUI_LANES)));
typedef uint16_t vu16_u __attribute__((vector_size(2 * SCALETUI_LANES), aligned(2)));
typedef int8_t vi8_u __attribute__((vector_size(SCALETUI_LANES), aligned(1)));
constexpr int kPanel = kLanes * kVecs;  // packed weight panel width (columns)
constexpr int kKBlock = 64;     // panel rows per block when the batch needs several passes
constexpr int kPrefetch = 64;   // panel rows ahead to prefetch (= kKBlock: the next block)
constexpr int kRowBlock = 6;    // batch rows per micro-kernel pass: 6 x kVecs accumulators
constexpr int64_t kPackRows = 20;  // from this many rows the blocked GEMM runs (gemm_panels)
constexpr int kMaxHeadDim = 256;
constexpr int kAccs = kLanes == 16 ? 16 : 8;  // attention's accumulators in flight

inline vf load(const float* p) { return *reinterpret_cast<const vf_u*>(p); }
inline void store(float* p, vf v) { *reinterpret_cast<vf_u*>(p) = v; }
// a broadcast: with AVX2 / AVX-512 one load-broadcast from memory (`vf{} + x` compiled to an add
// and a register shuffle per splat, on the FP pipes the FMAs need: half the GEMM rate)
inline vf splat(float x) {
#if defined(__AVX512F__)
  return _mm512_set1_ps(x);
#elif defined(__AVX2__)
  return _mm256_set1_ps(x);
#else
  return vf{} + x;
#endif
}

// exp for x <= 0 (softmax after subtracting the max): 2^n * p(f), |rel err| < 2e-7
inline vf vexp(vf x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  vf t = x * splat(1.44269504088896341f);
  vf r = (t + splat(12582912.0f)) - splat(12582912.0f);  // round to nearest
  vf f = x - r * splat(0.693359375f) - r * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * f + splat(1.3981999507e-3f);
  p = p * f + splat(8.3334519073e-3f);
  p = p * f + splat(4.1665795894e-2f);
  p = p * f + splat(1.6666665459e-1f);
  p = p * f + splat(5.0000001201e-1f);
  p = p * f * f + f + splat(1.0f);
  vi e = (__builtin_convertvector(r, vi) + 127) << 23;
  return p * (vf)e;
}

// Threads to use besides the caller: SCALETUI_NATIVE_THREADS - 1 when set, else one fewer than
// XLA's intra-op pool (the caller is usually one of its threads), at least one.
int64_t max_helpers(ffi::ThreadPool& pool) {
  static const int64_t from_env = [] {
    const char* v = std::getenv("SCALETUI_NATIVE_THREADS");
    return v ? std::max(0L, std::atol(v) - 1) : -1L;
  }();
  return from_env >= 0 ? from_env : std::max<int64_t>(1, pool.num_threads() - 1);
}

// Runs fn(i) for i in [0, n) on the caller and XLA's pool. Indices are claimed from a shared
// counter, so a pool task that starts late (or never, on a one-thread pool) only finds no work;
// the caller returns when every claimed index is done. `grain` indices are claimed at a time;
// 0 means one contiguous range per thread (what streaming a weight wants: each thread reads
// one sequential stretch that its prefetches run ahead in).
template <typename Fn>
void parallel_for(ffi::ThreadPool& pool, int64_t n, int64_t grain, const Fn& fn) {
  if (grain <= 0) grain = (n + max_helpers(pool)) / (max_helpers(pool) + 1);
  int64_t helpers = std::min<int64_t>(max_helpers(pool), (n + grain - 1) / grain - 1);
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  struct Job {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto job = std::make_shared<Job>();
  auto work = [job, n, grain, &fn] {
    for (;;) {
      int64_t lo = job->next.fetch_add(grain, std::memory_order_relaxed);
      if (lo >= n) return;  // no claim: `fn` (which may be gone by now) is not touched
      int64_t hi = std::min(n, lo + grain);
      for (int64_t i = lo; i < hi; ++i) fn(i);
      job->done.fetch_add(hi - lo, std::memory_order_release);
    }
  };
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule(decltype(work)(work));
  work();
  for (int spins = 0; job->done.load(std::memory_order_acquire) < n; ++spins) {
    if (spins > 4096) std::this_thread::yield();
  }
}

// ---------------------------------------------------------------------------------------------
// dense: y[M, N] = x[M, D] @ W, W packed [N/P, D, P] as f32, bf16 or int8 (+ f32 column scales)

// kLanes consecutive weights of a panel row, widened to f32 (GCC's generic vector conversions
// come out as one scalar convert per element here, so AVX2 / AVX-512 spell them out).
inline vf widen(const float* p) { return load(p); }
inline vf widen(const uint16_t* p) {  // bf16: the high half of an f32
#if defined(__AVX512F__)
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#elif defined(__AVX2__)
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#else
  vu32 w = __builtin_convertvector(*reinterpret_cast<const vu16_u*>(p), vu32) << 16;
  return (vf)w;
#endif
}
inline vf widen(const int8_t* p) {  // int8: the column scale is applied once, to the sums
#if defined(__AVX512F__)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  return __builtin_convertvector(*reinterpret_cast<const vi8_u*>(p), vf);
#endif
}

template <int MB, typename W>
inline void dense_micro(const float* x, int64_t ldx, const W* panel, int64_t k0, int64_t k1,
                        float* y, int64_t ldy, bool first, int pass, int passes) {
  constexpr int64_t kRowBytes = kPanel * sizeof(W);
  // prefetch one cache line every kStride rows (a panel row is 16..256 bytes)
  constexpr int kStride = kRowBytes >= 64 ? 1 : 64 / kRowBytes;
  // Accumulator sets the rows take turns on. A row's FMAs wait for the previous row's (4-5
  // cycles), so with one set a core does one panel row per FMA latency whatever MB is: on AVX2
  // (16-column panels) that held an int8 batch-1 read well under the memory's speed, which the
  // sets recover (docs/serve.md, "Native CPU kernels", has the figures). f32 and bf16 rows
  // carry 4x and 2x the bytes, so memory binds first (sets measured no faster there), and
  // AVX-512's 64-column rows do 16 weights a cycle with one set.
  constexpr int kSets = kLanes == 8 && std::is_same_v<W, int8_t> && MB <= 2 ? 4 / MB : 1;
  vf acc[kSets][MB][kVecs];
  for (int s = 0; s < kSets; ++s)
    for (int r = 0; r < MB; ++r)
      for (int c = 0; c < kVecs; ++c)
        acc[s][r][c] = first || s > 0 ? vf{} : load(y + r * ldy + c * kLanes);
  // this pass prefetches every passes-th line: the work is spread over all passes. f32 panels
  // with AVX2 (one 64-byte line a row) in one pass of one or two rows leave it to the hardware
  // prefetcher, which alone streams faster there; from 3 rows, over several passes, and for
  // bf16 / int8 rows the prefetch pays (docs/serve.md, "Native CPU kernels")
  const bool prefetch = kLanes == 16 || !std::is_same_v<W, float> || passes > 1 || MB > 2;
  int countdown = pass;
  auto row = [&](int64_t k, vf (&a)[MB][kVecs]) __attribute__((always_inline)) {
    const W* w = panel + k * kPanel;
    if (prefetch && k % kStride == 0 && countdown-- == 0) {
      countdown = passes - 1;
      // into L2 (prefetcht1): L1's few fill buffers would cap how far ahead this can run
      const char* ahead = reinterpret_cast<const char*>(w + kPrefetch * kPanel);
      for (int64_t b = 0; b < kRowBytes; b += 64) __builtin_prefetch(ahead + b, 0, 2);
    }
    vf wv[kVecs];
    for (int c = 0; c < kVecs; ++c) wv[c] = widen(w + c * kLanes);
    for (int r = 0; r < MB; ++r) {
      vf xv = splat(x[r * ldx + k]);
      for (int c = 0; c < kVecs; ++c) a[r][c] += xv * wv[c];
    }
  };
  int64_t k = k0;
  for (; k + kSets <= k1; k += kSets)
    for (int s = 0; s < kSets; ++s) row(k + s, acc[s]);
  for (; k < k1; ++k) row(k, acc[0]);
  for (int s = 1; s < kSets; ++s)
    for (int r = 0; r < MB; ++r)
      for (int c = 0; c < kVecs; ++c) acc[0][r][c] += acc[s][r][c];
  for (int r = 0; r < MB; ++r)
    for (int c = 0; c < kVecs; ++c) store(y + r * ldy + c * kLanes, acc[0][r][c]);
}

template <typename W>
void dense_rows(const float* x, int64_t m, int64_t d, const W* panel, int64_t k0, int64_t k1,
                float* y, int64_t n, bool first) {
  const int passes = static_cast<int>((m + kRowBlock - 1) / kRowBlock);
  int pass = 0;
  int64_t r = 0;
  for (; r + kRowBlock <= m; r += kRowBlock, ++pass)
    dense_micro<kRowBlock>(x + r * d, d, panel, k0, k1, y + r * n, n, first, pass, passes);
  const float* xr = x + r * d;
  float* yr = y + r * n;
  switch (m - r) {
    case 1: dense_micro<1>(xr, d, panel, k0, k1, yr, n, first, pass, passes); break;
    case 2: dense_micro<2>(xr, d, panel, k0, k1, yr, n, first, pass, passes); break;
    case 3: dense_micro<3>(xr, d, panel, k0, k1, yr, n, first, pass, passes); break;
    case 4: dense_micro<4>(xr, d, panel, k0, k1, yr, n, first, pass, passes); break;
    case 5: dense_micro<5>(xr, d, panel, k0, k1, yr, n, first, pass, passes); break;
    default: break;
  }
}

// One panel's kPanel output columns for a few rows (m < kPackRows); `scale` (int8) holds the
// panel's column scales, or is null.
template <typename W>
void dense_panel(const float* x, int64_t m, int64_t d, const W* panel, const float* scale,
                 float* y, int64_t n) {
  if (m <= kRowBlock) {  // one pass: stream the panel once
    dense_rows(x, m, d, panel, 0, d, y, n, true);
  } else if (std::is_same_v<W, float>) {
    // several row passes: walk the panel in k blocks so each block is read from DRAM once and
    // re-read from L1 by the other passes; the passes take turns prefetching the next block's
    // rows, so memory stays busy through all of them (11% off a batch-16 step against the
    // first pass prefetching it all)
    for (int64_t k0 = 0; k0 < d; k0 += kKBlock)
      dense_rows(x, m, d, panel, k0, std::min(d, k0 + kKBlock), y, n, k0 == 0);
  } else {
    // bf16 / int8 over several passes: widen each k block once into an L1 scratch block, which
    // every pass then reads as f32 (widening per pass cost more than the f32 step saved)
    alignas(64) float block[kKBlock * kPanel];
    for (int64_t k0 = 0; k0 < d; k0 += kKBlock) {
      const int64_t rows = std::min<int64_t>(kKBlock, d - k0);
      const W* src = panel + k0 * kPanel;
      // the next block's lines are fetched while this one's passes compute
      const char* next = reinterpret_cast<const char*>(src + kKBlock * kPanel);
      for (int64_t b = 0; b < kKBlock * kPanel * int64_t{sizeof(W)}; b += 64)
        __builtin_prefetch(next + b, 0, 2);
      for (int64_t i = 0; i < rows * kPanel; i += kLanes) store(block + i, widen(src + i));
      dense_rows(x + k0, m, d, static_cast<const float*>(block), 0, rows, y, n, k0 == 0);
    }
  }
  if (scale == nullptr) return;
  for (int64_t r = 0; r < m; ++r)
    for (int c = 0; c < kVecs; ++c)
      store(y + r * n + c * kLanes, load(y + r * n + c * kLanes) * load(scale + c * kLanes));
}

// --- many rows (prompts): a blocked GEMM over x packed once per call -------------------------
//
// x is copied into row blocks of kRowBlock rows interleaved by k ([ceil(M/6), D, 6]), so the
// micro-kernel's broadcasts read one sequential stream (x's own rows sit D floats apart: with
// D a multiple of 1024 every row maps to the same few L1 sets). Each thread owns a range of
// panels and walks it k block by k block: one panel's k block (kGemmK x kPanel, widened to f32
// once for bf16/int8) stays in L2 across the row blocks, whose packed x streams past it. Row
// chunks of kGemmRows bound the packed x one k block holds.

// panel rows per k block: 1024 x kPanel f32 = 256 KiB, read from L2 by every row block. Each
// block costs a load and a store of the 6 x kPanel sums per row block; at 64 rows (16 KiB, in
// L1) those held the kernel at 154 / 171 GFLOP/s for 128 / 512 rows of a 2048 x 8192 bf16
// matmul on Zen 4, at 1024 it runs 182 / 196 (bench/dense_kernels.py `widen`, side by side).
constexpr int64_t kGemmK = 1024;
constexpr int64_t kGemmRows = 32 * kRowBlock;  // rows per chunk (packed x: <= 768 KiB per k block)

// y[0:rows, 0:kPanel] (+)= xb[kc, 6] @ wb[kc, kPanel]; rows <= 6 (xb zero past them).
inline void gemm_micro(const float* xb, const float* wb, int64_t kc, float* y, int64_t ldy,
                       int64_t rows, bool first) {
  vf acc[kRowBlock][kVecs] = {};
  for (int64_t k = 0; k < kc; ++k) {
    vf wv[kVecs];
    for (int c = 0; c < kVecs; ++c) wv[c] = load(wb + k * kPanel + c * kLanes);
    for (int r = 0; r < kRowBlock; ++r) {
      vf xv = splat(xb[k * kRowBlock + r]);
      for (int c = 0; c < kVecs; ++c) acc[r][c] += xv * wv[c];
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < kVecs; ++c) {
      float* out = y + r * ldy + c * kLanes;
      store(out, first ? acc[r][c] : load(out) + acc[r][c]);
    }
}

// x [M, D] -> [ceil(M/6), D, 6], zero rows past M.
std::vector<float> pack_rows(const float* x, int64_t m, int64_t d) {
  const int64_t blocks = (m + kRowBlock - 1) / kRowBlock;
  std::vector<float> out(blocks * d * kRowBlock, 0.0f);
  for (int64_t r = 0; r < m; ++r) {
    float* dst = out.data() + (r / kRowBlock) * d * kRowBlock + r % kRowBlock;
    const float* src = x + r * d;
    for (int64_t k = 0; k < d; ++k) dst[k * kRowBlock] = src[k];
  }
  return out;
}

// Panels [p0, p1) of y = x @ W for all m rows, x packed by pack_rows.
template <typename W>
void gemm_panels(const float* xp, int64_t m, int64_t d, const W* w, const float* scale,
                 int64_t p0, int64_t p1, float* y, int64_t n) {
  std::vector<float> scratch(std::is_same_v<W, float> ? 0 : kGemmK * kPanel);  // widened block
  float* block = scratch.data();
  for (int64_t r0 = 0; r0 < m; r0 += kGemmRows) {
    const int64_t r1 = std::min(m, r0 + kGemmRows);
    for (int64_t k0 = 0; k0 < d; k0 += kGemmK) {
      const int64_t kc = std::min(kGemmK, d - k0);
      for (int64_t p = p0; p < p1; ++p) {
        const W* src = w + (p * d + k0) * kPanel;
        const float* wb;
        if constexpr (std::is_same_v<W, float>) {
          wb = src;
        } else {
          for (int64_t i = 0; i < kc * kPanel; i += kLanes) store(block + i, widen(src + i));
          wb = block;
        }
        for (int64_t r = r0; r < r1; r += kRowBlock)
          gemm_micro(xp + ((r / kRowBlock) * d + k0) * kRowBlock, wb, kc,
                     y + r * n + p * kPanel, n, std::min<int64_t>(kRowBlock, r1 - r), k0 == 0);
      }
    }
    if (scale == nullptr) continue;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = p0 * kPanel; c < p1 * kPanel; c += kLanes)
        store(y + r * n + c, load(y + r * n + c) * load(scale + c));
  }
}

template <ffi::DataType T>
ffi::Error DenseAny(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<T, 3>& w,
                    const float* scale, int64_t n_scale, ffi::ResultBuffer<ffi::F32>& y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() < 1 || wd[2] != kPanel || xd.back() != wd[1])
    return ffi::Error::InvalidArgument("dense: need x [..., D] and W packed [N/" +
                                       std::to_string(kPanel) + ", D, " +
                                       std::to_string(kPanel) + "]");
  const int64_t d = wd[1], panels = wd[0], n = panels * kPanel;
  if (scale != nullptr && n_scale != n)
    return ffi::Error::InvalidArgument("dense: int8 W needs one scale per packed column");
  const int64_t m = static_cast<int64_t>(x.element_count()) / d;
  const float* xp = x.typed_data();
  const auto* wp = w.typed_data();
  float* yp = y->typed_data();
  if (m >= kPackRows) {  // many rows: one contiguous range of panels per thread
    const std::vector<float> packed = pack_rows(xp, m, d);
    const int64_t slices = std::min(panels, max_helpers(pool) + 1);
    parallel_for(pool, slices, 1, [&](int64_t i) {
      gemm_panels(packed.data(), m, d, wp, scale, i * panels / slices, (i + 1) * panels / slices,
                  yp, n);
    });
    return ffi::Error::Success();
  }
  parallel_for(pool, panels, 0, [&](int64_t p) {
    dense_panel(xp, m, d, wp + p * d * kPanel, scale ? scale + p * kPanel : nullptr,
                yp + p * kPanel, n);
  });
  return ffi::Error::Success();
}

ffi::Error DenseF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32, 3> w,
                    ffi::ResultBuffer<ffi::F32> y) {
  return DenseAny(pool, x, w, nullptr, 0, y);
}

ffi::Error DenseBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                     ffi::Buffer<ffi::BF16, 3> w, ffi::ResultBuffer<ffi::F32> y) {
  return DenseAny(pool, x, w, nullptr, 0, y);
}

ffi::Error DenseI8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8, 3> w,
                   ffi::Buffer<ffi::F32, 1> scale, ffi::ResultBuffer<ffi::F32> y) {
  return DenseAny(pool, x, w, scale.typed_data(), static_cast<int64_t>(scale.element_count()),
                  y);
}

// --- bf16 compute on bf16 weights: bf16 pairs (AVX512_BF16) ----------------------------------
//
// scaletui_dense_bf16_dot is what `--dtype bf16` runs on bf16 weights where the CPU has
// AVX512_BF16: x [M, D] bf16 and W packed in *pairs* panels [N/P, ceil(D/2), 2P], each row
// holding rows 2k and 2k + 1 of a P-column panel interleaved (column c's pair at 2c, 2c + 1),
// which is the operand layout of vdpbf16ps: 32 multiply-adds per instruction, twice an f32
// FMA's, every product exact (bf16 x bf16) and the sums f32. x is packed once per call into
// 6-row blocks of pairs; each thread streams its own range of panels once per 192 rows, k block
// by k block, prefetching the next block. Elsewhere bf16 weights keep the plain panels and the
// widening kernel (x passed as f32: the same exact products at f32's rate).

#if defined(__AVX512BF16__)
static_assert(kPanel == 64, "the pairs kernel is written for AVX-512's 64-column panels");
constexpr bool kBF16Dot = true;
// k pairs per block: 512 x 2P bf16 = 128 KiB of weight, read from L2 by every row block after
// the first. Each block costs a load and a store of the 6 x 64 sums per row block; at 64 pairs
// (16 KiB, L1-sized) those round trips held the kernel to 0.75 of the core's vdpbf16ps rate,
// at 512 it runs at 0.87-0.91 (M = 128 and 512; docs/benchmarks.md, "The native dense kernel").
// int8 panels are converted to bf16 pairs one such block at a time (128 rows: 299-310 -> 319-351).
constexpr int64_t kDotPairs = 512;
constexpr int64_t kDotAhead = 32;  // pairs ahead to prefetch: 8 KiB, as the widening kernel

// Row block b of x [M, D] bf16 as pairs [ceil(D/2), 6] uint32 (low half: the even k), zero past
// M and D: the broadcasts the micro-kernel reads, in order. Written into block b of `out`.
void pack_pair_block(const uint16_t* x, int64_t m, int64_t d, int64_t b, uint32_t* out) {
  const int64_t d2 = (d + 1) / 2, whole = d / 2;
  uint32_t* dst = out + b * d2 * kRowBlock;
  for (int r = 0; r < kRowBlock; ++r) {
    const int64_t row = b * kRowBlock + r;
    if (row >= m) {
      for (int64_t j = 0; j < d2; ++j) dst[j * kRowBlock + r] = 0u;
      continue;
    }
    const uint16_t* src = x + row * d;
    for (int64_t j = 0; j < whole; ++j)
      dst[j * kRowBlock + r] = src[2 * j] | static_cast<uint32_t>(src[2 * j + 1]) << 16;
    if (d % 2) dst[whole * kRowBlock + r] = src[d - 1];
  }
}

// x packed as pairs [ceil(M/6), ceil(D/2), 6]; the buffer is the calling thread's, kept between
// calls up to kKeepPacked bytes (a fresh one each call faulted in its pages and zeroed them: 3 %
// of an O or down projection at 128 rows), or owned here past that.
constexpr size_t kKeepPacked = size_t{8} << 20;
constexpr int64_t kPackGrain = 1 << 16;  // pairs a thread packs per claim
struct PackedPairs {
  std::unique_ptr<uint32_t[]> owned;
  const uint32_t* data = nullptr;
};

// Row blocks are shared out over the pool when x is large (a prompt): the packing ran on one
// thread while the other waited, 2-3 % of a prompt's matmuls.
PackedPairs pack_pairs(ffi::ThreadPool& pool, const uint16_t* x, int64_t m, int64_t d) {
  thread_local std::unique_ptr<uint32_t[]> kept;
  thread_local size_t kept_size = 0;
  const int64_t blocks = (m + kRowBlock - 1) / kRowBlock, per_block = (d + 1) / 2 * kRowBlock;
  const size_t size = static_cast<size_t>(blocks * per_block);
  PackedPairs out;
  uint32_t* buf;
  if (size * sizeof(uint32_t) > kKeepPacked) {
    out.owned.reset(new uint32_t[size]);
    buf = out.owned.get();
  } else {
    if (kept_size < size) kept.reset(new uint32_t[size]), kept_size = size;
    buf = kept.get();
  }
  out.data = buf;
  parallel_for(pool, blocks, std::max<int64_t>(1, kPackGrain / per_block),
               [&](int64_t b) { pack_pair_block(x, m, d, b, buf); });
  return out;
}

// x [..., D] bf16 packed once (pack_pairs), then `panels` weight panels (or the MLP's panel
// pairs) shared out as one contiguous range per thread: run(x packed, rows, p0, p1).
template <typename Run>
void over_panels(ffi::ThreadPool& pool, const ffi::Buffer<ffi::BF16>& x, int64_t d,
                 int64_t panels, const Run& run) {
  const int64_t m = static_cast<int64_t>(x.element_count()) / d;
  const PackedPairs packed =
      pack_pairs(pool, reinterpret_cast<const uint16_t*>(x.typed_data()), m, d);
  const int64_t slices = std::min(panels, max_helpers(pool) + 1);
  parallel_for(pool, slices, 1, [&](int64_t i) {
    run(packed.data, m, i * panels / slices, (i + 1) * panels / slices);
  });
}

// Which weight rows a row block prefetches: rows first, first + every, ... of its k block, each
// `pairs` pair rows on (a pair row is 4 cache lines); first < 0: none.
struct WeightPrefetch {
  int64_t pairs;
  int first, every;
};
constexpr int kSpreadPasses = 3;  // from this many row blocks the next k block is prefetched

// Pass `pass` of `passes` row blocks over a k block of kp pairs. Below kSpreadPasses (up to 12
// rows: the weight's read takes longer than its FMAs) the first pass streams the block,
// prefetching kDotAhead pairs ahead, and the others find it in cache. From kSpreadPasses the
// passes take turns prefetching the *next* k block (the memory right after this one: the next
// k block or panel), so it loads while they all compute and the next first pass reads L2: with
// only the first pass prefetching, 16 rows waited on memory and then computed with it idle
// (2048 x 8192 at 16-18 rows: 301-320 -> 310-367 GFLOP/s side by side, docs/benchmarks.md).
inline WeightPrefetch weight_prefetch(int pass, int passes, int64_t kp) {
  if (passes >= kSpreadPasses) return {kp, pass, passes};
  return {kDotAhead, pass == 0 ? 0 : -1, 1};
}

// y[0:MB, 0:P] (+)= x pairs [kp, 6] @ W pairs [kp, 2P]
template <int MB>
inline void dot_micro(const uint32_t* xb, const uint16_t* wb, int64_t kp, float* y, int64_t ldy,
                      bool first, WeightPrefetch ahead) {
  __m512 acc[MB][kVecs];
  for (int r = 0; r < MB; ++r)
    for (int c = 0; c < kVecs; ++c) acc[r][c] = first ? _mm512_setzero_ps() : load(y + r * ldy + c * kLanes);
  int countdown = ahead.first;  // rows until the next prefetch; negative: none
  for (int64_t k = 0; k < kp; ++k) {
    if (countdown == 0) {
      countdown = ahead.every;
      const char* line = reinterpret_cast<const char*>(wb + (k + ahead.pairs) * 2 * kPanel);
      for (int b = 0; b < 2 * kPanel * 2; b += 64) __builtin_prefetch(line + b, 0, 2);
    }
    --countdown;
    __m512bh wv[kVecs];
    for (int c = 0; c < kVecs; ++c)
      wv[c] = (__m512bh)_mm512_loadu_si512(wb + k * 2 * kPanel + c * 2 * kLanes);
    for (int r = 0; r < MB; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xb[k * kRowBlock + r]));
      for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
  for (int r = 0; r < MB; ++r)
    for (int c = 0; c < kVecs; ++c) store(y + r * ldy + c * kLanes, acc[r][c]);
}

void dot_rows(const uint32_t* xb, const uint16_t* wb, int64_t kp, float* y, int64_t ldy,
              int64_t rows, bool first, WeightPrefetch ahead) {
  switch (rows) {
    case 1: return dot_micro<1>(xb, wb, kp, y, ldy, first, ahead);
    case 2: return dot_micro<2>(xb, wb, kp, y, ldy, first, ahead);
    case 3: return dot_micro<3>(xb, wb, kp, y, ldy, first, ahead);
    case 4: return dot_micro<4>(xb, wb, kp, y, ldy, first, ahead);
    case 5: return dot_micro<5>(xb, wb, kp, y, ldy, first, ahead);
    default: return dot_micro<6>(xb, wb, kp, y, ldy, first, ahead);
  }
}

// Rows [r0, r1) (at most kGemmRows) of one pairs panel [d2, 2P]'s kPanel columns into y (row r0
// at y, rows ldy apart), x packed by pack_pairs.
void dot_panel_rows(const uint32_t* xp, int64_t r0, int64_t r1, int64_t d2, const uint16_t* panel,
                    float* y, int64_t ldy) {
  const int passes = static_cast<int>((r1 - r0 + kRowBlock - 1) / kRowBlock);
  for (int64_t k0 = 0; k0 < d2; k0 += kDotPairs) {  // panels are contiguous: the prefetch runs
    const int64_t kp = std::min(kDotPairs, d2 - k0);  // on into the next one
    const uint16_t* block = panel + k0 * 2 * kPanel;
    for (int64_t r = r0; r < r1; r += kRowBlock)
      dot_rows(xp + ((r / kRowBlock) * d2 + k0) * kRowBlock, block, kp, y + (r - r0) * ldy, ldy,
               std::min<int64_t>(kRowBlock, r1 - r), k0 == 0,
               weight_prefetch(static_cast<int>((r - r0) / kRowBlock), passes, kp));
  }
}

// Panels [p0, p1) of y [M, N] = x @ W, x packed by pack_pairs, W [N/P, d2, 2P] pairs panels.
void dot_panels(const uint32_t* xp, int64_t m, int64_t d2, const uint16_t* w, int64_t p0,
                int64_t p1, float* y, int64_t n) {
  for (int64_t r0 = 0; r0 < m; r0 += kGemmRows) {
    const int64_t r1 = std::min(m, r0 + kGemmRows);
    for (int64_t p = p0; p < p1; ++p)
      dot_panel_rows(xp, r0, r1, d2, w + p * d2 * 2 * kPanel, y + r0 * n + p * kPanel, n);
  }
}

// f32 -> bf16 bits, rounded to nearest even (as XLA's convert)
inline __m256i to_bf16(vf v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }
inline vf round_bf16(vf v) {
  return reinterpret_cast<vf>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

// silu(g) = g * sigmoid(g) for bf16 g, each step rounded to bf16 as XLA's ops on bf16 round it
// (jax.nn.silu: g * 1 / (1 + exp(-g))). exp(-g) from vexp's range (x <= 0): for g < 0 as
// (1 / exp(g / 2))^2, which overflows to inf below -88.7 as f32's exp does (silu -0 there)
inline vf silu_bf16(vf g) {
  const vf one = splat(1.0f);
  const vf root = one / vexp(g * splat(0.5f));  // exp(-g / 2), for g < 0
  const vf e = round_bf16(g < splat(0.0f) ? root * root : vexp(-g));
  return round_bf16(g * round_bf16(one / round_bf16(one + e)));
}

// Panels [p0, p1) of out [M, F] = silu(x @ Wg) * (x @ Wu) in bf16, W = [Wg | Wu] in pairs panels
// (gate panel j, its up panel j + F/P): each row chunk's gate and up sums go to a scratch the
// thread keeps, and only the product is written, rounded as the unfused ops round it: the sums to
// bf16, then each step of silu (silu_bf16) and the product.
void dot_swiglu_panels(const uint32_t* xp, int64_t m, int64_t d2, const uint16_t* w, int64_t p0,
                       int64_t p1, uint16_t* out, int64_t f) {
  thread_local std::vector<float> scratch;
  scratch.resize(kGemmRows * 2 * kPanel);  // [rows, gate P | up P]
  float* g = scratch.data();
  const int64_t half = f / kPanel, ld = 2 * kPanel;
  for (int64_t r0 = 0; r0 < m; r0 += kGemmRows) {
    const int64_t r1 = std::min(m, r0 + kGemmRows);
    for (int64_t p = p0; p < p1; ++p) {
      dot_panel_rows(xp, r0, r1, d2, w + p * d2 * 2 * kPanel, g, ld);
      dot_panel_rows(xp, r0, r1, d2, w + (p + half) * d2 * 2 * kPanel, g + kPanel, ld);
      for (int64_t r = r0; r < r1; ++r)
        for (int c = 0; c < kVecs; ++c) {
          const float* gr = g + (r - r0) * ld + c * kLanes;
          const vf act = silu_bf16(round_bf16(load(gr))) * round_bf16(load(gr + kPanel));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * f + p * kPanel + c * kLanes),
                              to_bf16(act));
        }
    }
  }
}

// rows [2 j0, 2 (j0 + kp)) of an int8 panel [D, P] -> bf16 pairs [kp, 2P], zero past D. Exact:
// every int8 is a bf16 (8 significant bits). The column scales apply to the finished sums.
void int8_pairs(const int8_t* panel, int64_t j0, int64_t kp, int64_t d, uint16_t* dst) {
  for (int64_t j = 0; j < kp; ++j) {
    const int64_t k = 2 * (j0 + j);
    const int8_t* a = panel + k * kPanel;
    for (int c = 0; c < kVecs; ++c) {
      const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + c * kLanes));
      const __m128i r1 = k + 1 < d ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                         a + kPanel + c * kLanes))
                                   : _mm_setzero_si128();
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(r0, r1)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi8(r0, r1)));
      _mm512_storeu_si512(dst + j * 2 * kPanel + c * 2 * kLanes,
                         reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
  }
}

// Panels [p0, p1) of y = (x @ Q) * scale for int8 Q in plain panels [N/P, D, P]: each k block of
// a panel becomes bf16 pairs in a buffer (L2) once per 192 rows, then every row block reads it.
void dot_i8_panels(const uint32_t* xp, int64_t m, int64_t d, const int8_t* w, const float* scale,
                   int64_t p0, int64_t p1, float* y, int64_t n) {
  std::vector<uint16_t> scratch(kDotPairs * 2 * kPanel);  // one k block as bf16 pairs
  uint16_t* block = scratch.data();
  const int64_t d2 = (d + 1) / 2;
  for (int64_t r0 = 0; r0 < m; r0 += kGemmRows) {
    const int64_t r1 = std::min(m, r0 + kGemmRows);
    for (int64_t p = p0; p < p1; ++p) {
      const int8_t* panel = w + p * d * kPanel;
      for (int64_t k0 = 0; k0 < d2; k0 += kDotPairs) {
        const int64_t kp = std::min(kDotPairs, d2 - k0);
        // the next block's lines (this panel's or the next one's) load while this one computes
        const char* next = reinterpret_cast<const char*>(panel + 2 * (k0 + kp) * kPanel);
        for (int64_t b = 0; b < 2 * kDotPairs * kPanel; b += 64) __builtin_prefetch(next + b, 0, 2);
        int8_pairs(panel, k0, kp, d, block);
        for (int64_t r = r0; r < r1; r += kRowBlock)
          dot_rows(xp + ((r / kRowBlock) * d2 + k0) * kRowBlock, block, kp, y + r * n + p * kPanel,
                   n, std::min<int64_t>(kRowBlock, r1 - r), k0 == 0, WeightPrefetch{0, -1, 1});
      }
      for (int64_t r = r0; r < r1; ++r)
        for (int c = 0; c < kVecs; ++c) {
          float* out = y + r * n + p * kPanel + c * kLanes;
          store(out, load(out) * load(scale + p * kPanel + c * kLanes));
        }
    }
  }
}
#else
constexpr bool kBF16Dot = false;
#endif

ffi::Error DenseI8Dot(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::S8, 3> w,
                      ffi::Buffer<ffi::F32, 1> scale, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() < 1 || wd[2] != kPanel || xd.back() != wd[1] ||
      static_cast<int64_t>(scale.element_count()) != wd[0] * kPanel)
    return ffi::Error::InvalidArgument("dense_i8_dot: need x [..., D], W packed [N/" +
                                       std::to_string(kPanel) + ", D, " +
                                       std::to_string(kPanel) + "] and a scale per column");
#if defined(__AVX512BF16__)
  const int64_t d = wd[1], n = wd[0] * kPanel;
  over_panels(pool, x, d, wd[0], [&](const uint32_t* xp, int64_t m, int64_t p0, int64_t p1) {
    dot_i8_panels(xp, m, d, w.typed_data(), scale.typed_data(), p0, p1, y->typed_data(), n);
  });
  return ffi::Error::Success();
#else
  return ffi::Error::InvalidArgument("dense_i8_dot: this CPU has no AVX512_BF16");
#endif
}

// W's element type is BF16, or U16 holding bf16 bits (a table the model also gathers rows from:
// XLA's CPU backend converts a whole bf16 table before a gather, on every call; bits it gathers
// as integers).
template <ffi::DataType W>
ffi::Error DenseBF16DotT(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<W, 3> w,
                         ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() < 1 || wd[2] != 2 * kPanel || (xd.back() + 1) / 2 != wd[1])
    return ffi::Error::InvalidArgument("dense_bf16_dot: need x [..., D] and W packed in pairs [N/" +
                                       std::to_string(kPanel) + ", ceil(D/2), " +
                                       std::to_string(2 * kPanel) + "]");
#if defined(__AVX512BF16__)
  const int64_t d2 = wd[1], n = wd[0] * kPanel;
  const auto* wp = reinterpret_cast<const uint16_t*>(w.typed_data());
  over_panels(pool, x, xd.back(), wd[0],
              [&](const uint32_t* xp, int64_t m, int64_t p0, int64_t p1) {
                dot_panels(xp, m, d2, wp, p0, p1, y->typed_data(), n);
              });
  return ffi::Error::Success();
#else
  return ffi::Error::InvalidArgument("dense_bf16_dot: this CPU has no AVX512_BF16");
#endif
}

ffi::Error DenseBF16Dot(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                        ffi::Buffer<ffi::BF16, 3> w, ffi::ResultBuffer<ffi::F32> y) {
  return DenseBF16DotT<ffi::BF16>(pool, x, w, y);
}

ffi::Error DenseBF16DotBits(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                            ffi::Buffer<ffi::U16, 3> w, ffi::ResultBuffer<ffi::F32> y) {
  return DenseBF16DotT<ffi::U16>(pool, x, w, y);
}

// The MLP's activation in one call: y [..., F] bf16 = silu(x @ Wg) * (x @ Wu) for x [..., D] bf16
// and W = [Wg | Wu] [D, 2F] in pairs panels, F a whole number of panels. Unfused, XLA wrote the
// f32 sums [..., 2F] out and read them back in an elementwise pass: 4-5 % of a 128-token prefill.
ffi::Error DenseBF16DotSwiGLU(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                              ffi::Buffer<ffi::BF16, 3> w, ffi::ResultBuffer<ffi::BF16> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  if (xd.size() < 1 || wd[2] != 2 * kPanel || (xd.back() + 1) / 2 != wd[1] || wd[0] % 2 ||
      yd.size() != xd.size() || yd.back() != wd[0] / 2 * kPanel)
    return ffi::Error::InvalidArgument(
        "dense_bf16_dot_swiglu: need x [..., D], W = [Wg | Wu] packed in pairs [2F/" +
        std::to_string(kPanel) + ", ceil(D/2), " + std::to_string(2 * kPanel) +
        "] and y [..., F]");
#if defined(__AVX512BF16__)
  const int64_t d2 = wd[1], half = wd[0] / 2;  // panel pairs: gate j, up j + half
  const auto* wp = reinterpret_cast<const uint16_t*>(w.typed_data());
  auto* yp = reinterpret_cast<uint16_t*>(y->typed_data());
  over_panels(pool, x, xd.back(), half, [&](const uint32_t* xp, int64_t m, int64_t p0, int64_t p1) {
    dot_swiglu_panels(xp, m, d2, wp, p0, p1, yp, half * kPanel);
  });
  return ffi::Error::Success();
#else
  return ffi::Error::InvalidArgument("dense_bf16_dot_swiglu: this CPU has no AVX512_BF16");
#endif
}

// ---------------------------------------------------------------------------------------------
// decode attention over the paged KV cache

struct AttnShape {
  int64_t rows, kv_heads, groups, head_dim;
  int64_t page;   // positions per page (S)
  int64_t pages;  // pages in the pool (P)
  int64_t width;  // page-table columns (W): a row reaches at most W * S positions
};

// One layer's page pool, stored as T (float, bf16 as uint16_t, or int8). Page p holds S
// positions of every KV head: the block of (p, KV head kh) sits at (p K + kh) H S in k (K^T,
// [H, S]) and in v ([S, H]); an int8 pool carries an f32 scale per position there too, at
// (p K + kh) S in k_scale / v_scale.
template <typename T>
struct PagePool {
  T *k, *v;                    // [P, K, H, S], [P, K, S, H]
  float *k_scale, *v_scale;    // [P, K, S], int8 only, else null
};

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) {
  uint32_t bits = uint32_t{x} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_f32(int8_t x) { return static_cast<float>(x); }

// Where to prefetch ahead to while reading a page block: the block read after this one (pages
// lie anywhere in the pool, so the hardware prefetcher cannot run ahead into it) and how many
// of its cache lines (its first 8 KiB at most).
struct Ahead {
  const void* next;
  int64_t lines;
};

// Prefetches (into L2) step `i` of `n` of the next block's lines, spread over the current block.
inline void prefetch_next(const Ahead& ahead, int64_t i, int64_t n) {
  if (ahead.next == nullptr) return;
  const char* bytes = static_cast<const char*>(ahead.next);
  for (int64_t line = i * ahead.lines / n; line < (i + 1) * ahead.lines / n; ++line)
    __builtin_prefetch(bytes + line * 64, 0, 2);
}

// vectors of kLanes stored T per 64-byte cache line (a prefetch per line, not per vector)
template <typename T>
constexpr int kVecsPerLine = std::max<int>(1, 64 / (kLanes * sizeof(T)));

// scores[g, p0 + p] = q[g] . K[:, p0 + p] for whole passes of PB vectors of positions from p0
// while they fit in len, K^T stored [H, w] (row stride w): G * PB independent accumulators in
// flight. Then passes of PB / 2 vectors, and so on down to one, so a page of 64 keeps 4 or
// more in flight whatever G. Returns the first position no pass covered.
template <int G, int PB, typename T>
int64_t score_passes(const T* kt, int64_t w, int64_t hd, int64_t p0, int64_t len, const float* q,
                     float* scores, int64_t stride, const Ahead& ahead) {
  for (; p0 + PB * kLanes <= len; p0 += PB * kLanes) {
    vf acc[G][PB] = {};
    for (int64_t h = 0; h < hd; ++h) {
      if (p0 == 0) prefetch_next(ahead, h, hd);
      const T* row = kt + h * w + p0;
      vf kv[PB];
      for (int j = 0; j < PB; ++j) {
        if (j % kVecsPerLine<T> == 0)  // 16 rows ahead, into L2: once per cache line
          __builtin_prefetch(row + 16 * w + j * kLanes, 0, 2);
        kv[j] = widen(row + j * kLanes);
      }
      for (int g = 0; g < G; ++g) {
        vf qv = splat(q[g * hd + h]);
        for (int j = 0; j < PB; ++j) acc[g][j] += qv * kv[j];
      }
    }
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < PB; ++j) store(scores + g * stride + p0 + j * kLanes, acc[g][j]);
  }
  if constexpr (PB > 1)
    return score_passes<G, PB / 2>(kt, w, hd, p0, len, q, scores, stride, ahead);
  return p0;
}

// scores[g, p] = q[g] . K[:, p] (* scale[p], int8) for p < len of one page, K^T stored [H, w].
// Where the page is whole vectors wide, the last vector runs whole too: its columns past len
// are in the page (stale or zero), and their scores are never used (the softmax masks every
// position past the row's). Elsewhere the tail is scalar, so no load leaves the page. (As a
// scalar tail it ran a chain of dependent FMAs per (head, position): with 11 positions in it,
// a quarter of a 16-row layer's attention; bench/decode_attention.py.)
template <int G, typename T>
void page_scores(const T* kt, int64_t w, int64_t hd, int64_t len, const float* q,
                 const float* scale, float* scores, int64_t stride, const Ahead& ahead) {
  constexpr int PB = G <= 2 ? kAccs / 2 : G <= 4 ? kAccs / 4 : kAccs / 8;  // vectors per pass
  const int64_t covered = w % kLanes == 0 ? (len + kLanes - 1) / kLanes * kLanes : len;
  for (int64_t p0 = score_passes<G, PB>(kt, w, hd, 0, covered, q, scores, stride, ahead);
       p0 < len; ++p0) {
    for (int g = 0; g < G; ++g) {
      float acc = 0.0f;
      for (int64_t h = 0; h < hd; ++h) acc += q[g * hd + h] * to_f32(kt[h * w + p0]);
      scores[g * stride + p0] = acc;
    }
  }
  if (scale == nullptr) return;
  for (int g = 0; g < G; ++g)
    for (int64_t p = 0; p < len; ++p) scores[g * stride + p] *= scale[p];
}

// out[g] += sum_p probs[g, p] (* scale[p], int8: folded into probs here) * V[p] over one
// page's len rows, V stored [S, H].
template <int G, typename T>
void page_values(const T* vp, int64_t hd, int64_t len, float* probs, int64_t stride,
                 const float* scale, vf (*acc)[kMaxHeadDim / kLanes], const Ahead& ahead) {
  const int64_t nv = hd / kLanes;
  if (scale != nullptr)  // first, so each broadcast below is one load (not a multiply, a shuffle)
    for (int g = 0; g < G; ++g)
      for (int64_t p = 0; p < len; ++p) probs[g * stride + p] *= scale[p];
  for (int64_t p = 0; p < len; ++p) {
    prefetch_next(ahead, p, len);
    vf pr[G];
    for (int g = 0; g < G; ++g) pr[g] = splat(probs[g * stride + p]);
    for (int64_t j = 0; j < nv; ++j) {
      if (j % kVecsPerLine<T> == 0)  // 32 positions ahead: once per cache line
        __builtin_prefetch(vp + (p + 32) * hd + j * kLanes, 0, 2);
      vf v = widen(vp + p * hd + j * kLanes);
      for (int g = 0; g < G; ++g) acc[g][j] += pr[g] * v;
    }
  }
}

// The step's K/V for every (row, KV head), already in the pool's storage (int8: with scales).
template <typename T>
struct StepKV {
  const T *k, *v;                    // [R, K, H]
  const float *k_scale, *v_scale;    // [R, K], int8 only
};

// The block index of page i of a row's page `table`, KV head kh, in the pool's k or v. Ids
// outside the pool are clamped into it rather than read or written out of bounds (the engine
// never hands them out).
inline int64_t page_block(const AttnShape& s, const int32_t* table, int64_t i, int64_t kh) {
  return std::clamp<int64_t>(table[i], 0, s.pages - 1) * s.kv_heads + kh;
}

// One (row, KV head): write the new K/V at `pos` (page table[pos / S], column pos % S), then
// attend its G query heads over positions 0..pos, read from pages table[0 .. pos / S]. `then`:
// the block read next (the next task's first K block), prefetched during the last V page, or null.
template <int G, typename T>
void attend_one(const AttnShape& s, int64_t r, int64_t kh, int32_t pos, const int32_t* table,
                const float* q, const StepKV<T>& step, const PagePool<T>& pool, float* out,
                std::vector<float>& scores, const void* then) {
  const int64_t hd = s.head_dim, ps = s.page, block = hd * ps;  // block: one K or V page block
  const int64_t head = r * s.kv_heads + kh;  // this row's KV head in k_new / v_new / q / out
  const bool scaled = pool.k_scale != nullptr;
  auto at = [&](int64_t i) { return page_block(s, table, i, kh); };  // page i's block
  // a position past the page table (the engine sizes tables to rule it out) writes nothing
  // and attends over every position the table reaches; a negative one counts as 0
  const int64_t p = std::max<int32_t>(pos, 0), capacity = s.width * ps;
  const int64_t n_pos = std::min(p + 1, capacity);
  if (p < capacity) {  // the step's K/V into the page holding `pos`
    const int64_t b = at(p / ps), col = p % ps;
    T* kt = pool.k + b * block;
    const T* kn = step.k + head * hd;
    for (int64_t h = 0; h < hd; ++h) kt[h * ps + col] = kn[h];
    std::memcpy(pool.v + b * block + col * hd, step.v + head * hd, hd * sizeof(T));
    if (scaled) {
      pool.k_scale[b * ps + col] = step.k_scale[head];
      pool.v_scale[b * ps + col] = step.v_scale[head];
    }
  }
  const int64_t stride = (n_pos + kLanes - 1) / kLanes * kLanes;
  scores.resize(G * stride);
  float qs[G * kMaxHeadDim];  // q scaled by 1/sqrt(H)
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const float* qh = q + head * G * hd;  // [G, H]
  for (int64_t i = 0; i < G * hd; ++i) qs[i] = qh[i] * scale;
  const int64_t n_read = (n_pos + ps - 1) / ps;  // pages holding positions 0..pos
  const int64_t lines = std::min<int64_t>(128, (block * sizeof(T) + 63) / 64);
  for (int64_t i = 0; i < n_read; ++i) {  // after the last K page, the first V page is next
    const int64_t b = at(i);
    const Ahead ahead{i + 1 < n_read ? pool.k + at(i + 1) * block : pool.v + at(0) * block,
                      lines};
    page_scores<G>(pool.k + b * block, ps, hd, std::min<int64_t>(ps, n_pos - i * ps), qs,
                   scaled ? pool.k_scale + b * ps : nullptr, scores.data() + i * ps, stride,
                   ahead);
  }
  float inv[G];
  for (int g = 0; g < G; ++g) {  // softmax numerators in place; 1 / denominator in inv
    float* sg = scores.data() + g * stride;
    for (int64_t p = n_pos; p < stride; ++p) sg[p] = -1e30f;
    vf mxv = splat(-1e30f);
    for (int64_t p0 = 0; p0 < stride; p0 += kLanes) {
      vf x = load(sg + p0);
      mxv = x > mxv ? x : mxv;
    }
    float mx = -1e30f;
    for (int l = 0; l < kLanes; ++l) mx = std::max(mx, mxv[l]);
    vf sum{};
    for (int64_t p0 = 0; p0 < stride; p0 += kLanes) {
      vf e = vexp(load(sg + p0) - splat(mx));
      store(sg + p0, e);
      sum += e;
    }
    float total = 0.0f;
    for (int l = 0; l < kLanes; ++l) total += sum[l];
    inv[g] = 1.0f / total;
  }
  vf acc[G][kMaxHeadDim / kLanes] = {};
  for (int64_t i = 0; i < n_read; ++i) {
    const int64_t b = at(i);
    const Ahead ahead{i + 1 < n_read ? pool.v + at(i + 1) * block : then, lines};
    page_values<G>(pool.v + b * block, hd, std::min<int64_t>(ps, n_pos - i * ps),
                   scores.data() + i * ps, stride, scaled ? pool.v_scale + b * ps : nullptr, acc,
                   ahead);
  }
  for (int g = 0; g < G; ++g) {
    float* og = out + (head * G + g) * hd;
    for (int64_t j = 0; j < hd / kLanes; ++j) store(og + j * kLanes, acc[g][j] * splat(inv[g]));
  }
}

template <typename T>
using AttendFn = void (*)(const AttnShape&, int64_t, int64_t, int32_t, const int32_t*,
                          const float*, const StepKV<T>&, const PagePool<T>&, float*,
                          std::vector<float>&, const void*);

template <typename T>
AttendFn<T> attend_for(int64_t groups) {
  switch (groups) {
    case 1: return attend_one<1, T>;
    case 2: return attend_one<2, T>;
    case 3: return attend_one<3, T>;
    case 4: return attend_one<4, T>;
    case 5: return attend_one<5, T>;
    case 6: return attend_one<6, T>;
    case 7: return attend_one<7, T>;
    case 8: return attend_one<8, T>;
    default: return nullptr;
  }
}

template <ffi::DataType D>
using Native = ffi::NativeType<D>;

constexpr int64_t kAttendGrain = 4;  // (row, KV head) items a thread claims at a time

// Args: q [R, N, H] f32, k_new/v_new [R, K, H] in the pool's storage type, (int8: their scales
// [R, K] f32,) positions [>= R] int32, page_table [>= R, W] int32, then the pool: k [P, K, H,
// S], v [P, K, S, H] (int8: then k_scale, v_scale [P, K, S] f32). Rets: out [R, N, H], then the
// pool (aliased to the inputs: updated in place).
//
// Work is split over (row, KV head). Rows may share pages for reading (a shared prefix); the
// engine gives each live row's write a page no other row reads. Rows it parks (inactive: page
// table all 0) all write page 0, column 0, at once: a benign race on a trash page that no live
// row reads.
template <ffi::DataType D>
ffi::Error DecodeAttentionAny(ffi::ThreadPool& threads, ffi::Buffer<ffi::F32, 3>& q,
                              ffi::Buffer<D, 3>& k_new, ffi::Buffer<D, 3>& v_new,
                              const float* k_scale_new, const float* v_scale_new,
                              ffi::Buffer<ffi::S32, 1>& positions,
                              ffi::Buffer<ffi::S32, 2>& page_table, ffi::RemainingArgs& pool_in,
                              ffi::ResultBuffer<ffi::F32, 3>& out, ffi::RemainingRets& pool_out) {
  // bf16, or U16 holding bf16 bits (kv_cache stores a CPU pool's bf16 that way)
  using T = std::conditional_t<D == ffi::DataType::BF16 || D == ffi::DataType::U16, uint16_t,
                               Native<D>>;
  constexpr bool kScaled = D == ffi::DataType::S8;
  constexpr int64_t kParts = kScaled ? 4 : 2;  // k, v (, k_scale, v_scale)
  auto qd = q.dimensions();
  auto kd = k_new.dimensions();
  auto vd = v_new.dimensions();
  auto td = page_table.dimensions();
  auto bad = [](const std::string& what) {
    return ffi::Error::InvalidArgument("decode_attention: " + what);
  };
  if (static_cast<int64_t>(pool_out.size()) != kParts ||
      static_cast<int64_t>(pool_in.size()) != kParts)
    return bad(kScaled ? "need the pool as k, v, k_scale and v_scale" : "need the pool as k, v");
  if (kd[1] < 1 || qd[1] < kd[1] || qd[1] % kd[1] || kd[0] != qd[0] || kd[2] != qd[2] ||
      vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] ||
      static_cast<int64_t>(positions.element_count()) < qd[0])
    return bad("q [R, N, H], k/v [R, K, H] and positions [>= R] disagree");
  if (td[0] < qd[0] || td[1] < 1) return bad("page_table must be [>= R, W >= 1]");
  if (qd[2] % 16 || qd[2] > kMaxHeadDim) return bad("head_dim must be a multiple of 16, <= 256");
  PagePool<T> pool{};
  int64_t pages = -1, page = -1;  // P and S, from the k buffer
  for (int64_t i = 0; i < kParts; ++i) {
    auto r = pool_out.get<ffi::AnyBuffer>(i);
    if (!r.has_value()) return r.error();
    auto dims = (*r)->dimensions();
    if (i < 2) {  // k [P, K, H, S] / v [P, K, S, H] in the step's type
      if ((*r)->element_type() != D || dims.size() != 4)
        return bad("the pool's k and v must be rank-4 buffers of k_new's type");
      const int64_t size = i == 0 ? dims[3] : dims[2], head = i == 0 ? dims[2] : dims[3];
      if (i == 0) pages = dims[0], page = size;
      if (dims[0] != pages || size != page || dims[1] != kd[1] || head != qd[2] || page < 1 ||
          pages < 1)
        return bad("pool shapes disagree with each other or with q/k/v: need k [P, K, H, S], "
                   "v [P, K, S, H], P >= 1, S >= 1");
      (i == 0 ? pool.k : pool.v) = static_cast<T*>((*r)->untyped_data());
    } else {  // scales [P, K, S] f32
      if ((*r)->element_type() != ffi::DataType::F32 || dims.size() != 3 || dims[0] != pages ||
          dims[1] != kd[1] || dims[2] != page)
        return bad("the pool's k_scale and v_scale must be f32 [P, K, S] beside k and v");
      (i == 2 ? pool.k_scale : pool.v_scale) = static_cast<float*>((*r)->untyped_data());
    }
  }
  AttnShape s{qd[0], kd[1], qd[1] / kd[1], qd[2], page, pages, td[1]};
  AttendFn<T> attend = attend_for<T>(s.groups);
  if (attend == nullptr) return bad("query heads per KV head must be <= 8");
  const StepKV<T> step{reinterpret_cast<const T*>(k_new.typed_data()),
                       reinterpret_cast<const T*>(v_new.typed_data()), k_scale_new, v_scale_new};
  const float* qp = q.typed_data();
  const int32_t* pos = positions.typed_data();
  const int32_t* table = page_table.typed_data();
  float* op = out->typed_data();
  const int64_t items = s.rows * s.kv_heads, block = s.head_dim * s.page;
  // the first K block an item reads: its row's first page, its KV head
  auto first_k = [&](int64_t i) -> const void* {
    return pool.k + page_block(s, table + i / s.kv_heads * s.width, 0, i % s.kv_heads) * block;
  };
  parallel_for(threads, (items + kAttendGrain - 1) / kAttendGrain, 1, [&](int64_t c) {
    thread_local std::vector<float> scores;
    const int64_t end = std::min(items, (c + 1) * kAttendGrain);
    for (int64_t i = c * kAttendGrain; i < end; ++i) {
      const int64_t r = i / s.kv_heads, kh = i % s.kv_heads;
      attend(s, r, kh, pos[r], table + r * s.width, qp, step, pool, op, scores,
             i + 1 < end ? first_k(i + 1) : nullptr);
    }
  });
  return ffi::Error::Success();
}

// f32, bf16, or U16 holding bf16 bits: the pool's storage type, no scales
template <ffi::DataType D>
ffi::Error DecodeAttentionPlain(ffi::ThreadPool threads, ffi::Buffer<ffi::F32, 3> q,
                                ffi::Buffer<D, 3> k_new, ffi::Buffer<D, 3> v_new,
                                ffi::Buffer<ffi::S32, 1> positions,
                                ffi::Buffer<ffi::S32, 2> page_table, ffi::RemainingArgs pool,
                                ffi::ResultBuffer<ffi::F32, 3> out, ffi::RemainingRets pool_out) {
  return DecodeAttentionAny(threads, q, k_new, v_new, nullptr, nullptr, positions, page_table,
                            pool, out, pool_out);
}

template <ffi::DataType D>
auto DecodeAttentionPlainBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32, 3>>()
      .template Arg<ffi::Buffer<D, 3>>()
      .template Arg<ffi::Buffer<D, 3>>()
      .template Arg<ffi::Buffer<ffi::S32, 1>>()
      .template Arg<ffi::Buffer<ffi::S32, 2>>()
      .RemainingArgs()
      .template Ret<ffi::Buffer<ffi::F32, 3>>()
      .RemainingRets();
}

ffi::Error DecodeAttentionI8(ffi::ThreadPool threads, ffi::Buffer<ffi::F32, 3> q,
                             ffi::Buffer<ffi::S8, 3> k_new, ffi::Buffer<ffi::S8, 3> v_new,
                             ffi::Buffer<ffi::F32, 2> k_scale_new,
                             ffi::Buffer<ffi::F32, 2> v_scale_new,
                             ffi::Buffer<ffi::S32, 1> positions,
                             ffi::Buffer<ffi::S32, 2> page_table, ffi::RemainingArgs pool,
                             ffi::ResultBuffer<ffi::F32, 3> out, ffi::RemainingRets pool_out) {
  auto kd = k_new.dimensions();
  auto sk = k_scale_new.dimensions();
  auto sv = v_scale_new.dimensions();
  if (sk[0] != kd[0] || sk[1] != kd[1] || sv[0] != kd[0] || sv[1] != kd[1])
    return ffi::Error::InvalidArgument("decode_attention: k/v scales must be [R, K]");
  return DecodeAttentionAny(threads, q, k_new, v_new, k_scale_new.typed_data(),
                            v_scale_new.typed_data(), positions, page_table, pool, out, pool_out);
}

// ---------------------------------------------------------------------------------------------
// prefill attention: a prompt chunk's queries over the sequence's earlier pages and, causally,
// over the chunk's own K/V (flash attention's online softmax, f32, on the FMA units)

// One KV head's keys 0..len-1 (len a multiple of kPanel) as f32: kt in blocks of kPanel keys,
// [len / kPanel, H, kPanel] (each block's K^T contiguous: a [H, len] K^T put every row of a block
// 4 KiB or more apart, on the same few L1 sets), and v [len, H]. Positions before `start` come
// from the gathered pages (k [W, K, H, S], v [W, K, S, H]), start..start+t-1 from the chunk's
// own K/V ([t, K, H]), zeros past them.
template <typename T>
void gather_keys(const T* own_k, const T* own_v, const T* prior_k, const T* prior_v, int64_t t,
                 int64_t kv_heads, int64_t hd, int64_t ps, int64_t start, int64_t kh,
                 int64_t len, float* kt, float* v) {
  auto at = [&](int64_t j, int64_t h) -> float& {
    return kt[(j / kPanel * hd + h) * kPanel + j % kPanel];
  };
  for (int64_t j = 0; j < start; j += ps) {
    const int64_t block = (j / ps * kv_heads + kh) * hd * ps;
    const T* kp = prior_k + block;  // [H, S]
    const T* vp = prior_v + block;  // [S, H]
    for (int64_t h = 0; h < hd; ++h)
      for (int64_t s = 0; s < ps; ++s) at(j + s, h) = to_f32(kp[h * ps + s]);
    for (int64_t i = 0; i < ps * hd; ++i) v[j * hd + i] = to_f32(vp[i]);
  }
  for (int64_t i = 0; i < t; ++i) {
    const T* kr = own_k + (i * kv_heads + kh) * hd;
    const T* vr = own_v + (i * kv_heads + kh) * hd;
    for (int64_t h = 0; h < hd; ++h) {
      at(start + i, h) = to_f32(kr[h]);
      v[(start + i) * hd + h] = to_f32(vr[h]);
    }
  }
  for (int64_t j = start + t; j < len; ++j)
    for (int64_t h = 0; h < hd; ++h) at(j, h) = 0.0f;
  std::fill(v + (start + t) * hd, v + len * hd, 0.0f);
}

// acc[r, h0 : h0 + CV lanes-vectors] += probs[r, 0:kPanel] @ v[j0 : j0 + kPanel, same columns]
template <int CV>
inline void prefill_values(const float* probs, const float* v, int64_t hd, int64_t h0, int64_t j0,
                           float* acc) {
  vf a[kRowBlock][CV];
  for (int r = 0; r < kRowBlock; ++r)
    for (int c = 0; c < CV; ++c) a[r][c] = load(acc + r * hd + h0 + c * kLanes);
  for (int64_t j = 0; j < kPanel; ++j) {
    vf vv[CV];
    for (int c = 0; c < CV; ++c) vv[c] = load(v + (j0 + j) * hd + h0 + c * kLanes);
    for (int r = 0; r < kRowBlock; ++r) {
      const vf p = splat(probs[r * kPanel + j]);
      for (int c = 0; c < CV; ++c) a[r][c] += p * vv[c];
    }
  }
  for (int r = 0; r < kRowBlock; ++r)
    for (int c = 0; c < CV; ++c) store(acc + r * hd + h0 + c * kLanes, a[r][c]);
}

struct PrefillShape {
  int64_t t, heads, kv_heads, groups, head_dim, start, len;  // len: keys held, kPanel-aligned
};

// A tile's kRowBlock rows before the first key block: m, l and the sums cleared, pos[r] row r's
// position (-1: a spare row past `rows`, every key masked, never written out), and take(r, its
// q row, or null for a spare row) to lay q out. Returns the last position (the blocks to walk).
template <typename T, typename Take>
int64_t start_tile(const PrefillShape& s, int64_t kh, int64_t r0, int64_t rows, const T* q,
                   float* m, float* l, float* acc, int32_t* pos, const Take& take) {
  int64_t last = 0;
  for (int r = 0; r < kRowBlock; ++r) {
    m[r] = -1e30f, l[r] = 0.0f;
    std::fill(acc + r * s.head_dim, acc + (r + 1) * s.head_dim, 0.0f);
    if (r >= rows) {
      pos[r] = -1;
      take(r, static_cast<const T*>(nullptr));
      continue;
    }
    const int64_t t = (r0 + r) / s.groups, head = kh * s.groups + (r0 + r) % s.groups;
    pos[r] = static_cast<int32_t>(s.start + t);
    last = std::max<int64_t>(last, pos[r]);
    take(r, q + (t * s.heads + head) * s.head_dim);
  }
  return last;
}

// A row's sums so far, scaled as the online softmax's max moved (fade exactly 1: it stayed).
inline void fade_row(float* acc, int64_t hd, float fade) {
  if (fade != 1.0f)
    for (int64_t h = 0; h < hd; h += kLanes) store(acc + h, load(acc + h) * splat(fade));
}

// A tile's rows out: row r is query (r0 + r) / G, head kh G + (r0 + r) % G; out = acc / l.
inline void write_rows(const PrefillShape& s, int64_t kh, int64_t r0, int64_t rows,
                       const float* acc, const float* l, float* out) {
  for (int r = 0; r < rows; ++r) {
    const int64_t t = (r0 + r) / s.groups, head = kh * s.groups + (r0 + r) % s.groups;
    float* o = out + (t * s.heads + head) * s.head_dim;
    for (int64_t h = 0; h < s.head_dim; ++h) o[h] = acc[r * s.head_dim + h] / l[r];
  }
}

// Rows r0 .. r0 + rows - 1 (rows <= kRowBlock) of KV head kh (row r: query r / G, head
// kh G + r % G, at position start + r / G) over keys 0..its position, kPanel keys a block from
// key 0. A row's arithmetic depends only on its position and the keys, not on the rows beside it
// (a block wholly past its position adds exact zeros and scales by exactly 1), so a prompt gives
// the same bits whole, in chunks or over a cached prefix's pages.
void prefill_tile(const PrefillShape& s, int64_t kh, int64_t r0, int64_t rows, const float* q,
                  const float* kt, const float* v, float* out) {
  constexpr int MR = kRowBlock;
  const int64_t hd = s.head_dim;
  alignas(64) float qs[kMaxHeadDim * MR];  // [H, MR]: q scaled by 1/sqrt(H)
  alignas(64) float acc[MR * kMaxHeadDim];  // [MR, H]
  alignas(64) float probs[MR * kPanel];
  float m[MR], l[MR];
  int32_t pos[MR];
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t last = start_tile(s, kh, r0, rows, q, m, l, acc, pos, [&](int r, const float* qh) {
    for (int64_t h = 0; h < hd; ++h) qs[h * MR + r] = qh ? qh[h] * scale : 0.0f;
  });
  vi iota;
  for (int i = 0; i < kLanes; ++i) iota[i] = i;
  for (int64_t j0 = 0; j0 <= last; j0 += kPanel) {
    vf sc[MR][kVecs] = {};
    const float* kb = kt + j0 * hd;  // this block's K^T [H, kPanel]
    for (int64_t h = 0; h < hd; ++h) {
      vf kv[kVecs];
      for (int c = 0; c < kVecs; ++c) kv[c] = load(kb + h * kPanel + c * kLanes);
      for (int r = 0; r < MR; ++r) {
        const vf x = splat(qs[h * MR + r]);
        for (int c = 0; c < kVecs; ++c) sc[r][c] += x * kv[c];
      }
    }
    for (int r = 0; r < MR; ++r) {
      vi keep[kVecs];
      vf mx = splat(-1e30f);
      for (int c = 0; c < kVecs; ++c) {
        keep[c] = iota + static_cast<int32_t>(j0 + c * kLanes) <= pos[r];
        sc[r][c] = keep[c] ? sc[r][c] : splat(-1e30f);
        mx = sc[r][c] > mx ? sc[r][c] : mx;
      }
      float m_new = m[r];
      for (int i = 0; i < kLanes; ++i) m_new = std::max(m_new, mx[i]);
      const float fade = std::exp(m[r] - m_new);  // exactly 1 when the max stays
      vf sum{};
      for (int c = 0; c < kVecs; ++c) {
        const vf e = keep[c] ? vexp(sc[r][c] - splat(m_new)) : vf{};
        store(probs + r * kPanel + c * kLanes, e);
        sum += e;
      }
      float total = 0.0f;
      for (int i = 0; i < kLanes; ++i) total += sum[i];
      l[r] = l[r] * fade + total;
      m[r] = m_new;
      fade_row(acc + r * hd, hd, fade);
    }
    int64_t h0 = 0;
    for (; h0 + kPanel <= hd; h0 += kPanel) prefill_values<kVecs>(probs, v, hd, h0, j0, acc);
    for (; h0 < hd; h0 += kLanes) prefill_values<1>(probs, v, hd, h0, j0, acc);
  }
  write_rows(s, kh, r0, rows, acc, l, out);
}

#if defined(__AVX512BF16__)
// --- the same on bf16 pairs (AVX512_BF16): a bf16 q over a bf16 pool -------------------------

// One KV head's keys 0..len-1 as vdpbf16ps operands: kt [len / kPanel, H / 2, 2 kPanel] (block
// b's row j: dims 2j and 2j + 1 of its kPanel keys, key c's pair at 2c, 2c + 1) and v [len / 2,
// 2H] (row j: keys 2j and 2j + 1, dim h's pair at 2h, 2h + 1). Sources as gather_keys'.
void gather_key_pairs(const uint16_t* own_k, const uint16_t* own_v, const uint16_t* prior_k,
                      const uint16_t* prior_v, int64_t t, int64_t kv_heads, int64_t hd, int64_t ps,
                      int64_t start, int64_t kh, int64_t len, uint16_t* kt, uint16_t* v) {
  for (int64_t j = 0; j < len; ++j) {
    const uint16_t *kj = nullptr, *vj = nullptr;  // key j's K column and V row; none past them
    int64_t kstride = 1;
    if (j < start) {
      const int64_t block = (j / ps * kv_heads + kh) * hd * ps;
      kj = prior_k + block + j % ps, kstride = ps;  // K^T [H, S]
      vj = prior_v + block + j % ps * hd;           // V [S, H]
    } else if (j < start + t) {
      kj = own_k + ((j - start) * kv_heads + kh) * hd;
      vj = own_v + ((j - start) * kv_heads + kh) * hd;
    }
    for (int64_t h = 0; h < hd; ++h) {
      kt[((j / kPanel * hd / 2 + h / 2) * kPanel + j % kPanel) * 2 + h % 2] =
          kj ? kj[h * kstride] : 0;
      v[(j / 2 * hd + h) * 2 + j % 2] = vj ? vj[h] : 0;
    }
  }
}

// acc[r, h0 : h0 + CV vectors] += probs [MR, kPanel / 2 pairs] @ v's kPanel keys from j0
template <int CV>
inline void prefill_value_pairs(const uint32_t* probs, const uint16_t* v, int64_t hd, int64_t h0,
                                int64_t j0, float* acc) {
  __m512 a[kRowBlock][CV];
  for (int r = 0; r < kRowBlock; ++r)
    for (int c = 0; c < CV; ++c) a[r][c] = load(acc + r * hd + h0 + c * kLanes);
  for (int64_t j = 0; j < kPanel / 2; ++j) {
    const uint16_t* row = v + ((j0 / 2 + j) * hd + h0) * 2;
    __m512bh vv[CV];
    for (int c = 0; c < CV; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(row + c * 2 * kLanes);
    for (int r = 0; r < kRowBlock; ++r) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(probs[r * kPanel / 2 + j]));
      for (int c = 0; c < CV; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], p, vv[c]);
    }
  }
  for (int r = 0; r < kRowBlock; ++r)
    for (int c = 0; c < CV; ++c) store(acc + r * hd + h0 + c * kLanes, a[r][c]);
}

// prefill_tile on bf16 pairs: q K^T with vdpbf16ps (q and K are bf16: every product exact, f32
// sums), scaled after; each block's probabilities rounded to bf16 (the sum taken of the rounded
// ones) for P V with vdpbf16ps, as flash attention does on GPUs. Twice the multiply-adds of the
// f32 FMAs; a row's arithmetic still depends only on its position and the keys.
void prefill_tile_pairs(const PrefillShape& s, int64_t kh, int64_t r0, int64_t rows,
                        const uint16_t* q, const uint16_t* kt, const uint16_t* v, float* out) {
  constexpr int MR = kRowBlock;
  const int64_t hd = s.head_dim;
  alignas(64) uint32_t qs[kMaxHeadDim / 2 * MR];  // [H / 2, MR]: q's dim pairs
  alignas(64) float acc[MR * kMaxHeadDim];        // [MR, H]
  alignas(64) uint32_t probs[MR * kPanel / 2];    // a block's probabilities in bf16 pairs
  float m[MR], l[MR];
  int32_t pos[MR];
  const vf scale = splat(1.0f / std::sqrt(static_cast<float>(hd)));
  auto pairs = [&](int r, const uint16_t* qh) {  // q's dims 2j, 2j + 1 as one uint32
    for (int64_t j = 0; j < hd / 2; ++j)
      qs[j * MR + r] = qh ? qh[2 * j] | static_cast<uint32_t>(qh[2 * j + 1]) << 16 : 0u;
  };
  const int64_t last = start_tile(s, kh, r0, rows, q, m, l, acc, pos, pairs);
  vi iota;
  for (int i = 0; i < kLanes; ++i) iota[i] = i;
  for (int64_t j0 = 0; j0 <= last; j0 += kPanel) {
    __m512 sc[MR][kVecs];
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < kVecs; ++c) sc[r][c] = _mm512_setzero_ps();
    const uint16_t* kb = kt + j0 * hd;  // this block's pairs [H / 2, 2 kPanel]
    for (int64_t j = 0; j < hd / 2; ++j) {
      __m512bh kv[kVecs];
      for (int c = 0; c < kVecs; ++c)
        kv[c] = (__m512bh)_mm512_loadu_si512(kb + j * 2 * kPanel + c * 2 * kLanes);
      for (int r = 0; r < MR; ++r) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(qs[j * MR + r]));
        for (int c = 0; c < kVecs; ++c) sc[r][c] = _mm512_dpbf16_ps(sc[r][c], x, kv[c]);
      }
    }
    for (int r = 0; r < MR; ++r) {  // the softmax step in vectors: it was half the tile's time
      vi keep[kVecs];
      vf mx = splat(-1e30f), scores[kVecs];
      for (int c = 0; c < kVecs; ++c) {
        keep[c] = iota + static_cast<int32_t>(j0 + c * kLanes) <= pos[r];
        scores[c] = keep[c] ? vf(sc[r][c]) * scale : splat(-1e30f);
        mx = scores[c] > mx ? scores[c] : mx;
      }
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(mx));
      const float fade = std::exp(m[r] - m_new);  // exactly 1 when the max stays
      vf sum{}, e[kVecs];
      for (int c = 0; c < kVecs; ++c) {
        e[c] = keep[c] ? round_bf16(vexp(scores[c] - splat(m_new))) : vf{};
        sum += e[c];
      }
      l[r] = l[r] * fade + _mm512_reduce_add_ps(sum);
      m[r] = m_new;
      fade_row(acc + r * hd, hd, fade);
      for (int c = 0; c < kVecs; c += 2)  // rounded already: exact; keys 2j, 2j + 1 in pair j
        _mm512_storeu_si512(probs + r * kPanel / 2 + c * kLanes / 2,
                            reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e[c + 1], e[c])));
    }
    int64_t h0 = 0;
    for (; h0 + kPanel <= hd; h0 += kPanel) prefill_value_pairs<kVecs>(probs, v, hd, h0, j0, acc);
    for (; h0 < hd; h0 += kLanes) prefill_value_pairs<1>(probs, v, hd, h0, j0, acc);
  }
  write_rows(s, kh, r0, rows, acc, l, out);
}
#endif

// Args: q [T, N, H] f32 (or bf16 on a bf16 pool: vdpbf16ps, prefill_tile_pairs); the chunk's
// own k, v [T, K, H] and the sequence's gathered pages k
// [W, K, H, S], v [W, K, S, H] in the pool's storage (f32, or U16 holding bf16 bits); start
// (int32: the chunk's first position, a multiple of S, at most W S; optionally then n, the rows
// wanted: queries and own keys past n are not read, and their rows come out as zeros). Ret:
// out [T, N, H]. Query i (position start + i) attends over positions 0..start+i: those before
// start read from the pages, the rest from the chunk.
template <ffi::DataType Q, ffi::DataType D>
ffi::Error PrefillAttention(ffi::ThreadPool threads, ffi::Buffer<Q, 3> q, ffi::Buffer<D, 3> k,
                            ffi::Buffer<D, 3> v, ffi::Buffer<D, 4> prior_k,
                            ffi::Buffer<D, 4> prior_v, ffi::Buffer<ffi::S32> start_buf,
                            ffi::ResultBuffer<ffi::F32, 3> out) {
  using T = std::conditional_t<D == ffi::DataType::U16, uint16_t, Native<D>>;
  constexpr bool kPairs = Q == ffi::DataType::BF16;  // a bf16 q on a bf16 pool: vdpbf16ps
#if !defined(__AVX512BF16__)
  if constexpr (kPairs)
    return ffi::Error::InvalidArgument("prefill_attention: a bf16 q needs AVX512_BF16");
#endif
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto pk = prior_k.dimensions();
  auto pv = prior_v.dimensions();
  auto bad = [](const std::string& what) {
    return ffi::Error::InvalidArgument("prefill_attention: " + what);
  };
  auto vd = v.dimensions();
  if (kd[1] < 1 || qd[1] % kd[1] || kd[0] != qd[0] || kd[2] != qd[2] || vd[0] != kd[0] ||
      vd[1] != kd[1] || vd[2] != kd[2])
    return bad("q [T, N, H] and k/v [T, K, H] disagree");
  if (qd[2] % 16 || qd[2] > kMaxHeadDim) return bad("head_dim must be a multiple of 16, <= 256");
  if (pk[1] != kd[1] || pk[2] != kd[2] || pv[0] != pk[0] || pv[1] != kd[1] || pv[2] != pk[3] ||
      pv[3] != kd[2] || pk[3] < 1)
    return bad("pages must be k [W, K, H, S] and v [W, K, S, H]");
  const int64_t given = start_buf.element_count();
  if (given != 1 && given != 2) return bad("start must be one int32 (then, optionally, rows)");
  const int64_t start = start_buf.typed_data()[0], ps = pk[3];
  if (start < 0 || start % ps || start > pk[0] * ps)
    return bad("start must be a multiple of the page size within the pages");
  const int64_t n = given == 2 ? std::clamp<int64_t>(start_buf.typed_data()[1], 0, qd[0]) : qd[0];
  float* op = out->typed_data();
  std::fill(op + n * qd[1] * qd[2], op + qd[0] * qd[1] * qd[2], 0.0f);  // the rows not wanted
  const int64_t len = (start + n + kPanel - 1) / kPanel * kPanel;
  const PrefillShape s{n, qd[1], kd[1], qd[1] / kd[1], qd[2], start, len};
  const int64_t per_head = 2 * len * s.head_dim;  // per KV head: kt, then v
  using Key = std::conditional_t<kPairs, uint16_t, float>;
  std::vector<Key> keys(s.kv_heads * per_head);
  const T* own_k = reinterpret_cast<const T*>(k.typed_data());
  const T* own_v = reinterpret_cast<const T*>(v.typed_data());
  const T* pages_k = reinterpret_cast<const T*>(prior_k.typed_data());
  const T* pages_v = reinterpret_cast<const T*>(prior_v.typed_data());
  parallel_for(threads, s.kv_heads, 1, [&](int64_t kh) {
    Key* kt = keys.data() + kh * per_head;
#if defined(__AVX512BF16__)
    if constexpr (kPairs) {
      gather_key_pairs(own_k, own_v, pages_k, pages_v, s.t, s.kv_heads, s.head_dim, ps, start,
                       kh, len, kt, kt + len * s.head_dim);
      return;
    }
#endif
    if constexpr (!kPairs)
      gather_keys(own_k, own_v, pages_k, pages_v, s.t, s.kv_heads, s.head_dim, ps, start, kh,
                  len, kt, kt + len * s.head_dim);
  });
  const int64_t tiles = (s.t * s.groups + kRowBlock - 1) / kRowBlock;  // per KV head
  const auto* qp = reinterpret_cast<const std::conditional_t<kPairs, uint16_t, float>*>(
      q.typed_data());
  // the latest (longest) tiles first, so the last ones claimed are short
  parallel_for(threads, s.kv_heads * tiles, 1, [&](int64_t i) {
    const int64_t kh = i % s.kv_heads, tile = tiles - 1 - i / s.kv_heads;
    const Key* kt = keys.data() + kh * per_head;
    const int64_t r0 = tile * kRowBlock, rows = std::min<int64_t>(kRowBlock, s.t * s.groups - r0);
#if defined(__AVX512BF16__)
    if constexpr (kPairs) {
      prefill_tile_pairs(s, kh, r0, rows, qp, kt, kt + len * s.head_dim, op);
      return;
    }
#endif
    if constexpr (!kPairs) prefill_tile(s, kh, r0, rows, qp, kt, kt + len * s.head_dim, op);
  });
  return ffi::Error::Success();
}

template <ffi::DataType Q, ffi::DataType D>
auto PrefillAttentionBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .template Arg<ffi::Buffer<Q, 3>>()
      .template Arg<ffi::Buffer<D, 3>>()
      .template Arg<ffi::Buffer<D, 3>>()
      .template Arg<ffi::Buffer<D, 4>>()
      .template Arg<ffi::Buffer<D, 4>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::F32, 3>>();
}

}  // namespace

// the registration macro splits its arguments on commas: name the 2-parameter templates
using F32x3 = ffi::Buffer<ffi::F32, 3>;
using S32x1 = ffi::Buffer<ffi::S32, 1>;
using S32x2 = ffi::Buffer<ffi::S32, 2>;
using F32x1 = ffi::Buffer<ffi::F32, 1>;
using F32x2 = ffi::Buffer<ffi::F32, 2>;
using BF16x3 = ffi::Buffer<ffi::BF16, 3>;
using U16x3 = ffi::Buffer<ffi::U16, 3>;  // bf16 bits
using S8x3 = ffi::Buffer<ffi::S8, 3>;

extern "C" int scaletui_panel_width() { return kPanel; }
extern "C" int scaletui_bf16_dot() { return kBF16Dot ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScaletuiDenseF32, DenseF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<F32x3>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScaletuiDenseBF16, DenseBF16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<BF16x3>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScaletuiDenseBF16Dot, DenseBF16Dot,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<BF16x3>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScaletuiDenseBF16DotBits, DenseBF16DotBits,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<U16x3>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScaletuiDenseBF16DotSwiGLU, DenseBF16DotSwiGLU,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<BF16x3>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScaletuiDenseI8Dot, DenseI8Dot,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<S8x3>()
                                  .Arg<F32x1>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScaletuiDenseI8, DenseI8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<S8x3>()
                                  .Arg<F32x1>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScaletuiDecodeAttentionF32, DecodeAttentionPlain<ffi::F32>,
                              DecodeAttentionPlainBinding<ffi::F32>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScaletuiDecodeAttentionBF16, DecodeAttentionPlain<ffi::BF16>,
                              DecodeAttentionPlainBinding<ffi::BF16>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScaletuiDecodeAttentionBF16Bits, DecodeAttentionPlain<ffi::U16>,
                              DecodeAttentionPlainBinding<ffi::U16>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScaletuiDecodeAttentionI8, DecodeAttentionI8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32x3>()
                                  .Arg<S8x3>()
                                  .Arg<S8x3>()
                                  .Arg<F32x2>()
                                  .Arg<F32x2>()
                                  .Arg<S32x1>()
                                  .Arg<S32x2>()
                                  .RemainingArgs()
                                  .Ret<F32x3>()
                                  .RemainingRets());

// the macro splits on commas: one name per instantiation
constexpr auto PrefillAttentionF32 = PrefillAttention<ffi::F32, ffi::F32>;
constexpr auto PrefillAttentionBF16Bits = PrefillAttention<ffi::F32, ffi::U16>;
constexpr auto PrefillAttentionBF16Dot = PrefillAttention<ffi::BF16, ffi::U16>;
constexpr auto BindF32 = PrefillAttentionBinding<ffi::F32, ffi::F32>;
constexpr auto BindBF16Bits = PrefillAttentionBinding<ffi::F32, ffi::U16>;
constexpr auto BindBF16Dot = PrefillAttentionBinding<ffi::BF16, ffi::U16>;

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScaletuiPrefillAttentionF32, PrefillAttentionF32, BindF32());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScaletuiPrefillAttentionBF16Bits, PrefillAttentionBF16Bits,
                              BindBF16Bits());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScaletuiPrefillAttentionBF16Dot, PrefillAttentionBF16Dot,
                              BindBF16Dot());
