"""A transform between record and text: ``fn(record: dict) -> str | None``, named by a spec.

    spec = transform_spec(my_module.to_text)   # "my_module:to_text"
    fn = load_transform(spec)                  # the function, imported (once per process)
    samples = sample_records(files, source_config)  # the first records of the first files
    transform_identity(spec, samples)  # "my_module:to_text (source xxh3 3ec6…, 32 sample …)"

A transform runs in prepare's worker processes (``python -m tokenmill.child``, which never
re-runs the user's script), so it is named by ``"module:qualname"`` and imported there: a
function of the script that was run (``__main__``), a lambda or a nested function cannot be, and
is refused with a ConfigError that says to move it into a module.

A transform is known by what it does, not only by its name: its identity is its module and
qualified name, an xxh3 of its module's source (of its own code when the source is not at hand)
and an xxh3 of what it makes of sample records — the first records of the first input files,
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

import copy
import functools
import importlib
import inspect
import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import xxhash

from tokenmill import sources
from tokenmill.errors import ConfigError, InputError
from tokenmill.records import Doc, Record, Skip, SourceConfig, describe

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
    source = xxhash.xxh3_64_hexdigest(_source(load_transform(spec)))
    records = xxhash.xxh3_64_hexdigest("\n".join(
        json.dumps(s.record, ensure_ascii=False, default=repr) for s in samples
    ).encode("utf-8", "surrogatepass"))
    return (f"{spec} (source xxh3 {source}, {len(samples)} sample records xxh3 {records} → "
            f"output xxh3 {behaviour(spec, samples)})")


def _source(fn: Transform) -> bytes:
    """The source a transform is known by: its whole module's (a helper or a constant beside it
    changes what it does), else its own, else its code object's bytes."""
    for obj in (inspect.getmodule(fn), fn):
        try:
            return inspect.getsource(obj).encode()
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
