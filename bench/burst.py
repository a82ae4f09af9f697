"""`python -m bench.burst --streams 1000`: open many SSE streams at once and count how many complete.

Starts `phaseserve up` (default: the bundled model) unless --base-url is given, opens --streams streaming
completions all at once (greedy, --tokens each, ignore_eos), reads every stream to its end, and reports
how many completed, the failures by status, the wall time, time to first token, and the gateway's
resident memory (peak: VmHWM of the gateway process, when this command started the stack).

What it guards: with a Redis connection per request in flight, a burst of streams failed with 503 ('Too
many connections'); the gateway shares a bounded pool instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp

from bench.servers import ServerProcess
from phaseserve.stack.benchmark.sse import sse_messages
from phaseserve.redis_server import free_port


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.burst", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=1000, help="streams opened at once")
    p.add_argument("--tokens", type=int, default=16, help="max_tokens of each stream")
    p.add_argument("--base-url", help="a running server (default: start `phaseserve up` for this run)")
    p.add_argument("--model", default="bundled", help="what `phaseserve up` serves (default: bundled)")
    p.add_argument("--up-arg", action="append", default=[], help="extra flag for `phaseserve up` (repeatable)")
    p.add_argument("--log", default="/tmp/phaseserve-burst.log", help="where the started stack logs")
    p.add_argument("--json-out", help="write the figures here as JSON")
    return p.parse_args(argv)


def children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def gateway_pid(launcher_pid: int) -> int | None:
    for pid in children(launcher_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"gateway" in cmd and b"-m" in cmd:
            return pid
    return None


def memory_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


async def one_stream(http: aiohttp.ClientSession, url: str, model: str, i: int, tokens: int, t0: float) -> dict:
    body = {"model": model, "prompt": f"Stream {i} says", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    first = None
    text_tokens = 0
    try:
        async with http.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                return {"status": r.status, "ok": False}
            done = finished = False
            async for _event_id, obj in sse_messages(r):
                if obj is None:  # [DONE]
                    done = True
                    continue
                if "error" in obj:
                    return {"status": "stream error", "ok": False}
                if first is None:
                    first = time.monotonic() - t0
                text_tokens += 1
                finished = finished or obj["choices"][0]["finish_reason"] == "length"
            return {"status": 200, "ok": done and finished, "ttft": first, "end": time.monotonic() - t0}
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return {"status": type(e).__name__, "ok": False}


async def burst(url: str, streams: int, tokens: int) -> dict:
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
        async with http.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        t0 = time.monotonic()
        results = await asyncio.gather(*(one_stream(http, url, model, i, tokens, t0) for i in range(streams)))
        wall = time.monotonic() - t0
    ok = [r for r in results if r["ok"]]
    ttfts = sorted(r["ttft"] for r in ok if r.get("ttft") is not None)
    return {"streams": streams, "completed": len(ok), "wall_s": round(wall, 2),
            "failures": dict(Counter(str(r["status"]) for r in results if not r["ok"])),
            "ttft_p50_s": round(statistics.median(ttfts), 2) if ttfts else None,
            "ttft_max_s": round(ttfts[-1], 2) if ttfts else None,
            "output_tok_s": round(len(ok) * tokens / wall, 1)}


def main(argv=None) -> int:
    args = parse_args(argv)
    server = None
    if args.base_url is None:
        port = free_port()
        cmd = [sys.executable, "-m", "phaseserve.stack.cli", "up", "--model", args.model, "--port", str(port),
               *args.up_arg]
        server = ServerProcess("phaseserve", cmd, port, Path(args.log)).start()
        url = server.url
    else:
        url = args.base_url.rstrip("/")
    try:
        gw = gateway_pid(server.proc.pid) if server else None
        before = memory_kib(gw) if gw else {}
        figures = asyncio.run(burst(url, args.streams, args.tokens))
        if gw:
            after = memory_kib(gw)
            figures.update(gateway_rss_before_mib=round(before["VmRSS"] / 1024, 1),
                           gateway_peak_rss_mib=round(after["VmHWM"] / 1024, 1))
    finally:
        if server:
            server.stop()
    print(json.dumps(figures, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(figures, indent=2))
    return 0 if figures["completed"] == figures["streams"] else 1


if __name__ == "__main__":
    sys.exit(main())
