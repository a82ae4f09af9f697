"""How a worker's policy applies what the worker reports about its steps. No I/O.

A result is accepted only for a step still open, and an event only for a sequence planned to sample in that
step (the same Sequence object: a cancelled and re-added id is a new one) and only at offset ==
len(output_ids). Results come in step order, so an older open step's was lost: the sequences it should have
sampled are recomputed from their confirmed outputs, as are those of a step given up (`drop_step`).

A sequence the worker says sat out the step (StepResult.deferred: its grammar matcher not ready) is neither
advanced nor recomputed: it is planned again from the position the worker holds it at, and the plans already
in flight for it are moot (the worker runs nothing of them, docs/architecture.md, "Poison requests").
"""

from __future__ import annotations

import structlog

from phaseserve.wire import StepResult
from scheduler.sequence import Sequence, SequenceStatus

log = structlog.get_logger("scheduler.policy")


class StepResults:
    """The part of `WorkerPolicy` that applies step results; it works on the policy's sequences."""

    def update(self, result: StepResult) -> list[str]:
        """Apply a step's sampled tokens; returns the ids of sequences that finished."""
        sampled = self._inflight.pop(result.step_id, None)
        if sampled is None:
            self._num_ignored_results += 1
            log.warning("ignoring result of an unknown or already applied step", step_id=result.step_id,
                        worker_id=result.worker_id)
            return []
        for old in sorted(k for k in self._inflight if k < result.step_id):
            # results come in step order, so an older open step's result was lost (harmless if it sampled nothing)
            lost = self._inflight.pop(old)
            if lost:
                log.warning("step result missing; recomputing its sequences", step_id=old, num_seqs=len(lost))
                self._settle(lost, set(), old)
        self._learn_verify_cost(result)
        planned = set(sampled)
        accepted: set[Sequence] = set()
        finished: list[str] = []
        for ev in result.events:
            seq = self._seqs.get(ev.seq_id)
            if seq is None or seq not in planned:
                continue  # cancelled, finished, or an earlier incarnation of this id
            if ev.offset != len(seq.output_ids):
                self._num_ignored_events += 1
                log.warning("ignoring token event at an unexpected offset", seq_id=ev.seq_id, offset=ev.offset,
                            expected=len(seq.output_ids), step_id=result.step_id)
                continue
            seq.output_ids.extend(ev.token_ids)
            seq.sat_out = False
            accepted.add(seq)
            self._settle_drafts(seq, result.step_id, ev, result.drafted.get(ev.seq_id, 0))
            self._name_confirmed_blocks(seq)  # the positions before this token are in the cache
            if ev.finish_reason is None and self._at_limit(seq):
                log.error("worker did not finish a sequence at its length limit; finishing it",
                          seq_id=seq.seq_id, outputs=len(seq.output_ids))
                ev_reason = "length"
            else:
                ev_reason = ev.finish_reason
            if ev_reason is not None:
                self._retire(seq)
                self._num_finished += 1
                finished.append(seq.seq_id)
            elif seq.awaiting_handoff:
                self._ready_handoffs.append(seq)
        for seq_id, position in result.deferred.items():
            seq = self._seqs.get(seq_id)
            if seq is not None and seq in planned and seq not in accepted:
                self._sit_out(seq, position, result.step_id)
        self._settle(sampled, accepted, result.step_id)
        return finished

    def _sit_out(self, seq: Sequence, position: int, step_id: int) -> None:
        """The worker holds `seq` at `position` and ran nothing of it in `step_id`: plan it from there. Its
        plans still in flight are moot (the worker skips chunks that do not start where it is)."""
        seq.sat_out = True
        if step_id <= seq.void_until:
            return  # a plan made before an earlier sit-out was applied: already rewound
        if seq.status is not SequenceStatus.RUNNING or not 0 <= position <= seq.num_computed_tokens:
            return  # preempted meanwhile, or a position we never planned: _settle recomputes it
        seq.num_computed_tokens = position
        seq.void_until = self._next_step_id - 1
        self._num_sat_out += 1

    def drop_step(self, step_id: int) -> bool:
        """A step whose result will never come (its plan or result was lost, or it overran the deadline):
        its sequences are recomputed from their confirmed outputs. False if the step was not open."""
        lost = self._inflight.pop(step_id, None)
        if lost is None:
            return False
        log.warning("step given up; recomputing its sequences", step_id=step_id, num_seqs=len(lost))
        self._settle(lost, set(), step_id)
        return True

    def outputs_of(self, seq_id: str) -> list[int] | None:
        """A live sequence's confirmed outputs (the list itself: read, do not change), or None."""
        seq = self._seqs.get(seq_id)
        return None if seq is None else seq.output_ids

    def request_of(self, seq_id: str):
        """A live sequence's SubmitRequest as admitted (with the seed drawn for it), or None."""
        seq = self._seqs.get(seq_id)
        return None if seq is None else seq.request

    def _settle(self, sampled: list[Sequence], accepted: set[Sequence], step_id: int) -> None:
        """Close a step's expected samples; a live sequence whose sample never came is recomputed."""
        for seq in sampled:
            seq.num_inflight_samples -= 1
            if seq not in accepted:
                self._settle_drafts(seq, step_id, None)
            if seq in accepted or self._seqs.get(seq.seq_id) is not seq or step_id <= seq.void_until:
                continue  # sampled, gone, or a step that sat it out (or was planned before it did)
            log.warning("planned token never reported; recomputing the sequence", seq_id=seq.seq_id)
            self._num_resyncs += 1
            if seq.status is SequenceStatus.RUNNING:
                self._preempt(seq, count=False)
