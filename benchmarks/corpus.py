"""Build a large, real, varied natural-language JSONL corpus for benchmarks, offline.

Sources: Debian documentation packages (fetched with ``apt-get download`` and
unpacked with ``dpkg-deb -x``, never installed) plus the Python standard
library.  Documents from all packages are merged least-bytes-first (so small
packages are used whole and big ones are capped at a common level) and stdlib
source code is mixed in at a bounded byte share, so every prefix of the file is
a mix of sources and languages.  Exact duplicates are dropped; no text is ever
repeated or synthesised.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import heapq
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path
from typing import Iterable, Iterator

FORMAT_VERSION = 1
MIN_CHARS = 200
CODE_SHARE = 0.20  # byte share of stdlib code in build_corpus (spec: must stay <= 0.30)
REPO_ROOT = Path(__file__).resolve().parent.parent

# Prose-heavy Debian documentation in several languages (order only breaks ties when merging).
DEFAULT_PACKAGES: tuple[str, ...] = (
    "linux-doc-6.1",
    "python3.11-doc",
    "postgresql-doc-15",
    "debian-handbook",
    "debian-reference-en",
    "debian-reference-de",
    "debian-reference-fr",
    "debian-reference-es",
    "debian-reference-it",
    "debian-reference-ja",
    "perl-doc",
    "git-doc",
    "glibc-doc",
    "bash-doc",
    "gnu-standards",
    "debian-faq",
    "debian-policy",
    "developers-reference",
    "maint-guide",
    "harden-doc",
    "apache2-doc",
    "python-django-doc",
    "gnucash-docs",
    "gimp-help-en",
    "gimp-help-de",
    "gimp-help-fr",
    "gimp-help-es",
    "gimp-help-it",
    "gimp-help-ja",
    "gimp-help-ru",
    "libreoffice-help-en-us",
    "libreoffice-help-de",
    "libreoffice-help-fr",
    "manpages",
    "manpages-dev",
    "manpages-de",
    "manpages-fr",
    "manpages-es",
    "manpages-it",
    "manpages-ja",
    "manpages-nl",
    "manpages-pl",
    "manpages-pt-br",
    "manpages-ru",
    "manpages-zh",
    "fortunes",
    "fortunes-de",
    "fortunes-es",
    "fortunes-it",
    "fortunes-ru",
)

# Paths never used: build artefacts, duplicated renderings, boilerplate, non-prose.
SKIP_RE = re.compile(
    r"/_sources/|/_static/|/_images/|/_modules/|/usr/share/doc-base/|/usr/share/lintian/"
    r"|/linux-doc-[\d.]+/html/|/perl-doc/usr/share/man/man1/"
    r"|/copyright$|/changelog[^/]*$|/(MAINTAINERS|CREDITS)(\.gz)?$"
    r"|/(genindex|search|py-modindex|modindex|ix\d+)[^/]*\.html?$"
)
HTML_RE = re.compile(r"\.x?html?(\.|$)")
MAN_RE = re.compile(r"/man/(?:[^/]+/)?man\w+/[^/]+\.\w+$")
TEXT_EXT = {".txt", ".rst", ".md", ".text", ".pod", ".info"}
UPPER_NAME_RE = re.compile(r"^[A-Z][A-Z0-9_-]{2,}$")

_apt_updated = False


# --------------------------------------------------------------------------- HTML


class _HTMLText(HTMLParser):
    """Collect visible text of an HTML page, skipping scripts, styles and navigation."""

    BLOCK = {
        "p", "div", "br", "li", "ul", "ol", "dl", "dt", "dd", "tr", "table", "pre",
        "h1", "h2", "h3", "h4", "h5", "h6", "section", "article", "blockquote",
        "hr", "title", "caption", "figure", "figcaption", "td", "th",
    }
    DROP_TAGS = {"script", "style", "noscript", "template", "nav", "svg", "button", "form"}
    DROP_CLASS = re.compile(
        r"\b(navheader|navfooter|docnav|nav|sphinxsidebar|related|footer|headerlink|breadcrumbs?"
        r"|toc-backref|sidebar|menu|navigation|skip-link|searchbox|debug|toplang|bottomlang"
        r"|leftside|rightside|permalink)\b"
    )
    DROP_ID = {"title", "path", "banner", "sidebar", "page-header", "footer", "hd", "ft", "SearchFrame",
               "DonationFrame", "TopLeftHeader", "modules-nav", "Bookmarks", "Contents", "DEBUG"}

    def __init__(self) -> None:
        """Initialise parser state."""
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.title = ""
        self._skip_tag: str | None = None
        self._skip_depth = 0
        self._pre = 0
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        """Track skipped regions, <pre> and block boundaries."""
        if self._skip_tag:
            self._skip_depth += tag == self._skip_tag
            return
        if tag == "title":
            self._in_title = True
        attr = dict(attrs)
        klass = f"{attr.get('class') or ''} {attr.get('role') or ''}"
        if (
            tag in self.DROP_TAGS or "hidden" in attr
            or self.DROP_CLASS.search(klass) or attr.get("id") in self.DROP_ID
        ):
            self._skip_tag, self._skip_depth = tag, 1
            return
        if tag == "pre":
            self._pre += 1
        if tag in self.BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        """Close skipped regions, <pre> and blocks."""
        if self._skip_tag:
            if tag == self._skip_tag:
                self._skip_depth -= 1
                if self._skip_depth == 0:
                    self._skip_tag = None
            return
        if tag == "title":
            self._in_title = False
        if tag == "pre" and self._pre:
            self._pre -= 1
        if tag in self.BLOCK:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        """Keep visible text (whitespace collapsed outside <pre>)."""
        if self._skip_tag:
            return
        if self._in_title:
            self.title += data
            return
        self.parts.append(data if self._pre else re.sub(r"\s+", " ", data))


def _tidy(text: str) -> str:
    """Strip trailing spaces per line and collapse runs of blank lines."""
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n[ \t]+\n", "\n\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def html_to_text(html: str) -> str:
    """Extract readable plain text from an HTML document."""
    parser = _HTMLText()
    try:
        parser.feed(html)
        parser.close()
    except Exception:  # html.parser is lenient, but be safe on pathological input
        return ""
    body = "".join(parser.parts)
    body = "\n".join(ln.strip() if not ln.startswith("  ") else ln for ln in body.split("\n"))
    title = re.sub(r"\s+", " ", parser.title).strip()
    body = _tidy(body)
    if title and not body.startswith(title):
        body = f"{title}\n\n{body}"
    return body


# --------------------------------------------------------------------------- roff / pod / info

_ROFF_NAMED = {
    "em": "—", "en": "–", "hy": "-", "aq": "'", "dq": '"', "lq": "“", "rq": "”",
    "oq": "‘", "cq": "’", "co": "©", "rg": "®", "tm": "™", "bu": "•", "de": "°",
    "mu": "×", "di": "÷", "+-": "±", "<=": "≤", ">=": "≥", "!=": "≠", "->": "→",
    "<-": "←", "ga": "`", "ti": "~", "ha": "^", "rs": "\\", "sl": "/", "Fo": "«",
    "Fc": "»", "fo": "‹", "fc": "›", "lh": "☜", "rh": "☞", "sc": "§", "ps": "¶",
}
_FONT_MACROS = {"B", "I", "SM", "SB", "BR", "IR", "BI", "IB", "RB", "RI", "CW"}
_HEADINGS = {"SH", "SS", "Sh", "Ss"}
_BREAKS = {"PP", "LP", "P", "sp", "Pp", "Lp", "TS", "TE", "br", "RS", "RE", "Bl", "El", "Bd", "Ed", "in"}
_MDOC_SILENT = {"Dd", "Dt", "Os", "Ns", "Oo", "Oc", "Bk", "Ek", "No", "Pf"}
_CJK = re.compile(r"[\u2e80-\u9fff\uac00-\ud7af\uff00-\uffef\u3000-\u303f]")


def _roff_inline(s: str) -> str:
    """Replace roff escapes in one line of text."""
    s = re.sub(r"\\\*?\[([^\]]*)\]", lambda m: _ROFF_NAMED.get(m.group(1), ""), s)
    s = re.sub(r"\\\*?\((..)", lambda m: _ROFF_NAMED.get(m.group(1), ""), s)
    s = re.sub(r"\\\*.", "", s)
    s = re.sub(r"\\f(\(..|\[[^\]]*\]|.)", "", s)
    s = re.sub(r"\\s[+-]?\d", "", s)
    s = re.sub(r"\\[hvwlLoDxXHSbkz]'[^']*'", "", s)
    s = re.sub(r"\\n(\(..|\[[^\]]*\]|.)", "", s)
    s = s.replace("\\\\", "\0").replace("\\e", "\0").replace("\\-", "-")
    s = s.replace("\\ ", " ").replace("\\~", " ")
    s = re.sub(r"\\[&|^c%:!/,)dutpa0]", "", s)
    return s.replace("\\", "").replace("\0", "\\")


def _roff_args(rest: str) -> list[str]:
    """Split macro arguments honouring double quotes."""
    return [a[1:-1] if a.startswith('"') and a.endswith('"') and len(a) > 1 else a
            for a in re.findall(r'"[^"]*"?|\S+', rest)]


def _mdoc_words(args: list[str]) -> str:
    """Render mdoc macro arguments: drop callable macro names, turn 'Fl x' into '-x'."""
    words, flag = [], False
    for a in args:
        if re.fullmatch(r"[A-Z][a-z][a-z]?", a):
            flag = a == "Fl"
            continue
        words.append(f"-{a}" if flag else a)
        flag = False
    return " ".join(words)


def _fill(chunks: list[str]) -> str:
    """Join filled roff text lines, without spaces between CJK characters."""
    text = ""
    for c in chunks:
        if text and not (_CJK.match(text[-1]) and _CJK.match(c[:1] or " ")):
            text += " "
        text += c
    return text


class _Roff:
    """Minimal roff renderer: filled paragraphs, headings, tagged lists, no-fill blocks."""

    def __init__(self) -> None:
        """Start with empty output."""
        self.out: list[str] = []
        self.para: list[str] = []
        self.nofill = False
        self.tag_next = False

    def flush(self) -> None:
        """End the current paragraph."""
        if self.para:
            self.out.append(_fill(self.para))
            self.para = []

    def text(self, line: str) -> None:
        """Add one line of running text."""
        line = _roff_inline(line)
        if self.nofill:
            self.out.append(line)
        elif not line.strip():
            self.flush()
            self.out.append("")
        else:
            self.para.append(line.strip())
            if self.tag_next:
                self.tag_next = False
                self.flush()

    def macro(self, name: str, args: list[str]) -> None:
        """Handle one request/macro line."""
        if name in _HEADINGS:
            self.flush()
            self.out.extend(["", _roff_inline(" ".join(args))])
        elif name in _BREAKS:
            self.flush()
            if name in ("PP", "LP", "P", "sp", "Pp", "Lp"):
                self.out.append("")
        elif name in ("TP", "TQ"):
            self.flush()
            self.tag_next = True
        elif name in ("IP", "It", "Dl"):
            self.flush()
            tag = args[0] if name == "IP" and args else _mdoc_words(args)
            if tag:
                self.out.append(_roff_inline(tag))
        elif name in ("nf", "EX", "Vb"):
            self.flush()
            self.nofill = True
        elif name in ("fi", "EE", "Ve"):
            self.flush()
            self.nofill = False
        elif name in _FONT_MACROS:
            self.text(("" if len(name) == 2 else " ").join(args))
        elif re.fullmatch(r"[A-Z][a-z][a-z]?", name) and name not in _MDOC_SILENT:
            self.text(_mdoc_words([name, *args]))
        elif name in ("UR", "MT", "UE", "ME"):
            self.text(" ".join(args))


def man_to_text(src: str) -> str:
    """Lightly render roff/man/mdoc markup to plain text."""
    r = _Roff()
    in_def = False
    for line in src.splitlines():
        if in_def:
            in_def = not line.startswith("..")
            continue
        if re.match(r"[.']\s*\\\"|\\\"", line):
            continue
        m = re.match(r"[.']\s*(\S+)\s*(.*)", line)
        if not m:
            r.text(line)
        elif m.group(1) in ("de", "de1", "am", "ig"):
            in_def = True
        else:
            r.macro(m.group(1), _roff_args(m.group(2)))
    r.flush()
    return _tidy("\n".join(r.out))


def pod_to_text(src: str) -> str:
    """Lightly strip POD markup: keep headings and paragraphs, unwrap formatting codes."""
    out: list[str] = []
    in_pod = True
    for line in src.splitlines():
        if line.startswith("="):
            cmd, _, rest = line[1:].partition(" ")
            in_pod = cmd != "cut"
            if cmd.startswith(("head", "item")) and rest.strip():
                out.extend(["", rest.strip()])
            continue
        if in_pod:
            out.append(line)
    text = "\n".join(out)
    entities = {"lt": "<", "gt": ">", "sol": "/", "verbar": "|"}
    text = re.sub(r"E<(lt|gt|sol|verbar)>", lambda m: entities[m.group(1)], text)
    for _ in range(3):
        text = re.sub(r"[BCIFLSXZE]<<+\s(.*?)\s>>+", r"\1", text, flags=re.S)
        text = re.sub(r"[BCIFLSXZE]<([^<>]*)>", r"\1", text)
    return _tidy(text)


def info_to_text(src: str) -> str:
    """Drop GNU info node separators and headers."""
    src = re.sub(r"\x1f\n?File: [^\n]*\n", "\n", src)
    src = src.replace("\x1f", "").replace("\x7f", "")
    src = re.sub(r"^Tag Table:\n.*?End Tag Table\n?", "", src, flags=re.S | re.M)
    return _tidy(src)


# --------------------------------------------------------------------------- decoding / classify


def _is_binary(raw: bytes) -> bool:
    """Heuristic binary detector: NUL bytes or many control characters."""
    head = raw[:8192]
    if b"\x00" in head:
        return True
    ctrl = sum(1 for b in head if b < 32 and b not in (9, 10, 12, 13, 27, 31))
    return ctrl > max(8, len(head) // 100)


def _decode(raw: bytes, kind: str) -> str | None:
    """Decode bytes as UTF-8, or an HTML page's declared charset; None if undecodable."""
    if _is_binary(raw):
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        pass
    if kind == "html":
        m = re.search(rb"charset=[\"']?([A-Za-z0-9_.:-]+)", raw[:4096])
        if m:
            try:
                return raw.decode(m.group(1).decode("ascii"))
            except (LookupError, UnicodeDecodeError):
                return None
    return None


