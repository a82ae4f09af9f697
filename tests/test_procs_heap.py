"""phaseserve.procs.freeze_startup_heap: start-up objects leave the collector's walks, later garbage is still freed."""

import subprocess
import sys

CHILD = """
import gc, time
from phaseserve.procs import freeze_startup_heap
startup = [[i] for i in range(300_000)]  # what a service holds for its whole life
gc.collect()
t = time.perf_counter(); gc.collect(); before = time.perf_counter() - t
freeze_startup_heap()
assert gc.get_freeze_count() >= 300_000, gc.get_freeze_count()
t = time.perf_counter(); gc.collect(); after = time.perf_counter() - t
assert after < before / 3, (after, before)
class Node: pass
a, b = Node(), Node(); a.other, b.other = b, a  # a cycle made after start-up
del a, b
assert gc.collect() >= 2  # still collected
print("ok")
"""


def test_freeze_startup_heap_in_a_fresh_process():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
