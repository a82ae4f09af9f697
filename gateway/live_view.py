"""The live view of the stack (docs/ui.md): `GET /v1/stack/events`, a server-sent-events stream of frames.

One sampler per gateway, however many people watch: while someone does, it reads the scheduler's StackView
(phaseserve/stack_view.py) and the workers' heartbeats every SAMPLE_INTERVAL_S, in a handful of Redis
commands, and keeps the `view-wanted` key alive so the scheduler writes that view (it writes none
otherwise). TTFT, ITL and tokens/s come from this gateway's own histograms (gateway/latency_window.py).
Nothing here runs per token or per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import structlog
from aiohttp import web

from phaseserve.gateway.auth import caller
from phaseserve.gateway.backend import Backend
from phaseserve.gateway.latency_window import Cumulative, LatencyWindow, bucket_counts, counter_value
from phaseserve.gateway.metrics import GatewayMetrics
from phaseserve.gateway.slow_client import SlowClient, write_within
from phaseserve.stack_view import StackView
from phaseserve.wire import Keys, WireError, WorkerInfo

log = structlog.get_logger("gateway.live_view")

SAMPLE_INTERVAL_S = 0.5  # while someone watches
IDLE_SAMPLE_INTERVAL_S = 2.0  # nobody watches: only the latency window is sampled (no Redis)
WANTED_TTL_MS = 3000  # the scheduler keeps writing its view this long after the last viewer left
KEEPALIVE_S = 15.0  # a comment line when no frame came (proxies drop silent connections)
WRITE_TIMEOUT_S = 10.0  # a viewer that reads nothing this long is dropped
OTHERS = "(other tenants)"


def frame(view: StackView | None, workers: list[WorkerInfo], latency: dict, now: float) -> dict:
    """What the page draws: the live workers (by heartbeat) with what the scheduler's view says of each,
    the waiting queue with each sequence's waiting time, and the latency window. A worker the view still
    names but whose heartbeat is gone is left out: it is dead."""
    by_id = {w.worker_id: w for w in view.workers} if view else {}
    shown = []
    for info in sorted(workers, key=lambda w: w.worker_id):
        w = by_id.get(info.worker_id)
        entry = {"worker_id": info.worker_id, "role": info.role, "host": info.host, "threads": info.threads,
                 "dtype": info.dtype, "cpu_level": info.cpu_level, "draining": info.draining,
                 "adopted": w is not None}
        if w is not None:
            entry.update(
                num_running=w.num_running, num_waiting=w.num_waiting,
                kv={"used": w.kv_blocks_used, "cached": w.kv_blocks_cached, "free": w.kv_blocks_free,
                    "total": w.kv_blocks_total},
                handoffs_in_flight=w.handoffs_in_flight,
                prefix_cache={"queries": w.prefix_cache_queries, "hits": w.prefix_cache_hits},
                speculation={"drafted": w.spec_draft_tokens, "accepted": w.spec_accepted_tokens},
                steps=[{"decode_tokens": s.decode_tokens, "prefill_tokens": s.prefill_tokens,
                        "prefill_chunks": s.prefill_chunks, "step_ms": round(s.step_s * 1e3, 3),
                        "predicted_ms": round(s.predicted_s * 1e3, 3), "target_ms": round(s.target_s * 1e3, 3)}
                       for s in w.steps],
                last_step_age_s=round(w.last_step_age_s + max(0.0, now - view.taken_at), 3))
        shown.append(entry)
    out = {"now": now, "workers": shown, "latency": latency, "view": view is not None}
    if view is not None:
        out.update(view_age_s=round(max(0.0, now - view.taken_at), 3), itl_target=view.itl_target,
                   max_num_batched_tokens=view.max_num_batched_tokens, num_waiting=view.num_waiting,
                   waiting=[{"request_id": s.request_id, "worker_id": s.worker_id,
                             "waiting_s": round(max(0.0, now - s.arrival_time), 3), "prompt_tokens": s.prompt_tokens,
                             "prefilled_tokens": s.prefilled_tokens, "tenant": s.tenant} for s in view.waiting])
        if view.tenants:
            out["tenants"] = [{"tenant": t.tenant, "weight": t.weight, "num_running": t.num_running,
                               "num_waiting": t.num_waiting} for t in view.tenants]
    return out


def as_seen_by(frame: dict, tenant: str) -> dict:
    """The frame a tenant's key may see: other tenants' requests stay in the queue (its length and their waits
    are the stack's), without their ids or tenant names, and the other tenants count as one row. The
    operator's keys (--api-key, tenant "") and an open server see everything."""
    if not tenant or "tenants" not in frame:
        return frame
    out = dict(frame)
    out["waiting"] = [w if w["tenant"] == tenant else {**w, "request_id": "", "tenant": OTHERS}
                      for w in frame.get("waiting", ())]
    own = [t for t in frame["tenants"] if t["tenant"] == tenant]
    rest = [t for t in frame["tenants"] if t["tenant"] != tenant]
    if rest:
        own.append({"tenant": OTHERS, "weight": sum(t["weight"] for t in rest),
                    "num_running": sum(t["num_running"] for t in rest),
                    "num_waiting": sum(t["num_waiting"] for t in rest)})
    out["tenants"] = own
    return out


class LiveView:
    """The sampler: one task per gateway, frames handed to every open stream."""

    def __init__(self, backend: Backend, keys: Keys, metrics: GatewayMetrics):
        self.backend, self.keys, self.metrics = backend, keys, metrics
        self.window = LatencyWindow(bucket_counts(metrics.ttft)[0], bucket_counts(metrics.itl)[0])
        self.viewers = 0
        self.frame: dict | None = None
        self.frame_no = 0
        self._new_frame = asyncio.Event()
        self._viewer_came = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.closing = False  # the gateway shuts down: every stream ends

    def end_streams(self) -> None:
        self.closing = True
        self._new_frame.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="live-view")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @contextlib.asynccontextmanager
    async def watching(self):
        self.viewers += 1
        self._viewer_came.set()
        try:
            yield
        finally:
            self.viewers -= 1

    async def next_frame(self, seen: int, timeout: float) -> tuple[dict | None, int]:
        """The newest frame after frame number `seen` (waiting for one up to `timeout`), and its number;
        (None, seen) when none came in time."""
        if self.frame_no == seen and not self.closing:
            event = self._new_frame
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await event.wait()
        if self.frame_no == seen:
            return None, seen
        return self.frame, self.frame_no

    def sample_latency(self) -> None:
        m = self.metrics
        self.window.add(Cumulative(time.monotonic(), bucket_counts(m.ttft)[1], bucket_counts(m.itl)[1],
                                   counter_value(m.generation_tokens)))

    async def read_view(self) -> StackView | None:
        pipe = self.backend.redis.pipeline(transaction=False)
        pipe.set(self.keys.stack_view_wanted(), b"1", px=WANTED_TTL_MS)
        pipe.get(self.keys.stack_view())
        _, raw = await pipe.execute()
        if raw is None:
            return None
        try:
            return StackView.from_wire(raw)
        except WireError as e:  # a scheduler of another version: show the heartbeats alone
            log.warning("unreadable stack view", error=str(e))
            return None

    async def sample(self) -> dict:
        view = await self.read_view()
        workers = await self.backend.workers.alive(max_age_s=0.0)
        return frame(view, workers, self.window.summary(), time.time())

    async def _run(self) -> None:
        while True:
            self.sample_latency()
            if self.viewers:
                try:
                    self.frame = await self.sample()
                except Exception as e:  # noqa: BLE001 -- Redis away, or anything else: say so, keep sampling
                    self.frame = {"now": time.time(), "error": f"cannot read the stack's state: {e}"}
                self.frame_no += 1
                done, self._new_frame = self._new_frame, asyncio.Event()
                done.set()
            self._viewer_came.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SAMPLE_INTERVAL_S if self.viewers else IDLE_SAMPLE_INTERVAL_S):
                    await self._viewer_came.wait()


LIVE_VIEW = web.AppKey("live_view", LiveView)


async def stack_events(request: web.Request) -> web.StreamResponse:
    """The live view's frames as server-sent events (`data: <json>`), until the client goes away."""
    live = request.app[LIVE_VIEW]
    tenant = caller(request).tenant.name
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    seen = 0
    async with live.watching():
        with contextlib.suppress(ConnectionError, SlowClient):
            while not live.closing:
                current, seen = await live.next_frame(seen, KEEPALIVE_S)
                data = (b": keep-alive\n\n" if current is None
                        else b"data: " + json.dumps(as_seen_by(current, tenant)).encode() + b"\n\n")
                await write_within(resp, request, data, WRITE_TIMEOUT_S)
    return resp
