// pybind11 registration of the KV-splice backends: `kv_splice(params: dict)`, the dict built by
// rapo_fast/kv/splice.py (_launch_extension) with the fields of rapo::KVSpliceParams (csrc/include/rapo/rope.h).
// Not a place for argument validation beyond the checks that keep memory safe; Python validates first.
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "rapo/registry.h"
#include "rapo/rope.h"

namespace py = pybind11;

namespace rapo {
namespace {

template <typename T>
T field(const py::dict& d, const char* name) {
  if (!d.contains(name)) throw std::invalid_argument(std::string("kv_splice: missing parameter '") + name + "'");
  return d[name].cast<T>();
}

KVSpliceParams parse(const py::dict& d) {
  KVSpliceParams p;
  p.device = field<int>(d, "device");
  p.stream = field<int64_t>(d, "stream");
  p.dtype = static_cast<DType>(field<int>(d, "dtype"));
  p.interleaved = field<bool>(d, "interleaved");
  p.k_pool = field<int64_t>(d, "k_pool");
  p.v_pool = field<int64_t>(d, "v_pool");
  p.pool_layer_stride = field<int64_t>(d, "pool_layer_stride");
  p.pool_token_stride = field<int64_t>(d, "pool_token_stride");
  p.pool_head_stride = field<int64_t>(d, "pool_head_stride");
  p.dst_k_ptrs = field<int64_t>(d, "dst_k_ptrs");
  p.dst_v_ptrs = field<int64_t>(d, "dst_v_ptrs");
  p.k_row_stride = field<int64_t>(d, "k_row_stride");
  p.k_slot_stride = field<int64_t>(d, "k_slot_stride");
  p.k_head_stride = field<int64_t>(d, "k_head_stride");
  p.v_row_stride = field<int64_t>(d, "v_row_stride");
  p.v_slot_stride = field<int64_t>(d, "v_slot_stride");
  p.v_head_stride = field<int64_t>(d, "v_head_stride");
  p.num_layers = field<int>(d, "num_layers");
  p.num_heads = field<int>(d, "num_heads");
  p.head_dim = field<int>(d, "head_dim");
  p.rotary_dim = field<int>(d, "rotary_dim");
  p.inv_freq = field<int64_t>(d, "inv_freq");
  p.requests = field<int64_t>(d, "requests");
  p.num_requests = field<int64_t>(d, "num_requests");
  p.max_tokens = field<int64_t>(d, "max_tokens");
  p.block_table = field<int64_t>(d, "block_table");
  p.block_table_stride = field<int64_t>(d, "block_table_stride");
  p.block_size = field<int64_t>(d, "block_size");
  p.aligned16 = field<bool>(d, "aligned16");
  // Memory-safety checks only (Python has validated the values themselves).
  if (p.rotary_dim < 0 || p.rotary_dim % 2 || p.rotary_dim > p.head_dim)
    throw std::invalid_argument("kv_splice: rotary_dim must be even and <= head_dim");
  if (p.num_requests < 0 || p.max_tokens < 0 || p.num_layers <= 0 || p.num_heads <= 0)
    throw std::invalid_argument("kv_splice: bad sizes");
  if (p.block_table != 0 && p.block_size <= 0) throw std::invalid_argument("kv_splice: block_size must be > 0");
  return p;
}

void kv_splice(const py::dict& d) {
  const KVSpliceParams p = parse(d);
  if (p.num_requests == 0 || p.max_tokens == 0) return;
  if (p.device < 0) {
    py::gil_scoped_release release;
    kv_splice_cpu(p);
    return;
  }
#ifdef RAPO_WITH_CUDA
  kv_splice_cuda(p);
#else
  throw std::runtime_error("kv_splice: rapo_fast._C was built without its CUDA backend");
#endif
}

}  // namespace

void register_kv_splice(pybind11::module_& m) {
  m.def("kv_splice", &kv_splice, py::arg("params"),
        "Splice stored segments' K/V into a cache, keys re-rotated by RoPE (see rapo_fast/kv/splice.py).");
}

}  // namespace rapo
