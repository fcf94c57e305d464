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
// Few queries (Q <= kDotMaxQ) take the dot mode instead: no key packing, a kernel reads key rows straight from the
// buffer (retrieval_cpu_kernels.h explains why and when).
// Steps of run_search: make_plan (mode, micro-kernel, blocking), pack_queries, then per pass of queries reset_heaps,
// scan_pass (scan_chunk_dot or scan_chunk_tiled per key chunk) and merge_pass.
// The ISA is chosen at run time (__builtin_cpu_supports) with target attributes, never -march=native.
// The search's contract (scores, order, ties, padding) is written in docs/retrieval.md.
// l2 with a centre (RetrievalSearchParams::centre): queries and keys are centred as they are packed (dot mode: as
// the dot kernel loads them), and each key's squared norm is taken from its centred row, so the expanded form does not
// cancel for keys far from the origin.
// Not here: argument validation (rapo_fast/retrieval/buffer.py does it first; rapo/retrieval.h keeps memory safe).
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

using TileFn = void (*)(const float*, const float*, int64_t, float*, int, TileCtx&);

int detect_isa() {
#ifdef RAPO_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return kIsaAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return kIsaAvx2;
#endif
  return kIsaScalar;
}

int isa_from_name(const std::string& e) {
  if (e == "scalar") return kIsaScalar;
  if (e == "avx2") return kIsaAvx2;
  if (e == "avx512") return kIsaAvx512;
  throw std::invalid_argument("RAPO_FAST_CPU_ISA: expected scalar, avx2 or avx512, got " + e);
}

int resolve_isa(int isa) {
  const int best = detect_isa();
  if (isa < 0) {
    const char* env = std::getenv("RAPO_FAST_CPU_ISA");
    isa = (env != nullptr && *env != '\0') ? isa_from_name(env) : best;
  }
  if (isa > best)
    throw std::invalid_argument("this CPU does not support the requested retrieval micro-kernel (isa " +
                                std::to_string(isa) + ")");
  return isa;
}

// The plan of one search: the micro-kernel and its tile shape, the thread count, and how queries (passes) and keys
// (chunks) are blocked.
struct SearchPlan {
  bool dot_mode = false;
  int isa = kIsaScalar;
  int NK = kScalarNK;  // keys per micro-kernel tile (dot mode: per block of the dot kernel)
  int QT = kScalarQT;  // queries per tile (dot mode: per query group)
  TileFn tile = tile_scalar;
  DotFn dot = nullptr;
  int T = 1;             // threads
  float min_thr = 0.0f;  // admission threshold before a heap is full
  bool use_aux = false;  // the metric reads key/query aux values
  int64_t nqt_all = 0;   // query tiles over all Q
  int64_t Dp = 0;        // row pitch of the dot mode's query rows
  int64_t Qp = 0;        // queries per pass
  int64_t Kc = 0;        // keys per chunk
  int64_t nchunks = 0;
  int64_t kc = 0;  // tiled path: D per micro-kernel block (D blocking, see tile_block_d)
};

// D per micro-kernel block of the tiled path: the query panel block [kc][QT] and the key panel block [kc][NK] must
// stay in L1 together while the key tiles of a chunk stream past the query block. Without blocking, the AVX2 6 x 16
// tile at D = 384 needs 33 KiB (24 + 9) against a 32 KiB L1, and the query panel was re-read from L2 for every key
// tile (bench/NOTES_retrieval.md, "D blocking"). Budget 20 KiB; blocks of equal size, multiples of 8. AVX-512 keeps
// one block (kc = D): its 12 x 32 tile was measured fast as is on AVX-512 machines, and no AVX-512 machine was at
// hand to measure the blocked variant. RAPO_FAST_CPU_KC=n forces blocks of n (tests use it to cover the partial-tile
// path at small D).
int64_t tile_block_d(int64_t D, int NK, int QT, int isa) {
  const char* env = std::getenv("RAPO_FAST_CPU_KC");
  if (env != nullptr && *env != '\0') {
    const long v = std::strtol(env, nullptr, 10);
    if (v <= 0) throw std::invalid_argument(std::string("RAPO_FAST_CPU_KC: expected a positive integer, got ") + env);
    return std::min<int64_t>(D, v);
  }
  if (isa == kIsaAvx512 || D <= 0) return std::max<int64_t>(D, 1);
  const int64_t kc_max = std::max<int64_t>(8, (int64_t(20) << 10) / (4 * (NK + QT)) / 8 * 8);
  const int64_t nblk = (D + kc_max - 1) / kc_max;
  return std::min<int64_t>(D, ((D + nblk - 1) / nblk + 7) / 8 * 8);
}

