"""tokenmill: raw text → token store → exact, resumable batches that keep accelerators fed."""

import os
import sys
import typing

from tokenmill.base.errors import (ConfigError, InputError, StaleIterator, StoreError, TokenizerError,
                                   TokenmillError)
from tokenmill.load import attention
from tokenmill.load.loader import Loader
from tokenmill.observe.metrics import Instrumented, Meter, ModelCost
from tokenmill.prepare import PrepareConfig, prepare
from tokenmill.store import TokenStore, verify_store
from tokenmill.streaming import open_stream as _open_stream
from tokenmill.tokenizer import load_tokenizer
from tokenmill.observe.watch import Watch

__version__ = "0.1.0"

# `from tokenmill.load.attention import varlen_args`, the path the guides give, names load/attention.py
sys.modules[f"{__name__}.attention"] = attention


def _from_text(inputs, *, tokenizer: str = "bytes", seq_len: int, batch_size: int,
               cache_dir: str | os.PathLike, seed: int = 0, rank: int | None = None,
               world_size: int | None = None, num_workers: int | str = "auto",
               shuffle_buffer: int | None = None, **options: typing.Any):
    """Streaming mode: batches straight from raw text, no prepare step (a StreamLoader).

    Worker processes tokenize ``inputs`` as batches are needed; the first pass is shuffled
    through a buffer of ``shuffle_buffer`` samples and cached as a store under ``cache_dir``,
    which later epochs read. ``layout="packed"`` (with ``max_segments``, ``pack_window``)
    packs documents window by window; ``inputs`` may be named sources with ``mixture=``
    phases, or ``{inputs: weight}`` (a MixedStreamLoader). Other ``options`` are
    ``prepare``'s (text_key, shard_tokens, …). See docs/streaming.md.
    """
    return _open_stream(inputs, tokenizer=tokenizer, seq_len=seq_len, batch_size=batch_size,
                        cache_dir=cache_dir, seed=seed, rank=rank, world_size=world_size,
                        num_workers=num_workers, shuffle_buffer=shuffle_buffer, **options)


# the entry point users know, wired here: streaming stands on load, so load.loader cannot import it
_from_text.__qualname__ = "Loader.from_text"
Loader.from_text = staticmethod(_from_text)

__all__ = [
    "ConfigError",
    "InputError",
    "Instrumented",
    "Loader",
    "Meter",
    "ModelCost",
    "PrepareConfig",
    "StaleIterator",
    "StoreError",
    "TokenStore",
    "TokenizerError",
    "TokenmillError",
    "Watch",
    "__version__",
    "load_tokenizer",
    "prepare",
    "verify_store",
]
