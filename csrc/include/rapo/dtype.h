// The dtype codes (enum class DType, generated into rapo/constants.h from rapo_fast/_constants.py), and the one
// definition of the fp16/bf16 <-> fp32 conversions: on the host over uint16_t bit patterns (FloatTraits,
// half_bits_to_float, ...), in CUDA device code over
// __half / __nv_bfloat16 (to_float, from_float). Every backend converts through these; SIMD row kernels (F16C, AVX2)
// may widen 8 lanes at a time in their own files, with the same IEEE rounding.
// Not a place for op math (retrieval_metric.h, rope.h) or for memory layout.
#pragma once
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "rapo/constants.h"  // enum class DType

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define RAPO_HD __host__ __device__ __forceinline__
#else
#define RAPO_HD inline
#endif

namespace rapo {

inline int dtype_size(DType d) {
  switch (d) {
    case DType::F32: return 4;
    case DType::F16: return 2;
    case DType::BF16: return 2;
    case DType::I64: return 8;
    case DType::I32: return 4;
    case DType::U8: return 1;
    case DType::Bool: return 1;
  }
  throw std::invalid_argument("unknown dtype code " + std::to_string(static_cast<int>(d)));
}

// bfloat16 is the top half of an fp32: exact widening, round-to-nearest-even narrowing, NaN kept NaN.
RAPO_HD float bf16_bits_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

RAPO_HD uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#ifndef __CUDACC__
// Host half precision through the compiler's _Float16 (GCC >= 12, Clang >= 15 on x86-64): IEEE conversions with
// correct rounding and subnormals, so no hand-written bit tricks are needed.
inline float half_bits_to_float(uint16_t h) {
  _Float16 v;
  memcpy(&v, &h, sizeof(v));
  return static_cast<float>(v);
}
inline uint16_t float_to_half_bits(float f) {
  _Float16 v = static_cast<_Float16>(f);
  uint16_t h;
  memcpy(&h, &v, sizeof(h));
  return h;
}

// A 16-bit element of dtype F16 or BF16 (chosen at run time), widened to fp32.
inline float float16_bits_to_float(DType dtype, uint16_t bits) {
  return dtype == DType::F16 ? half_bits_to_float(bits) : bf16_bits_to_float(bits);
}

// Host storage type of a floating dtype and its scalar conversions, for code templated on the dtype.
template <DType DT>
struct FloatTraits;
template <>
struct FloatTraits<DType::F32> {
  using Bits = float;
  static float to_float(float x) { return x; }
  static float from_float(float x) { return x; }
};
template <>
struct FloatTraits<DType::F16> {
  using Bits = uint16_t;
  static float to_float(uint16_t x) { return half_bits_to_float(x); }
  static uint16_t from_float(float x) { return float_to_half_bits(x); }
};
template <>
struct FloatTraits<DType::BF16> {
  using Bits = uint16_t;
  static float to_float(uint16_t x) { return bf16_bits_to_float(x); }
  static uint16_t from_float(float x) { return float_to_bf16_bits(x); }
};
#else
// Device conversions of CUDA's own 16-bit types: exact widening, round-to-nearest-even narrowing.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
#endif

}  // namespace rapo
