// RoPE re-rotation math shared by the CPU and CUDA KV-splice backends, and the splice's parameter block.
// Spec: rapo_fast/reference/kv_splice.py. Rotation by delta of pair (x1, x2) with frequency w:
//   a = (delta * w) mod 2 pi, formed in double; (x1, x2) -> (x1 cos a - x2 sin a, x2 cos a + x1 sin a) in fp32.
// Why double for the angle: delta * w in fp32 carries an absolute error of ~delta * w * 6e-8 rad (0.06 rad at
// delta = 1e6, w = 1), which grows with the position; in double the reduced angle keeps fp32 accuracy for any
// practical position. It is formed once per (request, frequency), not per element, so its cost does not matter.
// Pairs: rotate_half (i, i + rotary_dim/2), interleaved (2i, 2i + 1); dims >= rotary_dim are copied.
// Not a place for memory layout logic beyond the parameter block (each backend addresses memory itself).
#pragma once
#include <cmath>
#include <cstdint>

#include "rapo/dtype.h"

namespace rapo {

// cos/sin of (delta * inv_freq) with the product and the reduction modulo 2 pi in double.
RAPO_HD void rope_cos_sin(int64_t delta, float inv_freq, float* c, float* s) {
  const double two_pi = 6.283185307179586476925286766559;
  double a = static_cast<double>(delta) * static_cast<double>(inv_freq);
  a = fmod(a, two_pi);  // delta >= 0 and w > 0, so a is in [0, 2 pi)
  const float af = static_cast<float>(a);
#ifdef __CUDA_ARCH__
  sincosf(af, s, c);  // accurate sincosf (not __sincosf): the argument is already reduced to [0, 2 pi)
#else
  *c = std::cos(af);
  *s = std::sin(af);
#endif
}

// One rotated pair: (x1, x2) -> (y1, y2).
RAPO_HD void rope_rotate_pair(float x1, float x2, float c, float s, float* y1, float* y2) {
  *y1 = x1 * c - x2 * s;
  *y2 = x2 * c + x1 * s;
}

// Everything one splice call needs; pointers are host addresses for the CPU backend, device addresses for CUDA.
// Strides are in elements. Requests are int64 [num_requests, 5]: (src token offset in the pool, tokens to copy,
// destination row, destination slot, rope delta). Destination of token j of request r in layer l:
//   HF layout:    dst_k_ptrs[l] + row * k_row_stride + (slot + j) * k_slot_stride + head * k_head_stride + d
//   paged layout: blk = block_table[row * block_table_stride + (slot + j) / block_size],
//                 dst_k_ptrs[l] + blk * k_row_stride + ((slot + j) % block_size) * k_slot_stride + head * ... + d
// Source: k_pool + l * pool_layer_stride + (offset + j) * pool_token_stride + head * pool_head_stride + d.
struct KVSpliceParams {
  int device = -1;
  int64_t stream = 0;
  DType dtype = DType::F32;
  bool interleaved = false;
  int64_t k_pool = 0, v_pool = 0;
  int64_t pool_layer_stride = 0, pool_token_stride = 0, pool_head_stride = 0;
  int64_t dst_k_ptrs = 0, dst_v_ptrs = 0;  // arrays of num_layers int64 addresses
  int64_t k_row_stride = 0, k_slot_stride = 0, k_head_stride = 0;
  int64_t v_row_stride = 0, v_slot_stride = 0, v_head_stride = 0;
  int num_layers = 0, num_heads = 0, head_dim = 0, rotary_dim = 0;
  int64_t inv_freq = 0;  // float32 [rotary_dim / 2]
  int64_t requests = 0;  // int64 [num_requests, 5]
  int64_t num_requests = 0, max_tokens = 0;
  int64_t block_table = 0, block_table_stride = 0;  // int32 [B, max_blocks], 0 for the HF layout
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

void kv_splice_cpu(const KVSpliceParams& p);
#ifdef RAPO_WITH_CUDA
void kv_splice_cuda(const KVSpliceParams& p);
#endif

}  // namespace rapo
