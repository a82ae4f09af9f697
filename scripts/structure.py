"""The house in numbers, as a newcomer meets it: `python scripts/structure.py [-v] [REPO]` (REPO: the repo root,
by default the one holding this script; `-v` lists every row behind a count).

Prints, per part (the services gateway/, scheduler/, workers/ with kernels/ under them, the shared ground
phaseserve/, the composers), its largest class and function in lines; the files over 400 lines; the mixin
classes (named *Mixin, or with two or more bases that are classes of this repo); the imports that run back up
the layers; the comment and docstring lines that carry a machine figure (a number with a unit of time, rate or
ratio, which rots as machines and code change); the docs' citations of dated records and headings with a date;
and the README's size.

The layers, bottom to top: the shared ground (phaseserve/, except the composers) < the services (gateway/,
scheduler/, workers/; kernels/ sits under workers/, which alone may use it) < the composers (the CLI, the
launcher, the in-process engine and the benchmark client that drives it: stack/; in a tree from before the
one import package, phaseserve/stack/ and phaseserve/benchmark/). An import runs back up when a shared module imports a
service or a composer, or a service imports a composer or another service (workers/ may import kernels/).
Imports are read by module name, so `phaseserve.gateway.x` (the folders mapped under one namespace) is the
gateway as much as `gateway.x` is in an older tree: the script reads a tree from before and after.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

SERVICES = ("gateway", "scheduler", "workers")
PARTS = (*SERVICES, "kernels", "phaseserve", "composers")
COMPOSER_FOLDERS = ("stack", "phaseserve/stack", "phaseserve/benchmark")  # today, and before the one package
LONG_FILE = 400
RANK = {"ground": 0, "kernels": 1, "gateway": 1, "scheduler": 1, "workers": 1, "composers": 2}
# a number and a unit of time, rate or ratio: 3 ms, 1.7 s, 40 µs, 12 tok/s, 25 GB/s, 1.5x, 0.98×, 7%; not a
# setting's value quoted as written (`1.3x`, '80ms') nor a plural ("503s")
FIGURE = re.compile(
    r"(?<![\w.`'\"])\d+(?:[.,]\d+)*(?:"
    r"\s*(?:ns|us|µs|ms)(?![\w/])|\s+(?:s|sec|secs|seconds?|minutes?|hours?)(?![\w/])"
    r"|\s*(?:tok|tokens|req|requests|steps|GB|MB|KB|GiB|MiB|GFLOP|TFLOP|B)/s(?!\w)"
    r"|[x×](?!\w)"
    r"|\s*%)")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
DATED_RECORD = re.compile(r"\b20\d\d-\d\d-\d\d-[\w.-]+\.md\b")


def python_files(root: Path, folder: str) -> list[Path]:
    base = root / folder
    if not base.is_dir():
        return []
    return sorted(p for p in base.rglob("*.py") if "bundled_model" not in p.parts)


def part_of_path(root: Path, path: Path) -> str:
    rel = path.relative_to(root).as_posix()
    if any(rel == c or rel.startswith(c + "/") for c in COMPOSER_FOLDERS):
        return "composers"
    return rel.split("/")[0]


def layer_of_module(module: str) -> str | None:
    """The layer of a dotted module name of this repo (None: not this repo's)."""
    parts = module.split(".")
    if parts[0] == "phaseserve" and len(parts) > 1 and parts[1] in (*SERVICES, "kernels", "stack"):
        parts = parts[1:]  # the folders mapped under the phaseserve namespace
    top = parts[0]
    if top in ("stack",) or (top == "phaseserve" and len(parts) > 1 and parts[1] in ("stack", "benchmark")):
        return "composers"
    if top == "phaseserve":
        return "ground"
    return top if top in (*SERVICES, "kernels") else None


def layer_of_path(root: Path, path: Path) -> str:
    part = part_of_path(root, path)
    return "ground" if part == "phaseserve" else part


def product_files(root: Path) -> list[Path]:
    files = {p for folder in (*SERVICES, "kernels", "phaseserve", "stack") for p in python_files(root, folder)}
    return sorted(files)


def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def largest_per_part(root: Path) -> dict[str, tuple[tuple[int, str], tuple[int, str]]]:
    best: dict[str, list[tuple[int, str]]] = {part: [(0, "-"), (0, "-")] for part in PARTS}
    for path in product_files(root):
        part = part_of_path(root, path)
        for node in ast.walk(parsed(path)):
            slot = (0 if isinstance(node, ast.ClassDef)
                    else 1 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
            if slot is not None:
                size = node.end_lineno - node.lineno + 1
                best[part][slot] = max(best[part][slot], (size, f"{path.relative_to(root)}:{node.name}"))
    return {part: (rows[0], rows[1]) for part, rows in best.items()}


def long_files(root: Path) -> list[str]:
    rows = []
    for folder in (*SERVICES, "phaseserve", "stack"):
        for path in python_files(root, folder):
            lines = len(path.read_text().splitlines())
            if lines > LONG_FILE:
                rows.append(f"{path.relative_to(root)}: {lines}")
    return rows


def base_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):  # Generic[T], Protocol[T]
        return base_name(node.value)
    return None


def mixin_classes(root: Path) -> list[str]:
    files = product_files(root)
    classes = [(path, node) for path in files for node in ast.walk(parsed(path)) if isinstance(node, ast.ClassDef)]
    own = {node.name for _, node in classes}
    rows = []
    for path, node in classes:
        bases = [b for b in map(base_name, node.bases) if b in own]
        if node.name.endswith("Mixin") or len(bases) >= 2:
            rows.append(f"{path.relative_to(root)}:{node.name}({', '.join(bases)})")
    return rows


def imported_modules(tree: ast.Module, package: list[str]) -> set[str]:
    """Every module a file imports, anywhere in it (function-level imports too), with `from m import name`
    also as m.name where that is another layer's; relative imports resolved against `package`."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            # `from phaseserve import stack` names a module of another layer than its package's
            found.update(f"{module}.{a.name}" for a in node.names
                         if layer_of_module(f"{module}.{a.name}") != layer_of_module(module))
    return found


def upward_imports(root: Path) -> list[str]:
    rows = set()
    for path in product_files(root):
        own = layer_of_path(root, path)
        parts = list(path.relative_to(root).with_suffix("").parts)
        package = parts[:-1]
        for module in imported_modules(parsed(path), package):
            layer = layer_of_module(module)
            if layer is None or layer == own or (own == "workers" and layer == "kernels"):
                continue
            if RANK[layer] >= RANK[own]:
                rows.add(f"{path.relative_to(root)} ({own}) -> {module} ({layer})")
    return sorted(rows)


def docstring_lines(tree: ast.Module) -> list[tuple[int, str]]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                for offset, text in enumerate(first.value.value.splitlines()):
                    lines.append((first.lineno + offset, text))
    return lines


def figure_lines(path: Path) -> list[tuple[int, str]]:
    """The comment and docstring lines of a Python file (or the // and /* */ lines of a C++ one) with a
    machine figure."""
    text = path.read_text()
    candidates: list[tuple[int, str]] = []
    if path.suffix == ".py":
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                candidates.append((tok.start[0], tok.string))
        candidates += docstring_lines(parsed(path))
    else:
        in_block = False
        for number, line in enumerate(text.splitlines(), 1):
            comment = ""
            if in_block or "/*" in line:
                comment = line
                in_block = "*/" not in line.split("/*")[-1] if "/*" in line else "*/" not in line
            elif "//" in line:
                comment = line[line.index("//"):]
            if comment:
                candidates.append((number, comment))
    return [(n, c.strip()) for n, c in sorted(set(candidates)) if FIGURE.search(c)]


def comments_with_figures(root: Path) -> list[str]:
    files = product_files(root)
    native = root / "kernels" / "native"
    if native.is_dir():
        files += sorted(p for p in native.rglob("*") if p.suffix in (".cpp", ".h", ".hpp", ".cc"))
    return [f"{path.relative_to(root)}:{n}: {text}" for path in files for n, text in figure_lines(path)]


def doc_pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def dated_doc_headings(root: Path) -> list[str]:
    return [f"{path.relative_to(root)}:{number}" for path in doc_pages(root)
            for number, line in enumerate(path.read_text().splitlines(), 1)
            if line.startswith("#") and DATE.search(line)]


def dated_record_citations(root: Path) -> list[str]:
    """Lines citing dated records (bench/results/<date>-<topic>.md) in the docs pages, the two pages whose job
    it is to link them (docs/performance.md, docs/benchmarks.md) aside."""
    return [f"{path.relative_to(root)}:{number}: {', '.join(sorted(set(DATED_RECORD.findall(line))))}"
            for path in doc_pages(root)[1:] if path.name not in ("performance.md", "benchmarks.md")
            for number, line in enumerate(path.read_text().splitlines(), 1) if DATED_RECORD.search(line)]


def report(root: Path, verbose: bool = False) -> str:
    out = ["largest class and function per part (lines):"]
    for part, ((cls_n, cls), (fn_n, fn)) in largest_per_part(root).items():
        out.append(f"  {part:<11} class {cls_n:>4}  {cls}")
        out.append(f"  {'':<11} func  {fn_n:>4}  {fn}")
    for title, rows in ((f"files over {LONG_FILE} lines (gateway/, scheduler/, workers/, phaseserve/)",
                         long_files(root)),
                        ("mixin classes", mixin_classes(root)),
                        ("imports running back up the layers", upward_imports(root)),
                        ("comment and docstring lines with a machine figure", comments_with_figures(root)),
                        ("docs lines citing a dated record (the performance and benchmarks pages aside)", dated_record_citations(root)),
                        ("docs headings with a date", dated_doc_headings(root))):
        out.append(f"{title}: {len(rows)}")
        if verbose:
            out += [f"    {r}" for r in rows]
    readme = root / "README.md"
    out.append(f"README.md: {readme.stat().st_size / 1000:.1f} KB ({readme.stat().st_size} bytes)")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    verbose = "-v" in argv
    roots = [a for a in argv if a != "-v"]
    root = Path(roots[0]).resolve() if roots else Path(__file__).resolve().parent.parent
    print(report(root, verbose))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
