// Score conventions of step retrieval, shared by the CPU and CUDA backends (and mirrored by
// rapo_fast/reference/retrieval.py, the spec). Every metric is reported so that larger is better:
//   ip:     s = <q, k>
//   cosine: s = <q, k> * qaux * kaux, aux = 1 / max(||x||, 1e-12)  (zero vectors score 0 against everything)
//   l2:     s = min(2 <q, k> - kaux - qaux, 0) = -||q - k||^2, aux = ||x||^2  (negative squared distance)
// kaux is computed once per stored key when it is added (Python, float64, then rounded to fp32); qaux per query from
// the query rounded to the buffer dtype. l2 is scored about the stored keys' mean m (q - m, k - m, with kaux =
// ||k - m||^2 taken while the keys are packed; retrieval.h, RetrievalSearchParams::centre), so that the form above
// does not cancel for keys far from the origin. Not a place for the dot product itself (each backend tiles its own).
#pragma once
#include <cmath>

#include "rapo/constants.h"  // kMetric*, kCosineEps (generated from rapo_fast/_constants.py)
#include "rapo/dtype.h"      // RAPO_HD

namespace rapo {

// Per-query auxiliary value from the sum of squares of the (dtype-rounded) query.
RAPO_HD float retrieval_query_aux(int metric, float sumsq) {
  if (metric == kMetricCosine) return 1.0f / fmaxf(sqrtf(sumsq), kCosineEps);
  if (metric == kMetricL2) return sumsq;
  return 0.0f;
}

// Final score from the fp32 dot product. The operation order is fixed here so that every backend (and every SIMD
// width of the CPU backend, which mirrors it lane-wise) rounds the same way.
RAPO_HD float retrieval_finish(int metric, float dot, float qaux, float kaux) {
  if (metric == kMetricCosine) return (dot * qaux) * kaux;
  if (metric == kMetricL2) {
    float t = (2.0f * dot - kaux) - qaux;
    // Rounding can make a duplicate's distance negative; the clamp keeps s <= 0. Written so that NaN stays NaN
    // (and so never admitted), matching the SIMD min(0, t) of the CPU backend lane for lane.
    return t > 0.0f ? 0.0f : t;
  }
  return dot;
}

}  // namespace rapo
