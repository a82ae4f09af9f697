"""The worker's heartbeat: a thread in the relay process (workers/relay.py) that keeps `worker:<id>` alive
with a TTL while the model makes progress (workers/model_liveness.py), withdraws it when the model hangs,
announces a new life when it moves again, and tells the relay when a draining worker has no scheduler to
answer its drain."""

from __future__ import annotations

import threading
import time

import redis
import structlog

from phaseserve.wire import Keys, WorkerInfo
from phaseserve.workers.model_liveness import ModelLiveness

log = structlog.get_logger("phaseserve.workers.relay")


class Heartbeat(threading.Thread):
    """Refreshes the heartbeat key every `interval` seconds while the model makes progress (`liveness`)."""

    def __init__(self, client: redis.Redis, keys: Keys, info: WorkerInfo, interval: float, ttl: float,
                 liveness: ModelLiveness | None = None, on_no_scheduler=None):
        super().__init__(name="heartbeat", daemon=True)
        self.client, self.keys, self.info = client, keys, info
        self.interval, self.ttl_ms = interval, max(1, int(ttl * 1000))
        self.liveness = liveness or ModelLiveness(float("inf"))
        # called (once) when a beat of a draining worker finds no scheduler holding the lease
        self.on_no_scheduler = on_no_scheduler
        self.stopped = threading.Event()
        self.woken = threading.Event()  # beat now, not at the next interval (the worker started draining)
        self.silent = False  # the heartbeat was withdrawn for a hung model
        self.incarnation = 0  # lives this worker has had after hangs (ModelLiveness.incarnation announced)

    def beat(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.sadd(self.keys.workers, self.info.worker_id)
        pipe.set(self.keys.worker_heartbeat(self.info.worker_id), self.info.to_wire(), px=self.ttl_ms)
        draining = self.info.draining
        if draining:  # is anyone there to answer the drain?
            pipe.exists(self.keys.scheduler_lease())
        replies = pipe.execute()
        if draining and not replies[-1] and self.on_no_scheduler is not None:
            self.on_no_scheduler()
            self.on_no_scheduler = None

    def start_draining(self) -> None:
        """Announce WorkerInfo.draining with the next beat, which comes now."""
        self.info.draining = True
        self.woken.set()

    def withdraw(self) -> None:
        """The model is hung: the scheduler must see this worker gone at its next look, not after the TTL."""
        self.silent = True
        log.error("model step overran the deadline; withdrawing the heartbeat",
                  deadline_s=round(self.liveness.overrun_deadline, 3))
        self.client.delete(self.keys.worker_heartbeat(self.info.worker_id))

    def tick(self) -> None:
        self.liveness.check(time.monotonic())
        if self.liveness.is_hung():
            if not self.silent:
                self.withdraw()
            return
        incarnation = self.liveness.incarnation
        if incarnation != self.incarnation:  # progress after a hang: announce the next life
            self.silent = False
            self.incarnation = incarnation
            self.info.started_at = time.time()  # a new started_at is a new life to the scheduler
            log.warning("model making progress again; rejoining as a new life", incarnation=incarnation)
        self.beat()

    def run(self) -> None:
        while True:
            self.woken.wait(self.interval)
            self.woken.clear()
            if self.stopped.is_set():
                return
            try:
                self.tick()
            except redis.RedisError as e:  # keep trying: Redis may come back before the TTL runs out
                log.warning("heartbeat failed", error=str(e))

    def stop(self) -> None:
        self.stopped.set()
        self.woken.set()
        self.join(timeout=self.interval + 1)
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(self.keys.worker_heartbeat(self.info.worker_id))
        pipe.srem(self.keys.workers, self.info.worker_id)
        pipe.execute()
