"""``prepare(..., engine="ray")``: the local engine's work units, tokenized and written as whole
shards by Ray tasks, the manifest written last by the driver; byte-identical to the local engine.

    tokenmill.prepare(["s3://bucket/raw/*.jsonl.zst"], out="s3://bucket/store",
                      tokenizer="/shared/tokenizer.json", engine="ray", ray_address="auto")

A shard closes at the first document boundary at or past ``shard_tokens``, so where a shard starts
depends on the token count of everything before it: no task can know it alone. So, in order:

1. *stage* (a task per unit; the units of ``sources.plan_units``, as the local engine): tokenize the
   unit, write its tokens, then its document lengths and skips, to the staging folder (each file
   atomically) and return the lengths and skips. A unit staged by an interrupted run with the same
   resume key is read back instead of tokenized again.
2. The driver walks the units in order with ``ShardWriter``'s rule (``cut``) and turns the stream
   into shards, each a list of (unit, token range) slices.
3. *write* (a task per shard): read the slices, write ``shard-NNNNN.bin``/``.idx`` (atomically: a
   temporary name and a rename, or one object put for a URL), return its ``ShardInfo``.
4. The driver commits finished shards in order with the local engine's progress records
   (``.progress/shard-NNNNN.json``: entry, cursor, skips up to the cursor), so either engine
   finishes the other's interrupted run; then the manifest, last; then staging is removed.

Staging, beside the shards (a shared filesystem or a URL every node reaches)::

    <out>/.progress/units/unit-NNNNNNN.bin    the unit's tokens, little-endian, store dtype
    <out>/.progress/units/unit-NNNNNNN.json   {"key", "unit", "num_tokens", "lengths", "skips"}

A unit's files are deleted once a committed shard's cursor has passed it. At most ``window``
(2 × CPUs) tasks are in flight and at most ``window`` staged units wait for their turn, so the
driver holds the document lengths of at most that many units. Progress is tokenmill's own bar on
the driver (plain Ray tasks show none; worker logs are not forwarded).
"""

from __future__ import annotations

import json
import os
import shutil
from collections import deque
from dataclasses import asdict, astuple, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import xxhash

from tokenmill import remote, sources
from tokenmill.errors import ConfigError, InputError, StoreError, TokenmillError
from tokenmill.prepare import (MANIFEST, PROGRESS, PrepareConfig, SkipLog,
                               _Progress, _report, resolve_workers, start_run, summary_line,
                               tokenize_unit, unit_weights)
from tokenmill.store import (ShardInfo, atomic_write_bytes, atomic_write_json, build_manifest,
                             idx_bytes, json_bytes, shard_name)
from tokenmill.tokenizer import load_tokenizer

UNITS = "units"
_TOKENIZERS: dict[tuple, Any] = {}  # per Ray worker process: loaded once, reused by its tasks


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
        return path if remote.is_url(path) else os.path.join(self.cwd, path)


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

def stage_unit(job: Job, u: int, unit: sources.Unit
               ) -> tuple[int, np.ndarray, list[tuple[int, sources.Skip]], int]:
    """Tokenize ``unit`` (number ``u``) into staging, or read back what an interrupted run
    staged; returns (u, document lengths, skips by document ordinal, num_tokens)."""
    dtype = np.dtype(job.dtype).newbyteorder("<")
    tokens_file, meta_file = job.unit_file(u, ".bin"), job.unit_file(u, ".json")
    meta = _read_json(meta_file, job.storage_options)
    if (meta is not None and meta["key"] == job.key and meta["unit"] == list(astuple(unit))
            and _size(tokens_file, job.storage_options) == meta["num_tokens"] * dtype.itemsize):
        skips = [(o, sources.Skip(**s)) for o, s in meta["skips"]]
        return u, np.asarray(meta["lengths"], dtype=np.int64), skips, meta["num_tokens"]
    res = tokenize_unit(replace(unit, path=job.local(unit.path)), job.config, job.storage_options,
                        _worker_tokenizer(job))
    skips = [(o, replace(s, path=unit.path)) for o, s in res.skips]  # named as the driver names it
    _put(tokens_file, res.tokens.astype(dtype).tobytes(), job.storage_options)
    meta = {"key": job.key, "unit": list(astuple(unit)), "num_tokens": len(res.tokens),
            "lengths": res.lengths.tolist(), "skips": [(o, asdict(s)) for o, s in skips]}
    _put(meta_file, json_bytes(meta), job.storage_options)  # last: it vouches for the tokens
    return u, res.lengths, skips, len(res.tokens)


