"""Interchange: Megatron-LM indexed datasets in, nanoGPT token streams and JSONL text out.

import_megatron(["data/corpus_text_document"], out="store/", tokenizer="tokenizer.json")
makes a store whose ``shard-NNNNN.bin`` are the Megatron ``.bin`` files themselves (hard links,
never copies, unless asked), each with a new ``.idx`` and a manifest of xxh3 checksums::

    PREFIX_0.bin ══hard link══ store/shard-00000.bin     (symlink across filesystems; or a copy)
    PREFIX_0.idx ──read──▶     store/shard-00000.idx     (written: one sequence per document)
    PREFIX_1.bin ══════════    store/shard-00001.bin …   store/manifest.json (written last)

Documents. A Megatron index lists N *sequences* and M = D + 1 document boundaries; its writers may
put several sequences in a document (``preprocess_data.py --split-sentences``: one per sentence).
tokenmill's unit is the document: the sequences of a document are merged into one, which needs no
copy because Megatron writes them back to back (checked: sequence offsets must be contiguous from
byte 0 and the ``.bin`` exactly as long as the sequences, or the import is refused). Documents of
0 tokens are dropped and counted in the manifest's ``skipped`` as ``empty_document``. Multimodal
indexes (a sequence-mode array after the document boundaries) are refused.

Checks. The token dtype must be uint16 or int32, the same in every prefix, and able to hold the
tokenizer's ids; every token id must be in [0, vocab_size): the ``.bin`` is scanned in 8 MiB
chunks (while its checksum is computed, in the same pass), and the first bad id is reported with
its shard, token and document.

export(store, out="train.bin", format="nanogpt"): the store's tokens in store order as one flat
little-endian uint16 file, what nanoGPT's ``np.memmap(path, dtype=np.uint16)`` reads, and
``meta.pkl`` beside it (pickled ``{"vocab_size": N}``, what its train.py reads); a split's folder
gives ``out/train.bin`` and ``out/val.bin``. Documents
end with EOS in a prepared store, so they are simply concatenated. An int32 store is exported only
when its vocabulary fits uint16 (vocab_size <= 65,536), otherwise refused; every id of every
dtype is checked below the manifest's vocab_size (``shardexport``).

export(store, out="docs.jsonl", format="jsonl"): one ``{"text": …}`` line per document, decoded
by the store's tokenizer (the manifest's ``settings.tokenizer`` spec, or ``tokenizer=``), which
must match the manifest's identity (its ``file_xxh3``, vocab size, EOS and BOS ids). One trailing
EOS and one leading BOS are stripped (for a prepared store, as it added them). Byte-level
tokenizers decode exactly, so text → store → text gives the text back.

Every output is written under a temporary name and renamed into place; memory stays bounded
(8 MiB chunks, one document at a time); a progress bar shows on a terminal.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import xxhash

from tokenmill.base.arrays import first_outside
from tokenmill.base.errors import ConfigError, InputError, TokenizerError
from tokenmill.base.io import atomic_output, atomic_write_bytes, atomic_write_json, temp_name
from tokenmill.load.plan import check_tokenizers
from tokenmill.prepare.split import check_accounts, split_of, split_sides
from tokenmill.store.shardexport import nanogpt_chunks, verified_shard
from tokenmill.store import (IDX_HEADER, IDX_MAGIC, IDX_VERSION, MANIFEST, DTYPE_CODES, ShardInfo,
                             TokenStore, build_manifest, idx_bytes, read_idx, shard_name)
from tokenmill.tokenizer import Tokenizer, load_tokenizer

__all__ = ["EXPORT_FORMATS", "LINK_MODES", "export", "import_megatron"]

LINK_MODES = ("hard", "symlink", "copy")
EXPORT_FORMATS = ("nanogpt", "jsonl")
STORE_DTYPES = (np.dtype(np.uint16), np.dtype(np.int32))
_CHUNK = 8 << 20
_MAX_EXAMPLES = 20
# os.link fails with these when the target is on another filesystem or links are not supported
_NO_HARD_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EACCES}


# ---- Megatron → store --------------------------------------------------------------------------

def import_megatron(prefixes: str | os.PathLike | Sequence[str | os.PathLike], *,
                    out: str | os.PathLike, tokenizer: str, link: str = "hard",
                    progress: bool | None = None) -> dict:
    """A store at ``out`` made of Megatron ``PREFIX.bin/.idx`` pairs, one shard each; the manifest.

    ``tokenizer`` is the spec of the tokenizer the data was made with (its identity goes into the
    manifest). ``link``: "hard" (a hard link, or a symlink when that fails, e.g. across
    filesystems), "symlink", or "copy". Nothing is written until every index has been checked.
    """
    if link not in LINK_MODES:
        raise ConfigError(f"link must be one of {LINK_MODES} (got link={link!r})")
    prefixes = [prefixes] if isinstance(prefixes, (str, os.PathLike)) else list(prefixes)
    if not prefixes:
        raise ConfigError("import_megatron needs at least one PREFIX (of PREFIX.bin/.idx)")
    prefixes = [_strip_suffix(os.fspath(p)) for p in prefixes]
    tok = load_tokenizer(tokenizer)
    plans = [_plan_shard(p) for p in prefixes]
    dtype = _store_dtype(plans, tok, tokenizer)
    out = Path(out)
    created = _claim_out_dir(out)
    try:
        shards, empty = [], []
        with _Bar(sum(p.bin_bytes for p in plans), "import", progress) as bar:
            for i, plan in enumerate(plans):
                info, mode = _write_shard(plan, out, i, link, tok.vocab_size, bar)
                shards.append(info)
                plan.link_used = mode
                empty += [(plan.prefix, d) for d in plan.empty_docs]
        if not any(s.num_documents for s in shards):
            raise InputError(f"no documents in {', '.join(prefixes)}: every document has 0 tokens")
        settings = {"imported_from": "megatron", "tokenizer": os.fspath(tokenizer),
                    "prefixes": [os.path.abspath(p.prefix) for p in plans],
                    "links": [p.link_used for p in plans]}
        manifest = build_manifest(tokenizer=tok.identity(), dtype=dtype, shards=shards,
                                  settings=settings, skipped=_empty_skips(empty))
        atomic_write_json(out / MANIFEST, manifest)
    except BaseException:  # out was new or empty: leave it as it was
        for f in out.iterdir():
            f.unlink()
        if created:
            out.rmdir()
        raise
    return manifest


class _ShardPlan:
    """One checked Megatron prefix: its dtype, per-document token counts, and the empty ones."""

    def __init__(self, prefix: str, dtype: np.dtype, doc_lengths: np.ndarray, bin_bytes: int):
        self.prefix, self.dtype, self.bin_bytes = prefix, dtype, bin_bytes
        self.empty_docs = np.flatnonzero(doc_lengths == 0)
        self.doc_lengths = doc_lengths[doc_lengths > 0]
        self.doc_starts = np.concatenate([[0], np.cumsum(doc_lengths)[:-1]]).astype(np.int64)
        self.link_used = ""


def _strip_suffix(prefix: str) -> str:
    """A prefix given as its .bin or .idx file means the pair: "a/x.bin" → "a/x"."""
    return prefix[:-4] if prefix.endswith((".bin", ".idx")) else prefix


def _plan_shard(prefix: str) -> _ShardPlan:
    """Check a Megatron prefix's index against its .bin; the tokens per document."""
    idx_path, bin_path = f"{prefix}.idx", f"{prefix}.bin"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise InputError(f"{path}: not found; a Megatron dataset PREFIX names PREFIX.bin and "
                             "PREFIX.idx (give the prefix without extension)", path=path)
    _check_megatron_header(idx_path)
    idx = read_idx(idx_path)
    dtype = idx.dtype
    lengths = np.asarray(idx.lengths, dtype=np.int64)
    n, bounds = len(lengths), np.asarray(idx.doc_idx, dtype=np.int64)
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if n else 0
    if n and lengths.min() < 0:
        raise InputError(f"{idx_path}: sequence {int(np.argmin(lengths))} has a negative length",
                         path=idx_path)
    want_ptr = (ends - lengths) * dtype.itemsize
    if not np.array_equal(np.asarray(idx.pointers), want_ptr):
        bad = int(np.flatnonzero(np.asarray(idx.pointers) != want_ptr)[0])
        raise InputError(f"{idx_path}: sequence {bad:,} starts at byte {int(idx.pointers[bad]):,} of "
                         f"the .bin, not {int(want_ptr[bad]):,}: the sequences are not back to back, "
                         "so tokenmill cannot use the .bin as it is", path=idx_path)
    bin_bytes = os.path.getsize(bin_path)
    if bin_bytes != total * dtype.itemsize:
        raise InputError(f"{bin_path}: {bin_bytes:,} bytes, but its index holds {total:,} "
                         f"{dtype} tokens ({total * dtype.itemsize:,} bytes); is the .bin truncated, "
                         "or from another dataset?", path=bin_path)
    if (len(bounds) == 0 or bounds[0] != 0 or bounds[-1] != n
            or (len(bounds) > 1 and np.diff(bounds).min() < 0)):
        shown = (bounds[:3].tolist(), bounds[-3:].tolist()) if len(bounds) else ([], [])
        raise InputError(f"{idx_path}: document index must rise from 0 to the {n:,} sequences "
                         f"(got {shown[0]} … {shown[1]})", path=idx_path)
    # tokens per document: the sequences of a document are merged (they are back to back)
    starts = np.concatenate([[0], ends])
    doc_lengths = starts[bounds[1:]] - starts[bounds[:-1]]
    if len(doc_lengths) and doc_lengths.max() > np.iinfo(np.int32).max:
        raise InputError(f"{idx_path}: document {int(np.argmax(doc_lengths)):,} holds "
                         f"{int(doc_lengths.max()):,} tokens, more than an index can record "
                         f"({np.iinfo(np.int32).max:,})", path=idx_path)
    return _ShardPlan(prefix, dtype, doc_lengths, bin_bytes)


