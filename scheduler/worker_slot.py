"""What the scheduler holds for one live worker: its heartbeat, its policy (KV block accounting and queues),
the plans it has in flight, where it is in a drain, and what the live view shows of it. Pure data."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from phaseserve.stack_view import STEPS_SHOWN, StepSample
from phaseserve.wire import WorkerInfo
from phaseserve.scheduler.lora_routing import AdapterRecency
from phaseserve.scheduler.policy import WorkerPolicy
from phaseserve.scheduler.step_cost import StepCostModel


@dataclass
class WorkerSlot:
    info: WorkerInfo
    policy: WorkerPolicy
    # (step id, sent at, seconds it may take once due) of plans sent with no result yet, oldest first
    in_flight: deque = field(default_factory=deque)
    needs_plan: bool = False  # something (a cancel) the worker must hear about even with no work left
    head_since: float = 0.0  # when the oldest in-flight plan became the one the worker runs (a result came)
    last_admission: int = 0  # when (RequestRouter.admissions) it was last given a new sequence; 0: never
    drain_deadline: float | None = None  # draining: when its running sequences are handed back (monotonic)
    handing_back: bool = False  # the deadline passed: no more plans; the rest moves once none is in flight
    drained: bool = False  # told it holds nothing and may exit
    loras: AdapterRecency = field(default_factory=AdapterRecency)  # the LoRA adapters it holds (lora_routing.py)
    # the worker's step time learned from its results (all steps; its decode-only steps apart, the ITL target's
    # baseline), and (tokens, keys, prefill chunks) of each plan in flight
    step_costs: StepCostModel = field(default_factory=StepCostModel)
    decode_step_costs: StepCostModel = field(default_factory=StepCostModel)
    plan_features: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    # the live view (phaseserve/stack_view.py): each plan in flight as a StepSample without its time, and
    # the last steps that answered
    plan_samples: dict[int, StepSample] = field(default_factory=dict)
    recent_steps: deque = field(default_factory=lambda: deque(maxlen=STEPS_SHOWN))
    last_step_at: float = 0.0  # when the newest of them answered (monotonic)

    @property
    def draining(self) -> bool:
        """The worker is leaving (SIGTERM): no new sequence goes to it."""
        return self.info.draining

    @property
    def takes_plans(self) -> bool:
        """False once a draining worker is past its deadline (what it runs moves elsewhere) or drained."""
        return not (self.handing_back or self.drained)

    @property
    def role(self) -> str:
        return self.info.role

    def predicted_ahead_s(self) -> float:
        """How long the plans in flight are predicted to keep the worker busy (0 while no fit of its step
        costs is known)."""
        costs = self.step_costs.costs
        if costs is None:
            return 0.0
        return sum(costs.predict(*self.plan_features[step_id]) for step_id, _sent, _timeout in self.in_flight
                   if step_id in self.plan_features)

    def head_deadline(self) -> float | None:
        """When the oldest in-flight step is given up if no result came; None with nothing in flight."""
        if not self.in_flight:
            return None
        _step_id, sent_at, timeout = self.in_flight[0]
        return max(sent_at, self.head_since) + timeout
