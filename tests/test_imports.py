"""The package's import graph has no cycles.

Every module under megakernel/ and reference/ (imported as megakernel.reference) is parsed with
`ast`; an edge A -> B is an `import`/`from` statement of A that names megakernel module B:

- module-level statements (class bodies and `try` blocks included) and function-level ones (the
  lazy imports inside functions and methods) both count. A module-level cycle breaks at import
  time; a lazy one only defers the break to the first call, and still ties the two modules into
  one, so neither can be read, tested or moved without the other;
- statements under `if TYPE_CHECKING:` do not count (they never run);
- `from P import n` is an edge to P.n when that is a module, else to P; importing a.b.c also
  imports the packages a.b and a, which count as edges too unless they contain the importer (a
  package is initialised before its own modules);
- imports by name at run time (`importlib.import_module`: the registries of layer kinds, model
  families and reference layers, the CLI's command table) are not edges. The one such cycle the
  static graph cannot see, the models finding the layer kinds through their registry while a
  layer kind imports the models, is checked by its own test.

A failure names each cycle as the chain of modules with the file and line of every edge.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ((REPO / "megakernel", "megakernel"), (REPO / "reference", "megakernel.reference"))

Edge = tuple[str, str, int]  # (target module, importing file, line)


def module_files(roots: tuple[tuple[Path, str], ...] = ROOTS) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file under each (directory, package)."""
    mods: dict[str, Path] = {}
    for root, package in roots:
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if root.name == "megakernel" and parts[0] == "reference":
                continue  # the link to reference/, walked as its own root
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join((package, *parts))] = path
    return mods


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: at module level and in functions, not under
    `if TYPE_CHECKING:` (its `else:` branch does run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                yield from _import_nodes(ast.Module(body=[child], type_ignores=[]))
        else:
            yield from _import_nodes(node)


def imported_names(module: str, path: Path, mods: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(megakernel module, line) of each module `module` imports, implicit packages included."""
    is_package = path.name == "__init__.py"
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: from the importer's package, one level up per extra dot
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                       for a in node.names]
        for target in targets:
            if target == "reference" or target.startswith("reference."):
                target = f"megakernel.{target}"
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                inside = module == name or module.startswith(name + ".")
                if name in mods and name != module and (i == len(parts) or not inside):
                    yield name, node.lineno


def import_graph(roots: tuple[tuple[Path, str], ...] = ROOTS) -> dict[str, dict[str, Edge]]:
    """module -> {imported module: (imported module, file, line of the first such import)}."""
    mods = module_files(roots)
    graph: dict[str, dict[str, Edge]] = {}
    for module, path in mods.items():
        edges: dict[str, Edge] = {}
        for target, line in imported_names(module, path, mods):
            edges.setdefault(target, (target, str(path.relative_to(REPO)
                                                  if path.is_relative_to(REPO) else path), line))
        graph[module] = edges
    return graph


def cycles(graph: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module, each as
    'a (file:line) -> b (file:line) -> ... -> a'."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan, iterative over each node's edges
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(graph, comp) for comp in components]


def _cycle_in(graph: dict[str, dict[str, Edge]], comp: list[str]) -> list[str]:
    """The shortest cycle through the component's first module (breadth-first), described."""
    members, start = set(comp), comp[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier and start not in prev:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w in members and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    path = [start]
    while True:
        path.append(prev[path[-1]])
        if path[-1] == start:
            break
    path.reverse()
    steps = zip(path[:-1], path[1:], strict=True)
    return [f"{a} ({graph[a][b][1]}:{graph[a][b][2]})" for a, b in steps] + [start]


def test_the_package_has_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in found)


def test_layer_kinds_import_nothing_of_the_models() -> None:
    """The models reach every layer kind through the layers' registry (`layers.kind(name)` imports
    megakernel.layers.<name> at run time), which the graph above cannot see: a layer kind that
    imports megakernel.models (ConfigError, RopeConfig, ...) closes a cycle. Their shared pieces
    live in megakernel.common.errors and megakernel.common.rope."""
    graph = import_graph()
    bad = [f"{m} -> {t} ({f}:{line})" for m, edges in graph.items()
           if m.startswith("megakernel.layers.")
           for t, (_, f, line) in edges.items()
           if t == "megakernel.models" or t.startswith("megakernel.models.")]
    assert not bad, "layer kinds importing the models:\n  " + "\n  ".join(bad)


def test_a_planted_cycle_is_found(tmp_path: Path) -> None:
    """The checker itself: a lazy import closing a cycle through a package is named with its
    lines; one under TYPE_CHECKING is not an edge."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.b import B\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n    return b\n")
    (pkg / "sub" / "b.py").write_text("import pkg.a\nB = 1\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                              "    import pkg.d\n")
    (pkg / "d.py").write_text("import pkg.c\n")
    found = cycles(import_graph(((pkg, "pkg"),)))
    assert len(found) == 1, found
    text = " -> ".join(found[0])
    assert text.startswith("pkg.a (") and "a.py:2" in text and "b.py:1" in text, text
    assert "pkg.c" not in text
