"""The import layers, bottom to top (docs/architecture.md, "Parts"), over the folders of the one `phaseserve`
import package (setup.py maps each top-level folder to phaseserve.<folder>):

- the shared ground, phaseserve/ (phaseserve/models/ included), imports no service;
- kernels/ imports the ground only; the services (gateway/, scheduler/, workers/) import the ground only, never
  each other (workers/ also uses kernels/);
- stack/ composes the services (the CLI, the launcher, the in-process engine) and is imported by nothing below
  it (tests, bench and scripts may use it).

Every import counts, function-level ones too, so a lazy import cannot hide an edge; and no file anywhere
imports a service by its folder's bare name (from a checkout's root that would load a second copy of it)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVICES = {"scheduler", "workers", "gateway"}
FOLDERS = ("kernels", "stack", *sorted(SERVICES))  # top-level folder -> phaseserve.<folder>
ALLOWED = {  # layer -> the layers it may import (besides itself)
    "ground": set(),
    "kernels": {"ground"},
    "scheduler": {"ground"},
    "gateway": {"ground"},
    "workers": {"ground", "kernels"},
    "stack": {"ground", "kernels"} | SERVICES,
}


def layer_of(module: str) -> str | None:
    """The layer of a dotted module name of this repo (None: not this repo's)."""
    parts = module.split(".")
    if parts[0] != "phaseserve":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in FOLDERS else "ground"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] != "phaseserve":
        parts.insert(0, "phaseserve")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path) -> set[str]:
    """Every dotted module (or module.name, for `from m import name`) a file imports, anywhere in it;
    relative imports resolved."""
    found: set[str] = set()
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            # `from phaseserve import stack` names a module of another layer than its package's
            found.update(f"{module}.{a.name}" for a in node.names
                         if layer_of(f"{module}.{a.name}") != layer_of(module))
    return found


def layer_violations(root: Path) -> list[str]:
    """Each import across the layers in the repo at `root`, as "path imports module (layer)"."""
    bad = []
    for folder in ("phaseserve", *FOLDERS):
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            own = layer_of(module_name(path, root))
            for module in sorted(imported_modules(path, root)):
                layer = layer_of(module)
                if layer is not None and layer != own and layer not in ALLOWED[own]:
                    bad.append(f"{rel} imports {module} ({layer})")
    return bad


def bare_imports(root: Path) -> list[str]:
    """Imports of a mapped folder by its bare top-level name, anywhere in the repo's Python."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0].startswith(".") or "site-packages" in rel.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module
                     else [])
            bad += [f"{rel.as_posix()} imports {n}" for n in names if n.split(".")[0] in FOLDERS]
    return bad


def test_no_module_imports_across_its_layer():
    bad = layer_violations(ROOT)
    assert not bad, "imports across layers:\n" + "\n".join(bad)


def test_no_file_imports_a_service_by_its_bare_folder_name():
    bad = bare_imports(ROOT)
    assert not bad, "imports by a bare folder name (use phaseserve.<folder>):\n" + "\n".join(bad)


def test_the_check_catches_the_ground_importing_a_service_and_a_service_importing_the_stack(tmp_path):
    files = {
        "phaseserve/__init__.py": "",
        "phaseserve/settings.py": "def f():\n    from phaseserve.scheduler.service import main\n",  # lazy: still an edge
        "phaseserve/models/__init__.py": "from .. import stack\n",
        "stack/engine.py": "import phaseserve.scheduler.policy\nimport phaseserve.workers.runner\nfrom phaseserve import wire\n",
        "gateway/app.py": "from phaseserve.stack.engine import Engine\nfrom phaseserve.wire import Keys\n",
        "workers/runner.py": "from phaseserve import kernels\nfrom phaseserve.models import tokenizer\nimport gateway.app\n",
        "kernels/__init__.py": "",
        "scheduler/policy.py": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert layer_violations(tmp_path) == [
        "phaseserve/models/__init__.py imports phaseserve.stack (stack)",
        "phaseserve/settings.py imports phaseserve.scheduler.service (scheduler)",
        "gateway/app.py imports phaseserve.stack.engine (stack)",
    ]
    assert bare_imports(tmp_path) == ["workers/runner.py imports gateway.app"]
