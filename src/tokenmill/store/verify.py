"""Checking a store: structure, sizes and every checksum (the ``.src`` sidecars' too), every
token id below the manifest's ``vocab_size``, and the fingerprint recomputed from the manifest
(tokenizer, dtype, shard checksums: ``format.store_fingerprint``), local or remote."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from tokenmill.base.arrays import first_outside
from tokenmill.base.errors import StoreError
from tokenmill.base.io import is_url, json_bytes, list_sizes, redact, xxh3_file
from tokenmill.store.cache import ShardCache
from tokenmill.store.format import (MANIFEST, MANIFEST_CHECKSUM, SOURCES, parse_src, read_idx,
                                    read_manifest, store_fingerprint)

_FILES = ((".bin", "bin_bytes", "bin_xxh3"), (".idx", "idx_bytes", "idx_xxh3"))
_SRC = (".src", "src_bytes", "src_xxh3")


def _files(shard: dict) -> tuple[tuple[str, str, str], ...]:
    """(extension, size key, checksum key) of each file a shard entry names."""
    return _FILES + ((_SRC,) if shard.get("src_xxh3") is not None else ())


def verify_store(path: str | os.PathLike, *, storage_options: dict | None = None) -> list[str]:
    """Check structure and every checksum; returns the problems found (empty when intact).

    For a URL every file is downloaded (to a temporary directory, never from the cache, so the
    remote objects themselves are checked) and deleted after its check.
    """
    if is_url(path):
        return [redact(p) for p in _verify_remote(os.fspath(path).rstrip("/"), storage_options)]
    path = Path(path)
    try:
        manifest = read_manifest(path)
    except StoreError as e:
        return [str(e)]
    problems = []
    if MANIFEST_CHECKSUM not in manifest:
        problems.append(f"{path / MANIFEST}: no {MANIFEST_CHECKSUM} field (damaged, or edited)")
    elif (path / MANIFEST).read_bytes() != json_bytes(manifest):
        problems.append(f"{path / MANIFEST}: same fields, other bytes than tokenmill writes "
                        "(damaged, or edited)")
    for s in manifest["shards"]:
        for ext, size_key, sum_key in _files(s):
            f = path / f"{s['name']}{ext}"
            if not f.exists():
                problems.append(f"{f}: missing")
                continue
            size = f.stat().st_size
            if size != s[size_key]:
                problems.append(f"{f}: expected {s[size_key]:,} bytes, found {size:,}")
                continue
            got = xxh3_file(f)
            if got != s[sum_key]:
                problems.append(f"{f}: checksum mismatch (xxh3 {got}, manifest {s[sum_key]})")
        f = path / f"{s['name']}.idx"
        if not any(p.startswith(str(f)) for p in problems):
            problems.extend(_check_idx_structure(f, s, np.dtype(manifest["dtype"])))
        f = path / f"{s['name']}.bin"
        if not any(p.startswith(str(f)) for p in problems):
            problems.extend(_check_ids(f, manifest))
        f = path / f"{s['name']}.src"
        if s.get("src_xxh3") is not None and not any(p.startswith(str(f)) for p in problems):
            problems.extend(_check_src(f, s, manifest))
    if not problems:
        problems += _check_totals(manifest, path / MANIFEST)
    return problems


def _verify_remote(url: str, storage_options: dict | None) -> list[str]:
    try:
        manifest = read_manifest(url, storage_options=storage_options)
    except StoreError as e:
        return [str(e)]
    sizes = list_sizes(url, storage_options)
    problems = []
    with tempfile.TemporaryDirectory(prefix="tokenmill-verify-") as tmp:
        cache = ShardCache(tmp, 1 << 62, storage_options=storage_options)
        for s in manifest["shards"]:
            for ext, size_key, sum_key in _files(s):
                f = f"{url}/{s['name']}{ext}"
                got = sizes.get(f"{s['name']}{ext}")
                if got is None or got != s[size_key]:
                    problems.append(f"{f}: missing" if got is None else
                                    f"{f}: expected {s[size_key]:,} bytes, found {got:,}")
                    continue
                try:
                    local = cache.fetch(f, s[size_key], s[sum_key])
                except StoreError as e:
                    problems.append(str(e))
                    continue
                if ext == ".idx":
                    problems += [p.replace(str(local), f) for p in
                                 _check_idx_structure(local, s, np.dtype(manifest["dtype"]))]
                elif ext == ".src":
                    problems += [p.replace(str(local), f) for p in _check_src(local, s, manifest)]
                else:
                    problems += [p.replace(str(local), f) for p in _check_ids(local, manifest)]
                local.unlink()
    if not problems:
        problems += _check_totals(manifest, f"{url}/{MANIFEST}")
    return problems


def _check_totals(manifest: dict, where) -> list[str]:
    """The totals and the fingerprint agree with the shards the manifest lists."""
    got, want = manifest.get("fingerprint"), store_fingerprint(manifest)
    if got != want:
        return [(f"{where}: fingerprint {got!r}, but its tokenizer, dtype and shard checksums "
                 f"give {want!r} (damaged, or edited)")]
    total = sum(s["num_tokens"] for s in manifest["shards"])
    docs = sum(s["num_documents"] for s in manifest["shards"])
    if total != manifest["num_tokens"] or docs != manifest["num_documents"]:
        return [f"{where}: totals ({manifest['num_documents']:,} documents, "
                f"{manifest['num_tokens']:,} tokens) disagree with its shards ({docs:,}, {total:,})"]
    return []


def _check_ids(f: Path, manifest: dict) -> list[str]:
    """Every token id of a .bin below the manifest's vocab_size (a manifest that claims a
    smaller vocabulary than its ids need makes a model's embedding too small)."""
    vocab = manifest["tokenizer"]["vocab_size"]  # an int >= 1: parse_manifest checked it
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    n = os.path.getsize(f) // dtype.itemsize
    ids = np.memmap(f, dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)
    if (bad := first_outside(ids, vocab)) is not None:
        return [(f"{f}: token {bad:,} is id {int(ids[bad]):,}, not below the manifest's "
                 f"tokenizer vocab_size {vocab:,} (an edited manifest, or another tokenizer's ids)")]
    return []


