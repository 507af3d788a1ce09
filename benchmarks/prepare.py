"""Benchmark `tokenmill prepare --workers 2` against raw tokenizers and raw tiktoken, same text.

python benchmarks/prepare.py [--corpus PATH] [--mb N] [--repeats K] [--json OUT]

Targets: prepare >= 3x tokenizers encode_batch and >= 0.9x tiktoken encode_ordinary_batch on
2 cores; peak RSS < 2 GB. Baselines see a list of str already in memory (no I/O); prepare is
timed end to end in a subprocess (start-up, JSON reading, tokenizing, writing, checksums).
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

import psutil

from tokenmill.tokenizer import load_tokenizer, train_bpe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import build_corpus

BENCH = Path(__file__).resolve().parent.parent / "bench-data"
VOCAB, TRAIN_MB, WORKERS = 32_000, 20, 2
CHUNK_DOCS = 1_000  # documents per encode_batch call
RSS_LIMIT = 2 << 30


def machine() -> dict:
    """Usable cores, CPU model and load average of this machine."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((l.split(":", 1)[1].strip() for l in cpuinfo if l.startswith("model name")), "?")
    return {"cores": len(os.sched_getaffinity(0)), "cpu": model, "loadavg": loadavg()}


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


def time_tokenizers(hf, texts: list[str]) -> dict:
    """Raw tokenizers encode_batch (Rust threads on every core): seconds and tokens."""
    t0, n = time.perf_counter(), 0
    for chunk in chunks(texts):
        n += sum(len(e) for e in hf.encode_batch(chunk, add_special_tokens=False))
    return {"seconds": time.perf_counter() - t0, "tokens": n}


def time_tiktoken(enc, texts: list[str]) -> dict:
    """Raw tiktoken encode_ordinary_batch on WORKERS threads: seconds and tokens."""
    t0, n = time.perf_counter(), 0
    for chunk in chunks(texts):
        n += sum(map(len, enc.encode_ordinary_batch(chunk, num_threads=WORKERS)))
    return {"seconds": time.perf_counter() - t0, "tokens": n}


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


