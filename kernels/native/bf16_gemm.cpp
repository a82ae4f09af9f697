// y = x @ W^T (+ bias) for a bf16 W, bf16 activations, for CPUs with AVX512-BF16: the linears of a bf16
// model, at every row count (decode steps of a few rows, prefill chunks of hundreds).
//
// Built against torch's stable ABI (torch/csrc/stable): a few seconds to compile, no ATen headers.
// Registered as torch.ops.phaseserve_bf16_gemm.{bf16_linear, supported}.
//
// Layout (kernels/native_bf16.py packs it once at load, a pure reshuffle): output rows in groups of 16,
// for each group its k-pairs in order, each one zmm of bf16 pairs (lane i = output 16g + i, k and k + 1),
// zero-padded to whole groups and pairs: [groups, K / 2, 32]. A group is one contiguous stream of
// 32 K bytes. A k-pair multiplies a broadcast pair of activations (vdpbf16ps), so each accumulator
// holds 16 outputs and needs no horizontal sum.
//
// Work: the groups are cut into chunks of ~256 KB; a chunk (taken by one thread) runs every row tile
// (up to 24 accumulators: 4 groups x up to 6 rows, or 2 groups x up to 12 rows) over its groups, so its
// weights come from DRAM once and from L2 for the other row tiles. Every tile prefetches its groups'
// streams 32 lines ahead into L1; with several row tiles, the tiles of a chunk also prefetch the *next*
// chunk into L2, spread evenly over them: DRAM keeps streaming while the later row tiles run from cache
// (else memory and compute add up instead of overlapping: 16 rows took ~1.4x as long without it).
//
// Every output sums its k-pairs in order 0, 1, ... in one fp32 accumulator, then adds the bias and rounds
// to bf16 once; no tile shape, row count or thread count changes that order, so a row's result does not
// depend on the rows beside it or on the threads (batch invariance).

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <immintrin.h>

#include "cpu_features.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

constexpr int64_t GROUP = 16;                // outputs per group (one zmm of fp32)
constexpr int64_t LINE = 64;                 // bytes of one k-pair of one group: one cache line
constexpr int64_t CHUNK_BYTES = 256 * 1024;  // a chunk of groups: it and the next one fit in L2
constexpr int64_t NEAR_LINES = 32;           // how far ahead (k-pairs) a group's stream is prefetched

struct Packed {
  const uint16_t* data;  // [groups, kpairs, 32]
  int64_t groups, kpairs;
};

struct Rows {
  const uint16_t* x;     // [T, K] bf16, row stride ldx
  int64_t ldx, K;
  const float* bias;     // [groups * 16] fp32 (zeros without a bias)
  uint16_t* out;         // [T, N] bf16, row stride N
  int64_t N;
};

AVX512_BF16 inline __m512bh broadcast_pair(const uint16_t* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return (__m512bh)_mm512_set1_epi32(pair);
}

