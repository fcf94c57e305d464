// CPU backend of the KV splice: copies each request's segment from the store's pools into every layer of the
// destination cache, rotating keys by R(delta) (fp32 math, rapo/rope.h) and copying values unchanged.
// Parallel over (request, layer, token) with OpenMP when built with it; per head, a whole row is widened to fp32,
// rotated and narrowed in three contiguous loops the compiler vectorises (see load_row and rotate_row_* below).
// Not a place for validation: the Python side (rapo_fast/kv/splice.py) checks ids and ranges,
// csrc/kv_splice_bindings.cpp the tensors' dtypes, shapes and strides, before calling, so this code trusts its inputs
// beyond the memory-safety checks of rapo/kv_splice.h. Contract: docs/kv_splice.md.
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <stdexcept>
#include <vector>

#include "rapo/dtype.h"
#include "rapo/kv_splice.h"
#include "rapo/rope.h"

namespace rapo {
namespace {

// Row converters: a whole head-dim row at a time (scalar conversions from rapo/dtype.h), written as plain loops over
// contiguous memory so that -O3 auto-vectorises them with the baseline ISA (SSE2 on x86-64; no -march=native, the .so
// must run on any x86-64). bf16 widening is a shift and its narrowing a few integer ops plus a select, both
// vectorisable. fp16 through _Float16 lowers to libgcc calls per element without F16C in the baseline ISA, hence the
// F16C path below.
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
__attribute__((target("avx,f16c"))) void half_row_store_f16c(const float* __restrict x, uint16_t* __restrict y, int n) {
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

template <DType DT>
using Bits = typename FloatTraits<DT>::Bits;

// Widen a row of dtype DT (F16 or BF16) to fp32.
template <DType DT>
void load_row(const Bits<DT>* __restrict x, float* __restrict y, int n) {
#ifdef RAPO_F16C
  if constexpr (DT == DType::F16) {
    if (cpu_has_f16c()) return half_row_load_f16c(x, y, n);
  }
#endif
  for (int d = 0; d < n; ++d) y[d] = FloatTraits<DT>::to_float(x[d]);
}

// Narrow an fp32 row to dtype DT (F16 or BF16), round to nearest even.
template <DType DT>
void store_row(const float* __restrict x, Bits<DT>* __restrict y, int n) {
#ifdef RAPO_F16C
  if constexpr (DT == DType::F16) {
    if (cpu_has_f16c()) return half_row_store_f16c(x, y, n);
  }
#endif
  for (int d = 0; d < n; ++d) y[d] = FloatTraits<DT>::from_float(x[d]);
}

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

// cos/sin depend on the request only (delta is per request), so they are built once per request: cos in
// cs[r * 2 * half + i], sin in cs[r * 2 * half + half + i] (two arrays, so the row loop reads them contiguously).
std::vector<float> rope_tables(const KVSpliceParams& p) {
  const int half = p.rotary_dim / 2;
  std::vector<float> cs(static_cast<size_t>(p.num_requests) * half * 2);
  for (int64_t r = 0; r < p.num_requests; ++r)
    for (int i = 0; i < half; ++i) {
      float* o = &cs[static_cast<size_t>(r) * half * 2];
      rope_cos_sin(p.requests[r * kKVRequestFields + 4], p.inv_freq[i], o + i, o + half + i);
    }
  return cs;
}

// Every head of token j of request q in layer l: keys rotated with the request's cos/sin (c, sn), the dims past the
// rotary ones and the values copied as stored. x, y: the thread's fp32 row buffers (unused for fp32).
template <DType DT>
inline void splice_token(const KVSpliceParams& p, const int64_t* q, int64_t l, int64_t j, const float* c,
                         const float* sn, float* x, float* y) {
  using S = Bits<DT>;
  const int half = p.rotary_dim / 2, rd = p.rotary_dim, D = p.head_dim;
  const int64_t src = l * p.pool_layer_stride + (q[0] + j) * p.pool_token_stride;
  const int64_t slot = q[3] + j;
  S* kd = reinterpret_cast<S*>(p.dst_k_ptrs[l]) + splice_dst_offset(p.block_table, p.block_table_stride, p.block_size,
                                                                    q[2], slot, p.k_row_stride, p.k_slot_stride);
  S* vd = reinterpret_cast<S*>(p.dst_v_ptrs[l]) + splice_dst_offset(p.block_table, p.block_table_stride, p.block_size,
                                                                    q[2], slot, p.v_row_stride, p.v_slot_stride);
  const S* kpool = static_cast<const S*>(p.k_pool);
  const S* vpool = static_cast<const S*>(p.v_pool);
  for (int h = 0; h < p.num_heads; ++h) {
    const S* ks = kpool + src + h * p.pool_head_stride;
    const S* vs = vpool + src + h * p.pool_head_stride;
    S* ko = kd + h * p.k_head_stride;
    S* vo = vd + h * p.v_head_stride;
    if constexpr (DT == DType::F32) {  // fp32: no widening, rotate straight into the cache
      if (p.interleaved)
        rotate_row_interleaved(ks, ko, c, sn, half);
      else
        rotate_row_half(ks, ko, c, sn, half);
    } else {
      load_row<DT>(ks, x, rd);
      if (p.interleaved)
        rotate_row_interleaved(x, y, c, sn, half);
      else
        rotate_row_half(x, y, c, sn, half);
      store_row<DT>(y, ko, rd);
    }
    // Dims past the rotary ones are copied as stored (no round trip through fp32).
    if (D > rd) std::memcpy(ko + rd, ks + rd, sizeof(S) * (D - rd));
    std::memcpy(vo, vs, sizeof(S) * D);
  }
}

template <DType DT>
void splice_impl(const KVSpliceParams& p) {
  const std::vector<float> cs = rope_tables(p);
  const int half = p.rotary_dim / 2;
  const int64_t L = p.num_layers, T = p.max_tokens;
  const int64_t total = p.num_requests * L * T;
#ifdef RAPO_WITH_OPENMP
#pragma omp parallel
#endif
  {
    // Per-thread fp32 row buffers (x: the stored key, y: rotated).
    std::vector<float> xbuf(static_cast<size_t>(p.rotary_dim) + 1), ybuf(static_cast<size_t>(p.rotary_dim) + 1);
#ifdef RAPO_WITH_OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t w = 0; w < total; ++w) {
      const int64_t r = w / (L * T), l = (w / T) % L, j = w % T;
      const int64_t* q = p.requests + r * kKVRequestFields;
      if (j >= q[1]) continue;
      const float* c = &cs[static_cast<size_t>(r) * half * 2];
      splice_token<DT>(p, q, l, j, c, c + half, xbuf.data(), ybuf.data());
    }
  }
}

}  // namespace

void kv_splice_cpu(const KVSpliceParams& p) {
  check_kv_splice_params(p);
  if (p.num_requests == 0 || p.max_tokens == 0) return;
  switch (p.dtype) {
    case DType::F32: splice_impl<DType::F32>(p); break;
    case DType::F16: splice_impl<DType::F16>(p); break;
    case DType::BF16: splice_impl<DType::BF16>(p); break;
    default:
      throw std::invalid_argument("kv_splice: dtype: expected float32, float16 or bfloat16, got code " +
                                  std::to_string(int(p.dtype)));
  }
}

}  // namespace rapo
