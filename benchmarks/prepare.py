"""Benchmark `tokenmill prepare` (--workers auto and 2) against raw fastokens, tokenizers, tiktoken.

python benchmarks/prepare.py [--corpus PATH] [--tokenizer FILE] [--mb N] [--repeats K]
                             [--work DIR] [--engines NAMES] [--json OUT]

One run, same texts: each raw engine encodes the corpus's documents already in memory (no I/O;
each in its own fresh process, so no run starts with caches another run warmed), then `tokenmill prepare`
runs end to end in a fresh process (start-up, JSON reading, tokenizing, cross-process transfer,
writing, checksums, manifest), with --workers 2 and with the default --workers auto (in-process
when the engine spreads itself over every core, as fastokens does; the targets are checked on
that default). Ratios are taken within the run. The two stores must be byte-identical. The store is then read back and
compared token for token with `tokenizers`' ids (EOS after each document).

Targets (issue 13), 2 workers on 2 cores: prepare >= 0.8 x raw fastokens encode_batch,
>= 10 x raw tokenizers encode_batch; store identical to tokenizers; peak RSS < 1 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil

from tokenmill.store import TokenStore
from tokenmill.tokenizer import load_tokenizer, train_bpe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import build_corpus

BENCH = Path(__file__).resolve().parent.parent / "bench-data"
VOCAB, TRAIN_MB, WORKERS = 32_000, 20, 2
CHUNK_DOCS = 1_000  # documents per encode_batch call
RSS_LIMIT = 1 << 30
RAW = ("fastokens", "fastokens_batch", "tiktoken", "tokenizers")


def machine() -> dict:
    """Usable cores, CPU model, load average and engine versions of this machine."""
    from importlib.metadata import version
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((l.split(":", 1)[1].strip() for l in cpuinfo if l.startswith("model name")), "?")
    return {"cores": len(os.sched_getaffinity(0)), "cpu": model, "loadavg": loadavg(),
            "versions": {p: version(p) for p in ("fastokens", "tokenizers", "tiktoken")}}


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def corpus_prefix(corpus: Path, mb: float | None) -> Path:
    """The corpus itself, or a scratch copy of its first `mb` MB of whole lines."""
    if mb is None:
        return corpus
    out = BENCH / f"{corpus.stem}.first{mb:g}mb.jsonl"
    if not out.exists():
        size, tmp = 0, out.with_suffix(".tmp")
        with open(corpus, "rb") as src, open(tmp, "wb") as dst:
            for line in src:
                if (size := size + len(line)) > mb * 1e6:
                    break
                dst.write(line)
        tmp.replace(out)
    return out


def read_texts(path: Path) -> list[str]:
    """Every document's text, in file order."""
    with open(path, "rb") as f:
        return [json.loads(line)["text"] for line in f]


def trained_tokenizer(corpus: Path) -> Path:
    """A 32k byte-level BPE trained on every k-th document (~20 MB) of the corpus; cached."""
    path = BENCH / f"bpe32k-{corpus.stem}.json"
    if path.exists():
        return path
    stride = max(1, round(corpus.stat().st_size / (TRAIN_MB * 1e6)))
    with open(corpus, "rb") as f:
        texts = [json.loads(line)["text"] for i, line in enumerate(f) if i % stride == 0]
    t0 = time.perf_counter()
    train_bpe(texts, VOCAB, out_path=path)
    mb = sum(len(t.encode()) for t in texts) / 1e6
    print(f"trained {path.name} on {mb:.1f} MB in {time.perf_counter() - t0:.0f} s")
    return path


def chunks(texts: list[str]):
    """The texts, CHUNK_DOCS at a time."""
    return (texts[i:i + CHUNK_DOCS] for i in range(0, len(texts), CHUNK_DOCS))


def timed(encode, texts: list[str]) -> dict:
    """Seconds spent in `encode(chunk)` over all chunks (only the call is timed), the tokens, and
    the ids as one flat uint32 array with per-document lengths (built outside the timing)."""
    seconds, flats, lengths = 0.0, [], []
    for chunk in chunks(texts):
        t0 = time.perf_counter()
        out = encode(chunk)
        seconds += time.perf_counter() - t0
        docs = out if isinstance(out, list) else split_flat(*out)
        flats += [np.asarray(d, np.uint32) for d in docs]
        lengths += [len(d) for d in docs]
    flat = np.concatenate(flats) if flats else np.zeros(0, np.uint32)
    return {"seconds": seconds, "tokens": len(flat), "ids": flat, "lengths": np.array(lengths)}


