// A decoder layer's elementwise work for bf16 CPU tensors, each op one pass over its rows, for CPUs with
// AVX512-BF16 (kernels/__init__.py dispatches here; kernels/reference.py is the oracle):
//   add_rms_norm(x, residual?, weight, eps) -> (norm(x + residual) * weight, x + residual)
//   silu_and_mul(x [T, 2I]) -> silu(gate) * up [T, I]
//   rotary_and_write_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slots): rotates q and k in place
//     (neox rotate-half) and stores the rotated k and v at their cache slots (slots < 0 skipped); returns
//     false, doing nothing, for dtypes and layouts it does not take (the caller runs torch)
//   argmax(logits [R, V]) -> int64 [R]: torch.argmax(logits.float(), dim=-1), without the fp32 copy
// Each replaces 5-10 small aten ops (dtype copies, temporaries) whose per-op overhead dominated at the few
// rows of a decode step.
//
// Bit-identical to the torch reference: every value is rounded to bf16 where torch rounds it (round to
// nearest even, done on the integer bits as torch does: vcvtneps2bf16 would flush denormals), products and
// sums are separate fp32 operations where torch's are (no FMA contraction: see the pragma), the rms
// statistic sums the squares in the order of torch's vectorized CPU sum (SumKernel.cpp's cascade, from
// its AVX2 build: 8 lanes), and silu's exp is Sleef's expf_u10 (the one torch's vectorized silu calls),
// operation for operation, tabulated once for all 65536 bf16 gates. tests/test_native_layer_ops.py
// checks equality (silu on every gate, the sum order over thousands of rows with outliers). Rows are
// independent and a row's arithmetic never depends on the batch or the thread count.
//
// Built against torch's stable ABI (torch/csrc/stable). Registered as torch.ops.phaseserve_layer_ops.

#pragma GCC optimize("fp-contract=off")  // torch rounds a*b and the sum separately: never fuse to an FMA

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <immintrin.h>

#include "avx2_math.h"
#include "op_args.h"
#include "row_tensors.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

constexpr int64_t ELEMS_PER_THREAD = 32768;  // below this much work a call stays on the calling thread
constexpr const char* LEVEL = "AVX512-BF16";  // what the ops need, as their errors say it

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1); }

// n <= 16 bf16 values from p as fp32 (the rest 0).
AVX512_BF16 inline __m512 load_bf16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

AVX512_BF16 inline __m512 load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// x rounded to bf16 exactly as c10::BFloat16 rounds (nearest even on the bits, denormals kept, NaN ->
// 0x7fc0), left as fp32 with the low half zero: ready for more fp32 arithmetic or to be stored.
AVX512_BF16 inline __m512 round_bf16(__m512 x) {
  __m512i b = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  b = _mm512_and_si512(b, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  b = _mm512_mask_mov_epi32(b, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
  return _mm512_castsi512_ps(b);
}

// n <= 16 values rounded by round_bf16, stored as bf16.
AVX512_BF16 inline void store_rounded(uint16_t* p, __m512 r, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(r), 16)));
}

// 32 values rounded by round_bf16 (elements 0-15 in lo, 16-31 in hi), stored as bf16: one permute of
// the high halves.
AVX512_BF16 inline void store_rounded(uint16_t* p, __m512 lo, __m512 hi) {
  const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27,
                                       25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  _mm512_storeu_si512(p, _mm512_permutex2var_epi16(_mm512_castps_si512(lo), odd, _mm512_castps_si512(hi)));
}

// ------------------------------------------------------------------------------------------------ rms norm

