"""The loaders ``tokenmill bench`` compares: a registry of factories, each
``(store_path, seq_len, batch_size, seed) -> iterator of {"inputs", "targets"}`` batches of random
seq_len-token windows (targets shifted by one)."""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.store import TokenStore, shard_name

Factory = Callable[[str, int, int, int], Iterator[Any]]
CONTENDERS: dict[str, Factory] = {}  # name -> (store_path, seq_len, batch_size, seed) -> batches
REQUIRES: dict[str, str] = {}  # an optional peer's name -> the module it needs
NOTES: dict[str, str] = {}  # what a factory chose, e.g. pin_memory; set in the child, reported
BASELINE = "naive"
TOKENMILL_SETTINGS = {"tokenmill": {}, "tokenmill-threads2": {"num_workers": 2},
                      "tokenmill-process2": {"num_workers": 2, "worker_type": "process"}}


def contender(name: str, requires: str | None = None):
    """Register a factory under ``name``; ``requires`` names the module of an optional peer."""
    def register(fn: Factory) -> Factory:
        CONTENDERS[name] = fn
        if requires:
            REQUIRES[name] = requires
        return fn
    return register


def naive_batches(store: TokenStore, seq_len: int, batch: int, seed: int = 0) -> Iterator[dict]:
    """A synchronous loader that builds each sample in Python lists, at random token offsets."""
    rnd = random.Random(seed)
    n = store.num_tokens - seq_len - 1
    while True:
        xs, ys = [], []
        for _ in range(batch):
            s = rnd.randrange(n)
            window = store.tokens(s, s + seq_len + 1).tolist()
            xs.append(window[:-1])
            ys.append(window[1:])
        yield {"inputs": np.array(xs, dtype=np.int64), "targets": np.array(ys, dtype=np.int64)}


def nanogpt_batches(data: np.ndarray, seq_len: int, batch: int, seed: int = 0) -> Iterator[dict]:
    """nanoGPT's get_batch: random offsets into one memmap, a list of int64 slices, np.stack."""
    rng = np.random.default_rng(seed)
    while True:
        ix = rng.integers(len(data) - seq_len - 1, size=batch)
        x = np.stack([data[i:i + seq_len].astype(np.int64) for i in ix])
        y = np.stack([data[i + 1:i + 1 + seq_len].astype(np.int64) for i in ix])
        yield {"inputs": x, "targets": y}


class WindowDataset:
    """Map-style dataset: item i is the window of tokens [i·L, i·L + L] as int64 inputs/targets.

    Pickles as its path (each worker maps the store itself); also a Grain data source.
    len(WindowDataset(store, seq_len=4)) == (store.num_tokens - 1) // 4
    """

    def __init__(self, path: str | os.PathLike, seq_len: int):
        self.path, self.seq_len = str(path), seq_len
        self._store: TokenStore | None = None
        self._len = (TokenStore(path).num_tokens - 1) // seq_len

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < self._len:
            raise IndexError(f"window {i} out of range [0, {self._len})")
        if self._store is None:
            self._store = TokenStore(self.path)
        s = int(i) * self.seq_len
        window = self._store.tokens(s, s + self.seq_len + 1).astype(np.int64)
        return {"inputs": window[:-1], "targets": window[1:]}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_store": None}


@contender(BASELINE)
def _naive(path, seq_len, batch_size, seed):
    return naive_batches(TokenStore(path), seq_len, batch_size, seed)


@contender("nanogpt")
def _nanogpt(path, seq_len, batch_size, seed):
    store = TokenStore(path)  # nanoGPT reads one file: the store's largest shard
    big = max(range(store.num_shards), key=lambda i: len(store.shard(i)))
    data = np.memmap(Path(path) / f"{shard_name(big)}.bin", dtype=store.dtype, mode="r")
    NOTES["nanogpt"] = (f"one np.memmap of the largest shard ({len(data):,} of "
                        f"{store.num_tokens:,} tokens), as nanoGPT's get_batch reads train.bin")
    return nanogpt_batches(data, seq_len, batch_size, seed)


def _tokenmill(name, path, seq_len, batch_size, seed):
    from tokenmill.load.loader import Loader
    settings = TOKENMILL_SETTINGS[name]
    NOTES[name] = f"Loader({', '.join(f'{k}={v!r}' for k, v in settings.items()) or 'defaults'})"
    with Loader(path, seq_len=seq_len, batch_size=batch_size, seed=seed, rank=0, world_size=1,
                **settings) as loader:
        yield from loader


for _name in TOKENMILL_SETTINGS:
    contender(_name)(functools.partial(_tokenmill, _name))


@contender("torch-dataloader", requires="torch")
def _torch_dataloader(path, seq_len, batch_size, seed):
    import torch
    pin = torch.cuda.is_available()
    NOTES["torch-dataloader"] = (f"shuffle, 2 worker processes, persistent; pin_memory "
                                 f"{'on' if pin else 'off (no CUDA: it would only cost time)'}")
    loader = torch.utils.data.DataLoader(
        WindowDataset(path, seq_len), batch_size=batch_size, shuffle=True, num_workers=2,
        pin_memory=pin, persistent_workers=True, generator=torch.Generator().manual_seed(seed))
    while True:  # epoch after epoch, as a training loop would
        yield from loader


@contender("grain", requires="grain")
def _grain(path, seq_len, batch_size, seed):
    import grain
    from absl import flags
    if not flags.FLAGS.is_parsed():  # mp_prefetch reads absl flags; nothing parsed them
        flags.FLAGS.mark_as_parsed()
    NOTES["grain"] = ("MapDataset(WindowDataset) shuffle + batch, mp_prefetch, 2 worker "
                      "processes: the same windows torch's DataLoader reads")
    it = iter(grain.MapDataset.source(WindowDataset(path, seq_len)).shuffle(seed=seed)
              .repeat(None).batch(batch_size).to_iter_dataset()
              .mp_prefetch(grain.MultiprocessingOptions(num_workers=2)))
    try:
        yield from it
    finally:
        it.close()
