"""scripts/structure.py: the layer rule and the figure rule it counts by, on a repo written for the test."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("structure", ROOT / "scripts" / "structure.py")
structure = importlib.util.module_from_spec(spec)
spec.loader.exec_module(structure)


def test_the_layers_read_by_module_name_today_and_under_one_namespace():
    layer = structure.layer_of_module
    assert layer("phaseserve.wire") == layer("phaseserve.models.model_source") == "ground"
    assert layer("phaseserve.stack.cli") == layer("stack.launcher") == layer("phaseserve.stack.benchmark.cli") == "composers"
    assert layer("gateway.app") == layer("phaseserve.gateway.app") == "gateway"
    assert layer("phaseserve.kernels") == layer("kernels.cpu_isa") == "kernels"
    assert layer("numpy") is None


def test_a_machine_figure_is_a_number_with_a_unit_of_time_rate_or_ratio():
    figures = ["takes 3 ms", "1.7 s a read", "~40 µs", "12 tok/s", "25 GB/s", "1.5x faster", "0.98×", "7% of it"]
    not_figures = ["the default `1.3x`", "'80ms' or 'off'", "503s until it is up", "16x16 tiles", "0x1F",
                   "2 × layers × kv_heads", "3 steps"]
    assert all(structure.FIGURE.search(t) for t in figures), [t for t in figures if not structure.FIGURE.search(t)]
    assert not any(structure.FIGURE.search(t) for t in not_figures), [t for t in not_figures
                                                                      if structure.FIGURE.search(t)]


def test_a_small_repo_in_numbers(tmp_path):
    def write(rel: str, text: str) -> None:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)

    write("README.md", "# x\n")
    write("docs/a.md", "see [r](../bench/results/2026-01-01-x.md)\n")
    write("phaseserve/wire.py", "import gateway.app  # runs back up\n")
    write("stack/cli.py", "import gateway.app\nimport scheduler.policy\n")  # composers may
    write("gateway/app.py", "class A: pass\nclass B: pass\nclass C(A, B):\n    '''a step took 3 ms'''\n")
    write("scheduler/policy.py", "from gateway import app\nclass StepsMixin: pass\n" + "x = 1\n" * 401)
    write("workers/runner.py", "import kernels.quant\n")  # workers may use kernels
    write("kernels/quant.py", "import workers.runner\n")  # kernels sit under workers
    assert structure.upward_imports(tmp_path) == [
        "kernels/quant.py (kernels) -> workers.runner (workers)",
        "phaseserve/wire.py (ground) -> gateway.app (gateway)",
        "scheduler/policy.py (scheduler) -> gateway (gateway)",
    ]
    assert structure.mixin_classes(tmp_path) == ["gateway/app.py:C(A, B)", "scheduler/policy.py:StepsMixin()"]
    assert structure.long_files(tmp_path) == ["scheduler/policy.py: 403"]
    assert structure.comments_with_figures(tmp_path) == ["gateway/app.py:4: a step took 3 ms"]
    assert structure.dated_record_citations(tmp_path) == ["docs/a.md:1: 2026-01-01-x.md"]
    assert "README.md: 0.0 KB (4 bytes)" in structure.report(tmp_path)