def split_flat(flat: bytes, offsets: bytes) -> list[np.ndarray]:
    """fastokens' encode_batch_flat result as one array per document."""
    ends = np.frombuffer(offsets, "<u8").astype(np.intp)
    return np.split(np.frombuffer(flat, "<u4"), ends[1:-1])


def raw_engines(tok_path: Path) -> dict:
    """name -> (label, function making a fresh encode(chunk) callable)."""
    import fastokens
    from tokenizers import Tokenizer

    def hf():
        t = Tokenizer.from_file(str(tok_path))
        return lambda chunk: [e.ids for e in t.encode_batch(chunk, add_special_tokens=False)]

    def fast_flat():
        t = fastokens.Tokenizer.from_file(str(tok_path))
        return lambda chunk: t.encode_batch_flat(chunk, add_special_tokens=False)

    def fast_batch():
        t = fastokens.Tokenizer.from_file(str(tok_path))
        return lambda chunk: [e.ids for e in t.encode_batch(chunk, add_special_tokens=False)]

    def tiktoken():
        enc = load_tokenizer(tok_path, engine="tiktoken").tiktoken_encoding
        assert enc is not None, "the tiktoken twin maps ids: not a raw tiktoken run"
        return lambda chunk: enc.encode_ordinary_batch(chunk, num_threads=WORKERS)

    return {"fastokens": ("fastokens encode_batch_flat (Rust threads)", fast_flat),
            "fastokens_batch": ("fastokens encode_batch (Rust threads)", fast_batch),
            "tiktoken": (f"tiktoken encode_ordinary_batch ({WORKERS} threads)", tiktoken),
            "tokenizers": ("tokenizers encode_batch (Rust threads)", hf)}


def vm_hwm(pid: int) -> int:
    """Peak RSS of one process since its exec (VmHWM; wait4's maxrss counts the forking parent)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))


def sample_rss(pid: int, stop: threading.Event, peaks: dict) -> None:
    """Every 0.1 s, record pid's process tree's peak summed RSS and each process's VmHWM."""
    root = psutil.Process(pid)
    while not stop.wait(0.1):
        rss = []
        try:
            for p in [root, *root.children(recursive=True)]:
                rss.append(p.memory_info().rss)
                peaks["hwm"][p.pid] = vm_hwm(p.pid)
        except (psutil.Error, OSError, StopIteration):  # a process ended while being read
            pass
        peaks["tree"] = max(peaks["tree"], sum(rss))


