// The LoRA adapters' low-rank products added to a linear's output (kernels.lora_add; kernels/reference.py is the
// oracle and the fallback), for CPUs with AVX2 + FMA, float32 or bf16 activations and adapter matrices:
//   lora_add(y [T, out], x [T, in], rows [n], ends [G], a [G] x [M*r, in], b [G] x [r, out], cols [M+1]) -> bool
// rows holds G groups of rows, one per adapter, group g ending at ends[g], with its matrices a[g], b[g] (r = 0:
// none, the adapter targets none of the linear's modules). For each row i, in place: h = a . x[i] (r values
// per module), then for each module m,
// y[i, cols[m]:cols[m+1]] += h[m*r:(m+1)*r] . b[:, cols[m]:cols[m+1]], summed in float32 and rounded once to
// y's dtype (nearest even, as torch rounds). A fused linear's modules (q/k/v, gate/up) each expand only into
// their own output columns: no zero blocks are read.
//
// One numerics: every row is computed alone, in an order fixed by the shapes of x, a and b (never by n, the
// other rows or the thread count), so a row's bits do not depend on what shares its step. Returns false,
// doing nothing, for dtypes or layouts it does not take (the caller runs torch).
//
// `wide`: 16-float AVX512 vectors (the caller passes it where kernels/cpu_isa.py allows avx512-bf16), else
// 8-float AVX2 ones.
//
// Built against torch's stable ABI (torch/csrc/stable). Registered as torch.ops.phaseserve_lora.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <immintrin.h>

#include "cpu_features.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

// multiply-adds: below this a call stays on the calling thread (a decode step's rows: an OpenMP region waits
// for every thread, on a busy machine for one that is not running; a prefill chunk's rows are worth it)
constexpr int64_t WORK_PER_THREAD = 1 << 22;

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// f rounded to bf16 as c10::BFloat16 rounds it (nearest even on the bits, NaN -> 0x7fc0)
inline uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

AVX2_FMA inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

AVX2_FMA inline __m256 load8(const uint16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { return bf16_to_float(*p); }

// sum of a[0:n] * x[0:n] (x float32): four 8-lane accumulators over blocks of 32, then 8, then the tail one
// by one, the lanes added in a fixed tree: the order depends on n only.
template <typename W>
AVX2_FMA float dot(const W* a, const float* x, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = _mm256_fmadd_ps(load8(a + i), _mm256_loadu_ps(x + i), s0);
    s1 = _mm256_fmadd_ps(load8(a + i + 8), _mm256_loadu_ps(x + i + 8), s1);
    s2 = _mm256_fmadd_ps(load8(a + i + 16), _mm256_loadu_ps(x + i + 16), s2);
    s3 = _mm256_fmadd_ps(load8(a + i + 24), _mm256_loadu_ps(x + i + 24), s3);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(load8(a + i), _mm256_loadu_ps(x + i), s0);
  const __m256 s = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  float total = _mm_cvtss_f32(q);
  for (; i < n; i++) total = std::fma(load1(a + i), x[i], total);
  return total;
}

// acc[0:n] = sum over j < r of h[j] * b[j * ldb + 0:n], j in order (b's rows may be bf16): blocks of 32
// columns (four independent accumulators), then of 8, then the tail one by one.
template <typename W>
AVX2_FMA void expand(const float* h, const W* b, int64_t ldb, int64_t r, int64_t n, float* acc) {
  int64_t c = 0;
  for (; c + 32 <= n; c += 32) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const W* bc = b + c;
    for (int64_t j = 0; j < r; j++, bc += ldb) {
      const __m256 hj = _mm256_set1_ps(h[j]);
      a0 = _mm256_fmadd_ps(hj, load8(bc), a0);
      a1 = _mm256_fmadd_ps(hj, load8(bc + 8), a1);
      a2 = _mm256_fmadd_ps(hj, load8(bc + 16), a2);
      a3 = _mm256_fmadd_ps(hj, load8(bc + 24), a3);
    }
    _mm256_storeu_ps(acc + c, a0);
    _mm256_storeu_ps(acc + c + 8, a1);
    _mm256_storeu_ps(acc + c + 16, a2);
    _mm256_storeu_ps(acc + c + 24, a3);
  }
  for (; c + 8 <= n; c += 8) {
    __m256 a0 = _mm256_setzero_ps();
    for (int64_t j = 0; j < r; j++) a0 = _mm256_fmadd_ps(_mm256_set1_ps(h[j]), load8(b + j * ldb + c), a0);
    _mm256_storeu_ps(acc + c, a0);
  }
  for (; c < n; c++) {
    float s = 0.0f;
    for (int64_t j = 0; j < r; j++) s = std::fma(h[j], load1(b + j * ldb + c), s);
    acc[c] = s;
  }
}

