"""Local walks and globs: each folder once, each file once, hidden names passed over and said.

One rule for every listing of local inputs (``sources.list_inputs``: ``prepare`` and
``Loader.from_text`` alike):

- A name starting with "." (``.git/``, ``.env``, ``.ipynb_checkpoints/``) is hidden: a folder walk
  and a glob's ``*`` / ``**`` pass it over, never entering a hidden folder, and the note counts it
  (``Ignored``). A hidden file or folder named explicitly, or by a glob that spells its dot
  (``d/.*``, ``d/**/.*.jsonl``), is read: the user named it. ``**`` never enters a hidden folder
  unless a part of the pattern spells its dot (``d/**/.cache/*.jsonl``, ``d/.cache/**``).
- A link to a folder is followed, and every folder is walked once, by its identity
  (st_dev, st_ino); the folders above the root count as walked, so a link loop (``d/loop -> ..``)
  never recurses. Among siblings, folders are walked before links to folders, so a
  ``latest -> v3`` link gives way to ``v3``.
- A link that leads to no file (a link loop, a link to nowhere) is said as what it is, by name,
  not counted as a file of some extension (``Ignored.broken``).
- A file reached twice (two links, two spellings, two arguments, a hard link) is read once: the
  first path in sorted order (``distinct``); the note counts the others with the path kept.
"""

from __future__ import annotations

import errno
import glob as globlib
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from tokenmill.base.io import is_url, special_kind
from tokenmill.inputs.records import format_or_none, local_path

__all__ = ["Ignored", "Passed", "distinct", "glob", "hidden_part", "outermost", "special", "walk"]