def _worker_tokenizer(job: Job):
    """The job's tokenizer, loaded once per Ray worker process."""
    c = job.config
    spec = c.tokenizer if c.tokenizer == "bytes" else job.local(c.tokenizer)
    if (key := (spec, c.fast_tokenizer, c.eos, c.bos)) not in _TOKENIZERS:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one task per core already
        _TOKENIZERS[key] = load_tokenizer(spec, fast=c.fast_tokenizer, eos=c.eos, bos=c.bos)
    return _TOKENIZERS[key]


def write_shard(job: Job, index: int, pieces: list[tuple[int, int, int]],
                lengths: np.ndarray) -> tuple[int, ShardInfo]:
    """Write shard ``index`` from token ranges ``(unit, start, stop)`` of staged units; returns
    (index, its ShardInfo) — the bytes ``ShardWriter`` writes for the same documents."""
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
    _put(f"{job.out}/{name}.bin", data, job.storage_options)
    _put(f"{job.out}/{name}.idx", idx, job.storage_options)
    return index, ShardInfo(name=name, num_documents=len(lengths), num_tokens=len(tokens),
                            bin_bytes=data.nbytes, idx_bytes=len(idx),
                            bin_xxh3=xxhash.xxh3_64_hexdigest(data),
                            idx_xxh3=xxhash.xxh3_64_hexdigest(idx))


def _put(path: str, data, storage_options) -> None:
    """Write a whole file atomically: temporary name and rename, or a single object put."""
    if remote.is_url(path):
        fs, p = remote._fs(path, storage_options)
        fs.pipe_file(p, bytes(data))
    else:
        atomic_write_bytes(path, data)


def _read_into(path: str, offset: int, view: memoryview, storage_options) -> None:
    if remote.is_url(path):
        fs, p = remote._fs(path, storage_options)
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
        if remote.is_url(path):
            fs, p = remote._fs(path, storage_options)
            return json.loads(fs.cat_file(p))
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (FileNotFoundError, ValueError):
        return None


def _size(path: str, storage_options) -> int | None:
    try:
        if remote.is_url(path):
            fs, p = remote._fs(path, storage_options)
            return int(fs.size(p))
        return os.path.getsize(path)
    except (FileNotFoundError, OSError):
        return None


def _remove(path: str, storage_options, *, recursive: bool = False) -> None:
    if remote.is_url(path):
        fs, p = remote._fs(path, storage_options)
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
    config, target, out, tok, dtype = run.config, run.target, run.out, run.tok, run.dtype
    files, sizes, settings, key = run.files, run.sizes, run.settings, run.key
    shards, cursor, skips = run.shards, run.cursor, run.skips
    units = sources.plan_units(files, config.source_config(storage_options))
    where = target.url if target else os.path.abspath(out)
    job = Job(config=config, out=where, staging=f"{where}/{PROGRESS}/{UNITS}",
              dtype=np.dtype(dtype).name, key=xxhash.xxh3_64_hexdigest(json_bytes(key)),
              cwd=os.getcwd(), storage_options=storage_options)
    if target:
        fs, p = remote._fs(job.staging, storage_options)
        fs.makedirs(p, exist_ok=True)  # a no-op on object stores
    else:
        Path(job.staging).mkdir(parents=True, exist_ok=True)
    weights = unit_weights(units, sizes)
    meter = _Progress(total=sum(weights), enabled=progress, done=sum(weights[:cursor[0]]))

    def commit(info: ShardInfo, at: tuple[int, int]) -> None:
        shards.append(info)
        atomic_write_json(out / PROGRESS / f"{info.name}.json",
                          {"shard": info.to_json(), "cursor": list(at), "skipped": skips.to_json()})

    owned = _connect(ray, address, workers)
    try:
        window = 2 * (workers if isinstance(workers, int) else
                      max(1, int(ray.cluster_resources().get("CPU", 1))))
        _run(ray, job, units, cursor, len(shards), skips, commit, meter, window, weights)
    finally:
        meter.close()
        if owned:
            ray.shutdown()
    if not shards:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(skips.by_reason.items())) or "none"
        raise InputError(f"no documents found in {len(files)} input file(s) (skipped: {reasons})")
    manifest = build_manifest(tokenizer=tok.identity(), dtype=dtype, shards=shards,
                              settings=settings, skipped=skips.to_json())
    if target:
        target.write_manifest(json_bytes(manifest))
        shutil.rmtree(out, ignore_errors=True)
    else:
        atomic_write_json(out / MANIFEST, manifest)
        shutil.rmtree(out / PROGRESS, ignore_errors=True)
    _remove(f"{where}/{PROGRESS}", storage_options, recursive=True)
    _report(summary_line(manifest), progress)
    return manifest


