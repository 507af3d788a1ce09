"""A store's shards as export reads them, every byte checked: each shard's ``.bin`` (and a local
``.idx``) against the manifest's xxh3, and every token id below the manifest's ``vocab_size`` — a
manifest edited to claim a smaller vocabulary (its checksum recomputed) would otherwise give
nanoGPT a ``meta.pkl`` whose embedding is too small for the ids beside it.

    for part in nanogpt_chunks(store, 4 << 20): f.write(part.data)   # train.bin's bytes
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import xxhash

from tokenmill.base.arrays import first_outside
from tokenmill.base.errors import StoreError
from tokenmill.base.io import is_url, redact, xxh3_file
from tokenmill.store import TokenStore

__all__ = ["nanogpt_chunks", "verified_shard"]

_NANOGPT_VOCAB = 1 << 16  # nanoGPT's train.py reads np.uint16 ids


def verified_shard(s: TokenStore, k: int) -> np.ndarray:
    """Shard ``k``'s tokens after checking its ``.bin`` (and a local ``.idx``) against the
    manifest's xxh3 — export reads every byte anyway; a StoreError names a changed file."""
    entry, tokens = s.manifest["shards"][k], s.shard(k)
    where = f"{redact(str(s.path))}/{entry['name']}"
    got = xxhash.xxh3_64_hexdigest(memoryview(np.ascontiguousarray(tokens)).cast("B"))
    if got != entry["bin_xxh3"]:
        raise StoreError(f"{where}.bin: checksum mismatch (xxh3 {got}, the manifest records "
                         f"{entry['bin_xxh3']}): the shard changed after prepare, nothing was "
                         "exported — run 'tokenmill verify', then 'tokenmill prepare' again")
    if not is_url(s.path) and (got := xxh3_file(f"{s.path}/{entry['name']}.idx")) != entry["idx_xxh3"]:
        raise StoreError(f"{where}.idx: checksum mismatch (xxh3 {got}, the manifest records "
                         f"{entry['idx_xxh3']}): the index changed after prepare, nothing was "
                         "exported — run 'tokenmill verify', then 'tokenmill prepare' again")
    return tokens


def nanogpt_chunks(s: TokenStore, size: int) -> Iterator[np.ndarray]:
    """The store's tokens in store order as little-endian uint16 chunks of ``size`` ids, each
    shard verified and every id checked below the manifest's vocab_size (and 65,536)."""
    vocab = s.tokenizer.get("vocab_size")
    if s.dtype != np.uint16 and not (type(vocab) is int and vocab <= _NANOGPT_VOCAB):
        raise StoreError(f"{s.path}: holds {s.dtype} tokens (vocab_size {vocab}); nanoGPT's reader "
                         "takes uint16 ids (< 65,536) — export --format jsonl instead, or prepare "
                         "with a tokenizer of at most 65,536 ids")
    stop = min(vocab, _NANOGPT_VOCAB) if type(vocab) is int else _NANOGPT_VOCAB
    for k in range(s.num_shards):
        tokens = verified_shard(s, k)
        for start in range(0, len(tokens), size):
            part = tokens[start:start + size]
            if (bad := first_outside(part, stop)) is not None:
                raise StoreError(_past_vocab(s, k, start + bad, int(part[bad]), vocab))
            yield part.astype("<u2", copy=False)


def _past_vocab(s: TokenStore, k: int, pos: int, value: int, vocab) -> str:
    """The error for an id at or past the vocabulary the manifest records."""
    name = s.manifest["shards"][k]["name"]
    return (f"{redact(str(s.path))}/{name}.bin: token {pos:,} is id {value:,}, not below the "
            f"manifest's vocab_size {vocab}: the store breaks its own vocab_size (an edited "
            "manifest, or another tokenizer's ids); nothing was exported — run 'tokenmill verify'")
