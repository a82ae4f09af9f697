"""Cache-aware routing and the cluster's side of prefix caching (scheduler/routing.py), pure: no Redis. Fake
workers (tests/test_scheduler_policy.py's) run each plan the cluster sends, so caches fill as they would."""

from __future__ import annotations

import random
import zlib

from test_scheduler_cluster import KEYS
from test_scheduler_policy import VOCAB, FakeWorker

from phaseserve.params import SamplingParams
from phaseserve.wire import LoraRef, SubmitRequest, WorkerInfo
from phaseserve.scheduler.cluster import Cluster, PolicyLimits
from phaseserve.scheduler.lora_routing import DEFAULT_MAX_LORAS, AdapterRecency
from phaseserve.scheduler.prefix_index import request_seed, scope_seed


def info(wid: str, num_blocks: int = 256, started_at: float = 1.0) -> WorkerInfo:
    return WorkerInfo(wid, "mixed", "m", num_blocks, 16, 2048, 1, started_at)


def tokens(seed: str, n: int) -> list[int]:
    return [zlib.crc32(f"{seed}:{i}".encode()) % VOCAB for i in range(n)]


def chat_req(rid: str, prompt: list[int], max_tokens: int = 6) -> SubmitRequest:
    return SubmitRequest(rid, "gw", list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0))


class Sim:
    """A cluster with fake workers: `step()` plans every worker's next step and applies its result."""

    def __init__(self, *wids: str, limits: PolicyLimits | None = None, num_blocks: int = 256):
        self.cluster = Cluster(KEYS, limits or PolicyLimits(), drain_timeout=5.0)
        self.workers: dict[str, FakeWorker] = {}
        self.published: dict = {}  # every worker's tokens, by request
        for wid in wids:
            self.add(wid, num_blocks)

    def add(self, wid: str, num_blocks: int = 256, started_at: float = 1.0) -> None:
        slot = self.cluster.add_worker(info(wid, num_blocks=num_blocks, started_at=started_at), epoch=3)
        self.workers[wid] = FakeWorker(slot.policy.config, published=self.published)

    def step(self) -> list[str]:
        """One plan per worker, run and applied; returns the requests that finished."""
        finished = []
        for wid, plan in self.cluster.plan_steps(0.0, 3, 1, lambda plan, expected: 30.0, 1.0):
            before = set(self.cluster.owner)
            self.cluster.apply_result(self.workers[wid].run(plan), epoch=3, now=0.0)
            finished += [r for r in before if r not in self.cluster.owner]
        return finished


def test_a_request_goes_to_the_worker_holding_its_prefix_within_the_load_slack():
    sim = Sim("a", "b")
    c = sim.cluster
    system = tokens("sys", 200)
    c.admit(chat_req("first", system + tokens("u1", 10)))
    assert c.owner["first"] == "a"
    while c.owner:
        sim.step()
    assert c.workers["a"].policy.num_cached_tokens(system + [1]) == 192
    # b is idle as well: a tie on load, but a holds the prefix
    c.admit(chat_req("second", system + tokens("u2", 10)))
    assert c.owner["second"] == "a"
    # a holds 1 sequence more than b now; up to the slack (4, or b's load) more, the prefix still wins
    a = c.workers["a"].policy
    for i in range(3):
        a.add_request(chat_req(f"load{i}", tokens(f"y{i}", 30)))
    c.admit(chat_req("third", system + tokens("u3", 10)))
    assert c.owner["third"] == "a"
    # past it (5 more), load wins
    c.admit(chat_req("fourth", system + tokens("u4", 10)))
    assert c.owner["fourth"] == "b"


