"""The package's modules import each other without a circle: layers point down only (bindings -> core API ->
engine -> transports -> kernels). Every import statement counts, also one inside a function: a deferred import
hides a circle from Python, not from the design."""
import ast
import os
from pathlib import Path

import ringtrain

PACKAGE = Path(ringtrain.__file__).resolve().parent


def module_name(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules():
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name, path, known):
    """The package modules `name` imports anywhere in its text."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # "from . import x" names a module x; "from .m import f" names m
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:     # "import ringtrain.torch.optimizer" -> that module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph():
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def circles(graph):
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, result = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return result


def package_circles():
    """Circles not involving a package's own __init__ (a package re-exporting its submodules is not a layer)."""
    graph = import_graph()
    packages = {name for name, path in modules().items() if path.name == "__init__.py"}
    # edges *into* a package __init__ from its own submodules are Python's parent-package import, not a design edge
    trimmed = {v: {w for w in ws if not (w in packages and v.startswith(w + "."))} for v, ws in graph.items()}
    return circles(trimmed)


def test_the_checker_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_deferred_and_relative_imports():
    graph = import_graph()
    assert "ringtrain.errors" in graph["ringtrain.engine.engine"]
    assert "ringtrain.gpu" in graph["ringtrain.engine.fusion"]           # imported inside a function


def test_no_import_circle_in_the_package():
    found = package_circles()
    assert not found, "import circles (every import statement counts, deferred ones too):\n" + "\n".join(
        " <-> ".join(c) for c in found)
