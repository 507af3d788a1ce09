"""Where `tokenmill prepare`'s time goes: each stage of a worker's unit, the parent, start-up.

python benchmarks/prepare_stages.py --corpus bench-data/corpus-100mb.first50mb.jsonl \
    --tokenizer bench-data/bpe32k-corpus-100mb.json

1. start-up: importing tokenmill, loading the tokenizer (engine choice and its proof), per process.
2. a worker's stages, timed unit by unit in this process as `prepare.tokenize.tokenize_unit` runs
   them (fastokens with its default threads, as in a worker): read the unit's bytes and
   parse its JSON lines, hash the input bytes (resume check), tokenize, and the result's trip
   through a pipe to the parent (pickle, send, receive, unpickle).
3. the parent of a real `prepare(workers=2)` under cProfile: waiting for workers, receiving
   results, the writer (writes, checksums, fsync), the manifest; CPU seconds of the parent and
   of its workers.
4. the same corpus prepared inline (workers=1: fastokens' own Rust threads use every core).
5. CPU seconds of each stage over the whole corpus, one stage at a time over every unit (CPU
   time, not wall: it holds on a loaded machine), with its share of the sum: read the bytes,
   split lines, UTF-8 decode + json.loads (the stdlib way) or orjson.loads(bytes) (what the
   reader does when orjson is installed), encode (the engine), concat (EOS + cast into one flat
   array), xxh3 (input bytes and shard), write (+ fsync), and start-up (import + tokenizer load).
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing
import os
import pstats
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from tokenmill.inputs import sources
from tokenmill.prepare import prepare
from tokenmill.prepare.tokenize import PrepareConfig, unit_digest
from tokenmill.tokenizer import encode_documents, load_tokenizer, token_dtype


def startup(tokenizer: Path) -> dict:
    """Seconds to import tokenmill and to load the tokenizer, in a fresh process (median of 3)."""
    code = ("import time; t0, c0 = time.perf_counter(), time.process_time(); "
            "import tokenmill.prepare, tokenmill.cli; "
            "t1, c1 = time.perf_counter(), time.process_time(); "
            "from tokenmill.tokenizer import load_tokenizer; "
            f"tok = load_tokenizer({str(tokenizer)!r}); t2, c2 = time.perf_counter(), "
            "time.process_time(); print(t1 - t0, t2 - t1, tok.engine, c1 - c0, c2 - c1)")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.split() for _ in range(3)]
    runs.sort(key=lambda r: float(r[1]))
    imp, load, engine, imp_cpu, load_cpu = runs[1]
    return {"import": float(imp), "load": float(load), "engine": engine,
            "import_cpu": float(imp_cpu), "load_cpu": float(load_cpu)}


def pipe_trip(result) -> float:
    """Seconds to send `result` through a multiprocessing pipe and receive it (another thread)."""
    a, b = multiprocessing.Pipe()
    got = []
    t = threading.Thread(target=lambda: got.append(b.recv()))
    t0 = time.perf_counter()
    t.start()
    a.send(result)
    t.join()
    return time.perf_counter() - t0


class TimedEncode:
    """A tokenizer whose encode_batch calls are timed (each text is encoded once: no run is
    helped by a cache a previous run of the same text warmed)."""

    def __init__(self, tok):
        self.tok, self.seconds = tok, 0.0
        self.vocab_size, self.eos_id, self.bos_id = tok.vocab_size, tok.eos_id, tok.bos_id

    def encode_batch(self, texts):
        """The wrapped tokenizer's encode_batch, timed."""
        t0 = time.perf_counter()
        out = self.tok.encode_batch(texts)
        self.seconds += time.perf_counter() - t0
        return out

    def identity(self) -> dict:
        """The wrapped tokenizer's identity."""
        return self.tok.identity()


