// The argument checks and the registration the native twins share (layer_ops.cpp for bf16 and
// layer_ops_f32.cpp for float32; the quantized matmuls quant_gemm.cpp for bf16 activations, quant_gemm_f32.cpp
// for float32 and quant_gemm_i8.cpp for float32 quantized to int8), so each twin keeps only what differs:
// its dtype, the CPU level it needs, its arithmetic.
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <cstdint>

namespace op_args {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// The twin's dtype, as its checks name it.
struct Dtype {
  ScalarType type;
  const char* name;
};
constexpr Dtype BF16{ScalarType::BFloat16, "bfloat16"};
constexpr Dtype F32{ScalarType::Float, "float32"};

// Every op checks first that this CPU has the level its file is compiled for (`level`, as the error says it).
inline void check_cpu(bool supported, const char* op, const char* level) {
  STD_TORCH_CHECK(supported, op, ": this CPU lacks ", level);
}

// ------------------------------------------------------------------------------------------------ layer ops

// An elementwise op's input: rows of the twin's dtype on the CPU.
inline void check_rows(const Tensor& t, Dtype dtype, const char* name, const char* op) {
  STD_TORCH_CHECK(t.is_cpu() && t.scalar_type() == dtype.type && t.dim() >= 1, op, ": ", name, " must be a ",
                  dtype.name, " CPU tensor");
}

// add_rms_norm's arguments (rms_norm's with no residual): x's rows, weight [n], a residual shaped as x. -> n
inline int64_t check_norm_args(const Tensor& x, const Tensor* residual, const Tensor& weight, Dtype dtype) {
  check_rows(x, dtype, "x", "add_rms_norm");
  check_rows(weight, dtype, "weight", "add_rms_norm");
  const int64_t n = x.size(x.dim() - 1);
  STD_TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n, "add_rms_norm: weight must be [", n, "]");
  if (residual != nullptr) {
    check_rows(*residual, dtype, "residual", "add_rms_norm");
    bool same = residual->dim() == x.dim();  // compared in place: no shape vectors on this per-layer path
    for (int64_t i = 0; same && i < x.dim(); i++) same = residual->size(i) == x.size(i);
    STD_TORCH_CHECK(same, "add_rms_norm: residual shape differs from x's");
  }
  return n;
}

// silu_and_mul's x: rows of gate | up. -> their width
inline int64_t check_silu_args(const Tensor& x, Dtype dtype) {
  check_rows(x, dtype, "x", "silu_and_mul");
  const int64_t width = x.size(x.dim() - 1);
  STD_TORCH_CHECK(width % 2 == 0, "silu_and_mul: the last dim must be even (gate | up), got ", width);
  return width;
}

// argmax's logits [rows, vocab], the vocab within the int32 lane indices the ops keep.
inline void check_argmax_args(const Tensor& logits, Dtype dtype) {
  check_rows(logits, dtype, "logits", "argmax");
  STD_TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "argmax: logits must be [rows, vocab > 0]");
  STD_TORCH_CHECK(logits.size(1) <= (int64_t(1) << 30), "argmax: vocab of ", logits.size(1), " is too large");
}

inline bool is_heads(const Tensor& t, Dtype dtype) {
  return t.is_cpu() && t.scalar_type() == dtype.type && t.dim() == 3 && t.stride(2) == 1;
}

// Whether rotary_and_write_kv takes these inputs: q, k, v and the caches of the twin's dtype with a dense
// head_dim, contiguous caches, a float32 cos/sin cache, int64 or int32 positions and slots. false: nothing is
// done and the caller runs torch. Shapes that disagree are errors.
inline bool rotary_args_taken(const Tensor& positions, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& cos_sin, const Tensor& k_cache, const Tensor& v_cache,
                              const Tensor& slots, Dtype dtype) {
  const auto index_type = positions.scalar_type();
  if (!is_heads(q, dtype) || !is_heads(k, dtype) || !is_heads(v, dtype) || k_cache.dim() != 4 ||
      v_cache.dim() != 4 || k_cache.scalar_type() != dtype.type || v_cache.scalar_type() != dtype.type ||
      !k_cache.is_cpu() || !v_cache.is_cpu() || !k_cache.is_contiguous() || !v_cache.is_contiguous() ||
      cos_sin.scalar_type() != ScalarType::Float || !cos_sin.is_cpu() || cos_sin.dim() != 2 ||
      cos_sin.stride(1) != 1 || (index_type != ScalarType::Long && index_type != ScalarType::Int) ||
      slots.scalar_type() != index_type || positions.dim() != 1 || slots.dim() != 1 || positions.stride(0) != 1 ||
      slots.stride(0) != 1 || !positions.is_cpu() || !slots.is_cpu())
    return false;
  const int64_t T = q.size(0), D = q.size(2), KVH = k.size(1);
  STD_TORCH_CHECK(k.size(0) == T && k.size(2) == D && v.size(0) == T && v.size(1) == KVH && v.size(2) == D,
                  "rotary_and_write_kv: q [T, H, D], k and v [T, KVH, D] disagree");
  STD_TORCH_CHECK(k_cache.size(2) == KVH && k_cache.size(3) == D && v_cache.size(0) == k_cache.size(0) &&
                      v_cache.size(1) == k_cache.size(1) && v_cache.size(2) == KVH && v_cache.size(3) == D,
                  "rotary_and_write_kv: cache shapes [blocks, block_size, KVH, D] disagree with k");
  const int64_t rd = cos_sin.size(1);
  STD_TORCH_CHECK(rd > 0 && rd % 2 == 0 && rd <= D, "rotary_and_write_kv: rotary_dim ", rd,
                  " must be even, positive and <= head_dim ", D);
  STD_TORCH_CHECK(positions.size(0) == T && slots.size(0) == T, "rotary_and_write_kv: positions and "
                  "slot_mapping must be [", T, "]");
  return true;
}

