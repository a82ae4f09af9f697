"""The cluster's decisions (scheduler/cluster.py and its parts) without Redis: routing, admission, drains, lost
workers, given-up steps and quarantined requests, as plain data in and the writes it decided (`Cluster.ops`) out."""

from __future__ import annotations

import math

from phaseserve.params import SamplingParams
from phaseserve.wire import (ERROR_QUARANTINED, ERROR_REJECTED, Keys, StepPlan, StepResult, SubmitRequest, TokenBatch,
                             TokenEvent, WorkerInfo)
from phaseserve.scheduler.cluster import Cluster, PolicyLimits
from phaseserve.scheduler.quarantine import STRIKES_FIELD
from phaseserve.scheduler.redis_writes import DeleteRecord, SendPlan, SetRecordField, TellError
from phaseserve.scheduler.step_cost import StepCostModel

KEYS = Keys("t")


def info(wid: str, role: str = "mixed", num_blocks: int = 64, max_model_len: int = 2048, **kw) -> WorkerInfo:
    return WorkerInfo(wid, role, "m", num_blocks, 16, max_model_len, 1, 1.0, **kw)


def req(rid: str, prompt_len: int = 10, max_tokens: int = 8) -> SubmitRequest:
    return SubmitRequest(rid, "gw", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens,
                                                                                   temperature=0.0))


def cluster(*infos: WorkerInfo) -> Cluster:
    c = Cluster(KEYS, PolicyLimits(), drain_timeout=5.0)
    for i in infos:
        c.add_worker(i, epoch=3)
    return c


def ops_of(c: Cluster, kind: type) -> list:
    return [op for op in c.ops if isinstance(op, kind)]


def test_new_requests_go_to_the_least_loaded_worker_and_ties_to_the_least_recently_given():
    c = cluster(info("a"), info("b"))
    assert c.admit(req("r1")) and c.admit(req("r2"))
    assert c.owner == {"r1": "a", "r2": "b"}  # a tie goes to the one given a sequence least recently
    c.workers["a"].policy.cancel("r1")
    del c.owner["r1"]
    assert c.admit(req("r3")) and c.owner["r3"] == "a"  # a holds nothing now: the least loaded
    assert SetRecordField(KEYS.request_record("r3"), "worker", "a") in c.ops


def test_decode_workers_take_new_sequences_only_when_no_other_worker_lives():
    c = cluster(info("d", role="decode", num_blocks=512), info("p", role="prefill"))
    c.admit(req("r1"))
    assert c.owner == {"r1": "p"}
    c.retire_worker("p", "heartbeat expired")
    assert c.owner == {"r1": "d"} and not c.parked  # its sequence moved to the survivor, a decode worker


def test_a_prompt_no_worker_can_hold_fails_alone_and_names_the_largest_worker():
    c = cluster(info("small", num_blocks=8, max_model_len=128), info("big", num_blocks=64, max_model_len=4096))
    assert not c.admit(req("huge", prompt_len=1100))
    assert "huge" not in c.owner and c.admit(req("fits"))
    [error] = ops_of(c, TellError)
    event = TokenBatch.from_wire(error.batch).events[0]
    assert event.error_kind == ERROR_REJECTED and "64" in event.error  # the client's error, the big worker's
    assert DeleteRecord(KEYS.request_record("huge")) in c.ops
    # a resumed sequence no survivor can hold is the cluster's failure, not the client's
    c.ops.clear()
    assert not c.admit(req("resumed", prompt_len=1100), output_ids=[3])
    assert TokenBatch.from_wire(ops_of(c, TellError)[0].batch).events[0].error_kind is None


def test_a_draining_worker_gets_nothing_new_gives_back_what_waits_and_is_told_when_it_holds_nothing():
    c = cluster(info("a"))
    c.admit(req("r1"))
    c.worker_seen(info("a", draining=True), now=0.0)
    assert c.workers["a"].draining and [r.request_id for r, _ in c.parked] == ["r1"] and not c.owner  # no other worker
    c.advance_drains(now=0.1, epoch=3)
    [drained] = ops_of(c, SendPlan)
    plan = StepPlan.from_wire(drained.plan)
    assert drained.stream == KEYS.steps("a") and plan.drained and plan.epoch == 3 and c.workers["a"].drained
    c.add_worker(info("b"), epoch=3)
    c.place_parked()
    assert c.owner == {"r1": "b"}


