"""Grain: a tokenmill store as a random-access data source, so Grain pipelines can read it.

    ds = (grain.MapDataset.source(source("store/", seq_len=2048))
          .shuffle(seed=0).repeat(None).batch(8)
          .to_iter_dataset().mp_prefetch(grain.multiprocessing.MultiprocessingOptions(2)))

Record i is **raw sample i** of the store's layout, in store order — not sample i of a tokenmill
epoch — so Grain's own ``shuffle`` decides the order and Grain's checkpoints decide resume:
``concat`` record i is the window of seq_len + 1 tokens starting at token i·seq_len (the windows
do not move between epochs as tokenmill's Loader moves them); ``packed`` record i is packed row
i. A record is a dict of int arrays of shape (seq_len,): ``inputs``, ``targets`` and for packed
rows ``segment_ids``, ``positions``, ``loss_mask`` — the Loader's batch rows, one at a time.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from tokenmill.load import pack
from tokenmill.base.errors import ConfigError
from tokenmill.load.plan import BatchPlan, LayoutConfig, SampleSource
from tokenmill.store import TokenStore

__all__ = ["TokenSource", "source"]


def source(store: str | os.PathLike, seq_len: int, *, layout: str = "concat",
           dtype: str = "int32") -> TokenSource:
    """A Grain ``RandomAccessDataSource`` over the raw samples of ``store`` in ``layout``.

    len(source(store, seq_len=4)) == (num_tokens - 4) // 4      # concat windows
    """
    _mark_absl_flags_parsed()
    return TokenSource(store, seq_len, layout=layout, dtype=dtype)


def _mark_absl_flags_parsed() -> None:
    """Grain 0.2.18's ``mp_prefetch`` reads its absl flags in the parent process, which raises
    UnparsedFlagAccessError unless the program ran ``absl.app``; mark them parsed (defaults
    kept) when nothing has parsed them."""
    from absl import flags
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class TokenSource:
    """Raw samples of one store as records; picklable (each process maps the store itself)."""

    def __init__(self, store: str | os.PathLike, seq_len: int, *, layout: str = "concat",
                 dtype: str = "int32"):
        if np.dtype(dtype) not in (np.dtype(np.int32), np.dtype(np.int64)):
            raise ConfigError(f"dtype must be 'int32' or 'int64' (got dtype={dtype!r})")
        # a str, not a Path: Path() would turn "s3://b/store" into "s3:/b/store"
        self.path = str(store.path if isinstance(store, TokenStore) else os.fspath(store))
        self.config = LayoutConfig(seq_len=seq_len, layout=layout)
        self.dtype = np.dtype(dtype).name
        store = store if isinstance(store, TokenStore) else TokenStore(self.path)
        self._sample_source = SampleSource(store, self.config, salt=0)
        self._plan = BatchPlan([self._sample_source], [1.0], np.dtype(self.dtype))

    def __len__(self) -> int:
        return self._sample_source.num_samples

    def __repr__(self) -> str:  # Grain keys checkpoints on it: name everything that shapes records
        return (f"TokenSource({str(self.path)!r}, seq_len={self.config.seq_len}, "
                f"layout={self.config.layout!r}, dtype={self.dtype!r}, "
                f"fingerprint={self._sample_source.store.fingerprint!r})")

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return self._getitems([index])[0]

    def _getitems(self, indices: Sequence[int]) -> list[dict[str, np.ndarray]]:
        """Records ``indices`` filled in one pass (Grain's batched read)."""
        ids = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        if ids.size and (ids.min() < -n or ids.max() >= n):
            raise IndexError(f"record index out of range [0, {n}) (got {indices!r})")
        ids %= n
        addrs = ids if self._plan.packed else pack.concat_starts(ids, seq_len=self.config.seq_len,
                                                                 offset=0)
        out = self._plan.new_buffers(len(ids))
        self._sample_source.fill(addrs, np.arange(len(ids)), out)
        return [{k: v[j] for k, v in out.items()} for j in range(len(ids))]

    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self.path), "seq_len": self.config.seq_len,
                "layout": self.config.layout, "dtype": self.dtype}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["seq_len"], layout=state["layout"],
                      dtype=state["dtype"])