SearchPlan make_plan(const RetrievalSearchParams& a, int num_threads, int isa, bool dot_mode) {
  SearchPlan pl;
  pl.dot_mode = dot_mode;
  pl.isa = isa;
#ifdef RAPO_X86
  if (dot_mode) {
    pl.QT = dot_qg(a.Q);
    pl.NK = dot_kb(pl.QT);
    pl.dot = pick_dot(a.key_dtype, pl.QT, a.centre != nullptr);
  } else if (isa == kIsaAvx512) {
    pl.NK = kAvx512NK;
    pl.QT = kAvx512QT;
    pl.tile = tile_avx512;
  } else if (isa == kIsaAvx2) {
    pl.NK = kAvx2NK;
    pl.QT = kAvx2QT;
    pl.tile = tile_avx2;
  }
#endif
#ifdef RAPO_WITH_OPENMP
  pl.T = num_threads > 0 ? num_threads : omp_get_max_threads();
#else
  (void)num_threads;
#endif
  // Eligible scores are >= min_score and > -inf (NaN never passes).
  pl.min_thr = std::max(a.min_score, -std::numeric_limits<float>::max());
  pl.use_aux = a.metric != kMetricIP;
  const int64_t NK = pl.NK, QT = pl.QT, C = a.C, T = pl.T;
  pl.nqt_all = (a.Q + QT - 1) / QT;
  pl.Dp = (a.D + 15) / 16 * 16;
  // Query passes bound the heaps' memory (every thread holds k entries per query of the pass).
  const int64_t heap_budget = int64_t(256) << 20;
  pl.Qp = heap_budget / (T * a.k * 8) / QT * QT;
  pl.Qp = std::min<int64_t>(std::max<int64_t>(pl.Qp, QT), pl.nqt_all * QT);
  // Key chunks: a packed fp32 chunk of ~384 KiB stays in L2 while every query tile of the pass streams over it.
  int64_t Kc = std::max<int64_t>(NK, (int64_t(384) << 10) / (4 * a.D) / NK * NK);
  const int64_t balance = ((C + 4 * T - 1) / (4 * T) + NK - 1) / NK * NK;  // >= 4 chunks per thread when C is small
  pl.Kc = std::max<int64_t>(NK, std::min(Kc, balance));
  pl.nchunks = (C + pl.Kc - 1) / pl.Kc;
  pl.kc = tile_block_d(a.D, pl.NK, pl.QT, isa);
  return pl;
}

// Every query converted to fp32 once, with its aux value (retrieval_query_aux). Tiled path: panels [D][QT] per query
// tile, zero lanes past Q (their threshold is NaN, so never admitted). Dot mode: rows of pitch Dp.
struct PackedQueries {
  FloatBuf panel;
  std::vector<float> aux;
};

PackedQueries pack_queries(const RetrievalSearchParams& a, const SearchPlan& pl) {
  const int64_t D = a.D, QT = pl.QT;
  const int64_t n = pl.nqt_all * pl.Dp * QT;
  PackedQueries pq{aligned_floats(n), std::vector<float>(static_cast<size_t>(pl.nqt_all * QT), 0.0f)};
  std::fill(pq.panel.get(), pq.panel.get() + n, 0.0f);
  std::vector<float> row(static_cast<size_t>(D));
  const int esz = a.key_dtype == static_cast<int>(DType::F32) ? 4 : 2;
  const int64_t pstride = pl.dot_mode ? 1 : QT;
  for (int64_t q = 0; q < a.Q; ++q) {
    convert_row(static_cast<const char*>(a.queries) + q * a.query_row_stride * esz, a.key_dtype, D, row.data(), pl.isa);
    if (a.centre != nullptr)
      for (int64_t d = 0; d < D; ++d) row[d] -= a.centre[d];
    float* p = pl.dot_mode ? pq.panel.get() + q * pl.Dp : pq.panel.get() + (q / QT) * D * QT + (q % QT);
    float ss = 0.0f;
    for (int64_t d = 0; d < D; ++d) {
      p[d * pstride] = row[d];
      ss += row[d] * row[d];
    }
    pq.aux[q] = retrieval_query_aux(a.metric, ss);
  }
  return pq;
}

