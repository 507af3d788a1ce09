"""The shape of the code: every import points down, no private name crosses modules, nothing grows
past the sizes in docs/architecture.md. Read from the source's syntax trees, so it needs no import.

LAYERS is the same list as the picture in docs/architecture.md ("Layers"): change both together.
A module may import a module of its own layer or of a lower one, never a higher one, and the
import graph has no cycle (imports inside functions count too: hiding an import in a function
does not remove the dependency).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "tokenmill"

# bottom → top; one entry per layer
LAYERS: list[tuple[str, ...]] = [
    ("tokenmill.errors",),
    ("tokenmill.io", "tokenmill.procs", "tokenmill.child", "tokenmill.metrics", "tokenmill.sampler",
     "tokenmill.textfields",
     "tokenmill.arrays",
     "tokenmill.pacing", "tokenmill.ring", "tokenmill.watch", "tokenmill.options",
     "tokenmill.segments", "tokenmill.lifetime", "tokenmill.ranks"),
    ("tokenmill.records", "tokenmill.jsonl", "tokenmill.readers", "tokenmill.columnar", "tokenmill.tabular",
     "tokenmill.splits", "tokenmill.decompress", "tokenmill.walk", "tokenmill.sources", "tokenmill.fastbpe",
     "tokenmill.tokenizer_files", "tokenmill.tokenizer", "tokenmill.pack", "tokenmill.rows",
     "tokenmill.attention", "tokenmill.balance", "tokenmill.cpsplit", "tokenmill.seqlens",
     "tokenmill.mixture"),
    ("tokenmill.packfit",),
    ("tokenmill.packplan",),
    ("tokenmill.store.format",),
    ("tokenmill.store.cache", "tokenmill.store.upload", "tokenmill.store.shards"),
    ("tokenmill.store.writer", "tokenmill.store.reader"),
    ("tokenmill.store.verify",),
    ("tokenmill.store",),
    ("tokenmill.prepare.split", "tokenmill.prepare.transform"),
    ("tokenmill.prepare.tokenize",),
    ("tokenmill.prepare.pool", "tokenmill.prepare.identity"),
    ("tokenmill.prepare.run",),
    ("tokenmill.integrations.ray",),
    ("tokenmill.prepare",),
    ("tokenmill.plan",),
    ("tokenmill.resume", "tokenmill.provenance", "tokenmill.balanced"),
    ("tokenmill.streaming.*",),
    ("tokenmill.streaming",),
    ("tokenmill.workers",),
    ("tokenmill.loader",),
    ("tokenmill.device", "tokenmill.inspection", "tokenmill.shardexport", "tokenmill.interchange",
     "tokenmill.bench*", "tokenmill.demo"),
    ("tokenmill.cli", "tokenmill.integrations", "tokenmill.integrations.torch",
     "tokenmill.integrations.jax", "tokenmill.integrations.grain", "tokenmill.integrations.hf",
     "tokenmill.integrations.torchtitan"),
    ("tokenmill.torch", "tokenmill.jax", "tokenmill.grain", "tokenmill.hf", "tokenmill.__main__"),
    ("tokenmill",),
]
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
MAX_INIT_PARAMS = 8


def module_name(path: Path) -> str:
    """Dotted name of a source file: src/tokenmill/store/__init__.py → tokenmill.store."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(name: str) -> int | None:
    """Index of the layer a module belongs to (patterns ending in * match a prefix)."""
    for i, layer in enumerate(LAYERS):
        for pattern in layer:
            if pattern.endswith("*") and name.startswith(pattern[:-1]) and name != pattern[:-2]:
                return i
            if name == pattern:
                return i
    return None


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


def test_every_module_has_a_layer():
    missing = [m for m in modules() if layer_of(m) is None]
    assert not missing, f"place these modules in LAYERS (and docs/architecture.md): {missing}"


def test_no_import_cycles():
    found = cycles(imports(modules()))
    assert not found, "import cycles:\n" + "\n".join(" → ".join(c) for c in found)


def test_every_import_points_down():
    known = modules()
    bad = []
    for src, targets in imports(known).items():
        for dst, line in sorted(targets):
            a, b = layer_of(src), layer_of(dst)
            if a is not None and b is not None and b > a:
                bad.append(f"{src}:{line} imports {dst} (layer {b} above {a})")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_private_name_crosses_modules():
    found = private_imports(modules())
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_sizes_stay_small():
    too_big = []
    for name, path in modules().items():
        text = path.read_text()
        n = len(text.splitlines())
        if n > MAX_MODULE_LINES:
            too_big.append(f"{name}: {n} lines (> {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_big.append(f"{name}.{node.name}: {length} lines (> {MAX_FUNCTION_LINES})")
                if node.name == "__init__":
                    params = [a.arg for a in node.args.args + node.args.kwonlyargs][1:]
                    if len(params) > MAX_INIT_PARAMS:
                        too_big.append(f"{name}.__init__ at line {node.lineno}: {len(params)} "
                                       f"parameters (> {MAX_INIT_PARAMS}; group them in a config)")
    assert not too_big, "\n".join(too_big)


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
