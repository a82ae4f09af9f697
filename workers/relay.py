"""The worker's Redis side, in a process of its own: step plans in, step writes and heartbeats out.

The model process (workers/service.py) starts it with `python -m phaseserve.workers.relay PLANS_FD WRITES_FD` and
talks to it over two pipes (multiprocessing connections; the messages are defined in phaseserve/wire/relay_pipe.py):

- `writes`, model -> relay. First the relay's configuration (`RelayConfig`), then one `StepWrites` per plan
  (entry id of the plan, StepResult bytes or None: ack only, TokenBatch bytes per gateway), or a
  `RelayNotice`: draining (SIGTERM: the heartbeat announces it at once, WorkerInfo.draining). The relay sends each
  step's writes in ONE pipeline (each event XADDed to its sequence's token log, phaseserve/token_log.py,
  then a PUBLISH per gateway, XADD to `results`, XACK + XDEL of the plan), in
  step order; steps that arrive during a round trip go out together in the next one. When the model
  process closes `writes`, the relay sends what is left, removes the heartbeat and exits.
- `plans`, relay -> model. A reader thread blocks on `steps:<worker>` (consumer group) and forwards each
  entry as a `PlanDelivery`, so with two plans in flight the next one is usually already in the
  pipe. A Redis failure is forwarded as one without an entry id (the worker stops), then the relay exits. While
  the worker drains, a `RelayNotice` no_scheduler says no scheduler holds the lease: nobody will answer
  the drain, so the worker need not wait for it (a whole stack stopping: `docker compose down`).

A heartbeat thread (workers/heartbeat.py) keeps `worker:<id>` alive while the model makes progress
(workers/model_liveness.py): a hung model's heartbeat is withdrawn and its late writes are void.

Redis outages: commands retry with backoff (phaseserve/redis_client.py); the plan reader and the step
writer wait and resume, so the model stays loaded through a Redis restart.

Why a process and not threads beside the model: threads share the model's GIL. The relay's Python
(msgpack, redis-py) holds the GIL for a while every step, and a thread holding it stalls the model's
next torch op, even from another core (docs/architecture.md, "The worker's own threads").
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

import redis
import structlog

from phaseserve import token_log
from phaseserve.procs import child_setup, freeze_startup_heap
from phaseserve.redis_client import CONNECTION_ERRORS, Backoff, connect, execute_through_outages
from phaseserve.wire import (FIELD, FIELD_BYTES, STREAM_MAXLEN, Keys, PlanDelivery, RelayConfig, RelayNotice,
                             WorkerInfo, model_to_relay)
from phaseserve.workers.heartbeat import Heartbeat
from phaseserve.workers.model_liveness import ModelLiveness, plan_timeout

log = structlog.get_logger("phaseserve.workers.relay")

READ_AHEAD = 8  # plans taken per XREADGROUP (the scheduler keeps two in flight)


class Relay:
    def __init__(self, config: RelayConfig, plans: Connection, writes: Connection):
        self.config = config
        self.plans, self.writes = plans, writes
        self.info = WorkerInfo.from_wire(config.info)
        self.worker_id = self.info.worker_id
        self.keys = Keys(config.key_prefix)
        self.steps_key = self.keys.steps(self.worker_id)
        self.client = connect(config.redis_url, name=f"{config.key_prefix}:relay:{self.worker_id}",
                              key_prefix=config.key_prefix)
        self.liveness = ModelLiveness(config.step_timeout)
        self.heartbeat = Heartbeat(self.client, self.keys, self.info, config.heartbeat_interval,
                                   config.heartbeat_ttl, self.liveness, self._no_scheduler)
        self.stopping = threading.Event()
        self.send_lock = threading.Lock()  # the reader and a failing writer both send on `plans`

    def _join_group(self, start: str = "$") -> None:
        try:
            self.client.xgroup_create(self.steps_key, self.keys.worker_group, id=start, mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
            if start == "$":  # a restarted worker with the same id: plans meant for its previous life are stale
                self.client.xgroup_setid(self.steps_key, self.keys.worker_group, id="$")

    def _send_plan(self, entry_id: bytes | None, payload) -> None:
        with self.send_lock:
            self.plans.send_bytes(PlanDelivery(entry_id, payload).to_pipe())

    def read_plans(self) -> None:
        streams = {self.steps_key: ">"}
        backoff = Backoff()
        try:
            while not self.stopping.is_set():
                try:
                    resp = self.client.xreadgroup(self.keys.worker_group, self.worker_id, streams,
                                                  count=READ_AHEAD, block=self.config.block_ms)
                except CONNECTION_ERRORS as e:  # Redis away: wait for it, the model stays loaded
                    log.warning("reading plans: redis unreachable; retrying", error=str(e))
                    self.stopping.wait(backoff.next_delay())
                    continue
                except redis.ResponseError as e:
                    if "NOGROUP" not in str(e):
                        raise
                    # Redis came back empty (no persistence): every plan in the new stream is this life's
                    log.warning("steps group missing; rejoining", error=str(e))
                    self._join_group(start="0")
                    continue
                backoff.reset()
                for _stream, entries in resp or ():
                    for entry_id, fields in entries:
                        # counted before it is handed over: its write can come back before this line's next
                        data = fields.get(FIELD_BYTES, b"")
                        self.liveness.plan_delivered(time.monotonic(), plan_timeout(data))
                        self._send_plan(entry_id, data)
        except Exception as e:  # a worker that cannot read plans must stop: tell the model process
            if not self.stopping.is_set():
                log.error("reading plans failed", error=str(e))
                self._fail(f"reading plans failed: {e}")  # a no-op if the model process itself is gone

    def _no_scheduler(self) -> None:
        log.info("draining, and no scheduler holds the lease: nobody will answer; telling the worker")
        try:
            with self.send_lock:
                self.plans.send_bytes(RelayNotice(no_scheduler=True).to_pipe())
        except (OSError, ValueError):  # the model process is gone already
            pass

    def _fail(self, message: str) -> None:
        try:
            self._send_plan(None, message)
        except (OSError, ValueError):
            pass

    def write_steps(self) -> None:
        """Until the model process closes `writes`: each step's writes, coalesced per round trip."""
        keys = self.keys
        open_ = True
        while open_:
            try:
                batch = [self.writes.recv_bytes()]
                while self.writes.poll(0):  # everything already waiting goes in the same round trip
                    batch.append(self.writes.recv_bytes())
            except EOFError:
                batch, open_ = [], False
            if not batch:
                continue
            pipe = self.client.pipeline(transaction=False)
            for raw in batch:
                message = model_to_relay(raw)
                if isinstance(message, RelayNotice):
                    if message.draining:
                        log.info("worker draining; announcing it")
                        self.heartbeat.start_draining()
                    continue
                entry_id, result, batches = message.entry_id, message.result, message.batches
                keep, hung = self.liveness.step_written(time.monotonic(), message.reset)
                if hung:
                    log.error("model step overran the deadline; this life's writes are void until the "
                              "scheduler adopts the worker again", deadline_s=round(self.liveness.overrun_deadline, 3))
                if not keep:  # the scheduler has given these sequences to others: acked only
                    result, batches = None, []
                for gateway_id, token_batch in batches:
                    # the durable copy first: a gateway that gets the message can always re-read it
                    token_log.append_batch(pipe, keys, token_batch)
                    pipe.publish(keys.gateway_channel(gateway_id), token_batch)
                if result is not None:
                    pipe.xadd(keys.results, {FIELD: result}, maxlen=STREAM_MAXLEN, approximate=True)
                pipe.xack(self.steps_key, keys.worker_group, entry_id)
                pipe.xdel(self.steps_key, entry_id)
            self._execute(pipe)

    def _execute(self, pipe) -> None:
        """Send a step's writes, waiting out a Redis outage (in step order: nothing later goes first).
        Per-command errors (an XACK whose group went with a restarted Redis) are logged, not fatal."""
        # every write is idempotent: token-log offsets are refused twice, the scheduler drops a repeated
        # result, subscribers drop a repeated offset
        replies = execute_through_outages(
            pipe, lambda e: log.warning("publishing a step: redis unreachable; retrying", error=str(e)))
        for reply in replies:
            if isinstance(reply, redis.ResponseError) and "NOGROUP" not in str(reply) \
                    and not token_log.is_duplicate(reply):  # a replayed step's offset: not a failure
                log.warning("a step write failed", error=str(reply))

    def run(self) -> int:
        """Join the steps group first, then heartbeat: the scheduler sends plans only to live workers."""
        backoff = Backoff()
        while True:
            try:
                self._join_group()
                self.heartbeat.beat()
                break
            except CONNECTION_ERRORS as e:  # Redis not up (yet): wait, keeping the loaded model
                if self.writes.poll(0):  # the model process is stopping (or gone)
                    return 0
                log.warning("announcing the worker: redis unreachable; retrying", error=str(e))
                time.sleep(backoff.next_delay())
            except Exception as e:
                log.error("worker could not announce itself", error=str(e))
                self._fail(f"announcing the worker failed: {e}")
                return 1
        self.heartbeat.start()
        reader = threading.Thread(target=self.read_plans, name="plan-reader", daemon=True)
        reader.start()
        code = 0
        try:
            self.write_steps()
        except Exception as e:
            log.error("publishing step results failed", error=str(e))
            self._fail(f"publishing step results failed: {e}")
            code = 1
        finally:
            self.stopping.set()
            try:
                self.heartbeat.stop()
            except redis.RedisError as e:
                log.warning("could not remove the heartbeat", error=str(e))
            reader.join(self.config.block_ms / 1000 + 1)
            self.plans.close()
        return code


def main(argv: list[str] | None = None) -> int:
    from phaseserve import logs

    argv = sys.argv[1:] if argv is None else argv
    # Ctrl-C (or a SIGTERM) sent to the whole process group: the worker decides (stop, or drain), then
    # closes `writes`, which ends us; dying first would only make the worker fail. With the worker gone
    # (our parent-death signal), SIGTERM ends us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()

    def on_sigterm(*_args) -> None:
        if os.getppid() != parent:
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    plans = Connection(int(argv[0]), readable=False)
    writes = Connection(int(argv[1]), writable=False)
    try:
        config = RelayConfig.from_pipe(writes.recv_bytes())
    except EOFError:  # the model process went away before configuring us
        return 0
    # what the launcher's preexec_fn does for its children, done here: see RelayLink.start (workers/relay_link.py)
    child_setup(config.cpus)()
    logs.configure("worker-relay", config.log_level, config.log_json)
    structlog.contextvars.bind_contextvars(worker_id=WorkerInfo.from_wire(config.info).worker_id)
    relay = Relay(config, plans, writes)
    freeze_startup_heap()
    return relay.run()


if __name__ == "__main__":
    sys.exit(main())
