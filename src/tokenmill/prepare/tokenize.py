"""One work unit → tokens: the config that decides a store's bytes, and tokenizing a unit.

    config = PrepareConfig(tokenizer="bytes", shard_tokens=1 << 20)
    res = tokenize_unit(sources.Unit("a.jsonl", 0, -1), config)   # UnitResult
    res.lengths.sum() == len(res.tokens)

Per document, in this order: the transform (``prepare.transform``; records in, text or None
out), the holdout filter (``prepare.split``: one side of a split), then encoding. Both drops
become Skips at their place (``dropped_by_transform``, ``held_out``), so they are counted once
across a resume.

``tokenize_unit`` runs in prepare's and streaming's worker processes and inline (one worker);
a unit's bytes are read by the worker itself, or arrive as ``payload`` (a compressed input read
as a stream by the parent).
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np
import xxhash

from tokenmill.inputs import sources
from tokenmill.base.errors import check_int
from tokenmill.base.io import CHUNK, filesystem, is_url, redact
from tokenmill.prepare.split import check_holdout, keep_side, text_hashes, texts_sum
from tokenmill.inputs.textfields import text_extensions, text_keys
from tokenmill.prepare.transform import (sample_records, transform_identity, transform_spec,
                                         transformed)
from tokenmill.inputs.readers import lines_before
from tokenmill.inputs.records import Doc, LineCount, local_path, unit_format, unit_lines_relative
from tokenmill.tokenizer import Tokenizer, encode_documents, load_tokenizer, token_dtype

DEFAULT_SHARD_TOKENS = 1 << 26  # 64 Mi tokens: 128 MiB uint16 shards


@dataclass(frozen=True)
class PrepareConfig:
    """Everything that decides a store's bytes (worker count and progress display do not).

    ``transform`` may be given as a function: it is stored as its "module:qualname" spec.
    """

    tokenizer: str = "bytes"
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    text_key: str = "text"
    txt_mode: str = "file"
    on_error: str = "raise"
    add_eos: bool = True
    add_bos: bool = False
    eos: str | None = None
    bos: str | None = None
    tokenizer_engine: str = "auto"  # what runs a tokenizer.json; never changes the ids
    unit_bytes: int = 4 << 20  # 4 MiB units: small enough that 2 workers end together
    transform: str | None = None  # "module:qualname" of fn(record) -> str | None
    holdout: tuple[str, float] | None = None  # ("val", 0.01): keep that side of a split
    split: str | None = None  # the split of a folder holding several (tokenmill.inputs.splits)
    text_ext: tuple[str, ...] = ()  # extensions read as text ("" = none; tokenmill.inputs.textfields)

    def __post_init__(self):
        object.__setattr__(self, "text_key", text_keys(self.text_key))  # frozen: normalised here
        object.__setattr__(self, "text_ext", text_extensions(self.text_ext))
        for name in ("shard_tokens", "unit_bytes"):  # frozen: made plain ints once, here
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum=1))
        if self.transform is not None:  # frozen: normalised once, here
            object.__setattr__(self, "transform", transform_spec(self.transform))
        object.__setattr__(self, "holdout", check_holdout(self.holdout))

    def source_config(self, storage_options: Mapping | None = None) -> sources.SourceConfig:
        """The part of the config the readers need."""
        return sources.SourceConfig(text_key=self.text_key, txt_mode=self.txt_mode,
                                    on_error=self.on_error, unit_bytes=self.unit_bytes,
                                    storage_options=storage_options, split=self.split,
                                    records=self.transform is not None, text_ext=self.text_ext)

    def settings(self, inputs: Sequence[str], files: Sequence[str], sizes: dict[str, int],
                 storage_options: Mapping | None = None) -> dict:
        """What the manifest records: the config minus display-only fields, plus the inputs
        (local paths normalised, URLs redacted: ``same_input`` spellings record the same); a
        transform by what it does too (replayed on the first records of ``files``)."""
        s = asdict(self)
        s.pop("tokenizer_engine")  # every engine gives identical ids (proven at load time)
        s.pop("unit_bytes")  # how work is split never changes the bytes (the resume key has it)
        for name in ("transform", "holdout", "split", "text_ext"):  # absent when unset: older
            if not s[name]:  # stores stay the same
                s.pop(name)
        if self.transform is not None:
            samples = sample_records(files, self.source_config(storage_options))
            s["transform"] = transform_identity(self.transform, samples)
        for name in ("holdout", "text_key", "text_ext"):  # as JSON reads them back: the resume
            if isinstance(s.get(name), tuple):  # key compares
                s[name] = list(s[name])
        s["inputs"] = [input_name(i) for i in inputs]
        s["num_files"] = len(files)
        s["files_xxh3"] = xxhash.xxh3_64_hexdigest(
            "\n".join(f"{input_name(f)}\t{sizes[f]}" for f in files).encode())
        return s


def input_name(path: str | os.PathLike) -> str:
    """How an input is recorded: a local path absolute and normalised, a URL as given, redacted.

    input_name("s3://k:secret@b/x.jsonl") == "s3://k:***@b/x.jsonl"
    """
    path = os.fspath(path)
    return redact(path) if is_url(path) else os.path.abspath(path)


@dataclass(frozen=True)
class UnitResult:
    """One tokenized unit: flat tokens, per-document lengths, skips by document ordinal, the
    characters read, an xxh3 of the input bytes the unit stands for (None: covered by the file's
    first unit), and where each document starts: ``lines`` (int64, in lockstep with ``lengths``;
    of the file, or of the unit when ``records.unit_lines_relative``) and the unit's
    ``newlines`` (``records.LineCount``), which ``readers.LineBases`` turns into file lines;
    with a transform or for one side of a split, ``texts``: the ``split.texts_sum`` of every
    document's text, either side (the two passes of a split must agree; a resume replays the
    transform on a few committed units and compares: ``identity.changed_output``)."""

    tokens: np.ndarray
    lengths: np.ndarray
    skips: list[tuple[int, sources.Skip]]
    chars: int
    digest: str | None = None
    lines: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    newlines: int = 0
    texts: str | None = None


@functools.lru_cache(maxsize=4)
def config_tokenizer(spec: str, engine: str, eos: str | None, bos: str | None) -> Tokenizer:
    """The tokenizer of a config, loaded once per process."""
    return load_tokenizer(spec, engine=engine, eos=eos, bos=bos)


def tokenizer_of(config: PrepareConfig) -> Tokenizer:
    """``config``'s tokenizer, loaded once per process."""
    return config_tokenizer(config.tokenizer, config.tokenizer_engine, config.eos, config.bos)


