// CUDA backend of exact step retrieval: one fused kernel scores a tile of queries against a split of the keys and keeps
// each query's running top-k in shared memory; a second kernel merges the splits. No [Q, C] score matrix exists: a
// block holds one [BQ, BK] score tile at a time (docs/retrieval.md).
//
// score_topk_kernel<T, BQ>: grid (ceil(Q / BQ), n_splits), 128 threads (4 warps); split s scans the keys
// [retrieval_split_key_begin(s), retrieval_split_key_begin(s + 1)) (whole 64-key tiles, balanced).
//   - per key tile of BK = 64 keys, the [BQ, 64] dot products are accumulated over D in chunks of DK = 32 staged in
//     shared memory: fp16/bf16 on tensor cores (WMMA 16x16x16, fp32 accumulation), fp32 with FMA (exact fp32, no TF32);
//   - the tile goes to shared memory as fp32; each warp then owns query rows: it applies the metric
//     (retrieval_metric.h), the min_score / exclusion filter, and inserts admitted candidates into the row's sorted
//     top-k list (shared memory, order of topk.h) with a warp-parallel shift;
//   - the block writes its lists to the workspace [n_splits, Q, k].
// merge_kernel: one block of 256 threads per query merges the n_splits sorted lists by a tree of parallel merge-path
// rounds in shared memory (retrieval_merge_query in rapo/retrieval_cuda_plan.h, whose host instantiation is tested).
// BQ is 16 for k > 128 or Q <= 16, else 64 (lists take BQ * k * 8 bytes of shared memory; k <= 1024 fits on
// sm_80/sm_90). The split count comes from retrieval_cuda_splits_for: the cost model of retrieval_cuda_plan.h with the
// device's SM count and this kernel's occupancy.
// Launched on the caller's stream (torch's current stream).
// Not here: argument validation (rapo_fast/retrieval/buffer.py; the checks here only keep memory safe).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cfloat>
#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "rapo/cuda_guard.h"
#include "rapo/dtype.h"
#include "rapo/retrieval.h"
#include "rapo/retrieval_cuda_plan.h"
#include "rapo/retrieval_metric.h"
#include "rapo/topk.h"

namespace rapo {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int BK = kRetrievalKeyTile;     // keys per tile
constexpr int DK = kRetrievalDepthChunk;  // reduction chunk staged in shared memory
constexpr int kMaxSplits = kRetrievalMaxSplits;
constexpr const char* kOp = "retrieval CUDA";  // prefix of every error message

template <class T>
struct Stage;  // shared-memory row pitch (elements) of the staged Q/K chunks, chosen for alignment and few conflicts
template <>
struct Stage<float> {
  static constexpr int LD = DK + 4;  // 144 bytes: 16-byte aligned rows for vector stores
};
template <>
struct Stage<__half> {
  static constexpr int LD = DK + 8;  // 80 bytes: WMMA needs ldm % 8 == 0 and 32-byte aligned fragment pointers
};
template <>
struct Stage<__nv_bfloat16> {
  static constexpr int LD = DK + 8;
};

constexpr int LDS = BK + 4;  // fp32 score tile pitch (WMMA store needs ldm % 4 == 0)

__host__ __device__ constexpr size_t align128(size_t x) { return (x + 127) / 128 * 128; }

template <class T, int BQ>
struct Smem {
  static constexpr size_t q_off = 0;
  static constexpr size_t k_off = align128(q_off + sizeof(T) * BQ * Stage<T>::LD);
  static constexpr size_t s_off = align128(k_off + sizeof(T) * BK * Stage<T>::LD);
  static constexpr size_t kaux_off = align128(s_off + sizeof(float) * BQ * LDS);
  static constexpr size_t kgrp_off = align128(kaux_off + sizeof(float) * BK);
  static constexpr size_t qaux_off = align128(kgrp_off + sizeof(int64_t) * BK);
  static constexpr size_t qex_off = align128(qaux_off + sizeof(float) * BQ);
  static constexpr size_t n_off = align128(qex_off + sizeof(int64_t) * BQ);
  static constexpr size_t lists_off = align128(n_off + sizeof(int) * BQ);
  static size_t bytes(int k) { return lists_off + size_t(BQ) * k * (sizeof(float) + sizeof(int32_t)); }
};

// Stage rows [row0, row0 + ROWS) x cols [d0, d0 + DK) of a row-major matrix into shared memory, zero outside
// [0, nrows) x [0, D). vec: 16-byte loads are legal (D, the row stride and the base are multiples of 16 bytes).
template <class T, int ROWS>
__device__ __forceinline__ void stage(T* dst, const T* __restrict__ src, int64_t stride, int64_t row0, int64_t nrows,
                                      int64_t d0, int64_t D, bool vec) {
  constexpr int LD = Stage<T>::LD;
  if (vec) {
    constexpr int VE = 16 / sizeof(T);
    constexpr int NV = DK / VE;
    for (int idx = threadIdx.x; idx < ROWS * NV; idx += kThreads) {
      const int r = idx / NV, cv = idx % NV;
      const int64_t row = row0 + r, d = d0 + int64_t(cv) * VE;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (row < nrows && d < D) v = *reinterpret_cast<const uint4*>(src + row * stride + d);
      *reinterpret_cast<uint4*>(dst + r * LD + cv * VE) = v;
    }
  } else {
    for (int idx = threadIdx.x; idx < ROWS * DK; idx += kThreads) {
      const int r = idx / DK, c = idx % DK;
      const int64_t row = row0 + r, d = d0 + c;
      dst[r * LD + c] = (row < nrows && d < D) ? src[row * stride + d] : from_float<T>(0.0f);
    }
  }
}

// [BQ, BK] += Qs[BQ, DK] . Ks[BK, DK]^T. Tensor cores for 16-bit types, FMA for fp32.
template <class T, int BQ>
struct TileMma {
  static constexpr int TM = BQ / 16;
  using FragA = nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, T, nvcuda::wmma::row_major>;
  using FragB = nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, T, nvcuda::wmma::col_major>;
  using FragC = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float>;
  FragC acc[TM];

