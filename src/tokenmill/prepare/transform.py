"""A transform between record and text: ``fn(record: dict) -> str | None``, named by a spec.

    spec = transform_spec(my_module.to_text)   # "my_module:to_text"
    fn = load_transform(spec)                  # the function, imported (once per process)
    samples = sample_records(files, source_config)  # the first records of the first files
    transform_identity(spec, samples)  # "my_module:to_text (source xxh3 3ec6…, 32 sample …)"

A transform runs in prepare's worker processes (``python -m tokenmill.base.child``, which never
re-runs the user's script), so it is named by ``"module:qualname"`` and imported there: a
function of the script that was run (``__main__``), a lambda or a nested function cannot be, and
is refused with a ConfigError that says to move it into a module.

A transform is known by what it does, not only by its name: its identity is its module and
qualified name, an xxh3 of the source of its module and of every module of the user's own code
that module imports, directly or through another (``own_modules``: not the standard library, not
site-packages, not tokenmill; a constant or a helper edited in ``helper.py`` changes it however
few records it touches; of its own code when no source is at hand), and an xxh3 of what it makes
of sample records — the first records of the first input files,
each given three times: a transform that returns two texts for one record (a random template) is
refused, as a resume, the validation split and the streaming cache need the same text for the
same record. The identity is part of the store's settings: a resume, or a streaming cache, made
with a transform that now reads or behaves otherwise (an edited helper in another module, a
changed constant) is refused, or not reused, and the message shows both identities.

The record: a JSONL line's object, a Parquet/Arrow row as a dict, ``{"text": …}`` for a .txt
document. The result: the document's text; None drops the record (a ``dropped_by_transform``
skip, counted); "" is an empty document (skipped, as everywhere). An exception, or a result that
is neither str nor None, is a ``transform_error``: an InputError naming the file, the line or
row and the transform, or under ``on_error="skip"`` a Skip. A transform that calls sys.exit()
is an InputError under either policy (it would end prepare, or one of its workers, silently).
"""

from __future__ import annotations

import ast
import copy
import functools
import importlib
import importlib.util
import inspect
import itertools
import json
import os
import site
import sys
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import xxhash

from tokenmill.inputs import sources
from tokenmill.base.errors import ConfigError, InputError
from tokenmill.inputs.records import Doc, Record, Skip, SourceConfig, describe

Transform = Callable[[dict], "str | None"]
# its behaviour: what it makes of the first 32 records of the first 4 files, each given 3 times
# (a template drawn at random from 2 agrees 3 times with odds 1/4 a record: 4^-32 for 32 records)
SAMPLE_FILES, SAMPLE_RECORDS, SAMPLE_CALLS = 4, 32, 3
MOVE_HINT = ("workers import the transform by name: move it into a module of its own (e.g. "
             "my_transforms.py beside your script, imported with 'from my_transforms import …') "
             "and pass that function, or pass 'module:function'")


def transform_spec(fn: Transform | str) -> str:
    """The ``"module:qualname"`` naming ``fn``, checked to import as that very function.

    transform_spec("json:dumps") == "json:dumps"
    """
    if isinstance(fn, str):
        load_transform(fn)  # refused here, in the parent, rather than in every worker
        return fn
    if not callable(fn):
        raise ConfigError(f"transform must be a function or a 'module:function' string "
                          f"(got transform={fn!r})")
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or "<lambda>" in qualname or "<locals>" in qualname:
        raise ConfigError(f"transform {qualname or fn!r} is a lambda, a nested function or has no "
                          f"importable name; {MOVE_HINT}")
    if module == "__main__":
        raise ConfigError(f"transform {qualname} is defined in the script that was run "
                          f"(__main__), which worker processes do not import; {MOVE_HINT}")
    spec = f"{module}:{qualname}"
    if load_transform(spec) is not fn:
        raise ConfigError(f"transform {spec} does not import as the function given (it was "
                          f"redefined or wrapped); {MOVE_HINT}")
    return spec


@functools.lru_cache(maxsize=8)
def load_transform(spec: str) -> Transform:
    """The function ``spec`` ("module:qualname") names, imported once per process."""
    module, sep, qualname = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not module or not qualname:
        raise ConfigError(f"transform must be 'module:function' (got {spec!r}); e.g. "
                          "--transform my_transforms:to_text")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"transform {spec}: cannot import module {module!r} ({e}); put its "
                          "folder on PYTHONPATH, or run from the folder that holds it (on a "
                          "running Ray cluster: make it importable on every node, e.g. with "
                          "runtime_env py_modules)") from None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"transform {spec}: module {module!r} has no {qualname!r}")
    if not callable(obj):
        raise ConfigError(f"transform {spec} is a {type(obj).__name__}, not a function")
    return obj


