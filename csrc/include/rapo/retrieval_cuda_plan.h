// The parts of the CUDA retrieval backend (csrc/retrieval_cuda.cu) that need no GPU, written once for the host and the
// device so that the CPU tests check the very code the kernels run (tests/retrieval/test_retrieval_cuda_plan.py,
// through _C.retrieval_cuda_plan, _C.retrieval_cuda_split_bounds and _C.retrieval_merge_splits_host):
//   - the query tile (BQ) of the scoring kernel for (Q, k);
//   - the key splits: how many (retrieval_cuda_plan_splits, from a cost model of the scan and of the merge) and which
//     keys each covers (retrieval_split_key_begin: whole 64-key tiles, balanced, none empty when n <= tiles);
//   - the merge of the splits' sorted lists into each query's top-k (retrieval_merge_query): a tree of pairwise
//     merge-path rounds in shared memory, over groups of lists that fit it, level by level.
// Not here: scoring, the kernels and their launch (retrieval_cuda.cu), the order itself (topk.h).
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "rapo/constants.h"  // kRetrievalMaxK
#include "rapo/dtype.h"      // RAPO_HD
#include "rapo/topk.h"

namespace rapo {

constexpr int kRetrievalKeyTile = 64;     // keys per tile of the scoring kernel (BK)
constexpr int kRetrievalDepthChunk = 32;  // reduction depth staged per step (DK)
constexpr int kRetrievalMaxSplits = 4096;
constexpr int64_t kRetrievalWorkspaceBytes = int64_t(1) << 30;  // cap of the [n_splits, Q, k] workspace

// Query rows per block of the scoring kernel. 16 rows when k > 128 (the lists take BQ * k * 8 bytes of shared memory)
// and when Q <= 16: a few-query search then computes 16 rows instead of 64, and the smaller block leaves room for more
// blocks per SM, hence more key loads in flight. Otherwise 64.
RAPO_HD int retrieval_cuda_query_tile(int64_t Q, int k) { return (k > 128 || Q <= 16) ? 16 : 64; }

// First key of split `split` of n_splits over C keys (split == n_splits gives C): splits are runs of whole 64-key
// tiles, tile counts differing by at most one, so every split is non-empty when n_splits <= ceil(C / 64).
RAPO_HD int64_t retrieval_split_key_begin(int64_t split, int64_t n_splits, int64_t C) {
  const int64_t tiles = (C + kRetrievalKeyTile - 1) / kRetrievalKeyTile;
  const int64_t begin = split * tiles / n_splits * kRetrievalKeyTile;
  return begin < C ? begin : C;
}

// ---- The merge -------------------------------------------------------------------------------------------------
// Input: for one query, n sorted lists of k entries (best first by topk_better, padded at the end with (-inf, -1)),
// list s at ws[(s * Q + q) * k]. Output: the first k entries of their union in the same order. Slot ids are unique
// across lists and no list holds a NaN or a -inf score, so the order is strict on real entries and the padding sorts
// after all of them: the result is the contract's order, padding included, whatever the merge order.
//
// A group of up to G lists is loaded into shared memory and reduced by rounds: each round merges lists (2p, 2p+1)
// into list p keeping the first k (an odd last list is copied), with ceil(k / kRetrievalMergeChunk) work items per
// output list; an item finds where its chunk of outputs starts by a binary search (merge path: how many of the first
// t0 outputs come from list 2p) and then merges sequentially. Rounds ping-pong between two buffers (G and ceil(G / 2)
// lists). When n > G, each group's result is written back over list g of the workspace (group g has read lists
// [gG, gG + G), all at or after g, before it writes), and the next level merges those ceil(n / G) lists.
constexpr int kRetrievalMergeChunk = 8;           // outputs per work item of a round
constexpr int kRetrievalMergeBufEntries = 12288;  // both buffers: 96 KB of shared memory at 8 bytes an entry

// Lists per group: the largest G with (G + ceil(G / 2)) * k <= kRetrievalMergeBufEntries (at least 2), at most n.
RAPO_HD int retrieval_merge_group(int n_splits, int k) {
  int g = 2 * kRetrievalMergeBufEntries / (3 * k);
  while (g > 2 && (g + (g + 1) / 2) * k > kRetrievalMergeBufEntries) --g;
  if (g < 2) g = 2;
  return n_splits < g ? n_splits : g;
}

// Entries of the merge buffer for (n_splits, k): the G-list buffer and the ceil(G / 2)-list buffer.
RAPO_HD size_t retrieval_merge_buffer_entries(int n_splits, int k) {
  const int g = retrieval_merge_group(n_splits, k);
  return size_t(g + (g + 1) / 2) * size_t(k);
}

// Work items of a round over c lists of k.
RAPO_HD int retrieval_merge_round_items(int c, int k) {
  return (c + 1) / 2 * ((k + kRetrievalMergeChunk - 1) / kRetrievalMergeChunk);
}

// Work item w of a round: outputs [t0, t0 + chunk) of merged list p from src lists 2p and 2p + 1 (c lists of k) into
// dst list p. Reads src only, writes only its own outputs: the items of a round are independent.
RAPO_HD void retrieval_merge_round_item(const float* src_s, const int32_t* src_i, float* dst_s, int32_t* dst_i, int c,
                                        int k, int w) {
  const int chunks = (k + kRetrievalMergeChunk - 1) / kRetrievalMergeChunk;
  const int p = w / chunks;
  const int t0 = (w - p * chunks) * kRetrievalMergeChunk;
  const int t1 = t0 + kRetrievalMergeChunk < k ? t0 + kRetrievalMergeChunk : k;
  const float* as = src_s + size_t(2 * p) * k;
  const int32_t* ai = src_i + size_t(2 * p) * k;
  float* os = dst_s + size_t(p) * k;
  int32_t* oi = dst_i + size_t(p) * k;
  if (2 * p + 1 >= c) {  // the odd last list: copied
    for (int t = t0; t < t1; ++t) {
      os[t] = as[t];
      oi[t] = ai[t];
    }
    return;
  }
  const float* bs = as + k;
  const int32_t* bi = ai + k;
  // Merge path: i = how many of the first t0 outputs come from list a (a wins ties, which only padding can have).
  // A[mid] precedes B[t0 - mid - 1] exactly when B's is not better; that holds for mid < i and fails from i on.
  int lo = 0, hi = t0;  // both lists have k > t0 entries, so every index below is in range
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (!topk_better(bs[t0 - mid - 1], bi[t0 - mid - 1], as[mid], ai[mid]))
      lo = mid + 1;
    else
      hi = mid;
  }
  int i = lo, j = t0 - lo;
  for (int t = t0; t < t1; ++t) {  // i + j == t < k: neither list runs out
    if (!topk_better(bs[j], bi[j], as[i], ai[i])) {
      os[t] = as[i];
      oi[t] = ai[i];
      ++i;
    } else {
      os[t] = bs[j];
      oi[t] = bi[j];
      ++j;
    }
  }
}

