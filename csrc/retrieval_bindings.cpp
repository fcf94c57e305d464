// pybind11 registration of the step-retrieval backends, in the binding convention of rapo/registry.h: the class
// RetrievalSearchParams (rapo/retrieval.h) filled by keyword in rapo_fast/retrieval/op.py, and one function per backend
// taking it, with the GIL released while a search runs.
// Not a place for math or for argument checks (rapo/retrieval.h: check_retrieval_params).
#include <cstdint>
#include <string>

#include "rapo/registry.h"
#include "rapo/retrieval.h"
#include "rapo/retrieval_cuda_plan.h"

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
  // The CUDA backend's host-side logic (rapo/retrieval_cuda_plan.h), bound in every build so that the CPU tests
  // check it: the split rule, its cost model, the split bounds and the merge's host instantiation.
  m.def("retrieval_cuda_plan", &retrieval_cuda_plan_splits, py::arg("Q"), py::arg("C"), py::arg("D"), py::arg("k"),
        py::arg("num_sms"), py::arg("blocks_per_sm") = 8, py::arg("elem_bytes") = 2,
        "Key splits the CUDA retrieval backend would use on num_sms SMs holding blocks_per_sm scoring blocks each.");
  m.def(
      "retrieval_cuda_plan_cost",
      [](int64_t Q, int64_t C, int64_t D, int k, int num_sms, int64_t n_splits, int blocks_per_sm, int elem_bytes) {
        const RetrievalCudaCost c = retrieval_cuda_cost(Q, C, D, k, num_sms, blocks_per_sm, elem_bytes, n_splits);
        return py::make_tuple(c.scan_ns, c.merge_ns);
      },
      py::arg("Q"), py::arg("C"), py::arg("D"), py::arg("k"), py::arg("num_sms"), py::arg("n_splits"),
      py::arg("blocks_per_sm") = 8, py::arg("elem_bytes") = 2,
      "(scan_ns, merge_ns) the split rule predicts for n_splits (private; tests).");
  m.def(
      "retrieval_cuda_split_bounds",
      [](int64_t n_splits, int64_t C) {
        if (n_splits < 1 || C < 0) throw std::invalid_argument("retrieval_cuda_split_bounds: n_splits >= 1, C >= 0");
        std::vector<int64_t> b(size_t(n_splits) + 1);
        for (int64_t s = 0; s <= n_splits; ++s) b[size_t(s)] = retrieval_split_key_begin(s, n_splits, C);
        return b;
      },
      py::arg("n_splits"), py::arg("C"), "First key of each CUDA split, and C (private; tests).");
  m.def(
      "retrieval_merge_splits_host",
      [](std::uintptr_t ws_scores, std::uintptr_t ws_slots, int n_splits, int64_t Q, int k, std::uintptr_t out_scores,
         std::uintptr_t out_slots) {
        py::gil_scoped_release nogil;
        retrieval_merge_splits_host(reinterpret_cast<float*>(ws_scores), reinterpret_cast<int32_t*>(ws_slots), n_splits,
                                    Q, k, reinterpret_cast<float*>(out_scores), reinterpret_cast<int64_t*>(out_slots));
      },
      py::arg("ws_scores"), py::arg("ws_slots"), py::arg("n_splits"), py::arg("Q"), py::arg("k"), py::arg("out_scores"),
      py::arg("out_slots"),
      "The CUDA merge kernel's work on the host: [n_splits, Q, k] float32 / int32 sorted lists (rewritten) into "
      "[Q, k] float32 / int64 (private; tests).");
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
  m.def(
      "retrieval_cuda_splits",
      [](int64_t Q, int64_t C, int k, int device, int64_t D, int dtype) {
        return retrieval_cuda_splits_for(Q, C, D, k, dtype, device);
      },
      py::arg("Q"), py::arg("C"), py::arg("k"), py::arg("device"), py::arg("D") = 0,
      py::arg("dtype") = static_cast<int>(DType::F16),
      "Number of key splits (workspace slices) the CUDA retrieval kernel uses for (Q, C, k, device) with keys of D "
      "elements (0: not given) of the dtype code `dtype`.");
#endif
}

}  // namespace rapo