// The same two loops on 16-float vectors, for AVX512 CPUs (the caller's `wide`): the same sums in another
// fixed order (the order depends on n and on `wide`, never on the rows).
AVX512_BF16 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

AVX512_BF16 inline __m512 load16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

template <typename W>
AVX512_BF16 float dot16(const W* a, const float* x, int64_t n) {
  __m512 s0 = _mm512_setzero_ps(), s1 = s0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = _mm512_fmadd_ps(load16(a + i), _mm512_loadu_ps(x + i), s0);
    s1 = _mm512_fmadd_ps(load16(a + i + 16), _mm512_loadu_ps(x + i + 16), s1);
  }
  for (; i + 16 <= n; i += 16) s0 = _mm512_fmadd_ps(load16(a + i), _mm512_loadu_ps(x + i), s0);
  float total = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
  for (; i < n; i++) total = std::fma(load1(a + i), x[i], total);
  return total;
}

template <typename W>
AVX512_BF16 void expand16(const float* h, const W* b, int64_t ldb, int64_t r, int64_t n, float* acc) {
  int64_t c = 0;
  for (; c + 64 <= n; c += 64) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const W* bc = b + c;
    for (int64_t j = 0; j < r; j++, bc += ldb) {
      const __m512 hj = _mm512_set1_ps(h[j]);
      a0 = _mm512_fmadd_ps(hj, load16(bc), a0);
      a1 = _mm512_fmadd_ps(hj, load16(bc + 16), a1);
      a2 = _mm512_fmadd_ps(hj, load16(bc + 32), a2);
      a3 = _mm512_fmadd_ps(hj, load16(bc + 48), a3);
    }
    _mm512_storeu_ps(acc + c, a0);
    _mm512_storeu_ps(acc + c + 16, a1);
    _mm512_storeu_ps(acc + c + 32, a2);
    _mm512_storeu_ps(acc + c + 48, a3);
  }
  for (; c + 16 <= n; c += 16) {
    __m512 a0 = _mm512_setzero_ps();
    for (int64_t j = 0; j < r; j++) a0 = _mm512_fmadd_ps(_mm512_set1_ps(h[j]), load16(b + j * ldb + c), a0);
    _mm512_storeu_ps(acc + c, a0);
  }
  for (; c < n; c++) {
    float s = 0.0f;
    for (int64_t j = 0; j < r; j++) s = std::fma(h[j], load1(b + j * ldb + c), s);
    acc[c] = s;
  }
}

// dot16 and expand16 for ROWS rows of one adapter at once: each loaded vector of a or b serves every row,
// and each row's sums are the same operations in the same order as alone (so the same bits).
constexpr int ROWS = 4;

template <typename W>
AVX512_BF16 void dot16_rows(const W* a, const float* const* x, int64_t n, float* out) {
  __m512 s0[ROWS], s1[ROWS];
#pragma GCC unroll 4
  for (int k = 0; k < ROWS; k++) s0[k] = s1[k] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 a0 = load16(a + i), a1 = load16(a + i + 16);
#pragma GCC unroll 4
    for (int k = 0; k < ROWS; k++) {
      s0[k] = _mm512_fmadd_ps(a0, _mm512_loadu_ps(x[k] + i), s0[k]);
      s1[k] = _mm512_fmadd_ps(a1, _mm512_loadu_ps(x[k] + i + 16), s1[k]);
    }
  }
  for (; i + 16 <= n; i += 16) {
    const __m512 a0 = load16(a + i);
#pragma GCC unroll 4
    for (int k = 0; k < ROWS; k++) s0[k] = _mm512_fmadd_ps(a0, _mm512_loadu_ps(x[k] + i), s0[k]);
  }
  for (int k = 0; k < ROWS; k++) {
    float total = _mm512_reduce_add_ps(_mm512_add_ps(s0[k], s1[k]));
    for (int64_t t = i; t < n; t++) total = std::fma(load1(a + t), x[k][t], total);
    out[k] = total;
  }
}

