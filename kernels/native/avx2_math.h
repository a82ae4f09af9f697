// Vector math the float32 ops for AVX2 + FMA CPUs share (attention_f32.cpp, layer_ops_f32.cpp), and the sum
// order of torch's CPU reductions, which layer_ops.cpp (bf16) uses too: one copy of each.
//
// Everything here is a fixed sequence of IEEE operations (no fast-math), so a value's bits depend only on its
// inputs: the property the "one numerics" of the ops rests on. The including file turns FMA contraction off.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "cpu_features.h"

// The first n (0..8) lanes set: for masked loads and stores of a row's tail.
AVX2_FMA inline __m256i lanes_below(int64_t n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))), idx);
}

// Sum of the 8 lanes, always in the same order: ((0+4) + (2+6)) + ((1+5) + (3+7)).
AVX2_FMA inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

AVX2_FMA inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 2^x for x <= 0 (clamped below at -126: the result is then ~2^-126 and the caller masks what must be 0).
// Degree 6 polynomial on [-0.5, 0.5] (relative error < 2e-7), times 2^n built in the exponent bits.
AVX2_FMA inline __m256 exp2_ps(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.5403530393381606e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618129107628477e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550410866482158e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.24022650695910072f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.6931471805599453f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// r[i] = column i of the 8 x 8 block r (in place).
AVX2_FMA inline void transpose8x8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; i++) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; i++) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; i++) {
    r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}

// Sleef's xexpf (sleefsimdsp.c, the build torch's Vectorized<float>::exp calls), operation for operation:
// FMAs where Sleef uses vmla, so the result is Sleef's to the bit.
AVX2_FMA inline __m256 sleef_expf(__m256 d) {
  const __m256i q = _mm256_cvtps_epi32(
      _mm256_mul_ps(d, _mm256_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f)));
  const __m256 qf = _mm256_cvtepi32_ps(q);
  __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-0.693145751953125f), d);
  s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-1.428606765330187045e-06f), s);
  __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
  u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
  // ldexp2: u * 2^(q >> 1) * 2^(q - (q >> 1))
  const __m256i q1 = _mm256_srai_epi32(q, 1), q2 = _mm256_sub_epi32(q, q1);
  const __m256i bias = _mm256_set1_epi32(0x7f);
  u = _mm256_mul_ps(u, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(q1, bias), 23)));
  u = _mm256_mul_ps(u, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(q2, bias), 23)));
  u = _mm256_and_ps(u, _mm256_cmp_ps(d, _mm256_set1_ps(-104.0f), _CMP_NLT_US));
  return _mm256_blendv_ps(u, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(_mm256_set1_ps(100.0f), d, _CMP_LT_OQ));
}

inline int64_t ceil_log2(int64_t x) {  // ATen's utils::CeilLog2
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// sum(x[0..n)) for n floats in the order of ATen's vectorized inner sum (SumKernel.cpp: vectorized_inner_sum
// -> row_sum -> multi_row_sum, ilp 4, 4 cascade levels) as torch runs it on every x86 CPU: from its AVX2
// build, 8 lanes (SumKernel.cpp registers no AVX512 sum: "slower with AVX512"); rows shorter than a vector take
// its scalar row_sum (4 partial sums, the rest onto the first). So a mean over a row (the rms statistic) is
// torch's bit for bit.
AVX2_FMA inline float torch_order_sum(const float* sq, int64_t n) {
  if (n < 8) {
    float partial[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int64_t whole = n / 4 * 4;
    for (int64_t k = 0; k < whole; k++) partial[k] += sq[k];
    for (int64_t k = whole; k < n; k++) partial[0] += sq[k];
    return ((partial[0] + partial[1]) + partial[2]) + partial[3];
  }
  const int64_t vecs = n / 8, rows = vecs / 4;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(rows) / 4);
  const int64_t level_step = int64_t(1) << level_power, level_mask = level_step - 1;
  __m256 acc[4][4];
  for (auto& level : acc)
    for (auto& a : level) a = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + level_step <= rows;) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], _mm256_loadu_ps(sq + (i * 4 + k) * 8));
    for (int64_t j = 1; j < 4; ++j) {
      for (int k = 0; k < 4; k++) {
        acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = _mm256_setzero_ps();
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < rows; ++i)
    for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], _mm256_loadu_ps(sq + (i * 4 + k) * 8));
  for (int64_t j = 1; j < 4; ++j)
    for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
  for (int64_t v = rows * 4; v < vecs; v++) acc[0][0] = _mm256_add_ps(acc[0][0], _mm256_loadu_ps(sq + v * 8));
  for (int k = 1; k < 4; k++) acc[0][0] = _mm256_add_ps(acc[0][0], acc[0][k]);
  float total = 0.0f;
  for (int64_t e = vecs * 8; e < n; e++) total += sq[e];
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc[0][0]);
  for (float lane : lanes) total += lane;
  return total;
}