def test_a_restarted_worker_is_never_told_it_holds_a_prefix_and_a_new_scheduler_forgets_the_index():
    sim = Sim("a")
    c = sim.cluster
    system = tokens("sys", 100)
    c.admit(chat_req("r1", system + [5]))
    while c.owner:
        sim.step()
    assert c.workers["a"].policy.num_cached_tokens(system + [6]) == 96
    assert c.stats().prefix_cache.cached_blocks > 0 and c.stats().prefix_cache.queries == 101
    # the worker restarts (a new life): its cache is empty, and so is its new policy's index
    c.gone_workers({"a": info("a", started_at=2.0)})
    assert "a" not in c.workers
    sim.add("a", started_at=2.0)
    c.admit(chat_req("r2", system + [6]))
    [plan] = [p for _, p in c.plan_steps(0.0, 3, 1, lambda plan, expected: 30.0, 1.0)]
    assert plan.starts[0].num_cached == 0
    st = c.stats()
    assert st.prefix_cache.queries == 101 + 101 and st.prefix_cache.hits == 0  # kept across the retire
    # a scheduler taking over builds its policies afresh: nothing is cached in its view
    fresh = Cluster(KEYS, PolicyLimits())
    fresh.add_worker(info("a", started_at=2.0), epoch=4)
    assert fresh.workers["a"].policy.num_cached_tokens(system + [6]) == 0


def test_a_lost_worker_s_shared_sequences_release_their_references_and_move():
    sim = Sim("a", "b")
    c = sim.cluster
    system = tokens("sys", 64)
    c.admit(chat_req("warm", system + [1]))
    while c.owner:
        sim.step()
    for i in range(3):
        c.admit(chat_req(f"s{i}", system + tokens(f"t{i}", 5), max_tokens=20))
    sim.step()
    assert {c.owner[f"s{i}"] for i in range(2)} == {"a"}  # the cached prefix draws them to a (within slack)
    policy = c.workers["a"].policy
    assert any(policy.kv.block_manager.refs(b) > 1 for s in policy.queues.running for b in s.block_table)
    c.retire_worker("a", "heartbeat expired")  # take_all: every reference released once, none twice
    assert policy.num_used_blocks == 0 and policy.num_free_blocks == policy.config.num_blocks
    assert all(c.owner[f"s{i}"] == "b" for i in range(3))


def test_sixteen_multi_turn_sessions_stay_with_their_prefix_and_the_load_stays_balanced():
    """Two mixed workers, 16 concurrent sessions of 6 turns resending their history: later turns land on the
    worker holding their history, and neither worker takes more than 1.5x the sequences of the other."""
    rng = random.Random(5)
    sim = Sim("a", "b", num_blocks=512)
    c = sim.cluster
    system = tokens("sys", 120)
    history = {s: system + tokens(f"s{s}u0", rng.randint(5, 30)) for s in range(16)}
    turn = dict.fromkeys(range(16), 0)
    home: dict[int, str] = {}
    landed = later = 0
    admitted = {"a": 0, "b": 0}
    waiting_to_send = list(range(16))
    rng.shuffle(waiting_to_send)
    in_flight: dict[str, int] = {}
    for _ in range(5000):
        # a few sessions send their next turn at random moments
        for s in list(waiting_to_send):
            if rng.random() < 0.3:
                waiting_to_send.remove(s)
                rid = f"s{s}-t{turn[s]}"
                holder = max(c.workers, key=lambda w: c.workers[w].policy.num_cached_tokens(history[s]))
                holds = c.workers[holder].policy.num_cached_tokens(history[s]) > len(system)
                c.admit(chat_req(rid, history[s], max_tokens=rng.randint(3, 12)))
                admitted[c.owner[rid]] += 1
                if turn[s] > 0:
                    later += 1
                    landed += holds and c.owner[rid] == holder
                in_flight[rid] = s
        for rid in sim.step():
            s = in_flight.pop(rid)
            answer = sim.published[rid]
            history[s] = history[s] + answer + tokens(f"s{s}u{turn[s] + 1}", rng.randint(5, 30))
            turn[s] += 1
            if turn[s] < 6:
                waiting_to_send.append(s)
        if not waiting_to_send and not in_flight:
            break
    assert all(t == 6 for t in turn.values())
    assert later == 16 * 5
    assert landed >= 0.9 * later, (landed, later)
    assert max(admitted.values()) <= 1.5 * min(admitted.values()), admitted