def _read(path: Path) -> bytes:
    """Read a file, transparently gunzipping *.gz."""
    data = path.read_bytes()
    if path.suffix == ".gz":
        try:
            return gzip.decompress(data)
        except (OSError, EOFError):
            return b""
    return data


def classify(path: Path) -> str | None:
    """Return the extractor kind for a documentation file, or None to ignore it."""
    posix = path.as_posix()
    if SKIP_RE.search(posix) or not path.is_file():
        return None
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    if MAN_RE.search(posix[:-3] if posix.endswith(".gz") else posix):
        return "man"
    if HTML_RE.search(name):
        return "html"
    if "/games/fortunes/" in posix and not name.endswith(".dat"):
        return "fortune"
    ext = os.path.splitext(name)[1].lower()
    if re.fullmatch(r".*\.info(-\d+)?", name):
        return "info"
    if ext in TEXT_EXT:
        return "pod" if ext == ".pod" else "text"
    if UPPER_NAME_RE.match(name.split(".")[0]) and ext in ("", ".txt", ".md"):
        return "text"
    return None


EXTRACT = {
    "html": html_to_text,
    "man": man_to_text,
    "pod": pod_to_text,
    "info": info_to_text,
    "text": _tidy,
    "fortune": _tidy,
}
CATEGORY = {
    "html": "html-manuals",
    "man": "man-pages",
    "pod": "text-docs",
    "info": "text-docs",
    "text": "text-docs",
    "fortune": "fortunes",
}


