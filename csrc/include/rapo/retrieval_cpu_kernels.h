// Micro-kernels of the CPU retrieval backend (csrc/retrieval_cpu.cpp, its only includer): the per-thread admission
// state, the packed-tile kernels (AVX-512 12 keys x 32 queries, AVX2 6 x 16, scalar 4 x 8), the few-query dot kernel
// (AVX2, keys streamed straight from the buffer) and the SIMD fp16/bf16 row conversion (scalar conversions come from
// rapo/dtype.h). Each kernel ends in the same epilogue: metric (retrieval_metric.h), one vector compare against the
// per-query threshold, and `admit` (exclusion, heap push, threshold update) for the few candidates that pass.
// ISA-specific code is compiled with target attributes and chosen at run time by the includer.
// Host-only; not shared with the CUDA backend.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define RAPO_X86 1
#endif

#include "rapo/dtype.h"
#include "rapo/retrieval_metric.h"
#include "rapo/topk.h"

namespace rapo {
namespace retrieval_cpu {

// Per-thread admission state of one query pass, shared by the micro-kernel epilogues through TileCtx.
struct ThreadHeaps {
  int64_t nq = 0;
  int k = 0;
  std::vector<float> s;     // [nq, k]
  std::vector<int32_t> id;  // [nq, k]
  std::vector<int32_t> n;   // [nq]
  std::vector<float> thr;   // [nq rounded up to QT]: admit when score >= thr (NaN for padding lanes)
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
__attribute__((noinline)) inline void admit(TileCtx& c, int lane, int t, float score) {
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

// ---- micro-kernels: score tile NK keys x QT queries over one block of D, then the epilogue ----
// D is split into blocks (SearchPlan::kc) so that a query panel block and a key panel block fit in L1 together; the
// NK x QT partial scores of a tile cross blocks through `part` (kFirst: start from zero, else load `part`; kLast: run
// the epilogue, else store `part`). One block (kFirst | kLast) is the whole D with no partial traffic.
constexpr int kFirst = 1;
constexpr int kLast = 2;

// Dot mode (few queries, see dotrow_avx2): KB keys x QG queries per block, KB * QG <= kDotOut scores; KB = 8 for
// QG <= 2, else 4 (measured 1.5x faster at Q = 3). One group of exactly Q queries up to 6 (the keys are streamed
// once); beyond, groups of 4, which re-read each key chunk from L2 (faster than groups of 6 there). Up to Q = 48 it
// beats packing the keys for the tile kernels (C=170k, D=384, one thread: 109 vs 146 ms at Q = 48, about even at 64);
// bench/NOTES_retrieval.md has the measurements.
constexpr int kDotMaxQ = 48;
constexpr int kDotOut = 24;
constexpr int dot_kb(int qg) { return qg <= 2 ? 8 : 4; }
inline int dot_qg(int64_t Q) { return Q <= 6 ? static_cast<int>(Q) : 4; }
// (keys, key row stride, j0, jlast, query rows, D, Dp, out [KB * QG], centre [D] or nullptr, kss [KB]): with a
// centre (l2, retrieval.h), keys are centred as they are loaded and kss[t] receives |k_t - centre|^2.
using DotFn = void (*)(const void*, int64_t, int64_t, int64_t, const float*, int64_t, int64_t, float*, const float*,
                       float*);

constexpr int kScalarNK = 4;
constexpr int kScalarQT = 8;

inline void tile_scalar(const float* __restrict qp, const float* __restrict kp, int64_t D, float* part, int phase,
                        TileCtx& c) {
  float acc[kScalarNK][kScalarQT];
  for (int t = 0; t < kScalarNK; ++t)
    for (int l = 0; l < kScalarQT; ++l) acc[t][l] = (phase & kFirst) ? 0.0f : part[t * kScalarQT + l];
  for (int64_t d = 0; d < D; ++d) {
    const float* q = qp + d * kScalarQT;
    const float* kd = kp + d * kScalarNK;
    for (int t = 0; t < kScalarNK; ++t)
      for (int l = 0; l < kScalarQT; ++l) acc[t][l] += kd[t] * q[l];
  }
  if (!(phase & kLast)) {
    for (int t = 0; t < kScalarNK; ++t)
      for (int l = 0; l < kScalarQT; ++l) part[t * kScalarQT + l] = acc[t][l];
    return;
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

// Metric, threshold compare and admission of one NK x 16 score tile stored row by row in `sc` (key t at sc + 16 t).
__attribute__((target("avx2,fma"))) inline void epilogue_avx2(const float* sc, int NK, TileCtx& c) {
  const __m256 th0 = _mm256_loadu_ps(c.thr), th1 = _mm256_loadu_ps(c.thr + 8);
  const __m256 qa0 = _mm256_loadu_ps(c.qaux), qa1 = _mm256_loadu_ps(c.qaux + 8);
  const __m256 zero = _mm256_setzero_ps(), two = _mm256_set1_ps(2.0f);
  for (int t = 0; t < NK; ++t) {
    __m256 s0 = _mm256_loadu_ps(sc + t * 16), s1 = _mm256_loadu_ps(sc + t * 16 + 8);
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

// Every access to the accumulator arrays is in a fully unrolled loop with constant indices, so that they live in
// registers: with the epilogue's loop indexing them, GCC 12 kept them in memory and stored all 12 on every step of
// the D loop (store-bound at about 55% of the FMA rate; bench/NOTES_retrieval.md "accumulators in registers").
__attribute__((target("avx2,fma"))) inline void tile_avx2(const float* __restrict qp, const float* __restrict kp,
                                                          int64_t D, float* part, int phase, TileCtx& c) {
  constexpr int NK = kAvx2NK;
  __m256 a0[NK], a1[NK];
  const bool first = phase & kFirst;
#pragma GCC unroll 6
  for (int t = 0; t < NK; ++t) {
    a0[t] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(part + t * 16);
    a1[t] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(part + t * 16 + 8);
  }
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
  alignas(32) float sc[NK * 16];
  float* dst = (phase & kLast) ? sc : part;
#pragma GCC unroll 6
  for (int t = 0; t < NK; ++t) {
    _mm256_storeu_ps(dst + t * 16, a0[t]);
    _mm256_storeu_ps(dst + t * 16 + 8, a1[t]);
  }
  if (phase & kLast) epilogue_avx2(sc, NK, c);
}

constexpr int kAvx512NK = 12;
constexpr int kAvx512QT = 32;

// As epilogue_avx2, for an NK x 32 tile (key t at sc + 32 t).
__attribute__((target("avx512f"))) inline void epilogue_avx512(const float* sc, int NK, TileCtx& c) {
  const __m512 th0 = _mm512_loadu_ps(c.thr), th1 = _mm512_loadu_ps(c.thr + 16);
  const __m512 qa0 = _mm512_loadu_ps(c.qaux), qa1 = _mm512_loadu_ps(c.qaux + 16);
  const __m512 zero = _mm512_setzero_ps(), two = _mm512_set1_ps(2.0f);
  for (int t = 0; t < NK; ++t) {
    __m512 s0 = _mm512_loadu_ps(sc + t * 32), s1 = _mm512_loadu_ps(sc + t * 32 + 16);
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

// Accumulators in registers as in tile_avx2 (every access unrolled with constant indices).
__attribute__((target("avx512f"))) inline void tile_avx512(const float* __restrict qp, const float* __restrict kp,
                                                           int64_t D, float* part, int phase, TileCtx& c) {
  constexpr int NK = kAvx512NK;
  __m512 a0[NK], a1[NK];
  const bool first = phase & kFirst;
#pragma GCC unroll 12
  for (int t = 0; t < NK; ++t) {
    a0[t] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(part + t * 32);
    a1[t] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(part + t * 32 + 16);
  }
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
  alignas(64) float sc[NK * 32];
  float* dst = (phase & kLast) ? sc : part;
#pragma GCC unroll 12
  for (int t = 0; t < NK; ++t) {
    _mm512_storeu_ps(dst + t * 32, a0[t]);
    _mm512_storeu_ps(dst + t * 32 + 16, a1[t]);
  }
  if (phase & kLast) epilogue_avx512(sc, NK, c);
}

// Few queries (Q <= kDotMaxQ): packing keys would cost more than scoring them, so keys are read straight from the
// buffer, converted 8 at a time. The scan is memory-bound, so it is written for streaming: each of the KB rows is
// walked to its end before the next (one linear stream; interleaving the KB rows, KB streams a row apart, streamed at
// 10 GB/s here), and with 256-bit loads (one Zen 4 thread streams 24 GB/s with them against 21 GB/s with 512-bit
// loads). 8 elements of a key row from `off`, as fp32 (F16C for fp16; bf16 is a 16-bit shift).
template <DType DT>
__attribute__((target("avx2,f16c"))) inline __m256 load8_avx2(const void* base, int64_t off) {
  if constexpr (DT == DType::F32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + off);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + off));
    if constexpr (DT == DType::F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// Sum of the 8 lanes. Takes a value, not a pointer to the accumulators: a pointer kept them in memory, stored on every
// step of the dot loop (see tile_avx2).
__attribute__((target("avx2"))) inline float hsum8_avx2(__m256 s8) {
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
  return _mm_cvtss_f32(s4);
}

template <DType DT, int QG, bool CENTRED>
__attribute__((target("avx2,fma,f16c"))) void dotrow_avx2(const void* keys, int64_t ks, int64_t j0, int64_t jlast,
                                                          const float* __restrict qrows, int64_t D, int64_t Dp,
                                                          float* out, const float* __restrict centre, float* kss) {
  constexpr int kKB = dot_kb(QG);
  constexpr int kU = QG == 1 ? 4 : 2;  // independent accumulators per query
  const int esz = DT == DType::F32 ? 4 : 2;
  const char* kb = static_cast<const char*>(keys);
  const int64_t D8 = D / 8 * 8;
  for (int t = 0; t < kKB; ++t) {
    const void* r = kb + std::min(j0 + t, jlast) * ks * esz;
    __m256 acc[QG][kU], sq[kU];
#pragma GCC unroll 4
    for (int u = 0; u < kU; ++u) sq[u] = _mm256_setzero_ps();
#pragma GCC unroll 6
    for (int l = 0; l < QG; ++l)
#pragma GCC unroll 4
      for (int u = 0; u < kU; ++u) acc[l][u] = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 * kU <= D8; d += 8 * kU) {
#pragma GCC unroll 4
      for (int u = 0; u < kU; ++u) {
        __m256 kv = load8_avx2<DT>(r, d + 8 * u);
        if constexpr (CENTRED) {
          kv = _mm256_sub_ps(kv, _mm256_loadu_ps(centre + d + 8 * u));
          sq[u] = _mm256_fmadd_ps(kv, kv, sq[u]);
        }
#pragma GCC unroll 6
        for (int l = 0; l < QG; ++l)
          acc[l][u] = _mm256_fmadd_ps(kv, _mm256_loadu_ps(qrows + l * Dp + d + 8 * u), acc[l][u]);
      }
    }
    for (; d < D8; d += 8) {
      __m256 kv = load8_avx2<DT>(r, d);
      if constexpr (CENTRED) {
        kv = _mm256_sub_ps(kv, _mm256_loadu_ps(centre + d));
        sq[0] = _mm256_fmadd_ps(kv, kv, sq[0]);
      }
#pragma GCC unroll 6
      for (int l = 0; l < QG; ++l) acc[l][0] = _mm256_fmadd_ps(kv, _mm256_loadu_ps(qrows + l * Dp + d), acc[l][0]);
    }
    const auto* re = static_cast<const typename FloatTraits<DT>::Bits*>(r);
#pragma GCC unroll 6
    for (int l = 0; l < QG; ++l) {
      __m256 s8 = acc[l][0];
#pragma GCC unroll 4
      for (int u = 1; u < kU; ++u) s8 = _mm256_add_ps(s8, acc[l][u]);
      float v = hsum8_avx2(s8);
      for (int64_t e = d; e < D; ++e)
        v += (FloatTraits<DT>::to_float(re[e]) - (CENTRED ? centre[e] : 0.0f)) * qrows[l * Dp + e];
      out[t * QG + l] = v;
    }
    if constexpr (CENTRED) {
      __m256 s8 = sq[0];
#pragma GCC unroll 4
      for (int u = 1; u < kU; ++u) s8 = _mm256_add_ps(s8, sq[u]);
      float v = hsum8_avx2(s8);
      for (int64_t e = d; e < D; ++e) {
        const float x = FloatTraits<DT>::to_float(re[e]) - centre[e];
        v += x * x;
      }
      kss[t] = v;
    }
  }
}

template <int QG, bool CENTRED>
DotFn pick_dotrow(int dtype) {
  if (dtype == static_cast<int>(DType::F32)) return dotrow_avx2<DType::F32, QG, CENTRED>;
  if (dtype == static_cast<int>(DType::F16)) return dotrow_avx2<DType::F16, QG, CENTRED>;
  return dotrow_avx2<DType::BF16, QG, CENTRED>;
}

template <bool CENTRED>
DotFn pick_dot_qg(int dtype, int qg) {
  switch (qg) {
    case 1: return pick_dotrow<1, CENTRED>(dtype);
    case 2: return pick_dotrow<2, CENTRED>(dtype);
    case 3: return pick_dotrow<3, CENTRED>(dtype);
    case 4: return pick_dotrow<4, CENTRED>(dtype);
    case 5: return pick_dotrow<5, CENTRED>(dtype);
    default: return pick_dotrow<6, CENTRED>(dtype);
  }
}

// The dot kernel for qg queries per group; centred: the l2 variant that centres keys as it loads them.
inline DotFn pick_dot(int dtype, int qg, bool centred) {
  return centred ? pick_dot_qg<true>(dtype, qg) : pick_dot_qg<false>(dtype, qg);
}

// fp16/bf16 rows to fp32, 8 at a time.
__attribute__((target("avx2,f16c"))) inline void convert_row_avx2(const void* src, int dtype, int64_t D, float* dst) {
  const uint16_t* s = static_cast<const uint16_t*>(src);
  int64_t d = 0;
  if (dtype == static_cast<int>(DType::F16)) {
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + d, load8_avx2<DType::F16>(src, d));
  } else {
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + d, load8_avx2<DType::BF16>(src, d));
  }
  for (; d < D; ++d) dst[d] = float16_bits_to_float(static_cast<DType>(dtype), s[d]);
}
#endif  // RAPO_X86

inline void convert_row(const void* src, int dtype, int64_t D, float* dst, int isa) {
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
  for (int64_t d = 0; d < D; ++d) dst[d] = float16_bits_to_float(static_cast<DType>(dtype), s[d]);
}

}  // namespace retrieval_cpu
}  // namespace rapo
