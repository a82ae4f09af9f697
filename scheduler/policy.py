"""One worker's scheduling policy: decode-first steps with chunked prefill over paged KV blocks. No I/O.

The scheduler service keeps one `WorkerPolicy` per live worker. It plans steps (`schedule()`, which states
what every plan keeps) and applies their results (`update()`), side by side here, over its sequences; its
parts have their own files: the sequences and their queues (scheduler/sequence_queues.py), the named steps
of a plan (scheduler/step_planner.py), the KV cache and prefix index (scheduler/kv_cache_manager.py), drafts
(scheduler/draft_planner.py), handoffs (scheduler/handoff_book.py), tenants (scheduler/tenant_planner.py),
the step budget (scheduler/budget.py), its counters and stats (scheduler/policy_stats.py). The reasoning:
docs/architecture.md, "The step budget".

Results: one is accepted only for a step still open, and an event only for a sequence planned to sample in
that step (the same Sequence object: a cancelled and re-added id is a new one) and only at offset ==
len(output_ids). Results come in step order, so an older open step's was lost: the sequences it should have
sampled are recomputed from their confirmed outputs, as are those of a step given up (`drop_step`). A
sequence the worker says sat out the step (StepResult.deferred: its grammar matcher not ready) is neither
advanced nor recomputed: it is planned again from the position the worker holds it at, and the plans already
in flight for it are moot (the worker runs nothing of them, docs/architecture.md, "Poison requests").
"""

from __future__ import annotations

from dataclasses import replace

import structlog

from phaseserve.kv_admission import KVCapacity
from phaseserve.wire import StepPlan, StepResult, SubmitRequest
from phaseserve.scheduler.budget import StepBudget, StepDraft
from phaseserve.scheduler.config import AdmissionError, SchedulerConfig, out_of_vocab
from phaseserve.scheduler.draft_planner import DraftPlanner
from phaseserve.scheduler.fair_share import TenantShares
from phaseserve.scheduler.handoff_book import Handoff, HandoffBook
from phaseserve.scheduler.kv_cache_manager import KVCacheManager
from phaseserve.scheduler.policy_stats import PolicyCounters, PolicyStats
from phaseserve.scheduler.sequence import Sequence, SequenceStatus
from phaseserve.scheduler.sequence_queues import SequenceQueues
from phaseserve.scheduler.step_cost import StepCosts
from phaseserve.scheduler.step_planner import StepPlanner
from phaseserve.scheduler.tenant_planner import TenantPlanner

log = structlog.get_logger("phaseserve.scheduler.policy")

RUNNING = SequenceStatus.RUNNING


