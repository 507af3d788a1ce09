"""The packed and concat layouts at scale: start, resume, memory, shuffle spread, packing quality.

    python benchmarks/scale.py start --dir /tmp/scale8 --docs 1e8 --shards 800
    python benchmarks/scale.py shuffle --dir /tmp/scale1k --docs 1e6 --shards 1000
    python benchmarks/scale.py quality --store STORE [--seq-len 2048 8192]

``start``: a sparse store (files of zeros that take no disk; the ``.idx`` files are real:
lognormal document lengths, median 600 tokens, as web text) of ``--docs`` documents in
``--shards`` shards, made once under ``--dir`` and reused, then made read-only. For each layout,
fresh processes (imports excluded from the time, as in a training script that imported
tokenmill already) build ``Loader(store, seq_len=2048, batch_size=8)``, load a state at step 0,
the middle or the end of epoch 0, and take one batch; reported: milliseconds (median of
``--repeats``), and the peak RSS of the process beyond the interpreter with numpy imported.

``shuffle``: distinct shards a global batch of 512 rows draws from, per layout (median over 20
global batches spread over the epoch).

``quality``: on a real store's document lengths, the packed layout's padding and documents cut
across rows against packing the whole store at once by best-fit decreasing (the layout before
the lazy plan), for each seq_len, with and without ``--max-segments``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SEQ_LEN, BATCH = 2048, 8


def vm(key: str) -> int:
    """This process's /proc/self/status figure ``key`` (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def make_store(out: Path, *, docs: int, shards: int, seed: int = 0) -> Path:
    """A valid store of ``docs`` sparse documents (lognormal lengths) in ``shards`` shards."""
    from tokenmill.base.io import atomic_write_json
    from tokenmill.store import ShardInfo, build_manifest, idx_bytes, shard_name
    if (out / "manifest.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    rng, infos = np.random.default_rng(seed), []
    for i in range(shards):
        n = docs // shards + (i < docs % shards)
        lengths = np.clip(rng.lognormal(np.log(600), 1.0, n), 1, 60_000).astype(np.int64)
        name, tokens = shard_name(i), int(lengths.sum())
        with open(out / f"{name}.bin", "wb") as f:
            f.truncate(2 * tokens)  # sparse: no blocks written
        (out / f"{name}.idx").write_bytes(idx_bytes(lengths, np.uint16))
        infos.append(ShardInfo(name, n, tokens, 2 * tokens, (out / f"{name}.idx").stat().st_size,
                               f"{i:016x}", f"{i:016x}"))  # placeholders: opened verify="off"
        if i % 50 == 0:
            print(f"  shard {i + 1}/{shards}", file=sys.stderr, flush=True)
    manifest = build_manifest(tokenizer={"kind": "sparse-bench", "vocab_size": 65000},
                              dtype=np.uint16, shards=infos, settings={}, skipped={"total": 0})
    atomic_write_json(out / "manifest.json", manifest)
    return out


def child(store: str, layout: str, where: str) -> dict:
    """In a fresh process: a Loader, a state loaded at ``where`` of epoch 0, one batch."""
    base = vm("VmRSS")  # the interpreter with numpy imported
    t0 = time.perf_counter()
    from tokenmill import Loader, TokenStore
    imported = time.perf_counter()
    loader = Loader(TokenStore(store, verify="off"), seq_len=SEQ_LEN, batch_size=BATCH,
                    layout=layout, num_workers=0)
    n = loader.samples_per_epoch
    at = {"start": 0, "middle": n // 2 // BATCH * BATCH, "end": (n - BATCH) // BATCH * BATCH}[where]
    loader.load_state_dict({**loader.state_dict(), "consumed_samples": at})
    batch = next(iter(loader))
    done = time.perf_counter()
    assert batch["inputs"].shape == (BATCH, SEQ_LEN)
    loader.close()
    return {"ms": (done - imported) * 1e3, "import_ms": (imported - t0) * 1e3,
            "rss_mb": (vm("VmHWM") - base) / 2**20, "samples_per_epoch": n}


def start(args) -> None:
    store = make_store(Path(args.dir), docs=int(args.docs), shards=args.shards)
    store.chmod(0o555)  # nothing may be written into the store's folder
    m = json.loads((store / "manifest.json").read_text())
    print(f"store {store}: {m['num_documents']:,} documents, {m['num_tokens']:,} tokens, "
          f"{len(m['shards'])} shards (read-only)")
    print("layout  where    first batch ms (median; runs)           RSS MB beyond numpy")
    for layout in args.layouts:
        for where in ("start", "middle", "end"):
            runs = [json.loads(subprocess.run(
                [sys.executable, "-c", "import numpy, json, sys; sys.path.insert(0, sys.argv[1]);"
                 " import scale; print(json.dumps(scale.child(*sys.argv[2:])))",
                 str(Path(__file__).parent), str(store), layout, where],
                capture_output=True, text=True, check=True).stdout.splitlines()[-1])
                for _ in range(args.repeats)]
            ms, rss = [r["ms"] for r in runs], [r["rss_mb"] for r in runs]
            print(f"{layout:7} {where:7} {statistics.median(ms):9.1f}  "
                  f"({', '.join(f'{v:.0f}' for v in ms)})   {statistics.median(rss):8.1f}",
                  flush=True)
    print(f"files in the store now: {len(list(store.iterdir()))} (were {2 * len(m['shards']) + 1})")


def shuffle(args) -> None:
    from tokenmill import Loader, TokenStore
    store = make_store(Path(args.dir), docs=int(args.docs), shards=args.shards)
    ts = TokenStore(store, verify="off")
    for layout in args.layouts:
        loader = Loader(ts, seq_len=SEQ_LEN, batch_size=512, layout=layout, num_workers=0)
        src, n = loader.plan.sources[0], loader.samples_per_epoch
        counts = []
        for k in np.linspace(0, n - 512, 20).astype(np.int64).tolist():
            _, addrs = loader.plan.resolve(np.arange(k, k + 512, dtype=np.int64))
            if src.packed is None:
                tokens = np.concatenate([addrs, addrs + SEQ_LEN])
            else:
                tokens = np.concatenate([w.layout.seg_start[w.layout.row_ptr[r]:
                                                             w.layout.row_ptr[r + 1]]
                                         for w, _, rows in src.packed.locate(addrs)
                                         for r in rows.tolist()])
            shards = np.searchsorted(ts.shard_token_starts, tokens, side="right") - 1
            counts.append(len(np.unique(shards)))
        print(f"{layout:7} distinct shards per global batch of 512 rows: median "
              f"{statistics.median(counts):.0f} of {ts.num_shards} (min {min(counts)}, "
              f"max {max(counts)})", flush=True)


def quality(args) -> None:
    from tokenmill import TokenStore
    from tokenmill.load import pack
    from tokenmill.load.packplan import PackedPlan, epoch_layout
    with TokenStore(args.store) as ts:
        lengths = np.asarray(ts.doc_lengths)
        print(f"store {args.store}: {len(ts):,} documents, {ts.num_tokens:,} tokens, median "
              f"{int(np.median(lengths))} tokens a document")
        print("seq_len  cap   whole-store padding  lazy padding  Δ pp   cut beyond long docs  "
              "windows  s (whole / lazy)")
        for L in args.seq_len:
            for cap in args.max_segments:
                t0 = time.perf_counter()
                whole = pack.pack_documents(lengths, L, cap)
                t1 = time.perf_counter()
                plan = PackedPlan(ts, seq_len=L, max_segments=cap, seed=0, salt=0)
                lazy = epoch_layout(plan, 0)
                t2 = time.perf_counter()
                cut = sum(plan.window_rows(0, w).num_cut for w in range(plan.num_windows()))
                print(f"{L:7} {cap or '-':>4} {100 * whole.padding_fraction:18.3f}% "
                      f"{100 * lazy.padding_fraction:12.3f}% {100 * (lazy.padding_fraction - whole.padding_fraction):+6.3f}"
                      f"  {cut:,} of {len(lengths):,} ({100 * cut / len(lengths):.3f}%)  "
                      f"{plan.num_windows():7}  {t1 - t0:.1f} / {t2 - t1:.1f}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    for name in ("start", "shuffle"):
        p = sub.add_parser(name)
        p.add_argument("--dir", required=True, help="where the sparse store is made (or reused)")
        p.add_argument("--docs", type=float, default=1e7)
        p.add_argument("--shards", type=int, default=100)
        p.add_argument("--layouts", nargs="+", default=["concat", "packed"])
        p.add_argument("--repeats", type=int, default=3)
    q = sub.add_parser("quality")
    q.add_argument("--store", required=True)
    q.add_argument("--seq-len", type=int, nargs="+", default=[2048, 8192])
    q.add_argument("--max-segments", type=lambda v: None if v == "none" else int(v), nargs="+",
                   default=[None])
    args = ap.parse_args(argv)
    print(f"$ python benchmarks/scale.py {' '.join(argv or sys.argv[1:])}")
    {"start": start, "shuffle": shuffle, "quality": quality}[args.what](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
