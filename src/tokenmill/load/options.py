"""The Loader's less common settings (``LoaderOptions``), checked when a Loader is built."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

import numpy as np

from tokenmill.base.errors import ConfigError, check_int
from tokenmill.base.procs import resolve_workers, usable_cores

__all__ = ["LoaderOptions", "WORKER_TYPES", "loader_prefetch", "loader_workers"]

WORKER_TYPES = ("thread", "process")


@dataclass(frozen=True)
class LoaderOptions:
    """The Loader's less common settings, passed to it as keywords (``Loader(..., epochs=2)``)."""

    prefetch: int | str = "auto"  # batches computed ahead; "auto" deepens while data wait > 1%
    epochs: int | None = None  # stop after this many epochs (None: run forever)
    dtype: str = "int32"  # of inputs/targets: "int32" or "int64"
    worker_type: str = "thread"  # "thread" or "process"
    cache_dir: str | os.PathLike | None = None  # unused since packed rows are planned lazily
    max_segments: int | None = None  # packed: at most this many documents a row (kernel limits)
    document_masks: bool = False  # concat: segment_ids, positions, loss_mask by document
    # named stores: [(first global sample, {name: weight}), …] phases (docs/mixing.md)
    mixture: Sequence | None = None
    balance: Any = None  # "attention" or a balance.CostModel: ranks' rows dealt by cost
    microbatches: int = 1  # balance: a rank's rows in this many cost-balanced runs
    stratify: bool = False  # balance: global batches of rows stratified by cost (docs/balance.md)
    # [(first step, seq_len), …] at tokens_per_step tokens a step (docs/guide-torch.md)
    seq_len_schedule: Sequence | None = None
    tokens_per_step: int | None = None
    thd: bool = False  # packed: cu_seqlens (fixed slots), max_seqlen a batch (docs/balance.md)

    def __post_init__(self):  # frozen: the ints are made plain ints once, here
        if self.prefetch != "auto":
            object.__setattr__(self, "prefetch", check_int("prefetch", self.prefetch, minimum=1,
                                                           or_else="'auto'"))
        object.__setattr__(self, "epochs", check_int("epochs", self.epochs, minimum=1,
                                                     optional=True))
        object.__setattr__(self, "microbatches", check_int("microbatches", self.microbatches,
                                                           minimum=1))
        if not isinstance(self.stratify, (bool, np.bool_)):
            raise ConfigError(f"stratify must be True or False (got stratify={self.stratify!r})")
        if np.dtype(self.dtype) not in (np.dtype(np.int32), np.dtype(np.int64)):
            raise ConfigError(f"dtype must be 'int32' or 'int64' (got dtype={self.dtype!r})")
        if self.cache_dir is not None:
            warnings.warn("Loader(cache_dir=…) is no longer used: the packed layout is planned "
                          "lazily and writes nothing; drop the argument", DeprecationWarning,
                          stacklevel=4)
        if self.worker_type not in WORKER_TYPES:
            raise ConfigError(f"worker_type must be 'thread' or 'process' "
                              f"(got {self.worker_type!r})")

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> LoaderOptions:
        """The options from a Loader's extra keywords; TypeError naming an unknown one."""
        known = {f.name for f in fields(cls)}
        for name in options:
            if name not in known:
                raise TypeError(f"Loader() got an unexpected keyword argument {name!r} "
                                f"(its options are {sorted(known)})")
        return cls(**options)


def loader_workers(num_workers: int | str) -> int:
    """A Loader's ``num_workers``: an int >= 0, or "auto" (1 when there is a spare core, else 0)."""
    if num_workers == "auto":
        # at most one background worker, used while the Pacer measures that it pays (numpy
        # copies release the GIL); a pool that competes with the step for 2 cores loses
        return 1 if usable_cores() > 1 else 0
    return resolve_workers(num_workers, name="num_workers", minimum=0)


def loader_prefetch(prefetch: int | str, num_workers: int) -> int:
    """A Loader's starting prefetch depth: as given, or for "auto" two batches a worker."""
    if prefetch == "auto":
        return 2 * max(1, num_workers)  # a starting depth; deepened while data wait > 1%
    return prefetch
