// One decoder layer of a decode step (one query per sequence) in one call, for float32 activations meeting
// int8/int4 weights packed for quant_gemm_i8 (CPUs with AVX2 + FMA): what the model otherwise runs as nine
// native calls a layer (kernels/__init__.py and workers/model.py DecoderLayer.forward):
//
//   x, r1 = add_rms_norm(h, residual?, input_norm)      (no residual: x = rms_norm(h), r1 = h)
//   q, k, v = split(quant_linear(x, qkv))
//   rotary_and_write_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slots)
//   a = decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
//   x, r2 = add_rms_norm(quant_linear(a, o), r1, post_norm)
//   return quant_linear(silu_and_mul(quant_linear(x, gate_up)), down), r2
//
// Each step runs the very code of the separate ops (quant_gemm_i8.h, layer_ops_f32.h, attention_f32.h), on
// the same values in the same order, so the results are theirs bit for bit (tests/test_native_decode_layer.py
// asserts it): a row's bits do not depend on which path its step took. What goes is the per-call cost: the
// dispatcher, the Python around each op and a tensor per intermediate; those live in scratch reused across
// calls. No biases (the caller keeps the separate ops for a linear with one).
//
// decode_layers runs every layer of the step in one call (what the model calls; one boxed call from Python a
// step instead of one a layer).
//
// Built against torch's stable ABI. Registered as torch.ops.phaseserve_decode_layer_f32.{decode_layer,
// decode_layers, supported}.

#pragma GCC optimize("fp-contract=off")  // as the separate ops' files: only the FMAs written out

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <immintrin.h>

#include "attention_f32.h"
#include "layer_ops_f32.h"
#include "op_args.h"
#include "quant_gemm_i8.h"
#include "row_tensors.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

constexpr int64_t ELEMS_PER_THREAD = 32768;  // layer_ops_f32.cpp's: below this much work a loop stays on one thread

// The calling thread's intermediates, grown as needed and kept for the next call.
struct Scratch {
  std::vector<float> x, r1, qkv, attn, o, gate_up, act;
  i8::QuantRows X;
};

float* grown(std::vector<float>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

// A packed weight of quant_gemm_i8 for n outputs of k features: checked, as that op checks it.
i8::Packed packed_weight(const Tensor& packed, int64_t bits, int64_t n, int64_t k, const char* name) {
  STD_TORCH_CHECK(bits == 4 || bits == 8, "decode_layer: ", name, ": bits must be 4 or 8");
  const int64_t bb = bits == 4 ? i8::block_bytes<4>() : i8::block_bytes<8>();
  STD_TORCH_CHECK(packed.is_cpu() && packed.dim() == 3 && packed.is_contiguous() &&
                      packed.scalar_type() == ScalarType::Byte && packed.size(2) == bb,
                  "decode_layer: ", name, " must be contiguous uint8 [ceil(N / 8), K / 32, ", bb, "]");
  STD_TORCH_CHECK(k % i8::BLOCK == 0 && packed.size(1) * i8::BLOCK == k, "decode_layer: ", name, " takes ",
                  packed.size(1) * i8::BLOCK, " features, the layer gives it ", k);
  STD_TORCH_CHECK(packed.size(0) == (n + i8::LANES - 1) / i8::LANES, "decode_layer: ", name, " has ",
                  packed.size(0), " groups of 8 outputs, the layer needs ", n);
  return {static_cast<const uint8_t*>(packed.const_data_ptr()), packed.size(1), packed.size(0), n};
}

// rows x [T, n] (+ r) -> out, and x + r -> h (when r): add_rms_norm's loop.
void norm_rows(const float* x, int64_t xs, const float* r, int64_t rs, const float* w, float* h, float* out,
               int64_t T, int64_t n, float eps) {
  torch::stable::parallel_for(0, T, std::max<int64_t>(1, ELEMS_PER_THREAD / n), [&](int64_t begin, int64_t end) {
    std::vector<float> sq(n);
    for (int64_t i = begin; i < end; i++)
      f32_rows::rms_norm_row(x + i * xs, r != nullptr ? r + i * rs : nullptr, w, h + i * n, out + i * n, n, eps,
                             sq.data());
  });
}

void check_f32(const Tensor& t, const char* name) {
  STD_TORCH_CHECK(t.is_cpu() && t.scalar_type() == ScalarType::Float, "decode_layer: ", name,
                  " must be a float32 CPU tensor");
}

template <typename Index>
void rotate_rows(const Index* pos, const Index* slot, float* qkv, int64_t T, int64_t H, int64_t KVH, int64_t D,
                 const float* cs, int64_t cs_stride, int64_t half, float* kc, float* vc) {
  const int64_t width = (H + 2 * KVH) * D;
  torch::stable::parallel_for(0, T, std::max<int64_t>(1, ELEMS_PER_THREAD / width), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      float* row = qkv + t * width;
      f32_rows::rotate_and_store_token(row, D, H, row + H * D, D, row + (H + KVH) * D, D, KVH, D,
                                       cs + static_cast<int64_t>(pos[t]) * cs_stride, half, slot[t], kc, vc);
    }
  });
}

