// CPU backend of exact step retrieval: scores Q queries against C keys with a register-blocked SIMD micro-kernel
// fused with a fixed-size heap per query, so no [Q, C] score matrix ever exists.
//
// Layout (GotoBLAS-style, as faiss gets from its BLAS): queries are packed once into panels [D][QT] (QT queries per
// SIMD tile, fp32); keys are processed in cache-sized chunks, each converted to fp32 and packed into panels [D][NK].
// The micro-kernel keeps an NK x QT score tile in registers (AVX-512: 12 x 32, AVX2: 6 x 16), broadcasting key
// values against query vectors. Its epilogue applies the metric (retrieval_metric.h) and compares each score vector
// with the per-query admission threshold (the heap's worst, or min_score), so the exclusion filter and the heap only
// run for the few candidates that could enter the top-k.
// Parallelism: OpenMP over key chunks (each thread keeps heaps for every query of the pass, so every key is read once),
// then OpenMP over queries for the merge of the per-thread heaps.
// The ISA is chosen at run time (__builtin_cpu_supports) with target attributes, never -march=native.
// Not here: argument validation beyond memory safety (rapo_fast/retrieval.py does it first).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define RAPO_X86 1
#endif
#ifdef RAPO_WITH_OPENMP
#include <omp.h>
#endif

#include "rapo/dtype.h"
#include "rapo/retrieval.h"
#include "rapo/retrieval_metric.h"
#include "rapo/topk.h"

