"""`python -m bench.live_view_cost`: workload A with a browser on the live view against without, side by side.

One `phaseserve up` serves every run. A headless Chromium (Debian's, driven by Playwright: tests/browser.py's
flags) is open throughout; in the "live view" arm one of its pages shows /ui/stack (so the gateway streams
frames and the scheduler writes its view: gateway/live_view.py, phaseserve/stack_view.py), in the "without"
arm that page is on about:blank and the view is off (the scheduler stops writing once the gateway's
`view-wanted` key expires; each switch waits that out). The arms alternate A B B A A B ... over --rounds
pairs, after one warm-up run, so drift in a shared machine's load falls on both. Prints each run, then per arm
the mean output tok/s and the median of the runs' TTFT and ITL p50/p99, and the ratio live-view / without.

  python -m bench.live_view_cost                      # bundled model, workload A, 3 pairs
  python -m bench.live_view_cost --model smollm2 --rounds 4 --phaseserve-arg=--workers=2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.servers import phaseserve_server
from bench.side_by_side import bench_args
from phaseserve.stack.benchmark import cli as bench_cli
from phaseserve.stack.benchmark.models import resolve_model
from phaseserve.redis_server import free_port

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--disable-quic", "--no-first-run"]
ARMS = ("without", "live view")
SWITCH_S = 4.0  # longer than the gateway's view-wanted TTL: the scheduler has stopped writing its view
COLUMNS = (("output tok/s", "output_throughput"), ("TTFT p50 ms", "p50_ttft_ms"), ("TTFT p99 ms", "p99_ttft_ms"),
           ("ITL p50 ms", "p50_itl_ms"), ("ITL p99 ms", "p99_itl_ms"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.live_view_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bundled", help="bundled, small-200m, smollm2, or anything `phaseserve up --model` takes")
    p.add_argument("--rounds", type=int, default=3, help="pairs of runs (one of each arm)")
    p.add_argument("--out-dir", default="bench/results", help="the JSON and the server's log go here")
    p.add_argument("--phaseserve-arg", action="append", default=[], metavar="ARG",
                   help="an extra flag for `phaseserve up` (repeatable)")
    p.add_argument("--chromium", default=CHROMIUM)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    return p


def order(rounds: int) -> list[str]:
    """A B, B A, A B, ...: each arm as often first as second."""
    out = []
    for i in range(rounds):
        out += list(ARMS if i % 2 == 0 else reversed(ARMS))
    return out


def summary(runs: list[dict]) -> dict:
    """Mean throughput and the median of each latency percentile over an arm's runs."""
    out = {"output_throughput": statistics.mean(r["metrics"]["output_throughput"] for r in runs)}
    for _, key in COLUMNS[1:]:
        out[key] = statistics.median(r["metrics"][key] for r in runs)
    return out


def format_table(by_arm: dict[str, dict]) -> str:
    head = f"{'':<14}" + "".join(f"{arm:>14}" for arm in ARMS) + f"{'ratio':>10}"
    lines = [head, "-" * len(head)]
    for title, key in COLUMNS:
        a, b = by_arm[ARMS[0]][key], by_arm[ARMS[1]][key]
        lines.append(f"{title:<14}{a:>14.1f}{b:>14.1f}{b / a if a else float('nan'):>9.3f}x")
    return "\n".join(lines)


def open_live_view(page, url: str) -> None:
    page.goto(url + "/ui/stack")
    page.wait_for_function("document.querySelectorAll('.worker .step').length > 0 || "
                           "document.querySelectorAll('.worker').length > 0", timeout=60_000)
    page.evaluate("""() => { window.frames_drawn = 0; new MutationObserver(() => { window.frames_drawn += 1; })
        .observe(document.querySelector('#workers'), {childList: true}); }""")


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    from playwright.sync_api import sync_playwright

    model_dir = resolve_model(args.model)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{Path(args.model).name}-{time.strftime('%Y%m%d-%H%M%S')}"
    server = phaseserve_server(model_dir, free_port(), "bench-model", out / f"live-view-cost-{tag}.log",
                               extra=args.phaseserve_arg)
    server.start(args.startup_timeout)
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    frames: list[int] = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto("about:blank")

            def run(label: str) -> dict:
                # in a thread of its own: Playwright's sync API holds this thread's event loop
                bargs = bench_args(extra, str(model_dir), label, server.url, "openai", "bench-model")
                with ThreadPoolExecutor(1) as pool:
                    return pool.submit(bench_cli.run_benchmark, bargs).result()

            run("warm-up")
            showing = False
            for arm in order(args.rounds):
                want = arm == "live view"
                if want != showing:
                    if want:
                        open_live_view(page, server.url)
                    else:
                        page.goto("about:blank")
                    showing = want
                    time.sleep(SWITCH_S)
                if want:
                    page.evaluate("window.frames_drawn = 0")
                result = run(arm)
                if want:
                    frames.append(page.evaluate("window.frames_drawn"))
                bench_cli.print_result(result)
                runs[arm].append(result)
            browser.close()
    finally:
        server.stop()
    by_arm = {arm: summary(rs) for arm, rs in runs.items()}
    print()
    print(f"model {model_dir} | workload {runs[ARMS[0]][0]['workload']} | order {' '.join(order(args.rounds))}")
    print(f"frames the live view drew during its runs: {frames}")
    for arm in ARMS:
        print(f"{arm} runs, output tok/s: " + ", ".join(f"{r['metrics']['output_throughput']:.1f}" for r in runs[arm]))
    print(format_table(by_arm))
    path = out / f"live-view-cost-{tag}.json"
    path.write_text(json.dumps({"model": str(model_dir), "order": order(args.rounds), "frames": frames,
                                "summary": by_arm, "runs": runs}, indent=1))
    print(f"wrote {path}")
    return 0 if all(r["metrics"]["completed"] for rs in runs.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
