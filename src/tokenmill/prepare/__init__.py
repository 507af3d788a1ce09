"""Raw text → token store: ``prepare()``, and the names other code used from ``tokenmill.prepare``.

The main process plans work units (``sources.plan_units``), keeps at most ``2 × workers`` units
in flight in worker processes (``prepare.pool``; each worker reads *and* tokenizes a whole unit)
and hands the results to the output's one writer (``store.writer.StoreWriter``) strictly in unit
order. Shard boundaries depend only on the document stream, so the store is byte-identical for
any worker count and either engine. An interrupted run resumes (see ``prepare.run``).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Sequence

from tokenmill.base.errors import ConfigError
from tokenmill.prepare.pool import UnitPool
from tokenmill.prepare.run import notify, prepare_local, summary_line
from tokenmill.prepare.split import (SIDES, check_accounts, check_fraction, check_plain_out,
                                     check_split_out, split_line, split_of, split_paths)
from tokenmill.prepare.tokenize import PrepareConfig, tokenize_unit

__all__ = ["PrepareConfig", "UnitPool", "prepare", "summary_line", "tokenize_unit"]


def prepare(inputs: str | Sequence[str], *, out: str | os.PathLike, tokenizer: str = "bytes",
            workers: int | str = "auto", progress: bool | None = None, overwrite: bool = False,
            storage_options: dict | None = None, engine: str = "local",
            ray_address: str | None = None, val_fraction: float | None = None,
            **options: Any) -> dict:
    """Tokenize ``inputs`` into a store at ``out``; resumes an interrupted run; returns the manifest.

    ``out`` may be an fsspec URL (``s3://bucket/store``): the store is staged under
    ``$TOKENMILL_CACHE_DIR/staging/``, each shard uploaded as it is committed and the manifest
    last; rerunning the same command resumes. ``storage_options`` go to fsspec for inputs and out.
    ``options`` are ``PrepareConfig`` fields (shard_tokens, text_key, txt_mode, on_error,
    tokenizer_engine, transform, …). ``workers="auto"``: in this process when the tokenizer's
    engine spreads itself over every core (fastokens: measured faster than 2 processes on 2
    cores), else one process per core (``prepare.run.auto_workers``). The manifest's
    ``tokenizer_engine`` says which engine ran (and why faster ones were refused); it is not part
    of the fingerprint. ``engine="ray"`` runs on Ray (``ray_address``: None, "auto" or
    "HOST:PORT"), same bytes: see ``tokenmill.prepare.ray`` and docs/scale-out.md. Only one
    prepare writes an output at a time: a second one fails at once with a
    ``ConcurrentWriterError`` naming the first's pid.

    ``transform=fn``: ``fn(record: dict) -> str | None`` makes each record's text (None drops
    it, counted); it must be importable by name (see ``prepare.transform``).
    ``val_fraction=F``: two stores, ``out/train`` and ``out/val``, documents split by a hash of
    their text (see ``prepare.split``); returns ``{"train": manifest, "val": manifest}``.
    """
    if not isinstance(inputs, (str, os.PathLike)):
        inputs = list(inputs)  # a generator is read more than once: early reader, run, split
    one = functools.partial(prepare_one, inputs, tokenizer=tokenizer, workers=workers,
                            progress=progress, overwrite=overwrite,
                            storage_options=storage_options, engine=engine,
                            ray_address=ray_address, **options)
    if val_fraction is None:
        check_plain_out(out)
        return one(out=out)
    if "holdout" in options:
        raise ConfigError("pass val_fraction= or holdout=, not both")
    return prepare_split(one, out, check_fraction(val_fraction), progress)


def prepare_one(inputs, *, out, tokenizer: str, workers, progress, overwrite, storage_options,
                engine: str, ray_address: str | None, **options: Any) -> dict:
    """One store, on the engine asked for; the manifest."""
    if engine == "ray":  # imported only here: the core never imports ray
        from tokenmill.prepare.ray import prepare_on_ray
        return prepare_on_ray(inputs, out=out, tokenizer=tokenizer, workers=workers,
                              progress=progress, overwrite=overwrite,
                              storage_options=storage_options, address=ray_address, **options)
    if engine != "local":
        raise ConfigError(f"engine must be 'local' or 'ray' (got {engine=!r})")
    return prepare_local(inputs, out=out, tokenizer=tokenizer, workers=workers,
                         overwrite=overwrite, storage_options=storage_options, progress=progress,
                         **options)


def prepare_split(one: Callable[..., dict], out, fraction: float,
                  progress: bool | None) -> dict[str, dict]:
    """``one(out=…, holdout=…)`` for the train side, then the val side; both manifests."""
    check_split_out(out)
    paths, done = split_paths(out), {}
    for side in SIDES:
        notify(f"split: writing the {side} side (val fraction {fraction:g}) to {paths[side]}",
               progress)
        done[side] = one(out=paths[side], holdout=(side, fraction))
        split = split_of(done[side])
        if side == "train" and split["held_out"] == 0:
            raise ConfigError(f"val_fraction={fraction:g}: no document of the "
                              f"{done[side]['num_documents']:,} falls on the val side; pass a "
                              "larger fraction (and --overwrite to redo the train store)")
        notify(f"split: {split_line(split, done[side]['num_documents'])}", progress)
    check_accounts(done["train"], done["val"])
    return done
