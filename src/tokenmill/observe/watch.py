"""The stall across ranks: which rank is slowest, in which stage; and a Chrome trace of the loop.

Wrap the training loop's batches on every rank::

    for batch in Watch(loader, every=50, trace="trace-{rank}.json"):
        step(batch)

Every ``every`` steps each rank contributes its seconds per stage over the window ("data wait"
in ``next()``, "step" between batches, and the loader's own ``stage_times()`` such as
"assemble") to one small ``torch.distributed.all_gather_object``; the rank and stage furthest
above that stage's median across ranks is named (``watch.last``, and a line to ``log``). In
data-parallel training a slow rank makes the others wait inside their step's all-reduce, so
their *step* times even out: the excess over the median, per stage, is what points at the cause.
Without an initialised process group there is one rank. torch is never imported here.

``trace=`` writes the Chrome trace event format (``{"traceEvents": [...]}``, one ``pid`` per
rank; open it in Perfetto or chrome://tracing) when the loop ends or ``close()`` is called: on
the loop's thread (tid 0) "data wait" (in ``next()``) and "step" spans, and inside each data wait
the stages the iterable reports through ``record_spans`` (a Loader's "plan", "gather", "wait";
``to_torch``'s "device copy"); stages run by a worker thread go on that thread's own row.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tokenmill.base.errors import check_int
from tokenmill.base.io import atomic_write_bytes
from tokenmill.load.ranks import torch_dist

__all__ = ["Watch", "slowest"]


def slowest(ranks: list[dict[str, float]], *, floor_s: float = 1e-3) -> dict[str, Any]:
    """The (rank, stage) furthest above that stage's median across ranks: data stages (data
    wait, the loader's stages) first — synchronised steps even out, data wait does not — and
    "step" only when no data stage stands out by ``floor_s``.

    slowest([{"data wait": 0.1, "step": 1.0}, {"data wait": 0.9, "step": 1.0}])["rank"] == 1
    """
    stages = sorted({k for r in ranks for k in r})
    for group in ([k for k in stages if k != "step"], ["step"]):
        best = {"rank": 0, "stage": None, "seconds": 0.0, "median_s": 0.0, "excess_s": 0.0}
        for stage in group:
            values = [r.get(stage, 0.0) for r in ranks]
            med = statistics.median(values)
            for rank, v in enumerate(values):
                if v - med > best["excess_s"]:
                    best = {"rank": rank, "stage": stage, "seconds": v, "median_s": med,
                            "excess_s": v - med}
        if best["excess_s"] >= floor_s:
            return best
    return best


class Watch:
    """Batches of ``iterable``, timed per stage; every ``every`` steps, the slowest rank named."""

    def __init__(self, iterable: Iterable, *, every: int = 50, trace: str | None = None,
                 log: Callable[[str], Any] | None = print):
        every = check_int("every", every, minimum=1)
        self.source, self._it, self.every, self._log = iterable, iter(iterable), every, log
        dist = torch_dist()
        self.rank = dist.get_rank() if dist else 0
        self.trace = None if trace is None else Path(str(trace).format(rank=self.rank))
        self.events: list[dict] = []
        self.last: dict[str, Any] | None = None
        self.steps = 0
        self._window: dict[str, float] = {}
        self._stages = getattr(iterable, "stage_times", None)
        self._stage_base = dict(self._stages()) if callable(self._stages) else {}
        self._last_end: float | None = None
        self._t0 = time.perf_counter()
        self._threads = {threading.get_ident(): 0}  # thread → tid in the trace (1: all_gather)
        self._record = getattr(iterable, "record_spans", None)
        if self.trace is not None and callable(self._record):
            self._record(self._stage_span)

    def __iter__(self) -> Watch:
        return self

    def _span(self, name: str, start: float, end: float) -> None:
        self._window[name] = self._window.get(name, 0.0) + end - start
        if self.trace is not None:
            self.events.append({"name": name, "ph": "X", "pid": self.rank, "tid": 0,
                                "ts": (start - self._t0) * 1e6, "dur": (end - start) * 1e6})

    def _stage_span(self, name: str, start: float, end: float) -> None:
        """A stage the iterable reports (from any thread): a trace span on that thread's row."""
        ident = threading.get_ident()
        tid = self._threads.get(ident)
        if tid is None:
            tid = self._threads.setdefault(ident, len(self._threads) + 1)
        self.events.append({"name": name, "ph": "X", "pid": self.rank, "tid": tid,
                            "ts": (start - self._t0) * 1e6, "dur": (end - start) * 1e6})

    def __next__(self):
        t0 = time.perf_counter()
        if self._last_end is not None:
            self._span("step", self._last_end, t0)
            self.steps += 1
            if self.steps % self.every == 0:
                self._compare()
                t0 = time.perf_counter()
        try:
            batch = next(self._it)
        except StopIteration:
            self.close()
            raise
        self._last_end = time.perf_counter()
        self._span("data wait", t0, self._last_end)
        return batch

    def _compare(self) -> None:
        """One all-gather of this window's seconds per stage; names the straggler."""
        start = time.perf_counter()
        mine = dict(self._window)
        if callable(self._stages):
            now = dict(self._stages())
            mine.update({k: v - self._stage_base.get(k, 0.0) for k, v in now.items()})
            self._stage_base = now
        dist = torch_dist()
        ranks = [mine]
        if dist is not None:
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        self.last = {**slowest(ranks), "step": self.steps, "ranks": ranks}
        self._window = {}
        if self._log is not None and self.rank == 0:
            s = self.last
            self._log(f"step {self.steps}: slowest rank {s['rank']} in {s['stage']}: "
                      f"{s['seconds'] * 1e3:,.1f} ms over {self.every} steps (median of ranks "
                      f"{s['median_s'] * 1e3:,.1f} ms)")
        if self.trace is not None:
            self.events.append({"name": "all_gather", "ph": "X", "pid": self.rank, "tid": 1,
                                "ts": (start - self._t0) * 1e6,
                                "dur": (time.perf_counter() - start) * 1e6})

    def close(self) -> None:
        """Stop the iterable's stage spans and write the trace (if asked); idempotent."""
        if self.trace is not None and callable(self._record):
            self._record(None)
        if self.trace is not None and self.events:
            meta = [{"name": "process_name", "ph": "M", "pid": self.rank,
                     "args": {"name": f"rank {self.rank}"}}]
            names = {0: "training loop", 1: "all_gather"}
            meta += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": t,
                      "args": {"name": names.get(t, f"loader worker {t - 1}")}}
                     for t in sorted({*self._threads.values(), 1})]
            atomic_write_bytes(self.trace, json.dumps({"traceEvents": [*meta, *self.events]}).encode())

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