def worker_stages(corpus: Path, tokenizer: Path) -> dict:
    """Seconds per stage summed over every unit of the corpus, as one worker runs them."""
    config = PrepareConfig(tokenizer=str(tokenizer))
    tok = load_tokenizer(tokenizer)
    source = config.source_config()
    units = sources.plan_units([str(corpus)], source)
    dtype = token_dtype(tok.vocab_size)
    stages = dict.fromkeys(["read + parse JSON", "hash input bytes", "tokenize (engine)",
                            "EOS + cast (encode_documents)", "pipe to parent"], 0.0)
    timed = TimedEncode(tok)
    for unit in units:
        t0 = time.perf_counter()
        texts = [x.text for x in sources.read_unit(unit, source) if isinstance(x, sources.Doc)]
        t1 = time.perf_counter()
        unit_digest(unit)
        t2 = time.perf_counter()
        before = timed.seconds
        tokens, lengths = encode_documents(timed, texts, dtype=dtype)
        t3 = time.perf_counter()
        stages["read + parse JSON"] += t1 - t0
        stages["hash input bytes"] += t2 - t1
        stages["tokenize (engine)"] += timed.seconds - before
        stages["EOS + cast (encode_documents)"] += (t3 - t2) - (timed.seconds - before)
        stages["pipe to parent"] += pipe_trip((tokens, lengths))
    return {"units": len(units), "engine": tok.engine, "stages": stages}


def cpu_stages(corpus: Path, tokenizer: Path, out: Path) -> dict:
    """CPU seconds of each stage over every unit of the corpus (see the module docstring)."""
    import json

    import xxhash
    try:
        from orjson import loads as loads_bytes  # what tokenmill.inputs.readers parses with, if present
    except ImportError:
        loads_bytes = None
    tok = load_tokenizer(tokenizer)
    unit_bytes = PrepareConfig().unit_bytes
    cpu, t = {}, time.process_time

    def stage(name, fn, *args):
        t0 = t()
        value = fn(*args)
        cpu[name] = cpu.get(name, 0.0) + t() - t0
        return value

    def read(f):  # a unit's bytes: unit_bytes, then to the end of the line
        return f.read(unit_bytes) + f.readline()

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "stages.bin", "wb") as sink, open(corpus, "rb") as f:
        while data := stage("read bytes", read, f):
            raws = stage("split lines", lambda: data.split(b"\n")[:-1])
            strs = stage("UTF-8 decode (stdlib path)", lambda: [r.decode() for r in raws])
            texts = stage("json.loads(str) (stdlib path)",
                          lambda: [json.loads(x)["text"] for x in strs])
            if loads_bytes is not None:
                fast = stage("orjson.loads(bytes) (tokenmill's path)",
                             lambda: [loads_bytes(r)["text"] for r in raws])
                assert fast == texts
            docs = stage("encode (engine)", tok.encode_batch, texts)
            flat = stage("concat (EOS + cast)", concat, docs, tok.eos_id,
                         token_dtype(tok.vocab_size))
            stage("xxh3 (input bytes + tokens)",
                  lambda: (xxhash.xxh3_64(data).digest(), xxhash.xxh3_64(flat).digest()))
            stage("write", sink.write, flat.data)
        stage("write", lambda: (sink.flush(), os.fsync(sink.fileno())))
    (out / "stages.bin").unlink()
    return cpu


def concat(docs, eos: int, dtype):
    """encode_documents' flat array (ids, EOS after each), given the engine's output."""
    return encode_documents(Given(docs, eos), [None] * len(docs), dtype=dtype)[0]


class Given:
    """A 'tokenizer' returning ids already computed (to time encode_documents' own work)."""

    def __init__(self, docs, eos: int):
        self.docs, self.eos_id, self.bos_id, self.vocab_size = docs, eos, None, 1 << 16

    def encode_batch(self, texts):
        """The ids given."""
        return self.docs


def parent_profile(corpus: Path, tokenizer: Path, out: Path, workers: int) -> tuple[dict, list]:
    """Wall and CPU seconds of prepare(workers=...) in this process, its top functions."""
    shutil.rmtree(out, ignore_errors=True)
    prof = cProfile.Profile()
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    prof.enable()
    prepare(str(corpus), out=out, tokenizer=str(tokenizer), workers=workers, progress=False)
    prof.disable()
    wall = time.perf_counter() - t0
    me2, kids2 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = {"wall": wall,
           "parent_cpu": me2.ru_utime + me2.ru_stime - me.ru_utime - me.ru_stime,
           "workers_cpu": kids2.ru_utime + kids2.ru_stime - kids.ru_utime - kids.ru_stime}
    stats = pstats.Stats(prof).stats
    rows = []
    for (path, line, fn), (_, _, tottime, cumtime, _) in stats.items():
        rows.append((cumtime, tottime, f"{Path(path).name}:{line}({fn})"))
    return cpu, sorted(rows, reverse=True)


