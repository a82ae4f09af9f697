// Vector math the native attention ops share (decode_attention.cpp, extend_attention.cpp): one copy, so
// the two ops' softmax and output rounding stay the same.
#pragma once

#include <immintrin.h>

#include <cstdint>

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
