// Float32 attention over the paged KV cache (fp32 caches), for CPUs with AVX2 + FMA: decode (one query per
// sequence) and extend (chunks of queries, causal over the cached prefix and the chunk itself), GQA,
// head_dim 16/32/64/128, up to 16 query heads per KV head.
//
// Built against torch's stable ABI (torch/csrc/stable), like decode_attention.cpp.
// Registered as torch.ops.phaseserve_attention_f32.{decode_attention, extend_attention, supported}, with the
// signatures of the bf16 ops.
//
// One numerics: a query row (one query head at one position) gets the same bits from either op, alone or
// batched, at any thread count, at any place of any chunk. Both ops run one routine, attend_partition, whose
// arithmetic for a row depends only on the row's query, its position and the sequence's K/V:
// - keys are cut into partitions of PARTITION_TOKENS at absolute positions (0, 512, ...);
// - in a partition, a score is one FMA chain over the features in order, times scale * log2(e); the
//   softmax takes the max of the row's visible scores, p = 2^(s - max), and their sum as 8 lanes over the
//   keys in order, then one fixed reduction; acc = p.V as one FMA chain over the keys in order, per feature;
// - partitions are folded in order into (max, sum, acc) (fold_partition), and the output is acc / sum.
// The routine serves several rows at once (the query heads of a KV head, and in extend several positions):
// they share each K/V load, never a sum, so how rows are grouped never changes a row's result. The cost
// against a GEMM-style prefill: every row keeps its own FMA chains, and the score and p.V blocks are small
// (docs/model-runner.md has the figures).
//
// Work: decode items are (sequence, partition, KV heads), their partial results folded per sequence by the
// thread that finishes its last item; extend items are (sequence, KV head, tile of consecutive queries),
// each folding its partitions as it goes. Threads pick up items in any order: never a result's concern.

#pragma GCC optimize("fp-contract=off")  // only the FMAs written out: the compiler fuses nothing on its own

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <immintrin.h>

#include "attention_f32.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;
using namespace f32_attention;

// ------------------------------------------------------------------------------------------------ checks

void check_common(const char* op, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                  const Tensor& block_tables, const Tensor& seq_lens) {
  STD_TORCH_CHECK(cpu_supports_avx2_fma(), op, ": this CPU lacks AVX2 and FMA");
  STD_TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4 && block_tables.dim() == 2 &&
                      seq_lens.dim() == 1,
                  op, ": q [T, Hq, D], caches [blocks, block_size, Hkv, D], tables [B, M], lens [B]");
  STD_TORCH_CHECK(q.scalar_type() == ScalarType::Float && k_cache.scalar_type() == ScalarType::Float &&
                      v_cache.scalar_type() == ScalarType::Float,
                  op, ": q and the caches must be float32");
  STD_TORCH_CHECK(block_tables.scalar_type() == ScalarType::Int && seq_lens.scalar_type() == ScalarType::Int, op,
                  ": block_tables and seq_lens must be int32");
  const int64_t D = q.size(2), nb = k_cache.size(0), bs = k_cache.size(1), hkv = k_cache.size(2);
  STD_TORCH_CHECK(k_cache.size(3) == D && v_cache.size(0) == nb && v_cache.size(1) == bs && v_cache.size(2) == hkv &&
                      v_cache.size(3) == D,
                  op, ": cache shapes disagree with q");
  STD_TORCH_CHECK(hkv > 0 && q.size(1) % hkv == 0 && q.size(1) / hkv <= MAX_GROUP, op,
                  ": query heads must be 1 to 16 times the KV heads");
  STD_TORCH_CHECK(D == 16 || D == 32 || D == 64 || D == 128, op, ": head_dim must be 16, 32, 64 or 128");
  STD_TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), op, ": caches must be contiguous");
  STD_TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D, op, ": q's heads must be dense rows");
  STD_TORCH_CHECK(block_tables.size(0) == seq_lens.size(0) && block_tables.stride(1) == 1 && seq_lens.stride(0) == 1,
                  op, ": block_tables [B, M] (dense rows) and seq_lens [B]");
  STD_TORCH_CHECK(q.is_cpu() && k_cache.is_cpu() && v_cache.is_cpu() && block_tables.is_cpu() && seq_lens.is_cpu(),
                  op, ": CPU tensors only");
}