// h [T, hidden] float32 (dense rows); residual: [T, hidden] or None (the first layer); norms [hidden]; the four
// linears packed for quant_gemm_i8 (no bias); positions and slots [T] int64 or int32; cos_sin [positions,
// rotary_dim] float32; caches [blocks, block_size, KVH, D] float32 contiguous; block_tables [T, M] and seq_lens
// [T] int32 (one query per sequence); torch_block as silu_and_mul takes it. Returns (h', residual').
std::tuple<Tensor, Tensor> decode_layer(Tensor h, std::optional<Tensor> residual, Tensor input_norm,
                                        Tensor post_norm, double eps, Tensor qkv_w, int64_t qkv_bits, Tensor o_w,
                                        int64_t o_bits, Tensor gate_up_w, int64_t gate_up_bits, Tensor down_w,
                                        int64_t down_bits, Tensor positions, Tensor cos_sin, Tensor k_cache,
                                        Tensor v_cache, Tensor slots, Tensor block_tables, Tensor seq_lens,
                                        double scale, int64_t num_heads, int64_t torch_block) {
  STD_TORCH_CHECK(cpu_supports_avx2_fma(), "decode_layer: this CPU lacks AVX2 + FMA");
  check_f32(h, "h");
  STD_TORCH_CHECK(h.dim() == 2 && h.stride(1) == 1, "decode_layer: h must be [T, hidden] with dense rows");
  const int64_t T = h.size(0), hidden = h.size(1);
  if (residual.has_value()) {
    check_f32(*residual, "residual");
    STD_TORCH_CHECK(residual->dim() == 2 && residual->size(0) == T && residual->size(1) == hidden &&
                        residual->stride(1) == 1,
                    "decode_layer: residual must be [T, hidden] like h, with dense rows");
  }
  for (const Tensor* w : {&input_norm, &post_norm}) {
    check_f32(*w, "a norm weight");
    STD_TORCH_CHECK(w->dim() == 1 && w->size(0) == hidden && w->stride(0) == 1,
                    "decode_layer: norm weights must be dense [hidden]");
  }
  // attention's shapes and the caches, as decode_attention and rotary_and_write_kv check them
  check_f32(k_cache, "k_cache");
  check_f32(v_cache, "v_cache");
  check_f32(cos_sin, "cos_sin");
  STD_TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
                  "decode_layer: caches must be contiguous [blocks, block_size, KVH, D]");
  const int64_t nb = k_cache.size(0), bs = k_cache.size(1), KVH = k_cache.size(2), D = k_cache.size(3);
  const int64_t H = num_heads;
  STD_TORCH_CHECK(v_cache.size(0) == nb && v_cache.size(1) == bs && v_cache.size(2) == KVH && v_cache.size(3) == D,
                  "decode_layer: the caches' shapes disagree");
  STD_TORCH_CHECK(KVH > 0 && H % KVH == 0 && H / KVH <= f32_attention::MAX_GROUP,
                  "decode_layer: query heads must be 1 to 16 times the KV heads");
  STD_TORCH_CHECK(D == 16 || D == 32 || D == 64 || D == 128, "decode_layer: head_dim must be 16, 32, 64 or 128");
  STD_TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.stride(1) == 1 && cos_sin.size(1) > 0 && cos_sin.size(1) % 2 == 0 &&
                      cos_sin.size(1) <= D,
                  "decode_layer: cos_sin must be [positions, rotary_dim] (even, <= head_dim) with dense rows");
  const auto index_type = positions.scalar_type();
  STD_TORCH_CHECK((index_type == ScalarType::Long || index_type == ScalarType::Int) &&
                      slots.scalar_type() == index_type && positions.is_cpu() && slots.is_cpu() &&
                      positions.dim() == 1 && slots.dim() == 1 && positions.size(0) == T && slots.size(0) == T &&
                      positions.stride(0) == 1 && slots.stride(0) == 1,
                  "decode_layer: positions and slots must be dense int64 or int32 [T]");
  STD_TORCH_CHECK(block_tables.is_cpu() && seq_lens.is_cpu() && block_tables.dim() == 2 && seq_lens.dim() == 1 &&
                      block_tables.scalar_type() == ScalarType::Int && seq_lens.scalar_type() == ScalarType::Int &&
                      block_tables.size(0) == T && seq_lens.size(0) == T && block_tables.stride(1) == 1 &&
                      seq_lens.stride(0) == 1,
                  "decode_layer: one query per sequence: block_tables int32 [T, M] (dense rows), seq_lens int32 [T]");
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int64_t M = block_tables.size(1);
  for (int64_t b = 0; b < T; b++) {
    STD_TORCH_CHECK(lens[b] >= 1 && lens[b] <= M * bs, "decode_layer: seq_lens[", b, "] = ", lens[b],
                    " is outside [1, ", M * bs, "]");
    f32_attention::check_blocks("decode_layer", tables + b * block_tables.stride(0), (lens[b] + bs - 1) / bs, nb);
  }
  const int64_t qkv_n = (H + 2 * KVH) * D, inter = down_w.size(1) * i8::BLOCK;
  const i8::Packed Wqkv = packed_weight(qkv_w, qkv_bits, qkv_n, hidden, "qkv");
  const i8::Packed Wo = packed_weight(o_w, o_bits, hidden, H * D, "o");
  const i8::Packed Wgu = packed_weight(gate_up_w, gate_up_bits, 2 * inter, hidden, "gate_up");
  const i8::Packed Wd = packed_weight(down_w, down_bits, hidden, inter, "down");
  STD_TORCH_CHECK(torch_block >= 0 && torch_block % 8 == 0, "decode_layer: torch_block must be a multiple of 8");
  const int64_t max_pos = cos_sin.size(0), num_slots = nb * bs;
  if (index_type == ScalarType::Long)
    op_args::check_rotary_indices(positions.const_data_ptr<int64_t>(), slots.const_data_ptr<int64_t>(), T, max_pos,
                                  num_slots, "decode_layer");
  else
    op_args::check_rotary_indices(positions.const_data_ptr<int32_t>(), slots.const_data_ptr<int32_t>(), T, max_pos,
                                  num_slots, "decode_layer");

  Tensor out = empty({T, hidden}, aoti_torch_dtype_float32());
  Tensor r2 = empty({T, hidden}, aoti_torch_dtype_float32());
  if (T == 0) return {out, r2};
  thread_local Scratch S;
  const float eps_f = static_cast<float>(eps);
  const float* hp = h.const_data_ptr<float>();
  // x, r1 = add_rms_norm(h, residual): without one, x = rms_norm(h) and r1 is h itself
  float* x = grown(S.x, T * hidden);
  const float* r1 = hp;
  int64_t r1s = h.stride(0);
  if (residual.has_value()) {
    float* r = grown(S.r1, T * hidden);
    norm_rows(hp, h.stride(0), residual->const_data_ptr<float>(), residual->stride(0),
              input_norm.const_data_ptr<float>(), r, x, T, hidden, eps_f);
    r1 = r, r1s = hidden;
  } else {
    norm_rows(hp, h.stride(0), nullptr, 0, input_norm.const_data_ptr<float>(), x, x, T, hidden, eps_f);
  }
  float* qkv = grown(S.qkv, T * qkv_n);
  i8::linear(Wqkv, static_cast<int>(qkv_bits), x, hidden, T, S.X, qkv, qkv_n);
  float* kc = k_cache.mutable_data_ptr<float>();
  float* vc = v_cache.mutable_data_ptr<float>();
  const int64_t half = cos_sin.size(1) / 2;
  if (index_type == ScalarType::Long)
    rotate_rows(positions.const_data_ptr<int64_t>(), slots.const_data_ptr<int64_t>(), qkv, T, H, KVH, D,
                cos_sin.const_data_ptr<float>(), cos_sin.stride(0), half, kc, vc);
  else
    rotate_rows(positions.const_data_ptr<int32_t>(), slots.const_data_ptr<int32_t>(), qkv, T, H, KVH, D,
                cos_sin.const_data_ptr<float>(), cos_sin.stride(0), half, kc, vc);
  float* attn = grown(S.attn, T * H * D);
  const f32_attention::Problem P{qkv, qkv_n, kc, vc, tables, block_tables.stride(0), lens, H, KVH, bs, D,
                                 static_cast<float>(scale) * f32_attention::LOG2E, attn};
  if (D == 16) f32_attention::run_decode<16>(P, T);
  else if (D == 32) f32_attention::run_decode<32>(P, T);
  else if (D == 64) f32_attention::run_decode<64>(P, T);
  else f32_attention::run_decode<128>(P, T);
  float* o = grown(S.o, T * hidden);
  i8::linear(Wo, static_cast<int>(o_bits), attn, H * D, T, S.X, o, hidden);
  float* rp = r2.mutable_data_ptr<float>();
  norm_rows(o, hidden, r1, r1s, post_norm.const_data_ptr<float>(), rp, x, T, hidden, eps_f);
  float* gu = grown(S.gate_up, T * 2 * inter);
  i8::linear(Wgu, static_cast<int>(gate_up_bits), x, hidden, T, S.X, gu, 2 * inter);
  float* act = grown(S.act, T * inter);
  const int64_t vector_end = torch_block == 0 ? 0 : inter / torch_block * torch_block;
  torch::stable::parallel_for(0, T, std::max<int64_t>(1, ELEMS_PER_THREAD / inter), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++)
      f32_rows::silu_and_mul_row(gu + i * 2 * inter, act + i * inter, inter, vector_end);
  });
  i8::linear(Wd, static_cast<int>(down_bits), act, inter, T, S.X, out.mutable_data_ptr<float>(), hidden);
  return {out, r2};
}