// Empty heaps for the nq queries of a pass; thresholds min_thr for real queries, NaN for padding lanes.
void reset_heaps(std::vector<ThreadHeaps>& heaps, int64_t nq, int k, const SearchPlan& pl) {
  const int64_t nqt = (nq + pl.QT - 1) / pl.QT;
  for (auto& h : heaps) {
    h.nq = nq;
    h.k = k;
    h.s.assign(static_cast<size_t>(nq * k), 0.0f);
    h.id.assign(static_cast<size_t>(nq * k), -1);
    h.n.assign(static_cast<size_t>(nq), 0);
    h.thr.assign(static_cast<size_t>(nqt * pl.QT), std::numeric_limits<float>::quiet_NaN());
    std::fill(h.thr.begin(), h.thr.begin() + nq, pl.min_thr);
  }
}

// Dot mode: every query group of the pass (queries q0 + [0, nqt * QT)) against keys [j_begin, j_end), read straight
// from the buffer by the dot kernel, NK keys at a time; the scores go through the metric and `admit`.
void scan_chunk_dot(const RetrievalSearchParams& a, const SearchPlan& pl, const PackedQueries& pq, ThreadHeaps& h,
                    TileCtx& c, int64_t q0, int64_t nqt, int64_t j_begin, int64_t j_end) {
  const int NK = pl.NK, QT = pl.QT;
  const bool use_aux = pl.use_aux;
  const DotFn dot = pl.dot;
  float out[kDotOut], kss[kDotOut];
  for (int64_t qt = 0; qt < nqt; ++qt) {
    const float* qr = pq.panel.get() + (q0 + qt * QT) * pl.Dp;
    c.thr = h.thr.data() + qt * QT;
    c.qlocal0 = qt * QT;
    const float* qa = pq.aux.data() + q0 + qt * QT;
    for (int64_t j0 = j_begin; j0 < j_end; j0 += NK) {
      dot(a.keys, a.key_row_stride, j0, j_end - 1, qr, a.D, pl.Dp, out, a.centre, kss);
      c.j0 = j0;
      for (int t = 0; t < NK; ++t) {
        const float ka = (!use_aux || j0 + t >= j_end) ? 0.0f : a.centre != nullptr ? kss[t] : a.key_aux[j0 + t];
        for (int l = 0; l < QT; ++l) {
          const float sc = retrieval_finish(a.metric, out[t * QT + l], qa[l], ka);
          if (sc >= c.thr[l]) admit(c, l, t, sc);
        }
      }
    }
  }
}

// Per-thread scratch of the tiled path: one chunk of keys packed as panels [D][NK] (zero past the chunk's end), their
// aux values, and a conversion row.
struct KeyScratch {
  FloatBuf panel;
  std::vector<float> aux;
  std::vector<float> row;
  std::vector<float> part;  // [ntile][NK * QT] partial scores across D blocks (empty with one block)
};

KeyScratch make_key_scratch(const RetrievalSearchParams& a, const SearchPlan& pl) {
  const int64_t ntile_max = (pl.Kc + pl.NK - 1) / pl.NK;
  return KeyScratch{
      aligned_floats(pl.dot_mode ? 1 : ntile_max * a.D * pl.NK),
      std::vector<float>(static_cast<size_t>(ntile_max * pl.NK), 0.0f), std::vector<float>(static_cast<size_t>(a.D)),
      std::vector<float>(pl.dot_mode || pl.kc >= a.D ? 0 : static_cast<size_t>(ntile_max * pl.NK * pl.QT))};
}

