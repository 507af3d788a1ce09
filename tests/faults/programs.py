"""The child processes of the fault tests: ``python programs.py COMMAND JSON-ARGS``.

Each is a small, realistic program (a training loop, a prepare run, a set of ranks) that the tests
start, signal and kill. Output goes to files named in the arguments, one JSON object per line,
written with O_APPEND so a kill leaves at most one torn last line.
"""

from __future__ import annotations

import json
import os
import sys
import time


def digest(batch: dict) -> str:
    """xxh3-64 of every array of a batch, in key order."""
    import xxhash
    h = xxhash.xxh3_64()
    for k in sorted(batch):
        h.update(k.encode())
        h.update(batch[k].tobytes())
    return h.hexdigest()


class Log:
    """Appends one JSON line per event; a SIGKILL can only tear the line being written."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.pid = os.getpid()

    def __call__(self, **event) -> None:
        os.write(self.fd, (json.dumps({"pid": self.pid, **event}) + "\n").encode())


def read_log(path) -> list[dict]:
    """A Log's events; a torn last line (a kill mid-write) is dropped."""
    from pathlib import Path
    path = Path(path)
    events = []
    if not path.exists():
        return events
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # only ever the last line a killed run wrote
    return events


def _write_json_atomic(path: str, obj) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _source(spec):
    return spec if isinstance(spec, str) else dict(spec)


def train(a: dict) -> None:
    """A training loop: resume from the checkpoint if there is one, log every batch's digest,
    "train" for ``step_s``, checkpoint every ``ckpt_every`` steps, stop at ``until`` samples."""
    from tokenmill import Loader
    log = Log(a["log"])
    loader = Loader(_source(a["source"]), seq_len=a["seq_len"], batch_size=a["batch_size"],
                    layout=a["layout"], seed=a["seed"], num_workers=a["num_workers"],
                    worker_type="process", rank=0, world_size=1)
    if os.path.exists(a["ckpt"]):
        with open(a["ckpt"]) as f:
            loader.load_state_dict(json.load(f))
    log(event="start", consumed=loader.consumed_samples)
    gb = loader.global_batch_size
    step = 0
    with loader:
        for batch in loader:
            log(c=loader.consumed_samples - gb, h=digest(batch))
            time.sleep(a["step_s"])  # the training step
            step += 1
            if step % a["ckpt_every"] == 0:
                _write_json_atomic(a["ckpt"], loader.state_dict())
            if a.get("until") is not None and loader.consumed_samples >= a["until"]:
                break
        _write_json_atomic(a["ckpt"], loader.state_dict())
    log(event="done", consumed=loader.consumed_samples)


def iterate(a: dict) -> None:
    """Plain user code: iterate a process-worker Loader forever; print "ready" after batch 1."""
    from tokenmill import Loader
    with Loader(_source(a["source"]), seq_len=a["seq_len"], batch_size=a["batch_size"],
                layout=a["layout"], num_workers=a["num_workers"], worker_type="process",
                rank=0, world_size=1) as loader:
        for i, _ in enumerate(loader):
            if i == 0:
                print("ready", flush=True)
            time.sleep(a["step_s"])


def prepare(a: dict) -> None:
    """tokenmill.prepare with the given keyword arguments; prints "done" when it returns."""
    from tokenmill.prepare import prepare as run
    run(a.pop("inputs"), progress=False, **a)
    print("done", flush=True)


def _rank_main(r: int, a: dict, barrier, results) -> None:
    from tokenmill import Loader
    steps, firsts = 0, []
    with Loader(a["store"], seq_len=a["seq_len"], batch_size=a["batch_size"], seed=a["seed"],
                rank=r, world_size=a["world_size"], epochs=a["epochs"], num_workers=1,
                worker_type="process") as loader:
        for batch in loader:
            barrier.wait(timeout=a["timeout"])  # the collective of a training step
            steps += 1
            firsts += batch["inputs"][:, 0].tolist()
    barrier.wait(timeout=a["timeout"])  # the end-of-training collective
    results.put((r, steps, firsts))