Problem problem(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_tables,
                const Tensor& seq_lens, double scale, Tensor& out) {
  return Problem{q.const_data_ptr<float>(), q.stride(0), k_cache.const_data_ptr<float>(),
                 v_cache.const_data_ptr<float>(), block_tables.const_data_ptr<int32_t>(), block_tables.stride(0),
                 seq_lens.const_data_ptr<int32_t>(), q.size(1), k_cache.size(2), k_cache.size(1), q.size(2),
                 static_cast<float>(scale) * LOG2E, out.mutable_data_ptr<float>()};
}

Tensor decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens,
                        double scale) {
  check_common("decode_attention", q, k_cache, v_cache, block_tables, seq_lens);
  const int64_t B = q.size(0), bs = k_cache.size(1), M = block_tables.size(1);
  STD_TORCH_CHECK(seq_lens.size(0) == B, "decode_attention: one query per sequence: q [B, Hq, D], seq_lens [B]");
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  for (int64_t b = 0; b < B; b++) {
    STD_TORCH_CHECK(lens[b] >= 1 && lens[b] <= M * bs, "decode_attention: seq_lens[", b, "] = ", lens[b],
                    " is outside [1, ", M * bs, "]");
    check_blocks("decode_attention", tables + b * block_tables.stride(0), (lens[b] + bs - 1) / bs, k_cache.size(0));
  }
  Tensor out = torch::stable::new_empty(q, {B, q.size(1), q.size(2)});
  if (B == 0) return out;
  const Problem P = problem(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  if (P.d == 16) run_decode<16>(P, B);
  else if (P.d == 32) run_decode<32>(P, B);
  else if (P.d == 64) run_decode<64>(P, B);
  else run_decode<128>(P, B);
  return out;
}

Tensor extend_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens,
                        Tensor query_start_loc, double scale) {
  check_common("extend_attention", q, k_cache, v_cache, block_tables, seq_lens);
  STD_TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.scalar_type() == ScalarType::Int &&
                      query_start_loc.is_cpu() && query_start_loc.stride(0) == 1,
                  "extend_attention: query_start_loc must be a dense int32 CPU vector [B + 1]");
  const int64_t T = q.size(0), B = seq_lens.size(0), bs = k_cache.size(1), M = block_tables.size(1);
  STD_TORCH_CHECK(query_start_loc.size(0) == B + 1, "extend_attention: query_start_loc must be [B + 1]");
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.const_data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  STD_TORCH_CHECK(starts[0] == 0 && starts[B] == T,
                  "extend_attention: query_start_loc must run from 0 to the number of queries");
  for (int64_t b = 0; b < B; b++) {
    const int64_t n = starts[b + 1] - starts[b];
    STD_TORCH_CHECK(n >= 0, "extend_attention: query_start_loc must not decrease");
    if (n == 0) continue;
    STD_TORCH_CHECK(lens[b] >= n && lens[b] <= M * bs, "extend_attention: seq_lens[", b, "] = ", lens[b],
                    " is outside [", n, ", ", M * bs, "]");
    check_blocks("extend_attention", tables + b * block_tables.stride(0), (lens[b] + bs - 1) / bs, k_cache.size(0));
  }
  Tensor out = torch::stable::new_empty(q, {T, q.size(1), q.size(2)});
  if (T == 0) return out;
  const Problem P = problem(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  if (P.d == 16) run_extend<16>(P, starts, B);
  else if (P.d == 32) run_extend<32>(P, starts, B);
  else if (P.d == 64) run_extend<64>(P, starts, B);
  else run_extend<128>(P, starts, B);
  return out;
}

bool supported() { return cpu_supports_avx2_fma(); }

}  // namespace

STABLE_TORCH_LIBRARY(phaseserve_attention_f32, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale) -> Tensor");
  m.def("extend_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, float scale) -> Tensor");
  m.def("supported() -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(phaseserve_attention_f32, CPU, m) {
  m.impl("decode_attention", TORCH_BOX(&decode_attention));
  m.impl("extend_attention", TORCH_BOX(&extend_attention));
}

STABLE_TORCH_LIBRARY_IMPL(phaseserve_attention_f32, CompositeExplicitAutograd, m) {
  m.impl("supported", TORCH_BOX(&supported));
}