// One row: h = bf16(x + r) (when r), then out = bf16(w * bf16(h * rsqrt(mean(h^2) + eps))).
// sq: n floats of scratch. 32 elements a step where it can (one permute stores them), then 16 masked.
AVX512_BF16 void rms_norm_row(const uint16_t* x, const uint16_t* r, const uint16_t* w, uint16_t* h_out,
                              uint16_t* out, int64_t n, float eps, float* sq) {
  const uint16_t* h = r != nullptr ? h_out : x;
  int64_t c = 0;
  if (r != nullptr) {
    for (; c + 32 <= n; c += 32) {
      const __m512 lo = round_bf16(_mm512_add_ps(load_bf16(x + c), load_bf16(r + c)));
      const __m512 hi = round_bf16(_mm512_add_ps(load_bf16(x + c + 16), load_bf16(r + c + 16)));
      store_rounded(h_out + c, lo, hi);
      _mm512_storeu_ps(sq + c, _mm512_mul_ps(lo, lo));
      _mm512_storeu_ps(sq + c + 16, _mm512_mul_ps(hi, hi));
    }
    for (; c < n; c += 16) {
      const __mmask16 m = tail_mask(n - c);
      const __m512 v = round_bf16(_mm512_add_ps(load_bf16(x + c, m), load_bf16(r + c, m)));
      store_rounded(h_out + c, v, m);
      _mm512_mask_storeu_ps(sq + c, m, _mm512_mul_ps(v, v));
    }
  } else {
    for (; c < n; c += 16) {
      const __mmask16 m = tail_mask(n - c);
      const __m512 v = load_bf16(x + c, m);
      _mm512_mask_storeu_ps(sq + c, m, _mm512_mul_ps(v, v));
    }
  }
  // torch: sum(h^2).div_(n).add_(eps), then rsqrt as 1 / sqrt
  const float mean = torch_order_sum(sq, n) / static_cast<float>(n);
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_sqrt_ps(_mm512_set1_ps(mean + eps)));
  for (c = 0; c + 32 <= n; c += 32) {
    const __m512 y0 = round_bf16(_mm512_mul_ps(load_bf16(h + c), inv));
    const __m512 y1 = round_bf16(_mm512_mul_ps(load_bf16(h + c + 16), inv));
    store_rounded(out + c, round_bf16(_mm512_mul_ps(load_bf16(w + c), y0)),
                  round_bf16(_mm512_mul_ps(load_bf16(w + c + 16), y1)));
  }
  for (; c < n; c += 16) {
    const __mmask16 m = tail_mask(n - c);
    const __m512 y = round_bf16(_mm512_mul_ps(load_bf16(h + c, m), inv));
    store_rounded(out + c, round_bf16(_mm512_mul_ps(load_bf16(w + c, m), y)), m);
  }
}

std::tuple<Tensor, Tensor> add_rms_norm_impl(Tensor x, Tensor* residual, Tensor weight, double eps) {
  op_args::check_cpu(cpu_supported(), "add_rms_norm", LEVEL);
  const int64_t n = op_args::check_norm_args(x, residual, weight, op_args::BF16);
  if (weight.stride(0) != 1) weight = torch::stable::contiguous(weight);
  const int64_t xs = as_rows(x);
  const int64_t rs = residual != nullptr ? as_rows(*residual) : 0;
  const std::vector<int64_t> shape = shape_of(x);
  Tensor out = empty(shape, aoti_torch_dtype_bfloat16());
  Tensor h = residual != nullptr ? empty(shape, aoti_torch_dtype_bfloat16()) : out;
  const int64_t rows = rows_of(x);
  if (rows == 0 || n == 0) return {out, h};
  const auto* xp = static_cast<const uint16_t*>(x.const_data_ptr());
  const auto* rp = residual != nullptr ? static_cast<const uint16_t*>(residual->const_data_ptr()) : nullptr;
  const auto* wp = static_cast<const uint16_t*>(weight.const_data_ptr());
  auto* op = static_cast<uint16_t*>(out.mutable_data_ptr());
  auto* hp = static_cast<uint16_t*>(h.mutable_data_ptr());
  const float feps = static_cast<float>(eps);
  torch::stable::parallel_for(0, rows, std::max<int64_t>(1, ELEMS_PER_THREAD / n), [&](int64_t begin, int64_t end) {
    std::vector<float> sq(n + 16);
    for (int64_t i = begin; i < end; i++)
      rms_norm_row(xp + i * xs, rp != nullptr ? rp + i * rs : nullptr, wp, hp + i * n, op + i * n, n, feps,
                   sq.data());
  });
  return {out, h};
}

Tensor rms_norm(Tensor x, Tensor weight, double eps) { return std::get<0>(add_rms_norm_impl(x, nullptr, weight, eps)); }

std::tuple<Tensor, Tensor> add_rms_norm(Tensor x, Tensor residual, Tensor weight, double eps) {
  return add_rms_norm_impl(x, &residual, weight, eps);
}

// ------------------------------------------------------------------------------------------------ silu * up