def engine_option(options: dict) -> dict:
    """``options`` with the older ``fast_tokenizer`` (False: "hf"; True: "auto"; a str: that
    engine) turned into ``tokenizer_engine``.

    engine_option({"fast_tokenizer": False}) == {"tokenizer_engine": "hf"}
    """
    if "fast_tokenizer" not in options:
        return options
    options = dict(options)
    fast = options.pop("fast_tokenizer")
    options.setdefault("tokenizer_engine", fast if isinstance(fast, str) else
                       ("auto" if fast else "hf"))
    return options


def engine_record(tok: Tokenizer) -> dict:
    """What the manifest says about the engine that ran (never fingerprinted: every engine
    gives the same ids): ``{"name": "fastokens", "notes": [why faster ones were refused]}``."""
    source = getattr(tok, "source", None)  # where a name was found (hf:org/name@commit/…)
    return {"name": tok.engine, "notes": list(tok.engine_notes)} | ({"source": source} if source
                                                                     else {})


def tokenize_unit(unit: sources.Unit, config: PrepareConfig, storage_options: Mapping | None = None,
                  tokenizer: Tokenizer | None = None, payload: bytes | None = None) -> UnitResult:
    """Read one unit (or its ``payload``) and tokenize its documents (EOS/BOS as configured)."""
    tok = tokenizer if tokenizer is not None else tokenizer_of(config)
    return encode_unit(read_unit_items(unit, config, storage_options, payload), config, tok)


class UnitRead(NamedTuple):
    """The first half of a unit's work: its Docs and Skips in file order (after the transform),
    the digest of its input bytes, its newline count (``records.LineCount``) and its file."""

    items: list
    digest: str | None
    newlines: int
    path: str