def extract(path: Path, kind: str) -> str | None:
    """Read and extract plain text of one file; None if unusable."""
    try:
        text = _decode(_read(path), kind)
    except OSError:
        return None
    if text is None:
        return None
    text = EXTRACT[kind](text)
    return text if len(text) >= MIN_CHARS else None


# --------------------------------------------------------------------------- Debian packages


def _run(cmd: list[str], cwd: Path) -> bool:
    """Run a command quietly; True on success."""
    res = subprocess.run(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if res.returncode != 0:
        print(f"warning: {' '.join(cmd)} failed: {res.stderr.strip()[-300:]}", file=sys.stderr)
    return res.returncode == 0


def _local_deb(debs: Path, pkg: str) -> Path | None:
    """Return the already downloaded .deb for a package (highest file name), if any."""
    found = sorted(debs.glob(f"{pkg}_*.deb"))
    return found[-1] if found else None


def fetch_debs(packages: Iterable[str], debs: Path) -> dict[str, Path]:
    """Download missing .debs with apt-get download (apt-get update once on failure)."""
    global _apt_updated
    debs.mkdir(parents=True, exist_ok=True)
    missing = [p for p in packages if _local_deb(debs, p) is None]
    if missing and not _run(["apt-get", "download", *missing], debs):
        if not _apt_updated:
            _apt_updated = _run(["apt-get", "update"], debs)
        for pkg in missing:
            if _local_deb(debs, pkg) is None:
                _run(["apt-get", "download", pkg], debs)
    return {p: d for p in packages if (d := _local_deb(debs, p)) is not None}


def unpack_deb(deb: Path, unpacked: Path) -> Path:
    """Extract a .deb with dpkg-deb -x into unpacked/<deb stem> (once, atomically)."""
    dest = unpacked / deb.stem
    if dest.is_dir():
        return dest
    unpacked.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{deb.stem}.", dir=unpacked))
    try:
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], check=True)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _sorted_files(root: Path) -> list[Path]:
    """All regular files under root in deterministic (sorted posix path) order."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        out.extend(Path(dirpath, f) for f in sorted(filenames))
    return sorted(out, key=lambda p: p.as_posix())


def _is_html_name(name: str) -> bool:
    """True for HTML file names (including apache-style index.html.de) and *.html dirs."""
    return bool(HTML_RE.search(name))


def _html_shadowed(path: Path, kind: str, pkg_has_html: bool) -> bool:
    """True for info/text renderings that duplicate a package's HTML manual."""
    if kind == "info":
        return pkg_has_html
    if kind not in ("text", "pod") or UPPER_NAME_RE.match(path.name.split(".")[0]):
        return False
    for sib in path.parent.iterdir():
        if _is_html_name(sib.name) or (sib.is_dir() and sib.name == "html"):
            return True
    return False