template <typename W>
AVX512_BF16 void expand16_rows(const float* const* h, const W* b, int64_t ldb, int64_t r, int64_t n,
                               float* const* acc) {
  int64_t c = 0;
  for (; c + 64 <= n; c += 64) {
    __m512 s[ROWS][4];
#pragma GCC unroll 4
    for (int k = 0; k < ROWS; k++) s[k][0] = s[k][1] = s[k][2] = s[k][3] = _mm512_setzero_ps();
    const W* bc = b + c;
    for (int64_t j = 0; j < r; j++, bc += ldb) {
      const __m512 b0 = load16(bc), b1 = load16(bc + 16), b2 = load16(bc + 32), b3 = load16(bc + 48);
#pragma GCC unroll 4
      for (int k = 0; k < ROWS; k++) {
        const __m512 hj = _mm512_set1_ps(h[k][j]);
        s[k][0] = _mm512_fmadd_ps(hj, b0, s[k][0]);
        s[k][1] = _mm512_fmadd_ps(hj, b1, s[k][1]);
        s[k][2] = _mm512_fmadd_ps(hj, b2, s[k][2]);
        s[k][3] = _mm512_fmadd_ps(hj, b3, s[k][3]);
      }
    }
    for (int k = 0; k < ROWS; k++)
      for (int q = 0; q < 4; q++) _mm512_storeu_ps(acc[k] + c + 16 * q, s[k][q]);
  }
  for (; c + 16 <= n; c += 16) {
    __m512 s[ROWS];
#pragma GCC unroll 4
    for (int k = 0; k < ROWS; k++) s[k] = _mm512_setzero_ps();
    for (int64_t j = 0; j < r; j++) {
      const __m512 b0 = load16(b + j * ldb + c);
#pragma GCC unroll 4
      for (int k = 0; k < ROWS; k++) s[k] = _mm512_fmadd_ps(_mm512_set1_ps(h[k][j]), b0, s[k]);
    }
    for (int k = 0; k < ROWS; k++) _mm512_storeu_ps(acc[k] + c, s[k]);
  }
  for (int k = 0; k < ROWS; k++)
    for (int64_t t = c; t < n; t++) {
      float v = 0.0f;
      for (int64_t j = 0; j < r; j++) v = std::fma(h[k][j], load1(b + j * ldb + t), v);
      acc[k][t] = v;
    }
}

