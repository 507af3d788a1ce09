"""``prepare(..., engine="ray")``: the local engine's work units, tokenized and written as whole
shards by Ray tasks, the manifest written last by the driver; byte-identical to the local engine.

    tokenmill.prepare(["s3://bucket/raw/*.jsonl.zst"], out="s3://bucket/store",
                      tokenizer="/shared/tokenizer.json", engine="ray", ray_address="auto")

A shard closes at the first document boundary at or past ``shard_tokens``, so where a shard starts
depends on the token count of everything before it: no task can know it alone. So, in order:

1. *stage* (a task per unit; the units of ``sources.plan_units``, as the local engine): tokenize the
   unit, write its tokens, then its document lengths and skips, to the staging folder (each file
   atomically) and return them. A unit staged by an interrupted run with the same resume key is
   read back instead of tokenized again.
2. The driver walks the units in order with ``ShardWriter``'s rule (``cut``) and turns the stream
   into shards, each a list of (unit, token range) slices.
3. *write* (a task per shard): read the slices, write ``shard-NNNNN.bin``/``.idx`` (atomically: a
   temporary name and a rename, or one object put for a URL), return its ``ShardInfo``.
4. The driver commits finished shards in order through the output's one writer
   (``store.writer.StoreWriter``: the lock, ``.progress`` records, the manifest last) — the same
   records as the local engine's, so either engine finishes the other's interrupted run.

Staging, beside the shards (a shared filesystem or a URL every node reaches)::

    <out>/.progress/units/unit-NNNNNNN.bin    the unit's tokens, little-endian, store dtype
    <out>/.progress/units/unit-NNNNNNN.json   {"key", "unit", "num_tokens", "lengths", "skips",
                                               "digest", "lines", "newlines", "texts"}

Each shard's ``.src`` (where its documents came from) is written by its write task; the driver
turns staged lines into lines of the file in unit order (``prepare.run.origins_of``).

A unit's files are deleted once a committed shard's cursor has passed it. At most ``window``
(2 × CPUs) tasks are in flight and at most ``window`` staged units wait for their turn, so the
driver holds the document lengths of at most that many units. Progress is tokenmill's own bar on
the driver (plain Ray tasks show none; worker logs are not forwarded).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections import deque
from dataclasses import asdict, astuple, dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import numpy as np
import xxhash

from tokenmill.inputs import sources
from tokenmill.base.errors import ConfigError, StoreError, Terminated, TokenmillError
from tokenmill.base.io import FileId, atomic_write_bytes, filesystem, is_url, json_bytes
from tokenmill.prepare.run import (Progress, Run, finish, notify, origins_of, start_run,
                                   summary_line, unit_weights)
from tokenmill.prepare.tokenize import PrepareConfig, config_tokenizer, tokenize_unit
from tokenmill.base.procs import (SigtermExits, children, command_line, end_trees, resolve_workers,
                                  sigterm_exits)
from tokenmill.store.format import Origins, idx_bytes, shard_name, src_bytes
from tokenmill.store.writer import PROGRESS, ShardInfo

UNITS = "units"


def _ray():
    try:
        import ray
    except ImportError as e:
        raise ConfigError(f"engine='ray' needs Ray ({e}); pip install 'tokenmill[ray]'") from None
    return ray


@dataclass(frozen=True)
class Job:
    """What every task needs; put in Ray's object store once."""

    config: PrepareConfig
    out: str  # shard directory or URL
    staging: str  # staged units: a directory or URL
    dtype: str
    key: str  # xxh3 of the resume key: a staged unit of other settings is never reused
    cwd: str  # relative paths are the driver's; a Ray worker may run elsewhere
    storage_options: dict | None = None

    def unit_file(self, u: int, ext: str) -> str:
        """Where unit ``u``'s staged tokens (``.bin``) or lengths and skips (``.json``) go."""
        return f"{self.staging}/unit-{u:07d}{ext}"

    def local(self, path: str) -> str:
        """``path`` as the driver meant it, from any working directory."""
        return path if is_url(path) else os.path.join(self.cwd, path)


class Staged(NamedTuple):
    """A stage task's answer: unit ``index``'s document lengths, skips by document ordinal, its
    token count, the xxh3 of its input bytes, its documents' lines and its newline count (as
    ``UnitResult``'s)."""

    index: int
    lengths: np.ndarray
    skips: list[tuple[int, sources.Skip]]
    num_tokens: int
    digest: str | None = None
    lines: np.ndarray | None = None
    newlines: int = 0
    texts: str | None = None  # a split's: UnitResult.texts


