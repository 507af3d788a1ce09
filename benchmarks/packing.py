"""Packing quality and speed: tokenmill's packer vs Grain's best-fit and first-fit.

One real store (paragraphs of the Python standard library's sources and docs, bytes tokenizer,
made by ``tokenmill prepare`` on first use), one row capacity (seq_len + 1 tokens). Every packer
gets the same items: the segments tokenmill places (whole documents, and documents longer than a
row cut into row-sized pieces, which Grain would otherwise truncate), in document order.
Reported: padding % of the rows, and build seconds per 1M documents of the store (tokenmill:
``pack.pack_documents``, the whole layout, best of 3; Grain: iterating ``BestFitPackIterDataset``
/ ``FirstFitPackIterDataset`` over an in-memory ``MapDataset`` of numpy arrays to the end), with
no cap and with ``max_segments`` (Grain's ``max_sequences_per_bin``).

    .venv/bin/python benchmarks/packing.py                 # prints a markdown table
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

from tokenmill import TokenStore, prepare
from tokenmill.load import pack


def stdlib_paragraphs(limit_docs: int) -> list[str]:
    """Paragraphs (split at blank lines) of the stdlib's .py sources and .txt/.rst docs, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[str] = []
    for path in sorted(p for ext in ("*.py", "*.txt", "*.rst") for p in root.rglob(ext)):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.extend(p for p in text.split("\n\n") if p.strip())
        if len(out) >= limit_docs:
            break
    return out[:limit_docs]


def make_store(where: Path, docs: int) -> Path:
    """The benchmark's store, prepared once (bytes tokenizer: one token per byte)."""
    store = where / f"stdlib-paragraphs-{docs}"
    if (store / "manifest.json").exists():
        return store
    where.mkdir(parents=True, exist_ok=True)
    src = where / f"stdlib-paragraphs-{docs}.jsonl"
    with open(src, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in stdlib_paragraphs(docs))
    prepare(str(src), out=store, tokenizer="bytes", workers="auto", progress=False)
    return store


def tokenmill_row(lengths: np.ndarray, seq_len: int, max_segments: int | None) -> dict:
    """Pack with tokenmill (best of 3 build times)."""
    times = []
    for _ in range(3):
        t = time.perf_counter()
        layout = pack.pack_documents(lengths, seq_len, max_segments)
        times.append(time.perf_counter() - t)
    return {"rows": layout.num_rows, "padding": layout.padding_fraction, "seconds": min(times),
            "items": len(layout.seg_len), "layout": layout}


def grain_row(kind: str, seg_lens: np.ndarray, seq_len: int, bins: int,
              max_segments: int | None) -> dict:
    """Pack the same items with Grain's packer ``kind`` and count the padding it leaves."""
    import grain
    import grain.experimental as ge
    capacity = seq_len + 1
    base = np.arange(capacity, dtype=np.int32) + 1  # token ids ≠ 0; a view per item, no copies
    items = [{"tokens": base[:n]} for n in seg_lens.tolist()]
    ds = grain.MapDataset.source(items).to_iter_dataset()
    packer = getattr(ge, kind)(ds, length_struct={"tokens": capacity}, num_packing_bins=bins,
                               shuffle_bins=False, max_sequences_per_bin=max_segments)
    t = time.perf_counter()
    rows = used = 0
    for row in packer:
        rows += 1
        used += int(np.count_nonzero(row["tokens_segment_ids"]))
    seconds = time.perf_counter() - t
    assert used == int(seg_lens.sum()), (used, int(seg_lens.sum()))  # every token placed once
    return {"rows": rows, "padding": 1 - used / (rows * capacity), "seconds": seconds,
            "items": len(seg_lens)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(Path(tempfile.gettempdir()) / "tokenmill-bench"))
    ap.add_argument("--docs", type=int, default=200_000, help="paragraphs in the store")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--bins", type=int, nargs="+", default=[64, 1024],
                    help="Grain num_packing_bins settings to run")
    ap.add_argument("--max-segments", nargs="+", default=["none", "8"],
                    help="caps on documents per row to run ('none': no cap)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import grain
    store_path = make_store(Path(args.data), args.docs)
    with TokenStore(store_path) as store:
        lengths = np.asarray(store.doc_lengths, dtype=np.int64)
    results = {}
    for cap in [None if c == "none" else int(c) for c in args.max_segments]:
        ours = tokenmill_row(lengths, args.seq_len, cap)
        layout = ours.pop("layout")
        order = np.lexsort((layout.seg_start, layout.seg_doc))  # document order, as a stream
        seg_lens = layout.seg_len[order]
        name = "best-fit decreasing" if cap is None else "fair fill under the cap"
        results[(f"tokenmill {name} (whole store)", cap)] = ours
        for bins in args.bins:
            for kind in ("BestFitPackIterDataset", "FirstFitPackIterDataset"):
                results[(f"grain {kind} (num_packing_bins={bins})", cap)] = grain_row(
                    kind, seg_lens, args.seq_len, bins, cap)
    print(f"store: {store_path} — {len(lengths):,} documents, {int(lengths.sum()):,} tokens, "
          f"mean {lengths.mean():.0f} tokens/doc, {len(seg_lens):,} items to place; "
          f"seq_len={args.seq_len}; grain {grain.__version__}\n")
    print("| packer | max_segments | rows | padding % | build s per 1M documents |")
    print("|---|---:|---:|---:|---:|")
    for (name, cap), r in results.items():
        print(f"| {name} | {cap or '—'} | {r['rows']:,} | {100 * r['padding']:.3f} | "
              f"{r['seconds'] * 1e6 / len(lengths):.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{"packer": n, "max_segments": c, **r} for (n, c), r in results.items()], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
