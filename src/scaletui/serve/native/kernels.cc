// Native CPU kernels for the decode hot path, called from XLA through its FFI.
//
// XLA CPU runs thin matmuls ([B <= 16, D] x [D, F]) at a third to a half of this machine's
// memory bandwidth and far below its FLOP/s, and decode attention as many tiny batched dots
// (docs/benchmarks.md). These two kernels do the same math the way the roofline assumes it:
//
//   scaletui_dense_f32   y[M, N] = x[M, D] @ W, with W pre-packed as panels [N/64, D, 64] so
//                        each panel streams contiguously and every weight load feeds all rows.
//   scaletui_decode_attention_f32
//                        one decode step of attention for every slot: writes the step's K/V
//                        into the chunked slot cache (in place: the chunk buffers are aliased
//                        inputs/outputs) and attends over exactly each slot's live positions.
//
// Work is split over XLA's intra-op thread pool. Written with GCC vector extensions, so the
// compiler emits AVX-512 where the host has it (-march=native) and narrower vectors elsewhere.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float vf __attribute__((vector_size(64)));
typedef float vf_u __attribute__((vector_size(64), aligned(4)));  // unaligned access
typedef int32_t vi __attribute__((vector_size(64)));
constexpr int kLanes = 16;
constexpr int kPanel = 64;      // packed weight panel width (4 vectors)
constexpr int kKBlock = 64;     // panel rows per block when the batch needs several passes
constexpr int kPrefetch = 64;   // panel rows ahead to prefetch (= kKBlock: the next block)
constexpr int kRowBlock = 6;    // batch rows per micro-kernel pass: 6 x 4 accumulators
constexpr int kMaxHeadDim = 256;

inline vf load(const float* p) { return *reinterpret_cast<const vf_u*>(p); }
inline void store(float* p, vf v) { *reinterpret_cast<vf_u*>(p) = v; }
inline vf splat(float x) { return vf{} + x; }

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
// dense: y[M, N] = x[M, D] @ W, W packed [N/64, D, 64]

