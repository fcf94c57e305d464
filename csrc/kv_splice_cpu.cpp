// CPU backend of the KV splice: copies each request's segment from the store's pools into every layer of the
// destination cache, rotating keys by R(delta) (fp32 math, rapo/rope.h) and copying values unchanged.
// Parallel over (request, layer, token) with OpenMP when built with it; per head, a whole row is widened to fp32,
// rotated and narrowed in three contiguous loops the compiler vectorises (see Row and rotate_row_* below).
// Not a place for validation: the Python side (rapo_fast/kv/splice.py) checks ids, ranges, dtypes and shapes before
// calling, so this code trusts its inputs.
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "rapo/dtype.h"
#include "rapo/rope.h"

namespace rapo {
namespace {

// Row converters: a whole head-dim row at a time, written as plain loops over contiguous memory so that -O3
// auto-vectorises them with the baseline ISA (SSE2 on x86-64; no -march=native, the .so must run on any x86-64).
// bf16 widening is a shift and its narrowing a few integer ops plus a select, both vectorisable. fp16 through
// _Float16 lowers to libgcc calls per element without F16C in the baseline ISA, hence the F16C path below.
struct HalfTag {};
struct BF16Tag {};
template <typename Tag>
struct Row;
template <>
struct Row<float> {
  using S = float;
  static void load(const float* __restrict x, float* __restrict y, int n) {
    for (int d = 0; d < n; ++d) y[d] = x[d];
  }
  static void store(const float* __restrict x, float* __restrict y, int n) {
    for (int d = 0; d < n; ++d) y[d] = x[d];
  }
};
template <>
struct Row<BF16Tag> {
  using S = uint16_t;
  static void load(const uint16_t* __restrict x, float* __restrict y, int n) {
    for (int d = 0; d < n; ++d) y[d] = bf16_bits_to_float(x[d]);
  }
  static void store(const float* __restrict x, uint16_t* __restrict y, int n) {
    for (int d = 0; d < n; ++d) y[d] = float_to_bf16_bits(x[d]);
  }
};
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// fp16 rows through F16C (vcvtph2ps / vcvtps2ph, 8 lanes), compiled for that target in these two functions only and
// picked at run time, so the library itself still targets baseline x86-64. Both conversions are IEEE round-to-
// nearest-even like _Float16's, so results equal the portable path's bit for bit (NaN payloads aside).
#define RAPO_F16C 1
__attribute__((target("avx,f16c"))) void half_row_load_f16c(const uint16_t* __restrict x, float* __restrict y, int n) {
  int d = 0;
  for (; d + 8 <= n; d += 8)
    _mm256_storeu_ps(y + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + d))));
  for (; d < n; ++d) y[d] = _cvtsh_ss(x[d]);
}
__attribute__((target("avx,f16c"))) void half_row_store_f16c(const float* __restrict x, uint16_t* __restrict y,
                                                               int n) {
  int d = 0;
  for (; d + 8 <= n; d += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + d),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT));
  for (; d < n; ++d) y[d] = _cvtss_sh(x[d], _MM_FROUND_TO_NEAREST_INT);
}
bool cpu_has_f16c() {
  static const bool ok = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return ok;
}
#endif

template <>
struct Row<HalfTag> {
  using S = uint16_t;
  static void load(const uint16_t* __restrict x, float* __restrict y, int n) {
#ifdef RAPO_F16C
    if (cpu_has_f16c()) return half_row_load_f16c(x, y, n);
#endif
    for (int d = 0; d < n; ++d) y[d] = half_bits_to_float(x[d]);
  }
  static void store(const float* __restrict x, uint16_t* __restrict y, int n) {
#ifdef RAPO_F16C
    if (cpu_has_f16c()) return half_row_store_f16c(x, y, n);
#endif
    for (int d = 0; d < n; ++d) y[d] = float_to_half_bits(x[d]);
  }
};

