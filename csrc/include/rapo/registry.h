// Declarations of the per-op registration hooks called from csrc/bindings.cpp.
// Each is defined in csrc/<op>_bindings.cpp. Not a place for math (see the other headers in this folder).
#pragma once
#include <pybind11/pybind11.h>

namespace rapo {
void register_retrieval(pybind11::module_& m);
void register_kv_splice(pybind11::module_& m);
}  // namespace rapo