def package_docs(pkg: str, root: Path) -> Iterator[dict]:
    """Yield documents (text, category, source) extracted from one unpacked package."""
    files = [(p, k) for p in _sorted_files(root) if (k := classify(p))]
    has_html = any(k == "html" for _, k in files)
    for path, kind in files:
        if _html_shadowed(path, kind, has_html):
            continue
        text = extract(path, kind)
        if text:
            yield {"text": text, "category": CATEGORY[kind], "source": pkg}


# --------------------------------------------------------------------------- Python stdlib


def _stdlib_root() -> Path:
    """The interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files(suffixes: tuple[str, ...]) -> list[Path]:
    """Stdlib files with the given suffixes, excluding site-packages and caches."""
    root = _stdlib_root()
    return [
        p for p in _sorted_files(root)
        if p.suffix in suffixes and not {"site-packages", "__pycache__"} & set(p.relative_to(root).parts)
    ]


def docstrings_of(source: str, name: str) -> str:
    """Concatenate module/class/function docstrings of a Python source, each under its name."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                parts.append(f"{getattr(node, 'name', name)}\n\n{doc}")
    return "\n\n".join(parts)


def _stdlib_texts(suffixes: tuple[str, ...]) -> Iterator[tuple[Path, str]]:
    """Yield (relative path, decoded text) for stdlib files, skipping undecodable ones."""
    root = _stdlib_root()
    for path in _stdlib_files(suffixes):
        text = _decode(path.read_bytes(), "text")
        if text is not None:
            yield path.relative_to(root), text