// The whole merge of query q, run by `ex`: ex.parallel_for(n, f) calls f(w) for the work items w in [0, n) that are
// this thread's (on the device: a block's threads stride over them; on the host: all of them), ex.sync() is a barrier
// (__syncthreads; nothing on the host). Every thread of the block must call this with the same arguments: the loop
// bounds, hence the barriers, are uniform. buf_s / buf_i hold retrieval_merge_buffer_entries(n_splits, k) entries
// (shared memory on the device). The workspace is read and rewritten in place: on the device it must be read through
// ordinary (coherent) loads, never the read-only cache. out_s / out_i: [Q, k] rows.
#ifdef __CUDACC__
#pragma nv_exec_check_disable  // Exec's members are __device__ (BlockExec) or host-only (RetrievalSerialExec)
#endif
template <class Exec>
RAPO_HD void retrieval_merge_query(const Exec& ex, float* ws_s, int32_t* ws_i, int n_splits, int64_t Q, int64_t q,
                                   int k, float* buf_s, int32_t* buf_i, float* out_s, int64_t* out_i) {
  const int G = retrieval_merge_group(n_splits, k);
  float* const a_s = buf_s;
  int32_t* const a_i = buf_i;
  float* const b_s = buf_s + size_t(G) * k;
  int32_t* const b_i = buf_i + size_t(G) * k;
  int m = n_splits;  // lists at this level: ws lists [0, m)
  for (;;) {
    const int groups = (m + G - 1) / G;
    for (int g = 0; g < groups; ++g) {
      const int first = g * G;
      const int cnt = m - first < G ? m - first : G;
      ex.parallel_for(cnt * k, [&](int idx) {
        const int l = idx / k;
        const int64_t off = (int64_t(first + l) * Q + q) * k + (idx - l * k);
        a_s[idx] = ws_s[off];
        a_i[idx] = ws_i[off];
      });
      ex.sync();
      float* src_s = a_s;
      int32_t* src_i = a_i;
      float* dst_s = b_s;
      int32_t* dst_i = b_i;
      for (int c = cnt; c > 1; c = (c + 1) / 2) {
        ex.parallel_for(retrieval_merge_round_items(c, k),
                        [&](int w) { retrieval_merge_round_item(src_s, src_i, dst_s, dst_i, c, k, w); });
        ex.sync();
        float* ts = src_s;
        src_s = dst_s;
        dst_s = ts;
        int32_t* ti = src_i;
        src_i = dst_i;
        dst_i = ti;
      }
      if (groups == 1) {
        ex.parallel_for(k, [&](int t) {
          out_s[q * k + t] = src_s[t];
          out_i[q * k + t] = int64_t(src_i[t]);
        });
      } else {
        ex.parallel_for(k, [&](int t) {
          const int64_t off = (int64_t(g) * Q + q) * k + t;
          ws_s[off] = src_s[t];
          ws_i[off] = src_i[t];
        });
      }
      ex.sync();  // the buffers are reloaded next; the lists written are read by other threads at the next level
    }
    if (groups == 1) return;
    m = groups;
  }
}