def test_a_prompt_that_shares_a_long_prefix_but_missed_the_cache_says_where_they_differ():
    from structlog.testing import capture_logs

    sim = Sim("a")
    c = sim.cluster
    system = tokens("sys", 150)
    c.admit(chat_req("r1", system + [5]))
    while c.owner:
        sim.step()
    changed = list(system)
    changed[40] += 1  # a template writing one early token differently (a date, say)
    with capture_logs() as logs:
        c.admit(chat_req("r2", changed + [5]))
        c.admit(chat_req("r3", system + [6]))  # shares all of it, and finds it cached: no line
    lines = [e for e in logs if e["event"] == "prefix cache matched little of a similar prompt"]
    assert len(lines) == 1
    line = lines[0]
    assert line["request_id"] == "r2" and line["similar_request_id"] == "r1" and line["first_difference"] == 40
    assert line["cached_tokens"] == 32 and line["tokens_in_common"] == 150 and line["log_level"] == "debug"


def lora_req(rid: str, prompt: list[int], adapter: str | None, max_tokens: int = 6) -> SubmitRequest:
    lora = LoraRef(adapter, f"/adapters/{adapter}") if adapter else None
    return SubmitRequest(rid, "gw", list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0), lora=lora)


def test_blocks_are_named_with_the_adapter_so_none_is_shared_between_adapters():
    sim = Sim("a")
    c = sim.cluster
    prompt = tokens("shared", 100)
    c.admit(lora_req("x", prompt, "sql"))
    while c.owner:
        sim.step()
    policy = c.workers["a"].policy

    def cached(adapter: str | None, path: str | None = None) -> int:
        return policy.num_cached_tokens(prompt, request_seed(lora_req("probe", prompt, adapter)) if path is None
                                        else scope_seed("", "", LoraRef(adapter, path).key))

    assert cached("sql") == 96
    assert cached(None) == 0 and cached("chat") == 0
    assert cached("sql", "/elsewhere/sql") == 0  # the same name from another folder is another adapter
    for rid, adapter in (("base", None), ("chat", "chat"), ("sql-again", "sql")):
        c.admit(lora_req(rid, prompt, adapter))
    while c.owner:
        sim.step()
    assert cached(None) == 96 and cached("chat") == 96
    # a tenant's scope and an adapter together: a seed of its own, and the base model's names are unchanged
    assert scope_seed("team-a", "", "k") not in (scope_seed("team-a", ""), scope_seed("", "", "k"))
    assert scope_seed("", "") == b""


def test_a_request_goes_to_a_worker_holding_its_adapter_within_the_load_slack():
    sim = Sim("a", "b")
    c = sim.cluster
    c.admit(lora_req("first", tokens("p1", 20), "sql"))
    assert c.owner["first"] == "a"
    c.admit(lora_req("other", tokens("p2", 20), None))
    assert c.owner["other"] == "b"  # the least loaded, with no adapter to prefer a worker
    # b is idle but a holds the adapter: within the slack, a
    for i in range(3):
        c.admit(lora_req(f"more{i}", tokens(f"p3{i}", 20), "sql"))
    assert [c.owner[f"more{i}"] for i in range(3)] == ["a", "a", "a"]
    # past the slack (a holds 5 sequences more than b's 1), load wins: b gets it, and holds the adapter then
    for i in range(2):
        c.workers["a"].policy.add_request(lora_req(f"load{i}", tokens(f"p4{i}", 20), None))
    c.admit(lora_req("spill", tokens("p5", 20), "sql"))
    assert c.owner["spill"] == "b" and c.workers["b"].loras.holds(LoraRef("sql", "/adapters/sql").key)


def test_a_worker_forgets_the_least_recently_used_adapters_past_its_max_loras():
    recency = AdapterRecency(2)
    for key in ("a", "b", "a", "c"):
        recency.use(key)
    assert recency.keys() == ["a", "c"] and not recency.holds("b") and not recency.holds(None)
    assert AdapterRecency(0).limit == DEFAULT_MAX_LORAS  # an older worker that does not say