def ranks(a: dict) -> None:
    """``world_size`` ranks in their own processes, each a Loader with a process worker, meeting
    at a barrier every step as a collective would; prints each rank's steps and first tokens.
    A rank with more steps than the others waits at the barrier until it times out: a hang."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(a["world_size"]), ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, a, barrier, results))
             for r in range(a["world_size"])]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in procs:
            r, steps, firsts = results.get(timeout=a["timeout"] + 60)
            out[r] = {"steps": steps, "firsts": firsts}
    finally:
        for p in procs:
            p.join(timeout=10)
    print(json.dumps({"ranks": out, "exitcodes": [p.exitcode for p in procs]}), flush=True)


class ChildWatch:
    """The command line of every child process seen while the block runs (polled every 10 ms,
    the latest one kept: a child caught between fork and exec shows the parent's at first)."""

    def __init__(self):
        import psutil
        import threading
        self.me, self.seen = psutil.Process(), {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ChildWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil
        while not self._stop.wait(0.01):
            for c in self.me.children(recursive=True):
                try:
                    cmd = c.cmdline()
                except psutil.Error:
                    continue  # ended meanwhile
                if cmd:  # an exited child not yet reaped (a zombie) shows an empty command line
                    self.seen[c.pid] = cmd


def tokenize_then_start_workers(a: dict) -> None:
    """Use a Hugging Face tokenizer in this process with its thread pool on, then start process
    pools (prepare with 2 workers, a Loader with 2 process workers): a forked child could inherit
    the pool's locks held and deadlock; tokenmill's workers are fresh interpreters
    (``python -m tokenmill.base.child``), so this must finish. Prints every child's command line."""
    from tokenizers import Tokenizer
    hf = Tokenizer.from_file(a["tokenizer"])
    with open(a["text"], encoding="utf-8") as f:
        texts = [f.read()] * 64
    n = sum(len(e.ids) for e in hf.encode_batch(texts))  # rayon threads busy in this process
    print(f"parent tokenized {n} tokens", flush=True)
    from tokenmill import Loader
    from tokenmill.prepare import prepare as run
    with ChildWatch() as during_prepare:
        run(a["inputs"], out=a["out"], tokenizer=a["tokenizer"], workers=2, progress=False,
            shard_tokens=20_000, unit_bytes=32_000)
    n = sum(len(e.ids) for e in hf.encode_batch(texts))  # and again, between pools
    with ChildWatch() as during_loading, \
            Loader(a["out"], seq_len=64, batch_size=4, num_workers=2, worker_type="process",
                   rank=0, world_size=1) as loader:
        for _, _ in zip(range(50), loader):
            pass
    print(json.dumps({"done": True, "parent": sys.orig_argv,
                      "prepare": sorted(during_prepare.seen.values()),
                      "loader": sorted(during_loading.seen.values())}), flush=True)


def rss(a: dict) -> None:
    """``batches`` batches through a process-worker Loader; RSS of this process and its workers
    sampled ``samples`` times; prints the series as JSON."""
    import psutil
    from tokenmill import Loader
    me = psutil.Process()

    def total() -> int:
        procs = [me] + me.children(recursive=True)
        return sum(p.memory_info().rss for p in procs if p.is_running())

    n, every = a["batches"], max(1, a["batches"] // a["samples"])
    series = []
    t0 = time.monotonic()
    with Loader(a["store"], seq_len=a["seq_len"], batch_size=a["batch_size"], layout=a["layout"],
                num_workers=a["num_workers"], worker_type="process", rank=0, world_size=1,
                seed=1) as loader:
        check = 0
        for i, batch in enumerate(loader):
            check ^= int(batch["inputs"][0, 0])
            if i % every == 0:
                series.append((i, total()))
            if i + 1 == n:
                break
        series.append((n, total()))
        steps_per_epoch = len(loader)
    print(json.dumps({"series": series, "seconds": time.monotonic() - t0,
                      "steps_per_epoch": steps_per_epoch, "check": check}), flush=True)


def fuzz_leg(a: dict) -> None:
    """A leg of a resume scenario (tests/resume_scenarios.py), run until it is killed."""
    from faults.resume_runner import child_leg
    child_leg(a, Log(a["log"]), digest)


COMMANDS = {"train": train, "fuzz_leg": fuzz_leg, "iterate": iterate, "prepare": prepare, "ranks": ranks,
            "tokenize_then_start_workers": tokenize_then_start_workers, "rss": rss}

if __name__ == "__main__":
    COMMANDS[sys.argv[1]](json.loads(sys.argv[2]))
