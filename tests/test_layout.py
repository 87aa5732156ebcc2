"""The package layout stays free of import loops, type-only and function-level ones included.

Issue 13 found two (cli → simulate → children → cli through a function-level import;
host ↔ nat ↔ dialback through type-only ones). A loop hides which module depends on
which; this walks every import statement of our four packages, wherever it sits.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("node", "protocol", "training", "kernels")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module → the modules of ours it imports (importing ``a.b.c`` also runs ``a.b``)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    targets.add(submodule if submodule in modules else node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        for target in targets & modules.keys():
            parts = target.split(".")
            for k in range(1, len(parts) + 1):
                parent = ".".join(parts[:k])
                # A module never "imports" its own package: Python ran that first.
                if parent in modules and parent != name and not name.startswith(parent + "."):
                    graph[name].add(parent)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_loop() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_our_packages_have_no_import_loops() -> None:
    graph = import_graph()
    assert "node.simulate" in graph["node.cli"] and "protocol.net.nat" in graph["protocol.net.host"]
    assert cycles(graph) == []


def test_every_path_the_readme_and_docs_name_exists() -> None:
    """Paths in backquotes that start at the repository root (a top-level folder of ours),
    in the README and docs/: a renamed file must not leave a reader at a dead end."""
    import re

    tops = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}
    missing = []
    for doc in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for path in re.findall(r"`([a-zA-Z_][\w.-]*/[\w./-]*)`", doc.read_text()):
            if path.split("/")[0] in tops and not (ROOT / path.rstrip("/")).exists():
                missing.append(f"{doc.name}: {path}")
    assert not missing, missing
