// pybind11 registration of the step-retrieval backends, in the binding convention of rapo/registry.h: the class
// RetrievalSearchParams (rapo/retrieval.h) filled by keyword in rapo_fast/retrieval/op.py, and one function per backend
// taking it, with the GIL released while a search runs.
// Not a place for math or for argument checks (rapo/retrieval.h: check_retrieval_params).
#include <cstdint>
#include <string>

#include "rapo/registry.h"
#include "rapo/retrieval.h"

namespace py = pybind11;

namespace rapo {

void register_retrieval(py::module_& m) {
  using P = RetrievalSearchParams;
  ParamsClass<P>(m, "RetrievalSearchParams", "One exact top-k search (rapo/retrieval.h); private.")
      .address("keys", &P::keys)
      .field("key_row_stride", &P::key_row_stride)
      .field("key_dtype", &P::key_dtype)
      .address("key_aux", &P::key_aux)
      .address("groups", &P::groups)
      .field("C", &P::C)
      .field("D", &P::D)
      .field("key_dim", &P::key_dim)
      .field("aux_len", &P::aux_len)
      .field("groups_len", &P::groups_len)
      .address("queries", &P::queries)
      .field("query_dtype", &P::query_dtype)
      .field("query_row_stride", &P::query_row_stride)
      .field("Q", &P::Q)
      .address("exclude", &P::exclude)
      .field("exclude_len", &P::exclude_len)
      .address("centre", &P::centre)
      .field("k", &P::k)
      .field("metric", &P::metric)
      .field("min_score", &P::min_score)
      .address("out_scores", &P::out_scores)
      .address("out_slots", &P::out_slots)
      .finish();
  m.def(
      "retrieval_search_cpu",
      [](P params, int num_threads, int isa) {
        py::gil_scoped_release nogil;
        retrieval_search_cpu(params, num_threads, isa);
      },
      py::arg("params"), py::kw_only(), py::arg("num_threads"), py::arg("isa"),
      "Exact top-k retrieval on the CPU (private; use rapo_fast.StepBuffer).");
  m.def(
      "retrieval_cpu_isa", [](int isa) { return std::string(retrieval_cpu_isa_name(isa)); }, py::arg("isa") = -1,
      "Micro-kernel the CPU retrieval backend uses on this machine (scalar, avx2 or avx512).");
#ifdef RAPO_WITH_CUDA
  m.def(
      "retrieval_search_cuda",
      [](P params, std::uintptr_t ws_scores, std::uintptr_t ws_slots, int n_splits, int device, std::uintptr_t stream) {
        py::gil_scoped_release nogil;
        retrieval_search_cuda(params, reinterpret_cast<float*>(ws_scores), reinterpret_cast<int32_t*>(ws_slots),
                              n_splits, device, stream);
      },
      py::arg("params"), py::kw_only(), py::arg("ws_scores"), py::arg("ws_slots"), py::arg("n_splits"),
      py::arg("device"), py::arg("stream"),
      "Exact top-k retrieval on a CUDA device, on the given stream (private; use rapo_fast.StepBuffer).");
  m.def("retrieval_cuda_splits", &retrieval_cuda_splits, py::arg("Q"), py::arg("C"), py::arg("k"), py::arg("device"),
        "Number of key splits (workspace slices) the CUDA retrieval kernel uses for (Q, C, k, device).");
#endif
}

}  // namespace rapo
