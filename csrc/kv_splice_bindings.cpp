// pybind11 registration of the KV-splice backends, in the binding convention of rapo/registry.h: each backend is one
// function taking the splice's tensors (DLPack, rapo/tensor_arg.h; the cache layers as lists) and its scalars by
// keyword; the tensors are checked here, where their pointers are taken (rank, shape, dtype, device, strides:
// splice_args), every index the kernels dereference by the backends (check_kv_splice_params, rapo/kv_splice.h), and
// the GIL is released while a splice runs.
// Not a place for argument validation of values (rapo_fast/kv/splice.py validates first) or for the rotation math.
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "rapo/kv_splice.h"
#include "rapo/registry.h"
#include "rapo/tensor_arg.h"

namespace py = pybind11;

namespace rapo {

namespace {

// The tensors of one splice, kept (and their DLPack capsules owned) for the call, the parameter block the backends
// read, filled from them, and the layers' addresses: ptrs [2, num_layers], each key cache's, then each value cache's.
struct SpliceArgs {
  std::vector<TensorArg> keys, values;
  TensorArg k_pool, v_pool, requests, inv_freq, block_table;
  TensorArg requests_host, block_table_host;  // the CUDA backend's host copies (the CPU backend reads the originals)
  KVSpliceParams p;
  std::vector<int64_t> ptrs;
};

std::vector<TensorArg> take_layers(py::handle layers, const char* op, const char* name) {
  if (!py::isinstance<py::sequence>(layers) || py::isinstance<py::str>(layers))
    throw py::type_error(std::string(op) + ": " + name + ": expected a list of tensors (one per layer), got " +
                         py_type_name(layers));
  std::vector<TensorArg> out;
  const py::sequence seq = py::reinterpret_borrow<py::sequence>(layers);
  for (size_t i = 0; i < seq.size(); ++i)
    out.emplace_back(seq[i], op, std::string(name) + "[" + std::to_string(i) + "]");
  return out;
}

SpliceArgs take_splice_tensors(const char* op, py::handle keys, py::handle values, py::handle k_pool, py::handle v_pool,
                               py::handle requests, py::handle inv_freq, py::handle block_table) {
  return SpliceArgs{take_layers(keys, op, "keys"),
                    take_layers(values, op, "values"),
                    TensorArg(k_pool, op, "k_pool"),
                    TensorArg(v_pool, op, "v_pool"),
                    TensorArg(requests, op, "requests"),
                    TensorArg(inv_freq, op, "inv_freq"),
                    TensorArg(block_table, op, "block_table", true),
                    {},
                    {},
                    {},
                    {}};
}

int narrow_extent(int64_t v, const char* op, const char* what) {
  if (v > std::numeric_limits<int>::max())
    throw std::invalid_argument(std::string(op) + ": " + what + " " + std::to_string(v) + " does not fit int32");
  return static_cast<int>(v);
}

// The pools and the cache layers: one dtype (float32, float16 or bfloat16), one device, 4-d, head dim contiguous;
// the pools share a shape and strides, the layers one shape and, per kind, one set of strides.
void check_pools_and_layers(SpliceArgs& a, const char* op, DLDevice dev) {
  a.k_pool.dims(4, "[num_layers, capacity, num_heads, head_dim]").float_dtype();
  a.k_pool.on(dev).unit_inner_stride();
  a.v_pool.dims(4, "[num_layers, capacity, num_heads, head_dim]").same_dtype(a.k_pool).on(dev);
  a.v_pool.same_shape(a.k_pool).same_strides(a.k_pool);
  const int64_t L = a.k_pool.size(0);
  if (int64_t(a.keys.size()) != L || int64_t(a.values.size()) != L)
    throw py::value_error(std::string(op) + ": keys/values: expected one tensor per layer of k_pool (" +
                          std::to_string(L) + "), got " + std::to_string(a.keys.size()) + " and " +
                          std::to_string(a.values.size()));
  for (std::vector<TensorArg>* layers : {&a.keys, &a.values}) {
    for (TensorArg& t : *layers) {
      t.dims(4, "[B, H, S, D] or [num_blocks, block_size, H, D]").same_dtype(a.k_pool).on(dev).unit_inner_stride();
      t.same_shape(a.keys[0]).same_strides((*layers)[0]).writable();
    }
  }
}

// The cache layout fields of p: HF [B, H, S, D] without a block table, paged [num_blocks, block_size, H, D] with one.
void fill_layout(SpliceArgs& a, KVSpliceParams& p) {
  const TensorArg &k0 = a.keys[0], &v0 = a.values[0];
  const bool paged = a.block_table.given();
  const int slot_dim = paged ? 1 : 2, head_dim = paged ? 2 : 1;
  p.k_row_stride = k0.stride(0), p.k_slot_stride = k0.stride(slot_dim), p.k_head_stride = k0.stride(head_dim);
  p.v_row_stride = v0.stride(0), p.v_slot_stride = v0.stride(slot_dim), p.v_head_stride = v0.stride(head_dim);
  p.dst_rows = k0.size(0), p.dst_slots = k0.size(slot_dim), p.dst_heads = k0.size(head_dim);
  p.dst_head_dim = k0.size(3);
  if (!paged) return;
  p.block_table = a.block_table.data<const int32_t>(), p.block_table_stride = a.block_table.stride(0);
  p.block_size = k0.size(1), p.block_table_rows = a.block_table.size(0), p.block_table_cols = a.block_table.size(1);
}

// Checks every tensor of a splice against `dev` and against each other and fills the parameter block (the host
// copies of requests and block table must be taken, or be the originals, before); the indices the requests hold are
// checked by the backend (check_kv_splice_params).
void splice_args(SpliceArgs& a, const char* op, DLDevice dev, bool interleaved, py::handle max_tokens) {
  check_pools_and_layers(a, op, dev);
  a.requests.dims(2, "[R, fields]").dtype(DType::I64).on(dev).contiguous();
  a.requests.size_is(1, kKVRequestFields, "fields per request");
  a.inv_freq.dims(1, "[rotary_dim / 2]").dtype(DType::F32).on(dev).contiguous();
  if (a.block_table.given()) a.block_table.dims(2, "[B, max_blocks]").dtype(DType::I32).on(dev).unit_inner_stride();
  KVSpliceParams& p = a.p;
  p.max_tokens = int_arg<int64_t>(max_tokens, op, "max_tokens");
  p.dtype = a.k_pool.float_dtype(), p.interleaved = interleaved;
  p.k_pool = a.k_pool.data(), p.v_pool = a.v_pool.data();
  p.pool_layer_stride = a.k_pool.stride(0), p.pool_token_stride = a.k_pool.stride(1);
  p.pool_head_stride = a.k_pool.stride(2), p.pool_tokens = a.k_pool.size(1);
  p.num_layers = narrow_extent(a.k_pool.size(0), op, "num_layers");
  p.num_heads = narrow_extent(a.k_pool.size(2), op, "num_heads");
  p.head_dim = narrow_extent(a.k_pool.size(3), op, "head_dim");
  p.rotary_dim = narrow_extent(2 * a.inv_freq.numel(), op, "rotary_dim");
  p.inv_freq = a.inv_freq.data<const float>();
  p.requests = a.requests.data<const int64_t>(), p.num_requests = a.requests.size(0);
  fill_layout(a, p);
  const TensorArg& req_host = a.requests_host.given() ? a.requests_host : a.requests;
  const TensorArg& bt_host = a.block_table_host.given() ? a.block_table_host : a.block_table;
  p.requests_host = req_host.data<const int64_t>(), p.block_table_host = bt_host.data<const int32_t>();
  bool aligned =
      reinterpret_cast<std::uintptr_t>(p.k_pool) % 16 == 0 && reinterpret_cast<std::uintptr_t>(p.v_pool) % 16 == 0;
  a.ptrs.resize(2 * a.keys.size());
  for (size_t l = 0; l < a.keys.size(); ++l) {
    a.ptrs[l] = reinterpret_cast<int64_t>(a.keys[l].data());
    a.ptrs[a.keys.size() + l] = reinterpret_cast<int64_t>(a.values[l].data());
  }
  for (int64_t addr : a.ptrs) aligned = aligned && addr % 16 == 0;
  p.aligned16 = aligned;
}

}  // namespace

void register_kv_splice(py::module_& m) {
  m.def(
      "kv_splice_cpu",
      [](py::handle keys, py::handle values, py::handle k_pool, py::handle v_pool, py::handle requests,
         py::handle inv_freq, py::handle block_table, bool interleaved, py::handle max_tokens) {
        const char* op = "kv_splice_cpu";
        SpliceArgs a = take_splice_tensors(op, keys, values, k_pool, v_pool, requests, inv_freq, block_table);
        splice_args(a, op, DLDevice{kDLCPU, 0}, interleaved, max_tokens);
        a.p.dst_k_ptrs = a.ptrs.data(), a.p.dst_v_ptrs = a.ptrs.data() + a.keys.size();
        py::gil_scoped_release nogil;
        kv_splice_cpu(a.p);
      },
      py::arg("keys"), py::arg("values"), py::arg("k_pool"), py::arg("v_pool"), py::arg("requests"),
      py::arg("inv_freq"), py::arg("block_table"), py::kw_only(), py::arg("interleaved"), py::arg("max_tokens"),
      "Splice stored segments' K/V into a CPU cache, keys re-rotated by RoPE (private; use rapo_fast.splice_kv). "
      "Tensors (DLPack capsules or objects with __dlpack__), all on the CPU: keys / values lists of one cache tensor "
      "per layer (written), HF [B, H, S, D] or, with block_table [B, max_blocks] int32, paged [num_blocks, "
      "block_size, H, D]; k_pool / v_pool [num_layers, capacity, H, D] of the caches' dtype; requests [R, 5] int64; "
      "inv_freq [rotary_dim / 2] float32.");
#ifdef RAPO_WITH_CUDA
  m.def(
      "kv_splice_cuda",
      [](py::handle keys, py::handle values, py::handle k_pool, py::handle v_pool, py::handle requests,
         py::handle inv_freq, py::handle block_table, py::handle requests_host, py::handle block_table_host,
         py::handle dst_ptrs, bool interleaved, py::handle max_tokens, py::handle device, std::uintptr_t stream) {
        const char* op = "kv_splice_cuda";
        SpliceArgs a = take_splice_tensors(op, keys, values, k_pool, v_pool, requests, inv_freq, block_table);
        a.requests_host = TensorArg(requests_host, op, "requests_host");
        a.block_table_host = TensorArg(block_table_host, op, "block_table_host", true);
        TensorArg ptrs(dst_ptrs, op, "dst_ptrs");
        const DLDevice dev{kDLCUDA, int_arg<int32_t>(device, op, "device")};
        splice_args(a, op, dev, interleaved, max_tokens);
        a.requests_host.on_host().dtype(DType::I64).contiguous().same_shape(a.requests);
        if (a.block_table.given() != a.block_table_host.given())
          throw py::value_error(std::string(op) +
                                ": block_table_host: expected exactly when block_table is given, got " +
                                (a.block_table_host.given() ? "one without" : "none with") + " block_table");
        if (a.block_table.given())
          a.block_table_host.on_host().dtype(DType::I32).same_shape(a.block_table).same_strides(a.block_table);
        ptrs.dims(2, "[2, num_layers]").dtype(DType::I64).on(dev).contiguous().writable();
        ptrs.size_is(0, 2, "2").size_is(1, a.k_pool.size(0), "num_layers");
        py::gil_scoped_release nogil;
        kv_splice_cuda(a.p, a.ptrs.data(), ptrs.data<int64_t>(), dev.device_id, stream);
      },
      py::arg("keys"), py::arg("values"), py::arg("k_pool"), py::arg("v_pool"), py::arg("requests"),
      py::arg("inv_freq"), py::arg("block_table"), py::arg("requests_host"), py::arg("block_table_host"),
      py::arg("dst_ptrs"), py::kw_only(), py::arg("interleaved"), py::arg("max_tokens"), py::arg("device"),
      py::arg("stream"),
      "Splice stored segments' K/V into a CUDA cache on the given stream, keys re-rotated by RoPE (private). Tensors "
      "as kv_splice_cpu's, on cuda:device, plus host copies of requests and block_table (read by the index checks) "
      "and dst_ptrs [2, num_layers] int64 on the device, into which the layers' addresses are copied on the stream "
      "(keep it alive until the kernel has run).");
#endif
}

}  // namespace rapo
