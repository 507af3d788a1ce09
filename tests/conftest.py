"""Shared fixtures: small real-text corpora and helpers to compare stores byte for byte."""

import json
import os
import sysconfig
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def stdlib_texts(limit_bytes: int, pattern: str = "*.py") -> list[str]:
    """Real text: the Python standard library's own sources, in sorted order, up to a size."""
    texts, total = [], 0
    for p in sorted(STDLIB.glob(pattern)):
        try:
            t = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not t:
            continue
        texts.append(t)
        total += len(t)
        if total >= limit_bytes:
            break
    return texts


def write_jsonl(path: Path, texts) -> Path:
    """One {"text": …} object per line."""
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return path


def store_bytes(path: Path) -> dict[str, bytes]:
    """Every file of a store (hidden ones too), by name: equal dicts mean byte-identical stores."""
    return {p.name: p.read_bytes() for p in sorted(Path(path).iterdir()) if p.is_file()}


@pytest.fixture(scope="session")
def real_texts() -> list[str]:
    """About 1.5 MB of real text (stdlib sources)."""
    return stdlib_texts(1_500_000)


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory, real_texts) -> str:
    """A byte-level BPE tokenizer.json (vocab 2,000) trained on real text, path as a string."""
    from tokenmill.tokenizer import train_bpe
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return str(train_bpe(real_texts[:200], 2000, out_path=out))


def write_positional_store(path: Path, lengths, *, shard_tokens: int = 1 << 30, offset: int = 0):
    """A store (int32) whose token at global position p is offset + p: any reorder, drop or
    duplicate of tokens shows up as a broken arithmetic sequence."""
    import numpy as np
    from tokenmill.store import ShardWriter, atomic_write_json, build_manifest
    path.mkdir(parents=True, exist_ok=True)
    lengths = np.asarray(lengths, dtype=np.int64)
    tokens = np.arange(offset, offset + int(lengths.sum()), dtype=np.int32)
    w = ShardWriter(path, dtype=np.int32, shard_tokens=shard_tokens)
    shards = [info for info, _ in w.add(tokens, lengths)]
    if (last := w.finish()) is not None:
        shards.append(last)
    manifest = build_manifest(tokenizer={"kind": "positional", "offset": offset,
                                         "vocab_size": 1 << 31}, dtype=np.int32, shards=shards,
                              settings={}, skipped={"total": 0})
    atomic_write_json(path / "manifest.json", manifest)
    return path
