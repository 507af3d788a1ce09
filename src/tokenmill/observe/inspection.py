"""What ``tokenmill inspect`` shows of a store: counts, length percentiles, a decoded sample."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from tokenmill.base.errors import TokenmillError
from tokenmill.base.io import atomic_write_bytes, is_url, redact
from tokenmill.load.packplan import PackedPlan
from tokenmill.prepare.split import split_line, split_of, split_sides
from tokenmill.store import TokenStore

PERCENTILES = (0, 10, 50, 90, 99, 100)
MEASURED_WINDOWS = 64  # windows inspect packs: a few seconds on any store


def length_percentiles(lengths: np.ndarray) -> dict[str, int]:
    """Tokens-per-document percentiles, keyed "p0" … "p100".

    length_percentiles(np.array([1, 2, 3]))["p50"] == 2
    """
    if len(lengths) == 0:
        return {f"p{q}": 0 for q in PERCENTILES}
    values = np.percentile(lengths, PERCENTILES, method="nearest")
    return {f"p{q}": int(v) for q, v in zip(PERCENTILES, values)}


def decoded_sample(store: TokenStore, *, max_tokens: int = 64) -> str | None:
    """The first document's opening tokens decoded, when the tokenizer file is still at hand."""
    from tokenmill.tokenizer import load_tokenizer
    spec = store.manifest.get("settings", {}).get("tokenizer", "bytes")
    try:
        tok = load_tokenizer(spec)
    except (TokenmillError, OSError):
        return None
    if tok.identity().get("file_xxh3") != store.tokenizer.get("file_xxh3"):
        return None  # a different file now sits at that path: decoding would mislead
    return tok.decode(np.asarray(store[0][:max_tokens], dtype=np.int64).tolist()) if len(store) else ""


def display_path(path: str | os.PathLike) -> str:
    """How a store's location is shown: a URL as given (credentials redacted), a local path
    normalised.

    display_path("s3://b/store/") == "s3://b/store" and display_path("a//b/") == "a/b"
    """
    if is_url(path):
        return redact(os.fspath(path).rstrip("/"))
    return str(Path(path))


def describe(path: str | os.PathLike) -> dict:
    """A JSON-able description of the store at ``path``; of a split's folder (``--val-fraction``:
    ``path/train`` and ``path/val``), ``{"path", "sides": {"train": …, "val": …}}``."""
    if paths := split_sides(path):
        return {"path": display_path(path), "sides": {k: describe(p) for k, p in paths.items()}}
    with TokenStore(path) as store:
        m = store.manifest
        disk = sum(s["bin_bytes"] + s["idx_bytes"] for s in m["shards"])
        return {
            "path": display_path(path),
            "documents": len(store),
            "tokens": store.num_tokens,
            "tokens_per_document": length_percentiles(store.doc_lengths),
            "mean_tokens_per_document": (store.num_tokens / len(store)) if len(store) else 0.0,
            "dtype": m["dtype"],
            "tokenizer": m["tokenizer"],
            "shards": len(m["shards"]),
            "disk_bytes": disk,
            "skipped": m.get("skipped", {}),
            "split": split_of(m),
            "fingerprint": m["fingerprint"],
            "sample": decoded_sample(store),
        }