class WorkerPolicy:
    """One worker's scheduling policy: its sequences, the plans of its steps, and their results."""

    def __init__(self, config: SchedulerConfig, worker_id: str = "local", first_step_id: int = 0,
                 transfer_prefix: str = "t"):
        self.config = config
        self.worker_id = worker_id
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.watermark,
                                 config.enable_prefix_caching)
        # the admission rule, shared with the gateway's up-front check (phaseserve/kv_admission.py)
        self.capacity = KVCapacity(config.num_blocks, config.block_size, config.max_model_len, config.watermark)
        self.drafts = DraftPlanner(config)
        self.handoffs = HandoffBook(transfer_prefix)
        self.shares = TenantShares()  # tenants' virtual times and weights (scheduler/fair_share.py)
        self.tenants = TenantPlanner(self.shares, self.kv, self.capacity, config.max_num_seqs)
        self.counters = PolicyCounters()
        self.queues = SequenceQueues(self.kv, self.shares)
        self.steps = StepPlanner(config, self.capacity, self.queues, self.kv, self.shares, self.tenants, self.drafts,
                                 self.handoffs, self.counters)
        self._inflight: dict[int, list[Sequence]] = {}  # step id -> sequences planned to sample in it
        self._next_step_id = first_step_id  # unique per adoption: a late result of an earlier one matches nothing
        # the worker's learned step costs (the service sets them from measured steps; None: not yet)
        self.step_costs: StepCosts | None = None
        self.decode_step_costs: StepCosts | None = None  # of its decode-only steps: the ITL target's baseline
        self.last_budget: StepBudget | None = None  # the last plan's budget (its predicted time)
        self.last_split = (0, 0, 0)  # the last plan's (decode tokens with drafts, prefill tokens, prefill chunks)

    @property
    def kv_transport(self) -> str | None:
        """The transport prefills stream out over for decode workers (None: this worker decodes them)."""
        return self.handoffs.kv_transport

    @kv_transport.setter
    def kv_transport(self, transport: str | None) -> None:
        self.handoffs.kv_transport = transport

    # ------------------------------------------------------------------ requests

    def add_request(self, req: SubmitRequest, output_ids: list[int] | None = None) -> None:
        """Queue a sequence. Non-empty `output_ids`: a recomputed/migrated one, prefilled over prompt + outputs.
        Raises AdmissionError if this worker can never hold it, ValueError for a malformed request."""
        rid = req.request_id
        if rid in self.queues.seqs:
            raise ValueError(f"request {rid!r} is already scheduled")
        outputs = list(output_ids or ())
        prompt_len = len(req.prompt_ids)
        if prompt_len == 0:
            raise ValueError(f"request {rid!r} has an empty prompt")
        if len(outputs) >= req.params.max_tokens:
            raise ValueError(f"request {rid!r} already has {len(outputs)} outputs, max_tokens is "
                             f"{req.params.max_tokens}")
        reason = (out_of_vocab(req.prompt_ids, self.config.vocab_size)
                  or self.capacity.rejection(prompt_len, req.params.max_tokens, len(outputs)))
        if reason is not None:
            raise AdmissionError(f"request {rid!r}: {reason}")
        self.queues.new(req, outputs)

    def cancel(self, request_id: str) -> bool:
        """Drop a sequence now (blocks freed at once; the worker hears it in the next plan's releases)."""
        seq = self.queues.seqs.get(request_id)
        if seq is None:
            return False
        self.queues.retire(seq)
        self.counters.num_cancelled += 1
        return True

    def take_all(self) -> list[tuple[SubmitRequest, list[int]]]:
        """Remove every unfinished sequence, returning it with its confirmed outputs (for another worker)."""
        self._inflight.clear()
        return [(s.request, list(s.output_ids)) for s in self.queues.take_all()]

    def take_waiting(self) -> list[tuple[SubmitRequest, list[int]]]:
        """Remove the waiting sequences (no blocks held) that may start elsewhere now, returning each with its
        confirmed outputs (a draining worker's, for other workers); see `SequenceQueues.take_waiting`."""
        return [(s.request, list(s.output_ids)) for s in self.queues.take_waiting()]

    def quiet_progress(self) -> list[SubmitRequest]:
        """The sequences moving on without a token to show for it (`SequenceQueues.quiet_progress`)."""
        return self.queues.quiet_progress()

    def outputs_of(self, seq_id: str) -> list[int] | None:
        """A live sequence's confirmed outputs (the list itself: read, do not change), or None."""
        seq = self.queues.seqs.get(seq_id)
        return None if seq is None else seq.output_ids

    def request_of(self, seq_id: str) -> SubmitRequest | None:
        """A live sequence's SubmitRequest as admitted (with the seed drawn for it), or None."""
        seq = self.queues.seqs.get(seq_id)
        return None if seq is None else seq.request

    def num_cached_tokens(self, prompt_ids: list[int], seed: bytes = b"") -> int:
        """How many leading tokens of `prompt_ids` this worker holds cached (for routing)."""
        return self.kv.num_cached_tokens(prompt_ids, seed)

    # ------------------------------------------------------------------ handoffs (scheduler/handoff_book.py)

    def ready_handoffs(self) -> list[str]:
        """Sequences whose prefill is done and first token confirmed, waiting to be handed to a decode
        worker (`hand_off`) or kept here (`keep`); each is reported once."""
        return self.handoffs.take_ready(self.queues.seqs)

    def handoff_of(self, seq_id: str) -> Handoff:
        """What a sequence waiting for its handoff would take to a decode worker."""
        return self.handoffs.handoff_of(self.queues.seqs[seq_id])

    def hand_off(self, seq_id: str) -> Handoff:
        """Let a sequence go to a decode worker: its blocks are freed and the worker told to forget it (its
        KV is already whole in the transfer: the worker finishes the transfer when the prefill ends, before
        it reports the first token)."""
        handoff = self.handoff_of(seq_id)
        self.queues.retire(self.queues.seqs[seq_id])
        self.handoffs.num_handed_off += 1
        return handoff

    def keep(self, seq_id: str) -> None:
        """No decode worker can take it: it decodes here."""
        seq = self.queues.seqs.get(seq_id)
        if seq is not None:
            self.handoffs.keep(seq)

    def can_accept_handoff(self, handoff: Handoff) -> bool:
        """Room for a handed-in sequence now: a max_num_seqs slot, blocks for its cached positions and its
        first decode above the watermark and the blocks promised to prefills."""
        req = handoff.request
        return (self.capacity.rejection(len(req.prompt_ids), req.params.max_tokens, len(handoff.output_ids)) is None
                and len(self.queues.running) < self.config.max_num_seqs
                and self.kv.can_allocate(self.kv.blocks_for(handoff.num_cached + 1),
                                         reserved=self.steps.promised_blocks()))

    def accept_handoff(self, handoff: Handoff, timeout_s: float = 2.0) -> None:
        """Take a sequence from a prefill worker: blocks for its cached positions now, its KV received into
        them with its first decode (`StepPlanner.schedule_decodes`). If the receive fails the worker reports no token
        and the sequence is recomputed here (`_settle`), never decoded over a half-received cache."""
        seq = self.queues.new(handoff.request, list(handoff.output_ids), status=RUNNING)
        seq.prefill_len = seq.num_computed_tokens = handoff.num_cached
        self.kv.allocate_slots(seq.block_table, 0, handoff.num_cached)
        seq.kv_receive = self.handoffs.receive(handoff, seq.block_table, timeout_s)
        self.handoffs.num_handed_in += 1

    # ------------------------------------------------------------------ planning

    def schedule(self) -> StepPlan | None:
        """The next step's plan, or None when there is nothing to send.

        Every plan keeps these (docs/architecture.md, "The step budget", says why and how they are met):
        - Decodes first: every running sequence past its prefill gets one token, in (priority, arrival)
          order, and is never dropped for prefill; a decode short of a block preempts (by recompute) the
          lowest-ranked running sequence. Prefill takes what is left of the budget, partial prefills'
          chunks (short prompts first) before new sequences, admitted FCFS.
        - The head of the waiting queue starts on the next plan when a slot and its blocks are free, and a
          long prompt (or a step that would be empty) moves at least one token; with tenants, a long prompt
          beside only another tenant's streams gets what the ITL target leaves, which may be none.
        - A sequence is admitted only with blocks for its whole prefill above the watermark and the blocks
          promised to partial prefills, never in a step that preempted, and never restarted while a sample
          of it is in flight (its SeqStart carries every token the worker published).
        - Speculation last (a worker that offers it): drafts for decodes in what prefill left of the budget,
          never a promised block, chosen as scheduler/draft_rule.py says (docs/speculative.md).
        - Tenants (only while more than one has work here; otherwise nothing above changes): the waiting queue
          is admitted, and prefill chunks get the budget, in weighted fair order on tokens (the tenants at
          their share of the worker after those under it), each tenant's own sequences in (priority, arrival)
          order; a preemption takes from the tenant furthest over its share of the KV blocks and slots, and the
          requests at the front of that order whose tenants are under their share preempt ones over it before
          decodes are planned (scheduler/tenant_planner.py, docs/tenants.md). Once two tenants have used the
          worker, a step with no decode keeps the long cap and `tenant_wait_s` (its long chunks wait for the next
          plan while one is in flight, the one exception to a long prompt's token a step), and the ITL target's
          bound of one stream while a tenant's streams pause between turns or its short prompt starts beside
          another tenant's long ones.
        """
        step = StepDraft()
        budget = StepBudget.for_step(self.config, self.step_costs, self.decode_step_costs)
        if self.shares.is_shared:
            self.steps.make_room_for_fair_heads(step)
        self.steps.schedule_decodes(step, budget)
        self.steps.bound_for_other_tenants(step, budget, behind_plans=bool(self._inflight))
        self.steps.reserve_head_of_queue(step, budget)
        self.steps.schedule_prefill_chunks(step, budget)
        self.steps.admit_waiting(step, budget)
        self.steps.plan_drafts(step, budget, self._next_step_id, self.step_costs)
        self.steps.note_itl_target(budget)
        self.last_budget = budget
        self.counters.num_steps_past_itl_patience += step.past_itl_patience
        if not step.is_empty:  # a plan that runs: its predicted time passes for the prompts it holds back
            self.steps.clock_s += budget.predicted_s
        return self._seal(step)

    def _seal(self, step: StepDraft) -> StepPlan | None:
        """The plan of a drafted step, with the pending releases; None when there is nothing to send."""
        if step.is_empty and not self.queues.releases:
            return None
        step_id = self._next_step_id
        self._next_step_id += 1
        self._inflight[step_id] = step.sampled  # every plan gets a result, even one with nothing to sample
        releases = self.queues.take_releases()
        self.counters.num_decode_tokens += len(step.decodes)
        prefill_tokens = sum(c.num_tokens for c in step.prefills)
        self.counters.num_prefill_tokens += prefill_tokens
        self.last_split = (sum(c.num_tokens for c in step.decodes), prefill_tokens, len(step.prefills))
        return StepPlan(step_id, self.worker_id, step.starts, step.decodes + step.prefills, releases,
                        receives=step.receives)

    # ------------------------------------------------------------------ applying results

    def update(self, result: StepResult) -> list[str]:
        """Apply a step's sampled tokens; returns the ids of sequences that finished."""
        sampled = self._inflight.pop(result.step_id, None)
        if sampled is None:
            self.counters.num_ignored_results += 1
            log.warning("ignoring result of an unknown or already applied step", step_id=result.step_id,
                        worker_id=result.worker_id)
            return []
        for old in sorted(k for k in self._inflight if k < result.step_id):
            # results come in step order, so an older open step's result was lost (harmless if it sampled nothing)
            lost = self._inflight.pop(old)
            if lost:
                log.warning("step result missing; recomputing its sequences", step_id=old, num_seqs=len(lost))
                self._settle(lost, set(), old)
        self.drafts.learn_verify_cost(result, self.step_costs)
        planned = set(sampled)
        accepted: set[Sequence] = set()
        finished: list[str] = []
        seqs = self.queues.seqs
        for ev in result.events:
            seq = seqs.get(ev.seq_id)
            if seq is None or seq not in planned:
                continue  # cancelled, finished, or an earlier incarnation of this id
            if ev.offset != len(seq.output_ids):
                self.counters.num_ignored_events += 1
                log.warning("ignoring token event at an unexpected offset", seq_id=ev.seq_id, offset=ev.offset,
                            expected=len(seq.output_ids), step_id=result.step_id)
                continue
            seq.output_ids.extend(ev.token_ids)
            seq.sat_out = False
            accepted.add(seq)
            self.drafts.settle(seq, result.step_id, ev, result.drafted.get(ev.seq_id, 0))
            self.kv.cache_confirmed_blocks(seq)  # the positions before this token are in the cache
            if ev.finish_reason is None and self._at_limit(seq):
                log.error("worker did not finish a sequence at its length limit; finishing it",
                          seq_id=seq.seq_id, outputs=len(seq.output_ids))
                ev_reason = "length"
            else:
                ev_reason = ev.finish_reason
            if ev_reason is not None:
                self.queues.retire(seq)
                self.counters.num_finished += 1
                finished.append(seq.seq_id)
            elif seq.awaiting_handoff:
                self.handoffs.first_token_confirmed(seq)
        for seq_id, position in result.deferred.items():
            seq = seqs.get(seq_id)
            if seq is not None and seq in planned and seq not in accepted:
                self._sit_out(seq, position, result.step_id)
        self._settle(sampled, accepted, result.step_id)
        return finished

    def drop_step(self, step_id: int) -> bool:
        """A step whose result will never come (its plan or result was lost, or it overran the deadline):
        its sequences are recomputed from their confirmed outputs. False if the step was not open."""
        lost = self._inflight.pop(step_id, None)
        if lost is None:
            return False
        log.warning("step given up; recomputing its sequences", step_id=step_id, num_seqs=len(lost))
        self._settle(lost, set(), step_id)
        return True

    def _sit_out(self, seq: Sequence, position: int, step_id: int) -> None:
        """The worker holds `seq` at `position` and ran nothing of it in `step_id`: plan it from there. Its
        plans still in flight are moot (the worker skips chunks that do not start where it is)."""
        seq.sat_out = True
        if step_id <= seq.void_until:
            return  # a plan made before an earlier sit-out was applied: already rewound
        if seq.status is not RUNNING or not 0 <= position <= seq.num_computed_tokens:
            return  # preempted meanwhile, or a position we never planned: _settle recomputes it
        seq.num_computed_tokens = position
        seq.void_until = self._next_step_id - 1
        self.counters.num_sat_out += 1

    def _settle(self, sampled: list[Sequence], accepted: set[Sequence], step_id: int) -> None:
        """Close a step's expected samples; a live sequence whose sample never came is recomputed."""
        for seq in sampled:
            seq.num_inflight_samples -= 1
            if seq not in accepted:
                self.drafts.settle(seq, step_id, None)
            if seq in accepted or not self.queues.is_live(seq) or step_id <= seq.void_until:
                continue  # sampled, gone, or a step that sat it out (or was planned before it did)
            log.warning("planned token never reported; recomputing the sequence", seq_id=seq.seq_id)
            self.counters.num_resyncs += 1
            if seq.status is RUNNING:
                self.steps.preempt(seq, count=False)

    def _at_limit(self, seq: Sequence) -> bool:
        n = len(seq.output_ids)
        return n >= seq.request.params.max_tokens or seq.num_prompt_tokens + n >= self.config.max_model_len

    # ------------------------------------------------------------------ introspection

    @property
    def num_waiting(self) -> int:
        return len(self.queues.waiting)

    @property
    def num_running(self) -> int:
        return len(self.queues.running)

    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.kv.num_used_blocks

    @property
    def queued_prefill_tokens(self) -> int:
        return self.queues.queued_prefill_tokens

    def has_unfinished(self) -> bool:
        return bool(self.queues.seqs)

    def running_ids(self) -> set[str]:
        """The sequences holding blocks on the worker (prefilling or decoding): those in its steps."""
        return {s.seq_id for s in self.queues.running}

    def running_sequences(self) -> list[Sequence]:
        return list(self.queues.running)

    def unprefilled(self) -> list[tuple[Sequence, int, int]]:
        return self.queues.unprefilled()

    def stats(self) -> PolicyStats:
        """A snapshot of this policy's queues, blocks and counters, and its parts' stats."""
        return PolicyStats(
            self.num_waiting, self.num_running, self.num_free_blocks, self.num_used_blocks, self.kv.num_blocks,
            self._next_step_id, len(self._inflight), self.queues.num_handoffs_in_flight,
            self.handoffs.num_handed_off, self.handoffs.num_handed_in, replace(self.counters),
            self.kv.stats(), self.drafts.stats.copy())
