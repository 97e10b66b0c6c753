"""The package's imports point down only, against the layer order written below, and close no circle.

Every import statement counts, also one inside a function (a deferred import hides a circle from Python, not from
the design), and so does every package `__init__` an import runs: `from ringtrain.elastic.state import State` runs
ringtrain/elastic/__init__.py first, and whatever that imports. The only edges left out are the parent packages a
module's own import already runs (importing ringtrain.engine.engine runs ringtrain/__init__ and
ringtrain/engine/__init__ before it, whatever it imports itself).
"""
import ast
import re
from pathlib import Path

import ringtrain

PACKAGE = Path(ringtrain.__file__).resolve().parent
ROOT = PACKAGE.parent

# Bottom first. A module belongs to the layer of the longest prefix naming it ("ringtrain" itself, the face, names
# only itself). Layers on one level are beside each other: neither imports the other. Any other module directly in
# ringtrain/ is a bottom module.
LEVELS = [
    {"bottom": ()},                                     # config, errors, ops, topology, timeline, stats, csrc, ...
    {"kernels": ("ringtrain.kernels", "ringtrain.gpu")},           # gpu.py: detection, streams, DeviceOps
    {"transports": ("ringtrain.transports",)},
    {"engine": ("ringtrain.engine",)},
    {"world": ("ringtrain.world",)},
    {"core": ("ringtrain.core", "ringtrain")},
    {"elastic": ("ringtrain.elastic",),
     "launch": ("ringtrain.launch", "ringtrain.spark", "ringtrain.ray", "ringtrain.__main__")},
    {"reducer": ("ringtrain.reducer",)},
    {"torch": ("ringtrain.torch",), "tensorflow": ("ringtrain.tensorflow",), "jax": ("ringtrain.jax",)},
    {"keras": ("ringtrain.keras",)},
]


def module_name(path, root=ROOT):
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(package=PACKAGE):
    return {module_name(p, package.parent): p for p in package.rglob("*.py")}


def layer_of(name):
    """(level, layer name) of a module of the package."""
    best = None
    for level, layers in enumerate(LEVELS):
        for layer, prefixes in layers.items():
            for prefix in prefixes:
                if name == prefix or (prefix != "ringtrain" and name.startswith(prefix + ".")):
                    if best is None or len(prefix) > best[0]:
                        best = (len(prefix), level, layer)
    if best is None and name.count(".") == 1:
        return 0, "bottom"
    return None if best is None else best[1:]


def parents(name):
    """The packages Python imports before `name`: a.b.c -> [a, a.b]."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def imports_of(name, path, known):
    """The package modules importing `name` runs, anywhere in its text: each module an import statement names, and
    every package __init__ on the way to it that is not already a parent of `name`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    named = set()
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
            if target:
                named.add(target)
    found = set()
    own_parents = set(parents(name))
    for target in named:
        found.add(target)
        found.update(p for p in parents(target) if p not in own_parents)
    found.discard(name)
    return found


def import_graph(package=PACKAGE):
    known = modules(package)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def circles(graph):
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, result = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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


def upward_edges(graph):
    """(importer, its layer, imported, its layer) for every edge that points up or sideways."""
    bad = []
    for v, targets in sorted(graph.items()):
        (lv, nv) = layer_of(v)
        for w in sorted(targets):
            (lw, nw) = layer_of(w)
            if lw > lv or (lw == lv and nw != nv):
                bad.append((v, nv, w, nw))
    return bad


def test_the_checker_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_deferred_relative_and_package_imports(tmp_path):
    graph = import_graph()
    assert "ringtrain.errors" in graph["ringtrain.engine.engine"]
    assert "ringtrain.gpu" in graph["ringtrain.engine.fusion"]           # imported inside a function
    # a little package: importing p.b.m runs p/b/__init__, which imports p.c: the edge a -> p.b counts, and with it
    # the circle a -> p.b -> p.c -> a; p.b.m's import of p.b.n does not count p.b (its own parent)
    files = {"p/__init__.py": "", "p/a.py": "def f():\n    from p.b.m import g\n",
             "p/b/__init__.py": "from ..c import h\n", "p/b/m.py": "from . import n\n", "p/b/n.py": "",
             "p/c.py": "import p.a\n"}
    for relative, text in files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    small = import_graph(tmp_path / "p")
    assert small["p.a"] == {"p.b", "p.b.m"}
    assert small["p.b.m"] == {"p.b.n"}
    assert circles(small) == [["p.a", "p.b", "p.c"]]


def test_every_module_has_a_layer():
    assert [name for name in modules() if layer_of(name) is None] == []
    assert layer_of("ringtrain") == (5, "core") and layer_of("ringtrain.errors") == (0, "bottom")
    assert layer_of("ringtrain.spark") == layer_of("ringtrain.launch.run")
    assert layer_of("ringtrain.keras.optimizer")[0] > layer_of("ringtrain.tensorflow")[0]


def test_no_import_points_up():
    bad = upward_edges(import_graph())
    assert not bad, "imports that point up or sideways (deferred ones and the package __init__ they run count):\n" + \
        "\n".join(f"{v} ({nv}) -> {w} ({nw})" for v, nv, w, nw in bad)


def test_no_import_circle_in_the_package():
    found = circles(import_graph())
    assert not found, "import circles (every import statement counts, deferred ones and package __init__s too):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def design_diagram():
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    return text.split("## Layers", 1)[1].split("```")[1]


def test_the_design_diagram_names_the_folders_as_they_are():
    diagram = design_diagram()
    named = set(re.findall(r"ringtrain/([a-z_]+)/", diagram))
    # "ringtrain/torch/  tensorflow/  keras/  jax/": folders listed after a ringtrain/x/ on one line
    for line in diagram.splitlines():
        if "ringtrain/" in line:
            named.update(re.findall(r"(?<![\w/.])([a-z_]+)/(?=\s|$|,|:)", line))
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert named - folders == set(), f"the diagram names folders that do not exist: {sorted(named - folders)}"
    assert folders - named == set(), f"package folders missing from the diagram: {sorted(folders - named)}"
    modules_named = set(re.findall(r"ringtrain/([a-z_]+\.py)", diagram))
    assert {m for m in modules_named if not (PACKAGE / m).exists()} == set()


def test_library_modules_import_what_they_use_by_name():
    """`import ringtrain as _core` inside the package hides which layer a module really uses."""
    graph = import_graph()
    assert sorted(v for v, targets in graph.items() if "ringtrain" in targets) == []


def test_contributing_says_where_every_folder_lives():
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    table = text.split("## Where things live", 1)[1].split("\n## ", 1)[0]
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert folders - set(re.findall(r"`(?:ringtrain/)?([a-z_]+)/`", table)) == set()
    for path in re.findall(r"`(ringtrain/[\w/]+\.py)`", table):
        assert (ROOT / path).exists(), path
    for name in re.findall(r"`(\w+\.py)`", table):
        assert list(PACKAGE.rglob(name)), name