class Written(NamedTuple):
    """A write task's answer: shard ``index`` is in place."""

    index: int
    info: ShardInfo


def cut(lengths: np.ndarray, fill: int, shard_tokens: int) -> tuple[list[int], int]:
    """Where shards close in a run of documents, ``fill`` tokens into the open shard: the
    document counts after which each closes, and the open shard's tokens after the run
    (``ShardWriter.add``'s rule: at the first document boundary at or past ``shard_tokens``).

    cut(np.array([3, 3, 3]), fill=0, shard_tokens=5) == ([2], 3)
    """
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    closes, tok = [], 0
    while not closes or closes[-1] < len(ends):
        stop = int(np.searchsorted(ends, tok + shard_tokens - fill, side="left")) + 1
        if stop > len(ends):
            return closes, fill + (int(ends[-1]) - tok if len(ends) else 0)
        closes.append(stop)
        tok, fill = int(ends[stop - 1]), 0
    return closes, 0


# ---- tasks ----------------------------------------------------------------------------------

def stage_unit(job: Job, u: int, unit: sources.Unit) -> Staged:
    """Tokenize ``unit`` (number ``u``) into staging, or read back what an interrupted run
    staged."""
    dtype = np.dtype(job.dtype).newbyteorder("<")
    tokens_file, meta_file = job.unit_file(u, ".bin"), job.unit_file(u, ".json")
    meta = _read_json(meta_file, job.storage_options)
    if (meta is not None and meta["key"] == job.key and meta["unit"] == unit_record(unit)
            and "lines" in meta  # staged before origins were recorded: redone
            and _size(tokens_file, job.storage_options) == meta["num_tokens"] * dtype.itemsize):
        skips = [(o, sources.Skip(**s)) for o, s in meta["skips"]]
        return Staged(u, np.asarray(meta["lengths"], dtype=np.int64), skips, meta["num_tokens"],
                      meta.get("digest"), np.asarray(meta["lines"], dtype=np.int64),
                      meta["newlines"], meta.get("texts"))
    c = job.config
    # a file path is the driver's (relative to its folder); a name (cl100k_base, org/name) is not
    spec = job.local(c.tokenizer)
    spec = spec if c.tokenizer != "bytes" and os.path.exists(spec) else c.tokenizer
    tok = config_tokenizer(spec, c.tokenizer_engine, c.eos, c.bos)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one task per core already
    res = tokenize_unit(on_this_machine(unit, job), c, job.storage_options, tok)
    skips = [(o, replace(s, path=unit.path)) for o, s in res.skips]  # named as the driver names it
    _put(tokens_file, res.tokens.astype(dtype).tobytes(), job.storage_options)
    meta = {"key": job.key, "unit": unit_record(unit), "num_tokens": len(res.tokens),
            "lengths": res.lengths.tolist(), "skips": [(o, asdict(s)) for o, s in skips],
            "digest": res.digest, "lines": res.lines.tolist(), "newlines": res.newlines,
            "texts": res.texts}
    _put(meta_file, json_bytes(meta), job.storage_options)  # last: it vouches for the tokens
    return Staged(u, res.lengths, skips, len(res.tokens), res.digest, res.lines, res.newlines,
                  res.texts)


def unit_record(unit: sources.Unit) -> list:
    """A unit as its staged ``.json`` records it (the file's identity as a list)."""
    return json.loads(json_bytes(astuple(unit)))


def on_this_machine(unit: sources.Unit, job: Job) -> sources.Unit:
    """``unit`` as a task reads it: its path the driver's, its file's identity without device and
    inode (another machine's mount of a shared filesystem numbers them otherwise)."""
    ident = unit.ident._replace(dev=0, ino=0) if isinstance(unit.ident, FileId) else unit.ident
    return replace(unit, path=job.local(unit.path), ident=ident)