def time_prepare(corpus: Path, tokenizer: Path, out: Path, engine: str, workers: str) -> dict:
    """`tokenmill prepare --workers W` end to end in a fresh process: seconds, tokens, peak RSS."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "tokenmill", "prepare", str(corpus), "--out", str(out),
           "--tokenizer", str(tokenizer), "--tokenizer-engine", engine,
           "--workers", workers, "--overwrite", "--quiet"]
    peaks, stop = {"tree": 0, "hwm": {}}, threading.Event()
    with open(BENCH / "prepare-stderr.log", "wb") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stderr=err)
        sampler = threading.Thread(target=sample_rss, args=(proc.pid, stop, peaks))
        sampler.start()
        _, status = os.waitpid(proc.pid, 0)
        seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    stop.set()
    sampler.join()
    if proc.returncode:
        log = (BENCH / "prepare-stderr.log").read_text()
        sys.exit(f"prepare failed (exit {proc.returncode}):\n{log}")
    manifest = json.loads((out / "manifest.json").read_text())
    return {"seconds": seconds, "tokens": manifest["num_tokens"] - manifest["num_documents"],
            "documents": manifest["num_documents"], "rss_tree_peak": peaks["tree"],
            "rss_single_peak": max(peaks["hwm"].values(), default=0),
            "rss_peak_by_process": sorted(peaks["hwm"].values(), reverse=True),
            "command": shlex.join(cmd)}


def store_equals(out: Path, ids: np.ndarray, lengths: np.ndarray, eos: int) -> str:
    """'yes' if the store holds exactly `ids` (per-document `lengths`), EOS after each; else why."""
    with TokenStore(out) as store:
        got_lengths = np.asarray(store.doc_lengths)
        if not np.array_equal(got_lengths, lengths + 1):
            return f"no: document lengths differ ({len(got_lengths)} vs {len(lengths)} documents)"
        tokens = store.tokens(0, store.num_tokens)
    ends = np.cumsum(lengths + 1) - 1
    if not (tokens[ends] == eos).all():
        return "no: EOS missing"
    mask = np.ones(len(tokens), bool)
    mask[ends] = False
    body = tokens[mask]
    if not np.array_equal(body, ids):
        at = int(np.flatnonzero(body != ids)[0]) if len(body) == len(ids) else -1
        return f"no: first difference at token {at}"
    return f"yes ({len(tokens):,} tokens, {len(lengths):,} documents)"


def summary(runs: list[dict], text_bytes: int) -> dict:
    """Median seconds of the runs, with MB/s and tokens/s of text."""
    seconds = statistics.median(r["seconds"] for r in runs)
    tokens = runs[0]["tokens"]
    return {"seconds": seconds, "mb_s": text_bytes / 1e6 / seconds, "tok_s": tokens / seconds,
            "tokens": tokens, "runs": [{k: v for k, v in r.items() if k not in ("ids", "lengths")}
                                       for r in runs]}


def print_table(results: dict) -> None:
    """Name, MB/s, M tokens/s, ratios to raw fastokens and tokenizers, peak RSS."""
    ft = results["fastokens"]["mb_s"]
    hf = results["tokenizers"]["mb_s"] if "tokenizers" in results else float("nan")
    print(f"\n| {'':50} | {'MB/s':>7} | {'Mtok/s':>6} | {'x fastokens':>11} | {'x tokenizers':>12} "
          f"| {'peak RSS (tree sum / largest process)':>37} |")
    print(f"|{'-' * 52}|{'-' * 8}:|{'-' * 7}:|{'-' * 12}:|{'-' * 13}:|{'-' * 38}:|")
    for r in results.values():
        rss = "-"
        if "rss_tree_peak" in r["runs"][0]:
            tree = max(x["rss_tree_peak"] for x in r["runs"])
            single = max(x["rss_single_peak"] for x in r["runs"])
            rss = f"{tree / 2**20:,.0f} MiB / {single / 2**20:,.0f} MiB"
        print(f"| {r['label']:50} | {r['mb_s']:7.2f} | {r['tok_s'] / 1e6:6.2f} | "
              f"{r['mb_s'] / ft:11.2f} | {r['mb_s'] / hf:12.2f} | {rss:>37} |")


def verdict(results: dict, equal: str) -> list[str]:
    """Each target and whether this run met it."""
    p = results["prepare"]
    tree = max(x["rss_tree_peak"] for x in p["runs"])
    checks = [("prepare >= 0.8 x raw fastokens", p["mb_s"] / results["fastokens"]["mb_s"] >= 0.8)]
    if "tokenizers" in results:
        checks.append(("prepare >= 10 x raw tokenizers",
                       p["mb_s"] / results["tokenizers"]["mb_s"] >= 10))
    checks += [(f"store equal to tokenizers: {equal}", equal.startswith("yes")),
               ("peak RSS (tree sum) < 1 GiB", tree < RSS_LIMIT)]
    return [f"{'PASS' if ok else 'FAIL'}  {name}" for name, ok in checks]


def time_raw(name: str, tok_path: Path, data: Path) -> dict:
    """One raw engine over the texts of `data`, in a fresh process (no cache warmed by another
    engine's run, whose Rust thread pools keep per-thread caches): seconds, tokens, ids."""
    ids_file = BENCH / f"raw-{name}.npz"
    cmd = [sys.executable, __file__, "--raw", name, "--corpus", str(data),
           "--tokenizer", str(tok_path), "--out", str(ids_file), "--work", str(BENCH)]
    res = json.loads(subprocess.run(cmd, check=True, capture_output=True).stdout)
    with np.load(ids_file) as z:
        res.update(ids=z["ids"], lengths=z["lengths"])
    ids_file.unlink()
    return res


def raw_main(args) -> int:
    """--raw NAME: time one raw engine over the texts (read before the clock starts)."""
    texts = read_texts(args.corpus)
    encode = raw_engines(args.tokenizer)[args.raw][1]()
    encode(["warm up: load the engine's lazy parts"])
    res = timed(encode, texts)
    np.savez(args.out, ids=res.pop("ids"), lengths=res.pop("lengths"))
    print(json.dumps(res))
    return 0


def measure(tok_path: Path, data: Path, repeats: int, engine: str, names: list[str]) -> dict:
    """The raw engines `names` and prepare, interleaved `repeats` times; the runs by name."""
    runs: dict[str, list] = {name: [] for name in [*names, "prepare", "prepare_workers"]}
    for _ in range(repeats):
        for name in names:
            runs[name].append(time_raw(name, tok_path, data))
        runs["prepare_workers"].append(time_prepare(data, tok_path, BENCH / "store-bpe32k-w",
                                                    engine, str(WORKERS)))
        runs["prepare"].append(time_prepare(data, tok_path, BENCH / "store-bpe32k", engine,
                                            "auto"))
    return runs


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table; optionally write every figure as JSON."""
    global BENCH  # --work: every path the benchmark writes
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, help="JSONL corpus (default: build_corpus, 220 MB)")
    ap.add_argument("--mb", type=float, help="only the first N MB of the corpus")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each measurement")
    ap.add_argument("--engine", default="auto", help="prepare's --tokenizer-engine")
    ap.add_argument("--json", type=Path, help="write all raw figures here")
    ap.add_argument("--tokenizer", type=Path,
                    help="tokenizer.json (default: a 32k BPE trained on the corpus, cached)")
    ap.add_argument("--work", type=Path, default=BENCH,
                    help="where corpora, stores and logs go (default: bench-data)")
    ap.add_argument("--engines", default=",".join(RAW),
                    help="raw engines to time (comma-separated; default all: %(default)s); "
                         "without tokenizers the store is checked against fastokens' ids")
    ap.add_argument("--raw", help=argparse.SUPPRESS)  # internal: time one raw engine
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    BENCH = args.work
    os.environ["TOKENIZERS_PARALLELISM"] = "true"  # raw tokenizers: Rust threads on every core
    if args.raw:
        return raw_main(args)
    info = {"command": shlex.join([sys.executable, *sys.argv]), "machine": machine()}
    print(f"$ {info['command']}")
    m = info["machine"]
    print(f"machine: {m['cores']} cores, {m['cpu']}, load average {m['loadavg']}, {m['versions']}")

    BENCH.mkdir(exist_ok=True)
    corpus = args.corpus or build_corpus(BENCH, target_mb=220)
    tok_path = args.tokenizer or trained_tokenizer(corpus)
    tok = load_tokenizer(tok_path, engine=args.engine)
    print(f"tokenizer: {tok_path} (vocab {tok.vocab_size:,}); tokenmill engine = {tok.engine} "
          f"{list(tok.engine_notes)}")
    data = corpus_prefix(corpus, args.mb)
    texts = read_texts(data)
    text_bytes = sum(len(t.encode()) for t in texts)
    info.update(corpus=str(data), documents=len(texts), text_bytes=text_bytes,
                file_bytes=data.stat().st_size, tokenizer=str(tok_path), repeats=args.repeats,
                engine=tok.engine, engine_notes=list(tok.engine_notes))
    print(f"corpus: {data} ({len(texts):,} documents, {text_bytes / 1e6:.1f} MB of UTF-8 text)")

    names = [n for n in args.engines.split(",") if n]
    if "fastokens" not in names or set(names) - set(RAW):
        sys.exit(f"--engines: names among {', '.join(RAW)}, fastokens included (got {args.engines})")
    runs = measure(tok_path, data, args.repeats, args.engine, names)
    labels = {name: label for name, (label, _) in raw_engines(tok_path).items()}
    labels["prepare"] = "tokenmill prepare --workers auto (default; end to end)"
    labels["prepare_workers"] = f"tokenmill prepare --workers {WORKERS} (end to end)"
    ref = runs["tokenizers" if "tokenizers" in runs else "fastokens"][0]
    same = {k: bool(np.array_equal(v[0]["ids"], ref["ids"])) for k, v in runs.items()
            if not k.startswith("prepare")}
    equal = store_equals(BENCH / "store-bpe32k", ref["ids"], ref["lengths"], tok.eos_id)
    if "tokenizers" not in runs:
        equal += " (checked against fastokens' ids: tokenizers not run)"
    shards = [p.name for p in sorted((BENCH / "store-bpe32k").glob("shard-*"))]
    if any((BENCH / "store-bpe32k" / n).read_bytes() != (BENCH / "store-bpe32k-w" / n).read_bytes()
           for n in shards):
        equal = f"no: --workers auto and --workers {WORKERS} stores differ"
    results = {k: {"label": labels[k], **summary(v, text_bytes)} for k, v in runs.items()}
    print(f"prepare commands: {runs['prepare'][0]['command']}\n  and "
          f"{runs['prepare_workers'][0]['command']}")
    print_table(results)
    print(f"\nraw engines' ids equal to tokenizers': {same}")
    checks = verdict(results, equal)
    print("\n".join(checks))
    info.update(results=results, raw_equal=same, store_equal=equal, checks=checks,
                loadavg_after=loadavg())
    print(f"load average after: {info['loadavg_after']}")
    if args.json:
        args.json.write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
