// CUDA backend of the KV splice: one launch over (request x token tile, layer) copies every requested segment from
// the store's pools into the destination cache (HF [B, H, S, D] or paged [blocks, block_size, H, D]), rotating keys by
// R(delta) with fp32 math (rapo/rope.h; angles formed in double once per block into shared memory) and copying values.
// Memory traffic uses 16-byte vectors when every base pointer, stride and the head/rotary dims allow it, scalar
// accesses otherwise. Contract: docs/kv_splice.md.
// Not a place for validation: csrc/kv_splice_bindings.cpp checks the tensors, rapo_fast/kv/splice.py the values, before
// the launch (rapo/kv_splice.h keeps memory safe).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>

#include "rapo/cuda_guard.h"
#include "rapo/dtype.h"
#include "rapo/kv_splice.h"
#include "rapo/rope.h"

namespace rapo {
namespace {

constexpr int kThreads = 256;
constexpr int kTokTile = 4;    // tokens per block: enough 16-byte units per thread to keep bytes in flight
constexpr int kMaxHalf = 512;  // rotary_dim / 2 <= 512 (head_dim <= 1024)

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

// Rotates one unit of VEC rotary pairs of a key row, ks -> ko, with the block's cos/sin table cs (cos of pair i at
// cs[2 i], sin at cs[2 i + 1]). rotate_half: the pairs (A[m], B[m]) of A = x[i0..), B = x[i0 + half..);
// interleaved: the pairs (AB[2m], AB[2m + 1]) of the 2 * VEC contiguous elements x[2 i0..).
template <typename T, int VEC, bool INTERLEAVED>
__device__ __forceinline__ void rotate_unit(const T* ks, T* ko, int i0, int half, const float* cs) {
  using V = Vec<T, VEC>;
  const int a0 = INTERLEAVED ? 2 * i0 : i0;
  const int b0 = INTERLEAVED ? 2 * i0 + VEC : i0 + half;
  const V va = *reinterpret_cast<const V*>(ks + a0);
  const V vb = *reinterpret_cast<const V*>(ks + b0);
  float x[2 * VEC];
#pragma unroll
  for (int m = 0; m < VEC; ++m) {
    x[m] = to_float(va.v[m]);
    x[VEC + m] = to_float(vb.v[m]);
  }
  V oa, ob;
#pragma unroll
  for (int m = 0; m < VEC; ++m) {
    const int e1 = INTERLEAVED ? 2 * m : m;
    const int e2 = INTERLEAVED ? 2 * m + 1 : VEC + m;
    float y1, y2;
    rope_rotate_pair(x[e1], x[e2], cs[2 * (i0 + m)], cs[2 * (i0 + m) + 1], &y1, &y2);
    T* o1 = e1 < VEC ? &oa.v[e1] : &ob.v[e1 - VEC];
    T* o2 = e2 < VEC ? &oa.v[e2] : &ob.v[e2 - VEC];
    *o1 = from_float<T>(y1);
    *o2 = from_float<T>(y2);
  }
  *reinterpret_cast<V*>(ko + a0) = oa;
  *reinterpret_cast<V*>(ko + b0) = ob;
}

// A unit is VEC rotary pairs (rotate_unit), or one VEC-vector of pass-through key dims, or one VEC-vector of values.
template <typename T, int VEC, bool INTERLEAVED>
__global__ void __launch_bounds__(kThreads) kv_splice_kernel(KVSpliceParams p, int tiles) {
  __shared__ float cs[2 * kMaxHalf];
  const int64_t r = blockIdx.x / tiles;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x % tiles) * kTokTile;
  const int l = blockIdx.y;
  const int64_t* q = p.requests + r * kKVRequestFields;
  const int64_t n = q[1];
  if (j0 >= n) return;  // uniform for the whole block, before the barrier
  const int half = p.rotary_dim / 2;
  for (int i = threadIdx.x; i < half; i += blockDim.x) rope_cos_sin(q[4], p.inv_freq[i], &cs[2 * i], &cs[2 * i + 1]);
  __syncthreads();

  const int ntok = static_cast<int>(min(static_cast<int64_t>(kTokTile), n - j0));
  const int H = p.num_heads, D = p.head_dim;
  const int rot_units = half / VEC;
  const int k_units = rot_units + (D - p.rotary_dim) / VEC;
  const int per_head = k_units + D / VEC;
  const int per_tok = H * per_head;
  const int total = ntok * per_tok;
  const T* kpool = static_cast<const T*>(p.k_pool) + l * p.pool_layer_stride;
  const T* vpool = static_cast<const T*>(p.v_pool) + l * p.pool_layer_stride;
  T* kdst = reinterpret_cast<T*>(p.dst_k_ptrs[l]);
  T* vdst = reinterpret_cast<T*>(p.dst_v_ptrs[l]);
  const int32_t* bt = p.block_table;
  using V = Vec<T, VEC>;

