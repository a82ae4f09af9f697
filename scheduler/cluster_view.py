"""The live view's picture of the cluster (phaseserve/stack_view.py), pure: built every few hundred
milliseconds from what the policies hold, never per step."""

from __future__ import annotations

from phaseserve.stack_view import WAITING_SHOWN, StackView, TenantShare, WaitingSequence, WorkerView
from phaseserve.wire import SubmitRequest
from phaseserve.scheduler.membership import PolicyLimits
from phaseserve.scheduler.worker_slot import WorkerSlot


def share_of(shares: dict[str, TenantShare], req: SubmitRequest) -> TenantShare:
    share = shares.get(req.tenant)
    if share is None:
        share = shares[req.tenant] = TenantShare(req.tenant, req.tenant_weight)
    return share


def cluster_view(workers: dict[str, WorkerSlot], parked: list, limits: PolicyLimits, taken_at: float, now: float
                 ) -> StackView:
    """`parked`: (request, outputs) waiting for a worker; `taken_at`: unix time; `now`: monotonic."""
    views, unprefilled, tenants = [], [], {}
    for wid, slot in workers.items():
        p = slot.policy
        pstats = p.stats()
        views.append(WorkerView(
            wid, slot.role, slot.info.host, slot.info.threads, slot.draining, p.num_running, p.num_waiting,
            p.num_used_blocks, pstats.prefix_cache.cached_blocks, p.num_free_blocks, slot.info.num_blocks,
            pstats.num_handoffs_in_flight, pstats.prefix_cache.queries, pstats.prefix_cache.hits,
            pstats.spec_decoding.num_draft_tokens, pstats.spec_decoding.num_accepted_tokens,
            list(slot.recent_steps),
            round(now - slot.last_step_at, 3) if slot.recent_steps else 0.0))
        for seq, total, done in p.unprefilled():
            unprefilled.append((seq.request, wid, total, done))
        for seq in p.running_sequences():
            share_of(tenants, seq.request).num_running += 1
    unprefilled += [(req, "", len(req.prompt_ids) + len(outputs or ()), 0) for req, outputs in parked]
    for req, *_ in unprefilled:
        share_of(tenants, req).num_waiting += 1
    unprefilled.sort(key=lambda x: x[0].arrival_time)
    waiting = [WaitingSequence(req.request_id, wid, req.arrival_time, total, done, req.tenant)
               for req, wid, total, done in unprefilled[:WAITING_SHOWN]]
    shares = [] if set(tenants) <= {""} else [tenants[t] for t in sorted(tenants)]  # no tenants: no table
    return StackView(taken_at, str(limits.itl_target), limits.max_num_batched_tokens, views,
                     len(unprefilled), waiting, shares)
