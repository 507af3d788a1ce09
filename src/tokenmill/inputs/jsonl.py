"""JSON Lines: the lines of a block of a unit → documents (``Doc``), whole records (``Record``,
for a transform) or what is wrong with a line (a ``Skip`` by ``report``).

    docs = jsonl_docs(blocks, "text", report, base, first=0)

A line is parsed from its bytes by orjson when installed (the `fast` extra), else by the
standard library; whatever orjson does not take as a non-empty string (malformed, invalid UTF-8,
lone surrogates, NaN, huge numbers, no text) goes the standard library's way, so skips and their
messages are the same either way. A key named twice in one object is malformed (parsers keep one
of the two silently): the text key(s) in a record, any key anywhere in a record a transform gets
whole. The fast path looks for it only where it can be: a line holding the key's quoted name twice
(one ``bytes.count``), or an escape that may spell it (``escape_spellings``: ``\\u0074ext`` is
``text``), is parsed again strictly (``decode_checked``). Lines are numbered from ``first`` (see
``records``: units past byte 0 count from their first record); ``base()`` gives the lines before
the unit, counted only when a message needs them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from functools import partial

from tokenmill.inputs.records import Doc, Record, Skip, SourceConfig
from tokenmill.inputs.textfields import joined, kind, missing_hint

__all__ = ["NOT_JSON_LINES", "decode_checked", "escape_spellings", "json_reader", "jsonl_docs",
           "jsonl_records", "kind", "named_twice", "one_value"]

_WS = " \t\r\f\v"  # what a blank line may hold
# what a file holding one JSON value (``one_value``) is told, by the value's kind
NOT_JSON_LINES = {
    "object": "one JSON object spread over several lines, not JSON Lines or an array of objects: "
              "a .json is read as one object per line or as one top-level array of objects; "
              "convert it to JSON Lines, e.g. jq -c '.KEY[]' for the records under KEY, or jq -c "
              ". for one record",
    "array": "a JSON array, not JSON Lines: a compressed .json is read as JSON Lines (one object "
             "per line), an array only from a plain .json; decompress it, or convert it with "
             "jq -c '.[]'"}


def one_value(head: bytes, whole: bool) -> str | None:
    """"array" or "object" when a file's first bytes show one JSON value rather than JSON Lines:
    one pretty-printed (its first line the bracket alone, as json.dump(indent=…) and jq write it,
    and its next line no whole object), or an array of objects on one line (the whole file, or a
    line longer than ``head``); None otherwise. ``whole``: ``head`` is the whole file.

    one_value(b'{\\n  "data": [\\n', whole=False) == "object"
    """
    head = head.removeprefix(b"\xef\xbb\xbf").lstrip(b" \t\r\n")
    kind = {b"[": "array", b"{": "object"}.get(head[:1])
    lines = [line for line in (raw.strip(b" \t\r") for raw in head.split(b"\n")) if line]
    if kind is None:
        return None
    if lines[0] in (b"[", b"{"):
        return kind if len(lines) < 2 or type(_value(lines[1])) is not dict else None
    if kind != "array" or not head.startswith(b"[{"):
        return None
    if b"\n" not in head and not whole:
        return "array"  # a first line longer than the head
    value = _value(lines[0])
    return "array" if whole and len(lines) == 1 and type(value) is list and value and \
        type(value[0]) is dict else None


def _value(line: bytes):
    """A line's JSON value; None if it is not one."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


def jsonl_docs(blocks, key: str, report, base, first: int) -> Iterator[Doc | Skip]:
    """``first``: lines before the unit's first record when known (else 0: unit-relative);
    ``key``: a field, or several joined (``textfields.joined``)."""
    if not isinstance(key, str):
        yield from _joined_docs(blocks, key, report, base, first)
        return
    new, done = tuple.__new__, first  # done: lines before the block
    quoted = json.dumps(key, ensure_ascii=False).encode()
    respelled = escape_spellings(key).search
    for data in blocks:
        raws = data.split(b"\n")
        if data.endswith(b"\n"):
            raws.pop()
        for n, raw in enumerate(raws, done + 1):  # n: the line's number (from first)
            try:  # fast path: a non-empty str straight from the line's bytes
                text = _loads_bytes(raw)[key]
                # the key twice? 20 MB of JSONL: 10 ms of count beside 26 ms of orjson
                # or spelled with escapes? 20 MB: ~10 ms of search (faster than b"\\u" in raw)
                if type(text) is str and text and raw.count(quoted) < 2 and not respelled(raw):
                    yield new(Doc, (text, n))  # Doc(text, n): 75 ns, not 130 (no argument parsing)
                    continue
            except (ValueError, TypeError, KeyError, RecursionError):
                pass
            # anything else (malformed, invalid UTF-8, no text...): the stdlib decides, as before
            line, utf8_error = _decoded(raw)
            try:
                value, _, found = decode_checked(line)
                text = value[key]
            except (ValueError, TypeError, KeyError, RecursionError):
                if problem := _json_problem(line, utf8_error, key):
                    yield report(f"line {base() + n - first}", *problem)
                continue
            if twice := named_twice(value, found, (key,)):
                yield report(f"line {base() + n - first}", "malformed_json", twice)
            elif type(text) is str and text:
                yield new(Doc, (text, n))
            else:
                yield report(f"line {base() + n - first}", *(
                    ("empty_document", f"{key!r} is empty") if text == "" else
                    ("non_string_field", f"{key!r} is {kind(text)}")))
        done += len(raws)