  __device__ void zero() {
    for (int i = 0; i < TM; ++i) nvcuda::wmma::fill_fragment(acc[i], 0.0f);
  }
  __device__ void step(const T* Qs, const T* Ks) {
    constexpr int LD = Stage<T>::LD;
    const int w = threadIdx.x / 32;  // warp w owns key columns [16w, 16w + 16) of the tile
#pragma unroll
    for (int kk = 0; kk < DK; kk += 16) {
      FragB b;
      nvcuda::wmma::load_matrix_sync(b, Ks + (w * 16) * LD + kk, LD);
#pragma unroll
      for (int i = 0; i < TM; ++i) {
        FragA a;
        nvcuda::wmma::load_matrix_sync(a, Qs + (i * 16) * LD + kk, LD);
        nvcuda::wmma::mma_sync(acc[i], a, b, acc[i]);
      }
    }
  }
  __device__ void store(float* S) {
    const int w = threadIdx.x / 32;
    for (int i = 0; i < TM; ++i)
      nvcuda::wmma::store_matrix_sync(S + (i * 16) * LDS + w * 16, acc[i], LDS, nvcuda::wmma::mem_row_major);
  }
};

template <int BQ>
struct TileMma<float, BQ> {
  static constexpr int RPT = BQ / 8;  // rows per thread; 16 threads across 4 column groups of 16
  float acc[RPT][4];

  __device__ void zero() {
    for (int i = 0; i < RPT; ++i)
      for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
  }
  __device__ void step(const float* Qs, const float* Ks) {
    constexpr int LD = Stage<float>::LD;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
#pragma unroll 4
    for (int d = 0; d < DK; ++d) {
      float b[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = Ks[(tx + 16 * j) * LD + d];
#pragma unroll
      for (int i = 0; i < RPT; ++i) {
        const float a = Qs[(ty * RPT + i) * LD + d];
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a, b[j], acc[i][j]);
      }
    }
  }
  __device__ void store(float* S) {
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    for (int i = 0; i < RPT; ++i)
      for (int j = 0; j < 4; ++j) S[(ty * RPT + i) * LDS + tx + 16 * j] = acc[i][j];
  }
};

// Insert (s, j) into a row's sorted list (best first) of n <= k entries, if it belongs in the top k. Warp-collective;
// every lane passes the same (s, j). The list only ever holds admitted candidates, so no sentinel values are needed.
__device__ void warp_insert(float* ls, int32_t* li, int* n_ptr, int k, float s, int32_t j) {
  const int lane = threadIdx.x & 31;
  const int n = *n_ptr;
  if (n == k && !topk_better(s, j, ls[k - 1], li[k - 1])) return;
  int cnt = 0;
  for (int i = lane; i < n; i += 32) cnt += topk_better(ls[i], li[i], s, j) ? 1 : 0;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) cnt += __shfl_xor_sync(0xffffffffu, cnt, off);
  const int pos = cnt;
  const int last = n < k ? n : k - 1;  // entries [pos, last) move one to the right; a full list drops its tail
  for (int base = last - 1; base >= pos; base -= 32) {
    const int i = base - lane;
    const bool act = i >= pos;
    float vs = 0.0f;
    int32_t vi = 0;
    if (act) {
      vs = ls[i];
      vi = li[i];
    }
    __syncwarp();
    if (act) {
      ls[i + 1] = vs;
      li[i + 1] = vi;
    }
    __syncwarp();
  }
  if (lane == 0) {
    ls[pos] = s;
    li[pos] = j;
    *n_ptr = n < k ? n + 1 : k;
  }
  __syncwarp();
}

