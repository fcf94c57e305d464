// pybind11 registration of the step-retrieval backends. Tensors arrive as raw pointers (ints), sizes and dtype codes
// already validated by rapo_fast/retrieval/buffer.py; the GIL is released while a search runs.
// Not a place for math or for argument checks beyond the backends' own memory-safety checks.
#include <cstdint>

#include "rapo/registry.h"
#include "rapo/retrieval.h"

namespace py = pybind11;

namespace rapo {
namespace {

template <class T>
T* ptr(std::uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

RetrievalSearchArgs make_args(std::uintptr_t keys, int64_t key_row_stride, int key_dtype, std::uintptr_t key_aux,
                              std::uintptr_t groups, int64_t C, int64_t D, std::uintptr_t queries,
                              int64_t query_row_stride, int64_t Q, std::uintptr_t exclude, int k, int metric,
                              float min_score, std::uintptr_t out_scores, std::uintptr_t out_slots) {
  RetrievalSearchArgs a;
  a.keys = ptr<const void>(keys);
  a.key_row_stride = key_row_stride;
  a.key_dtype = key_dtype;
  a.key_aux = ptr<const float>(key_aux);
  a.groups = ptr<const int64_t>(groups);
  a.C = C;
  a.D = D;
  a.queries = ptr<const void>(queries);
  a.query_row_stride = query_row_stride;
  a.Q = Q;
  a.exclude = ptr<const int64_t>(exclude);
  a.k = k;
  a.metric = metric;
  a.min_score = min_score;
  a.out_scores = ptr<float>(out_scores);
  a.out_slots = ptr<int64_t>(out_slots);
  return a;
}

}  // namespace

void register_retrieval(py::module_& m) {
  m.def(
      "retrieval_search_cpu",
      [](std::uintptr_t keys, int64_t key_row_stride, int key_dtype, std::uintptr_t key_aux, std::uintptr_t groups,
         int64_t C, int64_t D, std::uintptr_t queries, int64_t query_row_stride, int64_t Q, std::uintptr_t exclude,
         int k, int metric, float min_score, std::uintptr_t out_scores, std::uintptr_t out_slots, int num_threads,
         int isa) {
        const RetrievalSearchArgs a = make_args(keys, key_row_stride, key_dtype, key_aux, groups, C, D, queries,
                                                query_row_stride, Q, exclude, k, metric, min_score, out_scores,
                                                out_slots);
        py::gil_scoped_release nogil;
        retrieval_search_cpu(a, num_threads, isa);
      },
      "Exact top-k retrieval on the CPU (private; use rapo_fast.StepBuffer).");
  m.def(
      "retrieval_cpu_isa", [](int isa) { return std::string(retrieval_cpu_isa_name(isa)); }, py::arg("isa") = -1,
      "Micro-kernel the CPU retrieval backend uses on this machine (scalar, avx2 or avx512).");
#ifdef RAPO_WITH_CUDA
  m.def(
      "retrieval_search_cuda",
      [](std::uintptr_t keys, int64_t key_row_stride, int key_dtype, std::uintptr_t key_aux, std::uintptr_t groups,
         int64_t C, int64_t D, std::uintptr_t queries, int64_t query_row_stride, int64_t Q, std::uintptr_t exclude,
         int k, int metric, float min_score, std::uintptr_t out_scores, std::uintptr_t out_slots,
         std::uintptr_t ws_scores, std::uintptr_t ws_slots, int n_splits, int device, std::uintptr_t stream) {
        const RetrievalSearchArgs a = make_args(keys, key_row_stride, key_dtype, key_aux, groups, C, D, queries,
                                                query_row_stride, Q, exclude, k, metric, min_score, out_scores,
                                                out_slots);
        py::gil_scoped_release nogil;
        retrieval_search_cuda(a, ptr<float>(ws_scores), ptr<int32_t>(ws_slots), n_splits, device, stream);
      },
      "Exact top-k retrieval on a CUDA device, on the given stream (private; use rapo_fast.StepBuffer).");
  m.def("retrieval_cuda_splits", &retrieval_cuda_splits,
        "Number of key splits (workspace slices) the CUDA retrieval kernel uses for (Q, C, k, device).");
#endif
}

}  // namespace rapo
