// pybind11 registration of the step-retrieval backends, in the binding convention of rapo/registry.h: each backend is
// one function taking the search's tensors (DLPack, rapo/tensor_arg.h) and its scalars by keyword; the tensors are
// checked here, where their pointers are taken (rank, shape, dtype, device, strides: search_args), the extents again by
// the backends (check_retrieval_params, rapo/retrieval.h), and the GIL is released while a search runs.
// Not a place for math.
#include <cstdint>
#include <string>
#include <vector>

#include "rapo/registry.h"
#include "rapo/retrieval.h"
#include "rapo/retrieval_cuda_plan.h"
#include "rapo/tensor_arg.h"

namespace py = pybind11;

namespace rapo {

namespace {

// The tensors of one search, kept (and their DLPack capsules owned) for the call, and the parameter block the
// backends read, filled from them.
struct SearchArgs {
  TensorArg keys, key_aux, groups, queries, exclude, centre, out_scores, out_slots;
  RetrievalSearchParams p;
};

// Checks every tensor of a search against `dev` and against each other (dtype, rank, device, layout, output shapes)
// and fills the parameter block; the extents it holds are checked again by the backend (check_retrieval_params).
void search_args(SearchArgs& a, const char* op, DLDevice dev, py::handle k, py::handle metric, double min_score) {
  RetrievalSearchParams& p = a.p;
  p.k = int_arg<int>(k, op, "k");
  p.metric = int_arg<int>(metric, op, "metric");
  p.min_score = static_cast<float>(min_score);
  const DType dt = a.keys.dims(2, "[C, D]").float_dtype();
  a.keys.on(dev).unit_inner_stride();
  a.queries.dims(2, "[Q, D]").same_dtype(a.keys).on(dev).unit_inner_stride();
  p.C = a.keys.size(0), p.key_dim = a.keys.size(1), p.Q = a.queries.size(0), p.D = a.queries.size(1);
  a.key_aux.dims(1, "[C]").dtype(DType::F32).on(dev).contiguous();
  a.groups.dims(1, "[C]").dtype(DType::I64).on(dev).contiguous();
  if (a.exclude.given()) a.exclude.dims(1, "[Q]").dtype(DType::I64).on(dev).contiguous();
  if (a.centre.given()) a.centre.dims(1, "[D]").dtype(DType::F32).on(dev).contiguous().size_is(0, p.D, "D");
  for (TensorArg* out : {&a.out_scores, &a.out_slots}) {
    out->dims(2, "[Q, k]").dtype(out == &a.out_scores ? DType::F32 : DType::I64).on(dev).contiguous().writable();
    out->size_is(0, p.Q, "Q").size_is(1, p.k, "k");
  }
  p.keys = a.keys.data(), p.key_row_stride = p.C ? a.keys.stride(0) : p.D, p.key_dtype = static_cast<int>(dt);
  p.queries = a.queries.data(), p.query_row_stride = p.Q ? a.queries.stride(0) : p.D, p.query_dtype = p.key_dtype;
  p.key_aux = a.key_aux.data<const float>(), p.aux_len = a.key_aux.numel();
  p.groups = a.groups.data<const int64_t>(), p.groups_len = a.groups.numel();
  p.exclude = a.exclude.data<const int64_t>(), p.exclude_len = a.exclude.given() ? a.exclude.numel() : 0;
  p.centre = a.centre.data<const float>();
  p.out_scores = a.out_scores.data<float>(), p.out_slots = a.out_slots.data<int64_t>();
}

// The tensors of a search in the order of the entry points' arguments (exclude and centre may be None).
SearchArgs take_search_tensors(const char* op, py::handle keys, py::handle key_aux, py::handle groups,
                               py::handle queries, py::handle exclude, py::handle centre, py::handle out_scores,
                               py::handle out_slots) {
  return SearchArgs{TensorArg(keys, op, "keys"),
                    TensorArg(key_aux, op, "key_aux"),
                    TensorArg(groups, op, "groups"),
                    TensorArg(queries, op, "queries"),
                    TensorArg(exclude, op, "exclude", true),
                    TensorArg(centre, op, "centre", true),
                    TensorArg(out_scores, op, "out_scores"),
                    TensorArg(out_slots, op, "out_slots"),
                    {}};
}

}  // namespace

void register_retrieval(py::module_& m) {
  m.def(
      "retrieval_search_cpu",
      [](py::handle keys, py::handle key_aux, py::handle groups, py::handle queries, py::handle exclude,
         py::handle centre, py::handle out_scores, py::handle out_slots, py::handle k, py::handle metric,
         double min_score, py::handle num_threads, py::handle isa) {
        const char* op = "retrieval_search_cpu";
        SearchArgs a = take_search_tensors(op, keys, key_aux, groups, queries, exclude, centre, out_scores, out_slots);
        search_args(a, op, DLDevice{kDLCPU, 0}, k, metric, min_score);
        const int threads = int_arg<int>(num_threads, op, "num_threads"), cpu_isa = int_arg<int>(isa, op, "isa");
        py::gil_scoped_release nogil;
        retrieval_search_cpu(a.p, threads, cpu_isa);
      },
      py::arg("keys"), py::arg("key_aux"), py::arg("groups"), py::arg("queries"), py::arg("exclude"), py::arg("centre"),
      py::arg("out_scores"), py::arg("out_slots"), py::kw_only(), py::arg("k"), py::arg("metric"), py::arg("min_score"),
      py::arg("num_threads"), py::arg("isa"),
      "Exact top-k retrieval on the CPU (private; use rapo_fast.StepBuffer). Tensors (DLPack capsules or objects with "
      "__dlpack__), all on the CPU: keys [C, D] float32/float16/bfloat16 with a unit inner stride, key_aux [C] "
      "float32, "
      "groups [C] int64, queries [Q, D] of the keys' dtype, exclude [Q] int64 or None, centre [D] float32 or None, "
      "out_scores [Q, k] float32 and out_slots [Q, k] int64 (contiguous, written).");
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
      [](py::handle ws_scores, py::handle ws_slots, py::handle out_scores, py::handle out_slots) {
        const char* op = "retrieval_merge_splits_host";
        const DLDevice cpu{kDLCPU, 0};
        TensorArg wss(ws_scores, op, "ws_scores"), wsi(ws_slots, op, "ws_slots");
        TensorArg os(out_scores, op, "out_scores"), oi(out_slots, op, "out_slots");
        wss.dims(3, "[n_splits, Q, k]").dtype(DType::F32).on(cpu).contiguous().writable();
        wsi.dims(3, "[n_splits, Q, k]").dtype(DType::I32).on(cpu).contiguous().writable().same_shape(wss);
        const int64_t n = wss.size(0), Q = wss.size(1), k = wss.size(2);
        os.dims(2, "[Q, k]").dtype(DType::F32).on(cpu).contiguous().writable().size_is(0, Q, "Q").size_is(1, k, "k");
        oi.dims(2, "[Q, k]").dtype(DType::I64).on(cpu).contiguous().writable().same_shape(os);
        if (n > kRetrievalMaxSplits || k > kRetrievalMaxK)  // the merge's own check, before the narrowing to int
          throw std::invalid_argument(std::string(op) + ": ws_scores: expected n_splits and k in [1, " +
                                      std::to_string(kRetrievalMaxSplits) + "] and [1, " +
                                      std::to_string(kRetrievalMaxK) + "], got shape " + wss.shape_str());
        py::gil_scoped_release nogil;
        retrieval_merge_splits_host(wss.data<float>(), wsi.data<int32_t>(), int(n), Q, int(k), os.data<float>(),
                                    oi.data<int64_t>());
      },
      py::arg("ws_scores"), py::arg("ws_slots"), py::arg("out_scores"), py::arg("out_slots"),
      "The CUDA merge kernel's work on the host: ws_scores / ws_slots [n_splits, Q, k] float32 / int32 sorted lists "
      "(rewritten) into out_scores / out_slots [Q, k] float32 / int64; CPU tensors (private; tests).");
#ifdef RAPO_WITH_CUDA
  m.def(
      "retrieval_search_cuda",
      [](py::handle keys, py::handle key_aux, py::handle groups, py::handle queries, py::handle exclude,
         py::handle centre, py::handle out_scores, py::handle out_slots, py::handle ws_scores, py::handle ws_slots,
         py::handle k, py::handle metric, double min_score, py::handle device, std::uintptr_t stream) {
        const char* op = "retrieval_search_cuda";
        SearchArgs a = take_search_tensors(op, keys, key_aux, groups, queries, exclude, centre, out_scores, out_slots);
        TensorArg wss(ws_scores, op, "ws_scores"), wsi(ws_slots, op, "ws_slots");
        const DLDevice dev{kDLCUDA, int_arg<int32_t>(device, op, "device")};
        search_args(a, op, dev, k, metric, min_score);
        wss.dims(3, "[n_splits, Q, k]").dtype(DType::F32).on(dev).contiguous().writable();
        wss.size_is(1, a.p.Q, "Q").size_is(2, a.p.k, "k");
        wsi.dims(3, "[n_splits, Q, k]").dtype(DType::I32).on(dev).contiguous().writable().same_shape(wss);
        if (wss.size(0) > kRetrievalMaxSplits)  // retrieval_search_cuda's own check, before the narrowing to int
          throw std::invalid_argument(std::string(op) + ": ws_scores: more than " +
                                      std::to_string(kRetrievalMaxSplits) + " splits, got shape " + wss.shape_str());
        py::gil_scoped_release nogil;
        retrieval_search_cuda(a.p, wss.data<float>(), wsi.data<int32_t>(), int(wss.size(0)), dev.device_id, stream);
      },
      py::arg("keys"), py::arg("key_aux"), py::arg("groups"), py::arg("queries"), py::arg("exclude"), py::arg("centre"),
      py::arg("out_scores"), py::arg("out_slots"), py::arg("ws_scores"), py::arg("ws_slots"), py::kw_only(),
      py::arg("k"), py::arg("metric"), py::arg("min_score"), py::arg("device"), py::arg("stream"),
      "Exact top-k retrieval on a CUDA device, on the given stream (private; use rapo_fast.StepBuffer). Tensors as "
      "retrieval_search_cpu's, all on cuda:device, plus the workspace ws_scores / ws_slots [n_splits, Q, k] float32 / "
      "int32 (n_splits from retrieval_cuda_splits); centre None.");
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
