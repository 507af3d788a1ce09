"""Raw text → token store: sources split into units, tokenized by a process pool, written in order.

The main process plans work units (``sources.plan_units``), keeps at most ``2 × workers`` units
in flight in a spawn-started process pool (each worker reads *and* tokenizes a whole unit), and
hands the results to a ``store.ShardWriter`` strictly in unit order. Shard boundaries depend only
on the document stream, so the store is byte-identical for any worker count.

Resume: after each shard is renamed into place, ``.progress/shard-NNNNN.json`` commits it with the
input cursor ``(unit, documents of that unit already written)`` and the skip counts up to there.
A rerun with the same settings keeps the committed shards whose checksums verify, deletes
anything after them, and continues from the last cursor. The manifest is written last; the
``.progress`` folder is removed after it.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import xxhash

from tokenmill import remote, sources
from tokenmill.errors import ConfigError, InputError, StoreError, TokenmillError
from tokenmill.store import (MANIFEST, ShardInfo, ShardWriter, atomic_write_json, build_manifest,
                             json_bytes, parse_manifest, read_manifest, shard_name, xxh3_file)
from tokenmill.tokenizer import encode_documents, load_tokenizer, token_dtype
from tokenmill.workers import children_ignore_sigint

PROGRESS = ".progress"
MAX_EXAMPLES = 20
DEFAULT_SHARD_TOKENS = 1 << 26  # 64 Mi tokens: 128 MiB uint16 shards


@dataclass(frozen=True)
class PrepareConfig:
    """Everything that decides a store's bytes (worker count and progress display do not)."""

    tokenizer: str = "bytes"
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    text_key: str = "text"
    txt_mode: str = "file"
    on_error: str = "raise"
    add_eos: bool = True
    add_bos: bool = False
    eos: str | None = None
    bos: str | None = None
    fast_tokenizer: bool = True
    unit_bytes: int = 4 << 20  # 4 MiB units: small enough that 2 workers end together

    def __post_init__(self):
        if self.shard_tokens < 1:
            raise ConfigError(f"shard_tokens must be >= 1 (got shard_tokens={self.shard_tokens})")
        if self.unit_bytes < 1:
            raise ConfigError(f"unit_bytes must be >= 1 (got unit_bytes={self.unit_bytes})")

    def source_config(self, storage_options=None) -> sources.SourceConfig:
        """The part of the config the readers need."""
        return sources.SourceConfig(text_key=self.text_key, txt_mode=self.txt_mode,
                                    on_error=self.on_error, unit_bytes=self.unit_bytes,
                                    storage_options=storage_options)

    def settings(self, inputs: Sequence[str], files: Sequence[str], sizes: dict[str, int]) -> dict:
        """What the manifest records: the config minus display-only fields, plus the inputs."""
        s = asdict(self)
        s.pop("fast_tokenizer")  # both engines give identical ids (proven at load time)
        s.pop("unit_bytes")  # how work is split never changes the bytes (the resume key has it)
        s["inputs"] = list(inputs)
        s["num_files"] = len(files)
        s["files_xxh3"] = xxhash.xxh3_64_hexdigest("\n".join(f"{f}\t{sizes[f]}" for f in files).encode())
        return s


@dataclass
class UnitResult:
    """One tokenized unit: flat tokens, per-document lengths, and skips by document ordinal."""

    tokens: np.ndarray
    lengths: np.ndarray
    skips: list[tuple[int, sources.Skip]]
    chars: int


@dataclass
class SkipLog:
    """Counts and first examples of skipped inputs, in stream order."""

    by_reason: Counter = field(default_factory=Counter)
    examples: list[dict] = field(default_factory=list)

    def add(self, skip: sources.Skip) -> None:
        """Count one skip; keep it as an example if there are fewer than MAX_EXAMPLES."""
        self.by_reason[skip.reason] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append({"path": skip.path, "where": skip.where,
                                  "reason": skip.reason, "detail": skip.detail})

    def to_json(self) -> dict:
        """The manifest's ``skipped`` entry."""
        return {"total": sum(self.by_reason.values()),
                "by_reason": dict(sorted(self.by_reason.items())), "examples": list(self.examples)}

    @classmethod
    def from_json(cls, d: dict) -> SkipLog:
        """Rebuild from a ``to_json`` dict."""
        return cls(Counter(d["by_reason"]), list(d["examples"]))


# ---- worker side ----------------------------------------------------------------------------