def _check_megatron_header(path: str) -> None:
    """Megatron-specific messages for what read_idx would only call corrupt."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(IDX_HEADER.size)
    if len(head) < IDX_HEADER.size:
        raise InputError(f"{path}: {size} bytes, too short for a Megatron index header", path=path)
    magic, version, code, n, m = IDX_HEADER.unpack(head)
    if magic != IDX_MAGIC or version != IDX_VERSION:
        raise InputError(f"{path}: not a Megatron-LM indexed dataset index (MMIDIDX version 1): "
                         f"magic {magic!r}, version {version}", path=path)
    if code not in DTYPE_CODES:
        raise InputError(f"{path}: unknown token dtype code {code}", path=path)
    plain = IDX_HEADER.size + 12 * n + 8 * m
    if size == plain + n and n:
        raise InputError(f"{path}: a multimodal index (one mode byte per sequence); tokenmill "
                         "imports text-only datasets", path=path)
    if size != plain:
        raise InputError(f"{path}: expected {plain:,} bytes for {n:,} sequences and {m:,} document "
                         f"boundaries, found {size:,}; the index is truncated or corrupt", path=path)


def _store_dtype(plans: list[_ShardPlan], tok: Tokenizer, spec: str) -> np.dtype:
    dtype = plans[0].dtype
    for p in plans:
        if p.dtype != dtype:
            raise InputError(f"{p.prefix}.idx: token dtype {p.dtype}, but {plans[0].prefix}.idx has "
                             f"{dtype}; a store holds one dtype — import them as separate stores",
                             path=f"{p.prefix}.idx")
    if dtype not in STORE_DTYPES:
        raise InputError(f"{plans[0].prefix}.idx: token dtype {dtype}; a tokenmill store holds uint16 "
                         "or int32 tokens — re-tokenize the text with 'tokenmill prepare'",
                         path=f"{plans[0].prefix}.idx")
    if np.iinfo(dtype).max < tok.vocab_size - 1:
        raise InputError(f"{plans[0].prefix}.idx: {dtype} tokens cannot hold the ids of {spec!r} "
                         f"(vocab_size {tok.vocab_size:,}); was the data made with another "
                         "tokenizer?", path=f"{plans[0].prefix}.idx")
    return dtype


def _claim_out_dir(out: Path) -> bool:
    """Make sure ``out`` is new or empty; whether this call created it."""
    if out.exists():
        if not out.is_dir() or any(out.iterdir()):
            raise ConfigError(f"{out}: exists and is not an empty directory; choose a new --out")
        return False
    out.mkdir(parents=True)
    return True


def _write_shard(plan: _ShardPlan, out: Path, i: int, link: str, vocab_size: int,
                 bar) -> tuple[ShardInfo, str]:
    """Place the .bin (link or copy), scan and hash it, write the .idx; (info, link mode used)."""
    name = shard_name(i)
    src, tmp = f"{plan.prefix}.bin", temp_name(out / f"{name}.bin")
    mode = _place(src, tmp, link)
    try:
        digest = _scan(tmp if mode != "copy" else src, tmp if mode == "copy" else None,
                       plan, vocab_size, bar)
        idx = idx_bytes(plan.doc_lengths, plan.dtype)
        atomic_write_bytes(out / f"{name}.idx", idx)
        os.replace(tmp, out / f"{name}.bin")
    finally:
        tmp.unlink(missing_ok=True)
    tokens = int(plan.doc_lengths.sum())
    info = ShardInfo(name=name, num_documents=len(plan.doc_lengths), num_tokens=tokens,
                     bin_bytes=plan.bin_bytes, idx_bytes=len(idx), bin_xxh3=digest,
                     idx_xxh3=xxhash.xxh3_64_hexdigest(idx))
    return info, mode


def _place(src: str, dst: Path, link: str) -> str:
    """Hard link (falling back to a symlink), symlink, or nothing yet for a copy; the mode used."""
    if link == "hard":
        try:
            os.link(src, dst)
            return "hard"
        except OSError as e:
            if e.errno not in _NO_HARD_LINK:
                raise
            link = "symlink"
    if link == "symlink":
        os.symlink(os.path.abspath(src), dst)
        return "symlink"
    return "copy"


def _scan(path: str | Path, copy_to: Path | None, plan: _ShardPlan, vocab_size: int, bar) -> str:
    """xxh3 of a .bin, checking every id is in [0, vocab_size); copy it to copy_to if given."""
    h, dtype = xxhash.xxh3_64(), plan.dtype.newbyteorder("<")
    buf = bytearray(_CHUNK - _CHUNK % dtype.itemsize)
    pos = 0  # tokens scanned so far
    with open(path, "rb") as f, (open(copy_to, "wb") if copy_to else _Null()) as dst:
        while n := f.readinto(buf):
            view = memoryview(buf)[:n]
            h.update(view)
            dst.write(view)
            ids = np.frombuffer(view, dtype)
            if (bad := first_outside(ids, vocab_size)) is not None:
                _bad_token(plan, pos + bad, int(ids[bad]), vocab_size)
            pos += len(ids)
            bar.update(n)
        if copy_to:
            dst.flush()
            os.fsync(dst.fileno())
    return h.hexdigest()


def _bad_token(plan: _ShardPlan, pos: int, value: int, vocab_size: int):
    doc = int(np.searchsorted(plan.doc_starts, pos, side="right")) - 1
    raise InputError(f"{plan.prefix}.bin: token {pos:,} (document {doc:,}) is {value}, outside "
                     f"[0, {vocab_size:,}) of the tokenizer given; was the data made with another "
                     "tokenizer? Pass the one it was made with as --tokenizer",
                     path=f"{plan.prefix}.bin", where=f"token {pos}")


def _empty_skips(empty: list[tuple[str, int]]) -> dict:
    """The manifest's ``skipped`` for the 0-token documents left out."""
    examples = [{"path": f"{p}.idx", "where": f"document {int(d)}", "reason": "empty_document",
                 "detail": "0 tokens"} for p, d in empty[:_MAX_EXAMPLES]]
    return {"total": len(empty), "by_reason": {"empty_document": len(empty)} if empty else {},
            "examples": examples}


