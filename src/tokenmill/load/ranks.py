"""Every rank's loader agrees: one small collective at the first batch of each pass.

A loader split over W ranks hands rank r its slice of one global batch, so "every sample once per
epoch, ranks disjoint" holds only when every rank builds it with the same settings. A script
written in the habit of ``seed=1337 + rank`` breaks it without a word; so does a rank that loaded
another checkpoint, or two processes given the same ``rank=``. ``agree`` gathers each rank's
batch-shaping settings once — ``torch.distributed.all_gather_object`` when a process group of
exactly W processes is initialised, ``jax.experimental.multihost_utils.process_allgather`` when
JAX runs W processes — and every rank raises the same ConfigError, naming the rank that differs
and the setting, before any batch is handed out. Every rank reaches the collective before any
rank raises, so a refusal never leaves a rank waiting.

A loader whose world_size is not the number of processes (1 on every rank; a data-parallel
slice under tensor or pipeline parallelism, where some processes never read data) is not
checked: the processes that iterate it are not known here. torch and jax are never imported:
only looked up in ``sys.modules``.

    disagreement([{"rank": 0, "seed": 1337}, {"rank": 1, "seed": 1338}])
    # "ranks disagree: rank 1's Loader has seed=1338 where rank 0's has seed=1337; use the same …"
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np
import xxhash

from tokenmill.base.errors import ConfigError, is_int

__all__ = ["CheckedFirst", "agree", "disagreement", "torch_dist"]

SAME = "tokenmill gives each rank its own slice of one global batch"
HINTS = {
    "world_size": "pass the same world_size on every rank, or leave rank and world_size out "
                  "(they are read from torch.distributed)",
    "seed": "use the same seed on every rank (seed=1337, not 1337 + rank): " + SAME + " of one "
            "shuffled order, so seeds that differ read some samples twice and others never",
    "consumed_samples": "every rank must start at the same step: load the same state on every "
                        "rank (a loader's state is the same on all ranks; save it on one, load "
                        "it on all)",
    "stores": "every rank must read the same stores (the same content: fingerprints)",
    "fingerprint": "every rank must read the same data with the same settings",
}
SHOWN_RANKS = 4  # ranks listed by name in a message; the others are counted


def torch_dist():
    """``torch.distributed`` if a process group is initialised in this process (not in a
    DataLoader worker, a fork of a rank that takes no part in its collectives), else None."""
    dist = sys.modules.get("torch.distributed")  # never import torch ourselves
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    data = sys.modules.get("torch.utils.data")
    if data is not None and data.get_worker_info() is not None:
        return None
    return dist


def agree(what: str, settings: Mapping[str, Any], *, rank: int, world_size: int) -> None:
    """Raise the same ConfigError on every rank when the ranks' ``settings`` (or their ranks)
    differ; a no-op without a process group of ``world_size`` processes (torch or JAX)."""
    if world_size < 2:
        return
    mine = {"rank": rank, "world_size": world_size, **settings}
    rows = _gathered(mine, world_size)
    if rows is not None and (problem := disagreement(rows, what=what)) is not None:
        raise ConfigError(problem)


def _gathered(mine: dict[str, Any], world_size: int) -> list[dict[str, Any]] | None:
    """Every process's ``mine``, in process order; None when no group of that size runs."""
    dist = torch_dist()
    if dist is not None and dist.get_world_size() == world_size:
        rows: list = [None] * world_size
        dist.all_gather_object(rows, mine)
        return rows
    jax = sys.modules.get("jax")
    initialised = getattr(getattr(jax, "distributed", None), "is_initialized", None)
    if initialised is not None and initialised() and jax.process_count() == world_size:
        from jax.experimental import multihost_utils  # jax is already imported: no new import
        return decoded(multihost_utils.process_allgather(encoded(mine)), list(mine))
    return None


class Hashed(NamedTuple):
    """A value another JAX process sent as a hash (only small ints travel as themselves)."""

    digest: int

    def __repr__(self) -> str:
        return f"<value hashed {self.digest:08x}>"


def encoded(settings: Mapping[str, Any]) -> np.ndarray:
    """``settings`` as int32 pairs (0, the int) or (1, a 31-bit hash), for a JAX all-gather
    (int32: JAX without x64 would narrow int64).

    encoded({"seed": 5}).tolist() == [0, 5]
    """
    out = []
    for value in settings.values():
        if is_int(value) and -2**31 <= value < 2**31:
            out += [0, int(value)]
        else:
            text = json.dumps(value, sort_keys=True, default=str).encode()
            out += [1, xxhash.xxh3_64_intdigest(text) & 0x7FFFFFFF]
    return np.array(out, dtype=np.int32)