def write_shard(job: Job, index: int, pieces: list[tuple[int, int, int]],
                lengths: np.ndarray, origins: Origins) -> Written:
    """Write shard ``index`` from token ranges ``(unit, start, stop)`` of staged units, and its
    documents' ``origins`` — the bytes ``ShardWriter`` writes for the same documents."""
    dtype = np.dtype(job.dtype)
    tokens = np.empty(sum(b - a for _, a, b in pieces), dtype=dtype.newbyteorder("<"))
    at = 0
    for u, a, b in pieces:
        view = memoryview(tokens[at:at + b - a]).cast("B")
        _read_into(job.unit_file(u, ".bin"), a * dtype.itemsize, view, job.storage_options)
        at += b - a
    data = memoryview(tokens).cast("B")
    idx = idx_bytes(lengths, dtype)
    name = shard_name(index)
    src = src_bytes(origins)
    _put(f"{job.out}/{name}.src", src, job.storage_options)
    _put(f"{job.out}/{name}.bin", data, job.storage_options)
    _put(f"{job.out}/{name}.idx", idx, job.storage_options)
    return Written(index, ShardInfo(name=name, num_documents=len(lengths), num_tokens=len(tokens),
                                    bin_bytes=data.nbytes, idx_bytes=len(idx),
                                    bin_xxh3=xxhash.xxh3_64_hexdigest(data),
                                    idx_xxh3=xxhash.xxh3_64_hexdigest(idx), src_bytes=len(src),
                                    src_xxh3=xxhash.xxh3_64_hexdigest(src)))


def _put(path: str, data, storage_options) -> None:
    """Write a whole file atomically: temporary name and rename, or a single object put."""
    if is_url(path):
        fs, p = filesystem(path, storage_options)
        fs.pipe_file(p, bytes(data))
    else:
        atomic_write_bytes(path, data)


def _read_into(path: str, offset: int, view: memoryview, storage_options) -> None:
    if is_url(path):
        fs, p = filesystem(path, storage_options)
        got = fs.cat_file(p, start=offset, end=offset + view.nbytes)
        n = len(got)
        view[:n] = got
    else:
        with open(path, "rb") as f:
            f.seek(offset)
            n = f.readinto(view)
    if n != view.nbytes:
        raise StoreError(f"{path}: staged unit holds {offset + n:,} bytes, expected at least "
                         f"{offset + view.nbytes:,}; run the same prepare again to redo it")


def _read_json(path: str, storage_options) -> dict | None:
    try:
        if is_url(path):
            fs, p = filesystem(path, storage_options)
            return json.loads(fs.cat_file(p))
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (FileNotFoundError, ValueError):
        return None


def _size(path: str, storage_options) -> int | None:
    try:
        if is_url(path):
            fs, p = filesystem(path, storage_options)
            return int(fs.size(p))
        return os.path.getsize(path)
    except (FileNotFoundError, OSError):
        return None


def _remove(path: str, storage_options, *, recursive: bool = False) -> None:
    if is_url(path):
        fs, p = filesystem(path, storage_options)
        try:
            fs.rm(p, recursive=recursive)
        except FileNotFoundError:
            pass
    elif recursive:
        shutil.rmtree(path, ignore_errors=True)
    else:
        Path(path).unlink(missing_ok=True)


# ---- driver ---------------------------------------------------------------------------------

def prepare_on_ray(inputs: Sequence[str], *, out: str | os.PathLike, tokenizer: str = "bytes",
                   workers: int | str = "auto", progress: bool | None = None,
                   overwrite: bool = False, storage_options: dict | None = None,
                   address: str | None = None, **options: Any) -> dict:
    """``tokenmill.prepare`` on Ray (see the module docstring); the same store, byte for byte.

    ``address``: None uses ``$RAY_ADDRESS`` if set, else starts a private Ray instance on this
    machine with ``workers`` CPUs; "auto" joins the cluster ``ray start`` made here; "HOST:PORT"
    joins that cluster. A Ray already initialized in this process is used as it is.
    """
    ray = _ray()
    run = start_run(inputs, out=out, tokenizer=tokenizer, overwrite=overwrite,
                    storage_options=storage_options, progress=progress, **options)
    if isinstance(run, dict):
        return run  # already complete
    writer = run.writer
    where = writer.remote.url if writer.remote else os.path.abspath(writer.out)
    job = Job(config=run.config, out=where, staging=f"{where}/{PROGRESS}/{UNITS}",
              dtype=writer.config.dtype,
              key=xxhash.xxh3_64_hexdigest(json_bytes(writer.config.key)), cwd=os.getcwd(),
              storage_options=storage_options)
    weights = unit_weights(run.units, run.sizes)
    meter = Progress(total=sum(weights), enabled=progress, done=sum(weights[:writer.cursor[0]]))
    # SIGTERM: Terminated, so the private Ray instance is stopped as for Ctrl-C (covering
    # finish too: the CLI's own handler is replaced by ray.init's)
    with sigterm_exits() as on_term:
        try:
            if is_url(job.staging):
                fs, staging = filesystem(job.staging, storage_options)
                fs.makedirs(staging, exist_ok=True)  # a no-op on object stores
            else:
                Path(job.staging).mkdir(parents=True, exist_ok=True)
            before = children()
            owned = _connect(ray, address, workers, on_term, before)
            on_term.arm()  # ray.init put in its own (sys.exit, after a C++ crash dump)
            try:
                window = 2 * (workers if isinstance(workers, int) else
                              max(1, int(ray.cluster_resources().get("CPU", 1))))
                Driver(ray, job, run, window, meter, weights).run()
            finally:
                if owned:
                    _shutdown(ray, before, on_term)
            manifest = finish(run)
        except BaseException:
            writer.abort()
            raise
        finally:
            meter.close()
    if writer.remote is not None:
        _remove(f"{where}/{PROGRESS}", storage_options, recursive=True)
    notify(summary_line(manifest), progress)
    return manifest


