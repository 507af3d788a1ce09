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

This facade re-exports the names other code uses; its ``open_stream`` (``mix.open_stream``) opens
one text source, or a mixture of them.
"""

from tokenmill.streaming.mix import open_stream
from tokenmill.streaming.order import DELAY_TAG, emission_order, emission_time, emitted_before

__all__ = ["DELAY_TAG", "emission_order", "emission_time", "emitted_before", "open_stream"]
