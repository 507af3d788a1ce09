"""Shared fixtures and helpers: small real-text corpora, self-describing stores, comparing stores
byte for byte, and taking, comparing and resuming batch streams (every test uses these, none
keeps its own copy)."""

import itertools
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
    # one "tokenizer" for every offset: positional stores may be mixed
    manifest = build_manifest(tokenizer={"kind": "positional", "vocab_size": 1 << 31},
                              dtype=np.int32, shards=shards,
                              settings={}, skipped={"total": 0})
    atomic_write_json(path / "manifest.json", manifest)
    return path


def docs_of(path) -> list[list[int]]:
    """Every document of the store at ``path``, as lists of token ids."""
    from tokenmill.store import TokenStore
    with TokenStore(path) as s:
        return [s[i].tolist() for i in range(len(s))]


# ---- batch streams ----------------------------------------------------------------------------

def take(batches, n: int | None = None) -> list[dict]:
    """The next ``n`` batches (all, if None) of an iterable, every array copied to numpy: a loader
    may reuse its buffers once we let go of a batch (torch/jax arrays are copied too)."""
    return [{k: _numpy_copy(v) for k, v in b.items()} for b in itertools.islice(batches, n)]


def _numpy_copy(a):
    import numpy as np
    return np.array(a.numpy() if hasattr(a, "numpy") else a)  # torch: .numpy() (CPU) first


def same(got: list[dict], want: list[dict]) -> bool:
    """Equal lists of batches: the same keys and exactly equal arrays, batch by batch."""
    import numpy as np
    return len(got) == len(want) and all(
        g.keys() == w.keys() and all(np.array_equal(np.asarray(g[k]), np.asarray(w[k])) for k in w)
        for g, w in zip(got, want))


def assert_resumes_exactly(make, steps: int) -> None:
    """Resume at every step k from a JSON round trip of the state, in a fresh loader from
    ``make()``: the tail equals the uninterrupted run's. Used for every stateful thing."""
    with make() as ref_loader:
        ref = take(ref_loader, steps)
    for k in range(steps + 1):
        with make() as a:
            take(a, k)
            state = json.loads(json.dumps(a.state_dict()))
        with make() as b:
            b.load_state_dict(state)
            assert same(take(b, steps - k), ref[k:]), f"resume at step {k} diverged"


def assert_worker_death_is_an_error(batches, workers, *, budget: int = 100_000):
    """SIGKILL the worker processes ``workers`` (psutil); the iterator ``batches`` then raises a
    RuntimeError saying a worker died — never a hang, never a quiet end — within 10 s."""
    import signal
    import time

    import pytest
    for w in workers:
        w.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="died") as e:
        for _ in range(budget):
            next(batches)
    assert time.monotonic() - t0 < 10
    return e.value