_WORKER_TOKENIZER = None


def _init_worker(spec: str, fast: bool, eos: str | None, bos: str | None, parent: int) -> None:
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides how to stop
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = load_tokenizer(spec, fast=fast, eos=eos, bos=bos)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()


def _exit_with_parent(parent: int) -> None:
    # a parent killed with SIGKILL cannot stop us; do not outlive it
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def tokenize_unit(unit: sources.Unit, config: PrepareConfig, storage_options=None,
                  tokenizer=None) -> UnitResult:
    """Read one unit and tokenize its documents (EOS/BOS as configured)."""
    tok = tokenizer or _WORKER_TOKENIZER
    texts: list[str] = []
    skips: list[tuple[int, sources.Skip]] = []
    for item in sources.read_unit(unit, config.source_config(storage_options)):
        if isinstance(item, sources.Skip):
            skips.append((len(texts), item))
        else:
            texts.append(item)
    tokens, lengths = encode_documents(tok, texts, add_eos=config.add_eos,
                                       add_bos=config.add_bos, dtype=token_dtype(tok.vocab_size))
    return UnitResult(tokens, lengths, skips, sum(map(len, texts)))


# ---- main side ------------------------------------------------------------------------------

def resolve_workers(workers: int | str) -> int:
    """``"auto"`` → the cores this process may use; otherwise a positive int."""
    if workers == "auto":
        return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                   else os.cpu_count() or 1)
    if not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers must be a positive int or 'auto' (got {workers=!r})")
    return workers


def _ordered_results(units: Sequence[sources.Unit], first: int, workers: int,
                     config: PrepareConfig, storage_options, tokenizer) -> Iterator[tuple[int, UnitResult]]:
    """Yield (unit index, result) in unit order, with at most 2 × workers units in flight."""
    if workers == 1:
        for u in range(first, len(units)):
            yield u, tokenize_unit(units[u], config, storage_options, tokenizer)
        return
    ctx = get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                               initargs=(config.tokenizer, config.fast_tokenizer, config.eos,
                                         config.bos, os.getpid()))
    pending: deque[tuple[int, Future]] = deque()
    nxt = first
    try:
        while nxt < len(units) or pending:
            while nxt < len(units) and len(pending) < 2 * workers:
                with children_ignore_sigint():  # submit may start a worker
                    pending.append((nxt, pool.submit(tokenize_unit, units[nxt], config,
                                                     storage_options)))
                nxt += 1
            u, fut = pending.popleft()
            try:
                result = fut.result()
            except BrokenProcessPool:
                raise TokenmillError(f"a prepare worker process died (killed, or out of memory?) "
                                     f"while tokenizing {units[u].path}; run the same command "
                                     "again: it resumes where it stopped") from None
            yield u, result
    finally:
        for _, fut in pending:
            fut.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


def unit_weights(units: Sequence[sources.Unit], sizes: dict[str, int]) -> list[float]:
    """Input bytes each unit stands for: its file's size shared equally among the file's units."""
    count = Counter(u.path for u in units)
    return [sizes.get(u.path, 0) / count[u.path] for u in units]


def _file_sizes(files: Sequence[str], storage_options) -> dict[str, int]:
    sizes = {}
    for f in files:
        try:
            if "://" in f:
                import fsspec
                fs, p = fsspec.core.url_to_fs(f, **(storage_options or {}))
                sizes[f] = int(fs.size(p) or 0)
            else:
                sizes[f] = os.path.getsize(f)
        except OSError:
            sizes[f] = 0
    return sizes


def _resume_key(settings: dict, files: Sequence[str], sizes: dict[str, int],
                unit_bytes: int) -> dict:
    """Settings, the unit size (cursors count units) and each file's size and mtime: a rerun
    resumes only on unchanged inputs."""
    mtimes = []
    for f in files:
        try:
            mtimes.append(os.stat(f).st_mtime_ns if "://" not in f else 0)
        except OSError:
            mtimes.append(0)
    stamp = "\n".join(f"{f}\t{sizes.get(f, 0)}\t{m}" for f, m in zip(files, mtimes))
    return {"settings": settings, "unit_bytes": unit_bytes,
            "inputs_xxh3": xxhash.xxh3_64_hexdigest(stamp.encode())}