// Every token's position inside the cos/sin cache and slot inside the KV cache, checked before anything is
// written (by rotary_and_write_kv, and by decode_layer which runs it).
template <typename Index>
void check_rotary_indices(const Index* pos, const Index* slot, int64_t T, int64_t max_pos, int64_t num_slots,
                          const char* op = "rotary_and_write_kv") {
  for (int64_t t = 0; t < T; t++) {
    STD_TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, op, ": position ", pos[t], " is outside the cos/sin cache [0, ",
                    max_pos, ")");
    STD_TORCH_CHECK(slot[t] < num_slots, op, ": slot ", slot[t], " is outside the cache (", num_slots, " slots)");
  }
}

// ------------------------------------------------------------------------------------------------ quantized matmuls

inline void check_bits(int64_t bits, const char* op) {
  STD_TORCH_CHECK(bits == 4 || bits == 8, op, ": bits must be 4 or 8");
}

// x [T, K]: dense rows of the twin's dtype on the CPU.
inline void check_activations(const Tensor& x, Dtype dtype, const char* op) {
  STD_TORCH_CHECK(x.is_cpu() && x.dim() == 2 && x.scalar_type() == dtype.type && x.stride(1) == 1, op,
                  ": x must be a ", dtype.name, " CPU tensor [T, K] with dense rows");
}

// The packed weight [groups, K / block, block_bytes] (uint8, contiguous, on the CPU) against x's K features.
// `groups`: how the twin names its first dim.
inline void check_packed(const Tensor& packed, int64_t block_bytes, const char* groups, int64_t K, int64_t block,
                         const char* op) {
  STD_TORCH_CHECK(packed.is_cpu() && packed.dim() == 3 && packed.is_contiguous() &&
                      packed.scalar_type() == ScalarType::Byte && packed.size(2) == block_bytes,
                  op, ": packed must be a contiguous uint8 CPU tensor [", groups, ", K / ", block, ", ", block_bytes,
                  "]");
  STD_TORCH_CHECK(K == packed.size(1) * block, op, ": x has ", K, " features, the weight ", packed.size(1) * block);
}

// n outputs fill the packed weight's groups of `lanes` (the last one padded).
inline void check_outputs(int64_t n, int64_t groups, int64_t lanes, const char* op) {
  STD_TORCH_CHECK(n > (groups - 1) * lanes && n <= groups * lanes, op, ": ", n, " outputs do not fill ", groups,
                  " groups of ", lanes);
}

}  // namespace op_args

// `supported() -> bool` of library `lib` (torch.ops.<lib>.supported: whether this CPU runs its ops), for the
// Python loader to ask before it dispatches to them. The function `supported` is the op file's own.
#define PHASESERVE_SUPPORTED_IMPL(lib)                                 \
  STABLE_TORCH_LIBRARY_IMPL(lib, CompositeExplicitAutograd, m) {      \
    m.impl("supported", TORCH_BOX(&supported));                       \
  }

// The layer ops' library `lib` (phaseserve_layer_ops, phaseserve_layer_ops_f32): the same ops in either
// dtype, but for silu_and_mul's schema (float32's takes torch's vector width).
#define PHASESERVE_LAYER_OPS_LIBRARY(lib, silu_schema)                                                       \
  STABLE_TORCH_LIBRARY(lib, m) {                                                                             \
    m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");                                         \
    m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");          \
    m.def(silu_schema);                                                                                      \
    m.def("rotary_and_write_kv(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor cos_sin, "     \
          "Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slots) -> bool");                                  \
    m.def("argmax(Tensor logits) -> Tensor");                                                                \
    m.def("supported() -> bool");                                                                            \
  }                                                                                                          \
  STABLE_TORCH_LIBRARY_IMPL(lib, CPU, m) {                                                                   \
    m.impl("rms_norm", TORCH_BOX(&rms_norm));                                                                \
    m.impl("add_rms_norm", TORCH_BOX(&add_rms_norm));                                                        \
    m.impl("silu_and_mul", TORCH_BOX(&silu_and_mul));                                                       \
    m.impl("rotary_and_write_kv", TORCH_BOX(&rotary_and_write_kv));                                          \
    m.impl("argmax", TORCH_BOX(&argmax));                                                                    \
  }                                                                                                          \
  PHASESERVE_SUPPORTED_IMPL(lib)
