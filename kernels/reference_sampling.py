"""The torch reference of sampling (kernels/reference.py re-exports `sample`; its Triton twin is
kernels/triton_ops.py's): temperature, top-k, top-p and min-p filters, then the exponential race over the
caller's noise. The filters read only the top of each row where that is exact, else the fully sorted row."""

from __future__ import annotations

import torch


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor, noise: torch.Tensor,
) -> torch.Tensor:
    """One token per row. logits [B, V] fp32; per-row temperature/top_k/top_p/min_p [B];
    noise [B, V] fp32 drawn from Exponential(1) by the caller (seeded per request).

    Row with temperature == 0: argmax(logits) (greedy). Otherwise logits / temperature,
    keep the top_k (0 = all), keep the smallest set with cumulative prob >= top_p,
    drop tokens with prob < min_p * max prob, then argmax(prob / noise) -- the
    exponential-race form of sampling from the renormalized distribution, which
    makes the draw a pure function of (logits, noise).
    """
    greedy = temperature == 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    x = logits.float() / t
    V = x.shape[1]
    k = torch.where(top_k <= 0, torch.full_like(top_k, V), top_k.clamp(max=V)).long()
    # rows without top-k and top-p keep every token: no sort at all when no row filters
    if bool((k < V).any()) or bool((top_p < 1.0).any()):
        x = _top_k_top_p_prefix(x, k, top_p)
        if x is None:
            x = _top_k_top_p_sorted(logits.float() / t, k, top_p)
    p = x.softmax(dim=1)
    p = p.masked_fill(p < min_p.unsqueeze(1) * p.max(dim=1, keepdim=True).values, 0.0)
    sampled = (p / noise).argmax(dim=1)
    return torch.where(greedy, logits.argmax(dim=1), sampled)


def _top_k_top_p_sorted(x: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """x with every token outside the row's top-k, then top-p set, at -inf (over a fully sorted row)."""
    sorted_x, _ = x.sort(dim=1, descending=True)
    kth = sorted_x.gather(1, (k - 1).unsqueeze(1))
    x = x.masked_fill(x < kth, float("-inf"))
    # top-p on the top-k-filtered distribution, sorted descending
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    sp = sorted_x.softmax(dim=1)
    cum_before = sp.cumsum(dim=1) - sp  # prob mass strictly above each token
    # top_p >= 1 keeps everything: the float cumsum can reach 1.0 before the tail
    keep_sorted = (cum_before < top_p.unsqueeze(1)) | (top_p.unsqueeze(1) >= 1.0)
    keep_sorted[:, 0] = True
    # threshold = smallest kept logit
    n_keep = keep_sorted.sum(dim=1, keepdim=True)
    thresh = sorted_x.gather(1, n_keep - 1)
    return x.masked_fill(x < thresh, float("-inf"))


# Columns the top-k/top-p filter sorts before it falls back to sorting the whole row: sorting a whole
# vocabulary's row costs an order of magnitude more than taking its top 1024.
_SAMPLE_PREFIX = 1024


def _top_k_top_p_prefix(x: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """The same filter from the top `n` values of each row only, or None where that cannot be exact:
    a row's top-k set (with ties) must fit in the prefix, and a row without top-k must reach its
    top-p mass inside it. The softmax normalizer of a row without top-k runs over the whole row.
    Equal to the fully sorted filter up to the rounding of that normalizer."""
    B, V = x.shape
    n = int(k.max())
    if n == V:
        n = min(V, _SAMPLE_PREFIX)
    if n >= V:
        return None
    whole = (k >= V).unsqueeze(1)  # rows without top-k
    if bool(((k > n) & (k < V)).any()):
        return None
    sorted_x = x.topk(n, dim=1).values
    kth = torch.where(whole, float("-inf"), sorted_x.gather(1, (k.clamp(max=n) - 1).unsqueeze(1)))
    if bool((((x >= kth).sum(dim=1, keepdim=True) > n) & ~whole).any()):  # k-th value ties past the prefix
        return None
    x = x.masked_fill(x < kth, float("-inf"))
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    top = sorted_x[:, :1]
    e = (sorted_x - top).exp()
    total = e.sum(dim=1, keepdim=True)
    if bool(whole.any()):
        total = torch.where(whole, (x - top).exp().sum(dim=1, keepdim=True), total)
    sp = e / total
    cum = sp.cumsum(dim=1)
    cum_before = cum - sp
    tp = top_p.unsqueeze(1)
    if bool((whole & (tp < 1.0) & (cum[:, -1:] < tp)).any()):  # the top-p set runs past the prefix
        return None
    keep_sorted = (cum_before < tp) | (tp >= 1.0)
    keep_sorted[:, 0] = True
    thresh = sorted_x.gather(1, keep_sorted.sum(dim=1, keepdim=True) - 1)
    thresh = torch.where(whole & (tp >= 1.0), float("-inf"), thresh)  # unfiltered rows keep everything
    return x.masked_fill(x < thresh, float("-inf"))
