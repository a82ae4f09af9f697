"""The house in numbers, as a newcomer meets it: run `python scripts/structure.py` from the repo root.

Prints, per service package, its largest class and function (in lines); the lines of the scheduler's service
loop and policy; the imports from the shared ground (phaseserve/ outside phaseserve/stack/, the top layer that
composes the services) into any service; code comments that carry a
unit of time or a ratio (figures that rot); and docs headings with a date in them (a lab notebook's headings).
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "scheduler", "workers", "kernels", "phaseserve")
SERVICES = ("gateway", "scheduler", "workers")
WATCHED_FILES = ("scheduler/service.py", "scheduler/policy.py")
# a number followed by a unit of time, or a ratio such as 1.5x / 0.98x
FIGURE = re.compile(r"\b\d+(\.\d+)?\s*(ns|us|µs|ms|s|sec|seconds|minutes)\b|\b\d+(\.\d+)?x\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def python_files(pkg: str) -> list[Path]:
    return sorted(p for p in (ROOT / pkg).rglob("*.py") if "bundled_model" not in p.parts)


def largest(pkg: str, kind: type) -> tuple[int, str]:
    best = (0, "-")
    for path in python_files(pkg):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, kind):
                size = node.end_lineno - node.lineno + 1
                best = max(best, (size, f"{path.relative_to(ROOT)}:{node.name}"))
    return best


def shared_imports_of_services() -> list[str]:
    """Modules of the shared ground that import a service (it should import none; phaseserve/stack/ may)."""
    found = []
    for path in python_files("phaseserve"):
        if "stack" in path.relative_to(ROOT / "phaseserve").parts[:1]:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                     else [])
            for name in names:
                if name.split(".")[0] in SERVICES:
                    found.append(f"{path.relative_to(ROOT)} -> {name}")
    return sorted(set(found))


def comments_with_figures() -> list[str]:
    found = []
    for pkg in PACKAGES:
        for path in python_files(pkg):
            tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
            for tok in tokens:
                if tok.type == tokenize.COMMENT and FIGURE.search(tok.string):
                    found.append(f"{path.relative_to(ROOT)}:{tok.start[0]}")
    return found


def dated_doc_headings() -> list[str]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("#") and DATE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}")
    return found


def main() -> int:
    verbose = "-v" in sys.argv
    print("largest class and function per package (lines):")
    for pkg in PACKAGES:
        (cls_n, cls), (fn_n, fn) = largest(pkg, ast.ClassDef), largest(pkg, (ast.FunctionDef, ast.AsyncFunctionDef))
        print(f"  {pkg:<11} class {cls_n:>4}  {cls}\n  {'':<11} func  {fn_n:>4}  {fn}")
    for rel in WATCHED_FILES:
        print(f"lines of {rel}: {len((ROOT / rel).read_text().splitlines())}")
    for title, rows in (("shared package imports of a service", shared_imports_of_services()),
                        ("code comments with a time or a ratio", comments_with_figures()),
                        ("docs headings with a date", dated_doc_headings())):
        print(f"{title}: {len(rows)}")
        if verbose:
            print("".join(f"    {r}\n" for r in rows), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