def _connect(ray, address: str | None, workers: int | str) -> bool:
    """Initialize Ray unless this process already did; True if we did (and shut it down)."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    kwargs: dict[str, Any] = {}
    if address == "local":  # a private instance on this machine, gone with this process
        kwargs = dict(num_cpus=resolve_workers(workers), include_dashboard=False)
    ray.init(address=address, log_to_driver=False, configure_logging=False, **kwargs)
    return True


def _run(ray, job: Job, units: Sequence[sources.Unit], cursor: tuple[int, int], first_shard: int,
         skips: SkipLog, commit, meter: _Progress, window: int, weights: list[float]) -> None:
    """Stage units, cut shards in unit order, write them, commit them in shard order."""
    stage = ray.remote(stage_unit).options(num_cpus=1)
    write = ray.remote(write_shard).options(num_cpus=1)
    job_ref = ray.put(job)
    n_units, shard_tokens = len(units), job.config.shard_tokens
    inflight: dict[Any, str] = {}  # ObjectRef → "stage" | "write"
    staged: dict[int, tuple[np.ndarray, list]] = {}  # finished units not yet cut
    ready: deque[tuple[int, list, np.ndarray, tuple[int, int]]] = deque()  # shards to write
    finished: dict[int, ShardInfo] = {}
    cursors: dict[int, tuple[int, int]] = {}
    pending_skips: deque[tuple[int, int, sources.Skip]] = deque()
    next_unit = frontier = cursor[0]
    next_shard = commit_next = first_shard
    pieces: list[tuple[int, int, int]] = []
    piece_lengths: list[np.ndarray] = []
    fill = 0
    removed = cursor[0]  # staged units below this are gone

    def close(at: tuple[int, int]) -> None:
        nonlocal next_shard, pieces, piece_lengths, fill
        ready.append((next_shard, pieces, np.concatenate(piece_lengths), at))
        cursors[next_shard] = at
        next_shard, pieces, piece_lengths, fill = next_shard + 1, [], [], 0

    def consume(u: int, lengths: np.ndarray, unit_skips: list) -> None:
        nonlocal fill
        d0 = cursor[1] if u == cursor[0] else 0
        t0 = int(lengths[:d0].sum())
        lengths = lengths[d0:]
        pending_skips.extend((u, o, s) for o, s in unit_skips if o >= d0)
        ends = np.concatenate([[0], np.cumsum(lengths)])
        closes, after = cut(lengths, fill, shard_tokens)
        start = 0
        for stop in closes:
            pieces.append((u, t0 + int(ends[start]), t0 + int(ends[stop])))
            piece_lengths.append(lengths[start:stop])
            close((u, d0 + stop))
            start = stop
        if start < len(lengths):
            pieces.append((u, t0 + int(ends[start]), t0 + int(ends[-1])))
            piece_lengths.append(lengths[start:])
        fill = after

    def commit_in_order() -> None:
        nonlocal commit_next, removed
        while commit_next in finished:
            at = cursors.pop(commit_next)
            while pending_skips and pending_skips[0][:2] < at:
                skips.add(pending_skips.popleft()[2])
            commit(finished.pop(commit_next), at)
            commit_next += 1
            for u in range(removed, at[0]):  # every shard that reads unit u is committed
                for ext in (".bin", ".json"):
                    _remove(job.unit_file(u, ext), job.storage_options)
            removed = max(removed, at[0])

    try:
        while next_unit < n_units or inflight or ready:
            while ready and len(inflight) < window:
                index, shard_pieces, lengths, _ = ready.popleft()
                inflight[write.remote(job_ref, index, shard_pieces, lengths)] = "write"
            stages = sum(kind == "stage" for kind in inflight.values())
            while (not ready and next_unit < n_units and len(inflight) < window
                   and stages + len(staged) < window):
                inflight[stage.remote(job_ref, next_unit, units[next_unit])] = "stage"
                next_unit, stages = next_unit + 1, stages + 1
            if not inflight:
                continue
            (ref,), _ = ray.wait(list(inflight), num_returns=1)
            kind = inflight.pop(ref)
            if kind == "write":
                index, info = _get(ray, ref)
                finished[index] = info
                commit_in_order()
                continue
            u, lengths, unit_skips, n_tokens = _get(ray, ref)
            staged[u] = (lengths, unit_skips)
            meter.update(weights[u], docs=len(lengths), tokens=n_tokens)
            while frontier in staged:
                consume(frontier, *staged.pop(frontier))
                frontier += 1
            if frontier == n_units and pieces:  # ShardWriter.finish: the last, partly filled shard
                if fill > 0:
                    close((n_units, 0))
                pieces, piece_lengths = [], []  # trailing documents of 0 tokens: dropped there too
        while pending_skips:
            skips.add(pending_skips.popleft()[2])
    except BaseException:
        for ref in inflight:
            ray.cancel(ref)
        raise


def _get(ray, ref):
    """``ray.get``; a tokenmill error from a task is re-raised as itself."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, TokenmillError):
            raise e.cause from e
        raise
