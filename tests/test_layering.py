"""The import layers: the shared package (phaseserve/) and kernels/ import no service; services import no
other service (workers/ may use kernels/); only `phaseserve.engine`, the in-process engine that composes the
scheduler policy and the model runner, imports services from inside the shared package. Every import counts,
function-level ones too, so a lazy import cannot hide an edge."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVICES = {"scheduler", "workers", "gateway"}
COMPOSERS = {"phaseserve/engine.py"}  # above the services; see docs/architecture.md, "Parts"
ALLOWED = {  # package -> the other top-level packages it may import
    "phaseserve": set(),
    "kernels": {"phaseserve"},
    "scheduler": {"phaseserve"},
    "gateway": {"phaseserve"},
    "workers": {"phaseserve", "kernels"},
}
TOP_LEVEL = set(ALLOWED) | {"bench"}


def imported_packages(path: Path) -> set[str]:
    """The top-level packages of this repo that a module imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update(n.split(".")[0] for n in names if n.split(".")[0] in TOP_LEVEL)
    return found


def test_no_module_imports_across_its_layer():
    bad = []
    for pkg, allowed in ALLOWED.items():
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            extra = imported_packages(path) - allowed - {pkg}
            if rel in COMPOSERS:
                extra -= SERVICES
            if extra:
                bad.append(f"{rel} imports {sorted(extra)}")
    assert not bad, "imports across layers:\n" + "\n".join(bad)


def test_the_composers_are_imported_by_no_service_or_shared_module():
    composer_modules = {c.removesuffix(".py").replace("/", ".") for c in COMPOSERS} | {"phaseserve.launcher",
                                                                                       "phaseserve.cli"}
    bad = []
    for pkg in ALLOWED:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                mod = node.module if isinstance(node, ast.ImportFrom) and node.level == 0 else None
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if mod == "phaseserve":  # from phaseserve import engine
                    names = [f"phaseserve.{a.name}" for a in node.names]
                elif mod:
                    names = [mod]
                for name in names:
                    if name in composer_modules and rel.removesuffix(".py").replace("/", ".") not in composer_modules:
                        bad.append(f"{rel} imports {name}")
    assert not bad, "a composing module imported from below:\n" + "\n".join(bad)
