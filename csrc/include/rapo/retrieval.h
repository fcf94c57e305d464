// Host-side interface of the step-retrieval backends (csrc/retrieval_cpu.cpp, csrc/retrieval_cuda.cu), called from
// csrc/retrieval_bindings.cpp. Python (rapo_fast/retrieval/buffer.py) has validated every shape, dtype and device
// before these run; the backends' own checks only keep memory safe. The search's contract is written in
// docs/retrieval.md. Not a place for math (retrieval_metric.h, topk.h).
#pragma once
#include <cstdint>

namespace rapo {

// One exact top-k search of Q queries against the first C stored keys.
struct RetrievalSearchParams {
  const void* keys = nullptr;  // [C, D] rows of key_dtype, inner stride 1, row stride key_row_stride
  int64_t key_row_stride = 0;
  int key_dtype = 0;                // DType code: F32, F16 or BF16
  const float* key_aux = nullptr;   // [C] fp32 (cosine: inverse norm, l2: squared norm); unused for ip
  const int64_t* groups = nullptr;  // [C] group id of each slot; read only when exclude is given
  int64_t C = 0;
  int64_t D = 0;
  const void* queries = nullptr;  // [Q, D] rows of key_dtype (rounded to the buffer dtype by the caller)
  int64_t query_row_stride = 0;
  int64_t Q = 0;
  const int64_t* exclude = nullptr;  // [Q] group to exclude per query (negative: none), or nullptr
  int k = 1;
  int metric = 0;                // RetrievalMetric
  float min_score = 0.0f;        // candidates with score < min_score are not eligible (-inf: no threshold)
  float* out_scores = nullptr;   // [Q, k] contiguous, best first, -inf padding
  int64_t* out_slots = nullptr;  // [Q, k] contiguous, -1 padding
};

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
