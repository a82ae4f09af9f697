"""The worker's Redis side, in a process of its own: step plans in, step writes and heartbeats out.

The model process (workers/service.py) starts it with `python -m workers.relay PLANS_FD WRITES_FD` and
talks to it over two pipes (multiprocessing connections, msgpack messages):

- `writes`, model -> relay. First the relay's configuration (`RelayConfig`), then one message per step,
  [entry id of the plan, StepResult bytes (None: ack only), [[gateway id, TokenBatch bytes], ...]]. The relay sends each
  step's writes in ONE pipeline (each event XADDed to its sequence's token log, phaseserve/token_log.py,
  then a PUBLISH per gateway, XADD to `results`, XACK + XDEL of the plan), in
  step order; steps that arrive during a round trip go out together in the next one. When the model
  process closes `writes`, the relay sends what is left, removes the heartbeat and exits.
- `plans`, relay -> model. A reader thread blocks on `steps:<worker>` (consumer group) and forwards each
  entry as [entry id, plan bytes], so with two plans in flight the next one is usually already in the
  pipe. A Redis failure is forwarded as [None, message] (the worker stops), then the relay exits.

A heartbeat thread keeps `worker:<id>` alive (with a TTL), whatever the model step takes.

Why a process and not threads beside the model: threads share the model's GIL. The relay's Python
(msgpack, redis-py) is a few hundred microseconds a step, and a thread holding the GIL that long
stalls the model's next torch op, even from another core. Measured on the bundled model
(docs/architecture.md, "The worker's own threads").
"""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection

import msgpack
import redis
import structlog

from phaseserve import token_log
from phaseserve.procs import child_setup
from phaseserve.wire import FIELD, FIELD_BYTES, STREAM_MAXLEN, Keys, WorkerInfo

log = structlog.get_logger("workers.relay")

READ_AHEAD = 8  # plans taken per XREADGROUP (the scheduler keeps two in flight)


@dataclass
class RelayConfig:
    redis_url: str
    key_prefix: str
    info: bytes  # WorkerInfo, as the heartbeat carries it
    heartbeat_interval: float = 1.0
    heartbeat_ttl: float = 5.0
    block_ms: int = 500
    log_level: str = "info"
    log_json: bool = False
    cpus: list[int] | None = None  # run on these CPUs (None: wherever the model process may run)


class Heartbeat(threading.Thread):
    """Refreshes the heartbeat key every `interval` seconds, independent of the model step."""

    def __init__(self, client: redis.Redis, keys: Keys, info: WorkerInfo, interval: float, ttl: float):
        super().__init__(name="heartbeat", daemon=True)
        self.client, self.keys, self.info = client, keys, info
        self.interval, self.ttl_ms = interval, max(1, int(ttl * 1000))
        self.stopped = threading.Event()

    def beat(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.sadd(self.keys.workers, self.info.worker_id)
        pipe.set(self.keys.worker_heartbeat(self.info.worker_id), self.info.to_wire(), px=self.ttl_ms)
        pipe.execute()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.beat()
            except redis.RedisError as e:  # keep trying: Redis may come back before the TTL runs out
                log.warning("heartbeat failed", error=str(e))

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=self.interval + 1)
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(self.keys.worker_heartbeat(self.info.worker_id))
        pipe.srem(self.keys.workers, self.info.worker_id)
        pipe.execute()


class Relay:
    def __init__(self, config: RelayConfig, plans: Connection, writes: Connection):
        self.config = config
        self.plans, self.writes = plans, writes
        self.info = WorkerInfo.from_wire(config.info)
        self.worker_id = self.info.worker_id
        self.keys = Keys(config.key_prefix)
        self.steps_key = self.keys.steps(self.worker_id)
        self.client = redis.Redis.from_url(config.redis_url)
        self.heartbeat = Heartbeat(self.client, self.keys, self.info, config.heartbeat_interval,
                                   config.heartbeat_ttl)
        self.stopping = threading.Event()
        self.send_lock = threading.Lock()  # the reader and a failing writer both send on `plans`

    def _join_group(self) -> None:
        try:
            self.client.xgroup_create(self.steps_key, self.keys.worker_group, id="$", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
            # a restarted worker with the same id: plans meant for its previous life are stale
            self.client.xgroup_setid(self.steps_key, self.keys.worker_group, id="$")

    def _send_plan(self, entry_id: bytes | None, payload) -> None:
        with self.send_lock:
            self.plans.send_bytes(msgpack.packb([entry_id, payload]))

    def read_plans(self) -> None:
        streams = {self.steps_key: ">"}
        try:
            while not self.stopping.is_set():
                resp = self.client.xreadgroup(self.keys.worker_group, self.worker_id, streams,
                                              count=READ_AHEAD, block=self.config.block_ms)
                for _stream, entries in resp or ():
                    for entry_id, fields in entries:
                        self._send_plan(entry_id, fields.get(FIELD_BYTES, b""))
        except Exception as e:  # a worker that cannot read plans must stop: tell the model process
            if not self.stopping.is_set():
                log.error("reading plans failed", error=str(e))
                self._fail(f"reading plans failed: {e}")  # a no-op if the model process itself is gone

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
                entry_id, result, batches = msgpack.unpackb(raw)
                for gateway_id, token_batch in batches:
                    # the durable copy first: a gateway that gets the message can always re-read it
                    token_log.append_batch(pipe, keys, token_batch)
                    pipe.publish(keys.gateway_channel(gateway_id), token_batch)
                if result is not None:
                    pipe.xadd(keys.results, {FIELD: result}, maxlen=STREAM_MAXLEN, approximate=True)
                pipe.xack(self.steps_key, keys.worker_group, entry_id)
                pipe.xdel(self.steps_key, entry_id)
            # the token log refuses an offset it already has (a replayed step): that is not a failure
            token_log.raise_unexpected(pipe.execute(raise_on_error=False))

    def run(self) -> int:
        """Join the steps group first, then heartbeat: the scheduler sends plans only to live workers."""
        try:
            self._join_group()
            self.heartbeat.beat()
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
    # Ctrl-C reaches the whole process group: the worker stops first, then closes `writes`, which ends us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    plans = Connection(int(argv[0]), readable=False)
    writes = Connection(int(argv[1]), writable=False)
    try:
        config = RelayConfig(**msgpack.unpackb(writes.recv_bytes()))
    except EOFError:  # the model process went away before configuring us
        return 0
    # what the launcher's preexec_fn does for its children, done here: see WorkerService.start_relay
    child_setup(config.cpus)()
    logs.configure("worker-relay", config.log_level, config.log_json)
    structlog.contextvars.bind_contextvars(worker_id=WorkerInfo.from_wire(config.info).worker_id)
    return Relay(config, plans, writes).run()


def config_message(config: RelayConfig) -> bytes:
    return msgpack.packb(asdict(config))


if __name__ == "__main__":
    sys.exit(main())