namespace rapo {
namespace {

constexpr int kIsaScalar = 0;
constexpr int kIsaAvx2 = 1;
constexpr int kIsaAvx512 = 2;

// Per-thread admission state of one query pass, shared by the micro-kernel epilogues through TileCtx.
struct ThreadHeaps {
  int64_t nq = 0;
  int k = 0;
  std::vector<float> s;      // [nq, k]
  std::vector<int32_t> id;   // [nq, k]
  std::vector<int32_t> n;    // [nq]
  std::vector<float> thr;    // [nq rounded up to QT]: admit when score >= thr (NaN for padding lanes)
};

struct TileCtx {
  ThreadHeaps* h;
  float* thr;             // thresholds of this query tile's lanes
  const float* qaux;      // [QT] query aux of this tile
  const float* kaux;      // [NK] key aux of this key tile
  int64_t qlocal0;        // index within the pass of lane 0
  int64_t j0;             // slot of key 0 of the tile
  int64_t jend;           // first slot past the chunk (padding keys are never admitted)
  const int64_t* groups;  // nullptr when there is no exclusion
  const int64_t* excl;    // exclusion of the pass's queries, or nullptr
  float min_thr;
  int metric;
};

// Scalar tail of every epilogue: exclusion, heap push, threshold update. Out of line: it runs rarely.
__attribute__((noinline)) void admit(TileCtx& c, int lane, int t, float score) {
  const int64_t j = c.j0 + t;
  if (j >= c.jend) return;
  const int64_t ql = c.qlocal0 + lane;
  if (c.excl != nullptr) {
    const int64_t g = c.excl[ql];
    if (g >= 0 && c.groups[j] == g) return;
  }
  ThreadHeaps& h = *c.h;
  TopKHeap heap{h.s.data() + ql * h.k, h.id.data() + ql * h.k, h.k, h.n[ql]};
  if (heap.push(score, static_cast<int32_t>(j))) {
    h.n[ql] = heap.n;
    if (heap.full()) c.thr[lane] = std::max(heap.worst_score(), c.min_thr);
  }
}

// ---- micro-kernels: score tile NK keys x QT queries over the whole D, then the epilogue ----

// Dot mode (few queries, see dot_avx512): KB keys x QG queries per block, KB * QG <= 24 accumulators.
constexpr int kDotMaxQ = 16;
constexpr int kDotOut = 24;
constexpr int dot_kb(int qg) { return qg <= 3 ? 8 : 4; }
inline int dot_qg(int64_t Q) { return Q <= 3 ? static_cast<int>(Q) : 6; }
using DotFn = void (*)(const void*, int64_t, int64_t, int64_t, const float*, int64_t, int64_t, float*);

constexpr int kScalarNK = 4;
constexpr int kScalarQT = 8;

void tile_scalar(const float* __restrict qp, const float* __restrict kp, int64_t D, TileCtx& c) {
  float acc[kScalarNK][kScalarQT] = {};
  for (int64_t d = 0; d < D; ++d) {
    const float* q = qp + d * kScalarQT;
    const float* kd = kp + d * kScalarNK;
    for (int t = 0; t < kScalarNK; ++t)
      for (int l = 0; l < kScalarQT; ++l) acc[t][l] += kd[t] * q[l];
  }
  for (int t = 0; t < kScalarNK; ++t)
    for (int l = 0; l < kScalarQT; ++l) {
      const float s = retrieval_finish(c.metric, acc[t][l], c.qaux[l], c.kaux[t]);
      if (s >= c.thr[l]) admit(c, l, t, s);
    }
}

#ifdef RAPO_X86
constexpr int kAvx2NK = 6;
constexpr int kAvx2QT = 16;

__attribute__((target("avx2,fma"))) void tile_avx2(const float* __restrict qp, const float* __restrict kp, int64_t D,
                                                    TileCtx& c) {
  constexpr int NK = kAvx2NK;
  __m256 a0[NK], a1[NK];
  for (int t = 0; t < NK; ++t) a0[t] = a1[t] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 q0 = _mm256_loadu_ps(qp + d * 16);
    const __m256 q1 = _mm256_loadu_ps(qp + d * 16 + 8);
    const float* kd = kp + d * NK;
#pragma GCC unroll 6
    for (int t = 0; t < NK; ++t) {
      const __m256 b = _mm256_broadcast_ss(kd + t);
      a0[t] = _mm256_fmadd_ps(b, q0, a0[t]);
      a1[t] = _mm256_fmadd_ps(b, q1, a1[t]);
    }
  }
  const __m256 th0 = _mm256_loadu_ps(c.thr), th1 = _mm256_loadu_ps(c.thr + 8);
  const __m256 qa0 = _mm256_loadu_ps(c.qaux), qa1 = _mm256_loadu_ps(c.qaux + 8);
  const __m256 zero = _mm256_setzero_ps(), two = _mm256_set1_ps(2.0f);
  for (int t = 0; t < NK; ++t) {
    __m256 s0 = a0[t], s1 = a1[t];
    if (c.metric == kMetricCosine) {
      const __m256 ka = _mm256_set1_ps(c.kaux[t]);
      s0 = _mm256_mul_ps(_mm256_mul_ps(s0, qa0), ka);
      s1 = _mm256_mul_ps(_mm256_mul_ps(s1, qa1), ka);
    } else if (c.metric == kMetricL2) {
      const __m256 ka = _mm256_set1_ps(c.kaux[t]);
      s0 = _mm256_min_ps(zero, _mm256_sub_ps(_mm256_sub_ps(_mm256_mul_ps(two, s0), ka), qa0));
      s1 = _mm256_min_ps(zero, _mm256_sub_ps(_mm256_sub_ps(_mm256_mul_ps(two, s1), ka), qa1));
    }
    const int m = _mm256_movemask_ps(_mm256_cmp_ps(s0, th0, _CMP_GE_OQ)) |
                  (_mm256_movemask_ps(_mm256_cmp_ps(s1, th1, _CMP_GE_OQ)) << 8);
    if (m != 0) {
      alignas(32) float tmp[16];
      _mm256_store_ps(tmp, s0);
      _mm256_store_ps(tmp + 8, s1);
      for (unsigned bits = static_cast<unsigned>(m); bits != 0; bits &= bits - 1) {
        const int lane = __builtin_ctz(bits);
        admit(c, lane, t, tmp[lane]);
      }
    }
  }
}

constexpr int kAvx512NK = 12;
constexpr int kAvx512QT = 32;

__attribute__((target("avx512f"))) void tile_avx512(const float* __restrict qp, const float* __restrict kp, int64_t D,
                                                     TileCtx& c) {
  constexpr int NK = kAvx512NK;
  __m512 a0[NK], a1[NK];
  for (int t = 0; t < NK; ++t) a0[t] = a1[t] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 q0 = _mm512_loadu_ps(qp + d * 32);
    const __m512 q1 = _mm512_loadu_ps(qp + d * 32 + 16);
    const float* kd = kp + d * NK;
#pragma GCC unroll 12
    for (int t = 0; t < NK; ++t) {
      const __m512 b = _mm512_set1_ps(kd[t]);
      a0[t] = _mm512_fmadd_ps(b, q0, a0[t]);
      a1[t] = _mm512_fmadd_ps(b, q1, a1[t]);
    }
  }
  const __m512 th0 = _mm512_loadu_ps(c.thr), th1 = _mm512_loadu_ps(c.thr + 16);
  const __m512 qa0 = _mm512_loadu_ps(c.qaux), qa1 = _mm512_loadu_ps(c.qaux + 16);
  const __m512 zero = _mm512_setzero_ps(), two = _mm512_set1_ps(2.0f);
  for (int t = 0; t < NK; ++t) {
    __m512 s0 = a0[t], s1 = a1[t];
    if (c.metric == kMetricCosine) {
      const __m512 ka = _mm512_set1_ps(c.kaux[t]);
      s0 = _mm512_mul_ps(_mm512_mul_ps(s0, qa0), ka);
      s1 = _mm512_mul_ps(_mm512_mul_ps(s1, qa1), ka);
    } else if (c.metric == kMetricL2) {
      const __m512 ka = _mm512_set1_ps(c.kaux[t]);
      s0 = _mm512_min_ps(zero, _mm512_sub_ps(_mm512_sub_ps(_mm512_mul_ps(two, s0), ka), qa0));
      s1 = _mm512_min_ps(zero, _mm512_sub_ps(_mm512_sub_ps(_mm512_mul_ps(two, s1), ka), qa1));
    }
    const unsigned m = static_cast<unsigned>(_mm512_cmp_ps_mask(s0, th0, _CMP_GE_OQ)) |
                       (static_cast<unsigned>(_mm512_cmp_ps_mask(s1, th1, _CMP_GE_OQ)) << 16);
    if (m != 0) {
      alignas(64) float tmp[32];
      _mm512_store_ps(tmp, s0);
      _mm512_store_ps(tmp + 16, s1);
      for (unsigned bits = m; bits != 0; bits &= bits - 1) {
        const int lane = __builtin_ctz(bits);
        admit(c, lane, t, tmp[lane]);
      }
    }
  }
}