// Sleef's xexpf (sleefsimdsp.c, the AVX512F build torch's Vectorized<float>::exp calls), operation for
// operation: FMAs where Sleef uses vmla, so the result is Sleef's to the bit.
AVX512_BF16 inline __m512 sleef_expf(__m512 d) {
  const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(d, _mm512_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f)));
  const __m512 qf = _mm512_cvtepi32_ps(q);
  __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-0.693145751953125f), d);
  s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-1.428606765330187045e-06f), s);
  __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
  u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
  // ldexp2: u * 2^(q >> 1) * 2^(q - (q >> 1))
  const __m512i q1 = _mm512_srai_epi32(q, 1), q2 = _mm512_sub_epi32(q, q1);
  const __m512i bias = _mm512_set1_epi32(0x7f);
  u = _mm512_mul_ps(u, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(q1, bias), 23)));
  u = _mm512_mul_ps(u, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(q2, bias), 23)));
  u = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.0f), _CMP_NLT_US), u);
  return _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(_mm512_set1_ps(100.0f), d, _CMP_LT_OQ), _mm512_set1_ps(INFINITY));
}

// silu(g) as torch computes it for bf16 gates: bf16(g / (1 + exp(-g))), fp32 inside.
AVX512_BF16 inline __m512 silu_bf16(__m512 g) {
  const __m512 e = sleef_expf(_mm512_xor_ps(g, _mm512_set1_ps(-0.0f)));
  return round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
}

// silu_bf16 of every bf16 value, by its bits: silu(gate) rounded to bf16 depends on the gate's 16 bits
// alone, so one gather of 16 entries replaces some 25 vector ops and a divide per 16 gates (the
// table is 128 KiB, the entries real activations use a few KiB). Same values by construction. One
// padding entry: the gather reads 4 bytes at entry i.
AVX512_BF16 std::vector<uint16_t> build_silu_table() {
  std::vector<uint16_t> table(65536 + 2, 0);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int i = 0; i < 65536; i += 16) {
    const __m512i bits = _mm512_add_epi32(_mm512_set1_epi32(i), lanes);
    store_rounded(table.data() + i, silu_bf16(_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16))),
                  static_cast<__mmask16>(0xFFFF));
  }
  return table;
}

const uint16_t* silu_table() {
  static const std::vector<uint16_t> table = build_silu_table();  // built once, thread-safe
  return table.data();
}

// bf16(silu(gate) * up) for n <= 16 gates (masked lanes look up entry 0).
AVX512_BF16 inline __m512 silu_mul(const uint16_t* table, const uint16_t* gate, __m512 up, __mmask16 m) {
  const __m512i idx = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, gate));
  const __m512i act = _mm512_slli_epi32(_mm512_i32gather_epi32(idx, table, 2), 16);
  return round_bf16(_mm512_mul_ps(_mm512_castsi512_ps(act), up));
}

AVX512_BF16 void silu_and_mul_row(const uint16_t* table, const uint16_t* x, uint16_t* out, int64_t inter) {
  const uint16_t* up = x + inter;
  const __mmask16 all = 0xFFFF;
  int64_t c = 0;
  for (; c + 32 <= inter; c += 32)
    store_rounded(out + c, silu_mul(table, x + c, load_bf16(up + c), all),
                  silu_mul(table, x + c + 16, load_bf16(up + c + 16), all));
  for (; c < inter; c += 16) {
    const __mmask16 m = tail_mask(inter - c);
    store_rounded(out + c, silu_mul(table, x + c, load_bf16(up + c, m), m), m);
  }
}

Tensor silu_and_mul(Tensor x) {
  op_args::check_cpu(cpu_supported(), "silu_and_mul", LEVEL);
  const int64_t width = op_args::check_silu_args(x, op_args::BF16);
  const int64_t xs = as_rows(x);
  const int64_t inter = width / 2, rows = rows_of(x);
  std::vector<int64_t> shape = shape_of(x);
  shape.back() = inter;
  Tensor out = empty(shape, aoti_torch_dtype_bfloat16());
  if (rows == 0 || inter == 0) return out;
  const auto* xp = static_cast<const uint16_t*>(x.const_data_ptr());
  auto* op = static_cast<uint16_t*>(out.mutable_data_ptr());
  const uint16_t* table = silu_table();
  torch::stable::parallel_for(0, rows, std::max<int64_t>(1, ELEMS_PER_THREAD / inter), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) silu_and_mul_row(table, xp + i * xs, op + i * inter, inter);
  });
  return out;
}