class Sample(NamedTuple):
    """A record a transform's behaviour is measured on, and where it is (for messages)."""

    path: str
    where: str
    record: dict


def transform_identity(spec: str, samples: Sequence[Sample] = ()) -> str:
    """What the store's settings record of a transform: its name, an xxh3 of its module's
    source and one of what it makes of ``samples`` (``sample_records``), as one string that a
    "settings differ" message shows as it is (the records' own xxh3 tells a changed input from a
    changed transform):
    ``"fmt:chat (source xxh3 3ec6…, 32 sample records xxh3 1a2b… → output xxh3 9f2c…)"``.
    A ConfigError if it is not deterministic (``behaviour``)."""
    output = behaviour(spec, samples)  # first: what it imports on its first call is loaded too
    fn, h = load_transform(spec), xxhash.xxh3_64()
    modules = own_modules(fn)
    for name, data in modules:
        h.update(f"{name}\0{len(data)}\0".encode() + data)
    if not modules:
        h.update(_code(fn))
    names = [name for name, _ in modules]
    listed = " + ".join(names[:4]) + (f" + {len(names) - 4} more" if len(names) > 4 else "")
    records = xxhash.xxh3_64_hexdigest("\n".join(
        json.dumps(s.record, ensure_ascii=False, default=repr) for s in samples
    ).encode("utf-8", "surrogatepass"))
    return (f"{spec} (source xxh3 {h.hexdigest()}{' of ' + listed if listed else ''}, "
            f"{len(samples)} sample records xxh3 {records} → output xxh3 {output})")


def own_modules(fn: Transform) -> list[tuple[str, bytes]]:
    """(name, file bytes) of ``fn``'s module and of every module of the user's own code it
    imports, directly or through another (its ``import`` statements, wherever they are, as far
    as they are loaded), sorted by name; the standard library, site-packages and tokenmill are
    not the user's. [] when ``fn``'s module has no file (its own code is then used)."""
    root = inspect.getmodule(fn)
    found: dict[str, bytes] = {}
    todo = [root] if root is not None else []
    while todo:
        module = todo.pop()
        name = getattr(module, "__name__", None)
        if name in found or (module is not root and not _is_own(module)):
            continue
        data = _file_bytes(module)
        if data is None:
            continue
        found[name] = data
        todo += [sys.modules[m] for m in _imports(data, module) if m in sys.modules]
    return sorted(found.items())


@functools.lru_cache(maxsize=1)
def _not_own_roots() -> tuple[str, ...]:
    """Folders whose modules are not the user's own: the standard library, every site-packages,
    tokenmill itself."""
    paths = sysconfig.get_paths()
    roots = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths]
    roots += site.getsitepackages() + [site.getusersitepackages()]
    roots.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tokenmill/
    return tuple(os.path.join(os.path.realpath(r), "") for r in roots)


def _is_own(module) -> bool:
    """Whether a loaded module is the user's own code (a file outside ``_not_own_roots``)."""
    path = getattr(module, "__file__", None)
    if not isinstance(path, str):
        return False  # built in, or a namespace package
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    return not path.startswith(_not_own_roots()) and \
        "site-packages" not in parts and "dist-packages" not in parts


def _file_bytes(module) -> bytes | None:
    """The bytes of a module's file (its source, or what was loaded), None if unreadable."""
    try:
        with open(module.__file__, "rb") as f:
            return f.read()
    except (OSError, TypeError, AttributeError):
        return None


def _imports(source: bytes, module) -> list[str]:
    """The modules a module's source imports (``import a.b``: a and a.b; ``from .c import d``:
    the package's c and c.d), resolved against its package; [] if it is not Python source."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            try:
                base = importlib.util.resolve_name("." * node.level + (node.module or ""),
                                                   getattr(module, "__package__", None) or "")
            except (ImportError, ValueError):
                continue
            names += [base] + [f"{base}.{a.name}" for a in node.names]
    return [".".join(n.split(".")[:k + 1]) for n in names for k in range(n.count(".") + 1)]


def _code(fn: Transform) -> bytes:
    """What a transform without a module file is known by: its own source, else its code
    object's bytes."""
    try:
        return inspect.getsource(fn).encode()
    except (OSError, TypeError):
        pass
    code = getattr(fn, "__code__", None)
    return code.co_code + repr(code.co_consts).encode() if code else repr(fn).encode()