def _load_progress(out: Path, key: dict, overwrite: bool, intact=None
                   ) -> tuple[list[ShardInfo], tuple[int, int], SkipLog]:
    """Committed shards that still verify (``intact(info)``, default: the local files' checksums),
    the cursor after the last, and the skips up to it."""
    pdir = out / PROGRESS
    key_file = pdir / "key.json"
    if key_file.exists():
        old = json.loads(key_file.read_text())
        committed = any(pdir.glob("shard-*.json"))
        if old != key:
            if committed and not overwrite:  # nothing committed: nothing to lose, start over
                raise ConfigError(f"{out}: holds an unfinished prepare with other settings or "
                                  "changed inputs; rerun the original command to finish it, or "
                                  "pass --overwrite to start over")
            _clear_store_dir(out)
    pdir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(key_file, key)
    shards: list[ShardInfo] = []
    cursor, skips = (0, 0), SkipLog()
    while (rec_file := pdir / f"{shard_name(len(shards))}.json").exists():
        try:
            rec = json.loads(rec_file.read_text())
            info = ShardInfo(**rec["shard"])
        except (json.JSONDecodeError, KeyError, TypeError):
            break
        if not (intact(info) if intact else _shard_intact(out, info)):
            break
        shards.append(info)
        cursor, skips = tuple(rec["cursor"]), SkipLog.from_json(rec["skipped"])
    # everything after the last good shard is redone: remove it so nothing stale survives
    for p in out.iterdir():
        stem = p.name.split(".")[0]
        if p.name.startswith((".shard-", f".{MANIFEST}")) or (stem.startswith("shard-") and
                                             int(stem[6:] or 0) >= len(shards)):
            p.unlink(missing_ok=True)
    for p in pdir.glob("shard-*.json"):
        if int(p.stem[6:]) >= len(shards):
            p.unlink()
    return shards, cursor, skips


def _shard_intact(out: Path, info: ShardInfo) -> bool:
    for ext, size, digest in ((".bin", info.bin_bytes, info.bin_xxh3),
                              (".idx", info.idx_bytes, info.idx_xxh3)):
        f = out / f"{info.name}{ext}"
        if not f.exists() or f.stat().st_size != size or xxh3_file(f) != digest:
            return False
    return True


def _clear_store_dir(out: Path) -> None:
    for p in out.iterdir():
        if p.name == PROGRESS:
            shutil.rmtree(p)
        elif p.name == MANIFEST or p.name.startswith(("shard-", ".shard-", f".{MANIFEST}")):
            p.unlink()


def _check_out_dir(out: Path, key: dict, overwrite: bool) -> dict | None:
    """The existing manifest if ``out`` already holds this very store; raise if it holds another."""
    if not out.exists():
        return None
    if (out / MANIFEST).exists():
        try:
            manifest = read_manifest(out)
        except StoreError:
            manifest = None
        if manifest is not None and manifest.get("settings") == key["settings"] and not overwrite:
            return manifest
        if not overwrite:
            raise ConfigError(f"{out}: already holds a store prepared with other settings; pass "
                              "--overwrite to replace it, or choose another --out")
        _clear_store_dir(out)
        return None
    # a prepare killed while renaming its manifest into place leaves the temporary one behind
    foreign = [p.name for p in out.iterdir() if p.name != PROGRESS and
               not p.name.startswith(("shard-", ".shard-", f".{MANIFEST}.tmp-"))]
    if foreign and not overwrite:
        raise ConfigError(f"{out}: exists and holds other files ({', '.join(sorted(foreign)[:3])}); "
                          "choose an empty or new --out")
    return None


def _check_remote_out(target: remote.RemoteOut, key: dict, overwrite: bool) -> dict | None:
    """``_check_out_dir`` for a URL: the remote manifest if it is this very store, else None
    (after clearing the remote store under ``overwrite``); raise if it holds something else."""
    data = target.manifest_text()
    if data is not None:
        try:
            manifest = parse_manifest(data, f"{target.url}/{MANIFEST}")
        except StoreError:
            manifest = None
        if manifest is not None and manifest.get("settings") == key["settings"] and not overwrite:
            return manifest
        if not overwrite:
            raise ConfigError(f"{target.url}: already holds a store prepared with other settings; "
                              "pass --overwrite to replace it, or choose another --out")
        target.clear()
        shutil.rmtree(target.staging, ignore_errors=True)
        return None
    if (foreign := target.foreign_files()) and not overwrite:
        raise ConfigError(f"{target.url}: exists and holds other files ({', '.join(foreign[:3])}); "
                          "choose an empty or new --out")
    return None


