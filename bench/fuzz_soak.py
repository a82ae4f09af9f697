"""A fuzz soak: schemathesis over every operation of `/openapi.json` for a fixed time, while another key
streams beside it. Does any request get a 5xx, and does the other key's stream ever stall?

`python -m bench.fuzz_soak [--minutes 10] [--model DIR] [--stall-limit 1.0]`

One `phaseserve up` stack on the model (the bundled one by default) with a keys file of two tenants: the
fuzzer's key sends whatever the schema allows and much it does not (hypothesis' strategies of each
operation, round after round with fresh seeds, generations capped at a few tokens); the victim's key
streams one chat completion after another and records the longest wait for its next chunk. The run ends
with the count of answers by status, the 5xx (with the request that got it), and the victim's longest
stall; the exit code is 1 where a 5xx was seen or a stall passed `--stall-limit`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import tempfile
import threading
import time
from pathlib import Path

import aiohttp

from bench.servers import phaseserve_server
from phaseserve.stack.benchmark.sse import sse_messages
from phaseserve.models.model_source import bundled_model_path
from phaseserve.redis_server import free_port

FUZZER_KEY, VICTIM_KEY = "fuzzer-key", "victim-key"
VICTIM_PROMPTS = ["Tell me a story about a fox.", "Count to twenty in words.", "Describe a CPU.",
                  "Write a short poem about the sea."]


def keys_file(folder: Path) -> Path:
    path = folder / "keys.json"
    path.write_text(json.dumps({
        "tenants": {"fuzzer": {}, "victim": {}},
        "keys": [{"name": "fuzzer", "key": FUZZER_KEY, "tenant": "fuzzer"},
                 {"name": "victim", "key": VICTIM_KEY, "tenant": "victim"}]}))
    return path


class Victim:
    """Streams chat completions with its own key until stopped; keeps the longest gap between chunks."""

    def __init__(self, base_url: str, model: str):
        self.url, self.model = base_url + "/v1/chat/completions", model
        self.longest_stall = 0.0
        self.streams = 0
        self.errors: list[str] = []
        self._stop = asyncio.Event()
        self._rng = random.Random(0)  # its own: hypothesis warns where strategies share the global one

    async def run(self) -> None:
        headers = {"Authorization": f"Bearer {VICTIM_KEY}"}
        async with aiohttp.ClientSession() as session:
            while not self._stop.is_set():
                body = {"model": self.model, "stream": True, "max_tokens": 64, "temperature": 0,
                        "messages": [{"role": "user", "content": self._rng.choice(VICTIM_PROMPTS)}]}
                last = time.monotonic()
                async with session.post(self.url, json=body, headers=headers) as resp:
                    if resp.status != 200:
                        self.errors.append(f"{resp.status}: {(await resp.text())[:200]}")
                        await asyncio.sleep(0.5)
                        continue
                    async for _, data in sse_messages(resp):
                        now = time.monotonic()
                        self.longest_stall = max(self.longest_stall, now - last)
                        last = now
                        if data is not None and "error" in data:
                            self.errors.append(str(data["error"])[:200])
                self.streams += 1

    def stop(self) -> None:
        self._stop.set()


def fuzz(base_url: str, deadline: float, statuses: collections.Counter, server_errors: list[str]) -> None:
    """Rounds of every operation's hypothesis strategy, a fresh seed each round, until `deadline`."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    operations = [op.ok() for op in schema.get_all_operations()]
    headers = {"Authorization": f"Bearer {FUZZER_KEY}"}
    while time.monotonic() < deadline:
        for op in operations:
            if time.monotonic() >= deadline:
                return

            @given(case=op.as_strategy())
            @settings(max_examples=20, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            def one(case):
                if time.monotonic() >= deadline:
                    return
                if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
                    case.body["max_tokens"] = min(case.body["max_tokens"], 8)  # the answers matter, not long outputs
                if isinstance(case.body, dict) and isinstance(case.body.get("max_output_tokens"), int):
                    case.body["max_output_tokens"] = min(case.body["max_output_tokens"], 8)
                response = case.call(headers=headers, timeout=120)
                statuses[response.status_code] += 1
                if response.status_code >= 500:
                    server_errors.append(f"{case.method} {case.formatted_path} {str(case.body)[:300]} -> "
                                         f"{response.status_code} {response.text[:300]}")

            one()


async def soak(base_url: str, model: str, minutes: float) -> tuple[collections.Counter, list[str], Victim]:
    statuses: collections.Counter = collections.Counter()
    server_errors: list[str] = []
    victim = Victim(base_url, model)
    victim_task = asyncio.create_task(victim.run())
    deadline = time.monotonic() + minutes * 60
    fuzzer = threading.Thread(target=fuzz, args=(base_url, deadline, statuses, server_errors), daemon=True)
    fuzzer.start()
    while fuzzer.is_alive():
        await asyncio.sleep(1.0)
    victim.stop()
    await victim_task
    return statuses, server_errors, victim


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: the bundled model)")
    ap.add_argument("--stall-limit", type=float, default=1.0, help="the victim's longest allowed chunk gap, s")
    args = ap.parse_args(argv)
    model_dir = args.model or Path(bundled_model_path())
    with tempfile.TemporaryDirectory(prefix="fuzz-soak-") as tmp:
        server = phaseserve_server(model_dir, free_port(), "fuzzed", Path(tmp) / "stack.log",
                                   extra=["--api-keys-file", str(keys_file(Path(tmp)))])
        with server:
            t0 = time.monotonic()
            statuses, server_errors, victim = asyncio.run(soak(server.url, "fuzzed", args.minutes))
            elapsed = time.monotonic() - t0
    print(f"fuzz soak: {elapsed / 60:.1f} min, {sum(statuses.values())} fuzzed requests, by status: "
          f"{dict(sorted(statuses.items()))}")
    print(f"5xx answers: {len(server_errors)}")
    for line in server_errors[:20]:
        print("  ", line)
    print(f"victim: {victim.streams} streams, longest stall {victim.longest_stall:.3f} s "
          f"(limit {args.stall_limit} s), errors: {len(victim.errors)}")
    for line in victim.errors[:10]:
        print("  ", line)
    return 1 if server_errors or victim.errors or victim.longest_stall > args.stall_limit else 0


if __name__ == "__main__":
    raise SystemExit(main())