  for (int u = threadIdx.x; u < total; u += blockDim.x) {
    const int jt = u / per_tok;
    const int rem = u - jt * per_tok;
    const int h = rem / per_head;
    const int k = rem - h * per_head;
    const int64_t j = j0 + jt;
    const int64_t src = (q[0] + j) * p.pool_token_stride + h * p.pool_head_stride;
    const int64_t slot = q[3] + j;
    if (k < k_units) {
      T* ko = kdst +
              splice_dst_offset(bt, p.block_table_stride, p.block_size, q[2], slot, p.k_row_stride, p.k_slot_stride) +
              h * p.k_head_stride;
      const T* ks = kpool + src;
      if (k < rot_units) {
        rotate_unit<T, VEC, INTERLEAVED>(ks, ko, k * VEC, half, cs);
      } else {
        const int d = p.rotary_dim + (k - rot_units) * VEC;
        *reinterpret_cast<V*>(ko + d) = *reinterpret_cast<const V*>(ks + d);
      }
    } else {
      T* vo = vdst +
              splice_dst_offset(bt, p.block_table_stride, p.block_size, q[2], slot, p.v_row_stride, p.v_slot_stride) +
              h * p.v_head_stride;
      const int d = (k - k_units) * VEC;
      *reinterpret_cast<V*>(vo + d) = *reinterpret_cast<const V*>(vpool + src + d);
    }
  }
}

template <typename T, int VEC>
void launch_layout(const KVSpliceParams& p, cudaStream_t stream) {
  const int64_t tiles = (p.max_tokens + kTokTile - 1) / kTokTile;
  const int64_t gx = p.num_requests * tiles;
  if (gx > 2147483647LL || p.num_layers > 65535)
    throw std::invalid_argument("kv_splice: too many requests x tokens or layers for one launch");
  dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(p.num_layers));
  if (p.interleaved)
    kv_splice_kernel<T, VEC, true><<<grid, kThreads, 0, stream>>>(p, static_cast<int>(tiles));
  else
    kv_splice_kernel<T, VEC, false><<<grid, kThreads, 0, stream>>>(p, static_cast<int>(tiles));
}

template <typename T>
void launch_dtype(const KVSpliceParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t strides[] = {p.pool_layer_stride, p.pool_token_stride, p.pool_head_stride, p.k_row_stride,
                             p.k_slot_stride,     p.k_head_stride,     p.v_row_stride,     p.v_slot_stride,
                             p.v_head_stride,     p.head_dim,          p.rotary_dim / 2};
  bool vec_ok = p.aligned16;
  for (int64_t s : strides) vec_ok = vec_ok && (s % kVec == 0);
  if (vec_ok)
    launch_layout<T, kVec>(p, stream);
  else
    launch_layout<T, 1>(p, stream);
}

}  // namespace

void kv_splice_cuda(KVSpliceParams p, const int64_t* host_ptrs, int64_t* dev_ptrs, int device,
                    std::uintptr_t stream_handle) {
  p.dst_k_ptrs = dev_ptrs;
  p.dst_v_ptrs = dev_ptrs == nullptr ? nullptr : dev_ptrs + p.num_layers;
  check_kv_splice_params(p);
  if (p.rotary_dim / 2 > kMaxHalf)
    throw std::invalid_argument("kv_splice: rotary_dim: expected <= 1024 on CUDA, got " + std::to_string(p.rotary_dim));
  if (p.num_requests == 0 || p.max_tokens == 0) return;
  if (host_ptrs == nullptr) throw std::invalid_argument("kv_splice: null pointer");
  CudaDeviceGuard guard(device, "kv_splice CUDA");
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  // From pageable host memory: the call returns once host_ptrs has been staged, so the caller may free it at once.
  cuda_check(
      cudaMemcpyAsync(dev_ptrs, host_ptrs, sizeof(int64_t) * 2 * size_t(p.num_layers), cudaMemcpyHostToDevice, stream),
      "kv_splice CUDA", "copying the layers' addresses");
  switch (p.dtype) {
    case DType::F32: launch_dtype<float>(p, stream); break;
    case DType::F16: launch_dtype<__half>(p, stream); break;
    case DType::BF16: launch_dtype<__nv_bfloat16>(p, stream); break;
    default:
      throw std::invalid_argument("kv_splice: dtype: expected float32, float16 or bfloat16, got code " +
                                  std::to_string(int(p.dtype)));
  }
  cuda_check(cudaGetLastError(), "kv_splice CUDA", "kernel launch");
  guard.restore();
}

}  // namespace rapo