// NW groups from g0 x TT rows from t0, over the whole K. Prefetches pf_lines lines from pf into L2 on
// the way (a share of the next chunk).
template <int NW, int TT>
AVX512_BF16 void tile(const Packed& W, int64_t g0, const Rows& R, int64_t t0, const char* pf, int64_t pf_lines) {
  __m512 acc[TT][NW];
  for (int t = 0; t < TT; t++)
    for (int w = 0; w < NW; w++) acc[t][w] = _mm512_setzero_ps();
  const int64_t full = R.K / 2;
  const uint16_t* x = R.x + t0 * R.ldx;
  const uint16_t* wp = W.data + g0 * W.kpairs * 32;
  const int64_t pf_per_pair = full > 0 ? (pf_lines + full - 1) / full : 0;
  int64_t pf_done = 0;
  for (int64_t kp = 0; kp < full; kp++) {
    for (int64_t i = 0; i < pf_per_pair && pf_done < pf_lines; i++, pf_done++)
      _mm_prefetch(pf + pf_done * LINE, _MM_HINT_T1);
    // each group's own stream, NEAR_LINES ahead into L1 (past its end: the next group's start)
    for (int w = 0; w < NW; w++) _mm_prefetch((const char*)(wp + (w * W.kpairs + kp + NEAR_LINES) * 32), _MM_HINT_T0);
    __m512bh wv[NW];
    for (int w = 0; w < NW; w++) wv[w] = (__m512bh)_mm512_loadu_si512(wp + (w * W.kpairs + kp) * 32);
    for (int t = 0; t < TT; t++) {
      const __m512bh xv = broadcast_pair(x + t * R.ldx + 2 * kp);
      for (int w = 0; w < NW; w++) acc[t][w] = _mm512_dpbf16_ps(acc[t][w], wv[w], xv);
    }
  }
  if (R.K & 1) {  // the last k alone: its pair's other half is 0 in the activations and in the weights
    __m512bh wv[NW];
    for (int w = 0; w < NW; w++) wv[w] = (__m512bh)_mm512_loadu_si512(wp + (w * W.kpairs + full) * 32);
    for (int t = 0; t < TT; t++) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(x[t * R.ldx + R.K - 1]);
      for (int w = 0; w < NW; w++) acc[t][w] = _mm512_dpbf16_ps(acc[t][w], wv[w], xv);
    }
  }
  for (int w = 0; w < NW; w++) {
    const int64_t n0 = (g0 + w) * GROUP;
    const __m512 b = _mm512_loadu_ps(R.bias + n0);
    const int64_t valid = std::min<int64_t>(GROUP, R.N - n0);
    const __mmask16 mask = valid == GROUP ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    for (int t = 0; t < TT; t++)
      _mm256_mask_storeu_epi16(R.out + (t0 + t) * R.N + n0, mask,
                               (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[t][w], b)));
  }
}

// tile<NW, rows> for a row count known only at run time (1 .. TT).
template <int NW, int TT>
AVX512_BF16 void tile_rows(int64_t rows, const Packed& W, int64_t g0, const Rows& R, int64_t t0, const char* pf,
                           int64_t pf_lines) {
  if constexpr (TT > 0) {
    if (rows == TT) tile<NW, TT>(W, g0, R, t0, pf, pf_lines);
    else tile_rows<NW, TT - 1>(rows, W, g0, R, t0, pf, pf_lines);
  }
}

// Groups [c0, c1) through every row tile; prefetches groups [n0, n1) (the next chunk) meanwhile.
template <int NW, int TT>
AVX512_BF16 void run_chunk(const Packed& W, int64_t c0, int64_t c1, int64_t n0, int64_t n1, const Rows& R, int64_t T) {
  const int64_t row_tiles = (T + TT - 1) / TT;
  const int64_t group_tiles = (c1 - c0) / NW + (c1 - c0) % NW;
  const int64_t tiles = row_tiles * group_tiles;
  const char* next = reinterpret_cast<const char*>(W.data + n0 * W.kpairs * 32);
  // one row tile: the near prefetch alone keeps DRAM streaming (an L2 prefetch a chunk ahead measured slower)
  const int64_t next_lines = row_tiles > 1 ? (n1 - n0) * W.kpairs : 0;
  int64_t i = 0;
  int64_t t0 = 0;
  for (int64_t r = 0; r < row_tiles; r++) {
    // balanced row tiles (T = 16: 8 + 8, not 12 + 4)
    const int64_t rows = (T - t0) / (row_tiles - r) + ((T - t0) % (row_tiles - r) != 0);
    int64_t g = c0;
    for (; g + NW <= c1; g += NW, i++) {
      const int64_t a = i * next_lines / tiles, b = (i + 1) * next_lines / tiles;
      tile_rows<NW, TT>(rows, W, g, R, t0, next + a * LINE, b - a);
    }
    for (; g < c1; g++, i++) {
      const int64_t a = i * next_lines / tiles, b = (i + 1) * next_lines / tiles;
      tile_rows<1, TT>(rows, W, g, R, t0, next + a * LINE, b - a);
    }
    t0 += rows;
  }
}