// Few queries (Q <= kDotMaxQ): packing keys would cost more than scoring them, so keys are read straight from the
// buffer (converted 16 at a time) and dotted with up to kDotQG queries, vectorised over D: each key vector is loaded
// once per group and reused by every query of it. Queries are fp32 rows zero-padded to a multiple of 16.
template <int DT>
__attribute__((target("avx512f"))) inline __m512 load16_avx512(const void* base, int64_t off) {
  if constexpr (DT == static_cast<int>(DType::F32)) {
    return _mm512_loadu_ps(static_cast<const float*>(base) + off);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + off));
    if constexpr (DT == static_cast<int>(DType::F16)) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// out[t * QG + l] = <key j0 + t, query l> for t < KB, l < QG; rows past the chunk are clamped to a valid row and
// never admitted (admit checks jend). Vector loop over D rounded down to 16; the tail is added in scalar code.
template <int DT, int QG>
__attribute__((target("avx512f"))) void dot_avx512(const void* keys, int64_t ks, int64_t j0, int64_t jlast,
                                                   const float* __restrict qrows, int64_t D, int64_t Dp, float* out) {
  constexpr int kDotKB = dot_kb(QG);
  constexpr int kDotQG = QG;
  const int esz = DT == static_cast<int>(DType::F32) ? 4 : 2;
  const char* kb = static_cast<const char*>(keys);
  const void* kr[kDotKB];
  for (int t = 0; t < kDotKB; ++t) kr[t] = kb + std::min(j0 + t, jlast) * ks * esz;
  __m512 acc[kDotKB][kDotQG];
  for (int t = 0; t < kDotKB; ++t)
    for (int l = 0; l < kDotQG; ++l) acc[t][l] = _mm512_setzero_ps();
  const int64_t D16 = D / 16 * 16;
  for (int64_t d = 0; d < D16; d += 16) {
    __m512 kv[kDotKB];
#pragma GCC unroll 8
    for (int t = 0; t < kDotKB; ++t) kv[t] = load16_avx512<DT>(kr[t], d);
#pragma GCC unroll 6
    for (int l = 0; l < kDotQG; ++l) {
      const __m512 qv = _mm512_loadu_ps(qrows + l * Dp + d);
#pragma GCC unroll 8
      for (int t = 0; t < kDotKB; ++t) acc[t][l] = _mm512_fmadd_ps(kv[t], qv, acc[t][l]);
    }
  }
  for (int t = 0; t < kDotKB; ++t)
    for (int l = 0; l < kDotQG; ++l) {
      float v = _mm512_reduce_add_ps(acc[t][l]);
      for (int64_t d = D16; d < D; ++d) {
        float kvs;
        if constexpr (DT == static_cast<int>(DType::F32)) kvs = static_cast<const float*>(kr[t])[d];
        else if constexpr (DT == static_cast<int>(DType::F16))
          kvs = half_bits_to_float(static_cast<const uint16_t*>(kr[t])[d]);
        else
          kvs = bf16_bits_to_float(static_cast<const uint16_t*>(kr[t])[d]);
        v += kvs * qrows[l * Dp + d];
      }
      out[t * kDotQG + l] = v;
    }
}