class Passed(list):
    """The files a listing passed over (a list of paths, counted by type; links that lead to no
    file named apart), with the hidden names it skipped (``hidden``; folders end in "/") and the
    repeats it dropped (``repeats``: (dropped, kept) pairs)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: list[str] = []
        self.repeats: list[tuple[str, str]] = []


@dataclass(frozen=True)
class Ignored:
    """What a directory walk or a glob passed over: files counted by extension (or kind), links
    that lead to no file (by name), hidden names and repeats, each with a few examples.

    str(Ignored.of(["d/a.md", "d/b.md", "d/c.csv"])) == "ignored 3 files: 2 .md, 1 .csv (e.g. d/a.md, d/b.md, d/c.csv)"
    """

    counts: tuple[tuple[str, int], ...] = ()  # (".md", 2), most common first
    examples: tuple[str, ...] = ()  # the first three paths, sorted
    hidden: tuple[str, ...] = ()  # hidden names passed over, sorted (folders end in "/")
    repeats: tuple[tuple[str, str], ...] = ()  # (dropped, kept), sorted
    broken: tuple[tuple[str, str], ...] = ()  # (link, what: "a link loop"), sorted

    @classmethod
    def of(cls, paths: Sequence[str], hidden: Iterable[str] = (),
           repeats: Iterable[tuple[str, str]] = ()) -> Ignored:
        """The record of these passed-over paths, hidden names and repeats."""
        broken = {p: what for p in paths if (what := broken_link(p))}
        paths = [p for p in paths if p not in broken]
        exts = Counter(_label(p) for p in paths)
        return cls(tuple(sorted(exts.items(), key=lambda kv: (-kv[1], kv[0]))),
                   tuple(sorted(paths)[:3]), tuple(sorted(set(hidden))),
                   tuple(sorted(dict(reversed(list(repeats))).items())),  # one per path dropped
                   tuple(sorted(broken.items())))

    @property
    def total(self) -> int:
        """How many files were passed over for their type."""
        return sum(n for _, n in self.counts)

    def __bool__(self) -> bool:
        return bool(self.counts or self.hidden or self.repeats or self.broken)

    def summary(self) -> str:
        """The counts alone: "2 .md, 1 .csv, 3 hidden, 2 link loops"."""
        kinds = Counter(what.removeprefix("a ") for _, what in self.broken)
        return ", ".join([f"{n} {ext}" for ext, n in self.counts]
                         + [f"{len(self.hidden)} hidden"] * bool(self.hidden)
                         + [f"{n} {what}{'s' * (n != 1)}" for what, n in sorted(kinds.items())])

    def __str__(self) -> str:
        if not self:
            return "ignored 0 files"
        parts = []
        if self.counts:
            n, kinds = self.total, ", ".join(f"{k} {ext}" for ext, k in self.counts)
            parts.append(f"ignored {n} file{'s' * (n != 1)}: {kinds} (e.g. {', '.join(self.examples)})")
        if self.hidden:
            parts.append(f"ignored {len(self.hidden)} hidden (names starting with '.', e.g. "
                         f"{', '.join(self.hidden[:3])}; name one to read it)")
        if self.broken:
            k, shown = len(self.broken), ", ".join(f"{p} ({what})" for p, what in self.broken[:3])
            more = f" and {k - 3} more" if k > 3 else ""
            parts.append(f"passed over {k} link{'s' * (k != 1)} that lead{'s' * (k == 1)} to no "
                         f"file: {shown}{more}")
        if self.repeats:
            k, shown = len(self.repeats), "; ".join(f"{a} = {b}" for a, b in self.repeats[:3])
            parts.append(f"dropped {k} repeat{'s' * (k != 1)} (a file or folder reached again by "
                         f"another path, read once: {shown})")
        return "; ".join(parts)


def _label(path: str) -> str:
    """How Ignored counts a path: what it is, if a walk passed it over for not being a regular
    file ("named pipe (FIFO)"), else its extension (".md", "(no extension)")."""
    kind = special(path) if format_or_none(path) else None  # others were passed for their name
    return kind.removeprefix("a ") if kind else (
        os.path.splitext(path.rstrip("/").rpartition("/")[2])[1].lower() or "(no extension)")


def broken_link(path: str) -> str | None:
    """What a local symbolic link that leads to no file is ("a link loop", "a dangling link");
    None for anything else (a file, a folder, a link that leads to one, a URL).

    broken_link("/") is None
    """
    if is_url(path) or not os.path.islink(path):
        return None
    try:
        os.stat(path)
    except OSError as e:
        return "a link loop" if e.errno == errno.ELOOP else \
            "a dangling link" if e.errno == errno.ENOENT else None
    return None


def special(path: str) -> str | None:
    """What a local path is if not a regular file, or a link to one (a FIFO, a socket, a device,
    a directory), in words; None for a regular file, a URL or a path that cannot be read."""
    try:
        return None if is_url(path) else special_kind(os.stat(path).st_mode)
    except OSError:
        return None


def _hidden(name: str) -> bool:
    return name.startswith(".")


def _identity(path: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of what ``path`` leads to; None if it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _above(root: str) -> dict[tuple[int, int], str]:
    """The folders holding ``root`` (its real path's parents), by identity: a link to one of
    them is a loop."""
    seen, here = {}, os.path.realpath(root)
    while (parent := os.path.dirname(here)) != here:
        here = parent
        if (key := _identity(here)) is not None:
            seen[key] = here.rstrip("/") + "/"
    return seen


def walk(root: str, passed: Passed,
         spelled: Sequence[str] = ()) -> Iterator[tuple[str, list[str], list[str]]]:
    """os.walk(root) following links to folders, each folder once (a loop never recurses), names
    sorted (folders before links to folders), hidden ones skipped and added to passed.hidden,
    but for those that a pattern of ``spelled`` (glob parts that spell a dot) matches.
    A caller may clear the folder list it is given, as with os.walk."""
    def unasked(name: str) -> bool:
        """Hidden, and not asked for by a part of the pattern that spells its dot."""
        return _hidden(name) and not any(fnmatchcase(name, p) for p in spelled)

    seen = _above(root)
    for d, dirs, names in os.walk(root, followlinks=True):
        d = os.path.normpath(d)  # root ".": "a/b.jsonl", as glob spells it
        here = "" if d == os.curdir else os.path.join(d, "")
        key = _identity(d)
        if key in seen:
            passed.repeats.append((here or os.curdir, seen[key]))
            dirs.clear()
            continue
        if key is not None:
            seen[key] = here or os.path.join(os.curdir, "")
        passed.hidden += [here + n + "/" for n in dirs if unasked(n)]
        passed.hidden += [here + n for n in names if unasked(n)]
        dirs[:] = sorted((n for n in dirs if not unasked(n)),
                         key=lambda n: (os.path.islink(here + n), n))
        yield d, dirs, sorted(n for n in names if not unasked(n))


def glob(pattern: str, passed: Passed) -> list[str]:
    """The local paths a glob matches, sorted; hidden names are skipped (added to passed.hidden)
    unless the pattern spells their dot (``d/**/.*.jsonl`` too); ``**`` goes through ``walk`` (a
    loop never recurses)."""
    if "**" not in pattern:
        shown = globlib.glob(pattern)
        hidden = set(globlib.glob(pattern, include_hidden=True)) - set(shown)
        passed.hidden += sorted(os.path.join(p, "") if os.path.isdir(p) else p for p in hidden)
        return sorted(shown)
    parts = pattern.split(os.sep)
    first = next(i for i, p in enumerate(parts) if globlib.has_magic(p))
    base = os.sep.join(parts[:first]) or (os.sep if pattern.startswith(os.sep) else "")
    rest, only_dirs = parts[first:], parts[-1] == ""
    rest = rest[:-1] if only_dirs else rest
    found, spelled = [], [p for p in rest if p.startswith(".") and p not in (".", "..")]
    # a folder matches once walk enters it
    for d, _, names in walk(base or os.curdir, passed, spelled):
        prefix = os.path.relpath(d, base or os.curdir).split(os.sep)
        prefix = [] if prefix == [os.curdir] else prefix
        if (base or prefix) and _matches(prefix, rest):
            found.append(os.path.join("" if d == os.curdir else d, ""))
        found += [os.path.join("" if d == os.curdir else d, n) for n in names
                  if not only_dirs and _matches(prefix + [n], rest)]
    return sorted(found)


def outermost(folders: Iterable[str]) -> list[str]:
    """The folders, sorted, without those inside another one of them (its walk covers them).

    outermost(["d/a/", "d", "d/b/c", "e"]) == ["d", "e"]
    """
    kept: list[str] = []
    for folder in sorted(folders, key=lambda f: os.path.join(f, "")):
        if not (kept and os.path.join(folder, "").startswith(os.path.join(kept[-1], ""))):
            kept.append(folder)
    return kept


def _matches(parts: list[str], pattern: list[str]) -> bool:
    """Whether path components match glob components; "**" matches any number of them."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_matches(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatchcase(parts[0], pattern[0]) and _matches(parts[1:], pattern[1:])


def distinct(paths: Iterable[str], passed: Passed) -> list[str]:
    """The paths, sorted, each file once by its identity (st_dev, st_ino): a later path to a file
    already listed is dropped and added to passed.repeats with the path kept (a ``file://`` URL is
    the local file it names). Other URLs stay as they are."""
    kept, seen = [], {}
    for path in sorted(paths):
        key = None if (local := local_path(path)) is None else _identity(local)
        if key is not None and key in seen:
            passed.repeats.append((path, seen[key]))
            continue
        if key is not None:
            seen[key] = path
        kept.append(path)
    return kept


def hidden_part(root: str, path: str) -> str | None:
    """The hidden part of ``path`` below ``root`` ("/"-separated, an fsspec listing): the path up to
    its first component starting with "." (a folder ends in "/"), or None.

    hidden_part("m/d", "m/d/.git/config") == "m/d/.git/"
    """
    parts = path[len(root.rstrip("/")) + 1:].split("/")
    k = next((i for i, p in enumerate(parts) if _hidden(p)), None)
    if k is None:
        return None
    return root.rstrip("/") + "/" + "/".join(parts[:k + 1]) + "/" * (k < len(parts) - 1)
