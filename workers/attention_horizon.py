"""The attention horizon K a worker publishes for its model (WorkerInfo.attention_horizon): the context
length at which a token's attention costs as much as its linear layers, the scheduler's cost model before
it has measured any step (scheduler/budget.py). Pure."""

from __future__ import annotations

from phaseserve.workers.loader import ModelConfig

# Attention runs at about this fraction of the linear layers' FLOP rate (small per-head matmuls, softmax,
# gathering paged K/V). Fitted on how the bundled model's chunk steps grew across a long prompt
# (bench/results/2026-11-22-step-budget.md); a low K only makes late chunks smaller, so the constant errs
# that way.
ATTENTION_EFFICIENCY = 0.32


def attention_horizon(cfg: ModelConfig) -> int:
    """K for the model `cfg` describes. Counts matmul weights only: biases, norms, the embedding and the
    lm_head (run on sampled rows only) are small or not per token."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    per_layer = h * (q + 2 * kv) + q * h + 2 * h * i + i * h  # qkv, o, gate_up, down
    linear_flops = 2 * per_layer * cfg.num_layers
    # per context token and layer, each head does q.k and p.v: 2 dot products of head_dim, 2 FLOPs a term
    attention_flops = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    return max(1, round(ATTENTION_EFFICIENCY * linear_flops / attention_flops))
