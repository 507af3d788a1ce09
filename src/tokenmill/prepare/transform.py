"""A transform between record and text: ``fn(record: dict) -> str | None``, named by a spec.

    spec = transform_spec(my_module.to_text)   # "my_module:to_text"
    fn = load_transform(spec)                  # the function, imported (once per process)
    transform_identity(spec)                   # "my_module:to_text (source xxh3 3ec6…)"

A transform runs in prepare's worker processes (``python -m tokenmill.child``, which never
re-runs the user's script), so it is named by ``"module:qualname"`` and imported there: a
function of the script that was run (``__main__``), a lambda or a nested function cannot be, and
is refused with a ConfigError that says to move it into a module. Its identity (module,
qualified name, xxh3 of its source — of its code object's bytes when the source is not at hand)
is part of the store's settings, so a resume with a changed transform is refused.

The record: a JSONL line's object, a Parquet/Arrow row as a dict, ``{"text": …}`` for a .txt
document. The result: the document's text; None drops the record (a ``dropped_by_transform``
skip, counted); "" is an empty document (skipped, as everywhere). An exception, or a result that
is neither str nor None, is a ``transform_error``: an InputError naming the file, the line or
row and the transform, or under ``on_error="skip"`` a Skip.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterator

import xxhash

from tokenmill.errors import ConfigError, InputError
from tokenmill.records import Doc, Record, Skip, describe

Transform = Callable[[dict], "str | None"]
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


def transform_identity(spec: str) -> str:
    """What the store's settings record of a transform: its module, qualified name and an xxh3
    of its source, as one string that a "settings differ" message shows as it is:
    ``"fmt:chat (source xxh3 3ec60a6bc51e590b)"``."""
    fn = load_transform(spec)
    try:
        source = inspect.getsource(fn).encode()
    except (OSError, TypeError):
        code = getattr(fn, "__code__", None)
        source = code.co_code + repr(code.co_consts).encode() if code else repr(fn).encode()
    return f"{spec} (source xxh3 {xxhash.xxh3_64_hexdigest(source)})"


def transformed(items, spec: str, path: str, on_error: str,
                place: Callable[[int], str]) -> Iterator[Doc | Skip]:
    """``items`` (Records, .txt Docs, Skips) → Docs and Skips, through the transform ``spec``;
    a Doc keeps its record's line.

    ``place(k)``: where the k-th item is, for a plain text (a .txt document) that carries none.
    """
    fn = load_transform(spec)
    for k, item in enumerate(items):
        if isinstance(item, Skip):
            yield item
            continue
        record, where = (item.fields, item.place) if isinstance(item, Record) else \
            ({"text": item.text}, functools.partial(place, k))
        try:
            text = fn(record)
            if text is not None and not isinstance(text, str):
                raise TypeError(f"returned {type(text).__name__}, expected str or None")
        except Exception as e:  # noqa: BLE001 - the user's code: any failure is reported here
            yield transform_error(path, where(), spec, e, on_error)
            continue
        if text is None:
            yield Skip(path, where(), "dropped_by_transform", f"{spec} returned None")
        elif text:
            yield Doc(text, item.line)
        else:
            yield Skip(path, where(), "empty_document", f"{spec} returned ''")


def transform_error(path: str, where: str, spec: str, error: Exception, on_error: str) -> Skip:
    """A Skip for a record the transform failed on, or under on_error="raise" an InputError."""
    if on_error == "skip":
        return Skip(path, where, "transform_error", f"{spec}: {describe(error)}")
    place = f"{path}:{where[5:]}" if where.startswith("line ") else f"{path}, {where}"
    raise InputError(f"{place}: transform {spec} raised {describe(error)}; fix the transform or "
                     "pass --on-error skip", path=path, where=where, reason="transform_error"
                     ) from error
