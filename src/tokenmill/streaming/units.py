"""The pass's work units, tokenized ahead by prepare's worker pool, handed back in unit order.

The workers are ``prepare.pool.UnitPool``'s (``procs.Worker``: ``python -m tokenmill.base.child``, so
they never re-run the user's main module); ``UnitResults`` drives that pool by hand, keeping
``UNITS_PER_WORKER`` units per worker in flight past the one waited for, and returns results
strictly in unit order — the token stream is the one ``prepare`` writes, for any worker count.
The bytes of compressed inputs are read by this process as streams (``sources.unit_payloads``)
and sent with their units. With ``num_workers=0`` units are tokenized in the caller's thread.

    units = UnitResults(plan, tokenizer, first=0, stop=threading.Event(), stats=stats)
    units.result(0).tokens      # unit 0's tokens; a worker's exception is raised here
    units.close()

A worker's exception is raised at ``result`` with its traceback as the cause; a worker that dies
is a ``WorkerError`` naming its exit reason, as soon as its connection closes.
"""

from __future__ import annotations

import threading
import time

from tokenmill.inputs import sources
from tokenmill.prepare.pool import UNITS_PER_WORKER, Advice, UnitPool
from tokenmill.prepare.tokenize import UnitResult, tokenize_unit
from tokenmill.streaming.plan import StreamPlan
from tokenmill.tokenizer import Tokenizer

POLL_S = 0.1  # how often a wait checks that the loader is not closing
STREAMING_ADVICE = Advice(
    killed="the loader cannot continue; create it again (it resumes from its state_dict)",
    crashed="the loader cannot continue, and creating it again would fail the same way; the "
            "worker's stderr above says why")


class Stopped(Exception):
    """The loader is closing: unwind the producer thread quietly."""


class UnitResults:
    """Units tokenized ahead by worker processes (or inline), handed back in unit order."""

    def __init__(self, plan: StreamPlan, tokenizer: Tokenizer, *, first: int,
                 stop: threading.Event, stats: dict):
        self.plan, self.tok, self.stop, self.stats = plan, tokenizer, stop, stats
        self.asked = first  # the next unit result() is asked for: units come strictly in order
        self.sent = first  # the next unit to send to the pool
        self.payloads = sources.unit_payloads(plan.units, first,
                                              plan.config.source_config(plan.storage_options))
        self.pool = (UnitPool(plan.num_workers, plan.config, plan.storage_options,
                              name="streaming", advice=STREAMING_ADVICE)
                     if plan.num_workers else None)

    def result(self, u: int) -> UnitResult:
        """Unit u's tokens; a worker's exception is raised here."""
        assert u == self.asked, f"units are read in order: asked for {u}, expected {self.asked}"
        self.asked += 1
        plan = self.plan
        if self.pool is None:
            t0 = time.perf_counter()
            res = tokenize_unit(plan.units[u], plan.config, plan.storage_options, self.tok,
                                next(self.payloads))
            self.stats["tokenization"] += time.perf_counter() - t0
            return res
        last = min(len(plan.units), u + 1 + UNITS_PER_WORKER * plan.num_workers)
        while self.sent < last:
            self.pool.submit(self.sent, plan.units[self.sent], next(self.payloads))
            self.sent += 1
        while (done := self.pool.wait(u, timeout=POLL_S)) is None:
            if self.stop.is_set():
                raise Stopped
        self.stats["tokenization"] += done.seconds
        return done.result

    def close(self) -> None:
        """Stop the workers (they hold no state worth waiting for) and the payload reader."""
        if self.pool is not None:
            self.pool.close()
        self.payloads.close()