// Every layer of a decode step in one call: decode_layer for layer i on input_norms[i], post_norms[i],
// weights[4i .. 4i + 3] (qkv, o, gate_up, down; their bits alike) and the caches k_caches[i], v_caches[i], the
// first without a residual. Returns the last layer's (h, residual). What is left per layer is that function's
// checks and two outputs, not a boxed call from Python.
std::tuple<Tensor, Tensor> decode_layers(Tensor h, std::vector<Tensor> input_norms, std::vector<Tensor> post_norms,
                                         double eps, std::vector<Tensor> weights, std::vector<int64_t> bits,
                                         Tensor positions, Tensor cos_sin, std::vector<Tensor> k_caches,
                                         std::vector<Tensor> v_caches, Tensor slots, Tensor block_tables,
                                         Tensor seq_lens, double scale, int64_t num_heads, int64_t torch_block) {
  const size_t n = input_norms.size();
  STD_TORCH_CHECK(n > 0 && post_norms.size() == n && weights.size() == 4 * n && bits.size() == 4 * n &&
                      k_caches.size() == n && v_caches.size() == n,
                  "decode_layers: per layer two norms, four weights and their bits, a K and a V cache");
  std::optional<Tensor> residual;
  for (size_t i = 0; i < n; i++) {
    auto [out, r] = decode_layer(h, residual, input_norms[i], post_norms[i], eps, weights[4 * i], bits[4 * i],
                                 weights[4 * i + 1], bits[4 * i + 1], weights[4 * i + 2], bits[4 * i + 2],
                                 weights[4 * i + 3], bits[4 * i + 3], positions, cos_sin, k_caches[i], v_caches[i],
                                 slots, block_tables, seq_lens, scale, num_heads, torch_block);
    h = out;
    residual = r;
  }
  return {h, *residual};
}