// The block's shared-memory regions (layout Smem<T, BQ>): staged Q/K chunks, the fp32 score tile, per-key aux and
// group of the tile, per-row query aux, excluded group, list length, and the rows' sorted top-k lists.
template <class T>
struct SmemViews {
  T* Qs;
  T* Ks;
  float* S;
  float* kaux;
  int64_t* kgrp;
  float* qaux;
  int64_t* qex;
  int* n;
  float* list_s;
  int32_t* list_i;
};

template <class T, int BQ>
__device__ __forceinline__ SmemViews<T> carve_smem(unsigned char* smem, int k) {
  using L = Smem<T, BQ>;
  SmemViews<T> v;
  v.Qs = reinterpret_cast<T*>(smem + L::q_off);
  v.Ks = reinterpret_cast<T*>(smem + L::k_off);
  v.S = reinterpret_cast<float*>(smem + L::s_off);
  v.kaux = reinterpret_cast<float*>(smem + L::kaux_off);
  v.kgrp = reinterpret_cast<int64_t*>(smem + L::kgrp_off);
  v.qaux = reinterpret_cast<float*>(smem + L::qaux_off);
  v.qex = reinterpret_cast<int64_t*>(smem + L::qex_off);
  v.n = reinterpret_cast<int*>(smem + L::n_off);
  v.list_s = reinterpret_cast<float*>(smem + L::lists_off);
  v.list_i = reinterpret_cast<int32_t*>(smem + L::lists_off + sizeof(float) * size_t(BQ) * k);
  return v;
}

// Per-row setup: the query's aux value from its dtype-rounded elements, its excluded group, an empty list.
template <class T, int BQ>
__device__ __forceinline__ void init_rows(const RetrievalSearchParams& a, const SmemViews<T>& v, int64_t q0) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const T* queries = static_cast<const T*>(a.queries);
  for (int r = warp; r < BQ; r += kWarps) {
    const int64_t q = q0 + r;
    float ss = 0.0f;
    if (q < a.Q)
      for (int64_t d = lane; d < a.D; d += 32) {
        const float x = to_float(queries[q * a.query_row_stride + d]);
        ss = fmaf(x, x, ss);
      }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if (lane == 0) {
      v.qaux[r] = retrieval_query_aux(a.metric, ss);
      v.qex[r] = (q < a.Q && a.exclude != nullptr) ? a.exclude[q] : int64_t(-1);
      v.n[r] = 0;
    }
  }
}

// The [BQ, BK] dot products of query rows [q0, q0 + BQ) with keys [j0, j0 + BK) into v.S, and the keys' aux values
// and groups into v.kaux / v.kgrp (keys at or past c_end are padding). Ends with a block barrier.
template <class T, int BQ>
__device__ __forceinline__ void score_tile(const RetrievalSearchParams& a, const SmemViews<T>& v, TileMma<T, BQ>& mma,
                                           int64_t q0, int64_t j0, int64_t c_end, bool vec) {
  for (int c = threadIdx.x; c < BK; c += kThreads) {
    const int64_t j = j0 + c;
    v.kaux[c] = (j < c_end && a.metric != kMetricIP) ? a.key_aux[j] : 0.0f;
    v.kgrp[c] = (j < c_end && a.exclude != nullptr) ? a.groups[j] : int64_t(-1);
  }
  mma.zero();
  for (int64_t d0 = 0; d0 < a.D; d0 += DK) {
    stage<T, BQ>(v.Qs, static_cast<const T*>(a.queries), a.query_row_stride, q0, a.Q, d0, a.D, vec);
    stage<T, BK>(v.Ks, static_cast<const T*>(a.keys), a.key_row_stride, j0, c_end, d0, a.D, vec);
    __syncthreads();
    mma.step(v.Qs, v.Ks);
    __syncthreads();
  }
  mma.store(v.S);
  __syncthreads();
}