def _connect(ray, address: str | None, workers: int | str, on_term: SigtermExits,
             before: set[int]) -> bool:
    """Initialize Ray unless this process already did; True if we did (and shut it down). What
    a ``ray.init`` that fails half-way started (its own SIGTERM handler exits) is ended."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    kwargs: dict[str, Any] = {}
    if address == "local":  # a private instance on this machine, gone with this process
        kwargs = dict(num_cpus=resolve_workers(workers), include_dashboard=False)
    try:
        ray.init(address=address, log_to_driver=False, configure_logging=False, **kwargs)
    except BaseException as e:
        on_term.quiet = True  # a SIGTERM now would cut the cleanup short: only noted
        on_term.arm()
        # first, each of its processes stopped with what it started (a raylet still starting
        # dies of SIGTERM without ending its agents); then what ray.init set up in this process
        end_trees(_started_by_ray(before))
        ray.shutdown()
        on_term.arm()  # ray.shutdown leaves SIGTERM to the default action (a silent death)
        if isinstance(e, SystemExit) and e.code == signal.SIGTERM:  # ray.init's own handler
            raise Terminated() from None
        raise
    return True


def _shutdown(ray, before: set[int], on_term: SigtermExits) -> None:
    """``ray.shutdown()``, then the processes it signalled waited for (and ended if need be):
    gcs_server and raylet die with this process, killed, which would leave raylet's agents
    behind."""
    ray.shutdown()
    on_term.arm()  # ray.shutdown leaves SIGTERM to the default action (a silent death)
    end_trees(_started_by_ray(before))


def _started_by_ray(before: set[int]) -> set[int]:
    """This process's children that are not in ``before`` and whose command names ray."""
    return {pid for pid in children() - before if "ray" in command_line(pid)}


class ShardPlan(NamedTuple):
    """A shard the driver has cut: its index, token ranges of staged units, document lengths and
    origins."""

    index: int
    pieces: list[tuple[int, int, int]]
    lengths: np.ndarray
    origins: Origins