def sample_records(files: Sequence[str], config: SourceConfig) -> list[Sample]:
    """The first SAMPLE_RECORDS records of each of the first SAMPLE_FILES files, in order, as
    the transform is given them (``config.records``; records passed over are not samples): a
    pure function of the inputs, so a rerun replays the transform on the same records."""
    samples: list[Sample] = []
    for path in files[:SAMPLE_FILES]:
        items = sources.read_unit(sources.Unit(path, 0, -1, fmt=sources.format_of(
            path, config.text_ext)), config)
        try:
            kept = [item for item in itertools.islice(items, 8 * SAMPLE_RECORDS)
                    if not isinstance(item, Skip)][:SAMPLE_RECORDS]
        finally:
            items.close()
        samples += [Sample(path, item.place(), item.fields) if isinstance(item, Record) else
                    Sample(path, "file" if config.txt_mode == "file" else f"line {item.line}",
                           {"text": item.text}) for item in kept]
    return samples


def behaviour(spec: str, samples: Sequence[Sample]) -> str:
    """An xxh3 of what the transform makes of each sample record (its text, None, or the type of
    what it raised), given a fresh copy SAMPLE_CALLS times; a ConfigError naming the record if
    they differ: a resume, the split and a streaming cache rely on the same text for a record."""
    fn, h = load_transform(spec), xxhash.xxh3_64()
    for sample in samples:
        first, *others = (_outcome(fn, spec, sample) for _ in range(SAMPLE_CALLS))
        if (second := next((o for o in others if o != first), first)) != first:
            raise ConfigError(
                f"transform {spec} is not deterministic: given the same record {SAMPLE_CALLS} "
                f"times ({_place(sample.path, sample.where)}) it returned {_short(first)}, then "
                f"{_short(second)}; a resume, the validation split and the streaming cache need "
                "the same text for the same record: draw any randomness from the record itself "
                "(e.g. random.Random(record['id']))")
        h.update(repr(first).encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()


def _outcome(fn: Transform, spec: str, sample: Sample) -> object:
    """What ``fn`` makes of a copy of the sample's record: a str or None, or what went wrong."""
    try:
        text = fn(copy.deepcopy(sample.record))
    except Exception as e:  # noqa: BLE001 - the user's code: its failures are part of it
        return f"<raised {type(e).__name__}>"
    except SystemExit as e:
        raise transform_exit(sample.path, sample.where, spec, e) from None
    return text if text is None or isinstance(text, str) else f"<returned {type(text).__name__}>"


def _short(value: object) -> str:
    """A value for a one-line message: its repr, cut at 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def transformed(items, spec: str, path: str, on_error: str,
                place: Callable[[Doc], str]) -> Iterator[Doc | Skip]:
    """``items`` (Records, .txt Docs, Skips) → Docs and Skips, through the transform ``spec``;
    a Doc keeps its record's line.

    ``place(doc)``: where a plain text (a .txt document, which carries no place) is, as a Skip
    names it ("line 12", "file"): of its file, never of its unit.
    """
    fn = load_transform(spec)
    for item in items:
        if isinstance(item, Skip):
            yield item
            continue
        record, where = (item.fields, item.place) if isinstance(item, Record) else \
            ({"text": item.text}, functools.partial(place, item))
        try:
            text = fn(record)
            if text is not None and not isinstance(text, str):
                raise TypeError(f"returned {type(text).__name__}, expected str or None")
        except Exception as e:  # noqa: BLE001 - the user's code: any failure is reported here
            yield transform_error(path, where(), spec, e, on_error)
            continue
        except SystemExit as e:  # would end a worker, or prepare itself, without a word
            raise transform_exit(path, where(), spec, e) from None
        if text is None:
            yield Skip(path, where(), "dropped_by_transform", f"{spec} returned None")
        elif text:
            yield Doc(text, item.line)
        else:
            yield Skip(path, where(), "empty_document", f"{spec} returned ''")


def transform_exit(path: str, where: str, spec: str, e: SystemExit) -> InputError:
    """The error for a transform that called sys.exit() (under either policy: it is no answer
    about one record)."""
    code = "" if e.code is None else repr(e.code)
    return InputError(f"{_place(path, where)}: transform {spec} called sys.exit({code}); a "
                      "transform returns the text, or None to drop the record, or raises an "
                      "exception: fix the transform", path=path, where=where,
                      reason="transform_error")


def _place(path: str, where: str) -> str:
    """A record's place in a message: "a.jsonl:12", or "a.csv, row 5 (line 7)"."""
    if where == "file":
        return path
    return f"{path}:{where[5:]}" if where.startswith("line ") else f"{path}, {where}"


def transform_error(path: str, where: str, spec: str, error: Exception, on_error: str) -> Skip:
    """A Skip for a record the transform failed on, or under on_error="raise" an InputError."""
    if on_error == "skip":
        return Skip(path, where, "transform_error", f"{spec}: {describe(error)}")
    raise InputError(f"{_place(path, where)}: transform {spec} raised {describe(error)}; fix "
                     "the transform or pass --on-error skip", path=path, where=where,
                     reason="transform_error") from error
