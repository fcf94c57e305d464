// Host-side interface of the KV-splice backends (csrc/kv_splice_cpu.cpp, csrc/kv_splice_cuda.cu), called from
// csrc/kv_splice_bindings.cpp: the parameter block, the destination addressing both backends share, and the checks
// that keep memory safe. The bindings fill the block from the tensors they were given and check those (rank, dtype,
// device, strides: rapo/tensor_arg.h); Python (rapo_fast/kv/splice.py) has validated ids and ranges before;
// check_kv_splice_params still checks every index the backends dereference (once per request, on a host copy of the
// requests and block table), so the op called directly raises instead of writing out of bounds.
// The splice's contract is written in docs/kv_splice.md. Not a place for the rotation math (rope.h).
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

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
  // Extents the checks need. pool_tokens: the pools' capacity (dim 1). dst_rows / dst_slots: the caches' batch rows
  // and slots (HF) or blocks and block size (paged); dst_heads / dst_head_dim: their heads and head dim (must equal
  // num_heads / head_dim). block_table_rows / block_table_cols: the block table's shape.
  int64_t pool_tokens = 0, dst_rows = 0, dst_slots = 0, dst_heads = 0, dst_head_dim = 0;
  int64_t block_table_rows = 0, block_table_cols = 0;
  // Host copies of requests and block_table (the same addresses for the CPU backend), read by the checks only.
  const int64_t* requests_host = nullptr;
  const int32_t* block_table_host = nullptr;
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

inline std::string kv_request_where(int64_t r) { return "kv_splice: request " + std::to_string(r) + ": "; }

// Every index one request dereferences: pool tokens [off, off + n), destination row and slots, and (paged) the block
// table entries of those slots. std::out_of_range reaches Python as IndexError.
inline void check_kv_splice_request(const KVSpliceParams& p, int64_t r) {
  const int64_t* q = p.requests_host + r * kKVRequestFields;
  const int64_t off = q[0], n = q[1], row = q[2], slot = q[3];
  if (n < 0 || n > p.max_tokens)
    throw std::out_of_range(kv_request_where(r) + "token count " + std::to_string(n) + " outside [0, max_tokens " +
                            std::to_string(p.max_tokens) + "]");
  if (off < 0 || off > p.pool_tokens - n)
    throw std::out_of_range(kv_request_where(r) + "pool tokens [" + std::to_string(off) + ", +" + std::to_string(n) +
                            ") outside the pool's " + std::to_string(p.pool_tokens));
  if (n == 0) return;
  const int64_t nrows = p.block_table != nullptr ? p.block_table_rows : p.dst_rows;
  if (row < 0 || row >= nrows)
    throw std::out_of_range(kv_request_where(r) + "batch row " + std::to_string(row) + " outside [0, " +
                            std::to_string(nrows) + ")");
  const int64_t nslots = p.block_table != nullptr ? p.block_table_cols * p.block_size : p.dst_slots;
  if (slot < 0 || slot > nslots - n)
    throw std::out_of_range(kv_request_where(r) + "slots [" + std::to_string(slot) + ", +" + std::to_string(n) +
                            ") outside the cache's " + std::to_string(nslots));
  if (p.block_table == nullptr) return;
  for (int64_t b = slot / p.block_size; b <= (slot + n - 1) / p.block_size; ++b) {
    const int32_t blk = p.block_table_host[row * p.block_table_stride + b];
    if (blk < 0 || blk >= p.dst_rows)
      throw std::out_of_range(kv_request_where(r) + "block_table[" + std::to_string(row) + ", " + std::to_string(b) +
                              "] = " + std::to_string(blk) + " outside [0, " + std::to_string(p.dst_rows) + ")");
  }
}

// The checks both backends run before any write (Python has validated the values already; these keep memory safe
// when the op is called directly).
inline void check_kv_splice_params(const KVSpliceParams& p) {
  if (p.rotary_dim < 0 || p.rotary_dim % 2 || p.rotary_dim > p.head_dim)
    throw std::invalid_argument("kv_splice: rotary_dim: expected even and <= head_dim " + std::to_string(p.head_dim) +
                                ", got " + std::to_string(p.rotary_dim));
  if (p.num_requests < 0 || p.max_tokens < 0 || p.num_layers <= 0 || p.num_heads <= 0 || p.pool_tokens < 0)
    throw std::invalid_argument("kv_splice: bad sizes");
  if (p.dst_heads != p.num_heads || p.dst_head_dim != p.head_dim)
    throw std::invalid_argument("kv_splice: the caches have " + std::to_string(p.dst_heads) + " heads of dim " +
                                std::to_string(p.dst_head_dim) + ", the pools " + std::to_string(p.num_heads) +
                                " of dim " + std::to_string(p.head_dim));
  if (p.block_table != nullptr) {
    if (p.block_size <= 0 || p.block_size != p.dst_slots)
      throw std::invalid_argument("kv_splice: block_size: expected the cache blocks' size " +
                                  std::to_string(p.dst_slots) + ", got " + std::to_string(p.block_size));
    if (p.block_table_host == nullptr || p.block_table_rows < 0 || p.block_table_cols < 0 ||
        (p.block_table_rows > 1 && p.block_table_stride < p.block_table_cols))
      throw std::invalid_argument("kv_splice: bad block table");
  }
  if (p.num_requests == 0 || p.max_tokens == 0) return;
  if (p.requests_host == nullptr || p.requests == nullptr || p.k_pool == nullptr || p.v_pool == nullptr ||
      p.dst_k_ptrs == nullptr || p.dst_v_ptrs == nullptr || (p.rotary_dim > 0 && p.inv_freq == nullptr))
    throw std::invalid_argument("kv_splice: null pointer");
  for (int64_t r = 0; r < p.num_requests; ++r) check_kv_splice_request(p, r);
}

void kv_splice_cpu(const KVSpliceParams& p);
#ifdef RAPO_WITH_CUDA
// Runs on `device`, on the CUDA stream whose raw handle is `stream` (torch's current stream). The layers' addresses
// are host_ptrs [2, num_layers] (each key cache's, then each value cache's); they are copied on the stream into
// dev_ptrs (as many int64 in device memory, which must outlive the kernel), which the kernel reads as p.dst_k_ptrs /
// p.dst_v_ptrs (their values in p are ignored).
void kv_splice_cuda(KVSpliceParams p, const int64_t* host_ptrs, int64_t* dev_ptrs, int device, std::uintptr_t stream);
#endif

}  // namespace rapo
