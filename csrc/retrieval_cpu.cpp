// CPU backend of exact step retrieval: scores Q queries against C keys with a register-blocked SIMD micro-kernel
// fused with a fixed-size heap per query, so no [Q, C] score matrix ever exists.
//
// Micro-kernels live in csrc/include/rapo/retrieval_cpu_kernels.h; this file is the driver.
// Layout (GotoBLAS-style, as faiss gets from its BLAS): queries are packed once into panels [D][QT] (QT queries per
// SIMD tile, fp32); keys are processed in cache-sized chunks, each converted to fp32 and packed into panels [D][NK].
// The micro-kernel keeps an NK x QT score tile in registers (AVX-512: 12 x 32, AVX2: 6 x 16), broadcasting key
// values against query vectors. Its epilogue applies the metric (retrieval_metric.h) and compares each score vector
// with the per-query admission threshold (the heap's worst, or min_score), so the exclusion filter and the heap only
// run for the few candidates that could enter the top-k.
// Parallelism: OpenMP over key chunks (each thread keeps heaps for every query of the pass, so every key is read once),
// then OpenMP over queries for the merge of the per-thread heaps.
// The ISA is chosen at run time (__builtin_cpu_supports) with target attributes, never -march=native.
// Not here: argument validation beyond memory safety (rapo_fast/retrieval/buffer.py does it first).
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

#ifdef RAPO_WITH_OPENMP
#include <omp.h>
#endif

#include "rapo/dtype.h"
#include "rapo/retrieval.h"
#include "rapo/retrieval_cpu_kernels.h"
#include "rapo/retrieval_metric.h"
#include "rapo/topk.h"

namespace rapo {
namespace {

using namespace retrieval_cpu;  // NOLINT: the kernels header exists only to keep this file short

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
  bool dot_mode = use >= kIsaAvx2 && a.Q <= kDotMaxQ;
  if (dot_env != nullptr && *dot_env != '\0') dot_mode = use >= kIsaAvx2 && dot_env[0] == '1';
  run_search(a, num_threads, use, dot_mode);
}

}  // namespace rapo
