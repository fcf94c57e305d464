// The per-op registration hooks called from csrc/bindings.cpp (each defined in csrc/<op>_bindings.cpp) and the one
// binding convention every op follows (docs/extension.md):
//   - the op's parameter struct is a Python class with one named attribute per field, bound with ParamsClass below;
//     its FIELDS attribute lists them, and Python fills every field by keyword (rapo_fast/_ext.py make_params);
//   - each backend is one function `<op>_<backend>(params, *, <backend options>)`; it takes the struct by value and
//     releases the GIL while it runs; CUDA backends take `device` and `stream` (a raw cudaStream_t handle);
//   - pointers cross as integer addresses (torch's data_ptr()), already validated by the op's Python module.
// Not a place for math or op logic.
#pragma once
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "rapo/dtype.h"

namespace rapo {

void register_retrieval(pybind11::module_& m);
void register_kv_splice(pybind11::module_& m);

// Binds the parameter struct S as a Python class: plain fields as they are, pointer fields as integer addresses,
// DType fields as their integer codes. finish() sets FIELDS, the tuple of every bound name, in binding order.
template <class S>
class ParamsClass {
 public:
  ParamsClass(pybind11::module_& m, const char* name, const char* doc) : cls_(m, name, doc) {
    cls_.def(pybind11::init<>());
  }

  template <class F>
  ParamsClass& field(const char* name, F S::* member) {
    static_assert(!std::is_pointer<F>::value, "bind pointer fields with address()");
    cls_.def_readwrite(name, member);
    names_.emplace_back(name);
    return *this;
  }

  template <class P>
  ParamsClass& address(const char* name, P* S::* member) {
    cls_.def_property(
        name, [member](const S& s) { return reinterpret_cast<std::uintptr_t>(s.*member); },
        [member](S& s, std::uintptr_t v) { s.*member = reinterpret_cast<P*>(v); });
    names_.emplace_back(name);
    return *this;
  }

  ParamsClass& dtype(const char* name, DType S::* member) {
    cls_.def_property(
        name, [member](const S& s) { return static_cast<int>(s.*member); },
        [member](S& s, int code) { s.*member = static_cast<DType>(code); });
    names_.emplace_back(name);
    return *this;
  }

  void finish() { cls_.attr("FIELDS") = pybind11::tuple(pybind11::cast(names_)); }

 private:
  pybind11::class_<S> cls_;
  std::vector<std::string> names_;
};

}  // namespace rapo
