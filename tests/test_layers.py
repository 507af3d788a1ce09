"""The shape of the code: the folders keep their order, every import points down, no private name
crosses modules, nothing grows past the sizes in docs/architecture.md. Read from the source's
syntax trees, so it needs no import.

ORDER is the same list as the picture in docs/architecture.md ("Folders"): change both together.
A module may import a module of its own place or of a lower one, never a higher one, and the
import graph has no cycle (imports inside functions count too: hiding an import in a function
does not remove the dependency). Inside a folder only the cycle check orders the modules.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "tokenmill"

# bottom → top: folders of src/tokenmill (a dotted entry is one module, placed apart from its
# folder); TOP is the package itself and the modules beside its folders
TOP = "(top level)"
ORDER: list[tuple[str, ...]] = [
    ("base",),
    ("inputs", "tokenizer"),
    ("store",),
    ("prepare",),
    ("load",),
    ("streaming",),
    ("observe",),
    ("integrations",),
    (TOP,),
]
MAX_TOP_LEVEL_MODULES = 12
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
MAX_INIT_PARAMS = 8
# over MAX_INIT_PARAMS today, pinned at their count: neither may grow, and one that shrinks to the
# limit must leave this list (the Loader's ninth is **options, checked into LoaderOptions)
INIT_PARAMS_PINNED = {"tokenmill.load.loader.Loader": 9}


def module_name(path: Path) -> str:
    """Dotted name of a source file: src/tokenmill/store/__init__.py → tokenmill.store."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def place_of(name: str) -> int | None:
    """Index in ORDER of a module's place: the longest entry it falls under, TOP for the package
    and its top-level modules, None for a module of a folder ORDER does not name."""
    rest = name.removeprefix("tokenmill").removeprefix(".")
    best: tuple[int, int] | None = None
    for i, entries in enumerate(ORDER):
        for entry in entries:
            if (rest == entry or rest.startswith(entry + ".")) and (best is None or len(entry) > best[1]):
                best = (i, len(entry))
    if best is not None:
        return best[0]
    if not rest or ("." not in rest and not (PACKAGE / rest).is_dir()):
        return len(ORDER) - 1
    return None


def climbs(graph: dict[str, set[tuple[str, int]]]) -> list[str]:
    """Every import of a module placed above the importer's place, as "src:line imports dst"."""
    bad = []
    for src, targets in sorted(graph.items()):
        for dst, line in sorted(targets):
            a, b = place_of(src), place_of(dst)
            if a is not None and b is not None and b > a:
                bad.append(f"{src}:{line} imports {dst} ({'/'.join(ORDER[b])} above {'/'.join(ORDER[a])})")
    return bad


def resolve(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports(known: dict[str, Path]) -> dict[str, set[tuple[str, int]]]:
    """module → {(imported tokenmill module, line)}; `from pkg import mod` counts as pkg.mod."""
    graph: dict[str, set[tuple[str, int]]] = defaultdict(set)
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = resolve(name, path, node)
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod
                           for a in node.names]
            else:
                continue
            for t in targets:
                if t.split(".")[0] == "tokenmill" and t != name:
                    graph[name].add((t, node.lineno))
    return graph