template <int QG>
DotFn pick_dot_qg(int dtype) {
  if (dtype == static_cast<int>(DType::F32)) return dot_avx512<static_cast<int>(DType::F32), QG>;
  if (dtype == static_cast<int>(DType::F16)) return dot_avx512<static_cast<int>(DType::F16), QG>;
  return dot_avx512<static_cast<int>(DType::BF16), QG>;
}

DotFn pick_dot(int dtype, int qg) {
  switch (qg) {
    case 1: return pick_dot_qg<1>(dtype);
    case 2: return pick_dot_qg<2>(dtype);
    case 3: return pick_dot_qg<3>(dtype);
    default: return pick_dot_qg<6>(dtype);
  }
}

// fp16/bf16 rows to fp32, 8 at a time (F16C for fp16; bf16 is a 16-bit shift).
__attribute__((target("avx2,f16c"))) void convert_row_avx2(const void* src, int dtype, int64_t D, float* dst) {
  const uint16_t* s = static_cast<const uint16_t*>(src);
  int64_t d = 0;
  if (dtype == static_cast<int>(DType::F16)) {
    for (; d + 8 <= D; d += 8)
      _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + d))));
  } else {
    for (; d + 8 <= D; d += 8) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + d)));
      _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
  }
  for (; d < D; ++d)
    dst[d] = dtype == static_cast<int>(DType::F16) ? half_bits_to_float(s[d]) : bf16_bits_to_float(s[d]);
}
#endif  // RAPO_X86

void convert_row(const void* src, int dtype, int64_t D, float* dst, int isa) {
  if (dtype == static_cast<int>(DType::F32)) {
    std::memcpy(dst, src, static_cast<size_t>(D) * sizeof(float));
    return;
  }
#ifdef RAPO_X86
  if (isa >= kIsaAvx2) {
    convert_row_avx2(src, dtype, D, dst);
    return;
  }
#endif
  const uint16_t* s = static_cast<const uint16_t*>(src);
  for (int64_t d = 0; d < D; ++d)
    dst[d] = dtype == static_cast<int>(DType::F16) ? half_bits_to_float(s[d]) : bf16_bits_to_float(s[d]);
}

struct AlignedFree {
  void operator()(float* p) const { std::free(p); }
};
using FloatBuf = std::unique_ptr<float[], AlignedFree>;

FloatBuf aligned_floats(int64_t n) {
  const size_t bytes = (static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float) + 63) / 64 * 64;
  float* p = static_cast<float*>(std::aligned_alloc(64, bytes));
  if (p == nullptr) throw std::bad_alloc();
  return FloatBuf(p);
}

using TileFn = void (*)(const float*, const float*, int64_t, TileCtx&);

int detect_isa() {
#ifdef RAPO_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return kIsaAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return kIsaAvx2;
#endif
  return kIsaScalar;
}