template <int MB>
inline void dense_micro(const float* x, int64_t ldx, const float* panel, int64_t k0, int64_t k1,
                        float* y, int64_t ldy, bool first, int pass, int passes) {
  vf acc[MB][4];
  for (int r = 0; r < MB; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = first ? vf{} : load(y + r * ldy + c * kLanes);
  int countdown = pass;  // this pass prefetches every passes-th row: spread over all passes
  for (int64_t k = k0; k < k1; ++k) {
    const float* w = panel + k * kPanel;
    if (countdown-- == 0) {
      countdown = passes - 1;
      // into L2 (prefetcht1): L1's few fill buffers would cap how far ahead this can run
      for (int c = 0; c < kPanel; c += kLanes)
        __builtin_prefetch(w + kPrefetch * kPanel + c, 0, 2);
    }
    vf w0 = load(w), w1 = load(w + 16), w2 = load(w + 32), w3 = load(w + 48);
    for (int r = 0; r < MB; ++r) {
      vf xv = splat(x[r * ldx + k]);
      acc[r][0] += xv * w0;
      acc[r][1] += xv * w1;
      acc[r][2] += xv * w2;
      acc[r][3] += xv * w3;
    }
  }
  for (int r = 0; r < MB; ++r)
    for (int c = 0; c < 4; ++c) store(y + r * ldy + c * kLanes, acc[r][c]);
}

void dense_rows(const float* x, int64_t m, int64_t d, const float* panel, int64_t k0, int64_t k1,
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

void dense_panel(const float* x, int64_t m, int64_t d, const float* panel, float* y, int64_t n) {
  if (m <= kRowBlock) {  // one pass: stream the panel once
    dense_rows(x, m, d, panel, 0, d, y, n, true);
    return;
  }
  // several row passes: walk the panel in k blocks so each block is read from DRAM once and
  // re-read from L1 by the other passes; the passes take turns prefetching the next block's
  // rows, so memory stays busy through all of them (11% off a batch-16 step against the first
  // pass prefetching it all)
  for (int64_t k0 = 0; k0 < d; k0 += kKBlock)
    dense_rows(x, m, d, panel, k0, std::min(d, k0 + kKBlock), y, n, k0 == 0);
}

ffi::Error Dense(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32, 3> w,
                 ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() < 1 || wd[2] != kPanel || xd.back() != wd[1])
    return ffi::Error::InvalidArgument("dense: need x [..., D] and W packed [N/64, D, 64]");
  const int64_t d = wd[1], panels = wd[0], n = panels * kPanel;
  const int64_t m = static_cast<int64_t>(x.element_count()) / d;
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  parallel_for(pool, panels, 0, [&](int64_t p) {
    dense_panel(xp, m, d, wp + p * d * kPanel, yp + p * kPanel, n);
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// decode attention over the chunked slot cache

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

struct AttnShape {
  int64_t rows, kv_heads, groups, head_dim, chunk;  // chunk: positions per chunk (C)
  int64_t n_chunks;                                 // live chunks passed in
};

// Prefetches (into L2) the first 8 KiB of the block read after this one, `i` of `n` steps
// through the current block: each chunk is its own buffer, so nothing else runs ahead into it.
inline void prefetch_next(const float* next, int64_t i, int64_t n) {
  if (next == nullptr) return;
  for (int64_t line = i * 128 / n; line < (i + 1) * 128 / n; ++line)
    __builtin_prefetch(next + line * kLanes, 0, 2);
}

// scores[g, p] = q[g] . K[:, p] for p < len of one chunk, K^T stored [H, w] (row stride w).
// PB vectors of positions per pass keep G * PB independent accumulators in flight; the tail is
// scalar so no load reads past position len - 1 of a row.
template <int G>
void chunk_scores(const float* kt, int64_t w, int64_t hd, int64_t len, const float* q,
                  float* scores, int64_t stride, const float* next) {
  constexpr int PB = G <= 2 ? 8 : G <= 4 ? 4 : 2;  // vectors of positions per pass
  int64_t p0 = 0;
  for (; p0 + PB * kLanes <= len; p0 += PB * kLanes) {
    vf acc[G][PB] = {};
    for (int64_t h = 0; h < hd; ++h) {
      if (p0 == 0) prefetch_next(next, h, hd);
      const float* row = kt + h * w + p0;
      vf kv[PB];
      for (int j = 0; j < PB; ++j) {
        __builtin_prefetch(row + 16 * w + j * kLanes, 0, 2);  // 16 rows ahead, into L2
        kv[j] = load(row + j * kLanes);
      }
      for (int g = 0; g < G; ++g) {
        vf qv = splat(q[g * hd + h]);
        for (int j = 0; j < PB; ++j) acc[g][j] += qv * kv[j];
      }
    }
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < PB; ++j) store(scores + g * stride + p0 + j * kLanes, acc[g][j]);
  }
  for (; p0 + kLanes <= len; p0 += kLanes) {
    vf acc[G] = {};
    for (int64_t h = 0; h < hd; ++h) {
      vf k0 = load(kt + h * w + p0);
      for (int g = 0; g < G; ++g) acc[g] += splat(q[g * hd + h]) * k0;
    }
    for (int g = 0; g < G; ++g) store(scores + g * stride + p0, acc[g]);
  }
  for (; p0 < len; ++p0) {
    for (int g = 0; g < G; ++g) {
      float acc = 0.0f;
      for (int64_t h = 0; h < hd; ++h) acc += q[g * hd + h] * kt[h * w + p0];
      scores[g * stride + p0] = acc;
    }
  }
}

// out[g] += sum_p probs[g, p] * V[p] over one chunk's len rows, V stored [w, H].
template <int G>
void chunk_values(const float* vp, int64_t hd, int64_t len, const float* probs, int64_t stride,
                  vf (*acc)[kMaxHeadDim / kLanes], const float* next) {
  const int64_t nv = hd / kLanes;
  for (int64_t p = 0; p < len; ++p) {
    prefetch_next(next, p, len);
    vf pr[G];
    for (int g = 0; g < G; ++g) pr[g] = splat(probs[g * stride + p]);
    for (int64_t j = 0; j < nv; ++j) {
      __builtin_prefetch(vp + (p + 32) * hd + j * kLanes, 0, 2);  // 32 positions ahead
      vf v = load(vp + p * hd + j * kLanes);
      for (int g = 0; g < G; ++g) acc[g][j] += pr[g] * v;
    }
  }
}

// One (slot, kv head): write the new K/V at `pos`, then attend its G query heads over
// positions 0..pos. k chunks are [B, K, H, C+1] (K transposed), v chunks [B, K, C+1, H].
template <int G>
void attend_one(const AttnShape& s, int64_t b, int64_t kh, int32_t pos, const float* q,
                const float* k_new, const float* v_new, float* const* kc, float* const* vc,
                float* out, std::vector<float>& scores) {
  const int64_t hd = s.head_dim, c = s.chunk, w = c + 1;
  const int64_t head_k = (b * s.kv_heads + kh) * hd * w;  // offset of this head's block
  // a position past the live chunks (the engine's bucket rules this out) writes nothing and
  // attends over every live position, as the XLA path's scratch-column write does
  const int64_t p = std::max<int32_t>(pos, 0), capacity = s.n_chunks * c;
  const int64_t n_pos = std::min(p + 1, capacity);
  if (p < capacity) {  // the step's K/V into the chunk holding `pos`
    const int64_t i = p / c, col = p % c;
    const float* kn = k_new + (b * s.kv_heads + kh) * hd;
    const float* vn = v_new + (b * s.kv_heads + kh) * hd;
    for (int64_t h = 0; h < hd; ++h) kc[i][head_k + h * w + col] = kn[h];
    std::memcpy(vc[i] + head_k + col * hd, vn, hd * sizeof(float));
  }
  const int64_t stride = (n_pos + kLanes - 1) / kLanes * kLanes;
  scores.resize(G * stride);
  float qs[G * kMaxHeadDim];  // q scaled by 1/sqrt(H)
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const float* qh = q + (b * s.kv_heads + kh) * G * hd;  // [G, H]
  for (int64_t i = 0; i < G * hd; ++i) qs[i] = qh[i] * scale;
  const int64_t n_read = (n_pos + c - 1) / c;  // chunks holding live positions
  for (int64_t i = 0; i < n_read; ++i)
    chunk_scores<G>(kc[i] + head_k, w, hd, std::min<int64_t>(c, n_pos - i * c), qs,
                    scores.data() + i * c, stride,
                    i + 1 < n_read ? kc[i + 1] + head_k : vc[0] + head_k);
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
  for (int64_t i = 0; i < n_read; ++i)
    chunk_values<G>(vc[i] + head_k, hd, std::min<int64_t>(c, n_pos - i * c),
                    scores.data() + i * c, stride, acc,
                    i + 1 < n_read ? vc[i + 1] + head_k : nullptr);
  for (int g = 0; g < G; ++g) {
    float* og = out + ((b * s.kv_heads + kh) * G + g) * hd;
    for (int64_t j = 0; j < hd / kLanes; ++j) store(og + j * kLanes, acc[g][j] * splat(inv[g]));
  }
}

using AttendFn = void (*)(const AttnShape&, int64_t, int64_t, int32_t, const float*,
                          const float*, const float*, float* const*, float* const*, float*,
                          std::vector<float>&);

AttendFn attend_for(int64_t groups) {
  switch (groups) {
    case 1: return attend_one<1>;
    case 2: return attend_one<2>;
    case 3: return attend_one<3>;
    case 4: return attend_one<4>;
    case 5: return attend_one<5>;
    case 6: return attend_one<6>;
    case 7: return attend_one<7>;
    case 8: return attend_one<8>;
    default: return nullptr;
  }
}

// Args: q [R, N, H], k_new/v_new [R, K, H], positions [>= R] int32, then n k chunks and n v
// chunks. Rets: out [R, N, H], then the 2n chunks (aliased to the inputs: updated in place).
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32, 3> q,
                           ffi::Buffer<ffi::F32, 3> k_new, ffi::Buffer<ffi::F32, 3> v_new,
                           ffi::Buffer<ffi::S32, 1> positions, ffi::RemainingArgs chunks,
                           ffi::ResultBuffer<ffi::F32, 3> out, ffi::RemainingRets chunks_out) {
  auto qd = q.dimensions();
  auto kd = k_new.dimensions();
  auto vd = v_new.dimensions();
  const int64_t n2 = static_cast<int64_t>(chunks_out.size());
  auto bad = [](const char* what) {
    return ffi::Error::InvalidArgument(std::string("decode_attention: ") + what);
  };
  if (n2 == 0 || n2 % 2 || static_cast<int64_t>(chunks.size()) != n2)
    return bad("need n k chunks then n v chunks");
  if (kd[0] != qd[0] || qd[1] % kd[1] || kd[2] != qd[2] || vd[0] != kd[0] || vd[1] != kd[1] ||
      vd[2] != kd[2] || static_cast<int64_t>(positions.element_count()) < qd[0])
    return bad("q [R, N, H], k/v [R, K, H] and positions [>= R] disagree");
  if (qd[2] % kLanes || qd[2] > kMaxHeadDim)
    return bad("head_dim must be a multiple of 16, <= 256");
  std::vector<float*> kc(n2 / 2), vc(n2 / 2);
  int64_t chunk = -1, rows = -1;
  for (int64_t i = 0; i < n2; ++i) {  // every chunk: f32, k [B, K, H, C+1] / v [B, K, C+1, H]
    auto r = chunks_out.get<ffi::AnyBuffer>(i);
    if (!r.has_value()) return r.error();
    auto dims = (*r)->dimensions();
    if ((*r)->element_type() != ffi::DataType::F32 || dims.size() != 4)
      return bad("chunks must be f32 rank-4 buffers");
    const bool is_k = i < n2 / 2;
    const int64_t width = is_k ? dims[3] : dims[2], head = is_k ? dims[2] : dims[3];
    if (chunk < 0) chunk = width - 1, rows = dims[0];
    if (width != chunk + 1 || dims[0] != rows || dims[0] < qd[0] || dims[1] != kd[1] ||
        head != qd[2] || chunk < 1)
      return bad("chunk shapes disagree with each other or with q/k/v");
    float* p = static_cast<float*>((*r)->untyped_data());
    (is_k ? kc[i] : vc[i - n2 / 2]) = p;
  }
  AttnShape s{qd[0], kd[1], qd[1] / kd[1], qd[2], chunk, n2 / 2};
  AttendFn attend = attend_for(s.groups);
  if (attend == nullptr)
    return ffi::Error::InvalidArgument("decode_attention: query heads per KV head must be <= 8");
  const float* qp = q.typed_data();
  const float* kp = k_new.typed_data();
  const float* vp = v_new.typed_data();
  const int32_t* pos = positions.typed_data();
  float* op = out->typed_data();
  parallel_for(pool, s.rows * s.kv_heads, 1, [&](int64_t i) {
    thread_local std::vector<float> scores;
    const int64_t b = i / s.kv_heads, kh = i % s.kv_heads;
    attend(s, b, kh, pos[b], qp, kp, vp, kc.data(), vc.data(), op, scores);
  });
  return ffi::Error::Success();
}

}  // namespace

// the registration macro splits its arguments on commas: name the 2-parameter templates
using F32x3 = ffi::Buffer<ffi::F32, 3>;
using S32x1 = ffi::Buffer<ffi::S32, 1>;

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScaletuiDenseF32, Dense,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<F32x3>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScaletuiDecodeAttentionF32, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32x3>()
                                  .Arg<F32x3>()
                                  .Arg<F32x3>()
                                  .Arg<S32x1>()
                                  .RemainingArgs()
                                  .Ret<F32x3>()
                                  .RemainingRets());
