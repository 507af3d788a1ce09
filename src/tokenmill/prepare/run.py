"""A prepare run: set up (settings, inputs, the output's one writer), tokenize in order, finish.

    run = start_run(inputs, out="store", tokenizer="bytes", overwrite=False,
                    storage_options=None, progress=None)     # a dict: already complete
    manifest = run_local(run, workers=2)

``start_run`` is shared by the local engine (``run_local``: the ordered pool feeding the
writer) and the Ray engine (``tokenmill.prepare.ray``), so both write the same store and
either finishes the other's interrupted run. The output belongs to ``store.writer.StoreWriter``:
its lock, its progress records, what it may delete.

Resume key: the settings that decide the store's bytes, the unit size (cursors count units), and
every input file with its size. Inputs are compared by content too: each progress record holds
the xxh3 of the input bytes of the units its shard holds, and a rerun recomputes them — a shard
whose input changed (even under the same size and mtime) is redone with everything after it.

Origins: every shard gets a ``.src`` (file id and line or row of each document, ``Origins``); the
manifest's ``sources`` lists the input files the ids index (``input_name``), and its
``source_kinds`` what each file's numbers count (line, row, element: ``inputs_record``, decided
when the units are planned, as their readers decide it). ``origins_of`` turns a unit's result
into origins, in unit order (``readers.LineBases``).
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Any, Callable, Mapping, Sequence

from tokenmill.inputs import readers, sources, tabular
from tokenmill.base.errors import ConfigError
from tokenmill.inputs.textfields import check_joinable, ignored_note
from tokenmill.base.io import file_size, is_url, redact
from tokenmill.prepare.identity import changed_output, check_unchanged, finished_ids, input_ids
from tokenmill.prepare.pool import ReadAhead, UnitPool, ordered_results
from tokenmill.prepare.split import texts_record
from tokenmill.prepare.tokenize import (PrepareConfig, UnitResult, engine_option, engine_record,
                                        input_name, unit_digest)
from tokenmill.base.procs import resolve_workers, usable_cores
from tokenmill.inputs.records import COMPRESSED, changed, io_errors
from tokenmill.store.format import INPUT_IDS, SOURCE_KINDS, SOURCES, Origins
from tokenmill.store.upload import RemoteOut
from tokenmill.store.writer import StoreWriter, WriterConfig
from tokenmill.tokenizer import Tokenizer, load_tokenizer, token_dtype


@dataclass
class Run:
    """What both engines share once a prepare run is set up and its progress loaded."""

    config: PrepareConfig
    writer: StoreWriter
    tok: Tokenizer
    files: list[str]
    sizes: dict[str, int]
    settings: dict
    storage_options: Mapping | None
    progress: bool | None
    units: list[sources.Unit]
    inputs: dict  # the manifest's record of the inputs (inputs_record)

    @property
    def where(self) -> str:
        """The output, as messages name it."""
        return self.writer.where


def start_run(inputs, *, out, tokenizer: str, overwrite: bool, storage_options, progress,
              **options: Any) -> Run | dict:
    """Check settings and inputs, take the output, load committed progress; the manifest if the
    output already holds this very store."""
    config = PrepareConfig(tokenizer=tokenizer, **engine_option(options))
    inputs = [os.fspath(i) for i in ([inputs] if isinstance(inputs, (str, os.PathLike))
                                     else inputs)]
    tok = load_tokenizer(config.tokenizer, engine=config.tokenizer_engine, eos=config.eos,
                         bos=config.bos)
    if config.add_bos and tok.bos_id is None:
        raise ConfigError(f"add_bos=True but tokenizer {config.tokenizer!r} has no BOS token; "
                          "pass bos='…'")
    listing = sources.list_inputs(inputs, on_error=config.on_error, storage_options=storage_options,
                                  split=config.split, text_ext=config.text_ext)
    files, list_skips = listing.files, listing.skips
    check_joinable(config.text_key, {f: sources.format_of(f, config.text_ext) for f in files})
    if listing.ignored:
        notify(ignored_note(listing.ignored), progress)
    sizes = file_sizes(files, storage_options)
    ids = input_ids(files, storage_options)  # before any input is read again (a resume's check)
    settings = config.settings(inputs, files, sizes, storage_options)
    if "spec" in tok.identity():  # a name: a resume must find the very same file behind it
        settings["tokenizer_file_xxh3"] = tok.identity()["file_xxh3"]
    key = {"settings": settings, "unit_bytes": config.unit_bytes,
           "files": [[input_name(f), sizes[f]] for f in files]}
    # out="s3://…": shards are staged locally, each uploaded as it is committed, manifest last
    remote = RemoteOut(os.fspath(out), storage_options) if is_url(out) else None
    units: list[sources.Unit] = []

    def planned() -> list[sources.Unit]:
        """The work units, planned once, on first need."""
        if not units:
            units.extend(sources.plan_units(files, config.source_config(storage_options)))
            same_sizes(units, sizes)
        return units

    writer = StoreWriter(remote.staging if remote else out,
                         WriterConfig(dtype=token_dtype(tok.vocab_size).name,
                                      shard_tokens=config.shard_tokens, key=key,
                                      overwrite=overwrite, origins=True),
                         remote=remote, check=input_check(planned, storage_options, progress),
                         same_inputs=lambda done, where: check_unchanged(done, files,
                                                                         storage_options, where))
    if writer.manifest is not None:
        return already_complete(writer, progress)
    try:
        same_transform(writer, planned(), config, storage_options, overwrite, progress)
        if writer.cursor == (0, 0) and not writer.shards:
            for s in list_skips:
                writer.skips.add(s)
        run = Run(config, writer, tok, files, sizes, settings, storage_options, progress,
                  planned(), inputs_record(files, planned(), storage_options, ids))
        if getattr(tok, "source", None):
            notify(f"tokenizer {config.tokenizer}: {tok.source}", progress)
        if tok.kind == "hf":
            notify(engine_line(tok), progress)
        return run
    except BaseException:
        writer.close()
        raise


def already_complete(writer: StoreWriter, progress: bool | None) -> dict:
    """The manifest of the store the output already holds (its inputs found unchanged since it
    was prepared, ``prepare.identity``, by the writer: else a ConfigError naming them)."""
    done = writer.manifest
    writer.close()
    notify(f"{writer.where}: already complete ({done['num_documents']:,} documents, "
           f"{done['num_tokens']:,} tokens)", progress)
    return done


def same_transform(writer: StoreWriter, units: list[sources.Unit], config: PrepareConfig,
                   storage_options, overwrite: bool, progress: bool | None) -> None:
    """Refuse to resume a run whose transform now makes other texts of committed units
    (``identity.changed_output``); under ``overwrite``, start it over."""
    what = changed_output(units, writer.unit_texts, config, storage_options)
    if what is None:
        return
    if not overwrite:
        raise ConfigError(
            f"{writer.where}: holds an unfinished prepare whose {what}: the transform, or "
            "something it loads (a module, a data file), changed since the run was interrupted; "
            "restore it as it was to finish the run, or pass --overwrite to start over with the "
            "transform as it is now")
    notify(f"note: {writer.where}: the interrupted run's {what}; starting over (--overwrite)",
           progress)
    writer.start_over()


def input_check(units: Callable[[], list[sources.Unit]], storage_options,
                progress: bool | None) -> Callable[[dict], bool]:
    """``check(record)`` for the writer: True if the inputs of a committed shard are unchanged
    (their bytes hash as recorded); else it says which file changed and returns False."""
    def check(record: dict) -> bool:
        """True if every unit of this committed shard still hashes as recorded."""
        planned = units()
        for u, want in sorted(record.get("inputs", {}).items(), key=lambda kv: int(kv[0])):
            unit = planned[int(u)] if int(u) < len(planned) else None
            if unit is None or unit_digest(unit, storage_options) != want:
                what = redact(unit.path) if unit else f"work unit {u}"
                notify(f"note: {what} changed since the interrupted run (its bytes differ, "
                       f"whatever its size and time say); redoing from {record['shard']['name']}",
                       progress)
                return False
        return True
    return check


def same_sizes(units: Sequence[sources.Unit], sizes: dict[str, int]) -> None:
    """Raise ``records.changed`` for a file whose size when its units were planned is not the
    size the run records (``sizes``, taken before): it changed in between."""
    for unit in units:
        size = getattr(unit.ident, "size", None)
        if size is not None and sizes.get(unit.path) not in (size, None):
            raise changed(unit.path, f"size {sizes[unit.path]:,} → {size:,} bytes")


def engine_line(tok: Tokenizer) -> str:
    """What prepare prints about the engine running a tokenizer.json."""
    why = "; ".join(n for n in tok.engine_notes if not n.startswith("asked for"))
    how = ("the reference" if tok.engine == "tokenizers"
           else "proven identical to tokenizers at load time")
    return f"tokenizer engine: {tok.engine} ({how})" + (f"; not faster ones: {why}" if why else "")


THREADED_ENGINES = ("fastokens",)  # spread one encode_batch over every core by themselves


def auto_workers(engine: str) -> int:
    """What ``workers="auto"`` means: 1 (in this process) for an engine that uses every core
    by itself, else one worker process per usable core.

    Measured (97 MB of Debian docs, 32k BPE, 2 cores): fastokens in-process 1.06 s wall and
    1.41 CPU-s for the whole CLI run; 2 worker processes 1.38 s and 2.39 CPU-s (each process
    pays imports and a tokenizer load, and texts and tokens cross pipes).
    """
    return 1 if engine in THREADED_ENGINES else usable_cores()


def likely_engine(config: PrepareConfig) -> str | None:
    """The engine a tokenizer.json will most likely run on, guessed before loading it (so
    workers can start while the parent loads): fastokens if asked for or installed, else None."""
    if not config.tokenizer.lower().endswith(".json"):
        return None
    if config.tokenizer_engine == "fastokens" or (
            config.tokenizer_engine == "auto" and find_spec("fastokens") is not None
            and not os.environ.get("FASTOKENS_INPUT_CACHE")):
        return "fastokens"
    return None


def prepare_local(inputs, *, out, tokenizer: str, workers: int | str, overwrite: bool,
                  storage_options, progress, **options: Any) -> dict:
    """The local engine end to end; worker processes (when used), or else a thread reading
    units ahead, start while the parent loads its tokenizer and takes the output."""
    config = PrepareConfig(tokenizer=tokenizer, **engine_option(options))
    early = auto_workers(likely_engine(config)) if workers == "auto" else resolve_workers(workers)
    ahead = early_reader(inputs, config, storage_options) if early == 1 else None
    try:
        with UnitPool(early, config, storage_options) if early > 1 else nullcontext() as pool:
            run = start_run(inputs, out=out, tokenizer=tokenizer, overwrite=overwrite,
                            storage_options=storage_options, progress=progress, **options)
            if isinstance(run, dict):
                return run  # already complete
            n = auto_workers(run.tok.engine) if workers == "auto" else early
            return run_local(run, n, pool if n == early else None, ahead if n == 1 else None)
    finally:
        if ahead is not None:
            ahead.close()  # idempotent: the run closes it when it used it


def early_reader(inputs, config: PrepareConfig, storage_options) -> ReadAhead | None:
    """Local inputs' units read and parsed by a thread while this one loads (and proves) the
    tokenizer, which leaves the second core idle for ~0.3 s (fastokens loads without the GIL);
    None for URLs, compressed streams or inputs that do not list (start_run says why)."""
    inputs = [inputs] if isinstance(inputs, (str, os.PathLike)) else inputs
    if any(is_url(os.fspath(i)) for i in inputs):
        return None
    try:
        listing = sources.list_inputs(inputs, on_error=config.on_error,
                                      storage_options=storage_options, text_ext=config.text_ext)
        # before planning: planning a compressed stream decompresses it whole (start_run would
        # do that a second time), and its units' bytes come from the parent anyway
        if any(sources.format_of(f, config.text_ext) in COMPRESSED for f in listing.files):
            return None
        units = sources.plan_units(listing.files, config.source_config(storage_options))
    except Exception:  # noqa: BLE001 - start_run lists them again and reports the problem
        return None
    return ReadAhead(units, config, storage_options)


def run_local(run: Run, workers: int, pool: UnitPool | None = None,
              ahead: ReadAhead | None = None) -> dict:
    """The local engine: units tokenized by ``workers`` processes (``pool``: already started;
    ``ahead``: units already being read, for one worker), written in order; the manifest."""
    writer, units = run.writer, run.units
    first = writer.cursor[0]
    weights = unit_weights(units, run.sizes)
    meter = Progress(total=sum(weights), enabled=run.progress, done=sum(weights[:first]))
    payloads = sources.unit_payloads(units, first, run.config.source_config(run.storage_options))
    try:
        origins = origins_of(run.files, units, run.storage_options)
        for u, res in ordered_results(units, first, workers, run.config, run.storage_options,
                                      run.tok, payloads, pool, ahead):
            writer.add(u, 0, res.tokens, res.lengths, res.skips, res.digest, origins(u, res),
                       res.texts)
            meter.update(weights[u], docs=len(res.lengths), tokens=len(res.tokens))
        manifest = finish(run)
    except BaseException:
        writer.abort()
        raise
    finally:
        payloads.close()  # the parent's open compressed streams
        meter.close()
    notify(summary_line(manifest), run.progress)
    return manifest


def finish(run: Run) -> dict:
    """Write the manifest of a run whose every unit is in (either engine); the manifest."""
    split = texts_record(run.files, run.units, run.writer.unit_texts) if run.config.holdout \
        else {}
    return run.writer.finish(run.tok.identity(), run.settings, {
        "tokenizer_engine": engine_record(run.tok),
        **inputs_finished(run.inputs, run.units, run.writer, run.storage_options), **split})


def inputs_record(files: Sequence[str], units: Sequence[sources.Unit], storage_options,
                  ids: Sequence[dict | None] | None = None) -> dict:
    """The manifest's record of the input files: each as recorded (``sources``), what its
    documents' numbers count (``source_kinds``), so ``explain`` never reads an input again, and
    its identity (``ids``, else taken now; ``inputs_finished`` adds the content)."""
    first: dict[str, sources.Unit] = {}
    for unit in units:
        first.setdefault(unit.path, unit)
    ids = input_ids(files, storage_options) if ids is None else list(ids)
    return {SOURCES: [input_name(f) for f in files],
            SOURCE_KINDS: [source_kind(first.get(f), storage_options) for f in files],
            INPUT_IDS: ids}


def inputs_finished(record: dict, units: Sequence[sources.Unit], writer: StoreWriter,
                    storage_options) -> dict:
    """``inputs_record``'s fields as the manifest holds them, once every unit is written: each
    file's identity with the hash of its bytes (``prepare.identity``)."""
    ids = finished_ids(record[INPUT_IDS], record[SOURCES], units, writer.input_digests,
                       storage_options)
    return {**record, INPUT_IDS: ids}