int resolve_isa(int isa) {
  const int best = detect_isa();
  if (isa < 0) {
    const char* env = std::getenv("RAPO_FAST_CPU_ISA");
    if (env != nullptr && *env != '\0') {
      const std::string e(env);
      if (e == "scalar") isa = kIsaScalar;
      else if (e == "avx2") isa = kIsaAvx2;
      else if (e == "avx512") isa = kIsaAvx512;
      else throw std::invalid_argument("RAPO_FAST_CPU_ISA must be scalar, avx2 or avx512, got " + e);
    } else {
      isa = best;
    }
  }
  if (isa > best)
    throw std::invalid_argument("this CPU does not support the requested retrieval micro-kernel (isa " +
                                std::to_string(isa) + ")");
  return isa;
}

void run_search(const RetrievalSearchArgs& a, int num_threads, int isa, bool dot_mode) {
  int NK = kScalarNK, QT = kScalarQT;
  TileFn tile = tile_scalar;
  DotFn dot = nullptr;
#ifdef RAPO_X86
  if (dot_mode) {
    QT = dot_qg(a.Q);
    NK = dot_kb(QT);
    dot = pick_dot(a.key_dtype, QT);
  } else if (isa == kIsaAvx512) {
    NK = kAvx512NK;
    QT = kAvx512QT;
    tile = tile_avx512;
  } else if (isa == kIsaAvx2) {
    NK = kAvx2NK;
    QT = kAvx2QT;
    tile = tile_avx2;
  }
#endif
  const int64_t Q = a.Q, C = a.C, D = a.D;
  const int k = a.k;
#ifdef RAPO_WITH_OPENMP
  const int T = num_threads > 0 ? num_threads : omp_get_max_threads();
#else
  const int T = 1;
  (void)num_threads;
#endif
  // Admission threshold before a heap is full: eligible scores are >= min_score and > -inf (NaN never passes).
  const float min_thr = std::max(a.min_score, -std::numeric_limits<float>::max());
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const bool use_aux = a.metric != kMetricIP;

  // Pack every query once: panels [D][QT], zero lanes past Q (their threshold is NaN, so never admitted); in dot
  // mode rows [QT][Dp] per group instead.
  const int64_t nqt_all = (Q + QT - 1) / QT;
  const int64_t Dp = (D + 15) / 16 * 16;
  FloatBuf qpanel = aligned_floats(nqt_all * Dp * QT);
  std::vector<float> qaux(static_cast<size_t>(nqt_all * QT), 0.0f);
  {
    std::vector<float> row(static_cast<size_t>(D));
    std::fill(qpanel.get(), qpanel.get() + nqt_all * Dp * QT, 0.0f);
    const int esz = a.key_dtype == static_cast<int>(DType::F32) ? 4 : 2;
    for (int64_t q = 0; q < Q; ++q) {
      convert_row(static_cast<const char*>(a.queries) + q * a.query_row_stride * esz, a.key_dtype, D, row.data(), isa);
      float* p = dot_mode ? qpanel.get() + q * Dp : qpanel.get() + (q / QT) * D * QT + (q % QT);
      const int64_t pstride = dot_mode ? 1 : QT;
      float ss = 0.0f;
      for (int64_t d = 0; d < D; ++d) {
        p[d * pstride] = row[d];
        ss += row[d] * row[d];
      }
      qaux[q] = retrieval_query_aux(a.metric, ss);
    }
  }

  // Query passes bound the heaps' memory (every thread holds k entries per query of the pass).
  const int64_t heap_budget = int64_t(256) << 20;
  int64_t Qp = heap_budget / (int64_t(T) * k * 8) / QT * QT;
  Qp = std::max<int64_t>(Qp, QT);
  Qp = std::min<int64_t>(Qp, nqt_all * QT);
  // Key chunks: a packed fp32 chunk of ~384 KiB stays in L2 while every query tile of the pass streams over it.
  int64_t Kc = std::max<int64_t>(NK, (int64_t(384) << 10) / (4 * D) / NK * NK);
  const int64_t balance = ((C + 4 * T - 1) / (4 * T) + NK - 1) / NK * NK;  // >= 4 chunks per thread when C is small
  Kc = std::max<int64_t>(NK, std::min(Kc, balance));
  const int64_t nchunks = (C + Kc - 1) / Kc;
  const int kesz = a.key_dtype == static_cast<int>(DType::F32) ? 4 : 2;

  std::vector<ThreadHeaps> heaps(static_cast<size_t>(T));
  for (int64_t q0 = 0; q0 < Q; q0 += Qp) {
    const int64_t nq = std::min(Qp, Q - q0);
    const int64_t nqt = (nq + QT - 1) / QT;
    for (auto& h : heaps) {
      h.nq = nq;
      h.k = k;
      h.s.assign(static_cast<size_t>(nq * k), 0.0f);
      h.id.assign(static_cast<size_t>(nq * k), -1);
      h.n.assign(static_cast<size_t>(nq), 0);
      h.thr.assign(static_cast<size_t>(nqt * QT), nan);
      std::fill(h.thr.begin(), h.thr.begin() + nq, min_thr);
    }
    const int64_t* excl = a.exclude != nullptr ? a.exclude + q0 : nullptr;

#ifdef RAPO_WITH_OPENMP
#pragma omp parallel num_threads(T)
#endif
    {
#ifdef RAPO_WITH_OPENMP
      const int tid = omp_get_thread_num();
#else
      const int tid = 0;
#endif
      ThreadHeaps& h = heaps[static_cast<size_t>(tid)];
      const int64_t ntile_max = (Kc + NK - 1) / NK;
      FloatBuf kpanel = aligned_floats(dot_mode ? 1 : ntile_max * D * NK);
      std::vector<float> kaux(static_cast<size_t>(ntile_max * NK), 0.0f);
      std::vector<float> row(static_cast<size_t>(D));
      TileCtx c{};
      c.h = &h;
      c.groups = a.groups;
      c.excl = excl;
      c.min_thr = min_thr;
      c.metric = a.metric;
#ifdef RAPO_WITH_OPENMP
      // Dynamic over chunks: each thread still sees its chunks in increasing slot order.
#pragma omp for schedule(dynamic, 1)
#endif
      for (int64_t ch = 0; ch < nchunks; ++ch) {
        const int64_t j_begin = ch * Kc;
        const int64_t j_end = std::min(C, j_begin + Kc);
        const int64_t ntile = (j_end - j_begin + NK - 1) / NK;
        c.jend = j_end;
        if (dot_mode) {
          float out[kDotOut];
          for (int64_t qt = 0; qt < nqt; ++qt) {
            const float* qr = qpanel.get() + (q0 + qt * QT) * Dp;
            c.thr = h.thr.data() + qt * QT;
            c.qlocal0 = qt * QT;
            const float* qa = qaux.data() + q0 + qt * QT;
            for (int64_t j0 = j_begin; j0 < j_end; j0 += NK) {
              dot(a.keys, a.key_row_stride, j0, j_end - 1, qr, D, Dp, out);
              c.j0 = j0;
              for (int t = 0; t < NK; ++t) {
                const float ka = (use_aux && j0 + t < j_end) ? a.key_aux[j0 + t] : 0.0f;
                for (int l = 0; l < QT; ++l) {
                  const float sc = retrieval_finish(a.metric, out[t * QT + l], qa[l], ka);
                  if (sc >= c.thr[l]) admit(c, l, t, sc);
                }
              }
            }
          }
          continue;
        }
        for (int64_t j = j_begin; j < j_begin + ntile * NK; ++j) {
          const int64_t tl = (j - j_begin) / NK, t = (j - j_begin) % NK;
          float* p = kpanel.get() + tl * D * NK + t;
          if (j < j_end) {
            convert_row(static_cast<const char*>(a.keys) + j * a.key_row_stride * kesz, a.key_dtype, D, row.data(),
                        isa);
            for (int64_t d = 0; d < D; ++d) p[d * NK] = row[d];
            kaux[static_cast<size_t>(j - j_begin)] = use_aux ? a.key_aux[j] : 0.0f;
          } else {
            for (int64_t d = 0; d < D; ++d) p[d * NK] = 0.0f;
            kaux[static_cast<size_t>(j - j_begin)] = 0.0f;
          }
        }
        for (int64_t qt = 0; qt < nqt; ++qt) {
          const float* qp = qpanel.get() + (q0 / QT + qt) * D * QT;
          c.thr = h.thr.data() + qt * QT;
          c.qaux = qaux.data() + q0 + qt * QT;
          c.qlocal0 = qt * QT;
          for (int64_t tl = 0; tl < ntile; ++tl) {
            c.j0 = j_begin + tl * NK;
            c.kaux = kaux.data() + tl * NK;
            tile(qp, kpanel.get() + tl * D * NK, D, c);
          }
        }
      }
    }

    // Merge the per-thread heaps of each query: sort the union by the contract's order, keep k, pad.
#ifdef RAPO_WITH_OPENMP
#pragma omp parallel for num_threads(T) schedule(static)
#endif
    for (int64_t ql = 0; ql < nq; ++ql) {
      std::vector<std::pair<float, int32_t>> cand;
      cand.reserve(static_cast<size_t>(T) * k);
      for (const auto& h : heaps) {
        const float* s = h.s.data() + ql * k;
        const int32_t* id = h.id.data() + ql * k;
        for (int i = 0; i < h.n[ql]; ++i) cand.emplace_back(s[i], id[i]);
      }
      const size_t keep = std::min<size_t>(cand.size(), static_cast<size_t>(k));
      std::partial_sort(cand.begin(), cand.begin() + keep, cand.end(), [](const auto& x, const auto& y) {
        return topk_better(x.first, x.second, y.first, y.second);
      });
      float* os = a.out_scores + (q0 + ql) * k;
      int64_t* oi = a.out_slots + (q0 + ql) * k;
      for (size_t i = 0; i < static_cast<size_t>(k); ++i) {
        os[i] = i < keep ? cand[i].first : -std::numeric_limits<float>::infinity();
        oi[i] = i < keep ? cand[i].second : -1;
      }
    }
  }
}

}  // namespace

