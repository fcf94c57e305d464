// CPU backend of the KV splice: copies each request's segment from the store's pools into every layer of the
// destination cache, rotating keys by R(delta) (fp32 math, rapo/rope.h) and copying values unchanged.
// Parallel over (request, layer, token) with OpenMP when built with it. Not a place for validation: the Python side
// (rapo_fast/kv_splice.py) checks ids, ranges, dtypes and shapes before calling, so this code trusts its inputs.
#include <cstring>
#include <stdexcept>
#include <vector>

#include "rapo/dtype.h"
#include "rapo/rope.h"

namespace rapo {
namespace {

template <typename T>
struct Elem;
template <>
struct Elem<float> {
  static float load(const float* p) { return *p; }
  static void store(float* p, float v) { *p = v; }
};
struct HalfTag {};
struct BF16Tag {};
template <>
struct Elem<HalfTag> {
  static float load(const uint16_t* p) { return half_bits_to_float(*p); }
  static void store(uint16_t* p, float v) { *p = float_to_half_bits(v); }
};
template <>
struct Elem<BF16Tag> {
  static float load(const uint16_t* p) { return bf16_bits_to_float(*p); }
  static void store(uint16_t* p, float v) { *p = float_to_bf16_bits(v); }
};

template <typename Tag, typename S>
void splice_impl(const KVSpliceParams& p) {
  const int64_t* req = reinterpret_cast<const int64_t*>(p.requests);
  const int64_t* kdst = reinterpret_cast<const int64_t*>(p.dst_k_ptrs);
  const int64_t* vdst = reinterpret_cast<const int64_t*>(p.dst_v_ptrs);
  const float* inv = reinterpret_cast<const float*>(p.inv_freq);
  const int32_t* bt = reinterpret_cast<const int32_t*>(p.block_table);
  const S* kpool = reinterpret_cast<const S*>(p.k_pool);
  const S* vpool = reinterpret_cast<const S*>(p.v_pool);
  const int half = p.rotary_dim / 2;
  const int64_t R = p.num_requests, L = p.num_layers, T = p.max_tokens;

  // cos/sin depend on the request only (delta is per request), so build them once per request.
  std::vector<float> cs(static_cast<size_t>(R) * half * 2);
  for (int64_t r = 0; r < R; ++r)
    for (int i = 0; i < half; ++i) {
      float* o = &cs[static_cast<size_t>(r * half + i) * 2];
      rope_cos_sin(req[r * 5 + 4], inv[i], o, o + 1);
    }

  const int64_t total = R * L * T;
#ifdef RAPO_WITH_OPENMP
#pragma omp parallel for schedule(static)
#endif
  for (int64_t w = 0; w < total; ++w) {
    const int64_t r = w / (L * T), l = (w / T) % L, j = w % T;
    const int64_t* q = req + r * 5;
    if (j >= q[1]) continue;
    const int64_t src = l * p.pool_layer_stride + (q[0] + j) * p.pool_token_stride;
    const int64_t slot = q[3] + j;
    S* kd = reinterpret_cast<S*>(kdst[l]) +
            splice_dst_offset(bt, p.block_table_stride, p.block_size, q[2], slot, p.k_row_stride, p.k_slot_stride);
    S* vd = reinterpret_cast<S*>(vdst[l]) +
            splice_dst_offset(bt, p.block_table_stride, p.block_size, q[2], slot, p.v_row_stride, p.v_slot_stride);
    const float* c = &cs[static_cast<size_t>(r) * half * 2];
    for (int h = 0; h < p.num_heads; ++h) {
      const S* ks = kpool + src + h * p.pool_head_stride;
      const S* vs = vpool + src + h * p.pool_head_stride;
      S* ko = kd + h * p.k_head_stride;
      S* vo = vd + h * p.v_head_stride;
      for (int i = 0; i < half; ++i) {
        const int a = p.interleaved ? 2 * i : i;
        const int b = p.interleaved ? 2 * i + 1 : i + half;
        float y1, y2;
        rope_rotate_pair(Elem<Tag>::load(ks + a), Elem<Tag>::load(ks + b), c[2 * i], c[2 * i + 1], &y1, &y2);
        Elem<Tag>::store(ko + a, y1);
        Elem<Tag>::store(ko + b, y2);
      }
      for (int d = p.rotary_dim; d < p.head_dim; ++d) ko[d] = ks[d];
      std::memcpy(vo, vs, sizeof(S) * p.head_dim);
    }
  }
}

}  // namespace

void kv_splice_cpu(const KVSpliceParams& p) {
  switch (p.dtype) {
    case DType::F32: splice_impl<float, float>(p); break;
    case DType::F16: splice_impl<HalfTag, uint16_t>(p); break;
    case DType::BF16: splice_impl<BF16Tag, uint16_t>(p); break;
    default: throw std::invalid_argument("kv_splice: dtype must be float32, float16 or bfloat16");
  }
}

}  // namespace rapo
