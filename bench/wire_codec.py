"""`python -m bench.wire_codec [--ref main] [--rounds 7]`: the wire codec's cost, this tree's against another
revision's, side by side in one process.

The old wire (phaseserve/wire.py, or the package phaseserve/wire/, and the params.py it uses) is taken from
`git show REF:...` into a temporary folder, so both codecs run on the same machine at the same moment,
alternating in rounds. Messages: a typical StepPlan (16 decodes with their block tables, and a new sequence's 512-token prefill chunk), the
StepResult and the TokenBatch of such a step. Prints microseconds per encode and per decode (best round)
and the ratio new / old (above 1: the new code is slower).
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

from phaseserve import wire as new_wire

BLOCK_SIZE = 16


def load_old(ref: str, into: Path) -> ModuleType:
    """The wire at `ref` (one module, phaseserve/wire.py, or the package phaseserve/wire/), importing the
    params.py of the same revision."""
    root = Path(__file__).resolve().parent.parent

    def show(path: str) -> str | None:
        done = subprocess.run(["git", "show", f"{ref}:{path}"], cwd=root, capture_output=True, text=True)
        return done.stdout if done.returncode == 0 else None

    def rename(src: str) -> str:
        return src.replace("from phaseserve.params import", "from old_params import").replace(
            "phaseserve.wire", "old_wire")

    (into / "old_params.py").write_text(show("phaseserve/params.py"))
    module = show("phaseserve/wire.py")
    if module is not None:
        (into / "old_wire.py").write_text(rename(module))
    else:
        (into / "old_wire").mkdir()
        names = subprocess.run(["git", "ls-tree", "--name-only", f"{ref}:phaseserve/wire/"], cwd=root, check=True,
                               capture_output=True, text=True).stdout.split()
        for name in names:
            if name.endswith(".py"):
                (into / "old_wire" / name).write_text(rename(show(f"phaseserve/wire/{name}")))
    sys.path.insert(0, str(into))
    return importlib.import_module("old_wire")


def messages(w: ModuleType) -> dict[str, object]:
    """A typical step's messages, built with module `w`'s classes."""
    SamplingParams = w.SamplingParams  # the one that module imported
    decodes = [w.ScheduledChunk(f"req-{i}", 1000 + 37 * i, 1, list(range(i * 100, i * 100 + (1001 + 37 * i) // BLOCK_SIZE + 1)))
               for i in range(16)]
    prompt = list(range(1000, 1512))
    start = w.SeqStart("req-new", "gw-0", prompt, SamplingParams(max_tokens=256, temperature=0.7, top_p=0.95, seed=3))
    prefill = w.ScheduledChunk("req-new", 0, len(prompt), list(range(5000, 5000 + len(prompt) // BLOCK_SIZE)))
    plan = w.StepPlan(1234, "worker-0", [start], decodes + [prefill], ["req-old"], epoch=2, timeout_s=1.5)
    events = [w.TokenEvent(f"req-{i}", 200 + i, [300 + i]) for i in range(16)] + [w.TokenEvent("req-new", 0, [42])]
    events[3].finish_reason = "stop"
    return {"StepPlan": plan, "StepResult": w.StepResult(1234, "worker-0", events, 16 + len(prompt), 0.031, 2),
            "TokenBatch": w.TokenBatch(1234, "worker-0", events)}


def per_call_us(fn, arg, number: int) -> float:
    t0 = time.perf_counter()
    for _ in range(number):
        fn(arg)
    return (time.perf_counter() - t0) / number * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default="main", help="the git revision whose wire is the old codec")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--number", type=int, default=2000, help="calls per round")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        old_wire = load_old(args.ref, Path(tmp))
        old_msgs, new_msgs = messages(old_wire), messages(new_wire)
        print(f"wire codec, this tree vs {args.ref}: best of {args.rounds} rounds of {args.number} calls, us per call")
        print(f"{'message':<11} {'op':<7} {'bytes':>6} {'old':>8} {'new':>8} {'new/old':>8}")
        for name in old_msgs:
            old_bytes, new_bytes = old_msgs[name].to_wire(), new_msgs[name].to_wire()
            assert old_bytes == new_bytes, f"{name}: the two codecs' bytes differ"
            old_cls, new_cls = type(old_msgs[name]), type(new_msgs[name])
            ops = {"encode": ((old_cls.to_wire, old_msgs[name]), (new_cls.to_wire, new_msgs[name])),
                   "decode": ((old_cls.from_wire, old_bytes), (new_cls.from_wire, new_bytes))}
            for op, ((old_fn, old_arg), (new_fn, new_arg)) in ops.items():
                best_old = best_new = float("inf")
                for _ in range(args.rounds):  # alternating: both see the same machine load
                    best_old = min(best_old, per_call_us(old_fn, old_arg, args.number))
                    best_new = min(best_new, per_call_us(new_fn, new_arg, args.number))
                print(f"{name:<11} {op:<7} {len(new_bytes):>6} {best_old:>8.2f} {best_new:>8.2f} {best_new / best_old:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