def decoded(table: np.ndarray, keys: Sequence[str]) -> list[dict[str, Any]]:
    """Rows of settings from the gathered ``encoded`` pairs (one row of the table a process)."""
    table = np.asarray(table).reshape(-1, len(keys), 2)
    return [{k: int(v) if kind == 0 else Hashed(int(v)) for k, (kind, v) in zip(keys, row)}
            for row in table.tolist()]


def disagreement(rows: Sequence[Mapping[str, Any]], *, what: str = "Loader") -> str | None:
    """What differs between the ranks' settings (``rows[r]`` is rank r's, with its ``rank=``),
    in one line naming the rank and the setting and what to do; None when they agree.

    disagreement([{"rank": 0, "seed": 1}, {"rank": 1, "seed": 1}]) is None
    """
    clash = rank_clash([row["rank"] for row in rows], what)
    if clash is not None:
        return clash
    for key in rows[0]:
        if key == "rank":
            continue
        groups: dict[str, list[int]] = {}
        for r, row in enumerate(rows):
            groups.setdefault(_key(row.get(key)), []).append(r)
        if len(groups) > 1:
            return _differs(rows, key, list(groups.values()), what)
    return None


def rank_clash(ranks: Sequence[Any], what: str = "Loader") -> str | None:
    """The message when the ranks given to the loaders are not each of 0 … W-1 once, else None.

    rank_clash([0, 0]) names ranks 0 and 1 both given rank=0
    """
    world = len(ranks)
    if sorted(ranks) == list(range(world)):
        return None
    seen: dict[Any, list[int]] = {}
    for process, r in enumerate(ranks):
        seen.setdefault(r, []).append(process)
    given, who = next((r, p) for r, p in seen.items()
                      if len(p) > 1 or not (isinstance(r, int) and 0 <= r < world))
    if len(who) > 1:
        said = f"ranks {_listed(who)} {'all' if len(who) > 2 else 'both'} made their {what}"
    else:
        said = f"rank {who[0]} made its {what}"
    missing = sorted(set(range(world)) - set(seen))
    unread = f", and no rank reads the slice of rank={_listed(missing)}" if missing else ""
    return (f"{said} with rank={given!r} (world_size={world}){unread}: give each process its own "
            "rank (torch.distributed.get_rank() or jax.process_index()), or leave rank and "
            "world_size out to take them from torch.distributed")


def _differs(rows: Sequence[Mapping[str, Any]], key: str, groups: list[list[int]],
             what: str) -> str:
    """The line for setting ``key`` differing across ``groups`` of ranks: the largest group
    (ties: the one holding the lowest rank) is the reference, the first rank outside it named."""
    reference = max(groups, key=lambda g: (len(g), -g[0]))
    odd = sorted(r for g in groups if g is not reference for r in g)
    ref = reference[0]
    also = f" (ranks differing from rank {ref}: {_listed(odd)})" if len(odd) > 1 else ""
    hint = HINTS.get(key, f"use the same {key} on every rank: {SAME}")
    return (f"ranks disagree: rank {odd[0]}'s {what} has {key}={rows[odd[0]].get(key)!r} "
            f"where rank {ref}'s has {key}={rows[ref].get(key)!r}{also}; {hint}")


def _listed(ranks: Sequence[int]) -> str:
    """``0, 1, 2`` — the first few, then how many more."""
    shown = ", ".join(map(str, ranks[:SHOWN_RANKS]))
    more = len(ranks) - SHOWN_RANKS
    return shown + (f" and {more:,} more" if more > 0 else "")


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=repr)


class CheckedFirst:
    """``batches``, after ``check()`` has run at the first ``next()``: where every rank is,
    whatever the pass holds; a refusal is raised again at every later ``next()``."""

    __slots__ = ("check", "batches", "error")

    def __init__(self, check: Callable[[], None], batches: Iterator):
        self.check: Callable[[], None] | None = check
        self.batches, self.error = batches, None

    def __iter__(self) -> CheckedFirst:
        return self

    def __next__(self):
        if self.check is not None:
            check, self.check = self.check, None
            try:
                check()
            except ConfigError as e:
                self.error = e
        if self.error is not None:
            raise self.error
        return next(self.batches)

    def close(self) -> None:
        """Close ``batches`` (a generator's ``finally`` cancels what it took ahead)."""
        close = getattr(self.batches, "close", None)
        if close is not None:
            close()
