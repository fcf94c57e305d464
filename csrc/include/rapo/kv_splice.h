// Host-side interface of the KV-splice backends (csrc/kv_splice_cpu.cpp, csrc/kv_splice_cuda.cu), called from
// csrc/kv_splice_bindings.cpp: the parameter block, the destination addressing both backends share, and the checks
// that keep memory safe. Python (rapo_fast/kv/splice.py) has validated ids, ranges, dtypes and shapes before these run.
// The splice's contract is written in docs/kv_splice.md. Not a place for the rotation math (rope.h).
#pragma once
#include <cstdint>
#include <stdexcept>

#include "rapo/dtype.h"

namespace rapo {

// Everything one splice call needs; pointers are host addresses for the CPU backend, device addresses for CUDA.
// Strides are in elements. Requests are int64 [num_requests, 5]: (src token offset in the pool, tokens to copy,
// destination row, destination slot, rope delta). Destination of token j of request r in layer l:
//   HF layout:    dst_k_ptrs[l] + row * k_row_stride + (slot + j) * k_slot_stride + head * k_head_stride + d
//   paged layout: blk = block_table[row * block_table_stride + (slot + j) / block_size],
//                 dst_k_ptrs[l] + blk * k_row_stride + ((slot + j) % block_size) * k_slot_stride + head * ... + d
// Source: k_pool + l * pool_layer_stride + (offset + j) * pool_token_stride + head * pool_head_stride + d.
struct KVSpliceParams {
  DType dtype = DType::F32;      // of the pools and the caches: F32, F16 or BF16
  bool interleaved = false;      // rotary pairs (2i, 2i + 1); rotate_half pairs (i, i + rotary_dim / 2) otherwise
  const void* k_pool = nullptr;  // [num_layers, capacity, num_heads, head_dim]
  const void* v_pool = nullptr;
  int64_t pool_layer_stride = 0, pool_token_stride = 0, pool_head_stride = 0;
  const int64_t* dst_k_ptrs = nullptr;  // [num_layers] addresses of each layer's key cache
  const int64_t* dst_v_ptrs = nullptr;  // [num_layers] addresses of each layer's value cache
  int64_t k_row_stride = 0, k_slot_stride = 0, k_head_stride = 0;
  int64_t v_row_stride = 0, v_slot_stride = 0, v_head_stride = 0;
  int num_layers = 0, num_heads = 0, head_dim = 0, rotary_dim = 0;
  const float* inv_freq = nullptr;    // [rotary_dim / 2]
  const int64_t* requests = nullptr;  // [num_requests, 5]
  int64_t num_requests = 0, max_tokens = 0;
  const int32_t* block_table = nullptr;  // [B, max_blocks] for the paged layout, nullptr for the HF layout
  int64_t block_table_stride = 0;
  int64_t block_size = 0;
  bool aligned16 = false;  // every base pointer 16-byte aligned (the CUDA backend's vector path needs it)
};

// Element offset of (row, slot) in a destination layer, HF or paged.
RAPO_HD int64_t splice_dst_offset(const int32_t* block_table, int64_t bt_stride, int64_t block_size, int64_t row,
                                  int64_t slot, int64_t row_stride, int64_t slot_stride) {
  if (block_table != nullptr) {
    const int64_t blk = block_table[row * bt_stride + slot / block_size];
    return blk * row_stride + (slot % block_size) * slot_stride;
  }
  return row * row_stride + slot * slot_stride;
}

// Memory-safety checks both backends run first (Python has validated the values themselves).
inline void check_kv_splice_params(const KVSpliceParams& p) {
  if (p.rotary_dim < 0 || p.rotary_dim % 2 || p.rotary_dim > p.head_dim)
    throw std::invalid_argument("kv_splice: rotary_dim must be even and <= head_dim");
  if (p.num_requests < 0 || p.max_tokens < 0 || p.num_layers <= 0 || p.num_heads <= 0)
    throw std::invalid_argument("kv_splice: bad sizes");
  if (p.block_table != nullptr && p.block_size <= 0) throw std::invalid_argument("kv_splice: block_size must be > 0");
}

void kv_splice_cpu(const KVSpliceParams& p);
#ifdef RAPO_WITH_CUDA
// Runs on `device`, on the CUDA stream whose raw handle is `stream` (torch's current stream).
void kv_splice_cuda(const KVSpliceParams& p, int device, std::uintptr_t stream);
#endif

}  // namespace rapo