class _Null:
    """A file that drops what it is given."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def write(self, data) -> None:
        return None


# ---- store → nanoGPT / JSONL --------------------------------------------------------------------

def export(store: str | os.PathLike, *, out: str | os.PathLike, format: str,
           tokenizer: str | None = None, progress: bool | None = None) -> dict:
    """Write a store as nanoGPT's ``train.bin`` + ``meta.pkl`` (format="nanogpt") or as text
    (format="jsonl").

    Returns {"format", "out", "documents", "tokens", "bytes", "files"}. ``tokenizer`` (jsonl only)
    overrides the manifest's spec; either must match the store's tokenizer identity. nanogpt:
    ``meta.pkl`` goes beside ``out``; a split's folder (``--val-fraction``) writes ``train.bin``
    and ``val.bin`` into the folder ``out``.
    """
    if format not in EXPORT_FORMATS:
        raise ConfigError(f"format must be one of {EXPORT_FORMATS} (got format={format!r})")
    if format == "nanogpt" and tokenizer is not None:
        raise ConfigError("format='nanogpt' writes token ids; tokenizer= is only for 'jsonl'")
    out, sides = Path(out), split_sides(store) if format == "nanogpt" else None
    if sides and (out.suffix == ".bin" or out.is_file()):
        raise ConfigError(f"{store}: holds a split's two stores, exported as train.bin and "
                          "val.bin into one folder; --out names that folder (e.g. data/mydata)")
    if not sides and out.is_dir():
        raise ConfigError(f"{out}: is a directory; --out names the file to write")
    if sides:
        check_split(store, sides)
    targets = {out / f"{k}.bin": p for k, p in sides.items()} if sides else {out: store}
    done = [_export_file(p, f, format, tokenizer, progress) for f, p in targets.items()]
    files = [str(f) for f in targets]
    if format == "nanogpt":  # nanoGPT's train.py sizes its embedding from meta["vocab_size"]
        files.append(str((out if sides else out.parent) / "meta.pkl"))
        atomic_write_bytes(files[-1], pickle.dumps({"vocab_size": done[0]["vocab_size"]}))
    total = {k: sum(d[k] for d in done) for k in ("documents", "tokens", "bytes")}
    return {"format": format, "out": str(out), **total, "files": files}


def check_split(store, sides: dict[str, str]) -> None:
    """Refuse a split folder whose train/ and val/ are not the two sides of one split made with
    one tokenizer (val.bin's ids would mean other tokens, or documents be in both files)."""
    with TokenStore(sides["train"], verify="off") as t, TokenStore(sides["val"], verify="off") as v:
        check_tokenizers([t, v])
        got = [(g or {}).get(k) for g in map(split_of, (t.manifest, v.manifest))
               for k in ("side", "fraction")]
        if got[0] != "train" or got[2] != "val" or got[1] != got[3]:
            raise ConfigError(f"{store}: its train/ and val/ are not the two sides of one split "
                              f"(sides and fractions: {got}); prepare both with one --val-fraction run")
        check_accounts(t.manifest, v.manifest)
        check_token_settings(store, t.manifest, v.manifest)


# the settings that decide a document's tokens besides the tokenizer (checked above)
TOKEN_SETTINGS = ("add_bos", "add_eos", "bos", "eos")


def check_token_settings(store, train: dict, val: dict) -> None:
    """Refuse a split whose train and val manifests made a document's tokens differently
    (one side with EOS, the other without: val.bin would not be train.bin's kind of stream)."""
    a, b = train.get("settings") or {}, val.get("settings") or {}
    for key in TOKEN_SETTINGS:
        if a.get(key) != b.get(key):
            raise ConfigError(f"{store}: its train/ and val/ were prepared with other '{key}' "
                              f"settings (train {a.get(key)!r}, val {b.get(key)!r}): their "
                              "documents end differently; prepare both with one --val-fraction "
                              "run")


def _export_file(store, out: Path, format: str, tokenizer, progress) -> dict:
    """One store into one file; its counts and the store's vocab_size."""
    # every shard's checksum is checked here, as it is read: the background check is not needed
    with TokenStore(store, verify="off") as s:
        writer = _write_nanogpt if format == "nanogpt" else _write_jsonl
        with output_errors(out), atomic_output(out) as f:
            writer(s, f, tokenizer, progress)
        return {"documents": len(s), "tokens": s.num_tokens, "bytes": out.stat().st_size,
                "vocab_size": s.tokenizer["vocab_size"]}


@contextlib.contextmanager
def output_errors(out: Path) -> Iterator[None]:
    """Create ``out``'s folder if needed; a folder that cannot be made or written (read-only, a
    file in the way, no permission) is a ConfigError naming ``out``."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        yield
    except OSError as e:
        why = e.strerror or type(e).__name__
        if isinstance(e, (FileExistsError, NotADirectoryError)) or not out.parent.is_dir():
            why = f"{why}: a part of its folder is a file, not a folder"
        raise ConfigError(f"{out}: cannot write ({why}); choose an --out in a folder you can "
                          "write to") from None


def _write_nanogpt(s: TokenStore, f, tokenizer, progress) -> None:
    with _Bar(s.num_tokens, "export", progress) as bar:
        for part in nanogpt_chunks(s, _CHUNK // 2):
            f.write(part.data)
            bar.update(len(part))


def _write_jsonl(s: TokenStore, f, tokenizer, progress) -> None:
    tok = _store_tokenizer(s, tokenizer)
    settings = s.manifest.get("settings") or {}
    eos = tok.eos_id if settings.get("add_eos", True) else None
    bos = tok.bos_id if settings.get("add_bos", True) else None
    with _Bar(s.num_tokens, "export", progress) as bar:
        for ids in _documents(s):
            n = len(ids)
            if len(ids) and eos is not None and ids[-1] == eos:
                ids = ids[:-1]
            if len(ids) and bos is not None and ids[0] == bos:
                ids = ids[1:]
            text = tok.decode(np.asarray(ids, dtype=np.int64))
            f.write(json.dumps({"text": text}, ensure_ascii=False).encode("utf-8") + b"\n")
            bar.update(n)


def _documents(s: TokenStore) -> Iterator[np.ndarray]:
    """Every document's tokens in store order, a view at a time."""
    for k, lengths in enumerate(np.split(s.doc_lengths, s.shard_doc_starts[1:-1])):
        tokens, pos = verified_shard(s, k), 0
        for n in lengths.tolist():
            yield tokens[pos:pos + n]
            pos += n


_IDENTITY_KEYS = ("kind", "vocab_size", "eos_id", "bos_id", "file_xxh3")


def _store_tokenizer(s: TokenStore, spec: str | None) -> Tokenizer:
    """The tokenizer a store was made with: ``spec`` or the manifest's, checked against its identity."""
    settings = s.manifest.get("settings") or {}
    given = spec is not None
    spec = spec if given else settings.get("tokenizer")
    if spec is None:
        raise TokenizerError(f"{s.path}: the manifest names no tokenizer spec; pass --tokenizer")
    kwargs = {k: settings[k] for k in ("eos", "bos") if settings.get(k) is not None}
    try:
        tok = load_tokenizer(spec, **kwargs)
    except TokenizerError as e:
        hint = "" if given else " (the spec recorded in the manifest); pass --tokenizer with that file"
        raise TokenizerError(f"{e}{hint}") from None
    want, got = s.tokenizer, tok.identity()
    diff = [k for k in _IDENTITY_KEYS if want.get(k) != got.get(k)]
    if diff:
        shown = ", ".join(f"{k} {got.get(k)!r} ≠ {want.get(k)!r}" for k in diff)
        raise TokenizerError(f"{spec}: not the tokenizer {s.path} was made with ({shown}); pass "
                             "--tokenizer with the file it was prepared with")
    return tok


# ---- progress --------------------------------------------------------------------------------

class _Bar:
    """A tqdm bar (bytes for import, tokens for export) on a terminal unless progress=False."""

    def __init__(self, total: int, desc: str, progress: bool | None):
        self._tqdm = None
        if progress is not False and sys.stderr.isatty():
            from tqdm import tqdm
            self._tqdm = tqdm(total=total, desc=desc, unit="B" if desc == "import" else "tok",
                              unit_scale=True, dynamic_ncols=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self._tqdm is not None:
            self._tqdm.close()

    def update(self, n: int) -> None:
        if self._tqdm is not None:
            self._tqdm.update(n)
