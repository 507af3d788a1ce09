"""Which files are text, and which fields of a record make its text.

``text_ext``: extensions read as plain text (``.txt``'s reader and ``txt_mode``) besides the
formats tokenmill knows by name — a folder of documentation (``.md``, ``.rst``, ``.html``, files
without an extension) becomes one document per file. ``""`` means "no extension". A name the
known formats take (``.jsonl``, ``.csv`` …) keeps its format.

    text_extensions("md,.RST,") == (".md", ".rst", "")
    text_format("docs/README", ("",)) == "txt" and text_format("a.md", (".rst",)) is None

``text_key`` with several fields (``("title", "body")``, ``--text-key title,body`` on the command
line): each JSON record's fields, in that order, joined by ``JOIN`` (a blank line, "\\n\\n");
an empty field is left out of the join, a missing or non-string one skips the record (counted,
naming the field). JSON Lines and ``.json`` only; a column of CSV/TSV/Parquet/Arrow is one key.

    joined({"title": "Hi", "body": "there"}, ("title", "body")) == "Hi\\n\\nthere"
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from tokenmill.base.errors import ConfigError

__all__ = ["JOIN", "add_arguments", "check_joinable", "ignored_note", "joined", "kind", "missing_hint", "text_extensions", "text_format", "text_keys"]

JOIN = "\n\n"


def text_extensions(value: str | Sequence[str]) -> tuple[str, ...]:
    """Extensions as given (``"md,rst,"`` or a list), lower-case with their dot; "" for none."""
    items = value.split(",") if isinstance(value, str) else list(value)
    out = []
    for item in items:
        if not isinstance(item, str) or "/" in item or os.sep in item:
            raise ConfigError(f"text_ext takes file extensions such as 'md' or '.rst', and '' "
                              f"for files without one (got {item!r})")
        ext = item.strip().strip("'\"").lower()
        out.append(ext if not ext or ext.startswith(".") else f".{ext}")
    return tuple(dict.fromkeys(out))


def text_format(path: str, text_ext: Sequence[str]) -> str | None:
    """"txt" when ``path``'s extension (lower-case; "" for none) is one of ``text_ext``."""
    if not text_ext:
        return None
    name = path.rstrip("/").rpartition("/")[2].rpartition(os.sep)[2]
    return "txt" if os.path.splitext(name)[1].lower() in text_ext else None


def text_keys(value: str | Sequence[str]) -> str | tuple[str, ...]:
    """One key as a str; several (``"a,b"`` or a list) as a tuple, in order."""
    keys = value.split(",") if isinstance(value, str) else list(value)
    if not keys or not all(isinstance(k, str) and k for k in keys):
        raise ConfigError(f"text_key must be a field name or several, e.g. 'text' or "
                          f"'title,body' (got text_key={value!r})")
    return keys[0] if len(keys) == 1 else tuple(dict.fromkeys(keys))


def joined(obj: dict, keys: Sequence[str]) -> str | tuple[str, str]:
    """The record's text: its ``keys``' values joined by JOIN (empty ones left out), or
    (reason, detail) for a record that has none."""
    parts = []
    for key in keys:
        if key not in obj:
            return "missing_field", f"no {key!r} key; {missing_hint(obj)}"
        if type(obj[key]) is not str:
            return "non_string_field", f"{key!r} is {kind(obj[key])}"
        if obj[key]:
            parts.append(obj[key])
    if parts:
        return JOIN.join(parts)
    return "empty_document", f"{', '.join(map(repr, keys))} {'is' if len(keys) == 1 else 'are'} empty"


def check_joinable(text_key: str | tuple[str, ...], formats: dict[str, str]) -> None:
    """Several keys join JSON fields only: a ConfigError naming a CSV/TSV/Parquet/Arrow input."""
    rows = [path for path, fmt in formats.items() if fmt in ("csv", "tsv", "parquet", "arrow")]
    if not isinstance(text_key, str) and rows:
        raise ConfigError(f"{rows[0]}: text_key={','.join(text_key)} joins the fields of JSON "
                          "records; a CSV, TSV, Parquet or Arrow input takes one column — "
                          "use --transform to build its text from several")


def missing_hint(obj: dict) -> str:
    """What a record without the key holds, and the flag to use when one field holds text.

    missing_hint({"id": 1, "content": "x"}) == "keys are 'id', 'content'; its text may be under --text-key content"
    """
    keys = ", ".join(map(repr, list(obj)[:5])) or "none"
    text = [k for k, v in obj.items() if type(v) is str and v]
    hint = f"; its text may be under --text-key {text[0]}" if len(text) == 1 else (
        f"; several fields hold text: --text-key {','.join(text[:3])} joins them" if text else "")
    return f"keys are {keys}{hint}"


_KINDS = {type(None): "null", bool: "a boolean", int: "a number", float: "a number",
          str: "a string", list: "an array", dict: "an object"}


def kind(value) -> str:
    """What a decoded JSON value is, for messages: kind(None) == "null", kind([]) == "an array"."""
    return _KINDS.get(type(value), type(value).__name__)


def ignored_note(ignored) -> str:
    """The note on what a walk passed over (a ``sources.Ignored``: files by type, hidden names,
    repeats), with the flag that reads their extensions as text."""
    exts = sorted((e for e, _ in ignored.counts if e.startswith(".") or e == "(no extension)"),
                  key=lambda e: e == "(no extension)")[:6]  # '' last: --text-ext md,''
    flag = ",".join("''" if e == "(no extension)" else e[1:] for e in exts)
    return (f"note: {ignored}" + ("; prepare reads regular files of .txt, .jsonl[.gz|.zst], "
                                 ".json[.gz|.zst], .csv, .tsv, .parquet, .arrow" if ignored.counts else "")
            + (f"; --text-ext {flag} reads them as plain text (text_ext= in Python)" if exts else ""))


def add_arguments(parser) -> None:
    """``prepare``'s --text-key and --text-ext."""
    parser.add_argument("--text-key", default="text", help="JSON field (a,b: the fields joined "
                        "by a blank line) / CSV, TSV or parquet column (default text)")
    parser.add_argument("--text-ext", default=(), metavar="EXT,...", help="extensions read as "
                        "plain text, one document per file (--txt-mode): e.g. md,rst,html,'' "
                        "('': files without an extension)")
