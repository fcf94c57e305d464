// The one PYBIND11_MODULE of rapo_fast._C. Each op registers its backend functions from its own
// <op>_bindings.cpp, in the binding convention of rapo/registry.h (docs/extension.md), so that ops can be added
// without touching this file's logic; build facts are reported in BUILD_INFO (rapo_fast._ext.build_info()), and the
// shared constants this build was compiled with (rapo/constants.h, generated from rapo_fast/_constants.py) in CONSTANTS
// and as one module attribute each (_C.METRIC_IP, ...), so tests/test_shared_constants.py can compare them.
// Not the place for op logic or argument checks (each op's bindings check its tensors, rapo/tensor_arg.h).
#include <pybind11/pybind11.h>

#include "rapo/constants.h"
#include "rapo/registry.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "rapo_fast compiled backends (C++ CPU, CUDA when built). Private: use the rapo_fast Python API.";
  py::dict info;
#ifdef RAPO_WITH_CUDA
  info["cuda"] = true;
#else
  info["cuda"] = false;
#endif
  info["cuda_archs"] = std::string(RAPO_CUDA_ARCHS);
  info["cuda_switch"] = std::string(RAPO_CUDA_SWITCH);
  info["nvcc_found"] = RAPO_NVCC_FOUND != 0;
#ifdef RAPO_WITH_OPENMP
  info["openmp"] = true;
#else
  info["openmp"] = false;
#endif
  info["cpu"] = true;
  m.attr("BUILD_INFO") = info;
  py::dict constants;
  for (const auto& c : rapo::kIntConstants) {
    constants[c.name] = c.value;
    m.attr(c.name) = c.value;
  }
  for (const auto& c : rapo::kFloatConstants) {
    constants[c.name] = c.value;
    m.attr(c.name) = c.value;
  }
  m.attr("CONSTANTS") = constants;
  rapo::register_retrieval(m);
  rapo::register_kv_splice(m);
}