class Driver:
    """Stages units, cuts shards in unit order, writes them, commits them in shard order."""

    def __init__(self, ray, job: Job, run: Run, window: int, meter: Progress,
                 weights: list[float]):
        self.ray, self.job, self.writer, self.units = ray, job, run.writer, run.units
        self.window, self.meter, self.weights = window, meter, weights
        self.stage = ray.remote(stage_unit).options(num_cpus=1)
        self.write = ray.remote(write_shard).options(num_cpus=1)
        self.job_ref = ray.put(job)
        self.start = run.writer.cursor  # where reading resumes: (unit, doc)
        self.inflight: dict[Any, str] = {}  # ObjectRef → "stage" | "write"
        self.staged: dict[int, Staged] = {}  # finished units not yet cut
        self.ready: deque[ShardPlan] = deque()  # shards cut, to write
        self.written: dict[int, ShardInfo] = {}
        self.cursors: dict[int, tuple[int, int]] = {}
        self.next_unit = self.frontier = self.removed = self.start[0]
        self.next_shard = self.commit_next = len(run.writer.shards)
        self.pieces: list[tuple[int, int, int]] = []
        self.piece_lengths: list[np.ndarray] = []
        self.piece_origins: list[Origins] = []
        self.origins = origins_of(run.files, run.units, job.storage_options)
        self.fill = 0

    def run(self) -> None:
        """Until every unit is staged and every shard committed."""
        try:
            while self.next_unit < len(self.units) or self.inflight or self.ready:
                self.launch()
                if not self.inflight:
                    continue
                (ref,), _ = self.ray.wait(list(self.inflight), num_returns=1)
                kind = self.inflight.pop(ref)
                if kind == "write":
                    self.on_written(_get(self.ray, ref))
                else:
                    self.on_staged(_get(self.ray, ref))
        except BaseException:
            for ref in self.inflight:
                self.ray.cancel(ref)
            raise

    def launch(self) -> None:
        """Start write tasks for cut shards, then stage tasks, within the window."""
        while self.ready and len(self.inflight) < self.window:
            plan = self.ready.popleft()
            self.writer.pend(plan.index)  # before any of its files may appear
            self.inflight[self.write.remote(self.job_ref, *plan)] = "write"
        stages = sum(kind == "stage" for kind in self.inflight.values())
        while (not self.ready and self.next_unit < len(self.units)
               and len(self.inflight) < self.window and stages + len(self.staged) < self.window):
            task = self.stage.remote(self.job_ref, self.next_unit, self.units[self.next_unit])
            self.inflight[task] = "stage"
            self.next_unit, stages = self.next_unit + 1, stages + 1

    def on_staged(self, st: Staged) -> None:
        """Cut the units that are now in order into shards."""
        self.staged[st.index] = st
        self.meter.update(self.weights[st.index], docs=len(st.lengths), tokens=st.num_tokens)
        while self.frontier in self.staged:
            self.consume(self.staged.pop(self.frontier))
            self.frontier += 1
        n_units = len(self.units)
        if self.frontier == n_units and self.pieces:  # ShardWriter.finish: the last shard
            if self.fill > 0:
                self.close((n_units, 0))
            self.pieces, self.piece_lengths, self.piece_origins = [], [], []  # trailing 0-token
            # documents: dropped too

    def consume(self, st: Staged) -> None:
        """Unit ``st.index``'s documents (from the resume point on) into the shards being cut."""
        u = st.index
        d0 = self.start[1] if u == self.start[0] else 0
        self.writer.note_unit(u, d0, st.skips, st.digest, st.texts)
        t0 = int(st.lengths[:d0].sum())
        lengths, origins = st.lengths[d0:], self.origins(u, st).part(d0)
        ends = np.concatenate([[0], np.cumsum(lengths)])
        closes, after = cut(lengths, self.fill, self.job.config.shard_tokens)
        start = 0
        for stop in closes:
            self.pieces.append((u, t0 + int(ends[start]), t0 + int(ends[stop])))
            self.piece_lengths.append(lengths[start:stop])
            self.piece_origins.append(origins.part(start, stop))
            self.close((u, d0 + stop))
            start = stop
        if start < len(lengths):
            self.pieces.append((u, t0 + int(ends[start]), t0 + int(ends[-1])))
            self.piece_lengths.append(lengths[start:])
            self.piece_origins.append(origins.part(start))
        self.fill = after

    def close(self, at: tuple[int, int]) -> None:
        """The shard being cut ends here; reading resumes at ``at`` after it."""
        self.ready.append(ShardPlan(self.next_shard, self.pieces,
                                    np.concatenate(self.piece_lengths),
                                    Origins.concat(self.piece_origins)))
        self.cursors[self.next_shard] = at
        self.next_shard, self.pieces, self.piece_lengths, self.fill = self.next_shard + 1, [], [], 0
        self.piece_origins = []

    def on_written(self, done: Written) -> None:
        """Commit written shards in order; drop staged units no uncommitted shard reads."""
        self.written[done.index] = done.info
        while self.commit_next in self.written:
            at = self.cursors.pop(self.commit_next)
            self.writer.commit(self.written.pop(self.commit_next), at, in_place=True)
            self.commit_next += 1
            for u in range(self.removed, at[0]):  # every shard that reads unit u is committed
                for ext in (".bin", ".json"):
                    _remove(self.job.unit_file(u, ext), self.job.storage_options)
            self.removed = max(self.removed, at[0])


def _get(ray, ref):
    """``ray.get``; a tokenmill error from a task is re-raised as itself."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, TokenmillError):
            raise e.cause from e
        raise
