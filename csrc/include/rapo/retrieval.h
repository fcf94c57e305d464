// Host-side interface of the step-retrieval backends (csrc/retrieval_cpu.cpp, csrc/retrieval_cuda.cu), called from
// csrc/retrieval_bindings.cpp, which fills the parameter block from the tensors it was given after checking them
// (rank, dtype, device, strides, output shapes: rapo/tensor_arg.h). Python (rapo_fast/retrieval/buffer.py) has
// validated the values before; the backends still check every extent they index with (check_retrieval_params), so
// that the op called directly raises instead of reading out of bounds. The search's contract: docs/retrieval.md.
// Not a place for math (retrieval_metric.h, topk.h).
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

#include "rapo/constants.h"  // metric and dtype codes, kRetrievalMaxK, kRetrievalMaxKeys

namespace rapo {

// One exact top-k search of Q queries against the first C stored keys.
struct RetrievalSearchParams {
  const void* keys = nullptr;  // [C, D] rows of key_dtype, inner stride 1, row stride key_row_stride
  int64_t key_row_stride = 0;
  int key_dtype = 0;                // DType code: F32, F16 or BF16
  const float* key_aux = nullptr;   // [C] fp32 (cosine: inverse norm, l2: squared norm); unused for ip
  const int64_t* groups = nullptr;  // [C] group id of each slot; read only when exclude is given
  int64_t C = 0;
  int64_t D = 0;                  // of the queries
  int64_t key_dim = 0;            // D of the keys: must equal D
  int64_t aux_len = 0;            // entries of key_aux (>= C unless the metric is ip)
  int64_t groups_len = 0;         // entries of groups (>= C when exclude is given)
  const void* queries = nullptr;  // [Q, D] rows of query_dtype (rounded to the buffer dtype by the caller)
  int query_dtype = 0;            // must equal key_dtype
  int64_t query_row_stride = 0;
  int64_t Q = 0;
  const int64_t* exclude = nullptr;  // [Q] group to exclude per query (negative: none), or nullptr
  int64_t exclude_len = 0;           // entries of exclude (== Q when exclude is given)
  // l2 only, CPU only: [D] fp32 centre subtracted from keys and queries before scoring, or nullptr. With a centre the
  // CPU backend computes each key's squared norm itself (key_aux unread) and scores |q - c|^2 + |k - c|^2 - 2 (q -
  // c).(k
  // - c), which keeps l2 exact for keys far from the origin relative to their spread (docs/retrieval.md).
  const float* centre = nullptr;
  int k = 1;
  int metric = 0;                // RetrievalMetric
  float min_score = 0.0f;        // candidates with score < min_score are not eligible (-inf: no threshold)
  float* out_scores = nullptr;   // [Q, k] contiguous, best first, -inf padding
  int64_t* out_slots = nullptr;  // [Q, k] contiguous, -1 padding
};

// The checks both backends run before touching memory: every extent the kernels index with, once per call.
// std::invalid_argument reaches Python as ValueError, std::out_of_range as IndexError.
inline void check_retrieval_params(const RetrievalSearchParams& a, const char* op) {
  const std::string o(op);
  if (a.k < 1 || a.k > kRetrievalMaxK)
    throw std::invalid_argument(o + ": k: expected an int in [1, " + std::to_string(kRetrievalMaxK) + "], got " +
                                std::to_string(a.k));
  if (a.D < 1 || a.C < 0 || a.Q < 0)
    throw std::invalid_argument(o + ": bad sizes (C " + std::to_string(a.C) + ", D " + std::to_string(a.D) + ", Q " +
                                std::to_string(a.Q) + ")");
  if (a.C > kRetrievalMaxKeys) throw std::invalid_argument(o + ": more than 2^31 - 1 keys");
  if (a.key_dtype < static_cast<int>(DType::F32) || a.key_dtype > static_cast<int>(DType::BF16))
    throw std::invalid_argument(o + ": keys: expected float32, float16 or bfloat16, got code " +
                                std::to_string(a.key_dtype));
  if (a.query_dtype != a.key_dtype) throw std::invalid_argument(o + ": queries: expected the keys' dtype, got another");
  if (a.metric < kMetricIP || a.metric > kMetricL2)
    throw std::invalid_argument(o + ": unknown metric " + std::to_string(a.metric));
  if (a.C > 0 && a.key_dim != a.D)
    throw std::invalid_argument(o + ": keys have D = " + std::to_string(a.key_dim) +
                                ", queries D = " + std::to_string(a.D));
  // Named per argument: the Python op copies such layouts first (rapo_fast/retrieval/op.py), so this is reached only by
  // a direct call, whose caller must learn which tensor was refused.
  if (a.C > 1 && a.key_row_stride < a.D)
    throw std::invalid_argument(o + ": keys: row stride " + std::to_string(a.key_row_stride) +
                                " is smaller than D = " + std::to_string(a.D) + " (overlapping rows)");
  if (a.Q > 1 && a.query_row_stride < a.D)
    throw std::invalid_argument(o + ": queries: row stride " + std::to_string(a.query_row_stride) +
                                " is smaller than D = " + std::to_string(a.D) + " (overlapping rows)");
  if (a.Q == 0) return;
  if ((a.C > 0 && a.keys == nullptr) || a.queries == nullptr || a.out_scores == nullptr || a.out_slots == nullptr)
    throw std::invalid_argument(o + ": null pointer");
  const bool needs_aux = a.metric != kMetricIP && !(a.metric == kMetricL2 && a.centre != nullptr);
  if (needs_aux && a.C > 0 && (a.key_aux == nullptr || a.aux_len < a.C))
    throw std::out_of_range(o + ": key_aux has " + std::to_string(a.aux_len) + " entries for " + std::to_string(a.C) +
                            " keys");
  if (a.centre != nullptr && a.metric != kMetricL2)
    throw std::invalid_argument(o + ": a centre is for the l2 metric only");
  if (a.exclude != nullptr) {
    if (a.exclude_len != a.Q)
      throw std::out_of_range(o + ": exclude has " + std::to_string(a.exclude_len) + " entries for " +
                              std::to_string(a.Q) + " queries");
    if (a.C > 0 && (a.groups == nullptr || a.groups_len < a.C))
      throw std::out_of_range(o + ": groups has " + std::to_string(a.groups_len) + " entries for " +
                              std::to_string(a.C) + " keys");
  }
}

// CPU backend. num_threads <= 0: OpenMP's default. isa: -1 picks the best the CPU supports (the RAPO_FAST_CPU_ISA
// environment variable, "scalar" | "avx2" | "avx512", overrides it), 0 scalar, 1 AVX2+FMA+F16C, 2 AVX-512F.
void retrieval_search_cpu(const RetrievalSearchParams& a, int num_threads, int isa);

// Name of the micro-kernel the CPU backend would use for `isa` (-1: automatic choice) on this machine.
const char* retrieval_cpu_isa_name(int isa);

#ifdef RAPO_WITH_CUDA
// CUDA backend: a fused scoring + per-split top-k kernel writing ws_scores/ws_slots [n_splits, Q, k], then a merge.
// The workspace is allocated by the caller (torch's caching allocator) with n_splits from retrieval_cuda_splits.
void retrieval_search_cuda(const RetrievalSearchParams& a, float* ws_scores, int32_t* ws_slots, int n_splits,
                           int device, std::uintptr_t stream);
int retrieval_cuda_splits(int64_t Q, int64_t C, int k, int device);
#endif

}  // namespace rapo
