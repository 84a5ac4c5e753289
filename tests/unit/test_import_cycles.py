"""Import cycles between the project's modules, read from the source with `ast` (every import counts: at module
level, inside a function, or under TYPE_CHECKING, since each is a dependency a reader must hold in mind). The
test finds none, so that a new cycle fails here, naming its modules."""

from __future__ import annotations

import ast

from tests.unit.test_import_rules import ROOT, module_name

PACKAGES = ("mbd", "actors", "serve_app", "pipelines")


def graph() -> dict[str, set[str]]:
    """Each project module and the project modules it imports (`from pkg import mod` counts as pkg.mod)."""
    paths = {module_name(p).removesuffix(".__init__"): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in paths}
    for mod, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            edges[mod] |= {t for t in targets if t in paths and t != mod}
    return edges


def cycles(edges: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted tuple."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[tuple[str, ...]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            comp.append(v)
            if len(comp) > 1:
                found.add(tuple(sorted(comp)))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_through_others():
    assert cycles(graph()) == set()


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {("a", "b", "c")}