// Each warp takes query rows of the tile: metric, min_score / exclusion filter, admission against the row's current
// worst, and warp_insert of every admitted candidate (in lane order, so in slot order within the tile).
template <class T, int BQ>
__device__ __forceinline__ void admit_tile(const RetrievalSearchParams& a, const SmemViews<T>& v, int64_t q0,
                                           int64_t j0, int64_t c_end, float min_thr) {
  const int k = a.k;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  for (int r = warp; r < BQ; r += kWarps) {
    if (q0 + r >= a.Q) continue;
    float* ls = v.list_s + size_t(r) * k;
    int32_t* li = v.list_i + size_t(r) * k;
    const float qa = v.qaux[r];
    const int64_t ex = v.qex[r];
#pragma unroll
    for (int half = 0; half < BK / 32; ++half) {
      const int c = lane + 32 * half;
      const int64_t j = j0 + c;
      const float s = retrieval_finish(a.metric, v.S[r * LDS + c], qa, v.kaux[c]);
      bool pass = j < c_end && s >= min_thr && !(ex >= 0 && v.kgrp[c] == ex);
      if (pass && v.n[r] == k) pass = topk_better(s, int32_t(j), ls[k - 1], li[k - 1]);
      unsigned mask = __ballot_sync(0xffffffffu, pass);
      while (mask != 0u) {
        const int src = __ffs(mask) - 1;
        mask &= mask - 1;
        const float sb = __shfl_sync(0xffffffffu, s, src);
        const int32_t jb = __shfl_sync(0xffffffffu, int32_t(j), src);
        warp_insert(ls, li, v.n + r, k, sb, jb);
      }
    }
  }
}

// The block's lists to the workspace [n_splits, Q, k] of its split, padded with -inf / -1.
template <class T, int BQ>
__device__ __forceinline__ void write_lists(const RetrievalSearchParams& a, const SmemViews<T>& v, float* ws_s,
                                            int32_t* ws_i, int64_t q0, int split) {
  const int k = a.k;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  for (int r = warp; r < BQ; r += kWarps) {
    const int64_t q = q0 + r;
    if (q >= a.Q) continue;
    const int n = v.n[r];
    float* os = ws_s + (int64_t(split) * a.Q + q) * k;
    int32_t* oi = ws_i + (int64_t(split) * a.Q + q) * k;
    for (int i = lane; i < k; i += 32) {
      os[i] = i < n ? v.list_s[size_t(r) * k + i] : -INFINITY;
      oi[i] = i < n ? v.list_i[size_t(r) * k + i] : -1;
    }
  }
}

template <class T, int BQ>
__global__ void __launch_bounds__(kThreads)
    score_topk_kernel(RetrievalSearchParams a, float* __restrict__ ws_s, int32_t* __restrict__ ws_i, bool vec) {
  extern __shared__ __align__(128) unsigned char smem[];
  const SmemViews<T> v = carve_smem<T, BQ>(smem, a.k);
  const int64_t q0 = int64_t(blockIdx.x) * BQ;
  const int split = blockIdx.y;
  const int64_t c_begin = retrieval_split_key_begin(split, gridDim.y, a.C);
  const int64_t c_end = retrieval_split_key_begin(split + 1, gridDim.y, a.C);
  const float min_thr = fmaxf(a.min_score, -FLT_MAX);  // eligible: >= min_score and > -inf; NaN never passes

  init_rows<T, BQ>(a, v, q0);
  TileMma<T, BQ> mma;
  for (int64_t j0 = c_begin; j0 < c_end; j0 += BK) {
    score_tile<T, BQ>(a, v, mma, q0, j0, c_end, vec);
    admit_tile<T, BQ>(a, v, q0, j0, c_end, min_thr);
    __syncthreads();
  }
  __syncthreads();  // an empty split never ran the tile loop: make the row setup visible before reading it
  write_lists<T, BQ>(a, v, ws_s, ws_i, q0, split);
}