def time_prepare(corpus: Path, tokenizer: Path, out: Path) -> dict:
    """`tokenmill prepare --workers 2` end to end in a fresh process: seconds, tokens, peak RSS."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "tokenmill", "prepare", str(corpus), "--out", str(out),
           "--tokenizer", str(tokenizer), "--workers", str(WORKERS), "--overwrite", "--quiet"]
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


def median_run(runs: list[dict], text_bytes: int) -> dict:
    """Median seconds of the runs, with MB/s and tokens/s of text."""
    seconds = statistics.median(r["seconds"] for r in runs)
    tokens = runs[0]["tokens"]
    return {"seconds": seconds, "mb_s": text_bytes / 1e6 / seconds, "tok_s": tokens / seconds,
            "tokens": tokens, "runs": runs}


def print_table(results: dict) -> None:
    """Name, MB/s, M tokens/s, ratios to both baselines, peak RSS."""
    hf, tt = results["tokenizers"]["mb_s"], results["tiktoken"]["mb_s"]
    print(f"\n{'':44}{'MB/s':>8}{'Mtok/s':>8}{'x tokenizers':>14}{'x tiktoken':>12}"
          f"{'peak RSS':>26}")
    for r in results.values():
        rss = "-"
        if "rss_tree_peak" in r["runs"][0]:
            tree = max(x["rss_tree_peak"] for x in r["runs"])
            single = max(x["rss_single_peak"] for x in r["runs"])
            rss = f"{tree / 2**20:,.0f} MiB sum, {single / 2**20:,.0f} max 1"
        print(f"{r['label']:44}{r['mb_s']:8.2f}{r['tok_s'] / 1e6:8.2f}{r['mb_s'] / hf:14.2f}"
              f"{r['mb_s'] / tt:12.2f}{rss:>26}")


def verdict(results: dict) -> list[str]:
    """Each target and whether this run met it."""
    p = results["prepare"]
    tree = max(x["rss_tree_peak"] for x in p["runs"])
    checks = [("prepare >= 3 x tokenizers", p["mb_s"] / results["tokenizers"]["mb_s"] >= 3),
              ("prepare >= 0.9 x tiktoken", p["mb_s"] / results["tiktoken"]["mb_s"] >= 0.9),
              ("peak RSS (tree sum) < 2 GB", tree < RSS_LIMIT)]
    return [f"{'PASS' if ok else 'FAIL'}  {name}" for name, ok in checks]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table; optionally write every figure as JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, help="JSONL corpus (default: build_corpus, 220 MB)")
    ap.add_argument("--mb", type=float, help="only the first N MB of the corpus")
    ap.add_argument("--repeats", type=int,
                    help="runs of each measurement (default 3 with --mb, else 1)")
    ap.add_argument("--json", type=Path, help="write all raw figures here")
    args = ap.parse_args(argv)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"  # raw tokenizers: Rust threads on every core
    repeats = args.repeats or (3 if args.mb else 1)
    info = {"command": shlex.join([sys.executable, *sys.argv]), "machine": machine()}
    print(f"$ {info['command']}")
    m = info["machine"]
    print(f"machine: {m['cores']} cores, {m['cpu']}, load average {m['loadavg']}")

    BENCH.mkdir(exist_ok=True)
    corpus = args.corpus or build_corpus(BENCH, target_mb=220)
    tok_path = trained_tokenizer(corpus)
    tok = load_tokenizer(tok_path)
    print(f"tokenizer: {tok_path} (vocab {tok.vocab_size:,}), tokenmill engine = {tok.engine}")
    if tok.engine != "tiktoken" or tok.tiktoken_encoding is None:
        sys.exit(f"expected tiktoken's fast path with ids = ranks: {tok.fallback_reason}")
    enc = tok.tiktoken_encoding  # tokenmill's tiktoken twin of the tokenizer.json
    from tokenizers import Tokenizer
    hf = Tokenizer.from_file(str(tok_path))

    data = corpus_prefix(corpus, args.mb)
    texts = read_texts(data)
    text_bytes = sum(len(t.encode()) for t in texts)
    info.update(corpus=str(data), documents=len(texts), text_bytes=text_bytes,
                file_bytes=data.stat().st_size, tokenizer=str(tok_path), repeats=repeats)
    print(f"corpus: {data} ({len(texts):,} documents, {text_bytes / 1e6:.1f} MB of UTF-8 text)")
    print(f"repeats: {repeats}, interleaved (tokenizers, tiktoken, prepare) x {repeats}")

    runs = {"tokenizers": [], "tiktoken": [], "prepare": []}
    for _ in range(repeats):
        runs["tokenizers"].append(time_tokenizers(hf, texts))
        runs["tiktoken"].append(time_tiktoken(enc, texts))
        runs["prepare"].append(time_prepare(data, tok_path, BENCH / "store-bpe32k"))
    labels = {"tokenizers": "tokenizers encode_batch (Rust threads)",
              "tiktoken": f"tiktoken encode_ordinary_batch ({WORKERS} threads)",
              "prepare": f"tokenmill prepare --workers {WORKERS} (end to end)"}
    results = {k: {"label": labels[k], **median_run(v, text_bytes)} for k, v in runs.items()}
    print(f"prepare command: {runs['prepare'][0]['command']}")
    print_table(results)
    counts = {k: r["tokens"] for k, r in results.items()}
    print(f"\ntokens (EOS excluded): {counts}" + ("" if len(set(counts.values())) == 1
                                                   else "  <- counts differ"))
    checks = verdict(results)
    print("\n".join(checks))
    info.update(results=results, checks=checks, loadavg_after=loadavg())
    print(f"load average after: {info['loadavg_after']}")
    if args.json:
        args.json.write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