def packing_quality(path: str | os.PathLike, seq_len: int, max_segments: int | None = None,
                    *, most_windows: int = MEASURED_WINDOWS) -> dict:
    """How the Loader's packed rows of seq_len + 1 tokens fit this store (seed 0, epoch 0):
    rows, padding fraction, documents longer than a row, documents cut across rows beyond
    those, the most documents in a row — measured on every window, or on ``most_windows``
    spread over the epoch (then padding and cuts are those windows' figures)."""
    with TokenStore(path) as store:
        plan = PackedPlan(store, seq_len=seq_len, max_segments=max_segments, seed=0, salt=0)
        n = plan.num_windows()
        picks = sorted({i * n // min(n, most_windows) for i in range(min(n, most_windows))})
        parts = [plan.window_rows(0, w) for w in picks]
    rows = sum(p.layout.num_rows for p in parts)
    used = sum(int(p.layout.seg_len.sum()) for p in parts)
    docs = sum(len(np.unique(p.layout.seg_doc)) for p in parts)
    return {"seq_len": seq_len, "max_segments": max_segments, "packing": plan.packing,
            "rows": plan.num_rows,
            "padding_fraction": 1 - used / (rows * (seq_len + 1)),
            "num_truncated": sum(p.layout.num_truncated for p in parts),
            "documents_cut": sum(p.num_cut for p in parts), "documents": docs,
            "most_segments": max(p.layout.most_segments for p in parts),
            "windows_measured": len(picks), "windows": n}


def format_packing(q: dict) -> str:
    """One line for ``packing_quality``'s dict."""
    cap = "" if q["max_segments"] is None else f", max_segments {q['max_segments']}"
    some = "" if q["windows_measured"] == q["windows"] else \
        f" (measured on {q['windows_measured']} of {q['windows']:,} windows)"
    return (f"packed       seq_len {q['seq_len']}{cap} ({q['packing']}): {q['rows']:,} rows, "
            f"padding {100 * q['padding_fraction']:.2f}%, {q['num_truncated']:,} documents longer "
            f"than a row, {q['documents_cut']:,} of {q['documents']:,} more cut across rows, at "
            f"most {q['most_segments']} a row{some}")


def format_description(info: dict) -> str:
    """Human-readable lines for ``describe``'s dict."""
    if "sides" in info:
        return "\n\n".join(format_description(side) for side in info["sides"].values())
    tok = info["tokenizer"]
    pct = "  ".join(f"{k} {v:,}" for k, v in info["tokens_per_document"].items())
    skipped = info["skipped"] or {}
    reasons = ", ".join(f"{k} {v:,}" for k, v in skipped.get("by_reason", {}).items())
    lines = [
        f"store        {info['path']}",
        f"documents    {info['documents']:,}",
        f"tokens       {info['tokens']:,}  (mean {info['mean_tokens_per_document']:,.1f} per document)",
        f"tokens/doc   {pct}",
        f"dtype        {info['dtype']}",
        f"tokenizer    {tok.get('kind')} {tok.get('name')}  vocab {tok.get('vocab_size'):,}  "
        f"eos {tok.get('eos_id')}  bos {tok.get('bos_id')}",
        f"shards       {info['shards']}  ({info['disk_bytes'] / 1e6:,.1f} MB on disk)",
        f"skipped      {skipped.get('total', 0):,}" + (f"  ({reasons})" if reasons else ""),
        f"fingerprint  {info['fingerprint']}",
    ]
    if info.get("split"):
        lines.insert(-1, f"split        {split_line(info['split'], info['documents'])}")
    if info["sample"] is not None:
        lines.append(f"sample       {info['sample'][:200]!r}")
    return "\n".join(lines)


def plot_lengths(path: str | os.PathLike, out_png: str | os.PathLike) -> None:
    """Write a histogram of document lengths (log-spaced bins) to a PNG."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise TokenmillError("--plot needs matplotlib: pip install 'tokenmill[plot]'") from None
    with TokenStore(path) as store:
        lengths = np.asarray(store.doc_lengths)
    fig, ax = plt.subplots(figsize=(7, 4))
    hi = max(int(lengths.max()) if len(lengths) else 1, 2)
    ax.hist(lengths, bins=np.unique(np.geomspace(1, hi, 60).astype(int)), color="#4672b4")
    ax.set_xscale("log")
    ax.set_xlabel("tokens per document")
    ax.set_ylabel("documents")
    ax.set_title(f"{Path(path).name}: {len(lengths):,} documents")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(out_png, png.getvalue())