// One block per query: retrieval_merge_query (rapo/retrieval_cuda_plan.h) with the block's threads striding over each
// round's work items and __syncthreads between rounds. The workspace is read and rewritten in place by the block (a
// level's group results), so its pointers are neither const nor __restrict__: loads must stay coherent with the
// block's own earlier stores (no read-only cache path); __syncthreads orders them within the block.
constexpr int kMergeThreads = 256;

struct BlockExec {
  template <class F>
  __device__ __forceinline__ void parallel_for(int n, F&& f) const {
    for (int w = threadIdx.x; w < n; w += kMergeThreads) f(w);
  }
  __device__ __forceinline__ void sync() const { __syncthreads(); }
};

__global__ void __launch_bounds__(kMergeThreads)
    merge_kernel(float* ws_s, int32_t* ws_i, int n_splits, int64_t Q, int k, float* __restrict__ out_s,
                 int64_t* __restrict__ out_i) {
  extern __shared__ __align__(128) unsigned char smem[];
  const size_t entries = retrieval_merge_buffer_entries(n_splits, k);
  float* buf_s = reinterpret_cast<float*>(smem);
  int32_t* buf_i = reinterpret_cast<int32_t*>(smem + sizeof(float) * entries);
  retrieval_merge_query(BlockExec{}, ws_s, ws_i, n_splits, Q, int64_t(blockIdx.x), k, buf_s, buf_i, out_s, out_i);
}

// Raises Kernel's dynamic shared-memory limit on the current device to at least `bytes`, never lowers it. Searches
// with different k share a kernel from several host threads (the bindings release the GIL): a limit lowered between
// one search's raise and its launch would fail that launch.
template <auto Kernel>
cudaError_t raise_smem_limit(size_t bytes) {
  constexpr int kDevices = 64;
  static std::mutex mu;
  static int limit[kDevices] = {};
  int dev = 0;
  const cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(mu);
  if (dev >= 0 && dev < kDevices && int(bytes) <= limit[dev]) return cudaSuccess;
  const cudaError_t r = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  if (r == cudaSuccess && dev >= 0 && dev < kDevices) limit[dev] = int(bytes);
  return r;
}

template <class T, int BQ>
void launch(const RetrievalSearchParams& a, float* ws_s, int32_t* ws_i, int n_splits, cudaStream_t stream) {
  const size_t bytes = Smem<T, BQ>::bytes(a.k);
  auto kernel = score_topk_kernel<T, BQ>;
  cuda_check(raise_smem_limit<score_topk_kernel<T, BQ>>(bytes), kOp,
             "shared memory size (k too large for this device?)");
  constexpr int VE = 16 / sizeof(T);
  const bool vec = a.D % VE == 0 && a.key_row_stride % VE == 0 && a.query_row_stride % VE == 0 &&
                   reinterpret_cast<std::uintptr_t>(a.keys) % 16 == 0 &&
                   reinterpret_cast<std::uintptr_t>(a.queries) % 16 == 0;
  const dim3 grid(unsigned((a.Q + BQ - 1) / BQ), unsigned(n_splits));
  kernel<<<grid, kThreads, bytes, stream>>>(a, ws_s, ws_i, vec);
  cuda_check(cudaGetLastError(), kOp, "score_topk_kernel launch");
}

template <class T>
void launch_dtype(const RetrievalSearchParams& a, float* ws_s, int32_t* ws_i, int n_splits, cudaStream_t stream) {
  if (retrieval_cuda_query_tile(a.Q, a.k) == 64)
    launch<T, 64>(a, ws_s, ws_i, n_splits, stream);
  else
    launch<T, 16>(a, ws_s, ws_i, n_splits, stream);
}

// Scoring blocks of (T, BQ) resident per SM at k on the current device (at least 1; 1 when the shared memory does not
// fit, which the launch then reports), cached per (device, k): every search asks. Clears the error a refused
// attribute leaves, so that it is not taken for a later launch's.
template <class T, int BQ>
int scoring_blocks_per_sm(int k) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, int> cache;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 1;
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto it = cache.find({dev, k});
    if (it != cache.end()) return it->second;
  }
  const size_t bytes = Smem<T, BQ>::bytes(k);
  auto kernel = score_topk_kernel<T, BQ>;
  int blocks = 0;
  if (raise_smem_limit<score_topk_kernel<T, BQ>>(bytes) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, bytes) != cudaSuccess) {
    (void)cudaGetLastError();
    return 1;
  }
  blocks = blocks < 1 ? 1 : blocks;
  std::lock_guard<std::mutex> lock(mu);
  cache[{dev, k}] = blocks;
  return blocks;
}

