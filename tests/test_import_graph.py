"""The import graph of the project's packages: no module-level cycles, and the layering holds.

Parsed with ast, nothing imported: an edge is an `import`/`from ... import` statement naming a
module. Module level means the statement runs on import (top level, class bodies, if/try blocks,
`if TYPE_CHECKING:` too, since a cycle there is one in the design); imports inside a function run
only when it is called, so the cycle rule leaves them out while the layering rules count them.
`from pkg import name` is an edge to pkg.name when that is a module, else to pkg; importing a
submodule also runs its enclosing packages' __init__, so those are edges too, except the
importer's own enclosing packages (already being imported when it runs).
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("packformat", "packtools", "storaged", "inference", "servicekit", "bench")


@dataclasses.dataclass(frozen=True)
class Edge:
    importer: str
    target: str  # a project module, or the dotted name as written for anything else (grpc.aio)
    module_level: bool
    line: int


@dataclasses.dataclass(frozen=True)
class Rule:
    """Modules under `importer` (a dotted prefix) must not import anything under `forbidden`."""

    importer: str
    forbidden: tuple[str, ...]
    why: str


RULES = (
    Rule("storaged", ("packtools",), "storaged depends on the pack format (packformat), not on the converters"),
    Rule("storaged.server", ("storaged.client",), "a server never imports its client"),
    Rule("inference.experts", ("grpc",), "the storaged client's errors carry their own codes, not grpc's"),
    Rule("packformat", ("storaged", "inference", "packtools"), "the core imports none of its users"),
)


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def module_files(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    modules: dict[str, tuple[Path, bool]] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            modules[".".join(parts)] = (path, is_package)
    return modules


def _resolve(name: str, known: Iterable[str]) -> str:
    """The longest known module that `name` is or lies under; `name` itself if none (external)."""
    known = set(known)
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return name


def _module_level_nodes(tree: ast.Module) -> set[int]:
    """ids of the import statements that run when the module is imported."""
    found: set[int] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.add(id(child))
            visit(child)

    visit(tree)
    return found


def imports_of(module: str, source: str, is_package: bool, known: Iterable[str]) -> list[Edge]:
    """Every import in `source` (the text of `module`) as edges, module-level ones marked."""
    known = set(known)
    tree = ast.parse(source)
    module_level = _module_level_nodes(tree)
    package = module if is_package else module.rpartition(".")[0]
    edges: list[Edge] = []

    def add(target: str, node: ast.stmt) -> None:
        at_top = id(node) in module_level
        edges.append(Edge(module, target, at_top, node.lineno))
        if target not in known:
            return
        # the enclosing packages of the target run first, unless they enclose the importer too
        parts = target.split(".")
        for end in range(1, len(parts)):
            parent = ".".join(parts[:end])
            if parent in known and not under(module, parent):
                edges.append(Edge(module, parent, at_top, node.lineno))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_resolve(alias.name, known), node)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level > 1:
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                add(submodule if submodule in known else _resolve(base, known), node)
    return edges


def project_edges(root: Path = ROOT) -> list[Edge]:
    modules = module_files(root)
    edges: list[Edge] = []
    for name, (path, is_package) in modules.items():
        edges.extend(imports_of(name, path.read_text(encoding="utf-8"), is_package, modules))
    return edges


def module_cycles(edges: Iterable[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module among module-level edges."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        if edge.module_level and edge.target != edge.importer:
            graph.setdefault(edge.importer, set()).add(edge.target)
            graph.setdefault(edge.target, set())
    # Tarjan's algorithm, iterative so deep chains do not hit the recursion limit
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = counter
                    counter += 1
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    advanced = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def rule_violations(edges: Iterable[Edge], rule: Rule) -> list[Edge]:
    """Edges (module-level or in a function) that break `rule`."""
    return [
        edge for edge in edges
        if under(edge.importer, rule.importer) and any(under(edge.target, f) for f in rule.forbidden)
    ]


def _describe(edges: Iterable[Edge]) -> str:
    return "\n".join(f"{e.importer}:{e.line} imports {e.target}" for e in edges)


# ---- the project's graph ----

@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return project_edges()


def test_every_package_is_parsed(edges):
    importers = {edge.importer.split(".")[0] for edge in edges}
    assert importers == set(PACKAGES)


def test_no_module_level_import_cycles(edges):
    cycles = module_cycles(edges)
    assert not cycles, "module-level import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_import_cycles_even_through_imports_inside_functions(edges):
    """A deferred import hides a cycle from the interpreter, not from a reader: none either."""
    every = [dataclasses.replace(edge, module_level=True) for edge in edges]
    cycles = module_cycles(every)
    assert not cycles, "import cycles (counting imports inside functions):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: f"{rule.importer}-not-{'-'.join(rule.forbidden)}")
def test_layering(edges, rule):
    bad = rule_violations(edges, rule)
    assert not bad, f"{rule.why}:\n{_describe(bad)}"


# ---- the checks themselves can fail ----

def _graph(sources: Mapping[str, str]) -> list[Edge]:
    """Edges of a synthetic tree: dotted name -> source; a name with '/__init__' is a package."""
    modules = {name.removesuffix("/__init__"): name.endswith("/__init__") for name in sources}
    edges: list[Edge] = []
    for name, source in sources.items():
        module = name.removesuffix("/__init__")
        edges.extend(imports_of(module, source, modules[module], modules))
    return edges


def test_a_module_level_cycle_is_found_and_a_function_level_one_is_not():
    cyclic = _graph({"p/__init__": "", "p.a": "from p import b\n", "p.b": "import p.a\n"})
    assert module_cycles(cyclic) == [["p.a", "p.b"]]
    deferred = _graph({"p/__init__": "", "p.a": "from p import b\n", "p.b": "def f():\n    import p.a\n"})
    assert module_cycles(deferred) == []


@pytest.mark.parametrize("source", [
    "class C:\n    from p.a import x\n",
    "try:\n    from p.a import x\nexcept ImportError:\n    x = None\n",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.a import x\n",
    "from .a import x\n",
])
def test_imports_that_run_on_import_close_a_cycle(source):
    assert module_cycles(_graph({"p/__init__": "", "p.a": "import p.b\n", "p.b": source})) == [["p.a", "p.b"]]


def test_a_cycle_through_a_package_init_is_found():
    # q.a imports p.x, which first runs p/__init__, which imports q.a
    edges = _graph({"p/__init__": "import q.a\n", "p.x": "", "q/__init__": "", "q.a": "import p.x\n"})
    assert module_cycles(edges) == [["p", "q.a"]]


def test_a_package_init_importing_its_submodules_is_not_a_cycle():
    edges = _graph({"p/__init__": "from p.a import x\n", "p.a": "from p import b\nx = 1\n", "p.b": ""})
    assert module_cycles(edges) == []


@pytest.mark.parametrize("rule, sources", [
    (RULES[0], {"storaged/__init__": "", "storaged.io": "def f():\n    from packtools.build import x\n",
                "packtools/__init__": "", "packtools.build": ""}),
    (RULES[1], {"storaged/__init__": "", "storaged.server/__init__": "",
                "storaged.server.servicer": "from storaged.client.client import KEY\n",
                "storaged.client/__init__": "", "storaged.client.client": ""}),
    (RULES[2], {"inference/__init__": "", "inference.experts/__init__": "",
                "inference.experts.source": "import grpc.aio\n"}),
    (RULES[3], {"packformat/__init__": "", "packformat.reader": "from inference.models import m\n",
                "inference/__init__": "", "inference.models/__init__": ""}),
], ids=["storaged-packtools-in-a-function", "server-client", "experts-grpc", "packformat-inference"])
def test_each_layering_rule_finds_a_breach(rule, sources):
    assert rule_violations(_graph(sources), rule)


def test_a_layering_rule_ignores_modules_outside_it():
    edges = _graph({"storagedx/__init__": "import packtools\n", "packtools/__init__": "",
                    "inference/__init__": "import grpc\n"})
    assert [rule_violations(edges, rule) for rule in RULES] == [[], [], [], []]