def show_parent(title: str, cpu: dict, rows: list, names: list[str]) -> None:
    """Wall and CPU seconds and the cumulative seconds of the named functions."""
    print(f"\n{title}: {cpu['wall']:.2f} s wall, CPU {cpu['parent_cpu']:.2f} s parent + "
          f"{cpu['workers_cpu']:.2f} s workers")
    for want in names:
        hit = next((r for r in rows if want in r[2]), None)
        if hit:
            print(f"  {hit[0]:7.2f} s cumulative  {hit[1]:6.2f} s own   {hit[2]}")


PARENT_FUNCTIONS = ["(start_run)", "(load_tokenizer)", "(plan_units)", "(ordered_results)",
                    "(wait)", "(_receive)", "(recv)", "(add)", "(finish)", "(xxh3_file)",
                    "(fsync)", "(UnitPool.__init__)", "(__init__)"]


def main(argv: list[str] | None = None) -> int:
    """Print the four sections."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("bench-data/store-stages"))
    ap.add_argument("--only-cpu", action="store_true", help="start-up and section 5 only")
    args = ap.parse_args(argv)
    mb = args.corpus.stat().st_size / 1e6
    print(f"$ {' '.join([sys.executable, *sys.argv])}\ncorpus {args.corpus} ({mb:.1f} MB of JSONL)")
    s = startup(args.tokenizer)
    print(f"\n1. start-up, per process: import {s['import']:.2f} s ({s['import_cpu']:.2f} CPU-s), "
          f"load tokenizer {s['load']:.2f} s ({s['load_cpu']:.2f} CPU-s; engine {s['engine']}, "
          "proof included)")
    if args.only_cpu:
        show_cpu_stages(cpu_stages(args.corpus, args.tokenizer, args.out), s, mb)
        return 0
    w = worker_stages(args.corpus, args.tokenizer)
    total = sum(w["stages"].values())
    print(f"\n2. one worker's stages over {w['units']} units (engine {w['engine']}, its default threads):")
    for name, sec in w["stages"].items():
        print(f"  {name:32} {sec:6.2f} s  {100 * sec / total:5.1f} %  {mb / sec:8.1f} MB/s")
    print(f"  {'total':32} {total:6.2f} s  100.0 %  {mb / total:8.1f} MB/s")
    for workers in (2, 1):
        cpu, rows = parent_profile(args.corpus, args.tokenizer, args.out, workers)
        show_parent(f"{3 if workers == 2 else 4}. parent of prepare(workers={workers}), "
                    f"{mb / cpu['wall']:.1f} MB/s", cpu, rows, PARENT_FUNCTIONS)
    show_cpu_stages(cpu_stages(args.corpus, args.tokenizer, args.out), s, mb)
    return 0


def show_cpu_stages(cpu: dict, start: dict, mb: float) -> None:
    """Section 5: CPU seconds and share of each stage tokenmill runs (the stdlib parse rows are
    what the reader does without orjson, shown apart)."""
    startup = start["import_cpu"] + start["load_cpu"]
    rows = {**cpu, "start-up (import + tokenizer load)": startup}
    fast = "orjson.loads(bytes) (tokenmill's path)" in cpu
    left_out = ("UTF-8 decode (stdlib path)", "json.loads(str) (stdlib path)") if fast else ()
    total = sum(v for k, v in rows.items() if k not in left_out)
    print(f"\n5. CPU seconds per stage, {mb:.0f} MB (share of the {total:.2f} CPU-s tokenmill "
          "spends; rows in [] are the stdlib parse it skips when orjson is installed):")
    for name, sec in rows.items():
        share = "" if name in left_out else f"{100 * sec / total:5.1f} %"
        shown = f"[{name}]" if name in left_out else name
        print(f"  {shown:42} {sec:6.3f} s  {share:>7}")


if __name__ == "__main__":
    sys.exit(main())