@dataclass
class Run:
    """What both engines share once a prepare run is set up and its progress loaded."""

    config: PrepareConfig
    target: Any  # remote.RemoteOut for out="s3://…", else None
    out: Path  # the local directory shards are written to (a staging dir for remote outs)
    tok: Any
    dtype: np.dtype
    files: list[str]
    sizes: dict[str, int]
    settings: dict
    key: dict
    shards: list[ShardInfo]
    cursor: tuple[int, int]
    skips: SkipLog


def start_run(inputs, *, out, tokenizer: str, overwrite: bool, storage_options, progress,
              **options: Any) -> Run | dict:
    """Check settings and inputs, then load committed progress; the manifest if already done."""
    config = PrepareConfig(tokenizer=tokenizer, **options)
    inputs = [str(i) for i in ([inputs] if isinstance(inputs, (str, os.PathLike)) else inputs)]
    # out="s3://…": shards are staged locally, each uploaded as it is committed, manifest last
    target = remote.RemoteOut(os.fspath(out), storage_options) if remote.is_url(out) else None
    out = target.staging if target else Path(out)
    tok = load_tokenizer(config.tokenizer, fast=config.fast_tokenizer, eos=config.eos, bos=config.bos)
    if config.add_bos and tok.bos_id is None:
        raise ConfigError(f"add_bos=True but tokenizer {config.tokenizer!r} has no BOS token; "
                          "pass bos='…'")
    files, list_skips = sources.list_files(inputs, on_error=config.on_error,
                                           storage_options=storage_options)
    sizes = _file_sizes(files, storage_options)
    settings = config.settings(inputs, files, sizes)
    key = _resume_key(settings, files, sizes, config.unit_bytes)
    done = (_check_remote_out(target, key, overwrite) if target
            else _check_out_dir(out, key, overwrite))
    if done is not None:
        shutil.rmtree(out if target else out / PROGRESS, ignore_errors=True)
        _report(f"{target.url if target else out}: already complete "
                f"({done['num_documents']:,} documents, {done['num_tokens']:,} tokens)", progress)
        return done
    out.mkdir(parents=True, exist_ok=True)
    shards, cursor, skips = _load_progress(out, key, overwrite,
                                           target.has_shard if target else None)
    if target:
        target.remove_from(len(shards))  # uploads that were never committed
    if cursor == (0, 0) and not shards:
        for s in list_skips:
            skips.add(s)
    return Run(config, target, out, tok, token_dtype(tok.vocab_size), files, sizes, settings, key,
               shards, tuple(cursor), skips)


