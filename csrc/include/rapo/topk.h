// Top-k ordering shared by the CPU and CUDA retrieval backends: the one definition of "better" (higher score first,
// ties to the smaller slot id) and a fixed-size binary heap over it. Not a place for scoring (retrieval_metric.h).
#pragma once
#include <cstdint>

#include "rapo/dtype.h"  // RAPO_HD

namespace rapo {

// The total order of the retrieval contract: a candidate (s1, i1) ranks before (s2, i2) when its score is higher, or
// equal with a smaller slot. NaN never ranks before anything, so a NaN score can never displace a real candidate.
RAPO_HD bool topk_better(float s1, int64_t i1, float s2, int64_t i2) { return s1 > s2 || (s1 == s2 && i1 < i2); }

// Fixed-capacity heap of the k best candidates seen so far, worst at the root so that the admission test is one
// comparison. Storage is caller-owned (s[k], id[k]) so that per-query heaps live in one flat allocation.
struct TopKHeap {
  float* s;
  int32_t* id;
  int k;
  int n;

  RAPO_HD float worst_score() const { return s[0]; }
  RAPO_HD bool full() const { return n >= k; }

  // Admits (score, slot) when the heap has room or the candidate ranks before the current worst.
  // Returns true when the candidate was kept.
  RAPO_HD bool push(float score, int32_t slot) {
    if (n < k) {
      int c = n++;
      while (c > 0) {  // sift up: parents are worse than their children
        int p = (c - 1) >> 1;
        if (!topk_better(s[p], id[p], score, slot)) break;
        s[c] = s[p];
        id[c] = id[p];
        c = p;
      }
      s[c] = score;
      id[c] = slot;
      return true;
    }
    if (!topk_better(score, slot, s[0], id[0])) return false;
    int c = 0;
    for (;;) {  // sift down from the root, moving the worse child up
      int l = 2 * c + 1;
      if (l >= k) break;
      int w = l;
      int r = l + 1;
      if (r < k && topk_better(s[l], id[l], s[r], id[r])) w = r;
      if (!topk_better(score, slot, s[w], id[w])) break;
      s[c] = s[w];
      id[c] = id[w];
      c = w;
    }
    s[c] = score;
    id[c] = slot;
    return true;
  }
};

}  // namespace rapo