def escape_spellings(key: str) -> re.Pattern:
    """What finds a line that may spell ``key`` with escapes (``"\\u0074ext"`` is "text"): a
    ``\\u`` escape of one of its characters (ASCII ones, which no JSON writer escapes, or the
    first unit of a surrogate pair), and ``\\/`` when it holds a "/". Such a line is parsed
    strictly; any other holds ``key`` only as its quoted name.

    escape_spellings("text").search(rb'{"te\\u0078t": 1}') is not None
    """
    units = {f"{u:04x}" for c in key
             for u in ([ord(c)] if ord(c) < 0x10000 else [0xD800 + ((ord(c) - 0x10000) >> 10)])}
    slash = "/|" if "/" in key else ""
    return re.compile(rf"\\(?:{slash}u(?:{'|'.join(sorted(units))}))".encode(), re.IGNORECASE)


def _joined_docs(blocks, keys: tuple[str, ...], report, base, first: int) -> Iterator[Doc | Skip]:
    """jsonl_docs for several keys: each record's fields joined; records without, reported."""
    for item in _records(blocks, keys[0], report, base, first, keys):
        if isinstance(item, Skip):
            yield item
        elif isinstance(text := joined(item.fields, keys), str):
            yield Doc(text, item.line)
        else:
            yield report(item.place(), *text)


def _stdlib_loads_bytes(raw: bytes):
    return json.loads(raw.decode())


try:  # orjson parses the UTF-8 bytes directly: no str of the line first (97 MB of JSONL: 0.16
    # CPU-s instead of 0.27 for decode + json.loads). Where it accepts a line, json.loads gives
    # the same value (it refuses lone surrogates, NaN, huge numbers: those go the stdlib way).
    from orjson import loads as _loads_bytes
except ImportError:  # pragma: no cover - depends on what is installed
    _loads_bytes = _stdlib_loads_bytes


def _decoded(raw: bytes) -> tuple[str | None, str | None]:
    """A line as str, or None and why it is not UTF-8."""
    try:
        return raw.decode(), None
    except UnicodeDecodeError as e:
        return None, f"{e.reason} at column {e.start + 1}"


def json_reader(config: SourceConfig):
    """What reads a JSONL unit's lines: their text_key (the fast path), or whole records."""
    return jsonl_records if config.records else jsonl_docs


def jsonl_records(blocks, key: str, report, base, first: int) -> Iterator[Record | Skip]:
    """Each line's whole JSON object (for a transform), numbered as jsonl_docs numbers its
    documents; what is not an object, or names a key twice anywhere, is reported."""
    return _records(blocks, key, report, base, first, None)


def _records(blocks, key: str, report, base, first: int, keys) -> Iterator[Record | Skip]:
    """jsonl_records; ``keys``: the keys that may not be named twice (None: any, anywhere)."""
    done = first
    for data in blocks:
        raws = data.split(b"\n")
        if data.endswith(b"\n"):
            raws.pop()
        for n, raw in enumerate(raws, done + 1):
            line, utf8_error = _decoded(raw)
            try:
                obj, _, found = decode_checked(line)
            except (ValueError, TypeError, RecursionError):
                obj = None
            if type(obj) is dict and (twice := named_twice(obj, found, keys)):
                yield report(f"line {base() + n - first}", "malformed_json", twice)
            elif type(obj) is dict:
                yield Record(obj, n, partial(_line_place, base, n - first))
            elif problem := _json_problem(line, utf8_error, key):
                yield report(f"line {base() + n - first}", *problem)
        done += len(raws)


def decode_checked(text: str, pos: int = 0) -> tuple[object, int, list[tuple[dict, list[str]]]]:
    """``json.JSONDecoder.raw_decode`` of ``text`` at ``pos``, and each object that names a key
    twice, with those keys (its dict holds one of the two values).

    decode_checked('{"a": 1, "a": 2}')[2] == [({"a": 2}, ["a"])]
    """
    found: list[tuple[dict, list[str]]] = []
    value, stop = json.JSONDecoder(object_pairs_hook=partial(_pairs, found)).raw_decode(text, pos)
    return value, stop, found


def _pairs(found: list, pairs: list[tuple[str, object]]) -> dict:
    """An object's dict; noted in ``found`` when a key is named twice."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        names = [name for name, _ in pairs]
        found.append((obj, [name for name in obj if names.count(name) > 1]))
    return obj


def named_twice(value, found: list[tuple[dict, list[str]]], keys) -> str | None:
    """What is wrong when a key is named twice (``decode_checked``'s ``found``): one of ``keys``
    in the object ``value``, or (keys None: a transform gets the record whole) any key in any
    object; None when none is.

    named_twice({"a": 2}, [], ("a",)) is None
    """
    for obj, names in found:
        twice = names if keys is None else [n for n in names if obj is value and n in keys]
        if twice:
            where = "" if obj is value else " of an object inside the record"
            return (f"key {twice[0]!r}{where} is named twice, and a JSON reader keeps one of the "
                    "two values silently: remove or rename one")
    return None


def _line_place(base, n: int) -> str:
    return f"line {base() + n}"


def _json_problem(line: str | None, utf8_error: str | None, key: str) -> tuple[str, str] | None:
    """(reason, detail) for a JSONL line that gave no text; None for a blank line."""
    if line is None:
        return "invalid_utf8", utf8_error
    if not line.strip(_WS):
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return "malformed_json", f"{e.msg}: column {e.colno}"
    except RecursionError:
        return "malformed_json", "nested too deeply"
    except ValueError as e:  # not a JSONDecodeError: an integer of more than 4,300 digits
        return "malformed_json", str(e)
    if not isinstance(obj, dict):
        return "malformed_json", f"expected a JSON object, got {kind(obj)}"
    return "missing_field", f"no {key!r} key; {missing_hint(obj)}"