void pack_key_chunk(const RetrievalSearchParams& a, const SearchPlan& pl, KeyScratch& ks, int64_t j_begin,
                    int64_t j_end, int64_t ntile) {
  const int64_t NK = pl.NK, D = a.D;
  const int kesz = a.key_dtype == static_cast<int>(DType::F32) ? 4 : 2;
  for (int64_t j = j_begin; j < j_begin + ntile * NK; ++j) {
    const int64_t tl = (j - j_begin) / NK, t = (j - j_begin) % NK;
    float* p = ks.panel.get() + tl * D * NK + t;
    if (j < j_end) {
      convert_row(static_cast<const char*>(a.keys) + j * a.key_row_stride * kesz, a.key_dtype, D, ks.row.data(),
                  pl.isa);
      if (a.centre != nullptr) {  // l2 about a centre: the key's squared norm is taken here, of the centred row
        float ss = 0.0f;
        for (int64_t d = 0; d < D; ++d) {
          const float v = ks.row[d] - a.centre[d];
          p[d * NK] = v;
          ss += v * v;
        }
        ks.aux[static_cast<size_t>(j - j_begin)] = ss;
      } else {
        for (int64_t d = 0; d < D; ++d) p[d * NK] = ks.row[d];
        ks.aux[static_cast<size_t>(j - j_begin)] = pl.use_aux ? a.key_aux[j] : 0.0f;
      }
    } else {
      for (int64_t d = 0; d < D; ++d) p[d * NK] = 0.0f;
      ks.aux[static_cast<size_t>(j - j_begin)] = 0.0f;
    }
  }
}

// Tiled path: pack keys [j_begin, j_end), then run the micro-kernel on every (query tile, key tile) of the pass,
// D block by D block (the query block stays in L1 while the chunk's key tiles stream past it).
void scan_chunk_tiled(const RetrievalSearchParams& a, const SearchPlan& pl, const PackedQueries& pq, KeyScratch& ks,
                      ThreadHeaps& h, TileCtx& c, int64_t q0, int64_t nqt, int64_t j_begin, int64_t j_end) {
  const int64_t NK = pl.NK, QT = pl.QT, D = a.D;
  const TileFn tile = pl.tile;
  const int64_t ntile = (j_end - j_begin + NK - 1) / NK;
  pack_key_chunk(a, pl, ks, j_begin, j_end, ntile);
  for (int64_t qt = 0; qt < nqt; ++qt) {
    const float* qp = pq.panel.get() + (q0 / QT + qt) * D * QT;
    c.thr = h.thr.data() + qt * QT;
    c.qaux = pq.aux.data() + q0 + qt * QT;
    c.qlocal0 = qt * QT;
    for (int64_t d0 = 0; d0 < D; d0 += pl.kc) {
      const int64_t dl = std::min(pl.kc, D - d0);
      const int phase = (d0 == 0 ? kFirst : 0) | (d0 + dl == D ? kLast : 0);
      for (int64_t tl = 0; tl < ntile; ++tl) {
        c.j0 = j_begin + tl * NK;
        c.kaux = ks.aux.data() + tl * NK;
        float* part = ks.part.empty() ? nullptr : ks.part.data() + tl * NK * QT;
        tile(qp + d0 * QT, ks.panel.get() + tl * D * NK + d0 * NK, dl, part, phase, c);
      }
    }
  }
}