def private_imports(known: dict[str, Path]) -> list[str]:
    """`from tokenmill.x import _name` and `x._name` on an imported tokenmill module."""
    found = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                mod = resolve(name, path, node)
                if mod.split(".")[0] != "tokenmill" or mod == name:
                    continue
                for a in node.names:
                    if f"{mod}.{a.name}" in known:
                        aliases[a.asname or a.name] = f"{mod}.{a.name}"
                    elif a.name.startswith("_") and not a.name.startswith("__"):
                        found.append(f"{name}:{node.lineno} imports {a.name} from {mod}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("tokenmill") and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                found.append(f"{name}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return found


def cycles(graph: dict[str, set[tuple[str, int]]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w, _ in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_place():
    missing = [m for m in modules() if place_of(m) is None]
    assert not missing, f"place these modules' folders in ORDER (and docs/architecture.md): {missing}"


def test_few_modules_sit_at_the_top_level():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} top-level modules (> {MAX_TOP_LEVEL_MODULES}): {top}"


def test_no_import_cycles():
    found = cycles(imports(modules()))
    assert not found, "import cycles:\n" + "\n".join(" → ".join(c) for c in found)


def test_every_import_points_down():
    bad = climbs(imports(modules()))
    assert not bad, "upward imports:\n" + "\n".join(bad)


@pytest.mark.parametrize("graph, want", [
    ({"tokenmill.base.io": {("tokenmill.load.plan", 3)}},
     ["tokenmill.base.io:3 imports tokenmill.load.plan (load above base)"]),
    ({"tokenmill.load.loader": {("tokenmill.streaming", 7)}},  # Loader.from_text climbed so
     ["tokenmill.load.loader:7 imports tokenmill.streaming (streaming above load)"]),
    ({"tokenmill.load.plan": {("tokenmill.streaming", 9)}},
     ["tokenmill.load.plan:9 imports tokenmill.streaming (streaming above load)"]),
    ({"tokenmill.store.writer": {("tokenmill.cli", 2)}},
     [f"tokenmill.store.writer:2 imports tokenmill.cli ({TOP} above store)"]),
    ({"tokenmill.streaming.loader": {("tokenmill.load.loader", 1), ("tokenmill.load.plan", 2)},
      "tokenmill.cli": {("tokenmill.observe.bench", 3)}, "tokenmill.inputs.sources": {("tokenmill.tokenizer", 4)},
      "tokenmill.prepare": {("tokenmill.prepare.ray", 5)}},
     []),
])
def test_the_order_check_finds_a_climbing_import(graph, want):
    assert climbs(graph) == want


def test_no_private_name_crosses_modules():
    found = private_imports(modules())
    assert not found, "private names used across modules:\n" + "\n".join(found)


def init_params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """The parameters of an ``__init__`` but self, ``*args`` and ``**kwargs`` included (a
    ``**kwargs`` is one parameter: it hides knobs, it does not remove them)."""
    a = node.args
    rest = [x for x in (a.vararg, a.kwarg) if x is not None]
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + rest][1:]


def inits(tree: ast.Module, module: str) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """Every class's ``__init__`` by the class's dotted name (module.Class)."""
    return {f"{module}.{cls.name}": f for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
            for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            and f.name == "__init__"}


def too_big(name: str, text: str) -> list[str]:
    """What in a module's source passes the sizes in docs/architecture.md, one line each."""
    found = []
    n = len(text.splitlines())
    if n > MAX_MODULE_LINES:
        found.append(f"{name}: {n} lines (> {MAX_MODULE_LINES})")
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{name}.{node.name}: {length} lines (> {MAX_FUNCTION_LINES})")
    for cls, init in inits(tree, name).items():
        limit = INIT_PARAMS_PINNED.get(cls, MAX_INIT_PARAMS)
        if len(params := init_params(init)) > limit:
            found.append(f"{cls}.__init__ at line {init.lineno}: {len(params)} parameters "
                         f"(> {limit}; group them in a config)")
    return found


def test_sizes_stay_small():
    found = [line for name, path in modules().items() for line in too_big(name, path.read_text())]
    assert not found, "\n".join(found)


def test_the_pinned_inits_have_exactly_their_pinned_count():
    """A pin is where an __init__ stands, not an allowance: one that shrank lowers its pin (and
    leaves the list once it is within MAX_INIT_PARAMS)."""
    counts = {cls: len(init_params(init)) for name, path in modules().items()
              for cls, init in inits(ast.parse(path.read_text()), name).items()}
    assert {k: counts.get(k) for k in INIT_PARAMS_PINNED} == INIT_PARAMS_PINNED
    assert all(n > MAX_INIT_PARAMS for n in INIT_PARAMS_PINNED.values())


@pytest.mark.parametrize("signature, count", [
    ("self, a, b, c, d, e, f, g, h", 8),
    ("self, a, b, c, d, e, f, g, h, **options", 9),
    ("self, a, b, c, d, e, f, g, *rest, h", 9),
    ("self, a, /, b, c, *, d, e, f, g, h, i", 9),
])
def test_the_size_check_counts_every_parameter_of_an_init(signature, count):
    text = f"class C:\n    def __init__({signature}):\n        pass\n"
    want = [f"m.C.__init__ at line 2: {count} parameters (> {MAX_INIT_PARAMS}; group them in a "
            "config)"] if count > MAX_INIT_PARAMS else []
    assert too_big("m", text) == want


@pytest.mark.parametrize("bad, want", [
    ({"a": {("b", 1)}, "b": {("a", 2)}}, [["a", "b"]]),
    ({"a": {("b", 1)}, "b": {("c", 1)}}, []),
])
def test_cycle_finder_finds_cycles(bad, want):
    assert cycles(bad) == want


def test_the_core_imports_no_optional_dependency_at_module_level():
    """`pip install tokenmill` is the core (pyproject's dependencies): every other third-party
    module is imported inside the function that needs it, so `import tokenmill` and the CLI
    work without the extras (issue 26: a slim install)."""
    import tomllib
    core = {"numpy", "xxhash", "tokenizers", "tiktoken", "fsspec", "tqdm"}
    deps = tomllib.loads((SRC.parent / "pyproject.toml").read_text())["project"]["dependencies"]
    assert {d.split(">")[0].split("=")[0].split("[")[0] for d in deps} == core
    import sys as _sys
    stdlib = set(_sys.stdlib_module_names)
    top = []
    for path in PACKAGE.rglob("*.py"):
        if "integrations" in path.parts or path.name in ("torch.py", "jax.py", "grain.py"):
            continue  # frameworks: imported only when their module is
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            top += [(path.name, n.split(".")[0]) for n in names]
    extra = {(f, n) for f, n in top if n not in stdlib and n not in core | {"tokenmill"}}
    assert not extra, extra