def read_unit_items(unit: sources.Unit, config: PrepareConfig,
                    storage_options: Mapping | None = None,
                    payload: bytes | None = None) -> UnitRead:
    """The first half of ``tokenize_unit``, which a thread can run ahead."""
    digest = unit_digest(unit, storage_options)
    count = LineCount()
    items = sources.read_unit(unit, config.source_config(storage_options), payload, count)
    if config.transform is not None:  # per document: transform → holdout → encode (C2)
        items = transformed(items, config.transform, unit.path, config.on_error,
                            txt_places(unit, config.txt_mode, storage_options))
    items = list(items)  # read to the end: the count is complete
    return UnitRead(items, digest, count.newlines, unit.path)


def encode_unit(read: UnitRead, config: PrepareConfig, tok: Tokenizer) -> UnitResult:
    """The second half of ``tokenize_unit``: a unit's items (from ``read_unit_items``) tokenized."""
    texts: list[str] = []
    lines: list[int] = []  # a document kept is appended to both, in lockstep
    skips: list[tuple[int, sources.Skip]] = []
    for item in read.items:
        if type(item) is Doc:
            text, line = item
            texts.append(text)
            lines.append(line)
        else:
            skips.append((len(texts), item))
    summed = hashes = None
    if config.holdout is not None or config.transform is not None:  # what a resume replays
        hashes = text_hashes(texts)  # (identity.changed_output) and a split accounts for
        summed = texts_sum(hashes)
    if config.holdout is not None:
        kept, skips = keep_side(texts, skips, config.holdout, read.path, hashes)
        texts, lines = [texts[i] for i in kept], [lines[i] for i in kept]
    tokens, lengths = encode_documents(tok, texts, add_eos=config.add_eos,
                                       add_bos=config.add_bos, dtype=token_dtype(tok.vocab_size))
    return UnitResult(tokens, lengths, skips, sum(map(len, texts)), read.digest,
                      np.array(lines, dtype=np.int64), read.newlines, summed)


def txt_places(unit: sources.Unit, txt_mode: str,
               storage_options: Mapping | None = None) -> Callable[[Doc], str]:
    """``place(doc)``: where a document of a .txt unit is, for a transform's skip or message:
    "file" (file mode), else "line N" of its file — the same for any unit size, so a manifest's
    skip examples do not depend on it (the lines before a unit past byte 0 are counted once, the
    first time a place is asked for: ``readers.lines_before``)."""
    if txt_mode == "file":
        return lambda doc: "file"
    base = functools.cache(lambda: lines_before(unit, storage_options)
                           if unit_lines_relative(unit) else 0)
    return lambda doc: f"line {base() + doc.line}"


def unit_digest(unit: sources.Unit, storage_options: Mapping | None = None) -> str | None:
    """xxh3 of the input bytes ``unit`` stands for (with its place), so that a resumed prepare
    can tell that an input changed under the same size and mtime.

    A byte range of a text file: those bytes. Any other unit (a whole file, row groups, part of
    a compressed stream): the whole file, once, for the unit that starts at 0 — the others
    return None. A URL (not ``file://``): fsspec's ``ukey`` (ETag or size and time). None if it
    cannot be read.
    """
    h = xxhash.xxh3_64(f"{input_name(unit.path)}\t{unit.start}\t{unit.stop}\n".encode())
    byte_range = unit_format(unit) in ("jsonl", "txt") and unit.stop != -1
    if not byte_range and unit.start != 0:
        return None
    try:
        local = local_path(unit.path)  # a file:// URL's bytes are read, as a path's
        if local is None:
            fs, p = filesystem(unit.path, storage_options)
            h.update(str(fs.ukey(p)).encode())
            return h.hexdigest()
        with open(local, "rb") as f:
            f.seek(unit.start if byte_range else 0)
            left = unit.stop - unit.start if byte_range else None
            while chunk := f.read(CHUNK if left is None else min(CHUNK, left)):
                h.update(chunk)
                if left is not None and (left := left - len(chunk)) == 0:
                    break
    except (OSError, NotImplementedError):
        return None  # the reader reports it (or skips it) on its own
    return h.hexdigest()
