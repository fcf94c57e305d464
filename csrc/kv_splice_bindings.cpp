// pybind11 registration of the KV-splice backends, in the binding convention of rapo/registry.h: the class
// KVSpliceParams (rapo/kv_splice.h) filled by keyword in rapo_fast/kv/splice.py, and one function per backend taking
// it, with the GIL released while a splice runs.
// Not a place for argument validation: Python validates first, rapo/kv_splice.h keeps memory safe.
#include <cstdint>

#include "rapo/kv_splice.h"
#include "rapo/registry.h"

namespace py = pybind11;

namespace rapo {

void register_kv_splice(py::module_& m) {
  using P = KVSpliceParams;
  ParamsClass<P>(m, "KVSpliceParams", "One splice of stored K/V segments into a cache (rapo/kv_splice.h); private.")
      .dtype("dtype", &P::dtype)
      .field("interleaved", &P::interleaved)
      .address("k_pool", &P::k_pool)
      .address("v_pool", &P::v_pool)
      .field("pool_layer_stride", &P::pool_layer_stride)
      .field("pool_token_stride", &P::pool_token_stride)
      .field("pool_head_stride", &P::pool_head_stride)
      .address("dst_k_ptrs", &P::dst_k_ptrs)
      .address("dst_v_ptrs", &P::dst_v_ptrs)
      .field("k_row_stride", &P::k_row_stride)
      .field("k_slot_stride", &P::k_slot_stride)
      .field("k_head_stride", &P::k_head_stride)
      .field("v_row_stride", &P::v_row_stride)
      .field("v_slot_stride", &P::v_slot_stride)
      .field("v_head_stride", &P::v_head_stride)
      .field("num_layers", &P::num_layers)
      .field("num_heads", &P::num_heads)
      .field("head_dim", &P::head_dim)
      .field("rotary_dim", &P::rotary_dim)
      .address("inv_freq", &P::inv_freq)
      .address("requests", &P::requests)
      .field("num_requests", &P::num_requests)
      .field("max_tokens", &P::max_tokens)
      .address("block_table", &P::block_table)
      .field("block_table_stride", &P::block_table_stride)
      .field("block_size", &P::block_size)
      .field("aligned16", &P::aligned16)
      .field("pool_tokens", &P::pool_tokens)
      .field("dst_rows", &P::dst_rows)
      .field("dst_slots", &P::dst_slots)
      .field("dst_heads", &P::dst_heads)
      .field("dst_head_dim", &P::dst_head_dim)
      .field("block_table_rows", &P::block_table_rows)
      .field("block_table_cols", &P::block_table_cols)
      .address("requests_host", &P::requests_host)
      .address("block_table_host", &P::block_table_host)
      .finish();
  m.def(
      "kv_splice_cpu",
      [](P params) {
        py::gil_scoped_release nogil;
        kv_splice_cpu(params);
      },
      py::arg("params"), "Splice stored segments' K/V into a CPU cache, keys re-rotated by RoPE (private).");
#ifdef RAPO_WITH_CUDA
  m.def(
      "kv_splice_cuda",
      [](P params, int device, std::uintptr_t stream) {
        py::gil_scoped_release nogil;
        kv_splice_cuda(params, device, stream);
      },
      py::arg("params"), py::kw_only(), py::arg("device"), py::arg("stream"),
      "Splice stored segments' K/V into a CUDA cache on the given stream, keys re-rotated by RoPE (private).");
#endif
}

}  // namespace rapo
