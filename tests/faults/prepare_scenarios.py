"""Prepare scenarios drawn at random: kill -9 a real ``tokenmill prepare`` at points chosen by its
own progress, rerun it (other worker counts, sometimes an input or a setting changed between
the kill and the rerun), and the final store must be byte-identical (every file) to an
uninterrupted run of what the last run was asked — or the rerun refused with a one-line reason,
after which ``--overwrite`` gives that store.

A scenario draws its corpus (2 to 5 input files of txt, jsonl, jsonl.gz, csv, json array and
parquet holding real text), tokenizer, transform, ``--val-fraction``, shard size, unit size (set
through the Python API in a child process; the CLI has no flag for it), txt mode, bad records
under ``--on-error skip``, and 1 to 3 kills, each at a point of the run's own progress: at
once, once its workers are up, once its writer holds the lock, after its k-th shard commit — or
none: it finishes, and the rerun meets a finished store.

``draw(seed)`` → ``PrepareScenario``; ``check(scenario, tmp, tokenizers)`` runs it and raises
``ScenarioFailed`` with the scenario's one line and the command that replays it.
tests/faults/test_prepare_fuzz.py runs seeds 0…N-1; benchmarks/fuzz_prepare.py runs more.
"""

from __future__ import annotations

import csv
import functools
import gzip
import io
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from faults.conftest import ScenarioFailed, watchdog

FORMATS = ("txt", "jsonl", "jsonl.gz", "csv", "json", "parquet")
TRANSFORMS = ("upper", "drop_short", "chat")
# Failures the fuzzer found that are not fixed yet (see resume_scenarios.KNOWN_FAILURES): not
# drawn by ``draw``; each has a fixed scenario in tests/faults/test_prepare_fuzz.py.
KNOWN_FAILURES: frozenset[str] = frozenset()
TRANSFORM_MODULE = '''
"""Transforms of the prepare fuzzer (written per scenario)."""
TEMPLATE = {template!r}


def wrap(text):
    return TEMPLATE.format(text)


def upper(record):
    return record["text"].upper()


def drop_short(record):
    return None if len(record["text"]) < 60 else record["text"]


def chat(record):
    return wrap(record["text"])
'''


@dataclass(frozen=True)
class PrepareScenario:
    """One corpus, the settings of its prepare, the kills and what changes before the rerun."""

    seed: int
    files: tuple[tuple[str, int], ...]  # (format, documents) per input file
    txt_mode: str
    tokenizer: str  # "bytes" | "bpe"
    transform: str | None
    val_fraction: float | None
    shard_tokens: int
    unit_bytes: int | None  # None: the CLI (its default unit size)
    bad_records: bool  # a malformed record in each JSON Lines file, under --on-error skip
    workers: tuple[int, ...]  # per run: the killed ones, then the last
    kills: tuple[tuple[str, int], ...]  # ("start" | "workers" | "lock" | "commit", k), or
                                        # ("end", 0): not killed, it finishes
    change: str | None  # before the last run: "input same size", "input grown",
                        # "shard_tokens", "unit_bytes", "transform edited"

    def line(self) -> str:
        """The scenario in one line: its seed and every parameter."""
        files = " ".join(f"{n}×{f}" for f, n in self.files)
        kills = ",".join(f"{w}{k or ''}" for w, k in self.kills)
        return (f"seed={self.seed} files=[{files}] txt_mode={self.txt_mode} "
                f"tokenizer={self.tokenizer} transform={self.transform} "
                f"val_fraction={self.val_fraction} shard_tokens={self.shard_tokens} "
                f"unit_bytes={self.unit_bytes or 'CLI'} bad_records={self.bad_records} "
                f"workers={list(self.workers)} kills=[{kills}] "
                f"then {self.change or 'no change'}")


def draw(seed: int) -> PrepareScenario:
    """The scenario of ``seed``."""
    rng = random.Random(seed)
    files = tuple((rng.choice(FORMATS), rng.randint(15, 60)) for _ in range(rng.randint(2, 5)))
    transform = rng.choice([None, None, *TRANSFORMS])
    unit_bytes = rng.choice([None, None, 2000, 8000, 40_000])
    kills = tuple(rng.choice([("start", 0), ("workers", 0), ("lock", 0), ("commit", 1),
                              ("commit", rng.randint(1, 8)), ("commit", rng.randint(1, 8)),
                              ("end", 0)])
                  for _ in range(rng.choice([1, 1, 2, 3])))
    changes = [None] * 6 + ["shard_tokens", "input same size", "input grown"] + \
        (["unit_bytes"] if unit_bytes else []) + \
        (["transform edited"] if transform == "chat" and
         "transform edited" not in KNOWN_FAILURES else [])
    change = rng.choice(changes)
    if change and change.startswith("input"):  # the first input, in the first shards: textual
        files = ((rng.choice(["txt", "jsonl", "csv", "json"]), files[0][1]),) + files[1:]
    return PrepareScenario(
        seed, files, rng.choice(["file", "lines", "paragraphs"]),
        rng.choice(["bytes", "bytes", "bytes", "bpe"]), transform,
        rng.choice([None, None, 0.1, 0.3]), rng.choice([2000, 4000, 8000]), unit_bytes,
        rng.random() < 0.15, tuple(rng.choice([1, 2, 2, 3]) for _ in range(len(kills) + 1)),
        kills, change)