template <int NW, int TT>
AVX512_BF16 void gemm(const Packed& W, const Rows& R, int64_t T) {
  const int64_t group_bytes = W.kpairs * LINE;
  // whole tiles of NW groups per chunk, ~CHUNK_BYTES of weights
  const int64_t chunk = NW * std::max<int64_t>(1, CHUNK_BYTES / (NW * group_bytes));
  const int64_t chunks = (W.groups + chunk - 1) / chunk;
  torch::stable::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; c++) {
      const int64_t c0 = c * chunk, c1 = std::min(c0 + chunk, W.groups);
      const int64_t n1 = c + 1 < end ? std::min(c1 + chunk, W.groups) : c1;  // nothing after the last
      run_chunk<NW, TT>(W, c0, c1, c1, n1, R, T);
    }
  });
}

// x [T, K] bf16 (dense rows); packed bf16 [ceil(N / 16), ceil(K / 2), 32] as kernels/native_bf16.py packs
// it; bias bf16 [N] or None; returns [T, N] bf16.
Tensor bf16_linear(Tensor x, Tensor packed, std::optional<Tensor> bias, int64_t n) {
  STD_TORCH_CHECK(cpu_supported(), "bf16_linear: this CPU lacks AVX512-BF16");
  STD_TORCH_CHECK(x.dim() == 2 && x.scalar_type() == ScalarType::BFloat16 && x.stride(1) == 1,
                  "bf16_linear: x must be bfloat16 [T, K] with dense rows");
  STD_TORCH_CHECK(x.is_cpu() && packed.is_cpu(), "bf16_linear: CPU tensors only");
  const int64_t T = x.size(0), K = x.size(1);
  STD_TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == ScalarType::BFloat16 &&
                      packed.size(2) == 2 * GROUP,
                  "bf16_linear: packed must be contiguous bfloat16 [N / 16, K / 2, 32]");
  const int64_t groups = packed.size(0), kpairs = packed.size(1);
  STD_TORCH_CHECK(kpairs == (K + 1) / 2, "bf16_linear: x has ", K, " features, the weight ", 2 * kpairs);
  STD_TORCH_CHECK(n > (groups - 1) * GROUP && n <= groups * GROUP, "bf16_linear: ", n,
                  " outputs do not fit a weight of ", groups, " groups of 16");
  std::vector<float> bias32(groups * GROUP, 0.0f);
  if (bias.has_value()) {
    const Tensor& b = *bias;
    STD_TORCH_CHECK(b.dim() == 1 && b.size(0) == n && b.scalar_type() == ScalarType::BFloat16 && b.is_contiguous() &&
                        b.is_cpu(),
                    "bf16_linear: bias must be contiguous bfloat16 [", n, "]");
    const uint16_t* bp = static_cast<const uint16_t*>(b.const_data_ptr());
    for (int64_t i = 0; i < n; i++) {
      const uint32_t bits = uint32_t(bp[i]) << 16;
      std::memcpy(&bias32[i], &bits, sizeof(float));
    }
  }
  Tensor out = torch::stable::new_empty(x, {T, n});
  if (T == 0 || n == 0) return out;
  const Packed W{static_cast<const uint16_t*>(packed.const_data_ptr()), groups, kpairs};
  const Rows R{static_cast<const uint16_t*>(x.const_data_ptr()), x.stride(0), K, bias32.data(),
               static_cast<uint16_t*>(out.mutable_data_ptr()), n};
  // up to 24 accumulators (32 zmm registers): one tile of 4 groups x T rows up to 6 rows (several groups
  // keep enough multiply-adds in flight), else tiles of 2 groups x up to 12 rows (fewer loads per
  // multiply-add than 4 x 6; measured ~equal or better at 8-32 rows)
  if (T <= 6) gemm<4, 6>(W, R, T);
  else gemm<2, 12>(W, R, T);
  return out;
}

bool supported() { return cpu_supported(); }

}  // namespace

STABLE_TORCH_LIBRARY(phaseserve_bf16_gemm, m) {
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("supported() -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(phaseserve_bf16_gemm, CPU, m) {
  m.impl("bf16_linear", TORCH_BOX(&bf16_linear));
}

STABLE_TORCH_LIBRARY_IMPL(phaseserve_bf16_gemm, CompositeExplicitAutograd, m) {
  m.impl("supported", TORCH_BOX(&supported));
}
