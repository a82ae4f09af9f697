// The arithmetic the native bf16 attention ops share (decode_attention.cpp, extend_attention.cpp), one copy,
// so that a query row (one query head at one position) gets the same bits from either op:
// - keys are cut into partitions of PARTITION_TOKENS at absolute positions (0, 512, ...);
// - a score (score_tile): 16 lanes over the features, each a vdpbf16ps chain over its feature pairs, then
//   one fixed reduction tree over 16 keys at once (transpose_reduce); times scale * log2(e);
// - a partition's softmax (softmax_row): the max of the row's visible scores, p = 2^(s - max) rounded to
//   bf16, their sum as 16 lanes over the keys' 16-key tiles in order, then one fixed reduction;
// - acc = p.V as one vdpbf16ps chain per feature over the key pairs in order, from 0 at the partition start;
// - partitions folded in order into (max, sum, acc) (fold_partition); the output is bf16(acc / sum).
// The ops' files are compiled with fp-contract off, so only the FMAs written out fuse.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

constexpr int64_t PARTITION_TOKENS = 512;  // a multiple of 128

#include "cpu_features.h"

// 2^x for x <= 0 (clamped below at -126: the result is then ~0 and the caller masks what must be 0).
AVX512_BF16 inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(x, n);  // [-0.5, 0.5]
  // 2^f = e^(f ln2), Taylor to degree 6 (relative error < 2e-7 on [-0.5, 0.5])
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022650695910072f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471805599453f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// out[h] = bf16(acc[h] / l[h]) for D elements. With bf16 p.V the accumulators hold each 32 features as
// unpacklo/unpackhi left them (lane 4j+k: feature 8j+k, then 8j+4+k): put back in order here.
AVX512_BF16 inline void store_normalized(uint16_t* out, const float* acc, float inv_l, int64_t d) {
  const __m512 s = _mm512_set1_ps(inv_l);
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t c = 0; c < d; c += 32) {
    const __m512 x = _mm512_mul_ps(_mm512_load_ps(acc + c), s), y = _mm512_mul_ps(_mm512_load_ps(acc + c + 16), s);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(x, lo, y)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c + 16),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(x, hi, y)));
  }
}

// 16 vectors -> one vector whose lane t is the sum of v[t]'s lanes (one fixed tree).
AVX512_BF16 inline __m512 transpose_reduce(__m512 v[16]) {
  __m512 r[8], s[4], u[2];
  for (int i = 0; i < 8; i++)  // lanes per 128-bit part: (v2i, v2i+1, v2i, v2i+1)
    r[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; i++) {  // (v4i .. v4i+3) in each 128-bit part
    __m512d a = _mm512_castps_pd(r[2 * i]), b = _mm512_castps_pd(r[2 * i + 1]);
    s[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; i++)  // 128-bit parts: (s2i: 0+1, 2+3), (s2i+1: 0+1, 2+3)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
}

// The raw scores (q . k) of one query row against 16 keys (keys[t] + offset: key t's D features): lane t.
// Per key, 16 lanes over the features (lane i: pairs i, i + 16, ... in order), then transpose_reduce.
template <int D>
AVX512_BF16 inline __m512 score_tile(const uint16_t* const* keys, int64_t offset, const uint16_t* q) {
  __m512bh qv[D / 32];
  for (int c = 0; c < D / 32; c++) qv[c] = (__m512bh)_mm512_loadu_si512(q + c * 32);
  __m512 dots[16];
  for (int t = 0; t < 16; t++) {
    __m512 a = _mm512_setzero_ps();
    for (int c = 0; c < D / 32; c++)
      a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(keys[t] + offset + c * 32), qv[c]);
    dots[t] = a;
  }
  return transpose_reduce(dots);
}

// One step of a p.V chain: acc + a . b over each lane's bf16 pair, `a` the broadcast pair (a row's
// probabilities). Both ops call this, so the operands' order is one.
AVX512_BF16 inline __m512 dot_pair(__m512 acc, int32_t a_pair, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(a_pair), (__m512bh)b);
}

AVX512_BF16 inline int32_t bf16_pair(const uint16_t* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return pair;
}

// Softmax of one row over the `visible` (1..PARTITION_TOKENS) keys of a partition: s holds the raw scores
// (q . k), 16-key tiles in order. Writes p = 2^(s * scale_log2 - max) as bf16 for the row's 16-key tiles
// (0 past visible); returns the max, and the sum of p in *l.
AVX512_BF16 inline float softmax_row(const float* s, int64_t visible, float scale_log2, uint16_t* probs, float* l) {
  const int64_t tiles = (visible + 15) / 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (visible - (tiles - 1) * 16)) - 1);
  const __m512 sc = _mm512_set1_ps(scale_log2);
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j + 1 < tiles; j++) mx = _mm512_max_ps(mx, _mm512_mul_ps(_mm512_loadu_ps(s + j * 16), sc));
  mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_mul_ps(_mm512_loadu_ps(s + (tiles - 1) * 16), sc));
  const float m = _mm512_reduce_max_ps(mx);
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < tiles; j++) {
    __m512 p = exp2_ps(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(s + j * 16), sc), mv));
    if (j + 1 == tiles) p = _mm512_maskz_mov_ps(tail, p);
    sum = _mm512_add_ps(sum, p);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + j * 16), (__m256i)_mm512_cvtneps_pbh(p));
  }
  *l = _mm512_reduce_add_ps(sum);
  return m;
}

// Fold a partition's (acc [d], m, l) of one row into the row's running (o [d], mo, lo), partitions in order;
// start from o = 0, mo = -inf, lo = 0.
AVX512_BF16 inline void fold_partition(const float* acc, float m, float l, float* o, float* mo, float* lo, int64_t d) {
  const float m_new = std::fmax(*mo, m);
  const float keep = std::exp2(*mo - m_new), w = std::exp2(m - m_new);  // keep = 0 on the first partition
  *lo = std::fmaf(l, w, *lo * keep);
  *mo = m_new;
  const __m512 kv = _mm512_set1_ps(keep), wv = _mm512_set1_ps(w);
  for (int64_t c = 0; c < d; c += 16)
    _mm512_storeu_ps(o + c, _mm512_fmadd_ps(_mm512_loadu_ps(acc + c), wv, _mm512_mul_ps(_mm512_loadu_ps(o + c), kv)));
}