// Rotate the first 2 * half dims of one row, x -> y (fp32), with cos/sin arrays of the request's frequencies.
// The same products and differences as rope_rotate_pair (rapo/rope.h), in the same order, so fp32 results are
// bit-identical to the per-pair loop; only the loop shape differs (separate cos and sin arrays, no layout branch
// inside the loop), which is what lets the compiler vectorise it.
inline void rotate_row_half(const float* __restrict x, float* __restrict y, const float* __restrict c,
                            const float* __restrict s, int half) {
  for (int i = 0; i < half; ++i) rope_rotate_pair(x[i], x[i + half], c[i], s[i], &y[i], &y[i + half]);
}
inline void rotate_row_interleaved(const float* __restrict x, float* __restrict y, const float* __restrict c,
                                   const float* __restrict s, int half) {
  for (int i = 0; i < half; ++i) rope_rotate_pair(x[2 * i], x[2 * i + 1], c[i], s[i], &y[2 * i], &y[2 * i + 1]);
}

template <typename Tag>
void splice_impl(const KVSpliceParams& p) {
  using S = typename Row<Tag>::S;
  const int64_t* req = reinterpret_cast<const int64_t*>(p.requests);
  const int64_t* kdst = reinterpret_cast<const int64_t*>(p.dst_k_ptrs);
  const int64_t* vdst = reinterpret_cast<const int64_t*>(p.dst_v_ptrs);
  const float* inv = reinterpret_cast<const float*>(p.inv_freq);
  const int32_t* bt = reinterpret_cast<const int32_t*>(p.block_table);
  const S* kpool = reinterpret_cast<const S*>(p.k_pool);
  const S* vpool = reinterpret_cast<const S*>(p.v_pool);
  const int half = p.rotary_dim / 2, rd = p.rotary_dim, D = p.head_dim;
  const int64_t R = p.num_requests, L = p.num_layers, T = p.max_tokens;

  // cos/sin depend on the request only (delta is per request), so build them once per request: cos in
  // cs[r * 2 * half + i], sin in cs[r * 2 * half + half + i] (two arrays, so the row loop reads them contiguously).
  std::vector<float> cs(static_cast<size_t>(R) * half * 2);
  for (int64_t r = 0; r < R; ++r)
    for (int i = 0; i < half; ++i) {
      float* o = &cs[static_cast<size_t>(r) * half * 2];
      rope_cos_sin(req[r * 5 + 4], inv[i], o + i, o + half + i);
    }

  const int64_t total = R * L * T;
#ifdef RAPO_WITH_OPENMP
#pragma omp parallel
#endif
  {
    // Per-thread fp32 row buffers (x: the stored key, y: rotated).
    std::vector<float> xbuf(static_cast<size_t>(rd) + 1), ybuf(static_cast<size_t>(rd) + 1);
    float* x = xbuf.data();
    float* y = ybuf.data();
#ifdef RAPO_WITH_OPENMP
#pragma omp for schedule(static)
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
      const float* sn = c + half;
      for (int h = 0; h < p.num_heads; ++h) {
        const S* ks = kpool + src + h * p.pool_head_stride;
        const S* vs = vpool + src + h * p.pool_head_stride;
        S* ko = kd + h * p.k_head_stride;
        S* vo = vd + h * p.v_head_stride;
        if constexpr (std::is_same_v<Tag, float>) {  // fp32: no widening, rotate straight into the cache
          if (p.interleaved)
            rotate_row_interleaved(ks, ko, c, sn, half);
          else
            rotate_row_half(ks, ko, c, sn, half);
        } else {
          Row<Tag>::load(ks, x, rd);
          if (p.interleaved)
            rotate_row_interleaved(x, y, c, sn, half);
          else
            rotate_row_half(x, y, c, sn, half);
          Row<Tag>::store(y, ko, rd);
        }
        // Dims past the rotary ones are copied as stored (no round trip through fp32).
        if (D > rd) std::memcpy(ko + rd, ks + rd, sizeof(S) * (D - rd));
        std::memcpy(vo, vs, sizeof(S) * D);
      }
    }
  }
}

}  // namespace

void kv_splice_cpu(const KVSpliceParams& p) {
  switch (p.dtype) {
    case DType::F32: splice_impl<float>(p); break;
    case DType::F16: splice_impl<HalfTag>(p); break;
    case DType::BF16: splice_impl<BF16Tag>(p); break;
    default: throw std::invalid_argument("kv_splice: dtype must be float32, float16 or bfloat16");
  }
}

}  // namespace rapo