def test_a_draining_worker_running_past_its_deadline_is_handed_back_once_nothing_is_in_flight():
    c = cluster(info("a"), info("b"))
    c.admit(req("r1"))
    plans = c.plan_steps(0.0, 3, 2, lambda plan, expected: 1.0, 0.5)
    assert {wid for wid, _ in plans} == {"a"} and all(plan.epoch == 3 for _, plan in plans)
    c.worker_seen(info("a", draining=True), now=0.0)
    c.advance_drains(now=10.0, epoch=3)  # past the deadline, a plan still in flight: it stays
    assert c.workers["a"].handing_back and c.owner == {"r1": "a"}
    assert c.plan_steps(10.0, 3, 2, lambda plan, expected: 1.0, 0.5) == []  # no more plans for it
    c.workers["a"].in_flight.clear()
    c.advance_drains(now=10.1, epoch=3)
    assert c.owner == {"r1": "b"} and c.workers["a"].drained


def test_steps_past_their_deadline_are_given_up_and_stale_results_ignored():
    c = cluster(info("a"))
    c.admit(req("r1"))
    [(_, plan)] = c.plan_steps(0.0, 3, 1, lambda plan, expected: 1.0, 0.5)
    c.apply_result(StepResult(plan.step_id, "a", [], epoch=2), epoch=3, now=0.2)  # another epoch's
    assert len(c.workers["a"].in_flight) == 1 and c.num_steps_given_up == 0
    assert c.give_up_overdue_steps(now=1.0) == 0.5  # due at 1.5: seconds left
    assert c.give_up_overdue_steps(now=2.0) is None
    assert c.num_steps_given_up == 1 and not c.workers["a"].in_flight
    assert c.owner == {"r1": "a"} and c.workers["a"].policy.num_waiting == 1  # recomputed, not lost


def learned(overhead_s: float, token_s: float) -> StepCostModel:
    """A step cost model fitted to steps that cost `overhead_s` plus `token_s` a token."""
    model = StepCostModel(min_samples=1, warmup=0, refit_every=1)
    for i in range(1, 64):
        tokens, keys, chunks = 8 * i, (37 * i) % 50 * 100, i % 3
        model.observe(tokens, keys, overhead_s + token_s * tokens + 1e-7 * keys + 1e-4 * chunks, chunks)
    assert model.costs is not None
    return model


def test_no_plan_is_queued_behind_plans_predicted_to_run_for_plan_ahead_s():
    """Two plans in flight hide the round trip between a result and the next plan; behind a long step (a
    long prompt's 512-token chunk, half a second here) a second plan only makes a request arriving now wait
    for both. Short steps still get their second plan."""
    def planned(prompt_len: int, plan_ahead_s: float) -> int:
        c = cluster(info("a"))
        c.workers["a"].step_costs = learned(overhead_s=0.002, token_s=0.001)
        c.admit(req("r1", prompt_len=prompt_len))
        return len(c.plan_steps(0.0, 3, 2, lambda plan, expected: 1.0, 0.5, plan_ahead_s=plan_ahead_s))

    assert planned(600, plan_ahead_s=0.1) == 1  # one 512-token chunk, about 0.5 s: the next waits for its result
    assert planned(600, plan_ahead_s=math.inf) == 2
    assert planned(10, plan_ahead_s=0.1) == 2  # a 10-token prefill, then its first decode behind it
    c = cluster(info("a"))  # no learned costs yet: pipelined as always
    c.admit(req("r1", prompt_len=600))
    assert len(c.plan_steps(0.0, 3, 2, lambda plan, expected: 1.0, 0.5, plan_ahead_s=0.1)) == 2


