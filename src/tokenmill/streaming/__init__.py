"""Streaming mode: raw text is tokenized inside the loader's workers and cached as a store.

    loader = Loader.from_text(["data/*.jsonl.zst"], tokenizer="tokenizer.json", seq_len=2048,
                              batch_size=8, cache_dir="cache/")
    for batch in loader: ...     # {"inputs", "targets"}: int32 (8, 2048); state_dict() resumes

One job per module (docs/streaming.md tells the whole story):

- ``plan``: what a pass depends on (``StreamPlan``, its fingerprint) and the ``Cursor``;
- ``order``: the shuffle buffer's emission order, pure functions of (seed, S, k);
- ``units``: the work units tokenized by worker processes, in unit order;
- ``cache``: the cache store written while streaming (one writer, resumable);
- ``windows``: the ``WindowSource`` protocol and its two sources, the text and the store;
- ``producer``: the thread that assembles this rank's batches (typed messages);
- ``rows``: packed rows, documents packed window by window (``PackedText``, ``StoreRows``);
- ``loader``: ``StreamLoader``, its state and resume;
- ``mix``: ``MixedStreamLoader``, a mixture of text sources (each a ``StreamLoader``).

This facade re-exports the names other code used from ``tokenmill.stream``; its ``open_stream``
is ``mix.open_text``: one text source, or a mixture of them.
"""

from tokenmill.streaming.cache import WAIT_WARNING_S
from tokenmill.streaming.loader import StreamLoader
from tokenmill.streaming.mix import MixedStreamLoader
from tokenmill.streaming.mix import open_text as open_stream
from tokenmill.streaming.order import (DELAY_TAG, emission_order, emission_time, emitted_before,
                                       window_delays)
from tokenmill.streaming.plan import DEFAULT_SHUFFLE_BUFFER, STATE_VERSION, Cursor, StreamPlan
from tokenmill.streaming.producer import READY_BATCHES
from tokenmill.streaming.windows import WindowSource

__all__ = [
    "Cursor", "DEFAULT_SHUFFLE_BUFFER", "DELAY_TAG", "MixedStreamLoader", "READY_BATCHES",
    "STATE_VERSION", "StreamLoader", "StreamPlan", "WAIT_WARNING_S", "WindowSource",
    "emission_order", "emission_time", "emitted_before", "open_stream", "window_delays",
]
