"""Streaming-mode benchmark: data wait under a simulated CPU step, with tokenizer capacity above
and below consumption.

    python benchmarks/stream.py [--workers auto] [--steps 400] [--seq-len 2048] [--batch-size 8]
                                [--json OUT]

Input: the real-text corpus of ``benchmarks/corpus.py`` (bench-data/corpus-220mb.jsonl), read
only as far as each run needs. Tokenizer: a byte-level BPE, vocab 32,000, trained with
``tokenmill.tokenizer.train_bpe`` on a 20 MB stride sample of the corpus and cached as
bench-data/bpe32k-corpus-220mb.json (the same recipe and file as benchmarks/prepare.py). Every
run is a fresh ``Loader.from_text`` with a fresh cache directory:

    capacity   tokens/s drawn for --seconds with no consumer (after the first batch)
    headroom   step = batch tokens / (capacity / 3): tokenization has 3x headroom; target < 1% wait
    starved    step = batch tokens / (capacity * 3): consumption is 3x capacity; the Meter must
               say "data-bound (…): tokenization"

The step is ``tokenmill.observe.bench``'s single-thread CPU job (np.sin passes), calibrated here with
``calibrate_step``; data wait and verdict are ``tokenmill.Meter``'s, via ``measure_steps``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench-data"
sys.path.insert(0, str(ROOT / "benchmarks"))

from tokenmill import Loader  # noqa: E402
from tokenmill.observe.bench import calibrate_step, measure_steps, tokens_per_s  # noqa: E402
from prepare import trained_tokenizer  # noqa: E402 (benchmarks/prepare.py, beside this file)



def bpe_tokenizer(corpus: Path) -> Path:
    """The cached 32k byte-level BPE of the corpus (benchmarks/prepare.py trains it if missing)."""
    return trained_tokenizer(corpus)


def fresh_loader(corpus: Path, tokenizer: Path, args, name: str) -> Loader:
    cache = BENCH / "stream-cache" / name
    shutil.rmtree(cache, ignore_errors=True)
    workers = args.workers if args.workers == "auto" else int(args.workers)
    return Loader.from_text([str(corpus)], tokenizer=str(tokenizer), seq_len=args.seq_len,
                            batch_size=args.batch_size, cache_dir=cache, seed=0, rank=0,
                            world_size=1, num_workers=workers)


def capacity(corpus: Path, tokenizer: Path, args) -> dict:
    """Tokens/s of the stream with nothing else running, and its time to first batch."""
    t0 = time.perf_counter()
    with fresh_loader(corpus, tokenizer, args, "capacity") as ld:
        it = iter(ld)
        next(it)
        first = time.perf_counter() - t0
        rate = tokens_per_s(it, args.seconds)
        workers, memory = ld.num_workers, ld.buffer_bytes()
    return {"tokens_per_s": rate, "time_to_first_batch_s": first, "workers": workers,
            "buffer_bound_bytes": memory}


def regime(corpus: Path, tokenizer: Path, args, name: str, step_ms: float) -> dict:
    """The Meter's summary over --steps simulated steps of ``step_ms`` fed by a fresh stream."""
    passes = calibrate_step(step_ms)
    with fresh_loader(corpus, tokenizer, args, name) as ld:
        s = measure_steps(ld, passes, args.steps)
        peak = ld.buffer_peak_tokens
    shutil.rmtree(BENCH / "stream-cache" / name, ignore_errors=True)
    batch_tokens = args.batch_size * args.seq_len
    return {"step_ms_target": step_ms, "consumption_tokens_per_s": batch_tokens / step_ms * 1e3,
            "data_wait_pct": s["data_wait_pct"], "tokens_per_s": s["tokens_per_s"],
            "wait_p99_ms": s["wait_p99_ms"], "step_p50_ms": s["step_p50_ms"],
            "time_to_first_batch_s": s["time_to_first_batch_s"], "verdict": s["verdict"],
            "verdict_detail": s["verdict_detail"], "stage_s": s["stage_s"],
            "peak_buffer_tokens": peak}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="auto")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    command = " ".join(["python benchmarks/stream.py", *map(shlex.quote, given)])
    from corpus import build_corpus
    corpus = build_corpus(BENCH, target_mb=220)
    tokenizer = bpe_tokenizer(corpus)
    cores = len(os.sched_getaffinity(0))
    print(f"command: {command}")
    print(f"corpus {corpus.name} ({corpus.stat().st_size / 1e6:.0f} MB), tokenizer "
          f"{tokenizer.name}, {cores} cores, load average {os.getloadavg()[0]:.1f}", flush=True)
    cap = capacity(corpus, tokenizer, args)
    batch_tokens = args.batch_size * args.seq_len
    print(f"capacity: {cap['tokens_per_s'] / 1e6:.2f} M tokens/s with {cap['workers']} worker(s), "
          f"first batch after {cap['time_to_first_batch_s']:.2f} s, buffer bound "
          f"{cap['buffer_bound_bytes'] / 2**20:.0f} MiB", flush=True)
    results = {"command": command, "cores": cores, "capacity": cap}
    for name, factor in (("headroom", 1 / 3), ("starved", 3.0)):
        step_ms = 1e3 * batch_tokens / (cap["tokens_per_s"] * factor)
        r = results[name] = regime(corpus, tokenizer, args, name, step_ms)
        print(f"{name:9s} step {step_ms:6.1f} ms (consumes "
              f"{r['consumption_tokens_per_s'] / 1e6:.2f} M tokens/s = {factor:.2g}x capacity): "
              f"data wait {r['data_wait_pct']:.2f}%, "
              f"p99 wait {r['wait_p99_ms']:.1f} ms, {r['tokens_per_s'] / 1e6:.2f} M tokens/s "
              f"-> {r['verdict']}", flush=True)
        print(f"          {r['verdict_detail']}", flush=True)
    results["loadavg_after"] = os.getloadavg()[0]
    shutil.rmtree(BENCH / "stream-cache", ignore_errors=True)
    ok = results["headroom"]["data_wait_pct"] < 1.0 and results["starved"]["verdict"].startswith(
        "data-bound") and results["starved"]["verdict"].endswith(": tokenization")
    print("targets met: headroom < 1% wait, starved data-bound on tokenization" if ok else
          "targets NOT met (see figures above)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