// One pass over every key for queries [q0, q0 + nq): OpenMP over key chunks, each thread filling its own heaps (so
// every key is read once per pass).
void scan_pass(const RetrievalSearchParams& a, const SearchPlan& pl, const PackedQueries& pq,
               std::vector<ThreadHeaps>& heaps, int64_t q0, int64_t nq) {
  const int64_t nqt = (nq + pl.QT - 1) / pl.QT;
#ifdef RAPO_WITH_OPENMP
#pragma omp parallel num_threads(pl.T)
#endif
  {
#ifdef RAPO_WITH_OPENMP
    const int tid = omp_get_thread_num();
#else
    const int tid = 0;
#endif
    ThreadHeaps& h = heaps[static_cast<size_t>(tid)];
    KeyScratch ks = make_key_scratch(a, pl);
    TileCtx c{};
    c.h = &h;
    c.groups = a.groups;
    c.excl = a.exclude != nullptr ? a.exclude + q0 : nullptr;
    c.min_thr = pl.min_thr;
    c.metric = a.metric;
#ifdef RAPO_WITH_OPENMP
    // Dynamic over chunks: each thread still sees its chunks in increasing slot order.
#pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t ch = 0; ch < pl.nchunks; ++ch) {
      const int64_t j_begin = ch * pl.Kc;
      const int64_t j_end = std::min(a.C, j_begin + pl.Kc);
      c.jend = j_end;
      if (pl.dot_mode)
        scan_chunk_dot(a, pl, pq, h, c, q0, nqt, j_begin, j_end);
      else
        scan_chunk_tiled(a, pl, pq, ks, h, c, q0, nqt, j_begin, j_end);
    }
  }
}

// Merge the per-thread heaps of each query of the pass: sort the union by the contract's order, keep k, pad with
// -inf / -1. OpenMP over queries.
void merge_pass(const RetrievalSearchParams& a, const SearchPlan& pl, const std::vector<ThreadHeaps>& heaps, int64_t q0,
                int64_t nq) {
  const int k = a.k;
#ifdef RAPO_WITH_OPENMP
#pragma omp parallel for num_threads(pl.T) schedule(static)
#endif
  for (int64_t ql = 0; ql < nq; ++ql) {
    std::vector<std::pair<float, int32_t>> cand;
    cand.reserve(static_cast<size_t>(pl.T) * k);
    for (const auto& h : heaps) {
      const float* s = h.s.data() + ql * k;
      const int32_t* id = h.id.data() + ql * k;
      for (int i = 0; i < h.n[ql]; ++i) cand.emplace_back(s[i], id[i]);
    }
    const size_t keep = std::min<size_t>(cand.size(), static_cast<size_t>(k));
    std::partial_sort(cand.begin(), cand.begin() + keep, cand.end(),
                      [](const auto& x, const auto& y) { return topk_better(x.first, x.second, y.first, y.second); });
    float* os = a.out_scores + (q0 + ql) * k;
    int64_t* oi = a.out_slots + (q0 + ql) * k;
    for (size_t i = 0; i < static_cast<size_t>(k); ++i) {
      os[i] = i < keep ? cand[i].first : -std::numeric_limits<float>::infinity();
      oi[i] = i < keep ? cand[i].second : -1;
    }
  }
}

// Few queries: reading the keys once straight from the buffer beats packing them for a mostly-padding 32-query tile.
// RAPO_FAST_CPU_DOT=0/1 forces the choice (tests cover both paths).
bool use_dot_mode(int64_t Q, int isa) {
  const char* env = std::getenv("RAPO_FAST_CPU_DOT");
  if (env != nullptr && *env != '\0') return isa >= kIsaAvx2 && env[0] == '1';
  return isa >= kIsaAvx2 && Q <= kDotMaxQ;
}

void run_search(const RetrievalSearchParams& a, int num_threads, int isa) {
  const SearchPlan pl = make_plan(a, num_threads, isa, use_dot_mode(a.Q, isa));
  const PackedQueries pq = pack_queries(a, pl);
  std::vector<ThreadHeaps> heaps(static_cast<size_t>(pl.T));
  for (int64_t q0 = 0; q0 < a.Q; q0 += pl.Qp) {
    const int64_t nq = std::min(pl.Qp, a.Q - q0);
    reset_heaps(heaps, nq, a.k, pl);
    scan_pass(a, pl, pq, heaps, q0, nq);
    merge_pass(a, pl, heaps, q0, nq);
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

void retrieval_search_cpu(const RetrievalSearchParams& a, int num_threads, int isa) {
  check_retrieval_params(a, "retrieval");
  if (a.Q == 0) return;
  run_search(a, num_threads, resolve_isa(isa));
}

}  // namespace rapo