def stdlib_docs(*, docstrings: bool) -> Iterator[dict]:
    """Yield stdlib documents: docstrings first (optional), then .py sources and .txt/.rst files."""
    if docstrings:
        for rel, src in _stdlib_texts((".py",)):
            doc = docstrings_of(src, rel.with_suffix("").as_posix().replace("/", "."))
            if len(doc) >= MIN_CHARS:
                yield {"text": doc, "category": "stdlib-docstrings", "source": "python-stdlib"}
    for rel, text in _stdlib_texts((".py", ".txt", ".rst")):
        category = "stdlib-code" if rel.suffix == ".py" else "stdlib-text"
        text = text if category == "stdlib-code" else _tidy(text)
        if len(text.strip()) >= MIN_CHARS:
            yield {"text": text, "category": category, "source": "python-stdlib"}


# --------------------------------------------------------------------------- writing


def _meta_path(out: Path) -> Path:
    """Sidecar metadata file recording how the corpus was built."""
    return out.with_name(out.name + ".meta.json")


def _cached(out: Path, key: dict) -> dict | None:
    """Return stored metadata when out exists, matches key and has the recorded size."""
    meta_file = _meta_path(out)
    if not (out.is_file() and meta_file.is_file()):
        return None
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError):
        return None
    ok = meta.get("key") == key and meta.get("bytes") == out.stat().st_size
    return meta if ok else None


