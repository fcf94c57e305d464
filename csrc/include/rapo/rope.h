// RoPE re-rotation math shared by the CPU and CUDA KV-splice backends. Spec: rapo_fast/reference/kv_splice.py; the
// contract is written in docs/kv_splice.md. Rotation by delta of pair (x1, x2) with frequency w:
//   a = (delta * w) mod 2 pi, formed in double; (x1, x2) -> (x1 cos a - x2 sin a, x2 cos a + x1 sin a) in fp32.
// Why double for the angle: delta * w in fp32 carries an absolute error of ~delta * w * 6e-8 rad (0.06 rad at
// delta = 1e6, w = 1), which grows with the position; in double the reduced angle keeps fp32 accuracy for any
// practical position. It is formed once per (request, frequency), not per element, so its cost does not matter.
// Pairs: rotate_half (i, i + rotary_dim/2), interleaved (2i, 2i + 1); dims >= rotary_dim are copied.
// Not a place for memory layout or the splice's parameters (kv_splice.h); each backend addresses memory itself.
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

}  // namespace rapo