// The host instantiation of the merge: one thread doing every work item of a phase, the phases in order.
struct RetrievalSerialExec {
  template <class F>
  void parallel_for(int n, F&& f) const {
    for (int w = 0; w < n; ++w) f(w);
  }
  void sync() const {}
};

// The merge kernel's work on the host, for the tests: every query of a [n_splits, Q, k] workspace (rewritten in
// place, as on the device) into out_s / out_i [Q, k].
inline void retrieval_merge_splits_host(float* ws_s, int32_t* ws_i, int n_splits, int64_t Q, int k, float* out_s,
                                        int64_t* out_i) {
  if (n_splits < 1 || n_splits > kRetrievalMaxSplits || k < 1 || k > kRetrievalMaxK || Q < 0)
    throw std::invalid_argument("retrieval merge: expected n_splits in [1, " + std::to_string(kRetrievalMaxSplits) +
                                "], k in [1, " + std::to_string(kRetrievalMaxK) + "], Q >= 0, got " +
                                std::to_string(n_splits) + ", " + std::to_string(k) + ", " + std::to_string(Q));
  if (Q > 0 && (ws_s == nullptr || ws_i == nullptr || out_s == nullptr || out_i == nullptr))
    throw std::invalid_argument("retrieval merge: null pointer");
  std::vector<float> buf_s(retrieval_merge_buffer_entries(n_splits, k));
  std::vector<int32_t> buf_i(buf_s.size());
  for (int64_t q = 0; q < Q; ++q)
    retrieval_merge_query(RetrievalSerialExec{}, ws_s, ws_i, n_splits, Q, q, k, buf_s.data(), buf_i.data(), out_s,
                          out_i);
}

// ---- The split rule ---------------------------------------------------------------------------------------------
// A cost model of one search, in ns on an H100-class GPU; only the ratios steer the choice.
//   scan(n):  each block walks ceil(tiles / n) key tiles of ceil(D / 32) staged steps, each step an exposed HBM load
//             plus two barriers (~0.7 us); blocks beyond one wave of (blocks_per_sm x SMs) run in further waves. That
//             latency path L and the bandwidth floor F of reading the keys once per query tile (~3 TB/s) combine as
//             (L^4 + F^4)^(1/4): max(L, F) away from the knee, 1.19 F where L = F (queues lengthen the loads near
//             the peak), so more splits keep paying a little until L is well under F.
//   merge(n): one block per query (waves of 2 per SM): each entry streamed (~0.25 ns), and per group of lists one
//             load from L2 (~1 us) plus its rounds (~0.3 us each: a binary search in shared memory and a barrier).
// The split count is the candidate with the least scan + merge among n_max, n_max / 2, n_max / 4, ... 1, where
// n_max = one wave of scoring blocks (at most blocks_per_sm x SMs splits for one query tile), at most one split per key
// tile, kRetrievalMaxSplits, and a workspace under 1 GiB. More splits shorten the scan only until the keys' bandwidth
// floor, and every split adds k entries per query to merge: so a few queries with a small k get many splits (the merge
// is cheap), a large k or a short scan fewer.
struct RetrievalCudaCost {
  double scan_ns;
  double merge_ns;
};

constexpr double kRetrievalStepNs = 700.0;
constexpr double kRetrievalHbmBytesPerNs = 3000.0;
constexpr double kRetrievalMergeEntryNs = 0.25;
constexpr double kRetrievalMergeGroupNs = 1000.0;
constexpr double kRetrievalMergeRoundNs = 300.0;
constexpr int kRetrievalMergeBlocksPerSm = 2;

inline int retrieval_ceil_log2(int64_t x) {
  int r = 0;
  while ((int64_t(1) << r) < x) ++r;
  return r;
}

// Predicted merge time (one block) of n sorted lists of k.
inline double retrieval_merge_block_ns(int64_t n, int k) {
  const int64_t G = retrieval_merge_group(int(n), k);
  double t = double(n) * k * kRetrievalMergeEntryNs;
  int64_t m = n;
  for (;;) {
    const int64_t groups = (m + G - 1) / G;
    const int64_t last = m - (groups - 1) * G;  // lists of the last group; the others have G
    t += double(groups) * kRetrievalMergeGroupNs +
         (double(groups - 1) * retrieval_ceil_log2(G) + retrieval_ceil_log2(last)) * kRetrievalMergeRoundNs;
    if (groups == 1) return t;
    m = groups;
  }
}