// f rounded to bf16 as float_to_bf16 rounds it, 8 at a time, stored as bf16
AVX2_FMA inline void store8_bf16(uint16_t* p, __m256 f) {
  __m256i b = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  b = _mm256_srli_epi32(b, 16);
  b = _mm256_blendv_epi8(b, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

AVX2_FMA inline void store8(float* p, __m256 f) { _mm256_storeu_ps(p, f); }
AVX2_FMA inline void store8(uint16_t* p, __m256 f) { store8_bf16(p, f); }
inline void store1(float* p, float f) { *p = f; }
inline void store1(uint16_t* p, float f) { *p = float_to_bf16(f); }

// The products of one row (x row xr, y row yr) with its adapter's matrices ap [M*r, in], bp [r, out].
template <typename Y, typename W>
AVX2_FMA void add_row(Y* yr, const Y* xr, const W* ap, const W* bp, int64_t in, int64_t out, int64_t r,
                      const std::vector<int64_t>& cols, bool wide, float* xf, float* h, float* acc) {
  const int64_t modules = static_cast<int64_t>(cols.size()) - 1;
  int64_t i = 0;
  for (; i + 8 <= in; i += 8) _mm256_storeu_ps(xf + i, load8(xr + i));
  for (; i < in; i++) xf[i] = load1(xr + i);
  for (int64_t j = 0; j < r * modules; j++) h[j] = wide ? dot16(ap + j * in, xf, in) : dot(ap + j * in, xf, in);
  for (int64_t m = 0; m < modules; m++) {
    if (wide) expand16(h + m * r, bp + cols[m], out, r, cols[m + 1] - cols[m], acc + cols[m]);
    else expand(h + m * r, bp + cols[m], out, r, cols[m + 1] - cols[m], acc + cols[m]);
  }
  int64_t c = 0;  // y + acc, rounded once (the same sum and rounding in both loops)
  for (; c + 8 <= out; c += 8) store8(yr + c, _mm256_add_ps(load8(yr + c), _mm256_loadu_ps(acc + c)));
  for (; c < out; c++) store1(yr + c, load1(yr + c) + acc[c]);
}

// ROWS rows of one adapter on the wide path: add_row's operations for each row, the matrices' vectors
// loaded once for all of them. rows_y/rows_x: the rows' y and x; xf, h, acc: ROWS scratch rows each.
template <typename Y, typename W>
AVX2_FMA void add_rows(Y* const* yr, const Y* const* xr, const W* ap, const W* bp, int64_t in, int64_t out,
                       int64_t r, const std::vector<int64_t>& cols, float* const* xf, float* const* h,
                       float* const* acc) {
  const int64_t modules = static_cast<int64_t>(cols.size()) - 1;
  for (int k = 0; k < ROWS; k++) {
    int64_t i = 0;
    for (; i + 8 <= in; i += 8) _mm256_storeu_ps(xf[k] + i, load8(xr[k] + i));
    for (; i < in; i++) xf[k][i] = load1(xr[k] + i);
  }
  float hj[ROWS];
  for (int64_t j = 0; j < r * modules; j++) {
    dot16_rows(ap + j * in, xf, in, hj);
    for (int k = 0; k < ROWS; k++) h[k][j] = hj[k];
  }
  for (int64_t m = 0; m < modules; m++) {
    const float* hm[ROWS];
    float* am[ROWS];
    for (int k = 0; k < ROWS; k++) hm[k] = h[k] + m * r, am[k] = acc[k] + cols[m];
    expand16_rows(hm, bp + cols[m], out, r, cols[m + 1] - cols[m], am);
  }
  for (int k = 0; k < ROWS; k++) {
    int64_t c = 0;  // as add_row
    for (; c + 8 <= out; c += 8) store8(yr[k] + c, _mm256_add_ps(load8(yr[k] + c), _mm256_loadu_ps(acc[k] + c)));
    for (; c < out; c++) store1(yr[k] + c, load1(yr[k] + c) + acc[k][c]);
  }
}

template <typename Y, typename W>
void run(Tensor& y, const Tensor& x, const int64_t* rows, const std::vector<int64_t>& group_of,
         const std::vector<Tensor>& a, const std::vector<Tensor>& b, const std::vector<int64_t>& cols, bool wide) {
  const int64_t in = x.size(1), out = y.size(1), n = static_cast<int64_t>(group_of.size());
  const int64_t ldx = x.stride(0), ldy = y.stride(0);
  // untyped: bf16 is read and written as its bits (uint16_t)
  const Y* xp = static_cast<const Y*>(x.const_data_ptr());
  Y* yp = static_cast<Y*>(y.mutable_data_ptr());
  std::vector<const W*> ap(a.size()), bp(b.size());
  int64_t max_r = 0;
  for (size_t g = 0; g < a.size(); g++) {
    ap[g] = static_cast<const W*>(a[g].const_data_ptr());
    bp[g] = static_cast<const W*>(b[g].const_data_ptr());
    max_r = std::max(max_r, b[g].size(0));
  }
  const int64_t modules = static_cast<int64_t>(cols.size()) - 1;
  const int64_t work = max_r * (modules * in + out);  // multiply-adds of a row
  torch::stable::parallel_for(0, n, std::max<int64_t>(1, WORK_PER_THREAD / std::max<int64_t>(1, work)),
                              [&](int64_t begin, int64_t end) {
    std::vector<float> xf(in * ROWS), h(max_r * modules * ROWS), acc(out * ROWS);
    for (int64_t k = begin; k < end; k++) {
      const int64_t g = group_of[k], r = b[g].size(0);
      if (r == 0) continue;  // the adapter targets none of this linear's modules
      if (wide && k + ROWS <= end && group_of[k + ROWS - 1] == g) {  // ROWS rows of this adapter at once
        Y* yr[ROWS];
        const Y* xr[ROWS];
        float *xs[ROWS], *hs[ROWS], *as[ROWS];
        for (int q = 0; q < ROWS; q++) {
          yr[q] = yp + rows[k + q] * ldy, xr[q] = xp + rows[k + q] * ldx;
          xs[q] = xf.data() + q * in, hs[q] = h.data() + q * max_r * modules, as[q] = acc.data() + q * out;
        }
        add_rows(yr, xr, ap[g], bp[g], in, out, r, cols, xs, hs, as);
        k += ROWS - 1;
        continue;
      }
      add_row(yp + rows[k] * ldy, xp + rows[k] * ldx, ap[g], bp[g], in, out, r, cols, wide, xf.data(), h.data(),
              acc.data());
    }
  });
}

bool is_rows(const Tensor& t) { return t.dim() == 2 && t.stride(1) == 1; }

bool is_float(ScalarType t) { return t == ScalarType::Float || t == ScalarType::BFloat16; }

bool lora_add(Tensor y, Tensor x, Tensor rows, std::vector<int64_t> ends, std::vector<Tensor> a,
              std::vector<Tensor> b, std::vector<int64_t> cols, bool wide) {
  STD_TORCH_CHECK(cpu_supports_avx2_fma(), "lora_add: this CPU lacks AVX2 and FMA");
  STD_TORCH_CHECK(!wide || cpu_supported(), "lora_add: wide needs AVX512 (cpu_features.h)");
  STD_TORCH_CHECK(ends.size() == a.size() && a.size() == b.size() && !a.empty(),
                  "lora_add: one end, a and b per group");
  const ScalarType yt = y.scalar_type(), wt = a[0].scalar_type();
  bool takes = is_float(yt) && x.scalar_type() == yt && is_float(wt) && y.is_cpu() && x.is_cpu() && is_rows(y) &&
               is_rows(x) && rows.is_cpu() && rows.scalar_type() == ScalarType::Long && rows.dim() == 1 &&
               rows.is_contiguous() && cols.size() >= 2;
  for (size_t g = 0; g < a.size() && takes; g++)
    takes = a[g].scalar_type() == wt && b[g].scalar_type() == wt && a[g].is_cpu() && b[g].is_cpu() &&
            a[g].is_contiguous() && b[g].is_contiguous();
  if (!takes) return false;
  const int64_t modules = static_cast<int64_t>(cols.size()) - 1, n = rows.size(0);
  STD_TORCH_CHECK(cols[0] == 0 && cols[modules] == y.size(1) && x.size(0) == y.size(0),
                  "lora_add: cols must bound the modules' columns of y");
  for (int64_t m = 0; m < modules; m++) STD_TORCH_CHECK(cols[m] <= cols[m + 1], "lora_add: cols must not decrease");
  for (size_t g = 0; g < a.size(); g++) {
    const int64_t r = b[g].dim() == 2 ? b[g].size(0) : -1;
    STD_TORCH_CHECK(r == 0 || (a[g].dim() == 2 && a[g].size(0) == modules * r && a[g].size(1) == x.size(1) &&
                               b[g].size(1) == y.size(1)),
                    "lora_add: a must be [modules * r, in] and b [r, out] (r = 0: no product)");
  }
  const int64_t* rp = rows.const_data_ptr<int64_t>();
  std::vector<int64_t> group_of(n);
  int64_t start = 0;
  for (size_t g = 0; g < ends.size(); g++) {
    STD_TORCH_CHECK(ends[g] >= start && ends[g] <= n, "lora_add: ends must not decrease nor pass the rows");
    std::fill(group_of.begin() + start, group_of.begin() + ends[g], static_cast<int64_t>(g));
    start = ends[g];
  }
  STD_TORCH_CHECK(start == n, "lora_add: the last group must end at the last row");
  for (int64_t k = 0; k < n; k++)
    STD_TORCH_CHECK(rp[k] >= 0 && rp[k] < y.size(0), "lora_add: row ", rp[k], " is outside y");
  if (n == 0) return true;
  if (yt == ScalarType::Float) {
    if (wt == ScalarType::Float) run<float, float>(y, x, rp, group_of, a, b, cols, wide);
    else run<float, uint16_t>(y, x, rp, group_of, a, b, cols, wide);
  } else {
    if (wt == ScalarType::Float) run<uint16_t, float>(y, x, rp, group_of, a, b, cols, wide);
    else run<uint16_t, uint16_t>(y, x, rp, group_of, a, b, cols, wide);
  }
  return true;
}

bool supported() { return cpu_supports_avx2_fma(); }

}  // namespace

STABLE_TORCH_LIBRARY(phaseserve_lora, m) {
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor rows, int[] ends, Tensor[] a, Tensor[] b, int[] cols, bool wide) -> bool");
  m.def("supported() -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(phaseserve_lora, CPU, m) { m.impl("lora_add", TORCH_BOX(&lora_add)); }

STABLE_TORCH_LIBRARY_IMPL(phaseserve_lora, CompositeExplicitAutograd, m) {
  m.impl("supported", TORCH_BOX(&supported));
}
