// The per-op registration hooks called from csrc/bindings.cpp (each defined in csrc/<op>_bindings.cpp) and the one
// binding convention every op follows (docs/extension.md):
//   - each backend is one function `<op>_<backend>(<tensors>, *, <scalars and backend options>)`;
//   - tensors cross as DLPack (a capsule from torch.utils.dlpack.to_dlpack, or any object with __dlpack__), read
//     into rapo/tensor_arg.h's TensorArg and checked there by the bindings, next to the pointers they take (rank,
//     shape, dtype, device, strides), with a TypeError / ValueError naming the argument; the bindings then fill the
//     op's parameter struct (rapo/<op>.h) from them, whose extents the backends check again before touching memory;
//   - scalars are keyword arguments; CUDA backends take `device` and `stream` (a raw cudaStream_t handle);
//   - the GIL is released while a backend runs.
// Not a place for math or op logic.
#pragma once
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

namespace rapo {

void register_retrieval(pybind11::module_& m);
void register_kv_splice(pybind11::module_& m);

}  // namespace rapo