inline RetrievalCudaCost retrieval_cuda_cost(int64_t Q, int64_t C, int64_t D, int k, int num_sms, int blocks_per_sm,
                                             int elem_bytes, int64_t n_splits) {
  if (n_splits < 1 || n_splits > kRetrievalMaxSplits || k < 1 || k > kRetrievalMaxK || Q < 0 || C < 0 || D < 1)
    throw std::invalid_argument("retrieval cost: expected n_splits in [1, " + std::to_string(kRetrievalMaxSplits) +
                                "], k in [1, " + std::to_string(kRetrievalMaxK) + "], Q, C >= 0, D >= 1, got " +
                                std::to_string(n_splits) + ", " + std::to_string(k) + ", " + std::to_string(Q) + ", " +
                                std::to_string(C) + ", " + std::to_string(D));
  const int64_t bq = retrieval_cuda_query_tile(Q, k);
  const int64_t q_tiles = (Q + bq - 1) / bq;
  const int64_t tiles = (C + kRetrievalKeyTile - 1) / kRetrievalKeyTile;
  const int64_t slots = int64_t(num_sms < 1 ? 1 : num_sms) * (blocks_per_sm < 1 ? 1 : blocks_per_sm);
  const int64_t waves = (q_tiles * n_splits + slots - 1) / slots;
  const int64_t steps = (tiles + n_splits - 1) / n_splits * ((D + kRetrievalDepthChunk - 1) / kRetrievalDepthChunk);
  const double latency = double(waves) * double(steps) * kRetrievalStepNs;
  const double floor = double(q_tiles) * double(C) * double(D) * elem_bytes / kRetrievalHbmBytesPerNs;
  const double l2 = latency * latency, f2 = floor * floor;
  const int64_t merge_slots = int64_t(num_sms < 1 ? 1 : num_sms) * kRetrievalMergeBlocksPerSm;
  const int64_t merge_waves = (Q + merge_slots - 1) / merge_slots;
  return {std::sqrt(std::sqrt(l2 * l2 + f2 * f2)), double(merge_waves) * retrieval_merge_block_ns(n_splits, k)};
}

// The number of key splits for a search of Q queries against C keys of D elements of elem_bytes, top k, on num_sms
// SMs holding blocks_per_sm scoring blocks each (the CUDA backend asks the occupancy calculator). Always in
// [1, kRetrievalMaxSplits] and at most max(1, ceil(C / 64)).
inline int retrieval_cuda_plan_splits(int64_t Q, int64_t C, int64_t D, int k, int num_sms, int blocks_per_sm,
                                      int elem_bytes) {
  if (Q < 1 || C < 1 || k < 1) return 1;
  if (D < 1) D = 1;
  const int64_t bq = retrieval_cuda_query_tile(Q, k);
  const int64_t q_tiles = (Q + bq - 1) / bq;
  const int64_t tiles = (C + kRetrievalKeyTile - 1) / kRetrievalKeyTile;
  const int64_t slots = int64_t(num_sms < 1 ? 1 : num_sms) * (blocks_per_sm < 1 ? 1 : blocks_per_sm);
  int64_t n_max = slots / q_tiles;
  if (n_max > tiles) n_max = tiles;
  if (n_max > kRetrievalMaxSplits) n_max = kRetrievalMaxSplits;
  const int64_t per_split_bytes = Q * int64_t(k) * 8;
  if (n_max > kRetrievalWorkspaceBytes / per_split_bytes) n_max = kRetrievalWorkspaceBytes / per_split_bytes;
  if (n_max < 1) return 1;
  int64_t best = n_max;
  double best_t = -1.0;
  for (int64_t n = n_max; n >= 1; n /= 2) {
    const RetrievalCudaCost c = retrieval_cuda_cost(Q, C, D, k, num_sms, blocks_per_sm, elem_bytes, n);
    const double t = c.scan_ns + c.merge_ns;
    if (best_t < 0.0 || t < best_t) {
      best = n;
      best_t = t;
    }
  }
  return int(best);
}

#ifdef RAPO_WITH_CUDA
// The CUDA backend's split count for a search (csrc/retrieval_cuda.cu): retrieval_cuda_plan_splits with the device's
// SM count and the scoring kernel's occupancy for (dtype, BQ, k). D <= 0: not given (taken as 384).
int retrieval_cuda_splits_for(int64_t Q, int64_t C, int64_t D, int k, int dtype, int device);
#endif

}  // namespace rapo