def source_kind(unit: sources.Unit | None, storage_options) -> str | None:
    """What the numbers of a file's documents count, from its first unit; None if it cannot be
    read (its reader met that too: the file holds no documents, or the run failed)."""
    try:
        return None if unit is None else tabular.origin_kind(unit, storage_options)
    except io_errors():
        return None


def origins_of(files: Sequence[str], units: Sequence[sources.Unit],
               storage_options) -> Callable[[int, UnitResult], Origins]:
    """``origins(u, result)``: where unit ``u``'s documents came from, as a store records it
    (file id: the index in ``files``); called for units in order (lines add up per file)."""
    ids = {f: i for i, f in enumerate(files)}
    bases = readers.LineBases(units, storage_options)

    def origins(u: int, res: UnitResult) -> Origins:
        """Unit ``u``'s documents' origins."""
        return Origins.of(ids[units[u].path], bases.absolute(u, res.lines, res.newlines))
    return origins


def unit_weights(units: Sequence[sources.Unit], sizes: dict[str, int]) -> list[float]:
    """Input bytes each unit stands for: its file's size shared equally among the file's units."""
    count = Counter(u.path for u in units)
    return [sizes.get(u.path, 0) / count[u.path] for u in units]


def file_sizes(files: Sequence[str], storage_options) -> dict[str, int]:
    """Each input file's size in bytes (0 if it cannot be read: the reader reports it)."""
    sizes = {}
    for f in files:
        try:
            sizes[f] = file_size(f, storage_options)
        except OSError:
            sizes[f] = 0
    return sizes


def summary_line(manifest: dict) -> str:
    """One line on a finished store: documents, tokens, shards, skips."""
    sk = manifest["skipped"]
    reasons = ", ".join(f"{k} {v:,}" for k, v in sk["by_reason"].items())
    return (f"done: {manifest['num_documents']:,} documents, {manifest['num_tokens']:,} tokens in "
            f"{len(manifest['shards'])} shard(s); skipped {sk['total']:,}"
            + (f" ({reasons})" if reasons else ""))


def notify(line: str, progress: bool | None) -> None:
    """Print one line to stderr unless progress is off."""
    if progress is not False:
        print(redact(line), file=sys.stderr, flush=True)


class Progress:
    """A tqdm bar on a terminal, a plain line every 10 s otherwise, nothing when disabled."""

    def __init__(self, total: float, enabled: bool | None, done: float = 0):
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

    def update(self, nbytes: float, *, docs: int, tokens: int) -> None:
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
