"""Every Redis key, stream and channel name of a stack, and the fixed shapes of what is stored there."""

from __future__ import annotations

FIELD = "m"  # every stream entry is {FIELD: <msgpack message>}
FIELD_BYTES = FIELD.encode()  # the same key as redis-py returns it in read entries

# approximate cap (XADD MAXLEN ~) on the steps and results streams: acked entries are history only
STREAM_MAXLEN = 10_000

# a sequence's token log (Keys.token_log): XADD MAXLEN ~ cap in entries (one a step) and its TTL, refreshed
# on write, so a finished request can still be resumed for a while and an abandoned one goes away
TOKEN_LOG_MAXLEN = 16_384
TOKEN_LOG_TTL_S = 300


class Keys:
    """Redis key, stream and channel names, all under one prefix."""

    def __init__(self, prefix: str = "ps"):
        self.prefix = prefix
        self.requests = f"{prefix}:requests"  # stream: SubmitRequest / CancelRequest
        self.results = f"{prefix}:results"  # stream: StepResult
        self.workers = f"{prefix}:workers"  # set of worker ids ever announced
        self.scheduler_group = "schedulers"
        self.worker_group = "workers"

    def steps(self, worker_id: str) -> str:
        return f"{self.prefix}:steps:{worker_id}"

    def gateway_channel(self, gateway_id: str) -> str:
        return f"{self.prefix}:gw:{gateway_id}"

    def worker_heartbeat(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    def request_record(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}"

    def scheduler_alive(self) -> str:
        """Set by the scheduler every worker refresh, expiring after a few: its liveness for health checks."""
        return f"{self.prefix}:scheduler:alive"

    def scheduler_seen(self, consumer: str) -> str:
        """Set by each scheduler process, the active one every worker refresh and a standby every look at
        the lease, expiring after a few: that process's own liveness (`python -m phaseserve.healthcheck
        scheduler`), where `scheduler_alive` is the stack's."""
        return f"{self.prefix}:scheduler:seen:{consumer}"

    def kv_transfer(self, transfer_id: str) -> str:
        """Stream: one KV transfer's chunks over Redis (workers/kv_transfer/redis_transport.py), with a TTL."""
        return f"{self.prefix}:kv:{transfer_id}"

    def scheduler_stats(self) -> str:
        """msgpack dict written by the scheduler on change (throttled): num_waiting, num_running,
        kv_blocks_used, kv_blocks_total, num_preemptions, num_workers, num_steps_held_by_itl_target,
        num_steps_past_itl_patience, updated_at. Read by the gateway's /metrics."""
        return f"{self.prefix}:scheduler:stats"

    def stack_view(self) -> str:
        """A StackView (phaseserve/stack_view.py) the scheduler writes at most every STACK_VIEW_INTERVAL_S,
        with a TTL: what the gateway's live view shows (docs/ui.md)."""
        return f"{self.prefix}:scheduler:view"

    def stack_view_wanted(self) -> str:
        """Set with a short TTL by a gateway while someone watches its live view: the scheduler writes
        `stack_view` only then."""
        return f"{self.prefix}:scheduler:view-wanted"

    # --- delivery and client leases (gateway side)

    def token_log(self, seq_id: str) -> str:
        """Stream: every TokenEvent of one sequence, written by the worker's relay beside its PUBLISH; entry id
        `<next offset>-0` (`-1` for an event without tokens), so a duplicate offset is refused. Capped and
        expiring (TOKEN_LOG_MAXLEN, TOKEN_LOG_TTL_S). See phaseserve/token_log.py."""
        return f"{self.prefix}:out:{seq_id}"

    def client_lease(self, seq_id: str) -> str:
        """Key with a short TTL, refreshed by the gateway serving a client of this sequence (value: that
        serving's attachment token). Gone for longer than the resume grace: nobody serves it, cancel it."""
        return f"{self.prefix}:lease:{seq_id}"

    def resume_secret(self) -> str:
        """Random bytes, set once (SET NX) by the first gateway that needs them: the key of every stream's
        resume token (gateway/sse_ids.py), shared by the stack's gateways."""
        return f"{self.prefix}:resume-secret"

    def lora_adapters(self) -> str:
        """Hash: LoRA adapter name -> its LoraRef (msgpack), the adapters the stack serves as models: written by
        the gateway (--lora-modules at start, POST /v1/load_lora_adapter and unload), so every gateway knows
        them (docs/lora.md)."""
        return f"{self.prefix}:lora:adapters"

    def key_usage(self, key_name: str) -> str:
        """Hash: one API key's usage so far (requests, prompt, cached and completion tokens), added to by every
        gateway as its requests end; read by GET /v1/usage (docs/tenants.md)."""
        return f"{self.prefix}:usage:{key_name}"

    def gateway_heartbeat(self, gateway_id: str) -> str:
        """A gateway's GatewayInfo, with a TTL: the gateway is alive."""
        return f"{self.prefix}:gateway:{gateway_id}"

    def response(self, response_id: str) -> str:
        """A stored Response of /v1/responses (JSON: owner digest, the Response, its conversation), with a
        TTL (--responses-ttl); written and read by any gateway (gateway/responses_store.py)."""
        return f"{self.prefix}:response:{response_id}"

    # ---- reliability (scheduler/worker side): fail-over, dead letters, confirmed outputs

    @property
    def dead_letters(self) -> str:
        """Stream of messages nobody could read: {FIELD: the raw bytes, "stream", "entry_id", "reason"}."""
        return f"{self.prefix}:dead"

    def scheduler_lease(self) -> str:
        """Holds the active scheduler's consumer name, with a TTL (SET NX PX); a standby waits for it."""
        return f"{self.prefix}:scheduler:lease"

    def scheduler_epoch(self) -> str:
        """INCR'ed by each scheduler that takes the lease; every StepPlan carries it."""
        return f"{self.prefix}:scheduler:epoch"

    # A request record (`request_record`, a hash) holds "submit" (the SubmitRequest as admitted, with the
    # seed the scheduler drew for an unseeded sampled request), "worker", and one field per confirmed output
    # token, OUTPUT_FIELD_PREFIX + offset -> token id, written as step results confirm them (idempotent, so
    # a retried pipeline cannot duplicate a token). A scheduler that takes over resumes from these.


OUTPUT_FIELD_PREFIX = "o"