def run_plans(c: Cluster) -> list[tuple[str, StepPlan]]:
    """Plan every worker's next step (its waiting sequences start running)."""
    return c.plan_steps(0.0, 3, 1, lambda plan, expected: 1.0, 0.5)


def errors_of(c: Cluster) -> dict[str, TokenEvent]:
    return {ev.seq_id: ev for op in ops_of(c, TellError) for ev in TokenBatch.from_wire(op.batch).events}


def test_a_request_running_on_two_workers_that_failed_is_quarantined_instead_of_moved_again():
    c = cluster(info("a"), info("b"), info("c"))
    c.admit(req("poison"))
    run_plans(c)  # running on a
    c.admit(req("queued"))  # admitted after: waiting on b, in no step yet
    assert c.owner == {"poison": "a", "queued": "b"}
    c.retire_worker("a", "heartbeat expired")
    assert c.owner["poison"] in ("b", "c") and c.quarantine.count("poison") == 1
    assert SetRecordField(KEYS.request_record("poison"), STRIKES_FIELD, 1) in c.ops  # a takeover keeps counting
    run_plans(c)
    second = c.owner["poison"]
    c.ops.clear()
    c.retire_worker(second, "new life (restarted or stalled)")
    assert "poison" not in c.owner and not c.parked  # failed, not moved to the third worker
    event = errors_of(c)["poison"]
    assert event.error_kind == ERROR_QUARANTINED and event.error.startswith("request quarantined")
    assert DeleteRecord(KEYS.request_record("poison")) in c.ops
    assert c.stats().num_quarantined == 1 and c.quarantine.count("poison") == 0
    # what waited on the failed worker was in none of its steps: moved, no strike
    assert "queued" in c.owner and c.quarantine.count("queued") == 0


def test_workers_leaving_on_purpose_or_lost_to_a_redis_outage_strike_nobody():
    c = cluster(info("a"), info("b"), info("c"))
    c.admit(req("r1"))
    run_plans(c)
    c.worker_seen(info("a", draining=True), now=0.0)
    c.retire_worker("a", "heartbeat expired")  # a draining worker that went: on purpose
    run_plans(c)
    holder = c.owner["r1"]
    other = ({"b", "c"} - {holder}).pop()
    # its heartbeat lapsed while the scheduler could not reach Redis: the outage's, not the sequence's
    c.gone_workers({other: c.workers[other].info}, blameless=True)
    assert holder not in c.workers and c.owner["r1"] == other
    assert c.quarantine.count("r1") == 0 and ops_of(c, TellError) == []


def test_strikes_are_forgotten_when_a_request_ends_and_restored_at_a_takeover():
    c = cluster(info("a"), info("b"))
    c.admit(req("done", max_tokens=1))
    [(wid, plan)] = run_plans(c)
    c.retire_worker(wid, "heartbeat expired")
    assert c.quarantine.count("done") == 1
    [(wid, plan)] = run_plans(c)
    c.apply_result(StepResult(plan.step_id, wid, [TokenEvent("done", 0, [7], "length")], epoch=3), epoch=3, now=0.1)
    assert "done" not in c.owner and c.quarantine.count("done") == 0
    # a scheduler taking over reads a record's strikes back (scheduler/leadership.py): one more failure is its last
    c.quarantine.restore("resumed", 1)
    c.admit(req("resumed"), output_ids=[3])
    run_plans(c)
    c.retire_worker(c.owner["resumed"], "heartbeat expired")
    assert errors_of(c)["resumed"].error_kind == ERROR_QUARANTINED


def test_quarantine_after_zero_never_fails_a_request():
    c = Cluster(KEYS, PolicyLimits(), quarantine_after=0)
    for w in ("a", "b"):
        c.add_worker(info(w), epoch=3)
    c.admit(req("r1"))
    for _ in range(3):
        run_plans(c)
        wid = c.owner["r1"]
        c.retire_worker(wid, "heartbeat expired")
        c.add_worker(info(wid), epoch=3)
        c.place_parked()
    assert c.quarantine.count("r1") == 3 and "r1" in c.owner and c.stats().num_quarantined == 0