# ---- the corpus ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def paragraphs() -> tuple[str, ...]:
    """About 400 KB of real text (the standard library's sources) cut at blank lines."""
    from conftest import stdlib_texts
    return tuple(p for t in stdlib_texts(400_000) for p in t.split("\n\n") if p.strip())


def documents(rng: random.Random, n: int) -> list[str]:
    """``n`` documents of real text (paragraphs of the standard library's sources, some joined),
    from a place of the library that ``rng`` picks."""
    paras = paragraphs()
    start = rng.randrange(len(paras) - 4 * n)
    return ["\n\n".join(paras[start + 3 * i:start + 3 * i + rng.randint(1, 3)])
            for i in range(n)]


def write_input(path: Path, fmt: str, docs: list[str], txt_mode: str, bad: bool,
                rng: random.Random) -> Path:
    """``docs`` as one input file of format ``fmt`` (a malformed line among them if ``bad``)."""
    path = path.with_name(f"{path.name}.{fmt}")
    records = [{"title": f"doc {i}", "text": t} for i, t in enumerate(docs)]
    if fmt == "txt":
        if txt_mode == "lines":
            docs = [" ".join(d.split()) for d in docs]
        path.write_text(("\n" if txt_mode == "lines" else "\n\n").join(docs) + "\n",
                        encoding="utf-8")
    elif fmt in ("jsonl", "jsonl.gz"):
        lines = [json.dumps(r) for r in records]
        if bad:
            lines.insert(rng.randrange(len(lines)), '{"text": "cut short')
        data = ("\n".join(lines) + "\n").encode()
        path.write_bytes(gzip.compress(data, mtime=0) if fmt.endswith(".gz") else data)
    elif fmt == "csv":
        buf = io.StringIO()
        writer = csv.DictWriter(buf, ["title", "text"])
        writer.writeheader()
        writer.writerows(records)
        path.write_text(buf.getvalue(), encoding="utf-8")
    elif fmt == "json":
        path.write_text(json.dumps(records, indent=rng.choice([None, 1])), encoding="utf-8")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(records), path,
                       row_group_size=max(1, len(records) // rng.randint(1, 4)))
    return path


def write_corpus(scn: PrepareScenario, root: Path) -> Path:
    """The scenario's input files, in ``root/src``."""
    rng = random.Random(scn.seed)
    src = root / "src"
    src.mkdir(parents=True)
    for i, (fmt, n) in enumerate(scn.files):
        write_input(src / f"part-{i:02d}", fmt, documents(rng, n), scn.txt_mode,
                    scn.bad_records, rng)
    return src


TEXTUAL = (".jsonl", ".txt", ".csv", ".json")  # inputs edited in place between kill and rerun


def change_input(src: Path, grow: bool) -> None:
    """Between the kill and the rerun, the first input (textual: ``draw`` sees to it; its first
    documents are in the first shards) changes: one word in capitals, its size and modification
    time kept (``grow`` False), or grown by a word."""
    path = sorted(src.iterdir())[0]
    assert path.suffix in TEXTUAL, path
    data, stat = path.read_bytes(), path.stat()
    at = data.index(b" the ")
    path.write_bytes(data[:at] + (b" THE THE " if grow else b" THE ") + data[at + 5:])
    if not grow:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


# ---- running a scenario -------------------------------------------------------------------------

@dataclass
class PrepareRun:
    """What one scenario is running: its folder, its inputs and settings, figures."""

    scn: PrepareScenario
    root: Path
    src: Path
    tokenizers: dict[str, str]
    replay: str
    figures: dict
    leave_out_known: bool = True  # random scenarios: changes that meet a known failure left out

    def fail(self, what: str) -> None:
        raise ScenarioFailed(f"prepare scenario failed: {what}\n  scenario: {self.scn.line()}\n"
                             f"  replay: {self.replay}")

    def count(self, key: str, n: int = 1) -> None:
        self.figures[key] = self.figures.get(key, 0) + n

    @property
    def module(self) -> str:
        return f"fuzz_transforms_{self.scn.seed}"

    def settings(self, **changed) -> dict:
        """prepare's keyword arguments for this scenario (``changed`` on top)."""
        s = self.scn
        out = {"tokenizer": self.tokenizers[s.tokenizer], "shard_tokens": s.shard_tokens,
               "txt_mode": s.txt_mode, "on_error": "skip" if s.bad_records else "raise",
               "transform": f"{self.module}:{s.transform}" if s.transform else None,
               "val_fraction": s.val_fraction, "unit_bytes": s.unit_bytes}
        out.update(changed)
        return out

    def command(self, settings: dict, out: Path, workers: int, overwrite: bool = False) -> list:
        """The prepare command: the CLI, or (a unit size asked for) the Python API in a child."""
        from faults.conftest import program
        if settings["unit_bytes"] is not None:
            args = {k: v for k, v in settings.items() if v is not None}
            return program("prepare", json.dumps({"inputs": [str(self.src)], "out": str(out),
                                                  "workers": workers, "overwrite": overwrite,
                                                  **args}))
        cmd = [sys.executable, "-m", "tokenmill", "prepare", str(self.src), "--out", str(out),
               "--tokenizer", settings["tokenizer"], "--workers", str(workers),
               "--shard-tokens", str(settings["shard_tokens"]), "--txt-mode",
               settings["txt_mode"], "--on-error", settings["on_error"], "--quiet"]
        for flag, key in (("--transform", "transform"), ("--val-fraction", "val_fraction")):
            if settings[key] is not None:
                cmd += [flag, str(settings[key])]
        return cmd + (["--overwrite"] if overwrite else [])

    def env(self, tmpdir: Path) -> dict:
        """A child's environment: its own TMPDIR (checked afterwards), the transforms importable."""
        from faults.conftest import child_env
        env = child_env(tmpdir)
        env["PYTHONPATH"] = os.pathsep.join([str(self.root / "mods"), env["PYTHONPATH"]])
        return env

    def reference(self, name: str, settings: dict) -> dict[str, bytes]:
        """Every file of an uninterrupted run (one worker) with ``settings``: in this process, or
        (a transform: imported afresh) in a child."""
        out = self.root / name
        if settings["transform"] is None:
            from tokenmill.base.errors import TokenmillError
            from tokenmill.prepare import prepare
            try:
                prepare([str(self.src)], out=out, workers=1, progress=False,
                        **{k: v for k, v in settings.items() if v is not None})
            except TokenmillError as e:
                self.refused(str(e))
            return snapshot(out)
        done = subprocess.run(self.command(settings, out, 1), env=self.env(self.root / "t-ref"),
                              cwd=self.root, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            self.refused(last_line(done.stderr))
        return snapshot(out)

    def refused(self, why: str) -> None:
        """The uninterrupted run failed: Void if rightly (a --val-fraction side that no
        document falls on: a corpus of a few .txt files in file mode), else a failure."""
        if "falls on the" in why:
            raise Void(why)
        self.fail(f"the uninterrupted run failed: {why}")


class Void(Exception):
    """The scenario asks for what prepare rightly refuses: nothing to check."""


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file below path (hidden and nested too), by relative name."""
    from faults.conftest import files_under
    return {name: (path / name).read_bytes() for name in files_under(path)}


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def sides(out: Path) -> list[Path]:
    """The stores a run writes: ``out``, or ``out/train`` and ``out/val``."""
    return [out / "train", out / "val"] if (out / "train").exists() or \
        (out / "val").exists() else [out]


def progress(out: Path) -> int:
    """Shards committed so far (a finished side counts its manifest's)."""
    n = 0
    for side in sides(out):
        try:
            n += len(json.loads((side / "manifest.json").read_text())["shards"])
        except (OSError, ValueError, KeyError):
            n += len(list((side / ".progress").glob("shard-*.json")))
    return n


def due(kind: str, k: int, proc: subprocess.Popen, out: Path) -> bool:
    """Has the run reached the kill point (kind, k) of its own progress? ("end": never; with one
    worker, prepare runs in its own process: "workers" never comes either)"""
    from faults.conftest import descendants
    if kind == "end":
        return False
    if kind == "start":
        return True
    if kind == "workers":
        return bool(descendants(proc.pid))
    if kind == "lock":
        return any(out.glob(".lock")) or any(out.glob("*/.lock"))
    return progress(out) >= k


def kill_at(run: PrepareRun, cmd: list, env: dict, out: Path, kind: str, k: int):
    """Start ``cmd``; SIGSTOP it at the kill point, list its processes and shared memory, SIGKILL
    it: (its descendants, their /dev/shm names, whether it had finished)."""
    from faults.conftest import stop_and_kill
    proc = subprocess.Popen(cmd, env=env, cwd=run.root, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not due(kind, k, proc, out) and proc.poll() is None:
            if time.monotonic() > deadline:
                run.fail(f"prepare reached no {kind} {k} in 120 s: it stalls")
            time.sleep(0.002)
    finally:
        kids, shm, _ = stop_and_kill(proc)
    return kids, shm, proc.returncode == 0


def check(scn: PrepareScenario, tmp: Path, tokenizers: dict[str, str], *,
          replay: str = "", timeout_s: float = 600, leave_out_known: bool = True) -> dict:
    """Run ``scn`` under ``tmp``; ScenarioFailed (one line, and ``replay``) if a promise broke.
    ``leave_out_known=False`` (the fixed scenarios): make the changes of known failures too."""
    root = tmp / f"prepare-{scn.seed}"
    (root / "mods").mkdir(parents=True)
    run = PrepareRun(scn, root, write_corpus(scn, root), tokenizers, replay, {}, leave_out_known)
    try:
        with watchdog(timeout_s, scn.line()):
            (root / "mods" / f"{run.module}.py").write_text(
                TRANSFORM_MODULE.format(template="<|user|>{}<|end|>"))
            settings = run.settings()
            ref = run.reference("reference", settings)
            out = root / "out"
            for j, (kind, k) in enumerate(scn.kills):
                killed(run, j, run.command(settings, out, scn.workers[j]), out, kind, k, ref)
            settings, ref = changed(run, settings, ref)
            finish(run, settings, out, ref)
    except Void:
        run.count("void (a split side without documents)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return run.figures


def killed(run: PrepareRun, j: int, cmd: list, out: Path, kind: str, k: int,
           ref: dict[str, bytes]) -> None:
    """Run ``j``, killed at (kind, k): nothing left behind; every file it left that the
    uninterrupted run also has holds that run's bytes."""
    from faults.conftest import assert_nothing_left
    tmpdir = run.root / f"t-kill{j}"
    kids, shm, finished = kill_at(run, cmd, run.env(tmpdir), out, kind, k)
    run.count("kills")
    run.count("kills mid-run", not finished)
    try:
        assert_nothing_left(kids, shm, tmpdir, what=f"kill {j} ({kind} {k}): ")
    except AssertionError as e:
        run.fail(str(e).splitlines()[0])
    left = snapshot(out) if out.exists() else {}
    bad = sorted(n for n in left if n in ref and left[n] != ref[n])
    if bad:
        run.fail(f"kill {j} ({kind} {k}) left {bad[0]} with bytes other than the uninterrupted "
                 f"run's")


def changed(run: PrepareRun, settings: dict, ref: dict) -> tuple[dict, dict]:
    """Apply the scenario's change before the last run: the new settings and their reference."""
    what = run.scn.change
    if what is None:
        return settings, ref
    if what.startswith("input"):
        change_input(run.src, grow=what == "input grown")
    elif what == "transform edited":
        (run.root / "mods" / f"{run.module}.py").write_text(
            TRANSFORM_MODULE.format(template="<|assistant|>{}<|end|>"))
    else:
        settings = {**settings, what: settings[what] * 2 if what == "shard_tokens"
                    else settings[what] // 2}
    return settings, run.reference("reference-changed", settings)


def finish(run: PrepareRun, settings: dict, out: Path, ref: dict[str, bytes]) -> None:
    """The last run goes to its end: the store is the uninterrupted run's, every file; after a
    change it may instead be refused with one line, and then --overwrite gives that store."""
    from tokenmill.store import verify_store
    cmd = run.command(settings, out, run.scn.workers[-1])
    done = subprocess.run(cmd, env=run.env(run.root / "t-last"), cwd=run.root,
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        if run.scn.change is None:
            run.fail(f"the rerun failed: {last_line(done.stderr)}")
        cli = settings["unit_bytes"] is None  # (the Python API raises: a traceback is its way)
        if cli and ("Traceback" in done.stderr or len(done.stderr.strip().splitlines()) != 1):
            run.fail(f"the rerun was refused without one line: {done.stderr.strip()[-300:]}")
        run.count("reruns refused")
        done = subprocess.run(run.command(settings, out, run.scn.workers[-1], overwrite=True),
                              env=run.env(run.root / "t-over"), cwd=run.root,
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            run.fail(f"the rerun with --overwrite failed: {last_line(done.stderr)}")
    got = snapshot(out)
    if got != ref:
        diff = sorted(set(got) ^ set(ref)) or sorted(n for n in ref if got[n] != ref[n])
        run.fail(f"the finished store differs from the uninterrupted run's: {diff[:3]}")
    for side in sides(out):
        if (problems := verify_store(side)):
            run.fail(f"verify {side.name}: {problems[0]}")
    run.count("stores byte-identical")
