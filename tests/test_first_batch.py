"""Time to first batch does not grow with the store: no per-sample or per-document work when a
Loader is built, and the first batch maps only the shards it reads.

The store is sparse (files of zeros that take no disk), 1e9 tokens in 128 shards: about 488,000
samples of seq_len 2048 and 1,000,000 documents, so any O(samples) or O(documents) array at
construction would take megabytes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from conftest import write_sparse_store

from tokenmill import Loader
from tokenmill.store import TokenStore

TOKENS, SHARDS, DOC = 10**9, 128, 1000


def sparse_store(out: Path) -> Path:
    """1e9 uint16 zeros in 128 sparse shards; checksums are placeholders (opened verify='off')."""
    per = TOKENS // SHARDS
    lengths = np.full(per // DOC, DOC, np.int64)
    lengths[-1] += per - lengths.sum()
    return write_sparse_store(out, [lengths] * SHARDS)


def mapped_shards(store: Path) -> set[str]:
    """Files of ``store`` that this process has memory-mapped now (from /proc/self/maps)."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return {Path(ln.split()[-1]).name for ln in lines if str(store) in ln}


@pytest.mark.parametrize("masks", [False, True])
def test_first_batch_does_no_per_sample_or_per_document_work(tmp_path, masks):
    # in a fresh interpreter: tracemalloc's peak counts every allocation of the process, any
    # thread's, and what earlier tests left in it (make test's xdist workers run any mix of
    # tests) once added 0.5 MB to it
    path = sparse_store(tmp_path / "s")
    code = f"import test_first_batch as t; t.first_batch_checked({str(path)!r}, {masks})"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                         os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]


def first_batch_checked(path: Path, masks: bool) -> None:
    """The checks of the test above, in this process: no per-sample or per-document memory."""
    store = TokenStore(path, verify="off")
    tracemalloc.start()
    try:
        loader = Loader(store, seq_len=2048, batch_size=8, document_masks=masks)
        built, _ = tracemalloc.get_traced_memory()
        assert mapped_shards(path) == set()  # opening maps nothing
        batch = next(iter(loader))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert loader.samples_per_epoch == (TOKENS - 1) // 2048 - 1  # ~488,000 samples
    # an array per sample (8 B × 488k = 3.9 MB) or per document (8 MB) would show here; what is
    # allowed is per shard (a few KB) and one block of 4096 positions resolved at once
    assert built < 256 << 10, built
    assert peak < 1 << 20, peak  # the batch buffers (128 KB each) and one block's rounds
    assert batch["inputs"].shape == (8, 2048) and not batch["inputs"].any()
    # only the shards the first batch's 8 windows fall in are mapped (each window: one shard),
    # and with document masks their indexes (the documents a window crosses are found there)
    mapped = mapped_shards(path)
    assert 1 <= len({m for m in mapped if m.endswith(".bin")}) <= 8, mapped
    assert {m.replace(".idx", ".bin") for m in mapped if m.endswith(".idx")} == \
        ({m for m in mapped if m.endswith(".bin")} if masks else set()), mapped
    if masks:  # windows of 2,049 tokens over documents of 1,000: 3 or 4 pieces each
        assert set(batch["segment_ids"].max(axis=1).tolist()) <= {3, 4}
    loader.close()
    store.close()


class Counting:
    """A TokenStore that counts the document ids its indexes are read for."""

    def __init__(self, store: TokenStore):
        self.store, self.ids = store, 0

    def __getattr__(self, name):
        return getattr(self.store, name)

    def __len__(self):
        return len(self.store)

    def doc_spans(self, ids):
        self.ids += len(ids)
        return self.store.doc_spans(ids)


def test_packed_start_and_resume_read_a_window_s_worth_of_documents(tmp_path):
    # 10^6 documents: the packed plan reads the lengths of a bounded number of windows (K
    # documents each) to start, and again to resume deep into a later epoch — never all of them
    from tokenmill.load.packplan import PackedPlan
    path = sparse_store(tmp_path / "s")
    store = TokenStore(path, verify="off")
    counting = Counting(store)
    tracemalloc.start()
    try:
        plan = PackedPlan(counting, seq_len=2048, max_segments=None, seed=0, salt=0)
        plan.locate(np.array([0, 1, 7]))  # the first batch
        started = counting.ids
        plan.locate(np.array([plan.num_rows * 5 + plan.num_rows * 3 // 4]))  # a resume
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(store) == 999_936 and plan.k == 8393
    assert started <= 30 * plan.k and counting.ids - started <= 30 * plan.k, (started, plan.k)
    assert counting.ids < len(store) // 4
    assert peak < 32 << 20, peak  # a few windows' arrays, not 10^6 documents' (8 MB each)
    # rows are allotted from the store's tokens: the whole epoch, to the row, without packing it
    assert plan.num_rows == plan.allotted(0, plan.windows)
    store.close()
