"""Admission bounds of a generation request, checked before anything is submitted.

`output_bound`: the completion length a prompt may ask for, against the model's context and the live
workers' KV caches (the scheduler admits a sequence only if one worker's cache can hold all of it), a 400
context_length_exceeded naming the field otherwise. `admit`: the operator's bounds (priority range, requests
in flight, prompt tokens queued, the key's quota), a 400 or a 429 with Retry-After.
"""

from __future__ import annotations

from phaseserve.gateway.endpoints import Endpoint
from phaseserve.gateway.errors import APIError, bad_request, context_length_exceeded, too_many_requests
from phaseserve.gateway.state import Gateway
from phaseserve.gateway.tenants import ApiKey
from phaseserve.kv_admission import KVCapacity


def output_bound(endpoint: Endpoint, max_len: int, caches: list[KVCapacity], prompt_len: int) -> int:
    """The request's max_tokens for a prompt, or a 400 when no live worker could ever hold prompt + completion."""
    what = endpoint.what
    if prompt_len >= max_len:
        raise context_length_exceeded(f"This model's maximum context length is {max_len} tokens. However, your "
                                      f"{what} has {prompt_len} tokens. Please reduce the length of the {what}.", what)
    requested, param = endpoint.requested_max_tokens(), endpoint.max_tokens_param()
    if requested is not None and prompt_len + requested > max_len:
        raise context_length_exceeded(
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the {what}, {requested} in the "
            f"completion). Please reduce the length of the {what} or completion.", param)
    if requested is None:
        room = max_len - prompt_len
        fits = max((c.max_new_tokens(prompt_len) for c in caches), default=room)
        chosen = min(endpoint.default_max_tokens(room), room, fits)
        if chosen < 1:
            raise _kv_exceeded(what, caches, None, param, prompt_len)
        return chosen
    if caches and not any(c.admits(prompt_len, requested) for c in caches):
        raise _kv_exceeded(what, caches, requested, param, prompt_len)
    return requested


def _kv_exceeded(what: str, caches: list[KVCapacity], requested: int | None, param: str,
                 prompt_len: int) -> APIError:
    longest = max(c.max_prompt_len(1) for c in caches)
    if requested is None or prompt_len > longest:
        return context_length_exceeded(
            f"This model's KV cache (the largest of its live workers') holds a {what} of at most {longest} "
            f"tokens. However, your {what} has {prompt_len} tokens. Please reduce the length of the {what}.",
            what)
    most = max(c.max_new_tokens(prompt_len) for c in caches)
    return context_length_exceeded(
        f"This model's KV cache (the largest of its live workers') holds your {prompt_len}-token {what} with at "
        f"most {most} tokens of completion. However, you requested {prompt_len + requested} tokens "
        f"({prompt_len} in the {what}, {requested} in the completion). Please reduce the length of the {what} "
        f"or completion.", param)


def admit(gw: Gateway, caller: ApiKey, priority: int, prompt_tokens: int, resuming: bool) -> None:
    """The operator's bounds: priority range, requests in flight, prompt tokens queued (429 + Retry-After), the
    key's quota. A resumed stream queues nothing new."""
    settings = gw.settings
    lo, hi = caller.priority_range or (settings.priority_min, settings.priority_max)
    if not lo <= priority <= hi:
        whose = "for this API key" if caller.priority_range else "on this server"
        raise bad_request(f"'priority' must be between {lo} and {hi} {whose} (lower is served first); "
                          f"got {priority}.", "priority")
    if gw.in_flight >= gw.max_in_flight:
        raise too_many_requests(f"Too many requests in flight on this gateway (limit {gw.max_in_flight})",
                                settings.retry_after)
    if resuming:
        return
    queued = gw.queued_prompt_tokens
    if queued and queued + prompt_tokens > gw.max_queued_prompt_tokens:
        raise too_many_requests(f"Too many prompt tokens queued on this gateway ({queued} "
                                f"+ {prompt_tokens} > {gw.max_queued_prompt_tokens})", settings.retry_after)
    refusal = gw.quotas.refusal(caller, prompt_tokens)
    if refusal is not None:
        gw.metrics.tenant_rejected.labels(caller.tenant.name, refusal.limit).inc()
        raise too_many_requests(refusal.message, refusal.retry_after)