// ------------------------------------------------------------------------------------------------ rotary + KV

struct Heads {
  uint16_t* p;
  int64_t st, sh, n;  // token stride, head stride, heads
};

// Rotates the first 2 * half features of each of the token's heads in place: (x1, x2) ->
// (bf16(x1 c - x2 s), bf16(x2 c + x1 s)), each product rounded to fp32 on its own, as the reference does.
AVX512_BF16 inline void rotate_heads(uint16_t* base, int64_t sh, int64_t heads, const float* cos, const float* sin,
                                     int64_t half) {
  for (int64_t h = 0; h < heads; h++) {
    uint16_t* x = base + h * sh;
    for (int64_t c = 0; c < half; c += 16) {
      const __mmask16 m = tail_mask(half - c);
      const __m512 x1 = load_bf16(x + c, m), x2 = load_bf16(x + half + c, m);
      const __m512 cv = _mm512_maskz_loadu_ps(m, cos + c), sv = _mm512_maskz_loadu_ps(m, sin + c);
      const __m512 o1 = _mm512_sub_ps(_mm512_mul_ps(x1, cv), _mm512_mul_ps(x2, sv));
      const __m512 o2 = _mm512_add_ps(_mm512_mul_ps(x2, cv), _mm512_mul_ps(x1, sv));
      store_rounded(x + c, round_bf16(o1), m);
      store_rounded(x + half + c, round_bf16(o2), m);
    }
  }
}

AVX512_BF16 inline void copy_heads(uint16_t* dst, const uint16_t* src, int64_t src_sh, int64_t heads, int64_t d) {
  for (int64_t h = 0; h < heads; h++)
    for (int64_t c = 0; c < d; c += 32) {
      const __mmask32 m = d - c >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1u << (d - c)) - 1);
      _mm512_mask_storeu_epi16(dst + h * d + c, m, _mm512_maskz_loadu_epi16(m, src + h * src_sh + c));
    }
}

template <typename Index>
void rotate_and_write(const Index* pos, const Index* slot, const Tensor& q, const Tensor& k, const Tensor& v,
                      const Tensor& cos_sin, const Tensor& k_cache, const Tensor& v_cache) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  const int64_t half = cos_sin.size(1) / 2, max_pos = cos_sin.size(0);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  op_args::check_rotary_indices(pos, slot, T, max_pos, num_slots);
  auto* qp = static_cast<uint16_t*>(q.mutable_data_ptr());
  auto* kp = static_cast<uint16_t*>(k.mutable_data_ptr());
  const auto* vp = static_cast<const uint16_t*>(v.const_data_ptr());
  auto* kc = static_cast<uint16_t*>(k_cache.mutable_data_ptr());
  auto* vc = static_cast<uint16_t*>(v_cache.mutable_data_ptr());
  const float* cs = cos_sin.const_data_ptr<float>();
  const int64_t cs_stride = cos_sin.stride(0);
  const int64_t qst = q.stride(0), qsh = q.stride(1), kst = k.stride(0), ksh = k.stride(1);
  const int64_t vst = v.stride(0), vsh = v.stride(1);
  const int64_t per_token = (H + 2 * KVH) * D;
  torch::stable::parallel_for(0, T, std::max<int64_t>(1, ELEMS_PER_THREAD / per_token), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      const float* cos = cs + static_cast<int64_t>(pos[t]) * cs_stride;
      const float* sin = cos + half;
      rotate_heads(qp + t * qst, qsh, H, cos, sin, half);
      uint16_t* kt = kp + t * kst;
      rotate_heads(kt, ksh, KVH, cos, sin, half);
      const int64_t s = slot[t];
      if (s >= 0) {
        copy_heads(kc + s * KVH * D, kt, ksh, KVH, D);
        copy_heads(vc + s * KVH * D, vp + t * vst, vsh, KVH, D);
      }
    }
  });
}