def _write_atomic_json(path: Path, obj: dict) -> None:
    """Write JSON atomically (temp file + rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def write_jsonl(out: Path, docs: Iterable[dict], limit_bytes: int | None, key: dict) -> dict:
    """Write deduplicated docs as JSONL atomically, stopping once limit_bytes is reached."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    seen: set[bytes] = set()
    total, n_docs = 0, 0
    by_cat: Counter[str] = Counter()
    by_src: Counter[str] = Counter()
    try:
        with open(tmp, "wb") as fh:
            for doc in unique(docs, seen):
                if limit_bytes is not None and total >= limit_bytes:
                    break
                line = (json.dumps({"text": doc["text"]}, ensure_ascii=False) + "\n").encode()
                fh.write(line)
                total += len(line)
                n_docs += 1
                by_cat[doc["category"]] += len(line)
                by_src[doc["source"]] += len(line)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    meta = {
        "key": key, "bytes": total, "docs": n_docs,
        "categories": dict(sorted(by_cat.items())), "sources": dict(sorted(by_src.items())),
    }
    _write_atomic_json(_meta_path(out), meta)
    return meta


def unique(docs: Iterable[dict], seen: set[bytes]) -> Iterator[dict]:
    """Drop documents whose exact text was already produced (seen is shared and updated)."""
    for doc in docs:
        digest = hashlib.sha1(doc["text"].encode()).digest()
        if digest not in seen:
            seen.add(digest)
            yield doc