bool supported() { return cpu_supports_avx2_fma(); }

}  // namespace

STABLE_TORCH_LIBRARY(phaseserve_decode_layer_f32, m) {
  m.def("decode_layer(Tensor h, Tensor? residual, Tensor input_norm, Tensor post_norm, float eps, Tensor qkv, "
        "int qkv_bits, Tensor o, int o_bits, Tensor gate_up, int gate_up_bits, Tensor down, int down_bits, "
        "Tensor positions, Tensor cos_sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
        "Tensor block_tables, Tensor seq_lens, float scale, int num_heads, int torch_block) -> (Tensor, Tensor)");
  m.def("decode_layers(Tensor h, Tensor[] input_norms, Tensor[] post_norms, float eps, Tensor[] weights, "
        "int[] bits, Tensor positions, Tensor cos_sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, "
        "Tensor block_tables, Tensor seq_lens, float scale, int num_heads, int torch_block) -> (Tensor, Tensor)");
  m.def("supported() -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(phaseserve_decode_layer_f32, CPU, m) {
  m.impl("decode_layer", TORCH_BOX(&decode_layer));
  m.impl("decode_layers", TORCH_BOX(&decode_layers));
}

PHASESERVE_SUPPORTED_IMPL(phaseserve_decode_layer_f32)