// false (nothing done) for dtypes and layouts the op does not take (op_args::rotary_args_taken): the caller then
// runs torch. Shapes that disagree or indices out of range are errors.
bool rotary_and_write_kv(Tensor positions, Tensor q, Tensor k, Tensor v, Tensor cos_sin, Tensor k_cache,
                         Tensor v_cache, Tensor slots) {
  op_args::check_cpu(cpu_supported(), "rotary_and_write_kv", LEVEL);
  if (!op_args::rotary_args_taken(positions, q, k, v, cos_sin, k_cache, v_cache, slots, op_args::BF16))
    return false;
  if (q.size(0) == 0) return true;
  const auto index_type = positions.scalar_type();
  if (index_type == ScalarType::Long)
    rotate_and_write(positions.const_data_ptr<int64_t>(), slots.const_data_ptr<int64_t>(), q, k, v, cos_sin,
                     k_cache, v_cache);
  else
    rotate_and_write(positions.const_data_ptr<int32_t>(), slots.const_data_ptr<int32_t>(), q, k, v, cos_sin,
                     k_cache, v_cache);
  return true;
}

// ------------------------------------------------------------------------------------------------ argmax

// The first index of the row's maximum, as torch's argmax finds it in the fp32 upcast (exact, order kept):
// a NaN is the maximum (the first NaN wins), equal values (+0 and -0 too) go to the lowest index. Four
// accumulators of 16 lanes, each seeing its indices in increasing order and keeping its first maximum on
// a strict >; the lowest index among the lanes holding the overall maximum is then the row's first.
AVX512_BF16 int64_t argmax_row(const uint16_t* x, int64_t n) {
  constexpr int ACC = 4;
  __m512 best[ACC];
  __m512i at[ACC];
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int a = 0; a < ACC; a++) {
    best[a] = _mm512_set1_ps(-INFINITY);
    at[a] = _mm512_set1_epi32(INT32_MAX);  // a lane that never sees a value above -inf never wins below
  }
  __mmask16 nan = 0;
  __m512i idx = lanes;
  const __m512i step = _mm512_set1_epi32(16);
  int64_t c = 0;
  for (; c + 16 * ACC <= n; c += 16 * ACC) {
    for (int a = 0; a < ACC; a++) {
      const __m512 v = load_bf16(x + c + 16 * a);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, best[a], _CMP_GT_OQ);
      best[a] = _mm512_mask_mov_ps(best[a], gt, v);
      at[a] = _mm512_mask_mov_epi32(at[a], gt, idx);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      idx = _mm512_add_epi32(idx, step);
    }
  }
  for (; c < n; c += 16) {
    const __mmask16 m = tail_mask(n - c);
    const __m512 v = load_bf16(x + c, m);
    const __mmask16 gt = _mm512_mask_cmp_ps_mask(m, v, best[0], _CMP_GT_OQ);
    best[0] = _mm512_mask_mov_ps(best[0], gt, v);
    at[0] = _mm512_mask_mov_epi32(at[0], gt, idx);
    nan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
    idx = _mm512_add_epi32(idx, step);
  }
  if (nan) {  // rare: find the first NaN (exponent all ones, mantissa not zero)
    for (int64_t i = 0; i < n; i++)
      if ((x[i] & 0x7fff) > 0x7f80) return i;
  }
  float top = -INFINITY;
  for (int a = 0; a < ACC; a++) top = std::max(top, _mm512_reduce_max_ps(best[a]));
  if (top == -INFINITY) return 0;  // every value is -inf: torch returns the first
  int32_t first = INT32_MAX;
  for (int a = 0; a < ACC; a++) {
    const __mmask16 eq = _mm512_cmp_ps_mask(best[a], _mm512_set1_ps(top), _CMP_EQ_OQ);
    first = std::min(first, _mm512_mask_reduce_min_epi32(eq, at[a]));
  }
  return first;
}

Tensor argmax(Tensor logits) {
  op_args::check_cpu(cpu_supported(), "argmax", LEVEL);
  op_args::check_argmax_args(logits, op_args::BF16);
  const int64_t rows = logits.size(0), n = logits.size(1);
  const int64_t stride = as_rows(logits);
  Tensor out = empty({rows}, aoti_torch_dtype_int64());
  if (rows == 0) return out;
  const auto* xp = static_cast<const uint16_t*>(logits.const_data_ptr());
  auto* op = static_cast<int64_t*>(out.mutable_data_ptr());
  torch::stable::parallel_for(0, rows, std::max<int64_t>(1, ELEMS_PER_THREAD / n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) op[i] = argmax_row(xp + i * stride, n);
  });
  return out;
}

bool supported() { return cpu_supported(); }

}  // namespace

PHASESERVE_LAYER_OPS_LIBRARY(phaseserve_layer_ops, "silu_and_mul(Tensor x) -> Tensor")