def interleave(streams: list[Iterator[dict]], code: Iterator[dict], code_share: float) -> Iterator[dict]:
    """Merge prose streams least-bytes-first (balanced mix); add code while below code_share of bytes."""
    heap = [(0, i) for i in range(len(streams))]
    prose_bytes = code_bytes = 0
    code_iter: Iterator[dict] | None = code
    while heap:
        sent, i = heapq.heappop(heap)
        doc = next(streams[i], None)
        if doc is None:
            continue
        size = len(doc["text"].encode())
        heapq.heappush(heap, (sent + size, i))
        prose_bytes += size
        yield doc
        while code_iter is not None and code_bytes < code_share * (prose_bytes + code_bytes):
            cdoc = next(code_iter, None)
            if cdoc is None:
                code_iter = None
                break
            code_bytes += len(cdoc["text"].encode())
            yield cdoc


# --------------------------------------------------------------------------- public API


def build_corpus(
    out_dir: str | os.PathLike = REPO_ROOT / "bench-data",
    *,
    target_mb: int = 220,
    seed_packages: Iterable[str] = DEFAULT_PACKAGES,
) -> Path:
    """Build (or reuse) a >= target_mb MB JSONL corpus of real text; return its path."""
    out_dir = Path(out_dir)
    packages = list(seed_packages)
    out = out_dir / f"corpus-{target_mb}mb.jsonl"
    key = {"version": FORMAT_VERSION, "target_mb": target_mb, "packages": packages}
    if _cached(out, key):
        return out
    debs = fetch_debs(packages, out_dir / "debs")
    roots = [(p, unpack_deb(debs[p], out_dir / "unpacked")) for p in packages if p in debs]
    seen: set[bytes] = set()
    streams = [unique(package_docs(p, r), seen) for p, r in roots]
    docs = interleave(streams, stdlib_docs(docstrings=False), CODE_SHARE)
    meta = write_jsonl(out, docs, target_mb * 1_000_000, key)
    if meta["bytes"] < target_mb * 1_000_000:
        print(f"warning: only {meta['bytes'] / 1e6:.1f} MB of real text available "
              f"(target {target_mb} MB); add packages to reach it", file=sys.stderr)
    return out


def stdlib_corpus(out_path: str | os.PathLike, *, max_mb: float | None = None) -> Path:
    """Build (or reuse) a JSONL corpus from the Python stdlib only (docstrings + sources); no network."""
    out = Path(out_path)
    key = {"version": FORMAT_VERSION, "stdlib": _stdlib_root().as_posix(), "max_mb": max_mb,
           "python": sys.version.split()[0]}
    if _cached(out, key):
        return out
    limit = None if max_mb is None else int(max_mb * 1_000_000)
    write_jsonl(out, stdlib_docs(docstrings=True), limit, key)
    return out


def corpus_stats(path: Path) -> dict:
    """Return the metadata recorded next to a corpus file."""
    return json.loads(_meta_path(Path(path)).read_text())


def main(argv: list[str] | None = None) -> int:
    """CLI: build the benchmark corpus and print a summary."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO_ROOT / "bench-data"), help="output directory")
    ap.add_argument("--mb", type=int, default=220, help="target size in MB (10^6 bytes)")
    ap.add_argument("--stdlib-only", action="store_true", help="build the small stdlib-only corpus")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    if args.stdlib_only:
        path = stdlib_corpus(Path(args.out) / "stdlib-corpus.jsonl", max_mb=args.mb)
    else:
        path = build_corpus(args.out, target_mb=args.mb)
    meta = corpus_stats(path)
    print(f"path: {path}")
    print(f"documents: {meta['docs']}")
    print(f"total: {meta['bytes'] / 1e6:.1f} MB   ({time.perf_counter() - start:.1f}s)")
    for cat, n in sorted(meta["categories"].items(), key=lambda kv: -kv[1]):
        print(f"  {cat:<18} {n / meta['bytes']:6.1%}  {n / 1e6:8.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