template <class T>
int scoring_blocks_per_sm_dtype(int64_t Q, int k) {
  return retrieval_cuda_query_tile(Q, k) == 64 ? scoring_blocks_per_sm<T, 64>(k) : scoring_blocks_per_sm<T, 16>(k);
}

}  // namespace

int retrieval_cuda_splits_for(int64_t Q, int64_t C, int64_t D, int k, int dtype, int device) {
  if (k < 1 || Q < 0 || C < 0) throw std::invalid_argument("retrieval_cuda_splits: bad sizes");
  CudaDeviceGuard guard(device, kOp);
  int sms = 1;
  cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), kOp, "multiprocessor count");
  int blocks_per_sm = 1;
  switch (static_cast<DType>(dtype)) {
    case DType::F32: blocks_per_sm = scoring_blocks_per_sm_dtype<float>(Q, k); break;
    case DType::F16: blocks_per_sm = scoring_blocks_per_sm_dtype<__half>(Q, k); break;
    case DType::BF16: blocks_per_sm = scoring_blocks_per_sm_dtype<__nv_bfloat16>(Q, k); break;
    default:
      throw std::invalid_argument("retrieval_cuda_splits: dtype: expected float32, float16 or bfloat16, got code " +
                                  std::to_string(dtype));
  }
  const int elem_bytes = static_cast<DType>(dtype) == DType::F32 ? 4 : 2;
  const int splits = retrieval_cuda_plan_splits(Q, C, D > 0 ? D : 384, k, sms, blocks_per_sm, elem_bytes);
  guard.restore();
  return splits;
}

int retrieval_cuda_splits(int64_t Q, int64_t C, int k, int device) {
  return retrieval_cuda_splits_for(Q, C, 0, k, static_cast<int>(DType::F16), device);
}

void retrieval_search_cuda(const RetrievalSearchParams& a, float* ws_scores, int32_t* ws_slots, int n_splits,
                           int device, std::uintptr_t stream_handle) {
  check_retrieval_params(a, "retrieval CUDA");
  if (a.centre != nullptr)
    throw std::invalid_argument("retrieval CUDA: no centre (the caller centres l2 keys and queries itself)");
  if (n_splits < 1 || n_splits > kMaxSplits) throw std::invalid_argument("retrieval CUDA: bad n_splits");
  if (a.Q == 0) return;
  if (a.Q > INT32_MAX) throw std::invalid_argument("retrieval CUDA: more than 2^31 - 1 queries");
  if (ws_scores == nullptr || ws_slots == nullptr) throw std::invalid_argument("retrieval CUDA: null pointer");
  CudaDeviceGuard guard(device, kOp);
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  switch (static_cast<DType>(a.key_dtype)) {
    case DType::F32: launch_dtype<float>(a, ws_scores, ws_slots, n_splits, stream); break;
    case DType::F16: launch_dtype<__half>(a, ws_scores, ws_slots, n_splits, stream); break;
    case DType::BF16: launch_dtype<__nv_bfloat16>(a, ws_scores, ws_slots, n_splits, stream); break;
    default:
      throw std::invalid_argument("retrieval CUDA: keys: expected float32, float16 or bfloat16, got code " +
                                  std::to_string(a.key_dtype));
  }
  const size_t merge_bytes =
      retrieval_merge_buffer_entries(n_splits, a.k) * (sizeof(float) + sizeof(int32_t));  // <= 96 KB
  cuda_check(raise_smem_limit<merge_kernel>(merge_bytes), kOp, "merge shared memory size");
  merge_kernel<<<unsigned(a.Q), kMergeThreads, merge_bytes, stream>>>(ws_scores, ws_slots, n_splits, a.Q, a.k,
                                                                      a.out_scores, a.out_slots);
  cuda_check(cudaGetLastError(), kOp, "merge_kernel launch");
  guard.restore();
}

}  // namespace rapo