def prepare(inputs: str | Sequence[str], *, out: str | os.PathLike, tokenizer: str = "bytes",
            workers: int | str = "auto", progress: bool | None = None, overwrite: bool = False,
            storage_options: dict | None = None, engine: str = "local",
            ray_address: str | None = None, **options: Any) -> dict:
    """Tokenize ``inputs`` into a store at ``out``; resumes an interrupted run; returns the manifest.

    ``out`` may be an fsspec URL (``s3://bucket/store``): the store is staged under
    ``$TOKENMILL_CACHE_DIR/staging/``, each shard uploaded as it is committed and the manifest
    last; rerunning the same command resumes. ``storage_options`` go to fsspec for inputs and out.
    ``options`` are ``PrepareConfig`` fields (shard_tokens, text_key, txt_mode, on_error, …).
    ``engine="ray"`` runs on Ray (``ray_address``: None, "auto" or "HOST:PORT"), same bytes:
    see ``tokenmill.integrations.ray`` and docs/scale-out.md.
    """
    if engine == "ray":  # imported only here: the core never imports ray
        from tokenmill.integrations.ray import prepare_on_ray
        return prepare_on_ray(inputs, out=out, tokenizer=tokenizer, workers=workers,
                              progress=progress, overwrite=overwrite,
                              storage_options=storage_options, address=ray_address, **options)
    if engine != "local":
        raise ConfigError(f"engine must be 'local' or 'ray' (got {engine=!r})")
    n_workers = resolve_workers(workers)
    run = start_run(inputs, out=out, tokenizer=tokenizer, overwrite=overwrite,
                    storage_options=storage_options, progress=progress, **options)
    if isinstance(run, dict):
        return run  # already complete
    config, target, out, tok, dtype = run.config, run.target, run.out, run.tok, run.dtype
    files, sizes, settings, shards, skips = run.files, run.sizes, run.settings, run.shards, run.skips
    cur_unit, cur_doc = run.cursor
    units = sources.plan_units(files, config.source_config(storage_options))
    writer = ShardWriter(out, dtype=dtype, shard_tokens=config.shard_tokens, first_shard=len(shards))
    weights = unit_weights(units, sizes)
    meter = _Progress(total=sum(weights), enabled=progress, done=sum(weights[:cur_unit]))
    pending: list[tuple[int, int, sources.Skip]] = []

    def commit(info: ShardInfo, cursor: tuple[int, int]) -> None:
        keep = []
        for u, o, s in pending:
            (skips.add(s) if (u, o) < cursor else keep.append((u, o, s)))
        pending[:] = keep
        shards.append(info)
        record = {"shard": info.to_json(), "cursor": list(cursor), "skipped": skips.to_json()}
        write = functools.partial(atomic_write_json, out / PROGRESS / f"{info.name}.json", record)
        if target:
            target.submit(out, info, on_uploaded=write)  # commits once the upload is verified
        else:
            write()

    try:
        for u, res in _ordered_results(units, cur_unit, n_workers, config, storage_options, tok):
            d0 = cur_doc if u == cur_unit else 0
            tokens, lengths = res.tokens, res.lengths
            if d0:
                tokens, lengths = tokens[int(lengths[:d0].sum()):], lengths[d0:]
            pending.extend((u, o, s) for o, s in res.skips if o >= d0)
            for info, n_docs in writer.add(tokens, lengths):
                commit(info, (u, d0 + n_docs))
            meter.update(weights[u], docs=len(lengths), tokens=len(tokens))
        if (info := writer.finish()) is not None:
            commit(info, (len(units), 0))
        for _, _, s in pending:
            skips.add(s)
        if target:
            target.drain()
    except BaseException:
        writer.abort()
        if target:
            target.abort()
        meter.close()
        raise
    meter.close()
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
    _report(summary_line(manifest), progress)
    return manifest


def summary_line(manifest: dict) -> str:
    """One line on a finished store: documents, tokens, shards, skips."""
    sk = manifest["skipped"]
    reasons = ", ".join(f"{k} {v:,}" for k, v in sk["by_reason"].items())
    return (f"done: {manifest['num_documents']:,} documents, {manifest['num_tokens']:,} tokens in "
            f"{len(manifest['shards'])} shard(s); skipped {sk['total']:,}"
            + (f" ({reasons})" if reasons else ""))


def _report(line: str, progress: bool | None) -> None:
    if progress is not False:
        print(line, file=sys.stderr, flush=True)


class _Progress:
    """A tqdm bar on a terminal, a plain line every 10 s otherwise, nothing when disabled."""

    def __init__(self, total: int, enabled: bool | None, done: int = 0):
        self.enabled = enabled is not False
        tty = sys.stderr.isatty() if enabled is None else bool(enabled) and sys.stderr.isatty()
        self.bar = None
        self.t0 = self.last = time.monotonic()
        self.total, self.done, self.start_done = total, done, done
        self.docs = self.tokens = 0
        if self.enabled and tty:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=done, unit="B", unit_scale=True,
                            desc="prepare", dynamic_ncols=True, smoothing=0.1)

    def update(self, nbytes: int, *, docs: int, tokens: int) -> None:
        """Account for one finished unit."""
        self.done += nbytes
        self.docs += docs
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(nbytes)
            self.bar.set_postfix_str(f"{self.docs:,} docs, {self.tokens / 1e6:,.1f}M tok",
                                     refresh=False)
        elif self.enabled and time.monotonic() - self.last >= 10:
            self.last = time.monotonic()
            print(self.line(), file=sys.stderr, flush=True)

    def line(self) -> str:
        """The plain progress line."""
        dt = max(time.monotonic() - self.t0, 1e-9)
        rate = (self.done - self.start_done) / dt
        pct = 100 * self.done / self.total if self.total else 100.0
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        return (f"prepare: {pct:5.1f}% | {self.done / 1e6:,.1f} of {self.total / 1e6:,.1f} MB | "
                f"{self.docs:,} docs | {self.tokens:,} tokens | {rate / 1e6:.2f} MB/s | "
                f"ETA {eta:,.0f} s")

    def close(self) -> None:
        """Finish the bar."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