def _check_src(f: Path, shard: dict, manifest: dict) -> list[str]:
    """A .src names one origin per document of its shard, each in a file the manifest lists."""
    try:
        origins = parse_src(Path(f).read_bytes(), str(f))
    except StoreError as e:
        return [str(e)]
    files = manifest.get(SOURCES)
    if len(origins.lines) != shard["num_documents"]:
        return [f"{f}: {len(origins.lines):,} origins for {shard['num_documents']:,} documents"]
    if not isinstance(files, list) or (len(origins.files) and int(origins.files.max()) >= len(files)):
        return [f"{f}: names input files that the manifest's {SOURCES!r} does not list"]
    if len(origins.lines) and int(origins.lines.min()) < 1:
        return [f"{f}: a line or row below 1"]
    return []


def _check_idx_structure(f: Path, shard: dict, dtype: np.dtype) -> list[str]:
    try:
        idx = read_idx(f)
    except StoreError as e:
        return [str(e)]
    lengths = np.asarray(idx.lengths, dtype=np.int64)
    want_ptr = np.zeros(len(lengths), np.int64)
    np.cumsum(lengths[:-1] * dtype.itemsize, out=want_ptr[1:])
    if idx.dtype != dtype:
        return [f"{f}: dtype {idx.dtype}, manifest says {dtype}"]
    if (lengths < 0).any() or int(lengths.sum()) != shard["num_tokens"]:
        return [f"{f}: sequence lengths sum to {int(lengths.sum()):,}, "
                f"manifest says {shard['num_tokens']:,} tokens"]
    if not np.array_equal(idx.pointers, want_ptr):
        return [f"{f}: sequence offsets are not contiguous"]
    if not np.array_equal(idx.doc_idx, np.arange(len(lengths) + 1)):
        return [f"{f}: document index is not 0..{len(lengths)}"]
    return []