const char* retrieval_cpu_isa_name(int isa) {
  switch (resolve_isa(isa)) {
    case kIsaAvx512: return "avx512";
    case kIsaAvx2: return "avx2";
    default: return "scalar";
  }
}

void retrieval_search_cpu(const RetrievalSearchArgs& a, int num_threads, int isa) {
  if (a.k < 1) throw std::invalid_argument("retrieval: k must be >= 1");
  if (a.D < 1 || a.C < 0 || a.Q < 0) throw std::invalid_argument("retrieval: bad sizes");
  if (a.C >= (int64_t(1) << 31)) throw std::invalid_argument("retrieval: more than 2^31 - 1 keys");
  if (a.key_dtype != static_cast<int>(DType::F32) && a.key_dtype != static_cast<int>(DType::F16) &&
      a.key_dtype != static_cast<int>(DType::BF16))
    throw std::invalid_argument("retrieval: keys must be float32, float16 or bfloat16");
  if (a.metric < kMetricIP || a.metric > kMetricL2) throw std::invalid_argument("retrieval: unknown metric");
  if (a.Q == 0) return;
  if ((a.C > 0 && a.keys == nullptr) || a.queries == nullptr || a.out_scores == nullptr || a.out_slots == nullptr)
    throw std::invalid_argument("retrieval: null pointer");
  if (a.metric != kMetricIP && a.C > 0 && a.key_aux == nullptr) throw std::invalid_argument("retrieval: null aux");
  if (a.exclude != nullptr && a.C > 0 && a.groups == nullptr) throw std::invalid_argument("retrieval: null groups");
  const int use = resolve_isa(isa);
  // Few queries: reading the keys once straight from the buffer beats packing them for a mostly-padding 32-query
  // tile. RAPO_FAST_CPU_DOT=0/1 forces the choice (tests cover both paths).
  const char* dot_env = std::getenv("RAPO_FAST_CPU_DOT");
  bool dot_mode = use == kIsaAvx512 && a.Q <= kDotMaxQ;
  if (dot_env != nullptr && *dot_env != '\0') dot_mode = use == kIsaAvx512 && dot_env[0] == '1';
  run_search(a, num_threads, use, dot_mode);
}

}  // namespace rapo
